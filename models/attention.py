"""Grouped-query attention without copying the keys: the `grouped` attention implementation.

transformers' eager attention repeats every key/value head for the query heads that share it
(`repeat_kv`), and its sdpa path is slow on CPU for bf16 decoding: with SmolLM2's 9 query / 3
key-value heads, a 64-row bf16 decode step over a 200-token cache took 358 ms with sdpa, 246
ms with eager and 180 ms here (interleaved medians on the 2-core dev box; single-row steps
and trees are equal within noise). Here the query heads of a group are stacked along the
query axis and multiplied with their one key head:

    query (B, H, q, D) -> (B, H_kv, G*q, D);  weights = query @ key^T (B, H_kv, G*q, T) * scale
    + the additive mask broadcast over the group; softmax in float32 (as eager; float64 models
    keep float64); @ value

which is eager attention's arithmetic, element for element, without the copies. Chosen by
`model.attn_implementation=grouped`; it takes the 4D tree masks the decoder builds.

Keys cut from a preallocated cache buffer (decode.cache.BufferedLayer hands out views
`buffer[:, :, :T]`) are not contiguous, and a bf16 CPU matmul copies such a view first: the
whole cache, every layer, every step (80 of 300 ms in a 64-row step). When the keys and values
are such views (they carry their buffer as `cache_buffer`), attention runs over the whole
zero-initialised buffer instead, with the
slots past T masked out (their weights are exactly 0): no copy, a few unused slots of work.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "grouped"


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """query (B, H, q, D), key / value (B, H_kv, T, D), attention_mask additive (B | 1, 1, q, >= T)
    -> (output (B, q, H, D), None). Query head h reads key head h // (H / H_kv), as in HF."""
    if dropout and module.training:
        raise ValueError("the grouped attention implementation is for inference (dropout must be 0)")
    B, H, q, D = query.shape
    kv_heads, T = key.shape[1], key.shape[-2]
    key, value = buffer_of(key), buffer_of(value)
    if key.shape[-2] != value.shape[-2]:  # only one of them came from a buffer
        key, value = key[:, :, :T], value[:, :, :T]
    group = H // kv_heads
    stacked = query.reshape(B, kv_heads, group * q, D)  # heads of a group are consecutive
    weights = torch.matmul(stacked, key.transpose(2, 3)) * scaling  # (B, H_kv, G*q, T)
    if attention_mask is not None or key.shape[-2] > T:
        mask = (attention_mask[:, :, :, :T] if attention_mask is not None  # (B | 1, 1, q, T)
                else torch.zeros(1, 1, q, T, dtype=weights.dtype, device=weights.device))
        if key.shape[-2] > T:  # the buffer's unused slots
            mask = nn.functional.pad(mask, (0, key.shape[-2] - T), value=torch.finfo(mask.dtype).min)
        weights = (weights.view(B, kv_heads, group, q, -1) + mask[:, :, None]).view(B, kv_heads, group * q, -1)
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)  # float32 as eager; float64 stays exact
    weights = nn.functional.softmax(weights, dim=-1, dtype=softmax_dtype).to(query.dtype)
    out = torch.matmul(weights, value)  # (B, H_kv, G*q, D)
    return out.view(B, H, q, D).transpose(1, 2).contiguous(), None


BUFFER_ATTR = "cache_buffer"  # set by decode.cache.BufferedLayer on the views it hands out


def buffer_of(t: torch.Tensor) -> torch.Tensor:
    """The contiguous (B, H, capacity, D) buffer that `t` (B, H, T, D) is the prefix view of
    (a BufferedLayer view carries it as t.cache_buffer), else `t` itself."""
    base = getattr(t, BUFFER_ATTR, None)
    if (base is not None and base.is_contiguous() and base.data_ptr() == t.data_ptr()
            and base.shape[:2] == t.shape[:2] and base.shape[3] == t.shape[3] and base.stride() == t.stride()):
        return base
    return t


AttentionInterface.register(NAME, grouped_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # the same 4D float mask eager attention takes
