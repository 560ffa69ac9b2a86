"""The law helpers every losslessness test shares: the references a decode is compared with.

- greedy: ``reference`` is HF ``generate`` on the prompt alone;
- sampling: ``exact_law`` enumerates the verifier's own law of the first 3 tokens over a V = 8
  vocabulary (``law_model``), ``engine_counts`` samples the engine, and ``law_test`` /
  ``tv_bound`` judge the counts (chi-square and a TV bound scaled to the sample size);
  ``smoke_counts`` is the short run of the same engine path for the cases whose law the enumeration
  of test_sampling_exact.py and one full Monte Carlo case per proposer file already prove;
  ``pit_values`` turns longer sampled rows into uniforms (probability-integral transform);
- teeth: ``residual_from_p_walk`` is an acceptance rule broken on purpose, and the recorders
  prove which paths and trees a test really exercised.
"""
from __future__ import annotations

from pathlib import Path

import torch
import yaml
from scipy.stats import chisquare
from transformers import DynamicCache

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate
from tests.tiny import tiny_llama

DECODE_CONF = Path(__file__).resolve().parents[1] / "conf" / "decode"
V = 8  # vocabulary of the law tests: V**3 = 512 cells for the first 3 tokens
LAW_PROMPT = torch.tensor([[1, 5, 2]])


def tree_paths(name: str) -> list[list[int]]:
    """The `paths` of a conf/decode preset."""
    return yaml.safe_load((DECODE_CONF / f"{name}.yaml").read_text())["paths"]


def prompt(seed: int, length: int = 5) -> torch.Tensor:
    """(1, length) random ids in 4..99 (printable characters of the tiny tokenizer)."""
    return torch.randint(4, 100, (1, length), generator=torch.Generator().manual_seed(seed))


