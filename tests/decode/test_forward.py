"""decode/forward.py against HF's own forward, logit for logit, on tiny fp64 models of every
preset family (litgpt-style): a prompt read in chunks, a tree verified over the static cache,
rows of different lengths batched, the accepted path compacted, a row handed to another."""
from __future__ import annotations

import pytest
import torch

from draftsmith.decode.engine import batch_inputs, chain_tree
from draftsmith.decode.forward import FastLlama, HFForward, cpu_prepacks, fast_problem, make_forward
from draftsmith.decode.proposers import DraftTree
from draftsmith.decode.tree import path_to
from draftsmith.models.errors import DraftsmithError
from tests.tiny import FAMILIES, tiny_family

TREE = [-1, 0, 0, 1, 1, 2, 3]  # root, two children, grandchildren on both sides, a great-grandchild


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF's next-token logits after `ids`, one plain forward, no cache."""
    return model(torch.tensor([ids])).logits[0, -1]


def run(fwd, model, trees, lens, rows=None):
    """Verify `trees` (one per row) over cached lengths `lens` -> per row (n, V) logits."""
    width = max(t.size for t in trees)
    inputs = batch_inputs(trees, lens, width, "cpu")
    length = max(lens) + width
    rows = len(trees) if rows is None else torch.tensor(rows)
    hidden, _ = fwd(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(length), rows, length)
    return [model.lm_head(hidden[b, : t.size]) for b, t in enumerate(trees)]


def prefill(fwd, model, prompts, chunk: int, rows=None):
    """Read each prompt into its cache row in chunks of `chunk` tokens -> last logits per row."""
    last = [None] * len(prompts)
    for start in range(0, max(map(len, prompts)), chunk):
        live = [b for b, p in enumerate(prompts) if start < len(p)]
        trees = [chain_tree(prompts[b][start: start + chunk], "cpu") for b in live]
        row_ids = [b if rows is None else rows[b] for b in live]
        out = run(fwd, model, trees, [start] * len(live), rows=row_ids)
        for b, logits in zip(live, out):
            last[b] = logits[-1]
    return last


@pytest.mark.parametrize("kind", ["fast", "hf"])
@pytest.mark.parametrize("preset", sorted(FAMILIES))
def test_forward_matches_hf_logit_for_logit(preset, kind):
    model = tiny_family(preset)
    fwd = make_forward(model, kind, max_rows=3, max_len=64)
    assert fwd.name == kind
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (11, 5, 8)]
    last = prefill(fwd, model, prompts, chunk=4, rows=[0, 1, 2])  # rows of different lengths, chunked
    for p, logits in zip(prompts, last):
        torch.testing.assert_close(logits, hf_logits(model, p), rtol=0, atol=1e-10)
    # one tree per row, verified together; every node's logits are the path's own
    trees = []
    for b in range(3):
        tokens = torch.randint(0, 160, (len(TREE),), generator=g)
        trees.append(DraftTree(tokens=tokens, parents=torch.tensor(TREE)))
    out = run(fwd, model, trees, [len(p) for p in prompts])
    for p, tree, logits in zip(prompts, trees, out):
        for node in range(tree.size):
            path = tree.tokens[path_to(TREE, node)].tolist()
            torch.testing.assert_close(logits[node], hf_logits(model, p + path), rtol=0, atol=1e-10)
    # compact each row's accepted path (node 0 -> 2 -> 5 for row 0, 0 -> 1 -> 4 for the others), then a step
    paths = [[0, 2, 5], [0, 1, 4], [0, 1, 4]]
    order = torch.arange(len(TREE)).repeat(3, 1)
    for b, path in enumerate(paths):
        order[b, : len(path)] = torch.tensor(path)
    fwd.cache.compact(3, torch.tensor([len(p) for p in prompts]), order)
    grown = [p + trees[b].tokens[paths[b]].tolist() for b, p in enumerate(prompts)]
    nxt = [chain_tree([7, 9], "cpu") for _ in range(3)]
    out = run(fwd, model, nxt, [len(p) for p in grown])
    for p, logits in zip(grown, out):
        torch.testing.assert_close(logits[1], hf_logits(model, p + [7, 9]), rtol=0, atol=1e-10)
    # a row handed to another cache row keeps its text
    fwd.cache.move_row(2, 0, len(grown[2]))
    (logits,) = run(fwd, model, [chain_tree([3], "cpu")], [len(grown[2])])
    torch.testing.assert_close(logits[0], hf_logits(model, grown[2] + [3]), rtol=0, atol=1e-10)


