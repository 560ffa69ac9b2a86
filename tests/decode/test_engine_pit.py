"""The engine's sampled output in bf16, token by token: a randomised probability-integral transform.

A bf16 tiny Llama (2,048 tokens, a peaked law with a long tail, EOS in the vocabulary) decodes
long generations at T > 0 through the engine with every proposer kind: plain decoding, Medusa
heads over a static tree, an EAGLE-2 dynamic tree and a draft model drafting a sampled tree.
For every emitted token x, with p the verifier's law given its prefix (softmax of the bf16
verifier's own logits, computed in float64, after temperature), the transform

    u = F(x) + U * p(x),   F(x) = mass of the tokens ranked before x,  U ~ U[0, 1) independent

is exactly uniform on [0, 1) when x ~ p, whatever the token order used for F (here: by
decreasing p, so a rule that over-emits drafted, likely tokens shifts u towards 0). The u of
all tokens are tested for uniformity (Kolmogorov-Smirnov); the runs must have accepted drafts
at depth >= 2, accepted non-first siblings mid-run (the cache compaction keeps a non-prefix
path) and stopped at EOS. The reference law comes from one forward over the whole sequence,
so it shares no cache, mask or compaction code with the engine; in bf16 its logits differ
from the engine's by kernel rounding only. A rule that forgets to update the residual fails.
"""
from __future__ import annotations

import copy

import pytest
import torch
from scipy.stats import kstest

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate
from draftsmith.decode.proposers import make_proposer
from tests.drafters import fitted_drafter, fitted_heads, noisy_copy
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow

VOCAB, EOS = 2048, 7
PROMPTS, NEW_TOKENS = 30, 100
MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    fp32 = tiny_llama(vocab_size=VOCAB, dtype=torch.float32, seed=11, eos_token_id=None)
    fp32.lm_head.weight.data *= 25  # mean top probability ~0.2 at T=1, ~0.4 at T=0.6; long tail
    fp32.lm_head.weight.data[EOS] *= 1.25  # EOS ends some of the generations
    heads = fitted_heads(fp32).to(torch.bfloat16)
    eagle = fitted_drafter(fp32, "eagle1").to(torch.bfloat16)
    draft = noisy_copy(fp32, 0.02).to(torch.bfloat16)
    model = copy.deepcopy(fp32).to(torch.bfloat16).requires_grad_(False)
    proposers = {
        "vanilla": lambda: None,
        "medusa": lambda: make_proposer("medusa", heads=heads, paths=MEDUSA_TREE),
        "eagle": lambda: make_proposer("eagle", drafter=eagle, embed_tokens=model.get_input_embeddings(),
                                       lm_head=model.lm_head, depth=3, top_k=3, total_tokens=8),
        "draft": lambda: make_proposer("draft", model=draft, vocab_size=VOCAB, num_tokens=3, tree_topk=[2, 2],
                                       seed=4),
    }
    return model, proposers


def decode_all(model, proposer, temperature: float, seed: int, num_prompts: int = PROMPTS):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 100, (6,), generator=torch.Generator().manual_seed(100 + i)).tolist()
               for i in range(num_prompts)]
    outs = [generate(model, torch.tensor([p]), proposer=proposer, max_new_tokens=NEW_TOKENS, temperature=temperature,
                     generator=g, eos_token_id=[EOS]) for p in prompts]
    return prompts, outs


class TreeRecorder:
    """Wraps the rejection rule to record each step's tree and accepted path."""

    def __init__(self, rule):
        self.rule, self.steps = rule, []

    def __call__(self, tree, *args):
        path, nxt = self.rule(tree, *args)
        self.steps.append((tree.tokens.tolist(), tree.parents.tolist(), path))
        return path, nxt


def candidate_lists(outs, recorder: TreeRecorder | None) -> list[list[list[int]]]:
    """Per generation, per emitted token: the drafted candidates tried at that position (the
    children of the accepted node it follows, in sibling order); [] without a tree."""
    steps = iter(recorder.steps if recorder is not None else [])
    lists = []
    for out in outs:
        per_token = [[]]  # the first token comes from the prefill
        for stat in out.steps:
            tokens, parents, path = next(steps) if recorder is not None else ([0], [-1], [0])
            for j in range(stat.emitted):
                per_token.append([tokens[c] for c in range(1, len(parents)) if parents[c] == path[j]])
        lists.append(per_token[: len(out.tokens)])
    return lists


