import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models.exports import LAYERS
from tests.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A tiny random Llama with 4 layers + the char tokenizer, saved (fp32) as an HF folder."""
    folder = tmp_path_factory.mktemp("verifier4")
    tiny_llama(dtype=torch.float32, num_hidden_layers=LAYERS).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def verifier(verifier_dir):
    """The saved verifier in fp64 (the exported lm_head rows are its fp32 weights, exactly)."""
    return AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float64).eval().requires_grad_(False)
