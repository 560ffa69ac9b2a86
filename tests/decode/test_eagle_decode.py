"""decode/eagle.py through the engine: EAGLE-1/3 proposers are lossless and draft what they claim.

- greedy identity with HF ``generate`` for a chain, a static tree and an EAGLE-2 dynamic tree,
  with drafters briefly fitted to the verifier (multi-token acceptance AND rejections happen);
- every drafted node is the drafter's own top-k on its path, recomputed from scratch without
  any cache (so the drafter's KV cache, positions and tree masks are right);
- the sampling law of the first 3 tokens (chi-square + TV) for chain, static and dynamic trees,
  and a deliberately broken rule fails it with an EAGLE-2 tree;
- the engine asks the verifier for extra layers only when a proposer needs them.
"""
import copy

import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate, truncate
from draftsmith.decode.proposers import make_proposer
from draftsmith.models.errors import DraftsmithError
from tests.decode.rows import check_rows_draft_as_alone
from tests.drafters import fitted_drafter, random_eagle_proposer
from tests.laws import (sample_case, RecordingProposer, RecordingRule, engine_counts, exact_law, law_model, law_test,
                        prompt, reference, residual_from_p_walk, tree_paths)
from tests.tiny import tiny_llama

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
DYNAMIC = dict(depth=4, top_k=3, total_tokens=10)
TREES = {"chain": dict(paths=CHAIN), "static": dict(paths=STATIC), "dynamic": DYNAMIC}


@pytest.fixture(scope="module")
def greedy_setup():
    torch.set_num_threads(1)
    model = tiny_llama().requires_grad_(False)
    drafters = {"eagle1": fitted_drafter(model, "eagle1"),
                "eagle3": fitted_drafter(model, "eagle3", ttt=2, draft_vocab_size=64)}
    return model, drafters


def proposer_for(model, drafter, tree: str):
    return make_proposer("eagle", drafter=drafter, embed_tokens=model.get_input_embeddings(),
                         lm_head=model.lm_head, **TREES[tree])


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", list(TREES))
def test_greedy_identity(greedy_setup, variant, tree, monkeypatch):
    model, drafters = greedy_setup
    proposer = proposer_for(model, drafters[variant], tree)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    steps = []
    for seed, n in [(1, 40), (2, 40), (3, 7)]:
        ids = prompt(seed, length=10 + seed)
        out = generate(model, ids, proposer=proposer, max_new_tokens=n, eos_token_id=())
        assert out.tokens == reference(model, ids, n, eos_token_id=None), (variant, tree, seed)
        steps += out.steps
    assert sum(s.emitted for s in steps) / len(steps) > 1.5  # multi-token acceptance...
    assert any(s.accepted == 0 for s in steps)  # ...and rejections
    if tree != "chain":  # a non-first child of the root accepted: the cache keep is not a prefix
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)
    if tree == "dynamic":
        assert all(s.num_nodes <= DYNAMIC["total_tokens"] for s in steps)
        assert max(s.num_nodes for s in steps) == DYNAMIC["total_tokens"]


