"""Token trees for one verification pass: structure, attention mask, position ids.

A tree has n nodes in topological order. Node 0 is the ROOT: the last emitted token, not yet
in the KV cache. Nodes 1..n-1 are drafted tokens. ``parents[i]`` is the parent of node i
(``parents[0] == -1``) and every parent has a smaller index than its children; siblings are
ordered by index. A chain (plain draft-model speculation) is the tree ``chain_parents(k)``.

The verifier sees the tree in ONE forward of the HF model's own code:

    mask, position_ids, _ = verify_inputs(parents, cache_len, dtype, device)
    out = model(input_ids=tokens[None], attention_mask=mask, position_ids=position_ids,
                cache=dynamic_cache, use_cache=True)

Row i of the logits is then the verifier's next-token logits after the path root..i: node i
attends to the cached prefix, to itself and to its ancestors only, and sits at position
``cache_len + depth(i)``. (transformers 5.x returns a 4D mask unchanged and adds it to the
attention scores; ``cache_position`` is no longer a model argument there, the cache appends
at its own length.)

Static trees (Medusa's top-k "choices") are built once with ``TreeBuffers.from_paths`` and
reused every step; only the mask's cache columns change with the cache length.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.models.errors import DraftsmithError


def paths_to_parents(
    paths: Sequence[Sequence[int]],
) -> tuple[list[int], list[int], list[int]]:
    """Medusa's static tree ("medusa_choices") -> (parents, choices, depths), root included.

    Each path is a tuple of top-k choice indices: ``(i,)`` is the depth-1 node holding head 1's
    i-th candidate, ``(i, j)`` its child holding head 2's j-th candidate, and so on. Nodes keep
    the order the paths are listed in, except that a path listed before one of its prefixes
    comes just after it (parents before children); node 0 is the root (parent -1, choice -1,
    depth 0). The order is what a cut keeps: the load-aware budget verifies a tree's first w
    nodes (decode.engine.truncate), so list paths best-first, as Medusa's mc_sim lists are
    (each entry is the next node by simulated acceptance gain). Medusa sorts its nodes by
    (depth, path), which no cut of a wide tree survives: its first w nodes are all depth 1.

    Raises a one-line DraftsmithError naming the bad path when a path is empty, has a negative index, is
    duplicated, or has a proper prefix that is not itself a path.
    """
    norm = [tuple(int(c) for c in p) for p in paths]
    seen: set[tuple[int, ...]] = set()
    for p in norm:
        if len(p) == 0:
            raise DraftsmithError("tree path () is empty: the root is implicit, list only drafted nodes")
        if any(c < 0 for c in p):
            raise DraftsmithError(f"tree path {p} has a negative choice index")
        if p in seen:
            raise DraftsmithError(f"tree path {p} is listed twice")
        seen.add(p)
    for p in norm:
        for d in range(1, len(p)):
            if p[:d] not in seen:
                raise DraftsmithError(f"tree path {p} has no parent: its prefix {p[:d]} is not a path")

    listed = {p: i for i, p in enumerate(norm)}
    after = {p: max(listed[p[:d]] for d in range(1, len(p) + 1)) for p in norm}  # its last-listed prefix
    ordered = sorted(norm, key=lambda p: (after[p], len(p)))  # a prefix: after <= the path's, shorter
    index = {p: i + 1 for i, p in enumerate(ordered)}  # path -> node index (root is 0)
    parents = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in ordered]
    choices = [-1] + [p[-1] for p in ordered]
    depths = [0] + [len(p) for p in ordered]
    return parents, choices, depths


def chain_parents(k: int) -> list[int]:
    """Parents of a chain root -> 1 -> ... -> k (k drafted tokens, k + 1 nodes)."""
    if k < 0:
        raise ValueError(f"chain length must be >= 0, got {k}")
    return [-1] + list(range(k))


def _as_parents(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Validate a parents vector (root first, topological order) and return it as a LongTensor."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    if parents.ndim != 1 or parents.numel() == 0:
        raise ValueError(f"parents must be a non-empty 1-D vector, got {tuple(parents.shape)}")
    if int(parents[0]) != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {int(parents[0])}")
    idx = torch.arange(parents.numel(), device=parents.device)
    bad = (parents[1:] < 0) | (parents[1:] >= idx[1:])
    if bool(bad.any()):
        i = int(bad.nonzero()[0]) + 1
        raise ValueError(
            f"parents[{i}] = {int(parents[i])}: every non-root node needs a parent with a "
            "smaller index (topological order)"
        )
    return parents


def ancestor_mask(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """(n, n) bool: ``[i, j]`` is True iff node j is node i or an ancestor of node i.

    Row i is the tree part of node i's attention: it may attend to exactly these nodes.
    """
    parents = _as_parents(parents)
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)  # (n, n), built on the CPU: one small op per node, no GPU launches
    for i, p in enumerate(parents.tolist()[1:], start=1):
        mask[i] |= mask[p]  # parents come first, so row p is already complete
    return mask.to(parents.device)


def path_to(parents: torch.Tensor | Sequence[int], node: int) -> list[int]:
    """Node indices from the root (0) to ``node`` inclusive."""
    parents = _as_parents(parents).tolist()
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} is not in a tree of {len(parents)} nodes")
    path = [node]
    while parents[path[-1]] != -1:
        path.append(parents[path[-1]])
    return path[::-1]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (..., q, kv) -> float (..., q, kv) in ``dtype``: 0 where a query may attend to a key,
    ``torch.finfo(dtype).min`` elsewhere (the 4D mask HF attention adds to its scores). The one
    builder of every tree, level and unrolled-step mask (verifier, draft model, EAGLE drafter)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _mask_from_ancestors(
    anc: torch.Tensor, cache_len: int, dtype: torch.dtype, kv_length: int | None
) -> torch.Tensor:
    """(1, 1, n, kv_length) additive float mask: 0 where allowed, finfo(dtype).min elsewhere.

    Columns [0, cache_len) are the cached prefix (all allowed), [cache_len, cache_len + n) the
    tree (ancestors and self allowed), the rest (a static cache's unused slots) masked.
    """
    n = anc.shape[0]
    kv_length = cache_len + n if kv_length is None else kv_length
    if kv_length < cache_len + n:
        raise ValueError(f"kv_length {kv_length} < cache_len + n = {cache_len + n}")
    allowed = torch.zeros(n, kv_length, dtype=torch.bool, device=anc.device)  # (n, kv)
    allowed[:, :cache_len] = True
    allowed[:, cache_len : cache_len + n] = anc
    return additive_mask(allowed, dtype)[None, None]  # (1, 1, n, kv)


def _positions(
    depths: torch.Tensor, cache_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids (1, n) = cache_len + depth and cache_position (n,) = cache slots."""
    n = depths.numel()
    position_ids = (cache_len + depths)[None]  # (1, n)
    cache_position = torch.arange(cache_len, cache_len + n, device=depths.device)  # (n,)
    return position_ids, cache_position


def verify_inputs(
    parents: torch.Tensor | Sequence[int],
    cache_len: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    kv_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs for verifying a tree in one forward on top of ``cache_len`` cached tokens.

    Returns:
      attention_mask (1, 1, n, kv_length) in ``dtype``: 0 where node i may attend (every
        cached column, itself, its ancestors), ``torch.finfo(dtype).min`` elsewhere.
        kv_length defaults to cache_len + n (the DynamicCache the engine uses); a larger
        value masks the columns after the tree.
      position_ids (1, n) long: cache_len + depth(i).
      cache_position (n,) long: arange(cache_len, cache_len + n), the cache slots the tree
        is written to (transformers 5.x models no longer take it; kept for callers that do).
    """
    parents = _as_parents(parents)
    device = parents.device if device is None else torch.device(device)
    anc = ancestor_mask(parents).to(device)  # (n, n)
    mask = _mask_from_ancestors(anc, cache_len, dtype, kv_length)
    position_ids, cache_position = _positions(anc.sum(dim=-1) - 1, cache_len)
    return mask, position_ids, cache_position


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Precomputed tensors of a static tree, built once and reused at every decoding step.

    parents (n,), depths (n,), choices (n,) (top-k rank of each node's token among its
    depth's candidates, -1 for the root), ancestors (n, n) bool.
    """

    parents: torch.Tensor  # (n,) long
    depths: torch.Tensor  # (n,) long
    choices: torch.Tensor  # (n,) long
    ancestors: torch.Tensor  # (n, n) bool

    @classmethod
    def from_parents(
        cls, parents: Sequence[int], choices: Sequence[int] | None = None
    ) -> "TreeBuffers":
        """Any tree from its parents vector; choices default to -1 (unknown) for every node."""
        parents_t = _as_parents(list(parents)).cpu()
        anc = ancestor_mask(parents_t)
        choices = [-1] * parents_t.numel() if choices is None else list(choices)
        if len(choices) != parents_t.numel():
            raise ValueError(f"{len(choices)} choices for {parents_t.numel()} nodes")
        return cls(
            parents=parents_t,
            depths=anc.sum(dim=-1) - 1,
            choices=torch.tensor(choices, dtype=torch.long),
            ancestors=anc,
        )

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeBuffers":
        """Medusa-style static tree from top-k choice paths (see ``paths_to_parents``)."""
        parents, choices, _ = paths_to_parents(paths)
        return cls.from_parents(parents, choices)

    @property
    def size(self) -> int:
        """Number of nodes n, root included."""
        return self.parents.numel()

    def to(self, device: torch.device | str) -> "TreeBuffers":
        """A copy with every tensor on ``device``."""
        return TreeBuffers(
            parents=self.parents.to(device),
            depths=self.depths.to(device),
            choices=self.choices.to(device),
            ancestors=self.ancestors.to(device),
        )

    def verify_inputs(
        self, cache_len: int, dtype: torch.dtype, kv_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Same as the module-level ``verify_inputs`` but from the precomputed ancestors."""
        mask = _mask_from_ancestors(self.ancestors, cache_len, dtype, kv_length)
        position_ids, cache_position = _positions(self.depths, cache_len)
        return mask, position_ids, cache_position
