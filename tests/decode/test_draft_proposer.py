"""decode/draft.py: a separate draft LM as proposer, lossless through the engine.

- greedy identity with ``model.generate(do_sample=False)`` for chains, top-k trees, the
  heuristic length schedule, a confidence threshold, and a draft of another architecture;
- the draft's KV cache equals a fresh prefill of the tokens it holds at every step;
- at temperature > 0 the reported q is the draft's own law after the engine's transform, and
  the first 3 tokens follow the verifier's exact law (chi-square + TV, mirroring
  tests/decode/test_engine.py) with a draft whose q is far from p, for a chain, a tree and an
  adaptive/confidence-cut draft; a rule that resamples from p after a rejection fails it;
- a reduced draft vocabulary (``vocab_rows``): q is zero outside the rows, greedy output and
  the sampled law stay the verifier's, and a proposer that drafts outside the rows is caught;
- int8 draft weights (``quant="int8"``, decode/quant.py): greedy identity, the exact law, and
  the reported q is the int8 draft's own law, not the float draft's;
- the heuristic length grows only when the draft's own deepest node is accepted, not when a
  grafted prompt-lookup branch runs deeper.
"""

import copy

import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.draft import DraftModelProposer, sample_without_replacement
from draftsmith.decode.engine import generate
from draftsmith.decode.sampling import logits_to_probs
from draftsmith.models.errors import DraftsmithError
from tests.decode.rows import check_rows_draft_as_alone
from tests.drafters import noisy_copy
from tests.laws import (assert_engine_law, LAW_PROMPT, RecordingRule, V, assert_cache_is_prefill, engine_counts, exact_law, law_model,
                        law_test, prompt, reference, smoke_counts)
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def models():
    verifier = tiny_llama(eos_token_id=None)
    close = noisy_copy(verifier, 0.008)  # greedy tau ~2 (chain) / ~2.5 (tree [2, 2])
    # another architecture (1 layer, hidden 16): rarely right, so nearly every step rejects
    other = tiny_llama(seed=5, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    # the same greedy proposals as `close`, but a peaked softmax (random tiny Llamas are nearly
    # uniform), so a confidence threshold of 0.5 cuts about half of the branches
    peaked = copy.deepcopy(close)
    peaked.lm_head.weight.data *= 30
    return verifier, {"close": close, "other": other, "peaked": peaked}


GREEDY_CASES = {
    # name: (draft, proposer kwargs)
    "chain4": ("close", dict(num_tokens=4)),
    "tree-2-2": ("close", dict(num_tokens=4, tree_topk=[2, 2])),
    "tree-3": ("close", dict(num_tokens=3, tree_topk=[3])),
    "heuristic": ("close", dict(num_tokens=2, length_schedule="heuristic", max_tokens=8)),
    "confidence": ("peaked", dict(num_tokens=6, tree_topk=[2], confidence=0.5)),
    "other-arch-tree": ("other", dict(num_tokens=3, tree_topk=[4, 2])),
    # a reduced vocabulary of the even ids: every odd verifier token is a sure rejection
    "reduced-vocab-tree": ("close", dict(num_tokens=4, tree_topk=[2], vocab_rows=torch.arange(0, 128, 2))),
    "int8-tree": ("close", dict(num_tokens=4, tree_topk=[2], quant="int8")),
}


def make(models, case: str) -> DraftModelProposer:
    verifier, drafts = models
    draft, kwargs = GREEDY_CASES[case]
    return DraftModelProposer(drafts[draft], verifier.config.vocab_size, **kwargs)


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_identity(models, case, monkeypatch):
    verifier = models[0]
    proposer = make(models, case)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    drafted: list[int] = []  # every token the draft proposed
    propose = proposer.propose

    def recording(*args):
        tree = propose(*args)
        drafted.extend(tree.tokens[1:].tolist())
        return tree

    monkeypatch.setattr(proposer, "propose", recording)
    sizes = []
    for seed, n in [(100, 40), (101, 40), (102, 7), (103, 1), (104, 2)]:
        ids = prompt(seed)
        out = generate(verifier, ids, proposer=proposer, max_new_tokens=n)
        assert out.tokens == reference(verifier, ids, max_new_tokens=n), (case, seed)
        sizes += [s.num_nodes for s in out.steps]
    depths = [len(p) - 1 for p in recorder.paths]
    assert min(depths) == 0  # rejections ran
    if case != "other-arch-tree":
        assert max(depths) >= 2  # several draft tokens accepted in one step
    if case.startswith("tree"):  # a later sibling was accepted: the draft cache kept a non-prefix path
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)
    if case in ("heuristic", "confidence"):
        assert len(set(sizes)) >= 3, sizes  # the draft length really changed
    if case == "reduced-vocab-tree":
        assert drafted and all(t % 2 == 0 for t in drafted), "a token outside the reduced vocabulary was drafted"


