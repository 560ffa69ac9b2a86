"""decode/budget.py: the load-aware policy speculates while verification is nearly free and
steps aside as the batch grows; whatever it chooses (rows skipping their proposer, trees cut),
every row stays its own greedy output."""
from __future__ import annotations

import pytest
import torch

from draftsmith.decode.budget import AdaptiveBudget, FixedBudget, RowStats, StepCost, make_budget
from draftsmith.decode.forward import make_forward
from draftsmith.decode.proposers import DraftTree
from draftsmith.models.errors import DraftsmithError
from tests.decode.rows import MEDUSA_TREE, SCHEDULE, Alternating, bandwidth_bound, row_prompt, run_schedule
from tests.laws import reference


class Row:  # a request as the policy sees it (a weakref-able key)
    pass


ROOT = DraftTree(tokens=torch.zeros(1, dtype=torch.long), parents=torch.tensor([-1]))  # a plain step's tree


def taught(policy: AdaptiveBudget, rows, accept: float, depth: int = 7, propose_s: float = 0.0005):
    """Give each row a history: trees of `depth` nodes in a chain, each depth accepted w.p. `accept`."""
    chain = DraftTree(tokens=torch.zeros(depth + 1, dtype=torch.long), parents=torch.arange(-1, depth))
    for _ in range(50):
        accepted = [int((torch.rand(depth) < accept).cumprod(0).sum()) for _ in rows]
        paths = [list(range(a + 1)) for a in accepted]
        policy.observe(rows, [chain] * len(rows), paths, len(rows) * 8, 0.01, [propose_s] * len(rows))
    policy.cost.scales.clear()  # (observe moved them; the test sets the machine)


def test_step_cost_interpolates_and_follows_the_observed_steps():
    cost = StepCost({1: 0.010, 4: 0.012, 16: 0.024})
    assert cost(1) == pytest.approx(0.010) and cost(4) == pytest.approx(0.012)
    assert 0.012 < cost(8) < 0.024 and cost(32) == pytest.approx(0.048)  # beyond: linear in n
    for _ in range(100):
        cost.observe(4, 0.024)  # this machine is twice as slow as calibrated
    assert cost(4) == pytest.approx(0.024, rel=1e-3) and cost(16) == pytest.approx(0.048, rel=1e-3)


def test_each_step_shape_learns_its_own_correction():
    """B rows W wide are not one row of B * W tokens: a wide step slower than the one-row calibration
    corrects the wide steps only, at once, and the policy steps aside (one shared correction scaled
    the plain step too and kept the wrong ratio for ever)."""
    policy = AdaptiveBudget(bandwidth_bound(knee=16))
    rows = [Row() for _ in range(8)]
    taught(policy, rows, accept=0.5)
    width, draft = policy.plan(rows)
    assert width > 1 and any(draft)
    policy.cost.observe(8, policy.cost.base(8), 1)  # the plain step: as calibrated
    policy.cost.observe(8 * width, 3 * policy.cost.base(8 * width), width)  # the wide one: 3x, from its first step
    assert policy.cost(8) == pytest.approx(policy.cost.base(8))
    assert policy.cost(8 * width, width) == pytest.approx(3 * policy.cost.base(8 * width))
    assert policy.cost(16 * width, 2 * width) == pytest.approx(3 * policy.cost.base(16 * width))  # wider: no cheaper
    assert policy.cost(16 * width, width) == pytest.approx(3 * policy.cost.base(16 * width))  # fuller: no cheaper
    assert policy.cost(4) == pytest.approx(policy.cost.base(4))  # fewer rows plain: not told, calibrated
    assert policy.plan(rows)[0] < width
    for _ in range(40):  # later steps of the shape: a running mean
        policy.cost.observe(8 * width, policy.cost.base(8 * width), width)
    assert policy.cost(8 * width, width) == pytest.approx(policy.cost.base(8 * width), rel=0.05)


