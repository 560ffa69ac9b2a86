"""The verifier forward the engine runs: many rows, each a token tree, over one static KV cache.

    fwd = make_forward(model, "fast", max_rows=8, max_len=2048)   # or "hf", or "auto"
    hidden, captured = fwd(tokens, positions, slots, allowed, rows=4, length=S, capture=[1, 14, 26])

One call verifies B rows of N tokens each (a row's tree, padded; a prefill chunk is a chain):

    tokens    (B, N) long   the tokens fed
    positions (B, N) long   their positions (cache length + depth in the tree)
    slots     (B, N) long   the cache slots their keys/values are written to (cache length + i)
    allowed   (B, N, S) bool  what each token attends to: its row's cached slots, its ancestors, itself
    rows      int B (cache rows 0..B-1) or a (B,) long tensor of cache rows
    length    S: the attended slots 0..S-1 of each row (a bucket >= every row's cache length + N)

-> hidden (B, N, H), the final normed states (lm_head(hidden) are the logits), and `captured`
(B, N, len(capture) * H): the outputs of those decoder layers (EAGLE-3's fusion layers; sorted,
distinct; the last layer's is the normed state, as HF's hidden_states[-1]), or None.

The cache (`StaticKV`) is preallocated: (layers, max_rows, kv_heads, max_len, head_dim) keys and
values. A row's accepted path is compacted in place with one fixed-size gather for all layers
(`StaticKV.compact`), and a finished row's cache is handed to another by copying it
(`StaticKV.move_row`).

Two implementations, chosen by `engine.forward` (FORWARDS; unknown values refused):
- fast: a purpose-built forward for the Llama family (llama, mistral, qwen2: RMSNorm, rotary
  embeddings with HF's own inv_freq and scaling, grouped-query attention, optional q/k/v/o and
  MLP biases, SwiGLU), running from the HF model's own weights (no copy). Its arithmetic follows
  HF's modules (RMSNorm in float32, the rotary embedding bit for bit, attention through torch's
  fused scaled_dot_product_attention as HF's default sdpa attention runs it); checked logit for
  logit against HF's forward on tiny configs of every preset family
  (tests/decode/test_forward.py). One Python call per layer op, q's and k's rotary embedding in
  one, no HF module dispatch, one mask per step: the per-step overhead that eager HF pays 30 times.
- hf: the HF model's own decoder with a transformers Cache that writes into the same static
  cache (the fallback for every other architecture).
- auto: fast when the architecture is supported, else hf.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from draftsmith.decode.tree import additive_mask
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import cpu_prepacks

FAST_FAMILIES = ("llama", "mistral", "qwen2")


class StaticKV:
    """Preallocated keys and values (layers, rows, kv_heads, max_len, head_dim) in one tensor each."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (num_layers, rows, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.rows, self.max_len = rows, max_len

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows, slots: torch.Tensor) -> None:
        """keys / values (B, Hkv, N, D) of the step's tokens -> cache slots (B, N) of `rows`."""
        index = row_index(rows, slots)  # (B, N) cache rows
        self.keys[layer][index, :, slots] = keys.transpose(1, 2)  # (B, N, Hkv, D)
        self.values[layer][index, :, slots] = values.transpose(1, 2)

    def read(self, layer: int, rows, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) (B, Hkv, length, D) of `rows`: views for rows 0..B-1, copies otherwise."""
        if isinstance(rows, int):
            return self.keys[layer, :rows, :, :length], self.values[layer, :rows, :, :length]
        return self.keys[layer, rows, :, :length], self.values[layer, rows, :, :length]

    def compact(self, rows, base: torch.Tensor, order: torch.Tensor) -> None:
        """For each row b, slots base[b] + j <- base[b] + order[b, j] (j < N), every layer at
        once: the accepted path (order's first entries) moves to the front of the step's slots."""
        B, N = order.shape
        src = base[:, None] + order  # (B, N)
        dst = base[:, None] + torch.arange(N, device=order.device)[None]  # (B, N)
        index = row_index(rows, src)
        for cache in (self.keys, self.values):
            moved = cache[:, index, :, src]  # (B, N, layers, Hkv, D): a copy, so overlaps are safe
            cache[:, index, :, dst] = moved

    def grow(self, max_len: int) -> None:
        """More slots per row (a request longer than the cache was sized for): one copy."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], max_len, old.shape[-1]))
            new[:, :, :, : self.max_len] = old
            setattr(self, name, new)
        self.max_len = max_len

    def swap_rows(self, a: int, b: int, length: int) -> None:
        """Rows a and b exchange their first `length` slots."""
        for cache in (self.keys, self.values):
            cache[:, [a, b], :, :length] = cache[:, [b, a], :, :length]  # advanced indexing reads a copy first

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row dst's first `length` slots <- row src's (a finished row's cache row reused)."""
        if src != dst and length:
            self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
            self.values[:, dst, :, :length] = self.values[:, src, :, :length]


def row_index(rows, like: torch.Tensor) -> torch.Tensor:
    """(B, N) cache row of every token: rows 0..B-1, or the given (B,) rows."""
    B, N = like.shape
    base = torch.arange(rows, device=like.device) if isinstance(rows, int) else rows
    return base[:, None].expand(B, N)


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only HF model's attention."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def fast_problem(model) -> str | None:
    """Why the fast forward cannot run this model exactly (one line), or None."""
    cfg = model.config
    if cfg.model_type not in FAST_FAMILIES:
        return f"config.model_type={cfg.model_type!r} is not in the Llama family ({', '.join(FAST_FAMILIES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"config.hidden_act={cfg.hidden_act!r} (the fast forward is SwiGLU with silu)"
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
        return f"config.sliding_window={cfg.sliding_window} is active (the static cache is full attention)"
    rope = getattr(model.model, "rotary_emb", None)
    if rope is None or not hasattr(rope, "inv_freq"):
        return "the model has no rotary embedding with inv_freq"
    if getattr(rope, "rope_type", "default") == "dynamic":
        return "dynamic rope scaling changes inv_freq with the length (not a static table)"
    return None


INVARIANT_ROWS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 8, torch.float64: 8}  # linear chunk rows
# engine.invariant: how the fast forward makes a row's logits independent of the rows beside it
# (off; rows: every linear layer on chunks of INVARIANT_ROWS rows; float64: every linear layer in
# float64, rounded back). Attention runs in float64 in both modes.
INVARIANT_MODES = {"false": None, "true": "rows", "rows": "rows", "float64": "float64"}


def invariant_mode(value) -> str | None:
    """engine.invariant (false | true | rows | float64; true means rows) -> None, "rows" or "float64"."""
    key = "false" if value is None else str(value).lower() if isinstance(value, (bool, str)) else repr(value)
    return choose(INVARIANT_MODES, key, "engine.invariant")


class FastLlama:
    """The Llama-family decoder as plain tensor ops over the HF model's own weights.

    invariant (engine.invariant, "rows" or "float64"): a row's logits do not depend on how many
    rows share the forward (a plain step, a tree of any size, other rows of a batch). "rows": every
    linear layer runs on chunks of exactly INVARIANT_ROWS rows (padded; one GEMM shape, so one
    kernel and one reduction order per row whatever the step holds). "float64": every linear layer
    runs in float64 on float64 copies of the weights (4x a bf16 model's memory) and rounds back
    (products of bf16 / fp16 values are exact there and the sums round at 1e-16, so whichever
    kernel runs, the rounded result is the same). Both run attention in float64 (the scores do not
    depend on the kernel; the softmax sums and the weighted values round at 1e-16, far below the
    model dtype's step)."""

    name = "fast"

    def __init__(self, model, cache: StaticKV, invariant=None, compile: str | None = None, packed: bool = False):
        problem = fast_problem(model)
        if problem:
            raise DraftsmithError(f"engine.forward=fast: {problem}; use engine.forward=hf (or auto)")
        self.model, self.cache, self.invariant = model, cache, invariant_mode(invariant)
        self.wide = {}  # linear module -> its (weight, bias) in float64 (invariant="float64"), made on first use
        # (linear modules reading one input) -> their weights stacked and prepacked for oneDNN, and their
        # biases (engine.weights=packed), made on first use
        self.packed: dict | None = {} if packed else None
        self.backend, self.graphs = compile, {}  # capture layers -> the compiled step (a constant inside each)
        self.chunk = INVARIANT_ROWS.get(next(model.parameters()).dtype, 8)
        inner = model.model
        self.embed, self.norm, self.layers = inner.embed_tokens, inner.norm, list(inner.layers)
        # per layer, the modules a step reads, looked up once (an nn.Module attribute costs a
        # Python lookup chain each time: ~20 a layer, 30 layers, every step)
        self.blocks = [(layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                        layer.self_attn.o_proj, layer.post_attention_layernorm,
                        (layer.mlp.gate_proj, layer.mlp.up_proj), layer.mlp.down_proj) for layer in self.layers]
        self.num_layers, self.kv_heads, self.head_dim = kv_shape(model)
        self.heads = model.config.num_attention_heads
        rope = inner.rotary_emb
        self.inv_freq, self.rope_scaling = rope.inv_freq, float(getattr(rope, "attention_scaling", 1.0))
        self.scale = self.layers[0].self_attn.scaling

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) (B, 1, N, D) in `dtype`, as HF's rotary embedding computes them, the
        sin's first half negated: x * cos + swap_halves(x) * signed sin == HF's
        x * cos + rotate_half(x) * sin bit for bit (a negation is exact), in one op fewer."""
        freqs = positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        sin = torch.cat((-sin[..., : freqs.shape[-1]], sin[..., freqs.shape[-1]:]), dim=-1)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    @torch.inference_mode()
    def __call__(self, tokens, positions, slots, allowed, rows, length: int, capture=()):
        return self.many([(tokens, positions, slots, allowed, rows, length)], capture)[0]

    @torch.inference_mode()
    def many(self, steps: list[tuple], capture=()) -> list[tuple]:
        """Several steps in ONE forward (the decoding rows' trees and the prompt chunks of rows still
        reading their prompt): each a (tokens (B, N), positions, slots, allowed (B, N, S), rows,
        length) over its own cache rows, in its own shape. Every linear layer reads its weights once
        for all their tokens; attention runs per step. -> [(hidden (B, N, H), captured or None)] per
        step. Compiled: the steps one after another, each a compiled step."""
        keep = tuple(i in capture for i in range(self.num_layers))  # bools: never made symbolic by dynamo
        if self.backend is None:
            return self.forward(steps, keep)
        if keep not in self.graphs:
            def step(tokens, positions, slots, allowed, rows, length):
                return self.forward([(tokens, positions, slots, allowed, rows, length)], keep)[0]
            self.graphs[keep] = compiled(step, self.backend, self.cache.keys.device)
        return [self.graphs[keep](*step) for step in steps]

    def forward(self, steps: list[tuple], keep: tuple[bool, ...]) -> list[tuple]:
        """The forward itself: static shapes per (B, N, S) bucket, no host syncs (compilable whole);
        keep[i]: return layer i's output."""
        exact = self.invariant is not None
        shapes, embedded = [], []
        for tokens, positions, slots, allowed, rows, length in steps:
            B, N = tokens.shape
            e = self.embed(tokens)  # (B, N, H)
            cos, sin = self.rope(positions, e.dtype)  # (B, 1, N, D)
            # (B, 1, N, S): bool (True = attend) for the exact attention, else an additive mask (0 or
            # -inf) in the model's dtype (the fused attention misreads one of another dtype), made once
            # here rather than converted in every layer
            mask = allowed[:, None] if exact else torch.zeros(
                allowed.shape, dtype=e.dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))[:, None]
            if not exact and N > 1 and self.heads > self.kv_heads:
                mask = mask.repeat(1, 1, self.heads // self.kv_heads, 1)  # (B, 1, G*N, S): stacked query heads
            shapes.append((B, N, rows, slots, length, cos, sin, mask))
            embedded.append(e.view(B * N, -1))
        h = embedded[0] if len(steps) == 1 else torch.cat(embedded)  # (T, H): every step's tokens
        sizes = [B * N for B, N, *_ in shapes]
        captured = []
        for i, (norm_in, qkv_proj, o_proj, norm_post, gate_up, down_proj) in enumerate(self.blocks):
            x = rms_norm(h, norm_in)
            qkv = self.linears(qkv_proj, x, joined=True)  # (T, (Hq + 2 Hkv) D)
            parts = [qkv] if len(steps) == 1 else qkv.split(sizes)
            o = [self.attend(i, part, *shape, exact) for part, shape in zip(parts, shapes)]  # (B * N, Hq * D) each
            h = h + self.linear(o_proj, o[0] if len(o) == 1 else torch.cat(o))
            x = rms_norm(h, norm_post)
            gate, up = self.linears(gate_up, x)
            h = h + self.linear(down_proj, F.silu(gate) * up)
            if keep[i] and i < self.num_layers - 1:
                captured.append(h)
        hidden = rms_norm(h, self.norm)  # (T, H)
        if keep[-1]:  # HF's hidden_states[-1] is the normed output, as trained on
            captured.append(hidden)
        layers = torch.cat(captured, dim=-1) if captured else None  # (T, L * H)
        out, start = [], 0
        for B, N, *_ in shapes:
            out.append((hidden[start:start + B * N].view(B, N, -1),
                        None if layers is None else layers[start:start + B * N].view(B, N, -1)))
            start += B * N
        return out

    def attend(self, layer: int, qkv, B: int, N: int, rows, slots, length: int, cos, sin, mask, exact: bool):
        """One step's attention in `layer`: its tokens' q, k, v (B * N, (Hq + 2 Hkv) D), rotated,
        k and v written to its cache rows -> (B * N, Hq * D)."""
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        qkv = qkv.view(B, N, -1)
        qk = qkv[..., : (Hq + Hkv) * D].view(B, N, Hq + Hkv, D).transpose(1, 2)  # (B, Hq + Hkv, N, D)
        swapped = qk.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # halves swapped
        qk = qk * cos + swapped * sin  # the rotary embedding of q's and k's heads at once
        q, k = qk[:, :Hq], qk[:, Hq:]  # (B, Hq, N, D), (B, Hkv, N, D)
        v = qkv[..., (Hq + Hkv) * D:].view(B, N, Hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
        self.cache.write(layer, k, v, rows, slots)
        keys, values = self.cache.read(layer, rows, length)  # (B, Hkv, S, D)
        return attention(q, keys, values, mask, self.scale, exact=exact).view(B * N, Hq * D)

    def linears(self, modules: tuple, x: torch.Tensor, joined: bool = False):
        """[module(x) for module in modules] (linear layers reading the same x); joined: their
        outputs side by side in one tensor (..., sum out). Packed: ONE product over their weights
        stacked and prepacked together (q, k, v; gate, up), split after: each output element is the
        same dot product, and a wider matrix reads faster than three."""
        if self.invariant is not None or self.packed is None:
            outs = [self.linear(m, x) for m in modules]
            return torch.cat(outs, dim=-1) if joined else outs
        if modules not in self.packed:
            weight = torch.cat([m.weight for m in modules])  # (sum out, in)
            bias = (None if all(m.bias is None for m in modules) else
                    torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules]))
            rows = PACK_ROWS.get(weight.dtype, 1)  # the product's rows oneDNN lays the weight out for
            self.packed[modules] = (torch.ops.mkldnn._reorder_linear_weight(weight, rows), bias)
        packed, bias = self.packed[modules]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
        out = out.view(*x.shape[:-1], -1)
        return out if joined else list(out.split([m.out_features for m in modules], dim=-1))

    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        """module(x); invariant="rows": over chunks of exactly `chunk` rows (the last padded);
        invariant="float64": in float64, rounded to x's dtype."""
        if self.invariant is None:
            if self.packed is None:
                return module(x)
            return self.linears((module,), x)[0]
        if self.invariant == "float64":
            if module not in self.wide:
                bias = None if module.bias is None else module.bias.double()
                self.wide[module] = (module.weight.double(), bias)
            weight, bias = self.wide[module]
            return F.linear(x.double(), weight, bias).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        m = flat.shape[0]
        pad = -m % self.chunk
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        out = torch.cat([module(part) for part in flat.split(self.chunk)])
        return out[:m].reshape(*x.shape[:-1], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over (m, H) states -> (m, V), chunked like every linear in invariant mode."""
        return self.linear(self.model.get_output_embeddings(), hidden)


COMPILERS = {"none": None, "inductor": "inductor", "count": "count"}  # engine.compile


def compiled(fn, backend: str, device: torch.device):
    """fn under torch.compile: the whole step as one graph (fullgraph: a graph break is an error),
    shapes marked dynamic so the buckets share graphs; on a GPU inductor captures CUDA graphs
    (mode reduce-overhead). backend="count" runs the captured graphs eagerly and counts them
    (tests: recompilations stay bounded)."""
    import torch._dynamo

    if backend == "count":
        def counting(gm, example_inputs):
            compiled.graphs += 1
            return gm.forward
        return torch.compile(fn, backend=counting, dynamic=True, fullgraph=True)
    mode = "reduce-overhead" if device.type == "cuda" else None
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn, backend=backend, mode=mode, dynamic=True, fullgraph=True)


compiled.graphs = 0  # graphs captured by backend="count"


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """HF's LlamaRMSNorm: in float32, then the weight times the result in x's dtype. An fp32 x
    and weight: torch's fused rms_norm, one op for seven, the same bits (HF's module against it:
    tests/decode/test_forward.py, test_rms_norm_is_hfs_bit_for_bit); other dtypes round twice in
    HF's (the normed value, then the product), which the fused op does not."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def attention(q, keys, values, mask, scale: float, exact: bool = False) -> torch.Tensor:
    """Grouped-query attention: q (B, Hq, N, D), keys / values (B, Hkv, S, D) -> (B, N, Hq * D).
    mask: exact, (B, 1, N, S) bool (True = attend); else additive, (B, 1, N, S) for one query and
    (B, 1, G*N, S), tiled over a group's G query heads, for several (FastLlama.forward makes it once
    a step).

    Default: torch's fused scaled_dot_product_attention (on a CPU its flash kernel: float32
    accumulators, reading the cache's strided views in place; a batched matmul would first copy
    every row's keys and values out of the cache, ~20 ms a step at 16 rows). A group's query heads
    are stacked along the query axis (each key and value head read once for all of them) for
    several queries, and for one query where the kernel's own grouped-query path is slow
    (``stacks_one_query``).
    exact (FastLlama's invariant mode): eager arithmetic in float64 (scores, softmax and weighted
    values round at 1e-16, whatever the kernel), the result rounded to q's dtype; the query heads
    of a group are stacked along the query axis (no repeated keys)."""
    if not exact:
        B, Hq, N, D = q.shape
        group = Hq // keys.shape[1]
        if group == 1 or (N == 1 and not stacks_one_query(q)):
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(B, N, Hq * D)  # (B, N, Hq * D)
        # a group's query heads stacked along the query axis, so each key and value head is read once
        # for all of them (about twice as fast for a tree or a prompt chunk); one query's (B, 1, 1, S)
        # mask broadcasts over the group, several queries' is tiled (B, 1, G*N, S)
        out = F.scaled_dot_product_attention(q.reshape(B, keys.shape[1], group * N, D), keys, values,
                                             attn_mask=mask, scale=scale)  # (B, Hkv, G*N, D)
        return out.view(B, Hq, N, D).transpose(1, 2).reshape(B, N, Hq * D)
    dtype, q, keys, values = q.dtype, q.double(), keys.double(), values.double()
    B, Hq, N, D = q.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    group = Hq // kv_heads
    stacked = q.reshape(B, kv_heads, group * N, D)
    scores = torch.matmul(stacked, keys.transpose(2, 3)) * scale  # (B, Hkv, G*N, S)
    scores = scores.view(B, kv_heads, group, N, S).masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(B, kv_heads, group * N, S), values)  # (B, Hkv, G*N, D)
    return out.view(B, Hq, N, D).transpose(1, 2).reshape(B, N, Hq * D).to(dtype)


