"""EAGLE on the real offline verifier, SmolLM2-135M-Instruct: a few training steps of EAGLE-1 and
EAGLE-3 (fused layers, reduced draft vocabulary), then greedy decoding through the engine with a
chain, a static tree and an EAGLE-2 dynamic tree, token for token against the verifier's own
`generate` in fp32 (a divergence must be a numerical tie, top-2 logit gap < 1e-4)."""
import pytest
import torch

from draftsmith.decode.engine import generate
from draftsmith.decode.harness import compare_greedy, prompt_ids
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.verifier import load_verifier
from draftsmith.train.eagle import run
from tests.hub import compose_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def verifier():
    v = load_verifier(compose_config("eagle").model)  # the default cache (converts once if needed)
    assert v.config.num_hidden_layers == 30 and v.config.vocab_size == 49152
    return v


@pytest.fixture(scope="module")
def drafters(verifier, tmp_path_factory):
    out = {}
    for method, extra in [("eagle1", []), ("eagle3", ["method.draft_vocab_size=4096"])]:
        folder = tmp_path_factory.mktemp(method)
        summary = run(compose_config("eagle", ["data=tiny", "trainer=debug", "trainer.max_steps=6",
                                               "trainer.batch_size=4", "logger=none", f"method={method}",
                                               "method.eval_steps=2", f"output_dir={folder}", *extra]))
        assert summary["steps"] == 6
        _, drafter, config, meta = load_drafter(summary["drafter_dir"], verifier_fingerprint=verifier.fingerprint)
        assert meta["verifier_name"] == "smollm2-135m"
        if method == "eagle3":
            assert config.fusion_layers == [1, 14, 26] and drafter.d2t.numel() == 4096
        out[method] = drafter.eval()
    return out


TREES = {"chain": dict(paths=[(0,), (0, 0), (0, 0, 0)]),
         "static": dict(paths=[(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]),
         "dynamic": dict(depth=4, top_k=3, total_tokens=10)}


@pytest.mark.parametrize("method, tree", [("eagle1", "chain"), ("eagle1", "dynamic"), ("eagle3", "static"),
                                          ("eagle3", "dynamic")])
def test_greedy_eagle_matches_verifier_generate(verifier, drafters, method, tree):
    model, tok = verifier.model, verifier.tokenizer
    proposer = make_proposer("eagle", drafter=drafters[method], embed_tokens=verifier.embed_tokens,
                             lm_head=verifier.lm_head, **TREES[tree])
    steps = []
    for question in ["What is the capital of France?", "Write a haiku about the sea."]:
        ids = prompt_ids(tok, [{"role": "user", "content": question}])
        ours = generate(model, ids, proposer=proposer, max_new_tokens=32)
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        ref = ref[0, ids.shape[1]:].tolist()
        check = compare_greedy(model, ids[0].tolist(), ours.tokens, ref, tol=1e-4)
        assert check["identical"] or check.get("tie"), (question, check)
        steps += ours.steps
    print(f"{method} {tree}: tau {sum(s.emitted for s in steps) / len(steps):.2f}")