def test_a_narrow_cut_is_judged_by_what_it_would_have_accepted():
    """A row whose tree is accepted through its third sibling (root -> 3 -> 4): a cut to 2 nodes
    would have accepted nothing, to 4 one token, the whole tree two (the old per-depth estimate
    gave every cut the whole tree's acceptance at the depths it reached)."""
    stats = RowStats()
    for _ in range(20):  # nodes 1, 2, 3 at depth 1; node 4 under node 3: 5 nodes, not cut
        stats.record([0, 3, 4], size=5, cut=False, widths=(2, 4, 8, 16))
    assert stats.expected(2, 0.5, 2.0) == pytest.approx(1 + 1 / 22)  # the prior's weight alone
    assert stats.expected(4, 0.5, 2.0) == pytest.approx(1 + (20 + 2 * 0.875) / 22)
    assert stats.expected(8, 0.5, 2.0) == pytest.approx(1 + (40 + 2 * sum(0.5 ** d for d in range(1, 8))) / 22)
    cut = RowStats()  # a tree cut to 4 nodes tells nothing about 8: the narrower cut's own mean stands
    for _ in range(20):
        cut.record([0, 3], size=4, cut=True, widths=(2, 4, 8, 16))
    assert cut.steps == {2: 20, 4: 20} and cut.expected(8, 0.5, 2.0) == pytest.approx(2.0)
    policy = AdaptiveBudget(bandwidth_bound(knee=16))
    policy.stats[row := Row()] = stats
    assert policy.plan([row])[0] >= 8  # one row, verification nearly free: the whole tree


def test_speculates_at_low_load_and_steps_aside_as_the_batch_grows():
    widths = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        policy = AdaptiveBudget(bandwidth_bound(knee=16))
        rows = [Row() for _ in range(batch)]
        taught(policy, rows, accept=0.7)
        width, draft = policy.plan(rows)
        widths.append(width)
        assert (width == 1) == (not any(draft))
    assert widths[0] >= 8 and widths[-1] == 1, widths  # the whole tree alone; plain decoding at saturation
    assert widths == sorted(widths, reverse=True), widths  # never wider as the load grows


@pytest.mark.parametrize("propose_s, drafts", [(0.005, False), (0.0005, True)])
def test_a_new_row_is_not_free_to_try(propose_s, drafts):
    """Rows that have not drafted yet take the drafting work their kind of proposer has shown: where
    a row's work (5 ms beside a 10 ms step) outweighs what it may accept, 8 new rows stay plain
    (taken as free, each would widen the whole step to try); where the work is small they draft."""
    policy = AdaptiveBudget(bandwidth_bound(knee=16))
    taught(policy, [Row() for _ in range(8)], accept=0.5, propose_s=propose_s)  # rows that have finished
    new = [Row() for _ in range(8)]
    width, draft = policy.plan(new)
    assert (width > 1) == drafts and any(draft) == drafts, (width, draft)


def test_the_catch_up_of_a_first_drafting_step_is_not_taken_for_its_work():
    """An EAGLE row's first drafting step reads its whole prompt through the drafter (the first
    after plain steps, their tokens): 50 ms once, beside a 10 ms step. Taken for its work per step
    it would never draft again (tau 1.00 on the AVX2 box); the steps that follow a drafting step
    tell its work, and where that is large the row does stop. A new row is charged what such a
    first step costs (trying is not free)."""
    chain = DraftTree(tokens=torch.zeros(8, dtype=torch.long), parents=torch.arange(-1, 7))
    for steady, drafts in [(0.0005, True), (0.05, False)]:
        policy = AdaptiveBudget(bandwidth_bound(knee=16))
        row = Row()
        policy.observe([row], [chain], [[0, 1, 2, 3]], 8, 0.01, [0.05])  # the first: the prompt read
        assert policy.plan([row])[1] == [True]
        for _ in range(3):
            policy.observe([row], [chain], [[0, 1, 2, 3]], 8, 0.01, [steady])
        assert policy.plan([row])[1] == [drafts], steady
        assert policy.plan([Row()])[1] == [False]  # a new row is charged what trying costs: 50 ms
    policy.observe([row], [ROOT], [[0]], 1, None, [0.0])  # a plain step, then a catch-up of 1 s:
    policy.observe([row], [chain], [[0, 1, 2, 3]], 8, 0.01, [1.0])
    assert policy.stats[row].work_s == pytest.approx(0.05)  # no sample


