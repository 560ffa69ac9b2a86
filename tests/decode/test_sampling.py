"""decode/sampling.py: hand cases for every rule, and the law test that proves losslessness.

The law test: a fixed random "target model" (a table of conditionals over V=8 tokens that
depends on the last two tokens and the position) and a very different draft table. Each
sample runs one speculative step (draft a tree, verify with ``rejection_walk``), emits the
accepted tokens + the next token, extends by plain target sampling up to M=3 tokens, and
records them. The empirical law of 20k samples must match the exactly enumerated law of the
first M tokens under the processed target (chi-square and total variation), and three
deliberately broken rules must fail the very same check.
"""


import pytest
import torch
from scipy.stats import chisquare

from draftsmith.decode import sampling
from draftsmith.decode.sampling import (
    ACCEPTANCE_RULES,
    LOSSY_RULES,
    argmax_ids,
    get_rule,
    greedy_walk,
    logits_to_probs,
    rejection_walk,
    typical_walk,
)
from draftsmith.decode.tree import paths_to_parents

F64 = torch.float64


# --- logits_to_probs ---------------------------------------------------------------------


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=F64).log()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, want",
    [
        (1.0, 0, 1.0, [1, 2, 3, 4]),  # identity: base probs 0.1 0.2 0.3 0.4
        (0.5, 0, 1.0, [1, 4, 9, 16]),  # T = 0.5 squares the probabilities
        (2.0, 0, 1.0, [1, 2**0.5, 3**0.5, 2]),  # T = 2 takes square roots
        (1.0, 2, 1.0, [0, 0, 3, 4]),  # top-k 2
        (1.0, 4, 1.0, [1, 2, 3, 4]),  # top-k = V is a no-op
        (1.0, 0, 0.65, [0, 0, 3, 4]),  # 0.4 < 0.65 <= 0.4 + 0.3
        (1.0, 0, 0.75, [0, 2, 3, 4]),  # 0.7 < 0.75 <= 0.9
        (1.0, 0, 0.3, [0, 0, 0, 1]),  # top token alone already has mass >= top_p
        (1.0, 0, 1e-9, [0, 0, 0, 1]),  # the top token is always kept
        (0.5, 3, 0.6, [0, 0, 9, 16]),  # T, then top-k {4,9,16}/29, then top-p: 16/29 < 0.6
    ],
)
def test_logits_to_probs_hand_values(temperature, top_k, top_p, want):
    got = logits_to_probs(probs_logits([0.1, 0.2, 0.3, 0.4]), temperature, top_k, top_p)
    want = torch.tensor(want, dtype=F64)
    assert got.dtype == F64
    torch.testing.assert_close(got, want / want.sum(), atol=1e-12, rtol=0)


def test_logits_to_probs_batched_and_ties():
    logits = torch.randn(2, 3, 10, dtype=F64)
    probs = logits_to_probs(logits, 0.8, top_k=4, top_p=0.9)
    assert probs.shape == (2, 3, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, dtype=F64))
    assert ((probs > 0).sum(-1) <= 4).all()
    # Every token tied with the k-th largest logit is kept.
    tied = logits_to_probs(torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64), 1.0, top_k=2)
    torch.testing.assert_close(tied, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0], dtype=F64))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": -1.0},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_k": -1},
    ],
)
def test_logits_to_probs_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(4), **kwargs)


# --- greedy_walk -------------------------------------------------------------------------

V_HAND = 6