def test_reduced_vocab_logits_and_refusals(models):
    """The rows' logits are the full lm_head's on those rows and -inf elsewhere; bad rows are
    refused in one line; tree widths shrink to the rows."""
    verifier, drafts = models
    close = drafts["close"]
    rows = torch.tensor([3, 7, 8, 50, 127])
    proposer = DraftModelProposer(close, 128, num_tokens=2, tree_topk=[9], vocab_rows=rows)
    assert proposer.widths == [5]
    ids = prompt(108)[0].tolist()
    proposer.prefill(torch.tensor(ids), torch.zeros(len(ids), 1), sampling_params(0.0))  # an empty draft cache
    with torch.no_grad():
        got = proposer._to_logits(close.model(torch.tensor([ids])).last_hidden_state[0, -1:])[0]  # (V,)
        want = close(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-12)
    assert bool(torch.isneginf(got[[i for i in range(128) if i not in rows.tolist()]]).all())
    for bad, why in [(torch.tensor([5, 3]), "increasing"), (torch.tensor([1, 128]), "below 128"),
                     (torch.tensor([], dtype=torch.long), "increasing"), (torch.tensor([2, 2]), "increasing")]:
        with pytest.raises(DraftsmithError, match=why) as info:
            DraftModelProposer(close, 128, vocab_rows=bad)
        assert "\n" not in str(info.value)


def test_greedy_identity_eos(models):
    verifier = models[0]
    proposer = make(models, "chain4")
    ids = prompt(105)
    free = reference(verifier, ids, max_new_tokens=30)
    for eos in ([free[11]], [free[0]], [free[20], free[6]]):
        ref = reference(verifier, ids, max_new_tokens=30, eos_token_id=eos)
        out = generate(verifier, ids, proposer=proposer, max_new_tokens=30, eos_token_id=eos)
        assert out.tokens == ref and out.stop_reason == "eos"


class CheckedDraft(DraftModelProposer):
    """After every acceptance the draft cache must be a fresh prefill of the committed text it
    holds, and at most the last accepted draft token and the next root may be unseen."""

    checks = 0

    def propose(self, root, hidden, ids):
        self.ids = list(ids)
        return super().propose(root, hidden, ids)

    def accept(self, tree, path, next_token, hidden):
        super().accept(tree, path, next_token, hidden)
        text = self.ids + tree.tokens[path[1:]].tolist() + [next_token]
        assert len(text) - 2 <= self.cached < len(text)
        assert_cache_is_prefill(self.model, self.cache, text[: self.cached])
        self.checks += 1


@pytest.mark.parametrize("case", ["chain4", "tree-2-2", "heuristic"])
@pytest.mark.parametrize("temperature", [0.0, 0.05])  # 0.05: tiny random Llamas are near-uniform at 1
def test_draft_cache_stays_in_sync(models, case, temperature):
    verifier, drafts = models
    _, kwargs = GREEDY_CASES[case]
    proposer = CheckedDraft(drafts["close"], verifier.config.vocab_size, **kwargs)
    out = generate(verifier, prompt(106), proposer=proposer, max_new_tokens=60, temperature=temperature,
                   generator=torch.Generator().manual_seed(0))
    assert proposer.checks == len(out.steps) >= 5
    accepted = [s.accepted for s in out.steps]
    assert min(accepted) == 0 and max(accepted) >= 2  # rejected and multi-token steps were checked