class Clock:
    """time.perf_counter for StepCost.calibrate: each forward of n tokens advances it by cost(n, call)."""

    def __init__(self, cost):
        self.now, self.calls, self.cost = 0.0, 0, cost

    def perf_counter(self):
        return self.now

    def forward(self, tokens, *args):
        self.now += self.cost(tokens.shape[1], self.calls)
        self.calls += 1


def test_the_calibration_is_robust_to_drift_and_noise(monkeypatch):
    """The one-row step cost T(n) is measured in rounds over every n (a machine slowing down moves
    every n alike) and made non-decreasing (a 4-token step measured cheaper than a 2-token one
    would price the 2-token step too high for ever: a width never chosen is never corrected)."""
    import draftsmith.decode.budget as budget

    class Forward:  # what calibrate uses of the engine's forward: its cache's device, and a call
        def __init__(self, clock):
            self.clock, self.cache = clock, type("Cache", (), {"keys": torch.zeros(1)})

        def __call__(self, tokens, *args):
            self.clock.forward(tokens)

    # 1 ms + 0.1 ms a token, on a machine 3% slower at every call
    clock = Clock(lambda n, call: (1e-3 + 1e-4 * n) * 1.03 ** call)
    monkeypatch.setattr(budget, "time", clock)
    cost = StepCost().calibrate(Forward(clock), 1, 32)
    assert sorted(cost.points) == [1, 2, 4, 8, 16, 32]
    ratios = [cost.points[n] / (1e-3 + 1e-4 * n) for n in cost.points]
    assert max(ratios) / min(ratios) < 1.2, ratios  # measured one n after another: 1.03 ** 30 = 2.4
    noisy = Clock(lambda n, call: {2: 3e-3, 4: 2e-3}.get(n, 1e-3 * n))  # 4 tokens measured below 2
    monkeypatch.setattr(budget, "time", noisy)
    cost = StepCost().calibrate(Forward(noisy), 1, 8)
    assert [cost.points[n] for n in (1, 2, 4, 8)] == pytest.approx([1e-3, 3e-3, 3e-3, 8e-3])


def test_a_row_that_never_accepts_stops_drafting():
    policy = AdaptiveBudget(bandwidth_bound(knee=16))
    good, bad = Row(), Row()
    taught(policy, [good], accept=0.8)
    taught(policy, [bad], accept=0.0)
    width, draft = policy.plan([good, bad])
    assert width > 1 and draft == [True, False]


def test_expensive_verification_means_plain_decoding():
    policy = AdaptiveBudget(StepCost({n: 0.01 * n for n in (1, 2, 4, 8, 16, 32)}))  # every token costs a step
    rows = [Row()]
    taught(policy, rows, accept=0.5)
    assert policy.plan(rows) == (1, [False])
    assert policy.choose(rows) == [0] and policy.counts[1] == 1
    for _ in range(20 * int(policy.half_life)):  # however long it stays plain, the prior alone never pays here
        policy.observe(rows, [ROOT], [[0]], 1, None, [0.0])
    assert policy.plan(rows) == (1, [False])


def test_a_row_kept_plain_probes_its_drafts_again():
    """A row whose drafts were all rejected goes plain; a plain step tells nothing new about its
    drafts, so its history ages and, while drafting would pay at the prior, it probes them again
    (not at once); a probe rejected again sends it back to plain at once."""
    policy = AdaptiveBudget(bandwidth_bound(knee=16))
    row = Row()
    taught(policy, [row], accept=0.0, depth=31)  # trees as wide as the widest step: every width is told
    assert policy.plan([row]) == (1, [False])
    plain = 0
    while policy.plan([row])[0] == 1:
        policy.observe([row], [ROOT], [[0]], 1, None, [0.0])  # (None: the step's time is no sample)
        plain += 1
        assert plain < 1000, "kept plain for good"
    assert plain > 1 and policy.plan([row])[1] == [True]
    width = policy.plan([row])[0]
    chain = DraftTree(tokens=torch.zeros(32, dtype=torch.long), parents=torch.arange(-1, 31))
    policy.observe([row], [chain], [[0]], width, None, [0.0005])  # the probe: nothing accepted
    assert policy.plan([row]) == (1, [False])