def argmax_logits(argmaxes: list[int]) -> torch.Tensor:
    """(n, V_HAND) logits whose row i has its unique maximum at argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), V_HAND, dtype=F64)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return logits


@pytest.mark.parametrize(
    "parents, tokens, argmaxes, want_path, want_next",
    [
        ([-1, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 5], [0, 1, 2, 3], 5),  # full accept + bonus
        ([-1, 0, 1, 2], [0, 1, 2, 3], [1, 4, 3, 5], [0, 1], 4),  # stops at node 2
        ([-1, 0, 0, 2], [0, 1, 2, 3], [2, 0, 3, 4], [0, 2, 3], 4),  # second sibling
        ([-1, 0, 0, 2], [0, 1, 2, 3], [5, 0, 3, 4], [0], 5),  # nothing accepted
        # duplicate sibling tokens: the deeper accepted subtree wins
        ([-1, 0, 0, 2], [0, 1, 1, 3], [1, 0, 3, 2], [0, 2, 3], 2),
    ],
)
def test_greedy_walk_hand_trees(parents, tokens, argmaxes, want_path, want_next):
    path, nxt = greedy_walk(torch.tensor(tokens), torch.tensor(parents), argmax_logits(argmaxes))
    assert path == want_path and nxt == want_next


def test_greedy_walk_ties_take_first_index():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 0.0, 0.0]], dtype=F64)
    # argmax of row 0 is 1 (first of the tied 1 and 2): token 2 is rejected.
    assert greedy_walk(torch.tensor([0, 2]), torch.tensor([-1, 0]), logits) == ([0], 1)
    assert greedy_walk(torch.tensor([0, 1]), torch.tensor([-1, 0]), logits) == ([0, 1], 0)



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_argmax_ids_is_torch_argmax_ties_and_nans_included(dtype):
    """argmax_ids (max(dim=-1).indices, the greedy rules' and the engine's argmax) is torch.argmax in
    every dtype: rows full of exact ties (one all equal), single rows, a vocabulary's width, NaN rows
    (argmax takes the first NaN); the other tie rule (the last maximal index) differs from it."""
    g = torch.Generator().manual_seed(0)
    for width in (1, 7, 49152):
        x = torch.randint(0, 3, (16, width), generator=g).to(dtype)  # many exact ties
        x[0] = 1  # every entry tied
        assert torch.equal(argmax_ids(x), x.argmax(dim=-1))
        assert torch.equal(argmax_ids(x[3]), x[3].argmax())
        last = width - 1 - x.flip(-1).argmax(dim=-1)  # the last maximal index
        assert torch.equal(argmax_ids(x), last) == (width == 1)
    x = torch.randn(4, 300, generator=g).to(dtype)
    x[1, 7] = x[2, 3] = x[2, 9] = float("nan")
    assert torch.equal(argmax_ids(x), x.argmax(dim=-1))
    assert argmax_ids(x)[2] == 3

# --- typical_walk ------------------------------------------------------------------------

# Row laws for the typical hand case (temperature 1):
#   skewed p = [.5, .3, .15, .05]: H = 1.142, 0.3 exp(-H) = 0.0958 -> threshold 0.09:
#     tokens 0, 1, 2 pass, token 3 (0.05) fails.
#   uniform p = [.25] * 4: H = ln 4, 0.3 exp(-H) = 0.075 -> threshold 0.075: all pass.
SKEWED = [0.5, 0.3, 0.15, 0.05]
UNIFORM = [0.25] * 4
PEAKED = [0.02, 0.02, 0.94, 0.02]  # threshold min(.09, .3 exp(-H)) = .09: only token 2 passes


def rows(*laws: list[float]) -> torch.Tensor:
    return torch.stack([probs_logits(law) for law in laws])


def test_typical_walk_hand_case():
    parents = torch.tensor([-1, 0, 0, 1, 2])
    # node 1 token 3 fails (0.05), node 2 token 1 passes (0.3), node 4 token 2 passes (0.25)
    tokens = torch.tensor([0, 3, 1, 0, 2])
    logits = rows(SKEWED, UNIFORM, UNIFORM, UNIFORM, PEAKED)
    assert typical_walk(tokens, parents, logits, temperature=1.0) == ([0, 2, 4], 2)
    # greedy accepts none of it: typical is not greedy (and not lossless)
    assert greedy_walk(tokens, parents, logits) == ([0], 0)
    # under a PEAKED parent (node 2) only its top token passes: node 4 with token 0 fails
    tokens = torch.tensor([0, 3, 1, 0, 0])
    logits = rows(SKEWED, UNIFORM, PEAKED, UNIFORM, UNIFORM)
    assert typical_walk(tokens, parents, logits, temperature=1.0) == ([0, 2], 2)


def test_typical_walk_equal_depth_prefers_likelihood_then_index():
    parents = torch.tensor([-1, 0, 0])
    logits = rows(SKEWED, PEAKED, PEAKED)
    # node 1 (p=.3) and node 2 (p=.5) both pass at depth 1: Medusa keeps the likelier one
    assert typical_walk(torch.tensor([0, 1, 0]), parents, logits, 1.0) == ([0, 2], 2)
    assert typical_walk(torch.tensor([0, 0, 1]), parents, logits, 1.0) == ([0, 1], 2)
    # equal likelihood too (duplicate tokens): the lower index
    assert typical_walk(torch.tensor([0, 1, 1]), parents, logits, 1.0) == ([0, 1], 2)


def test_typical_walk_applies_temperature():
    # at T = 0.25, p ~ SKEWED ** 4 puts 0.007 on token 2 (threshold 0.09); at T = 1 it has 0.15
    chain, tokens, logits = torch.tensor([-1, 0]), torch.tensor([0, 2]), rows(SKEWED, PEAKED)
    assert typical_walk(tokens, chain, logits, temperature=0.25) == ([0], 0)
    assert typical_walk(tokens, chain, logits, temperature=1.0) == ([0, 1], 2)


def test_typical_walk_docstring_and_registry():
    assert typical_walk.__doc__.startswith("LOSSY:")
    assert LOSSY_RULES == {"typical"}
    assert set(ACCEPTANCE_RULES) == {"greedy", "rejection", "coupled", "typical"}
    assert get_rule("greedy") is sampling._greedy_rule and get_rule("rejection") is sampling._rejection_rule
    with pytest.raises(ValueError, match="coupled, greedy, rejection, typical"):
        get_rule("medusa")


def test_sampling_settings_are_validated_once_and_typical_refuses_truncation():
    from draftsmith.decode.sampling import SamplingParams, resolve_rule
    from draftsmith.models.errors import DraftsmithError

    for bad in [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(DraftsmithError):
            SamplingParams(**bad)
    assert resolve_rule("auto", SamplingParams(0.0)) == "greedy"
    assert resolve_rule("auto", SamplingParams(0.7, top_p=0.9)) == "rejection"
    with pytest.raises(DraftsmithError, match="typical.*cannot honour top_k=5"):
        resolve_rule("typical", SamplingParams(0.7, top_k=5))
    with pytest.raises(DraftsmithError, match="needs temperature > 0"):
        resolve_rule("typical", SamplingParams(0.0))


# --- rejection_walk: hand edge cases -----------------------------------------------------


def test_rejection_walk_certain_accept_and_reject():
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor([-1, 0, 0])
    tokens = torch.tensor([0, 1, 2])
    target = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.0, 0.0, 0.0, 1.0]], dtype=F64)
    # deterministic children: p(1) = 0 rejects node 1, p(2) = 1 accepts node 2, then the
    # leaf's law puts all its mass on token 3.
    for _ in range(20):
        assert rejection_walk(tokens, parents, target, None, None, g) == ([0, 2], 3)
    # sampled children with q = p: every draft is accepted
    draft = target.clone()
    draft[0] = torch.tensor([0.0, 0.5, 0.5, 0.0], dtype=F64)
    target[0] = draft[0]
    for _ in range(20):
        path, _ = rejection_walk(tokens, parents, target, draft, None, g)
        assert path == [0, 1]  # p(x) / q(x) = 1: the first child is always accepted
    # a draft the draft law gives probability 0 cannot have been sampled from it
    draft[0] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    with pytest.raises(ValueError, match="draft probability 0"):
        rejection_walk(tokens, parents, target, draft, None, g)


def walk(*args) -> tuple[tuple[int, ...], int]:
    path, nxt = rejection_walk(*args)
    return tuple(path), nxt


def test_rejection_walk_sampled_flags_and_exhausted_draft():
    g = torch.Generator().manual_seed(0)
    parents, tokens = torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 2])
    target = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4], dtype=F64)
    draft = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3, dtype=F64)  # q = delta(1) at the root
    # Sampled from delta(1): node 1 is accepted w.p. p(1) = 0.5; after its rejection q has
    # no mass left, node 2 is never tried, and the next token comes from p with 1 removed.
    outcomes = {walk(tokens, parents, target, draft, None, g) for _ in range(200)}
    assert outcomes == {((0, 1), 3), ((0,), 0)}
    # The same tree flagged deterministic at the root: node 2 (token 2, p = 0) is tried too
    # and rejected, and q is never consulted.
    sampled = torch.tensor([False, True, True])
    outcomes = {walk(tokens, parents, target, draft, sampled, g) for _ in range(200)}
    assert outcomes == {((0, 1), 3), ((0,), 0)}
    # Flagged deterministic, a child the draft law cannot produce is fine.
    draft[0] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    assert rejection_walk(tokens, parents, target, draft, sampled, g)[1] in (0, 3)
    with pytest.raises(ValueError, match="draft probability 0"):
        rejection_walk(tokens, parents, target, draft, None, g)


def test_rejection_walk_is_reproducible():
    tokens, parents = torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1])
    logits = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(3))
    target = torch.softmax(logits, dim=-1)
    runs = [
        [rejection_walk(tokens, parents, target, None, None, g) for _ in range(50)]
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


# --- the law test ------------------------------------------------------------------------

V = 8
M = 3  # tokens recorded per sample
N = 20_000  # samples per case
PRE, ROOT = 3, 5  # the token before the root, and the root (last emitted token)
MEDUSA_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
TOPK_PARENTS, TOPK_CHOICES, TOPK_DEPTHS = paths_to_parents(MEDUSA_TREE)


# Target conditionals: three likely tokens and a thin tail, in a random order per (position,
# last token), plus noise that depends on the previous token too. At T=1 the law of 3 tokens
# is spread over all 512 sequences yet concentrated enough for a 20k-sample TV bound; at
# T=0.7, top-p 0.9 keeps ~3 tokens per context, so the truncation really removes tokens
# (which must then never be emitted).
PROFILE = [2.2, 2.0, 1.5, -2.0, -2.5, -3.0, -4.0, -5.0]


def law_tables(temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed target P[pos, prev, last] (M+1, V, V, V) and draft Q[pos, last] (M+1, V, V).

    The target looks at the last two tokens. The draft sees only the last one, at half the
    logit scale and with large noise of its own, so the two differ a lot (sum min(p, q) is
    ~0.5 at T=1) while still agreeing often enough that deep paths get accepted. Both get the
    same temperature / top-p processing.
    """
    g = torch.Generator().manual_seed(1234)
    order = torch.rand(M + 1, V, V, generator=g).argsort(dim=-1)  # (M+1, V, V)
    base = torch.tensor(PROFILE, dtype=F64)[order]  # (M+1, last, V)
    target_logits = base[:, None] + 0.7 * torch.randn(M + 1, V, V, V, dtype=F64, generator=g)
    draft_logits = 0.5 * base + 1.5 * torch.randn(M + 1, V, V, dtype=F64, generator=g)
    return (
        logits_to_probs(target_logits, temperature, top_p=top_p),
        logits_to_probs(draft_logits, temperature, top_p=top_p),
    )


