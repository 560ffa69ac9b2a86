"""decode/peagle.py through the engine: P-EAGLE proposes every depth from ONE drafter forward,
drafts what it claims, and is lossless like every other proposer.

- a P-EAGLE drafter briefly fitted with the trainer's own loss (train/eagle.py, placeholder steps)
  decodes greedily token-identical to HF ``generate`` with a chain, a static tree and a dynamic
  tree, accepting several tokens a step and rejecting some;
- each step runs the drafter ONCE and projects onto the draft vocabulary ONCE;
- every drafted node is its depth's top-k, recomputed from scratch with no cache (pairs, root and
  placeholders in one causal forward over the whole sequence), and the dynamic tree is the exact
  best-first choice over the product of the per-depth top-k lists;
- rows of P-EAGLE beside EAGLE-3 and plain rows in one batched engine, with steps that skip the
  proposer and trees cut to a prefix, each equal their own greedy output;
- the sampling law of the first 3 tokens (chi-square + TV) for a chain, a static tree and a
  dynamic tree, and a deliberately broken rule fails it;
- bad arguments are one-line errors (a tree deeper than the depths trained, a sequential drafter).
"""
import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.engine import Engine, generate
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError
from tests.drafters import PEAGLE_K as K
from tests.drafters import PEAGLE_MASK as MASK
from tests.drafters import fitted_drafter, fitted_peagle
from tests.decode.rows import Alternating, check_rows_draft_as_alone
from tests.laws import (sample_case, RecordingProposer, RecordingRule, V, engine_counts, exact_law, law_model, law_test,
                        prompt, reference, residual_from_p_walk, tree_paths)
from tests.tiny import tiny_llama

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
DYNAMIC = dict(depth=4, top_k=3, total_tokens=10)
TREES = {"chain": dict(paths=CHAIN), "static": dict(paths=STATIC), "dynamic": DYNAMIC}


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama().requires_grad_(False)
        return model, fitted_peagle(model)
    finally:
        torch.set_num_threads(threads)


def proposer_for(model, drafter, tree: str | dict, **extra):
    kwargs = TREES[tree] if isinstance(tree, str) else tree
    return make_proposer("peagle", drafter=drafter, embed_tokens=model.get_input_embeddings(),
                         lm_head=model.lm_head, **kwargs, **extra)


@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_identity(setup, tree, monkeypatch):
    model, drafter = setup
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    proposer = proposer_for(model, drafter, tree)
    steps = []
    for seed, n in [(1, 40), (2, 40), (3, 7)]:
        ids = prompt(seed, length=10 + seed)
        out = generate(model, ids, proposer=proposer, max_new_tokens=n, eos_token_id=())
        assert out.tokens == reference(model, ids, n, eos_token_id=None), (tree, seed)
        steps += out.steps
    assert sum(s.emitted for s in steps) / len(steps) > 1.5  # multi-token acceptance...
    deep = 2 if tree == "dynamic" else 3  # the best-first 10 nodes of 3 x 3 x 3 x 3 stop at depth 2 here
    assert any(s.accepted == 0 for s in steps) and any(s.accepted >= deep for s in steps)  # ...rejections, deep accepts
    if tree != "chain":  # a non-first child of the root accepted: the verifier cache keeps a non-prefix path
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)
    if tree == "dynamic":
        assert all(s.num_nodes == DYNAMIC["total_tokens"] for s in steps)


def test_greedy_identity_with_an_int8_drafter_and_eos(setup):
    model, drafter = setup
    ids = prompt(5, 12)
    free = reference(model, ids, 30, eos_token_id=None)
    out = generate(model, ids, proposer=proposer_for(model, drafter, "dynamic", quant="int8"), max_new_tokens=30,
                   eos_token_id=free[12])
    assert out.tokens == reference(model, ids, 30, eos_token_id=free[12]) and out.stop_reason == "eos"