def test_the_policy_name_is_an_explicit_key(batch_setup):
    model, _ = batch_setup
    forward = make_forward(model, "fast", max_rows=2, max_len=128)
    assert isinstance(make_budget("fixed"), FixedBudget)
    policy = make_budget("adaptive", forward, max_num_seqs=2)
    assert sorted(policy.cost.points) == [1, 2, 4, 8, 16, 32, 64] and all(t > 0 for t in policy.cost.points.values())
    with pytest.raises(DraftsmithError, match="engine.budget='greedy' is not known; valid: adaptive, fixed"):
        make_budget("greedy")


@pytest.mark.parametrize("policy", ["alternating", "adaptive"])
def test_every_row_stays_its_own_greedy_output_whatever_the_budgets(batch_setup, policy):
    model, factories = batch_setup
    engine_budget = Alternating() if policy == "alternating" else AdaptiveBudget(bandwidth_bound(knee=4))
    requests, widest = run_schedule(model, factories, SCHEDULE, budget=engine_budget)
    for (kind, seed, length, new, _), request in zip(SCHEDULE, requests):
        ids = torch.tensor([row_prompt(seed, length)])
        assert request.out == reference(model, ids, max_new_tokens=new, eos_token_id=None), (policy, kind)
    plain = [s for r in requests for s in r.steps if s.num_nodes == 1]
    drafted = [s for r, (k, *_) in zip(requests, SCHEDULE) for s in r.steps if s.num_nodes > 1 and k != "vanilla"]
    assert plain and drafted  # rows really skipped their proposer on some steps and drafted on others


@pytest.mark.parametrize("machine", ["verify-is-free", "every-token-costs-a-step"])
def test_generate_with_the_adaptive_budget_drafts_where_it_pays_and_stays_lossless(batch_setup, monkeypatch, machine):
    """generate(budget="adaptive") (decode/evaluate.py engine.budget): one row's engine measures its
    step cost once; where verifying many tokens costs no more than one it drafts, where every token
    costs a step (an AVX2 CPU's fp32 products, in the limit) it decodes plain; either way the output
    is the verifier's own greedy output."""
    from draftsmith.decode import budget as budget_module
    from draftsmith.decode.engine import _ENGINES, generate

    model, factories = batch_setup
    per_token = 0.0 if machine == "verify-is-free" else 0.01

    def calibrate(self, forward, cache_rows, max_tokens, repeats=3):
        self.points = {n: 0.01 + per_token * (n - 1) for n in (1, 2, 4, 8, 16, 32)}
        return self

    monkeypatch.setattr(budget_module.StepCost, "calibrate", calibrate)
    monkeypatch.setattr(budget_module.StepCost, "observe", lambda self, *args, **kwargs: None)  # the machine as set
    _ENGINES.pop(model, None)  # a fresh one-row engine: its budget calibrates when it is made
    ids = torch.tensor([row_prompt(3, 21)])
    out = generate(model, ids, proposer=factories["medusa"](), max_new_tokens=30, eos_token_id=(), budget="adaptive")
    assert out.tokens == reference(model, ids, max_new_tokens=30, eos_token_id=None)
    nodes = [s.num_nodes for s in out.steps]
    if machine == "verify-is-free":
        assert max(nodes) > 1 and out.tau > 1
    else:
        assert set(nodes) == {1} and out.tau == 1
    fixed = generate(model, ids, proposer=factories["medusa"](), max_new_tokens=30, eos_token_id=())
    assert max(s.num_nodes for s in fixed.steps) == len(MEDUSA_TREE) + 1  # fixed: the whole tree, whatever the machine
    _ENGINES.pop(model, None)
    with pytest.raises(DraftsmithError, match="engine.budget='some' is not known; valid: adaptive, fixed") as e:
        generate(model, ids, proposer=factories["medusa"](), max_new_tokens=4, budget="some")
    assert "\n" not in str(e.value)
