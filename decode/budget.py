"""How many draft tokens each row verifies, step by step: the engine's budget policy (engine.budget).

    fixed     every proposer's whole tree, every step (the budget is the tree).
    adaptive  each step, the width W of the step (nodes a drafting row verifies, root included:
              1, 2, 4, 8, ...) and the rows that draft are chosen to maximise the batch's expected
              tokens per second:

        rate(W, D) = sum_b E_b(W if b in D else 1) / (T(B * W) + sum_{b in D} c_b)

        E_b(w)  tokens row b emits when it verifies the first w nodes of its tree:
                1 + sum of P_b(accepted >= d) over the depths d those nodes reach, from the row's
                own history (a prior of `prior` per depth until it has some);
        T(n)    the verifier forward's time for n tokens in the step on this machine: measured at
                start for n = 1, 2, 4, ... (StepCost.calibrate), corrected by every step's own time;
        c_b     the row's proposal time (a running mean of its own).

      W = 1 with no row drafting is plain continuous batching: the proposers do not run and
      nothing is paid beyond a plain step. At low load drafting is nearly free (T barely grows
      with n while decoding is bound by reading the weights) and the whole tree is verified; as
      the batch grows T(B * W) grows with it and the width shrinks; at saturation it is 1.

Choices are counted for /metrics and the benchmarks (``counts``).
"""
from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from draftsmith.models.errors import DraftsmithError, choose


class FixedBudget:
    """Every proposer's whole tree (the budget is the decode preset's)."""

    name = "fixed"

    def __init__(self):
        self.counts: Counter = Counter()  # width -> steps

    def choose(self, rows) -> list[int | None]:
        return [None] * len(rows)

    def observe(self, rows, trees, accepted, tokens: int, seconds: float, propose_s: list[float]) -> None:
        self.counts[max(t.size for t in trees)] += 1


@dataclass
class RowStats:
    """One row's acceptance history and proposal cost."""

    hits: list[float] = field(default_factory=list)  # hits[d-1]: steps that accepted >= d drafted tokens
    tries: list[float] = field(default_factory=list)  # tries[d-1]: steps whose verified tree reached depth d
    depths: list[int] = field(default_factory=list)  # the node depths of its last full proposal
    propose_s: float | None = None  # running mean of its proposal time

    def p_accept(self, depth: int, prior: float, weight: float) -> float:
        """P(accepted >= depth | the tree reaches it), shrunk towards the prior."""
        i = depth - 1
        hits = self.hits[i] if i < len(self.hits) else 0.0
        tries = self.tries[i] if i < len(self.tries) else 0.0
        return (hits + prior * weight) / (tries + weight)

    def expected(self, width: int, prior: float, weight: float) -> float:
        """E[tokens emitted] verifying the first `width` nodes of its tree (1 = the root alone)."""
        depths = self.depths[:width] if self.depths else list(range(width))
        reach = max(depths) if depths else 0
        return 1.0 + sum(self.p_accept(d, prior, weight) for d in range(1, reach + 1))


