"""The batched engine: every row lossless whatever its neighbours.

Rows of every proposer kind (plain, Medusa, EAGLE-1 / EAGLE-3 trees, a draft model, prompt
lookup, lookahead) join and leave one Engine at staggered steps, with prompts read in chunks
beside rows that decode. Greedy: every row equals HF `generate` on its prompt alone (tiny fp64
Llama). Sampling: rows at different temperatures / top-p follow the verifier's law token by
token (probability-integral transform), and a seeded request emits the same tokens alone or
beside others. Teeth: rows reading each other's cache, and one generator shared by all rows,
must fail these checks.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import kstest

from draftsmith.decode import forward as forwards
from draftsmith.decode.engine import Engine
from draftsmith.decode.proposers import Proposer, make_proposer
from tests.decode.rows import SCHEDULE, row_prompt, run_schedule
from tests.laws import pit_values, reference


def test_every_row_is_its_own_greedy_generate_while_rows_join_and_leave(batch_setup, monkeypatch):
    model, factories = batch_setup
    forwards_run = []  # per forward: its steps' (rows, tokens per row)
    chunk_steps = []  # per step with prompt chunks: their steps' shapes, and whether rows decoded beside them
    many, chunks_of = forwards.FastLlama.many, Engine._chunks

    def recorded(self, steps, capture=()):
        forwards_run.append([tuple(step[0].shape) for step in steps])
        return many(self, steps, capture)

    def chunked(self):
        chunks = chunks_of(self)
        chunk_steps.append(([tuple(step[0].shape) for step in chunks.steps], bool(self.decoding)))
        return chunks

    monkeypatch.setattr(forwards.FastLlama, "many", recorded)
    monkeypatch.setattr(Engine, "_chunks", chunked)
    requests, widest = run_schedule(model, factories, SCHEDULE)
    assert widest == 3  # rows really decoded side by side (and the 5 later ones joined as others left)
    # prompts were read in chunks, in the decoding rows' own forward when rows decoded (the trees'
    # step first, then one step per row's chunk: a forward of 2+ steps), each chunk its own (1, n)
    # step (never padded to the longest), prefill_chunk=8 tokens a step in all
    assert sum(len(steps) >= 2 and steps[0][0] >= 2 for steps in forwards_run) >= 3, forwards_run
    assert sum(beside for _, beside in chunk_steps) >= 5, chunk_steps
    assert any(len(shapes) >= 2 for shapes, _ in chunk_steps), chunk_steps  # rows shared a step's 8 tokens
    assert all(rows == 1 for shapes, _ in chunk_steps for rows, _ in shapes), chunk_steps
    assert all(sum(n for _, n in shapes) <= 8 for shapes, _ in chunk_steps), chunk_steps
    for (kind, seed, length, new, _), request in zip(SCHEDULE, requests):
        ids = torch.tensor([row_prompt(seed, length)])
        assert request.out == reference(model, ids, max_new_tokens=new, eos_token_id=None), kind
        assert request.stop.reason == "length" and request.error is None
    accepted = {kind: sum(s.accepted for s in r.steps) for (kind, *_), r in zip(SCHEDULE, requests)}
    widest_tree = {kind: max(s.num_nodes for s in r.steps) for (kind, *_), r in zip(SCHEDULE, requests)}
    assert all(widest_tree[k] > 1 for k in widest_tree if k != "vanilla"), widest_tree  # each drafted in the batch
    assert all(accepted[k] > 0 for k in ("medusa", "eagle1", "eagle3", "draft", "prompt_lookup")), accepted


def test_rows_reading_each_others_cache_are_caught(batch_setup, monkeypatch):
    """Teeth: every row reads its neighbour's cache row: the outputs are no longer the verifier's."""
    model, factories = batch_setup
    monkeypatch.setattr(forwards.StaticKV, "read", lambda self, layer, rows, length: (
        self.keys[layer, :rows].roll(1, 0)[:, :, :length], self.values[layer, :rows].roll(1, 0)[:, :, :length])
        if isinstance(rows, int) else (self.keys[layer, rows, :, :length], self.values[layer, rows, :, :length]))
    requests, _ = run_schedule(model, factories, SCHEDULE[:3])
    wrong = [r.out != reference(model, torch.tensor([row_prompt(seed, n)]), max_new_tokens=new, eos_token_id=None)
             for (_, seed, n, new, _), r in zip(SCHEDULE[:3], requests)]
    assert any(wrong)


SAMPLED = [("medusa", 11, 6, 40, 0), ("eagle1", 12, 9, 40, 0), ("vanilla", 13, 5, 40, 1), ("draft", 14, 7, 40, 2),
           ("prompt_lookup", 15, 12, 40, 4), ("eagle3", 16, 8, 40, 6)]
PARAMS = [dict(temperature=0.6), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3), dict(temperature=1.0),
          dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.8)]


def test_sampled_rows_follow_the_verifier_law_each_with_its_own_parameters(batch_setup):
    model, factories = batch_setup
    us = []
    for run in range(4):
        gens = [torch.Generator().manual_seed(100 * run + i) for i in range(len(SAMPLED))]
        requests, widest = run_schedule(model, factories, SAMPLED,
                                        add_kwargs=lambda i: dict(**PARAMS[i], generator=gens[i]))
        assert widest == 3
        us += pit_values(model, requests, PARAMS, seed=run)
    assert len(us) >= 900
    assert kstest(us, "uniform").pvalue > 1e-3


def seeded_run(model, factories, neighbours: bool, shared: torch.Generator | None = None) -> list[int]:
    """Request 0 (seed 7, T=1) alone or beside two sampled neighbours -> its tokens."""
    schedule = [("eagle1", 21, 8, 30, 0)] + ([("medusa", 22, 5, 30, 0), ("draft", 23, 11, 25, 2)] if neighbours else [])

    def kwargs(i):
        gen = shared if shared is not None else torch.Generator().manual_seed([7, 8, 9][i])
        return dict(temperature=1.0, generator=gen)

    if shared is not None:
        shared.manual_seed(7)
    requests, _ = run_schedule(model, factories, schedule, add_kwargs=kwargs)
    return requests[0].out


def test_a_seeded_request_emits_the_same_tokens_alone_or_beside_others(batch_setup):
    model, factories = batch_setup
    alone = seeded_run(model, factories, neighbours=False)
    assert seeded_run(model, factories, neighbours=True) == alone
    shared = torch.Generator()  # teeth: one generator for every row, and the neighbours move its draws
    assert seeded_run(model, factories, neighbours=False, shared=shared) == alone
    assert seeded_run(model, factories, neighbours=True, shared=shared) != alone


class Broken(Proposer):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def propose(self, root, hidden, ids):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter exploded")
        return make_proposer("prompt_lookup", num_tokens=2).propose(root, hidden, ids)


def test_a_row_whose_proposer_raises_fails_alone(batch_setup):
    model, factories = batch_setup
    engine = Engine(model, max_num_seqs=2)
    good = engine.add(row_prompt(31, 6), proposer=factories["medusa"](), max_new_tokens=20, eos_token_id=())
    bad = engine.add(row_prompt(32, 6), proposer=Broken(), max_new_tokens=20, eos_token_id=())
    while engine.busy:
        engine.step()
    assert isinstance(bad.error, RuntimeError) and bad.stop.reason == "error" and len(bad.out) < 20
    assert good.error is None and good.out == reference(model, torch.tensor([row_prompt(31, 6)]), max_new_tokens=20,
                                                        eos_token_id=None)


def test_a_cancelled_row_leaves_at_the_next_step(batch_setup):
    model, factories = batch_setup
    engine = Engine(model, max_num_seqs=2)
    keep = engine.add(row_prompt(41, 6), proposer=factories["eagle1"](), max_new_tokens=24, eos_token_id=())
    drop = engine.add(row_prompt(42, 6), max_new_tokens=24, eos_token_id=())
    for _ in range(3):
        engine.step()
    engine.cancel(drop)
    finished = engine.step()
    assert drop in finished and drop.stop.reason == "cancelled" and len(engine.decoding) == 1
    while engine.busy:
        engine.step()
    assert keep.out == reference(model, torch.tensor([row_prompt(41, 6)]), max_new_tokens=24, eos_token_id=None)


def test_forked_drafters_propose_together_and_stay_lossless(batch_setup, monkeypatch):
    """Rows forked from one Medusa proposer (with prompt lookup grafted on) share a batch_key: the
    heads of every drafting row run in one call per step, and every row is still its own greedy
    output."""
    from draftsmith.decode.lookup import PromptLookupGraft
    from draftsmith.decode.proposers import MedusaProposer

    model, factories = batch_setup
    template = PromptLookupGraft(factories["medusa"](), num_tokens=4, max_ngram=2)
    calls = []
    real = MedusaProposer.propose_batch
    monkeypatch.setattr(MedusaProposer, "propose_batch",
                        staticmethod(lambda ps, *a: (calls.append(len(ps)), real(ps, *a))[1]))
    engine = Engine(model, max_num_seqs=3)
    rows = [engine.add(row_prompt(70 + i, 6 + 3 * i), proposer=template.fork(), max_new_tokens=20, eos_token_id=())
            for i in range(3)]
    while engine.busy:
        engine.step()
    for i, row in enumerate(rows):
        assert row.out == reference(model, torch.tensor([row_prompt(70 + i, 6 + 3 * i)]), max_new_tokens=20,
                                    eos_token_id=None)
    assert max(calls) == 3  # three rows' heads in one call


@pytest.mark.parametrize("forward", ["hf", "fast"])
def test_a_short_chunk_beside_a_wide_one_stays_inside_the_cache(batch_setup, forward):
    """Near the end of a row's reserved slots, its last prompt chunk (44 tokens) is padded to the
    width of another row's first chunk (212): the pad nodes' slots would run past the cache
    (256 + 212 > 430). They must land inside it, and both rows stay their own greedy output."""
    model, _ = batch_setup
    engine = Engine(model, max_num_seqs=2, max_len=430, forward=forward, prefill_chunk=256)
    long, short = row_prompt(90, 300), row_prompt(91, 212)
    rows = [engine.add(p, max_new_tokens=2, eos_token_id=()) for p in (long, short)]
    while engine.busy:
        engine.step()
    assert engine.forward.cache.max_len == 430  # no growth hid the overflow
    for p, row in zip((long, short), rows):
        assert row.error is None and row.out == reference(model, torch.tensor([p]), max_new_tokens=2,
                                                          eos_token_id=None)


@pytest.mark.parametrize("kind", ["eagle1", "draft"])
def test_a_batched_proposal_that_raises_leaves_every_row_as_it_was(batch_setup, kind, monkeypatch):
    """Rows of one drafter propose together; when that batched proposal raises (once, midway
    through building the trees), each row proposes alone that step, from its state as it was
    (nothing committed by the failed attempt), and every row is still its own greedy output."""
    from draftsmith.decode import draft, eagle

    model, factories = batch_setup
    owner, name = (eagle, "_drive") if kind == "eagle1" else (draft._DraftStack, "drive")
    real, failures = getattr(owner, name), []

    def flaky(*args):
        if not failures and len(args[1 if kind == "draft" else 0]) > 1:
            failures.append(1)
            raise RuntimeError("the batched drafter call failed")
        return real(*args)

    monkeypatch.setattr(owner, name, flaky)
    schedule = [(kind, 51, 9, 20, 0), (kind, 52, 6, 24, 0), (kind, 53, 12, 16, 0)]
    requests, widest = run_schedule(model, factories, schedule)
    assert failures and widest == 3
    for (_, seed, length, new, _), request in zip(schedule, requests):
        assert request.error is None
        assert request.out == reference(model, torch.tensor([row_prompt(seed, length)]), max_new_tokens=new,
                                        eos_token_id=None)