def test_one_drafter_forward_and_one_projection_per_step(setup, monkeypatch):
    """The whole point of P-EAGLE: K depths cost one drafter forward (EAGLE's dynamic tree of the
    same depth costs `depth` forwards) and one lm_head call over the K rows."""
    model, drafter = setup
    calls = {"forward": 0, "logits": 0, "rows": []}
    forward, logits = EagleDrafter.forward, EagleDrafter.logits

    def counted_forward(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    def counted_logits(self, features, *args):
        calls["logits"] += 1
        calls["rows"].append(features.shape[0])
        return logits(self, features, *args)

    monkeypatch.setattr(EagleDrafter, "forward", counted_forward)
    monkeypatch.setattr(EagleDrafter, "logits", counted_logits)
    for name, tree in TREES.items():
        calls.update(forward=0, logits=0, rows=[])
        proposer = RecordingProposer(proposer_for(model, drafter, tree))
        out = generate(model, prompt(6, 12), proposer=proposer, max_new_tokens=20, eos_token_id=())
        n = len(proposer.calls)
        assert n == len(out.steps) and calls["forward"] == n and calls["logits"] == n, (name, calls, n)
        assert set(calls["rows"]) == {K}, (name, calls["rows"])
    eagle = fitted_drafter(model, "eagle3", steps=1)
    calls.update(forward=0, logits=0)
    proposer = RecordingProposer(make_proposer("eagle", drafter=eagle, embed_tokens=model.get_input_embeddings(),
                                               lm_head=model.lm_head, paths=CHAIN))
    generate(model, prompt(6, 12), proposer=proposer, max_new_tokens=20, eos_token_id=())
    assert calls["forward"] == K * len(proposer.calls)  # sequential EAGLE: one forward per depth


@torch.no_grad()
def depth_log_probs(model, drafter, ids: list[int], depth: int) -> torch.Tensor:
    """(depth, N) the drafter's per-depth laws after ids, from scratch: one verifier forward for the
    real features, one causal drafter forward over every pair, the root's and depth-1 placeholders."""
    x = torch.tensor([ids])
    out = model.model(x[:, :-1], output_hidden_states=True)
    layer_hidden = torch.cat([out.hidden_states[i + 1] for i in drafter.config.fusion_layers], dim=-1)
    feats = drafter.input_features(None, layer_hidden)[0]  # (L-1, H): g_0 .. g_{L-2}
    embed = model.get_input_embeddings()
    tokens = embed(torch.tensor(ids[1:]))  # pair j = (x_{j+1}, g_j)
    slots = depth - 1
    mask_embed = embed(torch.tensor([drafter.config.mask_token_id])).expand(slots, -1)
    mask_feat = drafter.placeholder_features()[None].expand(slots, -1)
    pred = drafter(torch.cat([tokens, mask_embed])[None], torch.cat([feats, mask_feat])[None])[0]
    return torch.log_softmax(drafter.logits(pred[-depth:], model.lm_head), dim=-1)


def best_first(logp: torch.Tensor, top_k: int, total: int) -> set[tuple[int, ...]]:
    """The total - 1 best root-to-node rank paths of the product tree, by summed log-prob (brute force)."""
    top = torch.topk(logp, top_k, dim=-1).values.double()  # (depth, k)
    paths = [()]
    for d in range(logp.shape[0]):
        paths += [p + (r,) for p in paths if len(p) == d for r in range(top_k)]
    score = {p: sum(float(top[i, r]) for i, r in enumerate(p)) for p in paths[1:]}
    ranked = sorted(score, key=lambda p: (-score[p], len(p)))
    return set(ranked[: total - 1])


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_drafted_nodes_are_each_depths_topk(setup, tree):
    model, drafter = setup
    proposer = RecordingProposer(proposer_for(model, drafter, tree))
    generate(model, prompt(7, 12), proposer=proposer, max_new_tokens=16, eos_token_id=())
    k = proposer.inner.top_k
    for ids, t in proposer.calls[:4]:  # the first step (prompt pairs) and later ones (accepted pairs)
        tokens, parents = t.tokens.tolist(), t.parents.tolist()
        logp = depth_log_probs(model, drafter, ids, proposer.inner.depth)
        ranks = torch.topk(logp, k, dim=-1).indices  # (depth, k) draft ids
        top = drafter.to_target_ids(ranks).tolist()
        rank_path = {0: ()}
        for u in range(1, len(tokens)):
            d = len(rank_path[parents[u]])
            rank_path[u] = rank_path[parents[u]] + (top[d].index(tokens[u]),)  # ValueError: not its depth's top-k
        if tree == "static":
            assert [rank_path[u] for u in range(1, len(tokens))] == [tuple(p) for p in STATIC]
        else:
            assert set(list(rank_path.values())[1:]) == best_first(logp, k, DYNAMIC["total_tokens"])
            assert all(parents[u] < u for u in range(1, len(tokens)))  # topological


def test_dynamic_tree_with_top1_is_the_chain(setup):
    model, drafter = setup
    chain = RecordingProposer(proposer_for(model, drafter, dict(paths=CHAIN[:3])))
    dyn = RecordingProposer(proposer_for(model, drafter, dict(depth=3, top_k=1, total_tokens=4)))
    a = generate(model, prompt(8, 12), proposer=chain, max_new_tokens=24, eos_token_id=())
    b = generate(model, prompt(8, 12), proposer=dyn, max_new_tokens=24, eos_token_id=())
    assert a.tokens == b.tokens and [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
    assert all(x[1].tokens.tolist() == y[1].tokens.tolist() for x, y in zip(chain.calls, dyn.calls))


@pytest.mark.parametrize("budget", ["fixed", "alternating"])
def test_batched_rows_beside_others_stay_their_greedy_output(setup, budget):
    """P-EAGLE rows (three trees) beside an EAGLE-3 row and a plain row in one engine, rows joining
    as others leave; with `alternating`, every row skips its proposer on some steps (Proposer.skip)
    and has its tree cut to a prefix on the others."""
    model, drafter = setup
    eagle3 = fitted_drafter(model, "eagle3", steps=30)
    embed, head = model.get_input_embeddings(), model.lm_head
    factories = {**{name: (lambda name=name: proposer_for(model, drafter, name)) for name in TREES},
                 "eagle3": lambda: make_proposer("eagle", drafter=eagle3, embed_tokens=embed, lm_head=head,
                                                 paths=[[0], [0, 0], [1]]),
                 "vanilla": lambda: None}
    schedule = [("dynamic", 1, 9, 24, 0), ("vanilla", 2, 5, 10, 0), ("chain", 3, 21, 30, 0), ("eagle3", 4, 7, 16, 2),
                ("static", 5, 12, 20, 3), ("dynamic", 6, 4, 12, 5)]
    kwargs = {} if budget == "fixed" else {"budget": Alternating()}
    engine = Engine(model, max_num_seqs=3, prefill_chunk=8, **kwargs)
    requests, step = {}, 0
    while len(requests) < len(schedule) or engine.busy:
        for i, (kind, seed, length, new, at) in enumerate(schedule):
            if at == step:
                requests[i] = engine.add(prompt(seed, length)[0].tolist(), proposer=factories[kind](),
                                         max_new_tokens=new, eos_token_id=())
        engine.step()
        step += 1
    for i, (kind, seed, length, new, _) in enumerate(schedule):
        r = requests[i]
        assert r.error is None and r.out == reference(model, prompt(seed, length), new, eos_token_id=None), (kind, i)
    peagle_steps = [s for i, (kind, *_) in enumerate(schedule) if kind in TREES for s in requests[i].steps]
    assert sum(s.accepted for s in peagle_steps) > 0
    if budget == "alternating":
        assert any(s.num_nodes == 1 for s in peagle_steps) and any(s.num_nodes == 3 for s in peagle_steps)


def test_bad_arguments_fail_clearly(setup):
    model, drafter = setup
    embed, head = model.get_input_embeddings(), model.lm_head
    with pytest.raises(DraftsmithError, match="5 deep but this P-EAGLE drafter proposes 4 tokens per forward"):
        proposer_for(model, drafter, dict(paths=CHAIN + [[0, 0, 0, 0, 0]]))
    with pytest.raises(DraftsmithError, match="5 deep"):
        proposer_for(model, drafter, dict(depth=5, top_k=2, total_tokens=6))
    with pytest.raises(DraftsmithError, match="needs a P-EAGLE drafter.*use the eagle proposer"):
        make_proposer("peagle", drafter=fitted_drafter(model, "eagle3", steps=1), embed_tokens=embed, lm_head=head,
                      paths=CHAIN)
    with pytest.raises(DraftsmithError, match="draft vocabulary"):
        proposer_for(model, drafter, dict(depth=2, top_k=65, total_tokens=5))


# ---------------------------------------------------------------------------------------------
# sampling law (tests/laws.py's exact enumeration over a V = 8 vocabulary)

LAW_SAMPLES = 3_000
LAW_CASES = {
    # name: (tree kwargs, logit scale, temperature, top_k, top_p)
    "chain-T1-topk6": (dict(paths=tree_paths("chain4")), 25.0, 1.0, 6, 1.0),
    "static-T0.7-topp0.9": (dict(paths=tree_paths("medusa-small")), 10.0, 0.7, 0, 0.9),
    "dynamic-T1": (dict(depth=3, top_k=2, total_tokens=6), 10.0, 1.0, 0, 1.0),
}


def law_proposer(model, tree_kwargs, seed: int = 0):
    """A random P-EAGLE drafter on the law model, drafting with the verifier's full lm_head (its
    guesses are then often right, so deep nodes get accepted and rejected)."""
    torch.manual_seed(seed)
    drafter = EagleDrafter(EagleConfig(model.config.hidden_size, V, model.config.to_dict(), variant="eagle3",
                                       fusion_layers=[0, 1, 1], parallel_tokens=4, mask_token_id=MASK)).to(model.dtype)
    return make_proposer("peagle", drafter=drafter.eval().requires_grad_(False),
                         embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head, **tree_kwargs)


# the one full Monte Carlo case: the dynamic tree from one parallel drafter forward (the broken rule
# below fails on it); the others are smoke runs of the same engine path
FULL_CASE = "dynamic-T1"


def law_setup(case, monkeypatch):
    """(model, proposer, recorder of the accepted paths)."""
    tree_kwargs, scale, _, _, _ = LAW_CASES[case]
    model = law_model(scale)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    return model, law_proposer(model, tree_kwargs), recorder


def assert_paths_exercised(case, recorder, deepest: int = 2) -> None:
    """Rejection, multi-token acceptance (`deepest` drafted tokens in one step) and (in trees) a
    non-first sibling accepted."""
    depths = [len(p) - 1 for p in recorder.paths]
    assert min(depths) == 0 and max(depths) >= deepest
    if not case.startswith("chain"):
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)


@pytest.mark.slow
def test_sampling_law(monkeypatch):
    """The full Monte Carlo law of the dynamic tree: chi-square and a TV bound scaled to the samples."""
    assert_paths_exercised(FULL_CASE, sample_case(LAW_CASES, FULL_CASE, law_setup, monkeypatch, LAW_SAMPLES))


@pytest.mark.parametrize("case", [c for c in LAW_CASES if c != FULL_CASE])
def test_sampling_smoke(case, monkeypatch):
    """The other cases as smoke runs (laws.smoke_counts says what that proves and what proves the law)."""
    recorder = sample_case(LAW_CASES, case, law_setup, monkeypatch)
    # two drafted tokens accepted in one step of the chain is rare (none in 200 generations on seeds
    # 1-3): the smoke run asserts one; the full case asserts two
    assert_paths_exercised(case, recorder, deepest=1 if case.startswith("chain") else 2)


@pytest.mark.slow
def test_sampling_law_catches_a_broken_rule_on_a_peagle_tree(monkeypatch):
    tree_kwargs, scale, temperature, top_k, top_p = LAW_CASES["dynamic-T1"]
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    monkeypatch.setattr(sampling, "rejection_walk", residual_from_p_walk)
    counts = engine_counts(model, law_proposer(model, tree_kwargs), 600, temperature, top_k, top_p, seed=1)
    pvalue, tv, _ = law_test(counts, law)
    assert pvalue < 1e-6, (pvalue, tv)


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_rows_draft_together_what_they_draft_alone(setup, tree, monkeypatch):
    """Forks of one P-EAGLE proposer as rows of one engine: each step ONE drafter forward (pairs,
    roots and placeholders of every row, stacked and padded) serves them all, and each row drafts
    exactly the trees it drafts alone; every output is the verifier's. Teeth: placeholders that
    see their row's padding draft differently."""
    from draftsmith.decode import eagle

    model, drafter = setup
    template = proposer_for(model, drafter, tree)
    prompts = [prompt(71, 9)[0].tolist(), prompt(72, 20)[0].tolist(), prompt(73, 5)[0].tolist()]
    check_rows_draft_as_alone(model, template, prompts, [24, 30, 16], monkeypatch, eagle)