def test_fast_forward_captures_the_layers_hf_returns():
    model = tiny_family("smollm2-135m")
    fwd = make_forward(model, "fast", max_rows=1, max_len=32)
    ids = [5, 9, 14, 3, 8]
    inputs = batch_inputs([chain_tree(ids, "cpu")], [0], len(ids), "cpu")
    _, captured = fwd(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(len(ids)), 1, len(ids),
                      [0, 1])
    ref = model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [embed, layer 0, layer 1 (normed)]
    torch.testing.assert_close(captured[0], torch.cat([ref[1][0], ref[2][0]], dim=-1), rtol=0, atol=1e-12)


def test_a_broken_forward_fails_the_comparison(monkeypatch):
    """Teeth: rotary positions doubled (a uniform shift would not show: rotary is relative), or every
    row in one cache row, and the logits move."""
    model = tiny_family("llama2-7b")
    prompts = [[5, 9, 14, 3, 8, 2], [7, 7, 1]]
    fwd = make_forward(model, "fast", max_rows=2, max_len=32)
    good = prefill(fwd, model, prompts, chunk=8)
    torch.testing.assert_close(good[1], hf_logits(model, prompts[1]), rtol=0, atol=1e-10)
    rope = FastLlama.rope
    monkeypatch.setattr(FastLlama, "rope", lambda self, positions, dtype: rope(self, positions * 2, dtype))
    shifted = prefill(make_forward(model, "fast", max_rows=2, max_len=32), model, prompts, chunk=8)
    assert (shifted[1] - good[1]).abs().max() > 1e-3
    monkeypatch.undo()
    from draftsmith.decode import forward as forwards

    monkeypatch.setattr(forwards, "row_index", lambda rows, like: torch.zeros_like(like))  # every row in cache row 0
    mixed = prefill(make_forward(model, "fast", max_rows=2, max_len=32), model, prompts, chunk=8)
    assert (mixed[1] - good[1]).abs().max() > 1e-3


