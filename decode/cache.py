"""KV-cache compaction after a tree verification, on transformers' own Cache objects.

A verification forward appends all n tree nodes to the cache, at slots
[cache_len, cache_len + n). Only the accepted path (root first) may stay: its entries move to
[cache_len, cache_len + len(path)) and everything after is dropped, so the cache is exactly
what a plain left-to-right forward over prompt + accepted tokens would have produced (the
keys were computed at position cache_len + depth, which is the accepted token's real position).

transformers 5.x keeps one layer object per model layer in ``cache.layers``; a layer's
``keys``/``values`` are (B, H_kv, S, D). ``DynamicLayer.update`` concatenates: every forward
copies the whole cache of every layer. ``BufferedLayer`` (``new_cache``, what the engine and
the batched generators use) keeps the same tensors in a buffer grown SLACK slots at a time, writes new
tokens in place and hands attention views of the filled part: a step's cache write costs its
new tokens, not the cache length. Compaction writes the kept nodes into place and shortens the layer with
``crop`` (transformers 5.x's ``crop`` takes a NEGATIVE count of tokens to remove).

Only full-attention layers are supported. Sliding-window layers keep a rolling window and a
``cumulative_length`` that no longer maps to slots once the window is full; quantized layers
hold a residual buffer plus quantized blocks; linear-attention/SSM layers have a recurrent
state that cannot drop tree nodes at all. Those raise instead of silently corrupting the cache.
"""

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DummyLayer, DynamicCache, DynamicLayer

from draftsmith.models.attention import BUFFER_ATTR


SLACK = 128  # free slots a BufferedLayer keeps past its tokens: it grows (one copy) every SLACK tokens


class BufferedLayer(DynamicLayer):
    """A full-attention cache layer over a preallocated (B, H_kv, capacity, D) buffer.

    ``update`` writes the new keys/values at the end of the filled part (growing the buffer by
    SLACK slots when full) and returns views ``[:, :, :length]``: no per-step copy of the cache.
    The buffer is zero-initialised and each view carries it as ``cache_buffer``, so attention
    may run over all of it with the slots past ``length`` masked (models/attention.py ``grouped``).
    ``crop(-n)`` drops the last n tokens, ``batch_select_indices`` keeps some rows and ``set``
    replaces the content (a continuous batch rebuilt by rows). Otherwise it is a DynamicLayer.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._keys = key_states.new_zeros((*key_states.shape[:2], SLACK, key_states.shape[-1]))  # (B, H, cap, D)
        self._values = value_states.new_zeros((*value_states.shape[:2], SLACK, value_states.shape[-1]))
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._keys[:, :, : self.length]  # (B, H, length, D)
        self.values = self._values[:, :, : self.length]
        setattr(self.keys, BUFFER_ATTR, self._keys)  # attention may run over the whole buffer
        setattr(self.values, BUFFER_ATTR, self._values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._keys.shape[-2]:  # grow: one copy per SLACK tokens
            capacity = end + SLACK
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the whole content by keys / values (B, H, L, D) (a batch rebuilt by rows)."""
        length, capacity = keys.shape[-2], keys.shape[-2] + SLACK
        self._keys = keys.new_zeros((*keys.shape[:2], capacity, keys.shape[-1]))
        self._values = values.new_zeros((*values.shape[:2], capacity, values.shape[-1]))
        self._keys[:, :, :length], self._values[:, :, :length] = keys, values
        self.length, self.is_initialized = length, True
        self._views()

    def adopt(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor, length: int) -> None:
        """Take over zero-padded buffers (B, H, capacity, D) whose first `length` slots are filled."""
        self._keys, self._values = keys_buffer, values_buffer
        self.length, self.is_initialized = length, True
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._views()

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None


def new_cache(config) -> Cache:
    """The cache the engine and the batched generators decode on: one BufferedLayer per layer
    when every layer is full attention; otherwise transformers' own DynamicCache for that
    config (which ``check_compactable`` then refuses, naming the setting)."""
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        return Cache(layers=[BufferedLayer() for _ in cache.layers])
    return cache


# Exact layer classes whose per-token keys/values can be compacted by index (subclasses such as
# DynamicSlidingWindowLayer or QuantizedLayer inherit from DynamicLayer but store tokens differently).
_DYNAMIC = (DynamicLayer, BufferedLayer)


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
        layer.crop(new_len - total)  # drop the rest (a no-op when nothing is left over)
