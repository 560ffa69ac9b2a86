"""decode/lookup.py PromptLookupGraft: prompt lookup grafted onto an EAGLE or Medusa tree.

- ``graft`` on hand-made trees: the drafter's nodes keep their indices, a continuation follows
  matching nodes and hangs new ones after them, siblings stay distinct; the grafted tree leads
  with the continuations (``lead_with``), so a step cut to its first nodes keeps them; grafted rows
  of one engine under a budget that cuts and skips stay their own greedy output (the draft model
  told each step in its own numbering) and cut steps accept grafted nodes;
- greedy identity with ``model.generate(do_sample=False)`` (tiny fp64 Llama) for EAGLE-1/3
  (dynamic tree and chain), Medusa and a draft model with a graft, grafted nodes were accepted,
  and the draft's own cache stayed a prefill of the accepted text;
- the sampling law of the first 3 tokens with a grafted EAGLE-2 tree at T=1 is the verifier's
  exact law (chi-square + TV, as tests/decode/test_eagle_decode.py), and a broken rule fails it;
- the decode presets: every EAGLE / Medusa preset has the keys, ``decode.lookup_tokens`` builds
  the graft through decode/evaluate.py; a sampled tree, a draft model at T > 0, bad values refused.
"""

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate, truncate
from draftsmith.decode.evaluate import run
from draftsmith.decode.lookup import PromptLookupGraft, graft, lead_with
from draftsmith.decode.build import load_preset, with_lookup
from draftsmith.decode.proposers import DraftTree
from draftsmith.decode.tree import path_to
from draftsmith.models.errors import DraftsmithError
from tests.conftest import tiny_model_overrides
from tests.decode.grafts import GRAFTED_PRESETS, inner_proposer
from tests.drafters import random_eagle_proposer
from tests.laws import (RecordingRule, engine_counts, exact_law, law_model, law_test, residual_from_p_walk,
                        tv_bound)
from tests.hub import compose_config
from tests.tiny import save_tiny_medusa, tiny_llama


def test_graft_keeps_the_drafters_nodes_and_appends_the_rest():
    # root 9; drafted: 5 (1), 4 (2) under the root, 6 (3) under 5
    tokens, parents, nodes = graft([9, 5, 4, 6], [-1, 0, 0, 1], [[5, 6, 7, 8], [3], [4]])
    assert tokens[:4] == [9, 5, 4, 6] and parents[:4] == [-1, 0, 0, 1]
    assert tokens == [9, 5, 4, 6, 7, 8, 3] and parents == [-1, 0, 0, 1, 3, 4, 0]
    assert nodes == [[1, 3, 4, 5], [6], [2]]
    for k, path in enumerate([[5, 6, 7, 8], [3], [4]]):
        assert [tokens[i] for i in path_to(parents, nodes[k][-1])[1:]] == path
    assert graft([9, 5], [-1, 0], []) == ([9, 5], [-1, 0], [])


class Spy:
    """Records every verified step of a grafted proposer: (nodes verified, nodes accepted past the
    root, an accepted node was grafted: its root path is not in the drafter's own tree; the grafted
    tree leads with the continuations, so indices do not tell)."""

    def __init__(self, proposer):
        self.verified, self.own = [], set()
        grafted, accept = proposer.grafted, proposer.accept

        def spy(tree, ids):
            self.own = root_paths(tree)
            return grafted(tree, ids)

        def spied_accept(tree, path, *args, **kwargs):  # the tree as verified (a cut step: its first nodes)
            self.verified.append((tree.size, len(path) - 1, any(root_path(tree, v) not in self.own for v in path)))
            return accept(tree, path, *args, **kwargs)

        proposer.grafted, proposer.accept = spy, spied_accept


def root_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[path_to(tree.parents, node)].tolist())


def root_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {root_path(tree, v) for v in range(tree.size)}


def test_the_continuations_lead_and_a_cut_keeps_them():
    """lead_with moves the continuations' nodes to the front and keeps the tree (the same root
    paths, topological): a step cut to its first w nodes verifies the continuation, not the
    drafter's wider nodes."""
    tokens, parents, nodes = graft([9, 5, 4, 6], [-1, 0, 0, 1], [[5, 6, 7, 8], [3]])
    led_tokens, led_parents, order = lead_with(tokens, parents, nodes)
    assert led_tokens == [9, 5, 6, 7, 8, 3, 4] and order == [0, 1, 3, 4, 5, 6, 2]
    assert all(led_parents[v] < v for v in range(1, len(led_parents)))
    old = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))
    led = DraftTree(tokens=torch.tensor(led_tokens), parents=torch.tensor(led_parents))
    assert root_paths(led) == root_paths(old)

    class Siblings:  # a drafter proposing the root's top-3 alternatives (Medusa's head 0, say)
        name, max_depth = "medusa", 1

        def propose(self, root, hidden, ids):
            return DraftTree(tokens=torch.tensor([root, 20, 21, 22]), parents=torch.tensor([-1, 0, 0, 0]))

    proposer = PromptLookupGraft(Siblings(), num_tokens=3, max_ngram=2, min_ngram=2)
    tree = proposer.propose(7, torch.zeros(4), [5, 6, 7, 8, 9, 10, 5, 6, 7])  # "6 7" matched: 8 9 10 follow
    assert truncate(tree, 4).tokens.tolist() == [7, 8, 9, 10]
    assert root_paths(tree) == {(7,), (7, 20), (7, 21), (7, 22), (7, 8), (7, 8, 9), (7, 8, 9, 10)}