def test_sampled_drafts_follow_the_calls_generator(models):
    """At T > 0 the draft's own draws are reseeded from the call's generator (seed_draws): the
    same seed gives the same drafts and output on every call, another seed other drafts. (A
    stream that carried on across calls made seeded requests irreproducible; a stream reset to
    a fixed seed would repeat one "sample" per context and bias the law.)"""
    verifier, drafts = models
    proposer = DraftModelProposer(drafts["close"], 128, num_tokens=3, tree_topk=[2], seed=0)
    drafted: list[list[int]] = []
    propose = proposer.propose

    def recording(*args):
        tree = propose(*args)
        drafted[-1].append(tuple(tree.tokens.tolist()))
        return tree

    proposer.propose = recording
    outs = []
    for seed in (7, 7, 8):
        drafted.append([])
        out = generate(verifier, prompt(112), proposer=proposer, max_new_tokens=20, temperature=1.0,
                       generator=torch.Generator().manual_seed(seed))
        outs.append(out.tokens)
    assert outs[0] == outs[1] and drafted[0] == drafted[1]
    assert drafted[2] != drafted[0]


def test_reported_q_is_the_drafts_own_law(models):
    """At T > 0 each sampled node reports q = logits_to_probs(draft logits) and its children
    are distinct tokens with q > 0 (drawn without replacement)."""
    verifier, drafts = models
    close = drafts["close"]
    proposer = DraftModelProposer(close, verifier.config.vocab_size, num_tokens=2, tree_topk=[3, 2])
    ids = prompt(107)[0]
    params = sampling_params(0.7, top_k=20, top_p=0.9)
    proposer.prefill(ids, torch.zeros(len(ids), 1), params)
    root = 42
    tree = proposer.propose(root, torch.zeros(1), [*ids.tolist(), root])
    with torch.no_grad():
        logits = close(torch.tensor([[*ids.tolist(), root]])).logits[0, -1]  # (V,)
    torch.testing.assert_close(tree.draft_probs[0], logits_to_probs(logits, 0.7, 20, 0.9), rtol=0, atol=1e-12)
    parents = tree.parents.tolist()
    assert parents == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    assert tree.sampled.tolist() == [True, True, True, True] + [False] * 6
    for u in range(4):
        kids = [c for c in range(len(parents)) if parents[c] == u]
        toks = tree.tokens[kids]
        assert toks.unique().numel() == len(kids)
        assert bool((tree.draft_probs[u, toks] > 0).all())
    # the depth-1 rows are the draft's law after root + that child (the tree mask was right)
    for c in (1, 2, 3):
        with torch.no_grad():
            lc = close(torch.tensor([[*ids.tolist(), root, int(tree.tokens[c])]])).logits[0, -1]
        torch.testing.assert_close(tree.draft_probs[c], logits_to_probs(lc, 0.7, 20, 0.9), rtol=0, atol=1e-12)


def test_reported_q_of_a_reduced_vocab_is_zero_outside_it(models):
    verifier, drafts = models
    close, rows = drafts["close"], torch.arange(1, 128, 3)
    proposer = DraftModelProposer(close, 128, num_tokens=2, tree_topk=[3], vocab_rows=rows)
    ids = prompt(109)[0]
    proposer.prefill(ids, torch.zeros(len(ids), 1), sampling_params(0.05))
    tree = proposer.propose(42, torch.zeros(1), [*ids.tolist(), 42])
    with torch.no_grad():
        logits = close(torch.tensor([[*ids.tolist(), 42]])).logits[0, -1]  # (V,)
    outside = torch.ones(128, dtype=torch.bool)
    outside[rows] = False
    want = logits_to_probs(logits.masked_fill(outside, float("-inf")), 0.05, 0, 1.0)
    torch.testing.assert_close(tree.draft_probs[0], want, rtol=0, atol=1e-12)
    assert float(tree.draft_probs[tree.sampled][:, outside].abs().sum()) == 0.0
    assert all(int(t) % 3 == 1 for t in tree.tokens[1:])


