"""The decoder on the device `device=auto` picks: the first GPU when torch sees one, else the CPU.
On a GPU machine `python -m pytest -q tests/decode/test_device.py` is the device check (greedy
identity with HF `generate` on the same GPU, the exact 3-token law of recursive rejection
sampling drawn with a generator of that device, decode/evaluate.py end to end); on the CPU the
same tests check that the device plumbing (tensors, generators, the report) follows `auto`."""
import pytest
import torch

from draftsmith.decode.engine import generate
from draftsmith.decode.evaluate import run
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.verifier import resolve_device
from tests.conftest import tiny_model_overrides
from tests.drafters import fitted_heads, random_heads
from tests.laws import (LAW_PROMPT, SMOKE_SAMPLES, V, exact_law, law_model, law_test, prompt, reference, tree_paths,
                        tv_bound)
from tests.hub import compose_config
from tests.tiny import save_tiny_medusa, tiny_llama

DEVICE = resolve_device("auto")


@pytest.fixture(scope="module")
def fitted():
    model = tiny_llama(eos_token_id=None)  # fp64: exact argmax on either device
    heads = fitted_heads(model)  # fitted on the CPU, then moved
    return model.to(DEVICE), heads.to(DEVICE)


@pytest.mark.parametrize("method", ["vanilla", "chain4", "medusa-small", "prompt-lookup"])
def test_greedy_identity_on_the_device(fitted, method):
    model, heads = fitted
    draft_free = {"vanilla": None, "prompt-lookup": make_proposer(
        "prompt_lookup", num_tokens=4, max_ngram=3, min_ngram=1, num_matches=2, device=DEVICE)}
    proposer = draft_free[method] if method in draft_free else make_proposer("medusa", heads=heads,
                                                                             paths=tree_paths(method))
    for seed, n in [(100, 40), (101, 40), (102, 7)]:
        ids = prompt(seed).to(DEVICE)
        out = generate(model, ids, proposer=proposer, max_new_tokens=n)
        assert out.tokens == reference(model, ids, max_new_tokens=n), (method, seed)
        assert all(s.verify_s > 0 and s.propose_s >= 0 for s in out.steps)  # clocks read after a synchronize


def test_sampling_law_on_the_device():
    """The tree-T0.7-topp0.9 case of test_engine.test_sampling_law, sampled on the device with a
    generator of that device: on a GPU the float64 law of the first 3 tokens, chi-square and a TV
    bound; on the CPU, where test_engine.test_sampling_law is this very case in full (and the
    enumeration in test_sampling_exact.py proves the rule), a smoke run of the device plumbing:
    valid tokens, and nothing sampled that the verifier's law gives probability 0."""
    full = DEVICE.type != "cpu"
    samples = 4_000 if full else SMOKE_SAMPLES
    model = law_model(10.0).to(DEVICE)
    law = exact_law(model, 0.7, 0, 0.9).cpu()
    proposer = make_proposer("medusa", heads=random_heads(model).to(DEVICE), paths=tree_paths("medusa-small"))
    g = torch.Generator(device=DEVICE).manual_seed(1)
    counts = torch.zeros(V**3, dtype=torch.float64)
    for _ in range(samples):
        a, b, c = generate(model, LAW_PROMPT.to(DEVICE), proposer=proposer, max_new_tokens=3, temperature=0.7,
                           top_p=0.9, generator=g, eos_token_id=()).tokens
        assert 0 <= min(a, b, c) and max(a, b, c) < V, (a, b, c)
        counts[(a * V + b) * V + c] += 1
    assert float(counts[law == 0].sum()) == 0.0, "sampled a sequence the verifier's law gives probability 0"
    if full:
        pvalue, tv, _ = law_test(counts, law)
        assert pvalue > 1e-3 and tv < tv_bound(law, samples), (pvalue, tv)


def test_the_cpu_law_helpers_agree_with_the_device():
    """The same fp64 model gives the same exact law on both devices (the CPU tests' reference), to
    float32 rounding: HF's RMSNorm computes in float32 whatever the model's dtype, and the CPU and
    CUDA round float32 differently. On an H200 (2026-12-04) the laws differed by 1.9e-8; rounding
    the norm in float32 rather than float64 moves this law by 8e-9 on the CPU. A wrong law (another
    temperature, top-p cut or rule) differs by far more than 1e-6."""
    model = law_model(10.0)
    cpu = exact_law(model, 0.7, 0, 0.9)
    there = exact_law(model.to(DEVICE), 0.7, 0, 0.9).cpu()
    assert float((cpu - there).abs().max()) < 1e-6
    assert float((cpu - exact_law(model.cpu(), 0.8, 0, 0.9)).abs().max()) > 1e-3  # the bound can fail


def test_evaluate_decodes_on_the_auto_device(tiny_model_dir, tmp_path):
    drafter = save_tiny_medusa(tmp_path / "drafter")
    cfg = compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=3", "max_new_tokens=12", f"output_dir={tmp_path / 'eval'}",
        f"drafter={drafter}", "decode=medusa-small", "device=auto"])
    report = run(cfg)
    assert report["device"] == str(DEVICE)
    for name in ("vanilla", "medusa", "hf_generate", "hf_prompt_lookup"):
        assert report["methods"][name]["greedy_divergences_unexplained"] == 0, name
