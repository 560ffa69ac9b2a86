"""KV-cache compaction after a tree verification, on transformers' own Cache objects.

A verification forward appends all n tree nodes to the cache, at slots
[cache_len, cache_len + n). Only the accepted path (root first) may stay: its entries move to
[cache_len, cache_len + len(path)) and everything after is dropped, so the cache is exactly
what a plain left-to-right forward over prompt + accepted tokens would have produced (the
keys were computed at position cache_len + depth, which is the accepted token's real position).

transformers 5.x keeps one layer object per model layer in ``cache.layers``; a layer's
``keys``/``values`` are (B, H_kv, S, D). ``DynamicLayer.update`` concatenates, so its tensors
are rebound (never written in place) on the next forward and a sliced view here is safe. Note that 5.x's
``crop`` takes a NEGATIVE count of tokens to remove (a positive value raises), which is why it
is not used here.

Only full-attention layers are supported. Sliding-window layers keep a rolling window and a
``cumulative_length`` that no longer maps to slots once the window is full; quantized layers
hold a residual buffer plus quantized blocks; linear-attention/SSM layers have a recurrent
state that cannot drop tree nodes at all. Those raise instead of silently corrupting the cache.
"""

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicLayer

# Exact layer classes whose per-token keys/values can be compacted by index (subclasses such as
# DynamicSlidingWindowLayer or QuantizedLayer inherit from these but store tokens differently).
_DYNAMIC = (DynamicLayer,)


def check_compactable(cache: Cache) -> None:
    """Raise TypeError naming the fix if ``compact_cache`` cannot handle this cache."""
    if not isinstance(cache, Cache):
        raise TypeError(
            f"expected a transformers Cache (e.g. DynamicCache(config=model.config)), got "
            f"{type(cache).__name__}; legacy tuple caches are not supported"
        )
    if getattr(cache, "offloading", False):
        raise TypeError("KV-cache compaction does not support offloaded caches; build the cache with offloading=False")
    for i, layer in enumerate(cache.layers):
        if type(layer) in _DYNAMIC or isinstance(layer, DummyLayer):
            continue
        kind = type(layer).__name__
        if getattr(layer, "is_sliding", False):
            fix = (
                "sliding-window attention: load the verifier with config.sliding_window=None "
                "(exact while prompt + generation fits in the window)"
            )
        else:
            fix = "use a DynamicCache on a full-attention model (config.layer_types all 'full_attention')"
        raise TypeError(f"cannot compact cache layer {i} of type {kind}: {fix}")


def compact_cache(cache: Cache, cache_len: int, keep: torch.Tensor | Sequence[int]) -> None:
    """In place: keep only the tree nodes ``keep`` of the last tree forward.

    cache_len: tokens in the cache before the tree forward. keep (m,) node indices in
    increasing order, root first (the accepted path). After the call the cache holds
    cache_len + m tokens; entry cache_len + j is what node keep[j] wrote.
    """
    check_compactable(cache)
    keep_list = [int(k) for k in (keep.tolist() if isinstance(keep, torch.Tensor) else keep)]
    m = len(keep_list)
    if m == 0:
        raise ValueError("keep must contain at least the root (node 0)")
    if any(b <= a for a, b in zip(keep_list, keep_list[1:])) or keep_list[0] < 0:
        raise ValueError(f"keep must be increasing non-negative node indices, got {keep_list}")
    contiguous = keep_list == list(range(m))  # a chain prefix: only truncation needed
    new_len = cache_len + m

    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer) or not layer.is_initialized:
            continue  # KV-sharing consumer: stores nothing
        total = layer.get_seq_length()
        total = int(total)
        if cache_len + keep_list[-1] >= total:
            raise ValueError(
                f"layer {i} holds {total} tokens, but node {keep_list[-1]} of a tree appended at "
                f"{cache_len} would be at slot {cache_len + keep_list[-1]}"
            )
        keys, values = layer.keys, layer.values  # (B, H_kv, S, D)
        if not contiguous:
            src = torch.tensor(keep_list, device=keys.device) + cache_len  # (m,)
            # Advanced indexing copies first, so overlapping source/target slots are safe.
            keys[:, :, cache_len:new_len] = keys.index_select(2, src)
            values[:, :, cache_len:new_len] = values.index_select(2, src)
        layer.keys = keys[:, :, :new_len]
        layer.values = values[:, :, :new_len]