def test_reported_q_of_an_int8_draft_is_its_own_law(models):
    """quant="int8": q is the law of the draft with int8 rows (its layers and its lm_head
    rows), not of the float draft, and the draft model handed in keeps its float weights."""
    from draftsmith.decode.quant import int8_copy

    verifier, drafts = models
    close, rows = drafts["close"], torch.arange(0, 128, 2)
    proposer = DraftModelProposer(close, 128, num_tokens=2, tree_topk=[3], vocab_rows=rows, quant="int8")
    assert sum(isinstance(m, torch.nn.Linear) for m in close.modules()) == 2 * 7 + 1  # untouched
    ids = prompt(110)[0]
    proposer.prefill(ids, torch.zeros(len(ids), 1), sampling_params(0.05))
    tree = proposer.propose(42, torch.zeros(1), [*ids.tolist(), 42])
    outside = torch.ones(128, dtype=torch.bool)
    outside[rows] = False
    with torch.no_grad():
        context = torch.tensor([[*ids.tolist(), 42]])
        int8_logits = int8_copy(close)(context).logits[0, -1]  # (V,): the lm_head quantized row by row too
        float_logits = close(context).logits[0, -1]
    want = logits_to_probs(int8_logits.masked_fill(outside, float("-inf")), 0.05, 0, 1.0)
    torch.testing.assert_close(tree.draft_probs[0], want, rtol=0, atol=1e-12)
    unquantized = logits_to_probs(float_logits.masked_fill(outside, float("-inf")), 0.05, 0, 1.0)
    assert float((tree.draft_probs[0] - unquantized).abs().max()) > 1e-6  # the int8 weights really ran


def test_heuristic_length_grows_only_when_the_drafts_deepest_node_is_accepted(models):
    """With prompt lookup grafted on, the accepted path may leave the draft's chain at depth 1
    and run deeper through grafted nodes: that is the lookup's success, and the draft length
    falls by 1; a path through the draft's own deepest node (grafted nodes may continue it)
    lengthens it by 2, HF's rule."""
    verifier, drafts = models
    ids = prompt(111)[0]

    def step(grafted_tokens, grafted_parents, path):
        """Draft root + 2 nodes, graft nodes 3.. onto them, accept `path` -> the next length."""
        proposer = DraftModelProposer(drafts["close"], 128, num_tokens=2, length_schedule="heuristic", max_tokens=8)
        proposer.prefill(ids, torch.zeros(len(ids), 1), sampling_params(0.0))
        tree = proposer.propose(42, torch.zeros(1), [*ids.tolist(), 42])
        assert tree.parents.tolist() == [-1, 0, 1]
        a = int(tree.tokens[1])
        tokens = tree.tokens.tolist() + [(a + 1) % 128 if t is None else t for t in grafted_tokens]
        grafted = type(tree)(tokens=torch.tensor(tokens), parents=torch.tensor([-1, 0, 1, *grafted_parents]))
        proposer.accept(grafted, path, 7, torch.zeros(len(tokens), 1))
        return proposer.length

    # a graft leaving at the root (None: a token other than the draft's first) and running 3
    # deep: the path 0 -> 3 -> 4 -> 5 holds no draft node
    assert step([None, 5, 6], [0, 3, 4], [0, 3, 4, 5]) == 1
    assert step([9], [2], [0, 1, 2, 3]) == 4  # the draft's chain accepted and the graft continues it
    assert step([], [], [0, 1, 2]) == 4  # the draft's chain alone, fully accepted
    assert step([], [], [0, 1]) == 1  # its second node rejected


def sampling_params(temperature, top_k=0, top_p=1.0):
    from draftsmith.decode.proposers import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def test_sample_without_replacement():
    q = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = [tuple(sample_without_replacement(q, 2, g)) for _ in range(4000)]
    assert all(len(set(d)) == 2 and 1 not in d for d in draws)
    first = torch.tensor([d[0] for d in draws])
    assert abs(float((first == 0).double().mean()) - 0.5) < 0.03
    # second draw given first = 0 is q without 0: 0.6 / 0.4
    second = torch.tensor([d[1] for d in draws if d[0] == 0])
    assert abs(float((second == 2).double().mean()) - 0.6) < 0.04
    assert sample_without_replacement(q, 5, g).__len__() == 3  # only 3 tokens have mass