def exact_law(P: torch.Tensor) -> torch.Tensor:
    """(V**M,) exact law of the first M tokens after [PRE, ROOT] under the target table."""
    first = P[0, PRE, ROOT]  # (V,)          t1
    second = P[1, ROOT]  # (V, V)             t1 -> t2
    third = P[2]  # (V, V, V)                 t1, t2 -> t3
    return (first[:, None, None] * second[:, :, None] * third).flatten()


def draw(weights: list[float], u: float) -> int:
    """Inverse-CDF draw of an index from unnormalised weights, given a uniform u in [0, 1)."""
    target, acc = u * sum(weights), 0.0
    for i, w in enumerate(weights):
        acc += w
        if target < acc:  # a zero weight is never drawn
            return i
    return max(i for i, w in enumerate(weights) if w > 0)  # rounding at the very top


def draft_tree(shape: str, Q: list, ranked: list, uniforms) -> tuple[list[int], list[int]]:
    """Draft one tree -> (tokens, parents); node 0 is the root, nodes in topological order.

    chain: 3 tokens, each sampled from q given the previous token.
    topk: MEDUSA_TREE, node = the choice-th most likely token of q given its parent.
    sampled: 2 children per node, depth 2, drawn one by one without replacement from q.
    ``Q[pos][last]`` is q as a list, ``ranked[pos][last]`` the tokens by decreasing q.
    """
    if shape == "topk":
        tokens = [ROOT]
        for i in range(1, len(TOPK_PARENTS)):
            parent = TOPK_PARENTS[i]
            tokens.append(ranked[TOPK_DEPTHS[parent]][tokens[parent]][TOPK_CHOICES[i]])
        return tokens, TOPK_PARENTS
    tokens, parents, depths = [ROOT], [-1], [0]
    per_node, levels = (1, 3) if shape == "chain" else (2, 2)
    frontier = [0]
    for _ in range(levels):
        new_frontier = []
        for u in frontier:
            q = list(Q[depths[u]][tokens[u]])
            for _ in range(min(per_node, sum(w > 0 for w in q))):
                x = draw(q, next(uniforms))
                q[x] = 0.0  # without replacement
                tokens.append(x)
                parents.append(u)
                depths.append(depths[u] + 1)
                new_frontier.append(len(tokens) - 1)
        frontier = new_frontier
    return tokens, parents