@pytest.mark.parametrize("kind", ["int8", "packed"])
@pytest.mark.parametrize("variant, tree", [("eagle1", "static"), ("eagle3", "dynamic")])
def test_greedy_identity_with_an_int8_or_packed_drafter(greedy_setup, variant, tree, kind):
    """quant="int8": an int8 copy of the drafter drafts (its own lm_head too: eagle3 here has a
    64-token one); weights="packed": an fp32 copy on oneDNN-prepacked weights (what
    decode.draft_weights=auto gives an fp32 drafter on an AVX2 CPU). The drafter handed in keeps its
    weights, the output is still the verifier's."""
    from draftsmith.decode.quant import Int8Linear, PackedLinear
    from draftsmith.models.verifier import cpu_prepacks

    model, drafters = greedy_setup
    drafter = drafters[variant]
    if kind == "packed":
        drafter = copy.deepcopy(drafter).float()  # the fp64 verifier's states are cast to it
        if not cpu_prepacks(torch.float32):  # a CPU without the kernel: refused in one line, not ignored
            with pytest.raises(DraftsmithError, match="decode.draft_weights=packed"):
                make_proposer("eagle", drafter=drafter, embed_tokens=model.get_input_embeddings(),
                              lm_head=model.lm_head, weights="packed", **TREES[tree])
            return
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    proposer = make_proposer("eagle", drafter=drafter, embed_tokens=model.get_input_embeddings(),
                             lm_head=model.lm_head, **({"quant": "int8"} if kind == "int8" else {"weights": "packed"}),
                             **TREES[tree])
    assert any(isinstance(m, Int8Linear if kind == "int8" else PackedLinear) for m in proposer.drafter.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in proposer.drafter.modules())
    assert isinstance(model.lm_head, torch.nn.Linear)  # the verifier's lm_head is never swapped
    steps = []
    for seed, n in [(1, 40), (2, 40)]:
        ids = prompt(seed, length=10 + seed)
        out = generate(model, ids, proposer=proposer, max_new_tokens=n, eos_token_id=())
        assert out.tokens == reference(model, ids, n, eos_token_id=None), (variant, tree, seed)
        steps += out.steps
    assert sum(s.emitted for s in steps) / len(steps) > 1.5 and any(s.accepted == 0 for s in steps)
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="decode.draft_quant='int4'.*valid: int8, none"):
        make_proposer("eagle", drafter=drafter, embed_tokens=model.get_input_embeddings(),
                      lm_head=model.lm_head, quant="int4", **TREES[tree])


def test_greedy_identity_with_eos(greedy_setup):
    model, drafters = greedy_setup
    ids = prompt(5, 12)
    free = reference(model, ids, 30, eos_token_id=None)
    for tree in TREES:
        ref = reference(model, ids, 30, eos_token_id=free[12])
        out = generate(model, ids, proposer=proposer_for(model, drafters["eagle1"], tree), max_new_tokens=30,
                       eos_token_id=free[12])
        assert out.tokens == ref and out.stop_reason == "eos"


@torch.no_grad()
def drafter_next_log_probs(model, drafter, ids: list[int], drafted: list[int]) -> torch.Tensor:
    """The drafter's log-probs (N,) after ids + drafted, from scratch: one verifier forward for the
    real features, then the drafter over the whole pair sequence per drafted token, no cache."""
    x = torch.tensor([ids])
    out = model.model(x[:, :-1], output_hidden_states=True)
    layers = drafter.config.fusion_layers
    layer_hidden = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1) if layers else None
    feats = drafter.input_features(out.last_hidden_state, layer_hidden)[0]  # (L-1, H): f_0 .. f_{L-2}
    tokens = ids[1:]  # pair j = (x_{j+1}, f_j)
    embed = model.get_input_embeddings()
    for step in range(len(drafted) + 1):
        pred = drafter(embed(torch.tensor([tokens])), feats[None])[0, -1]  # (H,) after the last token
        if step == len(drafted):
            return torch.log_softmax(drafter.logits(pred, model.lm_head), dim=-1)
        tokens = tokens + [drafted[step]]
        feats = torch.cat([feats, pred[None]])


@pytest.mark.parametrize("variant", ["eagle1", "eagle3"])
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_drafted_nodes_are_the_drafters_own_topk(greedy_setup, variant, tree):
    model, drafters = greedy_setup
    drafter = drafters[variant]
    proposer = RecordingProposer(proposer_for(model, drafter, tree))
    generate(model, prompt(7, 12), proposer=proposer, max_new_tokens=16, eos_token_id=())
    k = proposer.inner.top_k
    for ids, t in proposer.calls[:4]:  # the first step (prompt pairs) and later ones (accepted pairs)
        tokens, parents = t.tokens.tolist(), t.parents.tolist()
        for u in range(len(tokens)):
            kids = [c for c in range(1, len(tokens)) if parents[c] == u]
            if not kids:
                continue
            path, v = [], u
            while v > 0:
                path.append(tokens[v])
                v = parents[v]
            logp = drafter_next_log_probs(model, drafter, ids, path[::-1])
            top = drafter.to_target_ids(torch.topk(logp, k).indices).tolist()
            kid_tokens = [tokens[c] for c in kids]
            if tree == "static":
                assert kid_tokens == top[: len(kids)]
            else:
                assert set(kid_tokens) <= set(top)