def test_config_errors_are_one_line(models):
    verifier = models[0]
    small_vocab = tiny_llama(vocab_size=64)
    with pytest.raises(DraftsmithError, match="vocabulary has 64 tokens but the verifier's has 128") as info:
        DraftModelProposer(small_vocab, verifier.config.vocab_size)
    assert "\n" not in str(info.value)
    with pytest.raises(DraftsmithError, match="decode.length_schedule='grow'.*valid: fixed, heuristic"):
        DraftModelProposer(models[1]["close"], 128, length_schedule="grow")
    with pytest.raises(DraftsmithError, match="decode.min_tokens"):
        DraftModelProposer(models[1]["close"], 128, num_tokens=4, max_tokens=2)
    with pytest.raises(DraftsmithError, match="decode.draft_quant='int4'.*valid: int8, none") as info:
        DraftModelProposer(models[1]["close"], 128, quant="int4")
    assert "\n" not in str(info.value)
    eager_free = tiny_llama()
    eager_free.config._attn_implementation = "flash_attention_2"  # takes no 4D float mask
    with pytest.raises(DraftsmithError, match="decode.tree_topk"):
        DraftModelProposer(eager_free, 128, tree_topk=[2])
    DraftModelProposer(eager_free, 128)  # a chain needs no tree mask


# ---------------------------------------------------------------------------------------------
# sampling law: the draft's q is far from the verifier's p

# the one full Monte Carlo case (a sampled tree at T < 1 with top-p: q cut like p, siblings drawn
# without replacement); the other cases are smoke runs of the same engine path
FULL_CASE = "tree-T0.7-topp0.9"
# 3k (~5 ms per sample on an idle core: ~15 s): TV 0.038-0.055 against the scaled bound of 0.077 on
# seeds 1-3 (chi-square p 0.016-0.89); laws.residual_from_p_walk fails this case at 1k (p 7e-26)
DRAFT_LAW_SAMPLES = 3_000


def law_draft(logit_scale: float):
    """A 1-layer draft over the same 8 tokens with its own random weights: q far from p."""
    draft = tiny_llama(vocab_size=V, eos_token_id=None, pad_token_id=None, seed=16, num_hidden_layers=1)
    draft.lm_head.weight.data *= logit_scale
    return draft


LAW_CASES = {
    # name: (verifier logit scale, proposer kwargs, temperature, top_k, top_p)
    "chain-T1": (25.0, dict(num_tokens=2), 1.0, 0, 1.0),
    "tree-T0.7-topp0.9": (10.0, dict(num_tokens=2, tree_topk=[2, 2]), 0.7, 0, 0.9),
    "heuristic-confidence-T1-topk6": (
        25.0, dict(num_tokens=2, length_schedule="heuristic", min_tokens=2, max_tokens=4, confidence=0.3,
                   tree_topk=[2]), 1.0, 6, 1.0),
    # q is zero on tokens 3, 5 and 7, which the verifier's law still reaches through (p - q)+
    "reduced-vocab-tree-T1": (25.0, dict(num_tokens=2, tree_topk=[2], vocab_rows=torch.tensor([0, 1, 2, 4, 6])),
                              1.0, 0, 1.0),
    "int8-chain-T1": (25.0, dict(num_tokens=2, quant="int8"), 1.0, 0, 1.0),
}


def first_token_tv(model, draft, temperature, top_k, top_p) -> float:
    with torch.no_grad():
        p = logits_to_probs(model(LAW_PROMPT).logits[0, -1], temperature, top_k, top_p)
        q = logits_to_probs(draft(LAW_PROMPT).logits[0, -1], temperature, top_k, top_p)
    return 0.5 * float((p - q).abs().sum())


def law_setup(case, monkeypatch):
    """(model, proposer, recorder of the accepted paths, list the tree sizes are appended to)."""
    scale, kwargs, temperature, top_k, top_p = LAW_CASES[case]
    model, draft = law_model(scale), law_draft(10.0)
    assert first_token_tv(model, draft, temperature, top_k, top_p) > 0.5  # q really differs from p
    proposer = DraftModelProposer(draft, V, seed=3, **kwargs)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    sizes: list[int] = []
    record_sizes(monkeypatch, proposer, sizes)
    return model, proposer, recorder, sizes


def assert_paths_exercised(case, recorder, sizes) -> None:
    """Rejection, multi-token acceptance, a non-first sibling in trees, a varying heuristic tree."""
    depths = [len(p) - 1 for p in recorder.paths]
    assert min(depths) == 0 and max(depths) >= 2
    if "tree" in case:
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)
    if "heuristic" in case:
        assert len(set(sizes)) >= 3, set(sizes)  # length and confidence cuts changed the tree