@torch.no_grad()
def pit_values(model, prompts, outs, temperature: float, seed: int, candidates=None) -> list[float]:
    """u = F(x) + U p(x) for every emitted token. F ranks the token's drafted candidates first
    (Medusa / EAGLE draft deterministically from the history, so this order does not depend on
    the token's own draw and u stays exactly uniform; a rule that over-emits rejected candidates
    puts u near 0), then every other token by decreasing p."""
    g = torch.Generator().manual_seed(seed)
    us = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = torch.tensor([prompt + out.tokens])
        logits = model(seq).logits[0, len(prompt) - 1 : -1]  # (n, V) bf16: the law of each emitted token
        probs = sampling.logits_to_probs(logits, temperature)  # (n, V) float64
        for j, (row, x) in enumerate(zip(probs, out.tokens)):
            assert row[x] > 0, "emitted a token the verifier's law excludes"
            first = list(dict.fromkeys(candidates[i][j])) if candidates is not None else []
            rest = row.clone()
            rest[first] = -1.0
            order = first + torch.sort(rest, descending=True, stable=True).indices[: VOCAB - len(first)].tolist()
            rank = order.index(x)
            before = float(row[order[:rank]].sum())
            us.append(before + float(torch.rand((), generator=g, dtype=torch.float64)) * float(row[x]))
    return us


DETERMINISTIC = {"medusa", "eagle"}  # their candidates are functions of the history


@pytest.mark.parametrize("method, temperature", [("vanilla", 1.0), ("medusa", 0.6), ("eagle", 0.6), ("draft", 0.8)])
def test_every_emitted_token_follows_the_bf16_verifiers_law(setup, monkeypatch, method, temperature):
    """(No top-p / top-k here: in bf16 the engine's and the reference's logits round differently,
    so a token at the truncation boundary may be in one law and not the other; truncation is
    tested exactly in fp64, tests/decode/test_engine.py and test_sampling_exact.py.)"""
    model, proposers = setup
    recorder = TreeRecorder(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    prompts, outs = decode_all(model, proposers[method](), temperature, seed=2)
    candidates = candidate_lists(outs, recorder) if method in DETERMINISTIC else None
    us = pit_values(model, prompts, outs, temperature, seed=3, candidates=candidates)
    pvalue = kstest(us, "uniform").pvalue
    assert len(us) > 1500 and pvalue > 1e-3, (method, pvalue, len(us))  # ~1,900-3,000 tokens (EOS ends some runs)
    assert any(o.stop_reason == "eos" and o.tokens[-1] == EOS for o in outs)
    assert all(EOS not in o.tokens[:-1] for o in outs)
    if method != "vanilla":
        paths = [path for _, _, path in recorder.steps]
        last = set((torch.tensor([len(o.steps) for o in outs]).cumsum(0) - 1).tolist())
        mid_run_non_first = [p for i, p in enumerate(paths) if len(p) > 1 and p[1] != 1 and i not in last]
        assert len(mid_run_non_first) >= 5, method  # the cache kept a non-prefix path and decoding went on
        assert sum(len(p) > 2 for p in paths) >= 5, method  # depth >= 2 accepted


def residual_not_updated(p, q):
    return p.double()  # broken: after a rejection the next token is drawn from p, not norm((p - q)+)


def test_the_transform_catches_a_broken_rule(setup, monkeypatch):
    model, proposers = setup
    recorder = TreeRecorder(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    monkeypatch.setattr(sampling, "_residual", residual_not_updated)
    prompts, outs = decode_all(model, proposers["medusa"](), 0.6, seed=2, num_prompts=3 * PROMPTS)
    us = pit_values(model, prompts, outs, 0.6, seed=3, candidates=candidate_lists(outs, recorder))
    assert kstest(us, "uniform").pvalue < 1e-3  # fails the criterion the law test applies (p > 1e-3)