class StepCost:
    """T(n): seconds of a verifier forward over n tokens, interpolated log-log between measured
    points and scaled by the running ratio of observed to predicted step times."""

    def __init__(self, points: dict[int, float] | None = None):
        self.points = dict(points or {})
        self.scale = 1.0

    def calibrate(self, forward, cache_rows: int, max_tokens: int, repeats: int = 3) -> "StepCost":
        """Time one row's forward of n = 1, 2, 4, ... max_tokens tokens on an empty cache row."""
        device = forward.cache.keys.device
        n = 1
        while n <= max_tokens:
            tokens = torch.zeros(1, n, dtype=torch.long, device=device)
            positions = torch.arange(n, device=device)[None]
            allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
            rows = torch.tensor([cache_rows - 1], device=device)
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                forward(tokens, positions, positions, allowed, rows, n)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            self.points[n] = sorted(times[1:])[len(times[1:]) // 2]
            n *= 2
        return self

    def __call__(self, n: int) -> float:
        if not self.points:
            return float(n)  # uncalibrated: proportional to the tokens
        xs = sorted(self.points)
        if n <= xs[0]:
            return self.scale * self.points[xs[0]]
        if n >= xs[-1]:  # beyond the largest measured: linear in n
            return self.scale * self.points[xs[-1]] * n / xs[-1]
        hi = next(x for x in xs if x >= n)
        lo = max(x for x in xs if x <= n)
        if hi == lo:
            return self.scale * self.points[lo]
        t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return self.scale * math.exp((1 - t) * math.log(self.points[lo]) + t * math.log(self.points[hi]))

    def observe(self, n: int, seconds: float, momentum: float = 0.9) -> None:
        predicted = self(n) / self.scale
        if predicted > 0:
            self.scale = momentum * self.scale + (1 - momentum) * seconds / predicted


class AdaptiveBudget:
    """The load-aware policy (see the module docstring)."""

    name = "adaptive"

    def __init__(self, cost: StepCost | None = None, widths=(1, 2, 4, 8, 16, 32), prior: float = 0.5,
                 prior_weight: float = 2.0):
        self.cost = cost or StepCost()
        self.widths, self.prior, self.weight = tuple(widths), float(prior), float(prior_weight)
        self.stats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.counts: Counter = Counter()  # chosen width -> steps
        self.drafting: Counter = Counter()  # rows that drafted / did not, over all steps

    def _row(self, request) -> RowStats:
        stats = self.stats.get(request)
        if stats is None:
            stats = self.stats[request] = RowStats()
        return stats

    def plan(self, rows) -> tuple[int, list[bool]]:
        """(step width W, which rows draft) maximising expected tokens per second."""
        B = len(rows)
        stats = [self._row(r) for r in rows]
        best = (sum(1.0 for _ in rows) / self.cost(B), 1, [False] * B)  # plain decoding
        for width in self.widths[1:]:
            gains = [(s.expected(width, self.prior, self.weight) - 1.0, s.propose_s or 0.0) for s in stats]
            order = sorted(range(B), key=lambda b: -gains[b][0] / (gains[b][1] + 1e-6))
            draft = [False] * B
            tokens, spent = float(B), self.cost(B * width)
            for b in order:  # add rows by gain per second of proposing while the rate rises
                gain, cost = gains[b]
                if gain <= 0 or (tokens + gain) / (spent + cost) <= tokens / spent:
                    continue
                tokens, spent, draft[b] = tokens + gain, spent + cost, True
            if any(draft) and tokens / spent > best[0]:
                best = (tokens / spent, width, draft)
        return best[1], best[2]

    def choose(self, rows) -> list[int]:
        width, draft = self.plan(rows)
        self.counts[width] += 1
        self.drafting.update(draft)
        return [width - 1 if d else 0 for d in draft]

    def observe(self, rows, trees, accepted, tokens: int, seconds: float, propose_s: list[float]) -> None:
        self.cost.observe(tokens, seconds)
        for request, tree, acc, spent in zip(rows, trees, accepted, propose_s):
            stats = self._row(request)
            if tree.size == 1:
                continue  # a plain step says nothing about the drafts
            depths = (tree.buffers.depths if tree.buffers is not None else _depths(tree)).tolist()
            if len(depths) >= len(stats.depths):
                stats.depths = depths  # the widest tree it proposed: what a wider step would verify
            reach = max(depths)
            for d in range(1, reach + 1):
                if len(stats.tries) < d:
                    stats.tries.append(0.0)
                    stats.hits.append(0.0)
                stats.tries[d - 1] += 1
                stats.hits[d - 1] += acc >= d
            stats.propose_s = spent if stats.propose_s is None else 0.8 * stats.propose_s + 0.2 * spent


def _depths(tree) -> torch.Tensor:
    parents = tree.parents.tolist()
    depths = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        depths[i] = depths[p] + 1
    return torch.tensor(depths)


BUDGETS = {"fixed": FixedBudget, "adaptive": AdaptiveBudget}


def make_budget(name: str, forward=None, max_num_seqs: int = 1, calibrate: bool = True):
    """The policy `name` (fixed | adaptive); adaptive calibrates T(n) on `forward` first."""
    cls = choose(BUDGETS, name, "engine.budget")
    if cls is FixedBudget:
        return FixedBudget()
    if calibrate and forward is None:
        raise DraftsmithError("engine.budget=adaptive measures the verifier forward: give it the engine's forward")
    cost = StepCost()
    if calibrate:
        cost.calibrate(forward, forward.cache.rows, min(forward.cache.max_len, max_num_seqs * 32))
    return AdaptiveBudget(cost)