def test_an_unsupported_family_is_refused_for_fast_and_served_by_hf():
    model = tiny_family("mistral-7b-instruct", sliding_window=8)
    assert "sliding_window" in fast_problem(model)
    with pytest.raises(DraftsmithError, match=r"engine.forward=fast: config.sliding_window=8 .*use engine.forward=hf"):
        make_forward(model, "fast", max_rows=1, max_len=16)
    with pytest.raises(DraftsmithError, match="engine.forward='nope' is not known; valid: auto, fast, hf"):
        make_forward(model, "nope", max_rows=1, max_len=16)
    assert isinstance(make_forward(tiny_family("llama2-7b"), "auto", max_rows=1, max_len=16), FastLlama)
    assert isinstance(make_forward(tiny_family("llama2-7b"), "hf", max_rows=1, max_len=16), HFForward)


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen2.5-7b-instruct"])  # qwen2: q/k/v biases through the packed op
def test_packed_weights_compute_the_modules_own_linear(preset):
    """engine.weights=packed (what auto picks on a CPU): every linear layer of the fast forward runs
    on a oneDNN-prepacked copy of the module's weight. Its logits are HF's forward's in that dtype
    within bf16 rounding, chunked prefill, tree and all, and a row's logits do not depend on how
    many rows share the forward (one row alone against three). In bf16 where this CPU has the
    kernels, else in fp32 (AVX2): the dtype auto packs on this CPU."""
    dtype = torch.bfloat16 if cpu_prepacks(torch.bfloat16) else torch.float32
    model = tiny_family(preset).to(dtype)
    weights = "auto"
    fwd = make_forward(model, "fast", max_rows=3, max_len=64, weights=weights)
    assert fwd.packed is not None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (11, 5, 8)]
    last = prefill(fwd, model, prompts, chunk=4, rows=[0, 1, 2])
    assert len(fwd.packed) == 4 * model.config.num_hidden_layers  # (q, k, v), o, (gate, up), down of every layer
    for p, logits in zip(prompts, last):
        torch.testing.assert_close(logits.float(), hf_logits(model, p).float(), rtol=0.02, atol=0.02)
    trees = [DraftTree(tokens=torch.randint(0, 160, (len(TREE),), generator=g), parents=torch.tensor(TREE))
             for _ in range(3)]
    together = run(fwd, model, trees, [len(p) for p in prompts])
    alone = make_forward(model, "fast", max_rows=1, max_len=64, weights=weights)
    prefill(alone, model, prompts[:1], chunk=4)
    (first,) = run(alone, model, trees[:1], [len(prompts[0])])
    assert torch.equal(first, together[0])


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_query_attention_over_the_cache_is_hfs_law(dtype, queries):
    """The fast forward's attention in every CPU dtype (one query in bf16 / fp16: the group's query
    heads stacked, stacks_one_query; several: stacked in every dtype) over the cache's strided views of
    rows of different lengths equals grouped-query attention as HF computes it (each key / value head
    repeated for its group: repeat_kv), in float64, within the dtype's rounding; query heads paired
    with the wrong key / value heads (a group taken as every Hkv-th head) are far outside it."""
    from draftsmith.decode.forward import attention, stacks_one_query

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S, max_len = 4, 9, 3, 64, 40, 64
    G = Hq // Hkv
    cache_k, cache_v = (torch.randn(6, Hkv, max_len, D, generator=g).to(dtype) for _ in range(2))
    keys, values = cache_k[:B, :, :S], cache_v[:B, :, :S]  # StaticKV.read's views of rows 0..B-1
    q = torch.randn(B, Hq, queries, D, generator=g).to(dtype)
    allowed = torch.zeros(B, queries, S, dtype=torch.bool)
    for b, cached in enumerate((S - queries, 17, 30, 5)):  # each row's own length; its tree's last queries
        allowed[b, :, :cached] = True
        allowed[b, :, cached:cached + queries] = torch.ones(queries, queries, dtype=torch.bool).tril()
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None]
    if queries > 1:
        additive = additive.repeat(1, 1, G, 1)  # (B, 1, G*N, S), as FastLlama.forward tiles it
    assert stacks_one_query(q) == (dtype != torch.float32)
    out = attention(q, keys, values, additive, D ** -0.5).double()  # (B, N, Hq * D)

    def law(pairs):  # float64 attention, query head h reading key / value head pairs[h]
        k, v = keys.double()[:, pairs], values.double()[:, pairs]  # (B, Hq, S, D)
        scores = (q.double() @ k.transpose(2, 3)) * D ** -0.5
        probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(B, queries, Hq * D)

    tolerance = {torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 5e-3}[dtype]  # a few units in the last place
    assert (out - law(torch.arange(Hq) // G)).abs().max() < tolerance  # repeat_kv: head h reads h // G
    assert (out - law(torch.arange(Hq) % Hkv)).abs().max() > 10 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_is_hfs_bit_for_bit(dtype):
    """The fast forward's RMSNorm (torch's fused op for fp32, HF's arithmetic otherwise) gives HF's
    LlamaRMSNorm's bits, over the widths and row counts a step holds; and on a bf16 input the fused
    op, which rounds once where HF's rounds twice, does not (why it runs for fp32 only)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from draftsmith.decode.forward import rms_norm

    g = torch.Generator().manual_seed(0)
    for width in (64, 576, 2048):
        norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(width, generator=g).to(dtype)
        for rows in (1, 3, 9, 16, 300):
            for scale in (1e-3, 1.0, 30.0):
                x = (torch.randn(rows, width, generator=g) * scale).to(dtype)
                assert torch.equal(rms_norm(x, norm), norm(x)), (width, rows, scale)
    if dtype == torch.bfloat16:
        fused = torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        assert not torch.equal(fused, norm(x))


def test_packed_weights_are_refused_where_they_cannot_run():
    model = tiny_family("smollm2-135m")  # float64
    with pytest.raises(DraftsmithError, match="engine.weights=packed prepacks bf16 / fp16 / fp32 .*torch.float64") as e:
        make_forward(model, "fast", max_rows=1, max_len=16, weights="packed")
    assert "\n" not in str(e.value)
    assert make_forward(model, "fast", max_rows=1, max_len=16).packed is None  # auto: the module's own weights
    bf16 = model.to(torch.bfloat16)
    with pytest.raises(DraftsmithError, match="engine.weights=packed and engine.invariant"):
        make_forward(bf16, "fast", max_rows=1, max_len=16, invariant=True, weights="packed")
    with pytest.raises(DraftsmithError, match="engine.forward=hf here"):
        make_forward(bf16, "hf", max_rows=1, max_len=16, weights="packed")
    with pytest.raises(DraftsmithError, match="engine.weights='fast'.*valid: auto, packed, plain"):
        make_forward(bf16, "fast", max_rows=1, max_len=16, weights="fast")
    assert make_forward(bf16, "fast", max_rows=1, max_len=16, weights="plain").packed is None
    with pytest.raises(DraftsmithError, match="engine.weights=packed cannot run under engine.compile=count"):
        make_forward(bf16, "fast", max_rows=1, max_len=16, compile="count", weights="packed")
    assert make_forward(bf16, "fast", max_rows=1, max_len=16, compile="count").packed is None  # auto: compiled


@pytest.mark.parametrize("bf16_kernels", [True, False])
def test_auto_packs_fp32_exactly_where_fp32_is_the_fast_dtype(monkeypatch, bf16_kernels):
    """engine.weights=auto: fp32 runs the modules' own weights on a CPU with oneDNN's bf16 kernels
    (AVX-512: bf16 is the dtype to decode in) and packed weights on one without (AVX2: fp32 is,
    and oneDNN's fp32 beats ATen's there); packed on request either way. bf16 packs where it can."""
    import draftsmith.decode.forward as forward

    monkeypatch.setattr(forward, "cpu_prepacks", lambda dtype: bf16_kernels or dtype == torch.float32)
    fp32 = tiny_family("smollm2-135m").to(torch.float32)
    assert (make_forward(fp32, "fast", max_rows=1, max_len=16).packed is None) == bf16_kernels
    assert make_forward(fp32, "fast", max_rows=1, max_len=16, weights="packed").packed is not None
    assert make_forward(fp32, "fast", max_rows=1, max_len=16, weights="plain").packed is None
    assert make_forward(fp32, "fast", max_rows=1, max_len=16, invariant=True).packed is None
    bf16 = tiny_family("smollm2-135m").to(torch.bfloat16)
    assert (make_forward(bf16, "fast", max_rows=1, max_len=16).packed is not None) == bf16_kernels
    monkeypatch.undo()  # the real probe: auto packs fp32 on this CPU exactly when it has no bf16 kernels
    packed = make_forward(fp32, "fast", max_rows=1, max_len=16).packed is not None
    assert packed == (forward.cpu_prepacks(torch.float32) and not forward.cpu_prepacks(torch.bfloat16))


def test_packed_weights_are_refused_on_a_cpu_without_the_kernels(monkeypatch):
    """An AVX2-only CPU (torch refuses oneDNN's prepacked bf16 linear there): auto runs the modules'
    own weights, packed is refused in one line naming the CPU."""
    import draftsmith.decode.forward as forward

    monkeypatch.setattr(forward, "cpu_prepacks", lambda dtype: False)
    bf16 = tiny_family("smollm2-135m").to(torch.bfloat16)
    assert make_forward(bf16, "fast", max_rows=1, max_len=16).packed is None
    with pytest.raises(DraftsmithError, match=r"engine.weights=packed: this CPU \(.*\) has no oneDNN prepacked "
                                              r"torch.bfloat16 linear.*use engine.weights=auto or plain") as e:
        make_forward(bf16, "fast", max_rows=1, max_len=16, weights="packed")
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    if forward.cpu_prepacks(torch.bfloat16):  # the real probe agrees with what the kernel does
        assert make_forward(bf16, "fast", max_rows=1, max_len=16).packed is not None
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
