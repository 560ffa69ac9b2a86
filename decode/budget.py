"""How many draft tokens each row verifies, step by step: the engine's budget policy (engine.budget).

    fixed     every proposer's whole tree, every step (the budget is the tree).
    adaptive  each step, the width W of the step (nodes a drafting row verifies, root included:
              1, 2, 4, 8, ...) and the rows that draft are chosen to maximise the batch's expected
              tokens per second:

        rate(W, D) = sum_b E_b(W if b in D else 1) / (T(B * W, W) + sum_{b in D} c_b)

        E_b(w)  tokens row b emits when it verifies the first w nodes of its tree: 1 + the drafted
                tokens such a cut accepted over the row's own drafting steps (each step tells every
                narrower cut: RowStats), shrunk towards a chain's prior of `prior` per depth; the
                history counts half for every `half_life` plain steps since the row last drafted, so
                a row kept plain probes its drafts again after a while;
        T(n)    the verifier forward's time for n tokens in the step on this machine: measured at
                start on one row for n = 1, 2, 4, ... (StepCost.calibrate), times a correction per
                step shape (W, B) learned from the steps themselves (B rows W wide are not one row
                of B * W tokens on an empty cache: every row reads its own cache; one shared
                correction would keep a wrong ratio of wide to plain steps for ever);
        c_b     the row's own work when it drafts: its proposal, its acceptance rule and its
                proposer's update (a running mean of its own over the drafting steps that follow a
                drafting step: the first after the prompt or a plain step also catches up on the
                tokens since, which an EAGLE drafter reads once; a row without such a step yet
                takes its kind's mean, and a row that has not drafted at all what its kind's first
                drafting steps cost: a new row is not free to try, or every row joining a full
                batch widens a whole step to try its drafts).

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

    def observe(self, rows, trees, paths, tokens: int, seconds: float | None, work_s: list[float]) -> None:
        self.counts[max(t.size for t in trees)] += 1


@dataclass
class RowStats:
    """One row's acceptance history, per step width, and its own work on a drafting step.

    A step of width w verifies the first w nodes of the row's tree (decode.engine.truncate keeps
    them, in the tree's topological order). Every drafting step tells what each narrower cut would
    have accepted: the leading nodes of the accepted path that lie among the first w (under greedy
    acceptance exactly what the cut tree accepts: a token the cut dropped matches nothing else)."""

    accepted: dict[int, float] = field(default_factory=dict)  # width -> drafted tokens a cut to it accepted, summed
    steps: dict[int, float] = field(default_factory=dict)  # width -> steps that tell (the tree had >= width nodes)
    work_s: float | None = None  # running mean of its own work on a drafting step (propose, accept, update)
    idle: int = 0  # plain steps since it last drafted (its history ages: see expected)
    streak: int = 0  # drafting steps in a row, up to this one
    memo: dict = field(default_factory=dict, repr=False)  # width -> expected(width), until the next record

    def record(self, path: list[int], size: int, cut: bool, widths) -> None:
        """A drafting step: its accepted `path` (node indices, root first) in a tree of `size` nodes,
        `cut` when the budget may have cut it (then wider steps are not told)."""
        self.memo.clear()
        self.idle = 0
        self.streak += 1
        for width in widths:
            if width > size and cut:
                break
            ahead = 0
            for node in path[1:]:
                if node >= width:
                    break
                ahead += 1
            self.accepted[width] = self.accepted.get(width, 0.0) + ahead
            self.steps[width] = self.steps.get(width, 0.0) + 1

    def kept_plain(self) -> None:
        """A step it did not draft in: its history is one step older."""
        self.memo.clear()
        self.idle += 1
        self.streak = 0

    def expected(self, width: int, prior: float, weight: float, half_life: float = math.inf) -> float:
        """E[tokens emitted] verifying the first `width` nodes of its tree (1 = the root alone): its
        own history at that width shrunk towards a chain's prior (sum of prior^d over the w - 1
        depths), and never below what a narrower width expects. The history counts half as much
        against the prior for every `half_life` plain steps since the row last drafted: a row kept
        plain learns nothing new of its drafts, so after a while it probes them again (the text, and
        what prompt lookup finds in it, changes as it grows)."""
        key = (width, prior, weight, half_life)
        if key not in self.memo:
            keep = 0.5 ** (self.idle / half_life)
            guess = sum(prior ** d for d in range(1, width))
            mean = (keep * self.accepted.get(width, 0.0) + weight * guess) / (keep * self.steps.get(width, 0.0) + weight)
            narrower = [self.accepted[w] / self.steps[w] for w in self.steps if w < width]
            self.memo[key] = 1.0 + max([mean, *narrower])
        return self.memo[key]


class StepCost:
    """T(n, width): seconds of a verifier step over n tokens, `width` per row (n / width rows). The
    one-row forward measured at start on an empty cache (interpolated log-log between the measured
    n, linear beyond), times a correction per (width, rows) learned from the steps themselves: the
    first step of a shape sets it, later ones move it by a running mean. A shape never seen takes
    the largest correction of the narrower-or-equal, fewer-or-equal shapes seen (a step is not
    assumed cheaper than its calibration because it is wider or fuller), else 1."""

    def __init__(self, points: dict[int, float] | None = None):
        self.points = dict(points or {})
        self.scales: dict[tuple[int, int], float] = {}  # (width, rows) -> observed / calibrated

    def calibrate(self, forward, cache_rows: int, max_tokens: int, repeats: int = 5) -> "StepCost":
        """Time one row's forward of n = 1, 2, 4, ... max_tokens tokens on an empty cache row: the
        median of `repeats` rounds, each timing every n once (a machine whose speed drifts moves
        every n alike, not the last ones measured), made non-decreasing in n (a wider step is never
        taken for cheaper than a narrower one because of the noise in one measurement: a width
        priced too high is never tried, so the steps could not correct it)."""
        device = forward.cache.keys.device
        sizes = [1 << i for i in range(max(max_tokens, 1).bit_length()) if 1 << i <= max_tokens]
        rows = torch.tensor([cache_rows - 1], device=device)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(repeats + 1):  # the first round warms up
            for n in sizes:
                tokens = torch.zeros(1, n, dtype=torch.long, device=device)
                positions = torch.arange(n, device=device)[None]
                allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
                t0 = time.perf_counter()
                forward(tokens, positions, positions, allowed, rows, n)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if round_:
                    times[n].append(time.perf_counter() - t0)
        floor = 0.0
        for n in sizes:
            floor = self.points[n] = max(floor, sorted(times[n])[len(times[n]) // 2])
        return self

    def scale(self, width: int, rows: int) -> float:
        if (width, rows) in self.scales:
            return self.scales[width, rows]
        seen = [s for (w, b), s in self.scales.items() if w <= width and b <= rows]
        return max(seen) if seen else 1.0

    def base(self, n: int) -> float:
        """The calibrated one-row time of n tokens."""
        if not self.points:
            return float(n)  # uncalibrated: proportional to the tokens
        xs = sorted(self.points)
        if n <= xs[0]:
            return self.points[xs[0]]
        if n >= xs[-1]:  # beyond the largest measured: linear in n
            return self.points[xs[-1]] * n / xs[-1]
        hi = next(x for x in xs if x >= n)
        lo = max(x for x in xs if x <= n)
        if hi == lo:
            return self.points[lo]
        t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return math.exp((1 - t) * math.log(self.points[lo]) + t * math.log(self.points[hi]))

    def __call__(self, n: int, width: int = 1) -> float:
        return self.scale(width, max(n // width, 1)) * self.base(n)

    def observe(self, n: int, seconds: float, width: int = 1, momentum: float = 0.9) -> None:
        predicted, key = self.base(n), (width, max(n // width, 1))
        if predicted > 0:
            ratio = seconds / predicted
            self.scales[key] = ratio if key not in self.scales else momentum * self.scales[key] + (1 - momentum) * ratio


class AdaptiveBudget:
    """The load-aware policy (see the module docstring)."""

    name = "adaptive"

    def __init__(self, cost: StepCost | None = None, widths=(1, 2, 4, 8, 16, 32), prior: float = 0.5,
                 prior_weight: float = 2.0, half_life: float = 32.0):
        self.cost = cost or StepCost()
        self.widths, self.prior, self.weight = tuple(widths), float(prior), float(prior_weight)
        self.half_life = float(half_life)  # plain steps after which a row's history counts half (RowStats.expected)
        self.stats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.counts: Counter = Counter()  # chosen width -> steps
        self.drafting: Counter = Counter()  # rows that drafted / did not, over all steps
        self.work: dict = {}  # proposer name -> running mean of a row's work on a drafting step after one
        self.trial: dict = {}  # proposer name -> running mean of a row's first drafting step (c_b of new rows)

    def _row(self, request) -> RowStats:
        stats = self.stats.get(request)
        if stats is None:
            stats = self.stats[request] = RowStats()
        return stats

    def _work(self, request, stats: RowStats) -> float:
        """c_b: the row's own work on a drafting step; a row that has drafted but has no such sample
        yet (it drafted once, or only after plain steps) takes its kind's, a new row what its kind's
        first drafting steps cost (trying: it reads its prompt through an EAGLE drafter first)."""
        if stats.work_s is not None:
            return stats.work_s
        kind = proposer_name(request)
        if stats.steps:
            return self.work.get(kind, 0.0)
        return self.trial.get(kind, self.work.get(kind, 0.0))

    def plan(self, rows) -> tuple[int, list[bool]]:
        """(step width W, which rows draft) maximising expected tokens per second."""
        B = len(rows)
        stats = [self._row(r) for r in rows]
        works = [self._work(r, s) for r, s in zip(rows, stats)]
        best = (sum(1.0 for _ in rows) / self.cost(B), 1, [False] * B)  # plain decoding
        for width in self.widths[1:]:
            gains = [(s.expected(width, self.prior, self.weight, self.half_life) - 1.0, work)
                     for s, work in zip(stats, works)]
            order = sorted(range(B), key=lambda b: -gains[b][0] / (gains[b][1] + 1e-6))
            draft = [False] * B
            tokens, spent = float(B), self.cost(B * width, width)
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

    def observe(self, rows, trees, paths, tokens: int, seconds: float | None, work_s: list[float]) -> None:
        """One decoding step: its trees, each row's accepted path (node indices, root first), the
        verifier's `tokens` (B x the step's width) and `seconds` (None: prompt chunks shared the
        forward, so its time tells nothing of T), and each row's own work (work_s)."""
        width = tokens // max(len(rows), 1)
        if seconds is not None:
            self.cost.observe(tokens, seconds, width)
        for request, tree, path, spent in zip(rows, trees, paths, work_s):
            stats = self._row(request)
            if tree.size == 1:
                stats.kept_plain()  # a plain step says nothing about the drafts: the history ages
                continue
            stats.record(path, tree.size, cut=tree.size >= width, widths=self.widths[1:])
            kind = proposer_name(request)
            if stats.streak == 1:  # its first drafting step since its prompt or a plain step: what trying
                # costs, not its work a step (an EAGLE drafter reads the pairs of the prompt, or of the
                # plain steps, first: paid once, then each step reads the pairs it accepted)
                self.trial[kind] = spent if kind not in self.trial else 0.9 * self.trial[kind] + 0.1 * spent
                continue
            stats.work_s = spent if stats.work_s is None else 0.8 * stats.work_s + 0.2 * spent
            self.work[kind] = spent if kind not in self.work else 0.9 * self.work[kind] + 0.1 * spent


def proposer_name(request) -> str | None:
    """The kind of proposer a row drafts with (rows of one kind share the estimate of a new row's work)."""
    return getattr(getattr(request, "proposer", None), "name", None)


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
