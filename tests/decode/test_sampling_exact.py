"""Exact laws, no sampling noise: the sampling primitives in every dtype, and rejection_walk.

1. Primitives (``logits_to_probs``, the inverse-CDF ``_sample``, ``_residual``, ``without``) on
   bf16 / fp16 / fp32 inputs over SmolLM2's 49,152-token vocabulary. The law of ``_sample`` is
   read off the function itself: it is monotone in its uniform, so the first uniform at which
   it reaches each token is found by bisection (60 halvings: 1e-18), and the law is the gaps.
   Against the float64 law of the same inputs the total variation must be < 1e-6 (a bf16 CDF
   was at 0.31 from it at T=1).
2. ``rejection_walk`` itself, enumerated: its acceptance coins become two weighted branches
   (weight a and 1 - a, a = min(1, p/q)) and its final draw records the residual law it draws
   from, so the emitted law of one step is computed exactly; the drafted tree is enumerated
   too (siblings sampled without replacement, with their exact probabilities). Together with
   the exact continuation under the target, the law of the first 4 tokens must equal the
   target's to 1e-12, and each deliberately broken helper must move it by more than 1e-4.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.sampling import logits_to_probs, rejection_walk

F64 = torch.float64
VOCAB = 49_152  # SmolLM2's
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def lm_logits(seed: int, dtype: torch.dtype, scale: float = 2.5) -> torch.Tensor:
    """(V,) logits shaped like a language model's: a few strong tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(VOCAB, generator=g, dtype=F64)
    logits[torch.randint(0, VOCAB, (5,), generator=g)] += 8.0
    return logits.to(dtype)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The verifier's law written independently in numpy float64: softmax(logits.double() / T)
    after HF's top-k and top-p (keep a token iff the mass of the more likely tokens < top_p; ties kept)."""
    x = logits.double().numpy() / temperature
    if 0 < top_k < x.size:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        values, counts = np.unique(p, return_counts=True)  # ascending distinct probabilities
        above = np.cumsum((values * counts)[::-1])[::-1] - values * counts  # mass strictly more likely
        keep = np.isin(p, values[above < top_p]) | (p == p.max())
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return torch.from_numpy(p)


def sampler_law(p: torch.Tensor) -> torch.Tensor:
    """The exact law of ``_sample(p, u)``, u ~ U[0, 1): the gaps between the first uniforms at
    which the draw reaches each token, found by a vectorised bisection over all tokens."""
    n = p.numel()
    target = torch.arange(1, n, dtype=torch.long)  # (V-1,) the draw reaches token j at b_j
    lo, hi = torch.zeros(n - 1, dtype=F64), torch.ones(n - 1, dtype=F64)
    for _ in range(60):
        mid = (lo + hi) / 2
        reached = sampling._sample(p, mid) >= target
        hi, lo = torch.where(reached, mid, hi), torch.where(reached, lo, mid)
    grid = torch.linspace(0, 1 - 1e-12, 4097, dtype=F64)
    assert bool((sampling._sample(p, grid).diff() >= 0).all()), "the inverse-CDF draw is not monotone"
    bounds = torch.cat([torch.zeros(1, dtype=F64), hi, torch.ones(1, dtype=F64)])  # (V+1,)
    return bounds.diff()  # (V,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 50, 0.95), (1.3, 0, 0.9)])
def test_verifier_law_from_low_precision_logits_is_exact(dtype, temperature, top_k, top_p):
    """logits_to_probs then the inverse-CDF draw: the law of one sampled token is the float64
    law of the verifier's own logits in its dtype."""
    logits = lm_logits(1, dtype)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == F64
    want = reference_probs(logits, temperature, top_k, top_p)
    assert tv(probs, want) < 1e-12
    assert tv(sampler_law(probs), want) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_primitives_compute_in_float64_whatever_the_input_dtype(dtype):
    """Probabilities handed over in a low dtype (values exactly representable there): the draw,
    the residual norm((p - q)+) and q without drawn tokens follow the float64 law of those values."""
    p = torch.softmax(lm_logits(2, F64), -1).to(dtype)  # (V,)
    q = torch.softmax(lm_logits(3, F64, scale=2.0), -1).to(dtype)  # (V,)
    p64, q64 = p.double(), q.double()
    assert tv(sampler_law(p), p64 / p64.sum()) < 1e-6

    residual = (p64 - q64).clamp(min=0)
    residual /= residual.sum()
    got = sampling._residual(p, q)
    assert got.dtype == F64 and tv(got, residual) < 1e-12
    assert tv(sampler_law(got), residual) < 1e-6

    removed = torch.topk(q64, 3).indices.tolist()
    rest = q64.clone()
    rest[removed] = 0
    rest /= rest.sum()
    got = sampling.without(q, removed)
    assert got.dtype == F64 and tv(got, rest) < 1e-12 and float(got[removed].sum()) == 0.0