@pytest.mark.parametrize("case", ["eagle1-dynamic", "eagle3-dynamic", "eagle3-chain", "medusa", "draft-heuristic"])
def test_greedy_identity_and_grafted_nodes_are_accepted(graft_setup, case, monkeypatch):
    model, drafters = graft_setup
    proposer = PromptLookupGraft(inner_proposer(model, drafters, case), num_tokens=6, max_ngram=3, min_ngram=1)
    spy = Spy(proposer)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    g = torch.Generator().manual_seed(5)
    for seed in range(4):
        # a prompt over 10 token ids: its n-grams recur, so lookup has matches from the start
        ids = torch.randint(4, 14, (1, 16), generator=g) if seed % 2 else torch.randint(4, 100, (1, 8), generator=g)
        out = generate(model, ids, proposer=proposer, max_new_tokens=40)
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                  pad_token_id=1)[0, ids.shape[1]:].tolist()
        assert out.tokens == want, (case, seed)
        assert out.proposer == f"{proposer.inner.name}+prompt_lookup"
    assert len(spy.verified) == len(recorder.paths)
    grafted = [accepted for _, accepted, hit in spy.verified if hit]
    assert grafted, "no grafted node was ever accepted: the test did not exercise the graft"
    assert any(accepted > proposer.inner.max_depth for accepted in grafted)  # deeper than the drafter
    if case == "draft-heuristic":
        assert proposer.inner.checks == len(recorder.paths)


def test_rows_cut_by_the_budget_keep_the_continuations_and_stay_lossless(graft_setup):
    """Grafted rows in one engine under a budget that cuts every other step to 2 drafted nodes (and
    skips the proposer on the others): each row is its own greedy output, the draft model's cache
    follows (it is told each cut step in its own numbering), and cut steps accepted continuation
    nodes (they lead the tree)."""
    from draftsmith.decode.engine import Engine
    from tests.decode.rows import Alternating
    from tests.laws import reference

    model, drafters = graft_setup
    cases = ["eagle3-dynamic", "medusa", "draft-heuristic"]
    proposers = [PromptLookupGraft(inner_proposer(model, drafters, case), num_tokens=6, max_ngram=3, min_ngram=1)
                 for case in cases]
    spies = [Spy(p) for p in proposers]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 12, (14,), generator=g).tolist() for _ in cases]  # recurring n-grams
    engine = Engine(model, max_num_seqs=3, budget=Alternating())
    rows = [engine.add(prompt, proposer=p, max_new_tokens=30, eos_token_id=()) for prompt, p in zip(prompts, proposers)]
    while engine.busy:
        engine.step()
    for case, prompt, row, spy in zip(cases, prompts, rows, spies):
        assert row.out == reference(model, torch.tensor([prompt]), max_new_tokens=30, eos_token_id=None), case
        assert any(hit for size, _, hit in spy.verified if size <= 3), case  # a cut step accepted grafted nodes


# an EAGLE-2 tree at T=1 (tree kwargs, logit scale, temperature, top_k, top_p)
LAW_CASE = (dict(depth=3, top_k=2, total_tokens=6), 10.0, 1.0, 0, 1.0)
# ~11 ms per grafted 3-token generate in the suite: 3k samples is ~30 s (20k took 3 min 40 s); the TV
# bound is scaled to the sample size (tv_bound): TV 0.109-0.115 against 0.159 on seeds 1-3 (chi-square
# p 0.59-0.87), and the broken rule below fails at 2k (at 1k: p 2e-22)
GRAFT_LAW_SAMPLES = 3_000


@pytest.mark.slow
def test_sampling_law_with_a_graft_is_the_verifiers():
    tree_kwargs, scale, temperature, top_k, top_p = LAW_CASE
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    proposer = PromptLookupGraft(random_eagle_proposer(model, tree_kwargs), num_tokens=3, max_ngram=2, min_ngram=1)
    spy = Spy(proposer)
    counts = engine_counts(model, proposer, GRAFT_LAW_SAMPLES, temperature, top_k, top_p, seed=1)
    pvalue, tv, impossible = law_test(counts, law)
    assert impossible == 0.0, "sampled a sequence the verifier's law gives probability 0"
    assert pvalue > 1e-3, (pvalue, tv)
    bound = tv_bound(law, GRAFT_LAW_SAMPLES)
    assert tv < bound, (pvalue, tv, bound)
    assert any(hit for *_, hit in spy.verified)  # grafted nodes were accepted