@pytest.mark.slow
def test_sampling_law(monkeypatch):
    """The full Monte Carlo law of the richest case: chi-square and a TV bound scaled to the samples."""
    _, _, temperature, top_k, top_p = LAW_CASES[FULL_CASE]
    model, proposer, recorder, sizes = law_setup(FULL_CASE, monkeypatch)
    assert_engine_law(model, proposer, DRAFT_LAW_SAMPLES, temperature, top_k, top_p)
    assert_paths_exercised(FULL_CASE, recorder, sizes)


@pytest.mark.parametrize("case", [c for c in LAW_CASES if c != FULL_CASE])
def test_sampling_smoke(case, monkeypatch):
    """The other cases as smoke runs (laws.smoke_counts says what that proves and what proves the law)."""
    _, _, temperature, top_k, top_p = LAW_CASES[case]
    model, proposer, recorder, sizes = law_setup(case, monkeypatch)
    smoke_counts(model, proposer, temperature, top_k, top_p)
    assert_paths_exercised(case, recorder, sizes)


def record_sizes(monkeypatch, proposer, sizes: list[int]) -> None:
    propose = proposer.propose

    def recording(*args):
        tree = propose(*args)
        sizes.append(tree.size)
        return tree

    monkeypatch.setattr(proposer, "propose", recording)


def resample_from_p_walk(tokens, parents, target_probs, draft_probs, sampled, generator):
    """BROKEN ON PURPOSE (a chain rule): accepts x ~ q with min(1, p(x)/q(x)) as it should,
    but after a rejection draws from p instead of norm((p - q)+), which over-weights the
    tokens q also likes."""
    tok, plist = tokens.tolist(), parents.tolist()
    path, u = [0], 0
    while True:
        p, q = target_probs[u], draft_probs[u]
        child = next((c for c in range(1, len(plist)) if plist[c] == u), None)
        if child is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        x = tok[child]
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, float(p[x] / q[x])):
            path.append(child)
            u = child
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))  # bug: should be (p - q)+


@pytest.mark.slow
def test_sampling_law_catches_a_broken_rule(monkeypatch):
    scale, kwargs, temperature, top_k, top_p = LAW_CASES["chain-T1"]
    model, draft = law_model(scale), law_draft(10.0)
    law = exact_law(model, temperature, top_k, top_p)
    proposer = DraftModelProposer(draft, V, seed=3, **kwargs)
    monkeypatch.setattr(sampling, "rejection_walk", resample_from_p_walk)
    counts = engine_counts(model, proposer, 1_000, temperature, top_k, top_p, seed=1)
    pvalue, tv, _ = law_test(counts, law)
    assert pvalue < 1e-6, (pvalue, tv)


@pytest.mark.parametrize("case, temperature", [("tree-2-2", 0.0), ("heuristic", 0.0), ("confidence", 0.0),
                                               ("tree-3", 1.0), ("int8-tree", 0.0)])
def test_rows_draft_together_what_they_draft_alone(models, case, temperature, monkeypatch):
    """Forks of one draft proposer as rows of one engine: each level of every row is ONE draft
    forward (their caches stacked, padded, at different lengths; one row's 20-token prompt fed
    first alone; rows drafting different depths with the heuristic schedule or a confidence cut),
    and each row drafts exactly the trees it drafts alone, from its own seeded draws at T > 0;
    every output is what it is alone (the verifier's at T = 0). Teeth: a mask that lets a token
    see every slot of its row (padding, other branches) changes what is drafted."""
    from draftsmith.decode import draft

    verifier = models[0]
    template = make(models, case)
    prompts = [prompt(121, 9)[0].tolist(), prompt(122, 20)[0].tolist(), prompt(123, 5)[0].tolist()]
    seeded = (lambda i: dict(temperature=temperature, generator=torch.Generator().manual_seed(i))) if temperature else None
    together = check_rows_draft_as_alone(verifier, template, prompts, [24, 30, 16], monkeypatch, draft, seeded)
    if case == "heuristic":
        assert len({len(t[0]) for _, trees in together for t in trees}) > 2  # rows drafted different depths
