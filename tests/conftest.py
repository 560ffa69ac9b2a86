import os

import pytest

from tests.tiny import save_tiny_verifier, tiny_llama, tiny_tokenizer

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: one core per worker, no oversubscription
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture()
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama + the char tokenizer saved as an HF folder (use as model.path)."""
    return save_tiny_verifier(tmp_path_factory.mktemp("tiny-verifier"))


def tiny_model_overrides(folder) -> list[str]:
    """Hydra overrides that point any main config at the tiny saved verifier."""
    return ["model.name=tiny", "model.source=hf", f"model.path={folder}", "model.dtype=float32"]
