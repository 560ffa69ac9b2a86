"""Coupled sampling (acceptance=coupled): each position's token is the Gumbel-max draw of the
verifier's law with noise keyed by (the request's seed, the position). Exact law, and the very
tokens plain sampling with the same seed emits, whatever the drafter, the budget and the batch."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, kstest

from draftsmith.decode import sampling
from draftsmith.decode.budget import AdaptiveBudget
from draftsmith.decode.engine import Engine, generate
from draftsmith.decode.sampling import PositionNoise, coupled_sample, coupled_walk, logits_to_probs
from tests.decode.rows import Alternating, bandwidth_bound, row_prompt
from tests.laws import pit_values


def law_of_draws(probs: torch.Tensor, draws: int, noise=lambda seed, v: PositionNoise(seed).gumbel(0, v, "cpu")):
    counts = torch.zeros(probs.numel())
    for seed in range(draws):
        counts[coupled_sample(probs, noise(seed, probs.numel()))] += 1
    return counts


def test_a_coupled_draw_follows_the_law_and_a_wrong_noise_does_not():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5], dtype=torch.float64)
    probs = logits_to_probs(logits, 0.8, top_p=0.95)
    counts = law_of_draws(probs, 20_000)
    support = probs > 0
    assert counts[~support].sum() == 0  # never a token outside the (truncated) law
    assert chisquare(counts[support], 20_000 * probs[support]).pvalue > 1e-3
    uniform = law_of_draws(probs, 20_000, lambda seed, v: torch.rand(v, generator=torch.Generator().manual_seed(seed),
                                                                   dtype=torch.float64))
    assert chisquare(uniform[support], 20_000 * probs[support]).pvalue < 1e-6  # teeth: not Gumbel, not the law


def test_the_walk_accepts_exactly_the_drawn_tokens():
    """A tree whose children hold each node's draw is accepted whole; a wrong child stops it."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 12, generator=g, dtype=torch.float64), -1)
    noise = PositionNoise(5).at(40)
    drawn = [coupled_sample(probs[d], noise.gumbel(d, 12, "cpu")) for d in range(4)]
    chain = torch.tensor([3, *drawn[:3]])  # root, then each depth's own draw
    assert coupled_walk(chain, torch.tensor([-1, 0, 1, 2]), probs, noise) == ([0, 1, 2, 3], drawn[3])
    wrong = chain.clone()
    wrong[2] = (drawn[1] + 1) % 12
    assert coupled_walk(wrong, torch.tensor([-1, 0, 1, 2]), probs, noise) == ([0, 1], drawn[1])


def test_same_tokens_as_plain_sampling_whatever_the_drafter(batch_setup):
    model, factories = batch_setup
    for seed in range(3):
        ids = torch.tensor([row_prompt(50 + seed, 7)])
        runs = {}
        for kind in ("vanilla", "medusa", "eagle1", "eagle3", "draft", "prompt_lookup", "lookahead"):
            out = generate(model, ids, proposer=factories[kind](), max_new_tokens=30, temperature=1.0, top_p=0.95,
                           acceptance="coupled", generator=torch.Generator().manual_seed(seed), eos_token_id=())
            runs[kind] = out.tokens
        assert all(tokens == runs["vanilla"] for tokens in runs.values()), runs
    sampled = generate(model, ids, max_new_tokens=30, temperature=1.0, top_p=0.95, acceptance="rejection",
                       generator=torch.Generator().manual_seed(2), eos_token_id=())
    assert sampled.tokens != runs["vanilla"]  # (the rejection rule draws from a stream: another sample)


@pytest.mark.parametrize("policy", ["alternating", "adaptive"])
def test_a_seeded_request_is_the_same_alone_or_in_a_batch_whatever_the_budget(batch_setup, policy):
    model, factories = batch_setup
    alone = generate(model, torch.tensor([row_prompt(61, 8)]), proposer=factories["eagle1"](), max_new_tokens=30,
                     temperature=0.9, acceptance="coupled", generator=torch.Generator().manual_seed(7),
                     eos_token_id=()).tokens
    budget = Alternating() if policy == "alternating" else AdaptiveBudget(bandwidth_bound(knee=2))
    engine = Engine(model, max_num_seqs=3, budget=budget, prefill_chunk=5)
    mine = engine.add(row_prompt(61, 8), proposer=factories["eagle1"](), max_new_tokens=30, temperature=0.9,
                      acceptance="coupled", generator=torch.Generator().manual_seed(7), eos_token_id=())
    others = [engine.add(row_prompt(62 + i, 6 + i), proposer=factories[k](), max_new_tokens=25, temperature=1.2,
                         acceptance="coupled", generator=torch.Generator().manual_seed(i), eos_token_id=())
              for i, k in enumerate(("medusa", "draft", "vanilla"))]
    while engine.busy:
        engine.step()
    assert mine.out == alone
    assert any(s.num_nodes == 1 for s in mine.steps) or policy == "adaptive"
    us = pit_values(model, [mine, *others], [dict(temperature=0.9)] + [dict(temperature=1.2)] * 3, seed=1)
    assert kstest(us, "uniform").pvalue > 1e-4


def test_coupled_needs_a_temperature():
    with pytest.raises(Exception, match="acceptance=coupled needs temperature > 0"):
        sampling.resolve_rule("coupled", sampling.SamplingParams(temperature=0.0))