def speculative_samples(
    shape: str, P: torch.Tensor, Q: torch.Tensor, seed: int
) -> tuple[list[int], list[int]]:
    """Counts (V**M,) of the first M emitted tokens over N one-step speculative runs, and how
    many runs accepted 0, 1, 2, 3 drafted tokens.

    Every random number comes from one seeded generator: the drafter's and the extension's
    uniforms via torch.rand, the acceptance rule's own draws inside rejection_walk.
    """
    g = torch.Generator().manual_seed(seed)
    P_list, Q_list = P.tolist(), Q.tolist()
    P_rows, Q_rows = P.reshape(-1, V), Q.reshape(-1, V)  # rows [(pos * V + prev) * V + last]
    ranked = torch.argsort(Q, dim=-1, descending=True, stable=True).tolist()
    counts, accepted = [0] * V**M, [0] * 4
    for _ in range(N):
        uniforms = iter(torch.rand(8, generator=g, dtype=F64).tolist())
        tokens, parents = draft_tree(shape, Q_list, ranked, uniforms)
        depths, target_rows = [0], [PRE * V + ROOT]  # depth 0, prev PRE, last ROOT
        for i in range(1, len(parents)):
            depths.append(depths[parents[i]] + 1)
            target_rows.append((depths[i] * V + tokens[parents[i]]) * V + tokens[i])
        target_probs = P_rows[target_rows]  # (n, V) target law after root..i
        draft_probs = None  # (n, V) law the children of i were drawn from
        if shape != "topk":
            draft_probs = Q_rows[[d * V + x for d, x in zip(depths, tokens)]]
        path, nxt = rejection_walk(
            torch.tensor(tokens), torch.tensor(parents), target_probs, draft_probs, None, g
        )
        accepted[len(path) - 1] += 1
        seq = [PRE, ROOT] + [tokens[i] for i in path[1:]] + [nxt]
        while len(seq) < M + 2:  # plain target sampling for the rest
            seq.append(draw(P_list[len(seq) - 2][seq[-2]][seq[-1]], next(uniforms)))
        a, b, c = seq[2 : M + 2]
        counts[(a * V + b) * V + c] += 1
    return counts, accepted