def reference(model, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> list[int]:
    """HF greedy ``generate`` on ids (1, T) alone: the new tokens."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=1,
                             max_new_tokens=max_new_tokens, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def assert_cache_is_prefill(model, cache: DynamicCache, tokens: list[int]) -> None:
    """Every layer's keys/values equal those of one fresh forward over ``tokens`` (a draft model's cache)."""
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        model.get_decoder()(input_ids=torch.tensor([tokens]), cache=fresh, use_cache=True)
    assert cache.get_seq_length() == len(tokens)
    for got, want in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-10)


def law_model(logit_scale: float):
    """A 2-layer fp64 Llama over 8 tokens whose logits are scaled up so the law is peaked
    (a near-uniform law would hide a wrong rule and make the TV bound pure noise)."""
    model = tiny_llama(vocab_size=V, eos_token_id=None, pad_token_id=None, seed=3)
    model.lm_head.weight.data *= logit_scale
    return model


def exact_law(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(V**3,) law of the first 3 new tokens after LAW_PROMPT, from the model's own conditionals (no cache)."""
    prefixes = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2)
    seqs = torch.cat([LAW_PROMPT.expand(V * V, -1), prefixes], dim=1).to(model.device)  # (V*V, T+2)
    t = LAW_PROMPT.shape[1]
    with torch.no_grad():
        logits = model(input_ids=seqs).logits[:, t - 1 : t + 2]  # (V*V, 3, V)
    probs = sampling.logits_to_probs(logits, temperature, top_k, top_p)  # (V*V, 3, V)
    p1 = probs[0, 0]  # (V,)
    p2 = probs[::V, 1]  # (V, V): [a] -> law of the 2nd token after a
    p3 = probs[:, 2].reshape(V, V, V)  # [a, b] -> law of the 3rd token
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def engine_counts(model, proposer, n, temperature, top_k, top_p, seed) -> torch.Tensor:
    """(V**3,) counts of the first 3 tokens of n seeded engine generations after LAW_PROMPT."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V**3, dtype=torch.float64)
    for _ in range(n):
        a, b, c = generate(model, LAW_PROMPT, proposer=proposer, max_new_tokens=3, temperature=temperature,
                           top_k=top_k, top_p=top_p, generator=g, eos_token_id=()).tokens
        assert 0 <= min(a, b, c) and max(a, b, c) < V, (a, b, c)  # valid tokens (an index past V would alias)
        counts[(a * V + b) * V + c] += 1
    return counts


def assert_engine_law(model, proposer, n, temperature, top_k, top_p, seed: int = 1) -> tuple[float, float]:
    """The full Monte Carlo law test: n seeded engine generations follow the verifier's exact law
    (nothing on a law-0 sequence, chi-square p > 1e-3, TV under tv_bound(law, n)). -> (p, TV)."""
    law = exact_law(model, temperature, top_k, top_p)
    pvalue, tv, impossible = law_test(engine_counts(model, proposer, n, temperature, top_k, top_p, seed), law)
    assert impossible == 0.0, "sampled a sequence the verifier's law gives probability 0"
    bound = tv_bound(law, n)
    assert pvalue > 1e-3, (pvalue, tv, bound)
    assert tv < bound, (pvalue, tv, bound)
    return pvalue, tv


SMOKE_SAMPLES = 48  # a smoke run: seconds, not tens of seconds


def smoke_counts(model, proposer, temperature, top_k, top_p, n: int = SMOKE_SAMPLES, seed: int = 1) -> torch.Tensor:
    """A smoke run of the law test: n seeded engine generations through the same proposer and
    settings, asserting what n samples prove exactly: valid tokens (engine_counts), and no sampled
    sequence that the verifier's exact law gives probability 0 (law_test's impossible mass). The
    law itself is proven by the enumeration of test_sampling_exact.py and by the one full Monte
    Carlo case of each proposer file; the caller asserts the code paths its case exists for."""
    law = exact_law(model, temperature, top_k, top_p)
    counts = engine_counts(model, proposer, n, temperature, top_k, top_p, seed)
    impossible = float(counts[law == 0].sum() / n)
    assert impossible == 0.0, "sampled a sequence the verifier's law gives probability 0"
    return counts


def sample_case(cases: dict, case: str, setup, monkeypatch, samples: int | None = None):
    """One case of a proposer file's law tests, whose cases end in (temperature, top_k, top_p):
    the full Monte Carlo law with `samples` (assert_engine_law), or a smoke run (smoke_counts).
    -> the recorder of the accepted paths that `setup(case, monkeypatch)` returned."""
    *_, temperature, top_k, top_p = cases[case]
    model, proposer, recorder = setup(case, monkeypatch)
    if samples:
        assert_engine_law(model, proposer, samples, temperature, top_k, top_p)
    else:
        smoke_counts(model, proposer, temperature, top_k, top_p)
    return recorder


def tv_bound(law: torch.Tensor, n: int, reps: int = 200, q: float = 0.99, margin: float = 1.25) -> float:
    """The TV distance that n exact draws from `law` stay below: `margin` times the q-quantile of
    the TV distance between n exact draws and the law, over `reps` simulated samples."""
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(law, n * reps, replacement=True, generator=g).view(reps, n)  # (reps, n)
    counts = torch.zeros(reps, law.numel(), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(reps, n, dtype=torch.float64))  # (reps, cells)
    return margin * float(torch.quantile(0.5 * (counts / n - law).abs().sum(-1), q))


def law_test(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """(chi-square p-value with cells of expected < 5 merged, TV distance, mass on law-0 cells)."""
    n = counts.sum()
    expected = law * n
    impossible = float(counts[law == 0].sum() / n)
    big = expected >= 5
    small = (~big) & (law > 0)
    obs = [*counts[big].tolist(), float(counts[small].sum())]
    exp = [*expected[big].tolist(), float(expected[small].sum())]
    if exp[-1] < 5:  # merge the leftover bucket into the smallest regular cell
        j = min(range(len(exp) - 1), key=exp.__getitem__)
        obs[j] += obs.pop()
        exp[j] += exp.pop()
    exp_total = sum(exp)
    obs_total = sum(obs)
    exp = [e * obs_total / exp_total for e in exp]  # mass outside (impossible cells) is counted apart
    pvalue = float(chisquare(obs, exp).pvalue)
    tv = 0.5 * float((counts / n - law).abs().sum())
    return pvalue, tv, impossible


def pit_values(model, requests, params, seed: int) -> list[float]:
    """u = F(x) + U p(x) of every emitted token under the verifier's law given its prefix: uniform
    on [0, 1] exactly when the rows follow the law (requests: engine requests, params: their sampling)."""
    g = torch.Generator().manual_seed(seed)
    us = []
    for request, p in zip(requests, params):
        ids = torch.tensor([request.prompt + request.out])
        with torch.no_grad():
            logits = model(ids).logits[0, len(request.prompt) - 1: -1]  # (n, V): the law of each emitted token
        probs = sampling.logits_to_probs(logits, p.get("temperature", 1.0), p.get("top_k", 0), p.get("top_p", 1.0))
        for law, x in zip(probs, request.out):
            order = torch.argsort(law, descending=True, stable=True)
            rank = int((order == x).nonzero())
            us.append(float(law[order[:rank]].sum() + torch.rand((), generator=g, dtype=torch.float64) * law[x]))
    return us


class RecordingRule:
    """Wraps an acceptance rule to record the accepted paths (to prove what the test ran)."""

    def __init__(self, rule):
        self.rule, self.paths = rule, []

    def __call__(self, *args, **kwargs):
        path, nxt = self.rule(*args, **kwargs)
        self.paths.append(path)
        return path, nxt


class RecordingProposer:
    """Wraps a proposer; keeps (ids, tree) of every step."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.name, self.feature_layers = inner.name, inner.feature_layers

    def prefill(self, *args, **kwargs):
        self.inner.prefill(*args, **kwargs)

    def accept(self, *args, **kwargs):
        self.inner.accept(*args, **kwargs)

    def propose(self, root, hidden, ids):
        tree = self.inner.propose(root, hidden, ids)
        self.calls.append((list(ids), tree))
        return tree


def children(parents: torch.Tensor) -> list[list[int]]:
    """Each node's children, in node order."""
    plist = parents.tolist()
    kids: list[list[int]] = [[] for _ in plist]
    for c, u in enumerate(plist[1:], start=1):
        kids[u].append(c)
    return kids


def residual_from_p_walk(tokens, parents, target_probs, draft_probs, sampled, generator):
    """BROKEN ON PURPOSE (blatant): after rejecting a deterministic child x it still draws
    from p instead of p with x removed, so drafted tokens are over-represented."""
    kids, tok = children(parents), tokens.tolist()
    path, u = [0], 0
    while True:
        p = target_probs[u]
        for c in kids[u]:
            if torch.rand((), generator=generator, dtype=p.dtype) < p[tok[c]]:
                path.append(c)
                u = c
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
