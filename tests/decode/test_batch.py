"""decode/batch.py, continuous batching, checked against the verifier alone: greedy rows equal
HF generate on each prompt by itself (fp64), sampled rows follow the verifier's law given their
prefix (a randomised probability-integral transform, as in test_engine_pit.py), and the
BufferedLayer cache behaves like a DynamicLayer."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import kstest
from transformers import DynamicCache

from draftsmith.decode import batch, sampling
from draftsmith.decode.cache import BufferedLayer, new_cache
from draftsmith.decode.sampling import SamplingParams, logits_to_probs
from draftsmith.models.errors import DraftsmithError
from tests.tiny import tiny_llama

VOCAB, EOS = 128, 5


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = tiny_llama(vocab_size=VOCAB, dtype=torch.float64, seed=3, eos_token_id=None)
    m.lm_head.weight.data *= 6  # a peaked law with a tail
    m.lm_head.weight.data[EOS] *= 1.4  # EOS ends some rows early, so rows leave and join mid-run
    return m.requires_grad_(False)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 23, (n,), generator=g).tolist()  # ragged: rows join wider and narrower
    return [torch.randint(6, VOCAB, (t,), generator=g).tolist() for t in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("batch_size", [1, 4, 7])
def test_greedy_rows_are_hf_generate_on_each_prompt_alone(model, batch_size):
    ps = prompts(17)
    got = {}
    for i, tokens, finish in batch.generate_batch(model, ps, max_new_tokens=30, eos=[EOS], batch_size=batch_size):
        assert i not in got
        got[i] = tokens
        assert finish == ("stop" if tokens[-1] == EOS else "length")
    assert sorted(got) == list(range(len(ps)))
    stopped = 0
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(model, p, 30), i
        stopped += got[i][-1] == EOS and len(got[i]) < 30
    assert stopped >= 3  # rows left early, so later prompts joined a running batch


def test_a_broken_mask_fails_the_greedy_check(model, monkeypatch):
    """Teeth: tokens that see every slot of their cache row (the padding, the slots past their
    own) no longer match HF."""
    from draftsmith.decode.engine import BatchInputs

    monkeypatch.setattr(BatchInputs, "allowed", lambda self, length: torch.ones(
        *self.tokens.shape, length, dtype=torch.bool))
    ps = prompts(6)
    got = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=12, eos=[EOS], batch_size=6)}
    assert any(got[i] != hf_greedy(model, p, 12) for i, p in enumerate(ps))


def chat_prompts(n: int, prefix_len: int = 9) -> list[list[int]]:
    """Prompts that share a prefix (a chat template's system prompt), with ragged suffixes of
    1..12 tokens, so rows join with the prefix at different offsets."""
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(6, VOCAB, (prefix_len,), generator=g).tolist()
    lengths = torch.randint(1, 13, (n,), generator=g).tolist()
    lengths[0] = 1  # one prompt is the prefix plus a single token of its own
    return [prefix + torch.randint(6, VOCAB, (t,), generator=g).tolist() for t in lengths]


@pytest.mark.parametrize("batch_size", [1, 5, 13])
def test_shared_prefix_rows_are_hf_generate_on_each_prompt_alone(model, batch_size):
    ps = chat_prompts(13)
    assert len(batch.common_prefix(ps)) == 9
    got = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=20, eos=[EOS], batch_size=batch_size)}
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(model, p, 20), i


def test_common_prefix_leaves_every_row_a_token_of_its_own():
    assert batch.common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2]
    assert batch.common_prefix([[1, 2, 3], [1, 5]]) == [1]
    assert batch.common_prefix([[7], [7, 8]]) == []
    assert batch.common_prefix([[4, 2, 3]]) == [4, 2]


def test_a_prefix_left_uncopied_fails_the_greedy_check(model, monkeypatch):
    """Teeth: rows that skip the shared prefix without its keys / values no longer match HF."""
    from draftsmith.decode.engine import Engine

    def skip_without_copy(self, request):
        P = len(self.prefix)
        if P and len(request.prompt) > P and request.prompt[:P] == self.prefix:
            request.fed = request.cache_len = P
            request.prompt_hidden.append(self.prefix_hidden)

    ps = chat_prompts(6)
    want = [hf_greedy(model, p, 12) for p in ps]
    monkeypatch.setattr(Engine, "_share_prefix", skip_without_copy)
    unshared = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=12, eos=[EOS], batch_size=6,
                                                          share_prefix=False)}
    assert all(unshared[i] == want[i] for i in range(len(ps)))  # the patch touches only the shared path
    got = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=12, eos=[EOS], batch_size=6)}
    assert any(got[i] != want[i] for i in range(len(ps)))


def pit(model, ps, outs, params, seed: int) -> list[float]:
    """u = F(x) + U p(x) for every sampled token, the law from one forward over prompt + answer."""
    g = torch.Generator().manual_seed(seed)
    us = []
    for i, p in enumerate(ps):
        seq = torch.tensor([p + outs[i]])
        probs = logits_to_probs(model(seq).logits[0, len(p) - 1 : -1], params.temperature, params.top_k,
                                params.top_p)  # (n, V) float64
        for row, x in zip(probs, outs[i]):
            assert row[x] > 0, "sampled a token outside the verifier's (truncated) law"
            order = torch.sort(row, descending=True, stable=True).indices.tolist()
            before = float(row[order[: order.index(x)]].sum())
            us.append(before + float(torch.rand((), generator=g, dtype=torch.float64)) * float(row[x]))
    return us


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_k=20)])
def test_sampled_rows_follow_the_verifiers_law(model, params):
    ps = prompts(40)
    outs = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=40, eos=[EOS], params=params,
                                                      batch_size=9, generator=torch.Generator().manual_seed(1))}
    us = pit(model, ps, outs, params, seed=2)
    assert len(us) > 600 and kstest(us, "uniform").pvalue > 1e-3


def test_a_wrong_temperature_fails_the_law_check(model, monkeypatch):
    """Teeth: drawing at T/2 instead of T is detected by the same transform."""
    real = sampling.logits_to_probs
    monkeypatch.setattr(sampling, "logits_to_probs", lambda logits, t, k=0, p=1.0: real(logits, t / 2, k, p))
    params = SamplingParams(temperature=1.0)
    ps = prompts(40)
    outs = {i: t for i, t, _ in batch.generate_batch(model, ps, max_new_tokens=40, eos=[EOS], params=params,
                                                      batch_size=9, generator=torch.Generator().manual_seed(1))}
    assert kstest(pit(model, ps, outs, params, seed=2), "uniform").pvalue < 1e-6


def test_sample_rows_never_draws_zero_mass():
    probs = torch.zeros(4, 10, dtype=torch.float64)
    probs[:, 3] = 1.0
    probs[1, 9] = 0.0
    probs[2, [0, 3]] = 0.5
    for _ in range(50):
        tokens = sampling.sample_rows(probs / probs.sum(-1, keepdim=True), None)
        assert all(probs[r, t] > 0 for r, t in enumerate(tokens.tolist()))


def test_bad_arguments_are_one_line_errors(model):
    with pytest.raises(DraftsmithError, match="max_new_tokens=0, batch_size=4: both must be >= 1"):
        next(batch.generate_batch(model, [[7]], max_new_tokens=0, eos=[EOS], batch_size=4))


def test_buffered_layer_matches_a_dynamic_cache(model):
    """Same keys/values seen by attention after prefill, steps, a crop and a row selection."""
    buffered, dynamic = new_cache(model.config), DynamicCache(config=model.config)
    assert all(isinstance(layer, BufferedLayer) for layer in buffered.layers)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(6, VOCAB, (3, 9), generator=g)
    for cache in (buffered, dynamic):
        model(ids, cache=cache, use_cache=True)
        for t in range(40):  # beyond the first buffer: it grows
            model(ids[:, t % 9 : t % 9 + 1], cache=cache, use_cache=True)
        cache.crop(-19)  # transformers 5.x: a negative count of tokens to remove (49 -> 30)
        cache.batch_select_indices(torch.tensor([2, 0]))
    for b, d in zip(buffered.layers, dynamic.layers):
        assert torch.equal(b.keys, d.keys) and torch.equal(b.values, d.values)
    assert buffered.get_seq_length() == dynamic.get_seq_length() == 30
    nxt = torch.randint(6, VOCAB, (2, 1), generator=g)
    a = model(nxt, cache=buffered, use_cache=True).logits
    b = model(nxt, cache=dynamic, use_cache=True).logits
    assert torch.equal(a, b)