def law_check(counts: list[int], law: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value, total variation, samples on zero-probability sequences).

    Cells expecting fewer than 5 samples are merged into one cell (dropped if it expects
    fewer than 5 in all and got nothing). The TV distance is taken over the same merged cells:
    on the raw 512 cells, 20k samples of the exact law would already show TV ~ 0.02 of pure
    noise from the sparse tail.
    """
    counts = torch.tensor(counts)
    obs = counts.double()  # (V**M,)
    expected = law * counts.sum()  # (V**M,)
    small = expected < 5
    obs_cells, exp_cells = obs[~small], expected[~small]
    if small.any() and (expected[small].sum() >= 5 or obs[small].sum() > 0):
        obs_cells = torch.cat([obs_cells, obs[small].sum()[None]])
        exp_cells = torch.cat([exp_cells, expected[small].sum()[None]])
    tv = 0.5 * float((obs_cells - exp_cells).abs().sum() / counts.sum())
    exp_cells = exp_cells * (obs_cells.sum() / exp_cells.sum())  # equal totals for scipy
    if bool((exp_cells == 0).any()):
        pvalue = 0.0  # samples landed where the verifier puts no mass at all
    else:
        pvalue = float(chisquare(obs_cells.numpy(), exp_cells.numpy()).pvalue)
    impossible = int(counts[law == 0].sum())
    return pvalue, tv, impossible


CASES = [  # (tree shape, temperature, top_p)
    ("chain", 1.0, 1.0),
    ("chain", 0.7, 0.9),
    ("topk", 1.0, 1.0),
    ("topk", 0.7, 0.9),
    ("sampled", 1.0, 1.0),
    ("sampled", 0.7, 0.9),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape, temperature, top_p", CASES)
def test_rejection_walk_is_lossless(shape, temperature, top_p):
    P, Q = law_tables(temperature, top_p)
    law = exact_law(P)
    assert int((law > 0).sum()) >= 16  # top-p leaves a law worth testing
    counts, accepted = speculative_samples(shape, P, Q, seed=0)
    # every branch of the rule ran: no draft accepted, some, all of a full-depth path
    depth = 3 if shape == "chain" else 2
    assert min(accepted[: depth + 1]) >= 100, accepted
    pvalue, tv, impossible = law_check(counts, law)
    assert impossible == 0, "emitted a sequence the processed verifier gives probability 0"
    assert pvalue > 1e-3, f"chi-square rejects the verifier's law: p = {pvalue:.2e}"
    assert tv < 0.03, f"total variation {tv:.4f}"


def accept_q_over_p(p_x, q_x):
    return min(1.0, q_x / p_x) if p_x > 0 else 1.0  # broken: min(1, q/p)


def residual_is_p(p, q):
    return p  # broken: after a rejection, keep sampling from p instead of norm((p - q)+)


def keep_rejected_draft(q, removed):
    return q.double()  # broken (subtle): the next sibling's q still holds the rejected tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "helper, broken, shape",
    [
        ("_accept_prob", accept_q_over_p, "chain"),
        ("_residual", residual_is_p, "topk"),
        ("without", keep_rejected_draft, "sampled"),
    ],
)
def test_law_check_catches_broken_rules(monkeypatch, helper, broken, shape):
    """The same law check must reject a rule with a known bug: the test has teeth."""
    monkeypatch.setattr(sampling, helper, broken)
    P, Q = law_tables(1.0, 1.0)
    counts, _ = speculative_samples(shape, P, Q, seed=0)
    pvalue, tv, _ = law_check(counts, exact_law(P))
    assert pvalue < 1e-6, f"broken {helper} passed the law check: p = {pvalue:.2e}, tv = {tv:.4f}"
