import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models.exports import LAYERS
from tests.tiny import save_tiny_verifier


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A tiny random Llama with 4 layers + the char tokenizer, saved (fp32) as an HF folder."""
    return save_tiny_verifier(tmp_path_factory.mktemp("verifier4"), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def verifier(verifier_dir):
    """The saved verifier in fp64 (the exported lm_head rows are its fp32 weights, exactly)."""
    return AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float64).eval().requires_grad_(False)