@pytest.mark.slow
def test_sampling_law_with_a_graft_catches_a_broken_rule(monkeypatch):
    tree_kwargs, scale, temperature, top_k, top_p = LAW_CASE
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    monkeypatch.setattr(sampling, "rejection_walk", residual_from_p_walk)
    proposer = PromptLookupGraft(random_eagle_proposer(model, tree_kwargs), num_tokens=3, max_ngram=2, min_ngram=1)
    counts = engine_counts(model, proposer, 2000, temperature, top_k, top_p, seed=1)
    pvalue, tv, _ = law_test(counts, law)
    assert pvalue < 1e-6, (pvalue, tv)


def test_a_sampled_tree_and_bad_settings_are_refused():
    class Sampler:
        name, max_depth = "draft", 2

        def propose(self, root, hidden, ids):
            return DraftTree(tokens=torch.tensor([root, 3]), parents=torch.tensor([-1, 0]),
                             draft_probs=torch.ones(2, 8) / 8, sampled=torch.tensor([True, False]))

    with pytest.raises(DraftsmithError, match="deterministic trees only"):
        PromptLookupGraft(Sampler(), num_tokens=3).propose(3, torch.zeros(4), [3, 3, 3])
    with pytest.raises(DraftsmithError, match="decode.lookup_tokens=0, decode.lookup_max_ngram=3"):
        PromptLookupGraft(Sampler(), num_tokens=0)
    with pytest.raises(DraftsmithError, match="lookup_min_ngram=3"):
        PromptLookupGraft(Sampler(), num_tokens=2, max_ngram=2, min_ngram=3)
    Sampler.name = "lookahead"
    with pytest.raises(DraftsmithError, match="grafts onto EAGLE, Medusa and draft-model trees only"):
        with_lookup(Sampler(), OmegaConf.create({"lookup_tokens": 4}))


def test_a_draft_model_is_grafted_only_when_greedy(graft_setup, monkeypatch):
    """At T > 0 a draft model samples its drafts: the call decodes with its own tree (a server's
    sampled requests), the next greedy call is grafted again."""
    model, drafters = graft_setup
    proposer = PromptLookupGraft(inner_proposer(model, drafters, "draft-heuristic"), num_tokens=4)
    spy = Spy(proposer)
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]])
    generate(model, ids, proposer=proposer, max_new_tokens=20, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert recorder.paths and not any(hit for *_, hit in spy.verified)
    spy.verified.clear()
    generate(model, ids, proposer=proposer, max_new_tokens=20)
    assert any(hit for *_, hit in spy.verified)  # grafted (and accepted) again


def test_evaluate_refuses_a_sampled_draft_with_a_graft(tiny_model_dir, tmp_path):
    from draftsmith.models.draft import build_student, save_draft_model
    from draftsmith.models.verifier import fingerprint
    from tests.tiny import tiny_tokenizer

    verifier = tiny_llama(dtype=torch.float32)
    student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
    draft = save_draft_model(tmp_path / "draft", student, tiny_tokenizer(), verifier_fingerprint=fingerprint(verifier),
                             verifier_name="tiny")
    cfg = compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=1", "max_new_tokens=4", f"output_dir={tmp_path / 'eval'}", "proposer=draft",
        f"drafter={draft}", "decode=draft-chain", "decode.lookup_tokens=5", "temperature=0.7"])
    with pytest.raises(DraftsmithError, match="decode.lookup_tokens=5 with a draft model at temperature=0.7"):
        run(cfg)


@pytest.mark.parametrize("preset", GRAFTED_PRESETS)
def test_every_eagle_and_medusa_preset_takes_the_graft_keys(preset):
    d = load_preset(preset)
    assert {"lookup_tokens", "lookup_max_ngram", "lookup_min_ngram"} <= set(d)

    class Inner:
        name, max_depth = {"chain4": "medusa"}.get(preset, preset.split("-")[0]), 3

    inner = Inner()
    assert with_lookup(inner, OmegaConf.merge(d, {"lookup_tokens": 0})) is inner
    built = with_lookup(inner, OmegaConf.merge(d, {"lookup_tokens": 7, "lookup_min_ngram": 2}))
    assert isinstance(built, PromptLookupGraft) and built.inner is inner
    assert (built.num_tokens, built.max_ngram, built.min_ngram, built.max_depth) == (7, d.lookup_max_ngram, 2, 7)


def test_evaluate_runs_the_graft_losslessly(tiny_model_dir, tmp_path):
    """decode.lookup_tokens on the command line, as a user types it, through decode/evaluate.py."""
    drafter = save_tiny_medusa(tmp_path / "drafter")
    cfg = compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=3", "max_new_tokens=16", f"output_dir={tmp_path / 'eval'}",
        f"drafter={drafter}", "decode=medusa-small", "decode.lookup_tokens=5", "hf.assistant=null"])
    report = run(cfg)
    ours = report["methods"]["medusa"]
    assert ours["greedy_identity_rate"] == 1.0 or ours["greedy_divergences_unexplained"] == 0, ours
    assert report["proposer"] == "medusa+prompt_lookup" and len(ours["accepted_per_depth"]) == 5  # graft depth 5