def stacks_one_query(q: torch.Tensor) -> bool:
    """Whether one query a row also stacks its group's query heads: on a CPU in bf16 / fp16, where
    the flash kernel's enable_gqa path took 4.6-7x as long (the 2-core AMD EPYC Zen 4 box, torch
    2.13, SmolLM2's 9 query / 3 key-value heads over 256 cached slots: 16 rows 1.49 -> 0.22 ms a
    layer in bf16, 2.63 -> 0.99 in fp16; one row 0.106 -> 0.023 in bf16), not in fp32 (0.18 against
    0.22 at 16 rows) nor on a GPU (not measured there: its path is as it was)."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)


class _StaticLayer(DynamicLayer):
    """A transformers cache layer over one layer of a StaticKV for the step being run."""

    def __init__(self, store: StaticKV, index: int):
        super().__init__()
        self.store, self.index, self.is_initialized = store, index, True
        self.step = None  # (rows, slots, length) of the current forward

    def update(self, key_states, value_states, *args, **kwargs):
        rows, slots, length = self.step
        self.store.write(self.index, key_states, value_states, rows, slots)
        return self.store.read(self.index, rows, length)

    def get_seq_length(self) -> int:
        return self.step[2] if self.step else 0


class HFForward:
    """The HF model's own decoder over the static cache (any architecture whose layers are full
    attention and take a 4D additive mask)."""

    name = "hf"

    def __init__(self, model, cache: StaticKV):
        self.model, self.cache = model, cache
        self.decoder = model.get_decoder()
        self.hf_cache = Cache(layers=[_StaticLayer(cache, i) for i in range(cache.keys.shape[0])])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    @torch.inference_mode()
    def __call__(self, tokens, positions, slots, allowed, rows, length: int, capture=()):
        for layer in self.hf_cache.layers:
            layer.step = (rows, slots, length)
        mask = additive_mask(allowed, self.model.dtype)[:, None]  # (B, 1, N, S)
        out = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.hf_cache,
                           use_cache=True, output_hidden_states=bool(capture))
        captured = torch.cat([out.hidden_states[i + 1] for i in capture], dim=-1) if capture else None
        return out.last_hidden_state, captured

    def many(self, steps: list[tuple], capture=()) -> list[tuple]:
        """Several steps (FastLlama.many's contract), one forward each."""
        return [self(*step, capture) for step in steps]


FORWARDS = {"fast": FastLlama, "hf": HFForward, "auto": None}  # engine.forward
WEIGHTS = {"auto": "auto", "packed": "packed", "plain": "plain"}  # engine.weights
# The rows oneDNN is told to expect when it lays out a prepacked weight (its batch-size hint). At 1
# it picks a one-row layout: on the 2-core AVX2 AMD EPYC box an fp32 product of 2-64 rows then took
# 1.3-2x as long as with a hint of 4-64 (30 layers' weights and the lm_head, 2 threads: 2 rows
# 46.6 -> 24.7-28.1 ms, 16 rows 72.0 -> 53.7-59.0, 64 rows 177.0 -> 136.4-142.9; one row 25-29 ms
# with any hint), and with a hint >= 4 each row's bits were the same whatever the rows beside it
# (with 1, one row alone differed). bf16 / fp16 keep the hint they were measured with on the
# AVX-512 box (1: bit for bit F.linear's up to 16 rows); other hints there are not measured yet.
PACK_ROWS = {torch.float32: 16}


def packs(model, weights: str, invariant=None, compile: str = "none") -> bool:
    """Whether the fast forward runs its linear layers on oneDNN-prepacked weights (engine.weights):
    packed: yes (a bf16 / fp16 / fp32 verifier on a CPU whose oneDNN has the kernels: cpu_prepacks;
    fp32 packs everywhere, bf16 / fp16 need AVX-512 or AVX-NE-CONVERT); plain:
    the modules' own weights; auto: packed for bf16 / fp16 where they pack, and for fp32 where bf16
    does not (a CPU without AVX-512, where fp32 is the fast dtype: fast_dtype), unless a
    shape-invariant mode runs its own linear layers or the step is compiled (torch.compile cannot
    trace the prepacked weights). On the 2-core Intel (AVX-512) dev box a one-row bf16 SmolLM2 step
    took 30.4 ms instead of 39.5 (scripts/bench/profile_step.py forwards=[fast,packed]), the products
    bit for bit F.linear's up to 16 rows; on the 2-core AVX2 AMD EPYC box oneDNN's fp32 (laid out
    for 16 rows: PACK_ROWS) beat ATen's at every step shape measured (1-16 rows x 1-9 tokens: 19-51%
    less a step). The price is a second copy of the layer weights in memory."""
    choose(WEIGHTS, weights, "engine.weights")
    param = next(model.parameters())
    fits = param.device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if weights == "packed" and not fits:
        raise DraftsmithError(f"engine.weights=packed prepacks bf16 / fp16 / fp32 weights for the CPU's oneDNN kernels; "
                              f"this verifier is {param.dtype} on {param.device.type}: use engine.weights=auto or plain")
    if weights == "packed" and invariant_mode(invariant) is not None:
        raise DraftsmithError("engine.weights=packed and engine.invariant both choose how the linear layers run: "
                              "drop one (engine.weights=auto picks packed only without engine.invariant)")
    if weights == "packed" and choose(COMPILERS, compile, "engine.compile") is not None:
        raise DraftsmithError(f"engine.weights=packed cannot run under engine.compile={compile} (torch.compile cannot "
                              f"trace oneDNN's prepacked weights): set engine.compile=none or engine.weights=auto")
    if weights == "packed" and not cpu_prepacks(param.dtype):
        raise DraftsmithError(f"engine.weights=packed: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no "
                              f"oneDNN prepacked {param.dtype} linear (it needs AVX-512 or AVX-NE-CONVERT): use "
                              f"engine.weights=auto or plain")
    # auto packs bf16 / fp16, and fp32 where it is the fast dtype (no bf16 kernels: AVX2)
    chosen = param.dtype in (torch.bfloat16, torch.float16) or not cpu_prepacks(torch.bfloat16)
    return weights == "packed" or (weights == "auto" and fits and chosen and cpu_prepacks(param.dtype)
                                   and invariant_mode(invariant) is None
                                   and choose(COMPILERS, compile, "engine.compile") is None)


def make_forward(model, kind: str, max_rows: int, max_len: int, invariant=None, compile: str = "none",
                 weights: str = "auto"):
    """The verifier forward of `kind` (fast | hf | auto) with its own static cache; invariant:
    FastLlama's shape-invariant mode (engine.invariant: false | true | rows | float64); compile:
    none | inductor (engine.compile); weights: auto | packed | plain (engine.weights, fast only)."""
    choose(FORWARDS, kind, "engine.forward")
    if kind == "auto":
        kind = "hf" if fast_problem(model) else "fast"
    if weights == "packed" and kind != "fast":
        raise DraftsmithError(f"engine.weights=packed is the fast forward's, and engine.forward={kind} here: "
                              f"set engine.forward=fast or engine.weights=auto")
    packed = packs(model, weights, invariant, compile)
    invariant = invariant_mode(invariant)
    backend = choose(COMPILERS, compile, "engine.compile")
    if invariant and kind != "fast":
        raise DraftsmithError(f"engine.invariant={invariant} needs the fast forward (its linear layers and attention "
                              f"are shape-invariant), and engine.forward={kind} here: "
                              f"{fast_problem(model) or 'set engine.forward=fast'}")
    layers, kv_heads, head_dim = kv_shape(model)
    param = next(model.parameters())
    if invariant == "float64" and param.dtype in (torch.float32, torch.float64):
        raise DraftsmithError(f"engine.invariant=float64 is for bf16 / fp16 verifiers (a float64 sum of {param.dtype} "
                              f"products can still round differently from one kernel to another); this verifier is "
                              f"{param.dtype}: use engine.invariant=rows")
    cache = StaticKV(layers, max_rows, kv_heads, max_len, head_dim, param.dtype, param.device)
    if backend is not None and kind != "fast":
        raise DraftsmithError(f"engine.compile={compile} compiles the fast forward, and engine.forward={kind} here: "
                              f"set engine.compile=none or engine.forward=fast")
    return FastLlama(model, cache, invariant, backend, packed) if kind == "fast" else HFForward(model, cache)