def test_sampling_without_a_generator_uses_the_default_one():
    probs = logits_to_probs(lm_logits(4, torch.bfloat16), 1.0)
    torch.manual_seed(5)
    first = [sampling.sample(probs) for _ in range(5)]
    torch.manual_seed(5)
    assert [sampling.sample(probs, None) for _ in range(5)] == first
    tokens, parents = torch.tensor([0, 1]), torch.tensor([-1, 0])
    assert rejection_walk(tokens, parents, probs.expand(2, -1), None, None, None)[1] in range(VOCAB)


# --- rejection_walk, enumerated ---------------------------------------------------------------

V = 5
M = 4  # tokens of the law compared: up to 3 accepted drafts + the next token
PRE, ROOT = 2, 4


def tables(temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed target P[pos, prev, last] (M, V, V, V) and draft Q[pos, last] (M, V, V): the
    target sees two tokens, the draft one, at another scale and with its own noise."""
    g = torch.Generator().manual_seed(7)
    base = torch.tensor([2.0, 1.6, 1.1, -0.5, -1.5], dtype=F64)[torch.rand(M, V, V, generator=g).argsort(-1)]
    target = base[:, None] + 0.8 * torch.randn(M, V, V, V, dtype=F64, generator=g)
    draft = 0.6 * base + 1.2 * torch.randn(M, V, V, dtype=F64, generator=g)
    return logits_to_probs(target, temperature, top_k, top_p), logits_to_probs(draft, temperature, top_k, top_p)


def target_law(P: torch.Tensor) -> dict[tuple, float]:
    """Exact law of the first M tokens after [PRE, ROOT] under P."""
    law = {}
    for seq in itertools.product(range(V), repeat=M):
        ctx, w = [PRE, ROOT], 1.0
        for pos, x in enumerate(seq):
            w *= float(P[pos, ctx[-2], ctx[-1], x])
            ctx.append(x)
        if w > 0:
            law[seq] = w
    return law


def complete(law: dict, prefix: list[int], weight: float, P: torch.Tensor) -> None:
    """Add weight x the target law of the rest of a length-M sequence after ``prefix``."""
    if weight == 0:
        return
    if len(prefix) == M:
        law[tuple(prefix)] += weight
        return
    ctx = [PRE, ROOT] + prefix
    row = P[len(prefix), ctx[-2], ctx[-1]].tolist()
    for x, px in enumerate(row):
        complete(law, prefix + [x], weight * px, P)


def ordered_draws(q: torch.Tensor, width: int):
    """Every ordered draw of up to `width` distinct tokens from q without replacement (stopping
    when q has no mass left), with its probability: the drafter's law of a sibling list."""
    def rec(drawn: list[int], prob: float):
        rest = q.clone()
        rest[drawn] = 0
        if len(drawn) == width or not float(rest.sum()) > 0:
            yield drawn, prob
            return
        rest /= rest.sum()
        for x in rest.nonzero().flatten().tolist():
            yield from rec(drawn + [x], prob * float(rest[x]))
    yield from rec([], 1.0)


def drafted_trees(P: torch.Tensor, Q: torch.Tensor):
    """Every tree the test's drafter can build, with its probability. Depth 1: up to 3 siblings
    SAMPLED from q at the root (top-k 3 exhausts q); depth 2: DETERMINISTIC top-2 under the
    first depth-1 node, top-1 under the others; depth 3: 2 siblings SAMPLED under the first
    depth-2 node. Yields (tokens, parents, sampled, draft_probs, target_probs, prob)."""
    ranked = torch.sort(Q, dim=-1, descending=True, stable=True).indices  # (M, V, V)
    for level1, p1 in ordered_draws(Q[0, ROOT], 3):
        tokens, parents, depth = [ROOT] + level1, [-1] + [0] * len(level1), [0] + [1] * len(level1)
        for j, u in enumerate(range(1, len(level1) + 1)):
            for r in range(2 if j == 0 else 1):
                tokens.append(int(ranked[1, tokens[u], r]))
                parents.append(u)
                depth.append(2)
        first_l2 = depth.index(2)
        for level3, p3 in ordered_draws(Q[2, tokens[first_l2]], 2):
            t = tokens + level3
            par = parents + [first_l2] * len(level3)
            dep = depth + [3] * len(level3)
            n = len(t)
            sampled = torch.zeros(n, dtype=torch.bool)
            sampled[0] = sampled[first_l2] = True
            draft_probs = torch.stack([Q[dep[i], t[i]] for i in range(n)])  # (n, V)
            prev = [PRE] + [t[par[i]] for i in range(1, n)]
            target_probs = torch.stack([P[dep[i], prev[i], t[i]] for i in range(n)])  # (n, V)
            yield torch.tensor(t), torch.tensor(par), sampled, draft_probs, target_probs, p1 * p3


class Branches:
    """Stands in for the walk's uniforms: each acceptance coin follows a script of decisions
    (extended with 'accept' where the script ends, the other branch remembered for later),
    and the final inverse-CDF draw records the law it would draw from."""

    def __init__(self, script: list[bool]):
        self.script, self.i, self.weight = list(script), 0, 1.0
        self.pending: list[list[bool]] = []
        self.final: torch.Tensor | None = None

    def accept(self, u, p_x: float, q_x: float) -> bool:
        a = min(max(sampling._accept_prob(p_x, q_x), 0.0), 1.0)
        if self.i == len(self.script):  # a new coin: take one branch now, queue the other
            choice = a > 0
            if (1 - a if choice else a) > 0:
                self.pending.append(self.script + [not choice])
            self.script.append(choice)
        choice = self.script[self.i]
        self.i += 1
        self.weight *= a if choice else 1 - a
        return choice

    def draw(self, p, u) -> int:
        self.final = p.double().clone()
        return -1


@contextlib.contextmanager
def uniforms_replaced_by(branches: Branches):
    """rejection_walk with its uniforms replaced by the branches' weights (restored after)."""
    saved = {name: getattr(sampling, name) for name in ("_uniforms", "_accept", "_sample")}
    sampling._uniforms = lambda n, generator, device: [None] * n
    sampling._accept, sampling._sample = branches.accept, branches.draw
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(sampling, name, value)


def walk_law(tree) -> list[tuple[list[int], float, torch.Tensor]]:
    """Every outcome of rejection_walk on one tree: (path, probability, law of next token)."""
    tokens, parents, sampled, draft_probs, target_probs, _ = tree
    outcomes, stack = [], [[]]
    while stack:
        branches = Branches(stack.pop())
        with uniforms_replaced_by(branches):
            path, _ = rejection_walk(tokens, parents, target_probs, draft_probs, sampled, None)
        stack += branches.pending
        outcomes.append((path, branches.weight, branches.final))
    return outcomes


def one_step_law(P, Q, events=None) -> dict[tuple, float]:
    """Exact law of the first M tokens: draft a tree, walk it, continue under the target."""
    law = defaultdict(float)
    for tree in drafted_trees(P, Q):
        tokens, parents, sampled, *_, tree_prob = tree
        for path, weight, final in walk_law(tree):
            accepted = tokens[path[1:]].tolist()
            w = tree_prob * weight
            if events is not None:
                record_events(events, path, parents, sampled, w)
            for x, px in enumerate(final.tolist()):
                complete(law, (accepted + [x])[:M], w * px, P)
    return law


def record_events(events: dict, path: list[int], parents: torch.Tensor, sampled: torch.Tensor, w: float) -> None:
    """Probability mass of the branches the test must exercise."""
    par = parents.tolist()
    siblings = {c: [i for i in range(1, len(par)) if par[i] == par[c]] for c in path[1:]}
    for c in path[1:]:
        kind = "sampled" if bool(sampled[par[c]]) else "deterministic"
        if siblings[c].index(c) > 0:
            events[f"later {kind} sibling accepted"] += w
    events[f"depth {len(path) - 1} reached"] += w
    if len(path) == 1 and len([i for i in par if i == 0]) == 3:
        events["3 root siblings all rejected"] += w


def law_tv(law: dict, want: dict) -> float:
    keys = set(law) | set(want)
    return 0.5 * sum(abs(law.get(k, 0.0) - want.get(k, 0.0)) for k in keys)


SETTINGS = [(1.0, 3, 1.0), (1.0, 0, 0.9)]  # (temperature, top_k, top_p) for p and q alike


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_rejection_walk_law_is_exact(temperature, top_k, top_p):
    P, Q = tables(temperature, top_k, top_p)
    events = defaultdict(float)
    law = one_step_law(P, Q, events)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert law_tv(law, target_law(P)) < 1e-12
    # every kind of branch carries real probability: the law above is not a trivial one
    for event in ["later sampled sibling accepted", "later deterministic sibling accepted", "depth 3 reached",
                  "depth 0 reached"]:
        assert events[event] > 1e-3, (event, dict(events))
    if top_k == 3:
        assert events["3 root siblings all rejected"] > 1e-3, dict(events)  # q runs out under top-k


def residual_not_updated(p, q):
    return p.double()  # broken: after a rejection, keep p instead of norm((p - q)+)


def q_not_renormalised(q, removed):
    q = q.double().clone()
    q[removed] = 0.0  # broken: the tried tokens are removed but q is not renormalised
    return q if float(q.sum()) > 0 else None


CORRECT_WITHOUT = sampling.without


def q_from_original_law(q, removed):
    return CORRECT_WITHOUT(q, removed[-1:])  # broken: from the original q, only the last tried token removed


@pytest.mark.parametrize("helper, broken", [("_residual", residual_not_updated), ("without", q_not_renormalised),
                                            ("without", q_from_original_law)],
                         ids=["residual-not-updated", "q-not-renormalised", "q-from-original-law"])
def test_broken_helpers_move_the_law(monkeypatch, helper, broken):
    """The same enumeration sees each known bug: the exact test has teeth. (Top-k 3: the root
    has three sampled siblings, so a third one is drawn after two rejections.)"""
    P, Q = tables(*SETTINGS[0])
    want = target_law(P)
    monkeypatch.setattr(sampling, helper, broken)
    assert law_tv(one_step_law(P, Q), want) > 1e-4