def test_dynamic_tree_with_top1_is_the_chain(greedy_setup):
    model, drafters = greedy_setup
    chain = RecordingProposer(make_proposer("eagle", drafter=drafters["eagle1"], embed_tokens=model.get_input_embeddings(),
                                            lm_head=model.lm_head, paths=CHAIN[:3]))
    dyn = RecordingProposer(make_proposer("eagle", drafter=drafters["eagle1"], embed_tokens=model.get_input_embeddings(),
                                          lm_head=model.lm_head, depth=3, top_k=1, total_tokens=4))
    a = generate(model, prompt(8, 12), proposer=chain, max_new_tokens=24, eos_token_id=())
    b = generate(model, prompt(8, 12), proposer=dyn, max_new_tokens=24, eos_token_id=())
    assert a.tokens == b.tokens and [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
    assert all(x[1].tokens.tolist() == y[1].tokens.tolist() for x, y in zip(chain.calls, dyn.calls))


def test_a_cut_of_a_dynamic_tree_is_the_tree_reranked_that_small(greedy_setup):
    # The load-aware budget verifies a tree's first w nodes: EAGLE-2's nodes are numbered best
    # first, so that cut is the tree EAGLE-2 itself keeps with total_tokens = w.
    model, drafters = greedy_setup
    # a pool drafted 3 deep, 2 wide: node -> (parent, cumulative log-prob); a confident chain 1-3-7
    pool = {1: (0, -0.1), 2: (0, -1.5), 3: (1, -0.2), 4: (1, -2.0), 5: (2, -1.6), 6: (2, -3.0),
            7: (3, -0.25), 8: (3, -2.2)}
    tok, par, dep, score = [50], [-1], [0], [0.0]
    for node, (parent, logp) in pool.items():
        tok, par, dep, score = tok + [50 + node], par + [parent], dep + [dep[parent] + 1], score + [logp]
    proposer = make_proposer("eagle", drafter=drafters["eagle3"], embed_tokens=model.get_input_embeddings(),
                             lm_head=model.lm_head, depth=3, top_k=2, total_tokens=9)
    whole = proposer._rerank(tok, par, dep, score)
    assert whole.tokens.tolist() == [50, 51, 53, 57, 52, 55, 54, 58, 56]  # best first
    for w in range(1, 10):
        proposer.total_tokens = w
        small, cut = proposer._rerank(tok, par, dep, score), truncate(whole, w)
        assert cut.tokens.tolist() == small.tokens.tolist() and cut.parents.tolist() == small.parents.tolist()
    # the same on trees the drafter builds (the first step of each prompt: the same prefix and state)
    for w in (3, 4):
        wide, narrow = (RecordingProposer(make_proposer("eagle", drafter=drafters["eagle3"],
                                                        embed_tokens=model.get_input_embeddings(),
                                                        lm_head=model.lm_head, depth=4, top_k=3, total_tokens=n))
                        for n in (10, w))
        for seed in range(10, 16):
            for proposer in (wide, narrow):
                generate(model, prompt(seed, 12), proposer=proposer, max_new_tokens=4, eos_token_id=())
        same = [(w_, n) for (ids, w_), (ids_n, n) in zip(wide.calls, narrow.calls) if ids == ids_n]  # same prefix
        assert len(same) >= 6
        for tree, small in same:
            cut = truncate(tree, w)
            assert cut.tokens.tolist() == small.tokens.tolist() and cut.parents.tolist() == small.parents.tolist()


@pytest.mark.parametrize("forward", ["fast", "hf"])
def test_engine_asks_for_layers_only_when_needed(greedy_setup, monkeypatch, forward):
    """The verifier forward captures layer states only for a proposer that reads them (EAGLE-3)."""
    from draftsmith.decode import forward as forwards

    model, drafters = greedy_setup
    impl = {"fast": forwards.FastLlama, "hf": forwards.HFForward}[forward]
    seen = []
    original = impl.many  # (the engine's every verifier forward: its steps and the layers captured)

    def spy(self, steps, capture=()):
        seen.append(tuple(capture))
        return original(self, steps, capture)

    monkeypatch.setattr(impl, "many", spy)
    generate(model, prompt(9, 12), proposer=proposer_for(model, drafters["eagle1"], "chain"), max_new_tokens=8,
             forward=forward)
    assert seen and not any(seen)
    seen.clear()
    generate(model, prompt(9, 12), proposer=proposer_for(model, drafters["eagle3"], "chain"), max_new_tokens=8,
             forward=forward)
    assert seen and all(c == tuple(sorted(set(drafters["eagle3"].config.fusion_layers))) for c in seen)


def test_bad_arguments_fail_clearly(greedy_setup):
    model, drafters = greedy_setup
    kwargs = dict(drafter=drafters["eagle1"], embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head)
    with pytest.raises(ValueError, match="depth, top_k and total_tokens"):
        make_proposer("eagle", **kwargs, depth=3)
    with pytest.raises(ValueError, match="not both"):
        make_proposer("eagle", **kwargs, paths=CHAIN, depth=3, top_k=2, total_tokens=5)
    with pytest.raises(ValueError, match="draft vocabulary"):
        make_proposer("eagle", drafter=drafters["eagle3"], embed_tokens=model.get_input_embeddings(),
                      lm_head=model.lm_head, depth=2, top_k=65, total_tokens=5)


# ---------------------------------------------------------------------------------------------
# sampling law (tests/laws.py's exact enumeration over a V = 8 vocabulary)

LAW_SAMPLES = 3_000  # 7-15 ms per 3-token generate on the shared 2-core box: under a minute
LAW_CASES = {
    # name: (tree kwargs, logit scale, temperature, top_k, top_p)
    "chain-T1-topk6": (dict(paths=tree_paths("chain4")), 25.0, 1.0, 6, 1.0),
    "static-T0.7-topp0.9": (dict(paths=tree_paths("medusa-small")), 10.0, 0.7, 0, 0.9),
    "dynamic-T1": (dict(depth=3, top_k=2, total_tokens=6), 10.0, 1.0, 0, 1.0),
    "int8-dynamic-T1": (dict(depth=3, top_k=2, total_tokens=6, quant="int8"), 10.0, 1.0, 0, 1.0),
}
# the one full Monte Carlo case: EAGLE-2's dynamic tree (the tree this proposer adds; the broken rule
# below fails on it); the others are smoke runs of the same engine path
FULL_CASE = "dynamic-T1"


def law_setup(case, monkeypatch):
    """(model, proposer, recorder of the accepted paths)."""
    tree_kwargs, scale, _, _, _ = LAW_CASES[case]
    model = law_model(scale)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    return model, random_eagle_proposer(model, tree_kwargs), recorder


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
def test_sampling_law_catches_a_broken_rule_on_a_dynamic_tree(monkeypatch):
    tree_kwargs, scale, temperature, top_k, top_p = LAW_CASES["dynamic-T1"]
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    monkeypatch.setattr(sampling, "rejection_walk", residual_from_p_walk)
    counts = engine_counts(model, random_eagle_proposer(model, tree_kwargs), 600, temperature, top_k, top_p, seed=1)
    pvalue, tv, _ = law_test(counts, law)
    assert pvalue < 1e-6, (pvalue, tv)


BATCH_PROMPTS = [prompt(61, 9)[0].tolist(), prompt(62, 20)[0].tolist(), prompt(63, 5)[0].tolist()]  # 20 > CATCH_UP


@pytest.mark.parametrize("variant, tree", [("eagle1", "static"), ("eagle1", "dynamic"), ("eagle3", "chain"),
                                           ("eagle3", "dynamic")])
def test_rows_draft_together_what_they_draft_alone(greedy_setup, variant, tree, monkeypatch):
    """Forks of one proposer as rows of one engine: ONE drafter forward serves every row at each
    stage (their caches stacked, padded, at different lengths, one row's 20-token prompt fed
    first alone), and each row drafts exactly the trees it drafts decoding alone, step by step;
    every output is the verifier's. Teeth: a mask that lets a query see every slot (its row's
    padding and sibling nodes) changes what is drafted."""
    from draftsmith.decode import eagle

    model, drafters = greedy_setup
    template = proposer_for(model, drafters[variant], tree)
    check_rows_draft_as_alone(model, template, BATCH_PROMPTS, [24, 30, 16], monkeypatch, eagle)
