"""Retrieval drafting (REST, He et al. 2024): look the context's longest suffix up in a token
datastore built from a corpus, and propose the continuations that followed it, merged into a
tree by how often each was seen.

Conventions:
- The datastore is one token sequence ``tokens`` (N,) int32: the corpus's documents, each
  followed by SEP = -1 (a match never spans two documents, a continuation stops at SEP).
- ``order`` (N,) int64 is a suffix array cut at ``key_tokens`` (K, even): the start positions
  sorted by their first K tokens (shorter when a document ends). Every suffix that starts with
  a query of n <= K tokens then sits in ONE contiguous range of ``order``.
- Sorting and searching use packed keys: column j holds tokens (2j, 2j+1) of the suffix as one
  int64, ``(t + 1) << 32 | (u + 1)`` (SEP and the end pad pack to 0, so they sort first). Any
  vocabulary below 2**31 fits.
- Proposals are deterministic (q = delta): a function of the context only. The engine's rules
  accept only tokens the verifier checked, so retrieval is lossless at every temperature, as
  prompt lookup is.

A datastore folder (``scripts/build_datastore.py``) holds ``datastore.safetensors`` (tokens,
order) and ``meta.json`` (kind "datastore", key_tokens, counts, the tokenizer's name and
fingerprint, the data preset). ``decode.datastore=<folder>`` grafts its tree onto any drafter's
tree, or onto prompt lookup's, in the same verifier forward (decode/lookup.py).
"""

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from draftsmith.models.errors import DraftsmithError

SEP = -1
DATASTORE_FILE = "datastore.safetensors"
META_FILE = "meta.json"
MAX_MATCHES = 512  # occurrences read per lookup, evenly spaced over the match range (REST reads up to 5,000)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id): a datastore is only valid for it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def concat_documents(docs: Iterable[Sequence[int]]) -> np.ndarray:
    """Documents of token ids -> tokens (N,) int32, each document followed by SEP."""
    parts = [np.asarray(list(doc) + [SEP], dtype=np.int64) for doc in docs if len(doc)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size and (tokens.max() >= 2**31 - 1 or (tokens[tokens != SEP] < 0).any()):
        raise DraftsmithError("datastore: token ids must lie in [0, 2**31 - 1); check the tokenizer")
    return tokens.astype(np.int32)


def packed_columns(tokens: np.ndarray, key_tokens: int) -> np.ndarray:
    """(K/2, N) int64: column j, position i = tokens i+2j, i+2j+1 packed (see the conventions)."""
    n = tokens.size
    padded = np.concatenate([tokens.astype(np.int64), np.full(key_tokens, SEP, dtype=np.int64)]) + 1  # (N + K,)
    cols = np.empty((key_tokens // 2, n), dtype=np.int64)
    for j in range(key_tokens // 2):
        cols[j] = (padded[2 * j : 2 * j + n] << 32) | padded[2 * j + 1 : 2 * j + 1 + n]
    return cols


class Datastore:
    """tokens (N,) int32 and order (N,) int64 (see the module conventions); searchable."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray | None, key_tokens: int, meta: dict | None = None):
        """order None: sort the suffixes here (building); else the saved suffix array (loading)."""
        if key_tokens < 2 or key_tokens % 2:
            raise DraftsmithError(f"datastore key_tokens={key_tokens}: must be an even number >= 2 (default 8)")
        cols = packed_columns(tokens, key_tokens)  # (K/2, N), packed once for sorting and searching
        if order is None:
            order = np.lexsort(cols[::-1]).astype(np.int64)  # lexsort's LAST key is the primary one
        self.tokens, self.order, self.key_tokens = tokens, order, key_tokens
        self.meta = meta or {}
        self.sorted_cols = cols[:, order]  # (K/2, N), each range sorted

    @classmethod
    def build(cls, docs: Iterable[Sequence[int]], key_tokens: int = 8, meta: dict | None = None) -> "Datastore":
        return cls(concat_documents(docs), None, key_tokens, meta)

    def save(self, out_dir: str | Path) -> Path:
        """Write the folder atomically (models.checkpoint.write_atomic_dir)."""
        from safetensors.numpy import save_file

        from draftsmith.models.checkpoint import write_atomic_dir

        meta = {**self.meta, "kind": "datastore", "key_tokens": self.key_tokens, "num_tokens": int(self.tokens.size),
                "num_documents": int((self.tokens == SEP).sum())}

        def write(tmp: Path):
            save_file({"tokens": self.tokens, "order": self.order}, str(tmp / DATASTORE_FILE))
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

        self.meta = meta
        return write_atomic_dir(out_dir, write)

    def match_range(self, query: Sequence[int]) -> tuple[int, int]:
        """[lo, hi) of ``order`` whose suffixes start with query (1..K tokens)."""
        q = [int(t) + 1 for t in query]
        lo, hi = 0, self.tokens.size
        for j in range(0, len(q), 2):
            col = self.sorted_cols[j // 2, lo:hi]  # sorted within [lo, hi): the earlier columns are equal there
            if j + 1 < len(q):
                first = last = (q[j] << 32) | q[j + 1]
            else:  # the query's last token opens a pair: any second token
                first, last = q[j] << 32, (q[j] << 32) | 0xFFFFFFFF
            lo, hi = lo + int(np.searchsorted(col, first, "left")), lo + int(np.searchsorted(col, last, "right"))
            if lo >= hi:
                return lo, lo
        return lo, hi

    def longest_match(self, ids: Sequence[int], min_ngram: int) -> tuple[int, int, int]:
        """(n, lo, hi) for the longest suffix of ids (n = K..min_ngram) found; n = 0 when none is."""
        for n in range(min(self.key_tokens, len(ids)), min_ngram - 1, -1):
            lo, hi = self.match_range(ids[len(ids) - n :])
            if hi > lo:
                return n, lo, hi
        return 0, 0, 0

    def continuations(self, ids: Sequence[int], depth: int, min_ngram: int = 2,
                      max_matches: int = MAX_MATCHES) -> list[list[int]]:
        """The up-to-depth tokens after each occurrence of the longest matched suffix of ids
        (at most max_matches occurrences, evenly spaced over the range, so frequent
        continuations keep their share); each stops at its document's end."""
        grid = self.continuation_grid(ids, depth, min_ngram, max_matches)
        return [row[row >= 0].tolist() for row in grid]

    def continuation_grid(self, ids: Sequence[int], depth: int, min_ngram: int = 2,
                          max_matches: int = MAX_MATCHES) -> np.ndarray:
        """``continuations`` as a (m, depth) int64 array, -1 after each one's end (none empty)."""
        n, lo, hi = self.longest_match(ids, min_ngram)
        if n == 0:
            return np.zeros((0, depth), dtype=np.int64)
        picks = np.linspace(lo, hi - 1, min(hi - lo, max_matches)).round().astype(np.int64)  # (m,)
        starts = self.order[picks] + n  # (m,) first continuation position
        idx = np.minimum(starts[:, None] + np.arange(depth), self.tokens.size - 1)  # (m, depth)
        window = self.tokens[idx].astype(np.int64)  # (m, depth)
        window[starts[:, None] + np.arange(depth) >= self.tokens.size] = SEP
        alive = np.cumprod(window != SEP, axis=1).astype(bool)  # (m, depth): before the first SEP
        return np.where(alive, window, -1)[alive[:, 0]]


def frequency_tree(conts: Sequence[Sequence[int]] | np.ndarray, budget: int) -> list[list[int]]:
    """Merge continuations into a trie counting how many pass through each node; keep the
    `budget` most frequent nodes (a parent is never rarer than its child, and ties go to the
    shallower node, then to the one met first, so the kept nodes form a tree); return the root
    paths of its leaves, in that order.

    conts: lists of tokens, or a (m, depth) int array of them with -1 after a continuation's end
    (Datastore.continuation_grid). Counted with array operations: the rows sorted once, a prefix of
    length d is a run of rows equal in their first d columns (a lookup reads up to 512 continuations
    of 8 tokens: counting them prefix by prefix in Python took ~1.5 ms of a ~15 ms step)."""
    grid = conts if isinstance(conts, np.ndarray) else _grid(conts)
    m, depth = grid.shape
    if m == 0 or depth == 0 or budget < 1:
        return []
    order = np.lexsort(grid.T[::-1])  # (m,) rows sorted lexicographically (an ended row's -1 sorts first)
    rows = grid[order]  # (m, depth)
    starts_new = np.zeros(m, dtype=bool)  # a run of equal prefixes starts at this sorted row
    starts_new[0] = True
    group_of, cand = [], []  # per depth: each sorted row's run id; candidates (-count, depth, first row met, start)
    for d in range(depth):
        if m > 1:
            starts_new[1:] |= rows[1:, d] != rows[:-1, d]
        group_of.append(np.cumsum(starts_new) - 1)  # (m,)
        starts = np.flatnonzero(starts_new)  # (g,) first sorted row of each run
        counts = np.diff(np.append(starts, m))  # (g,) rows through the node
        first = np.minimum.reduceat(order, starts)  # (g,) the continuation that met it first
        real = rows[starts, d] >= 0  # (g,) a token there, not a continuation's end
        cand.append(np.stack([-counts[real], np.full(real.sum(), d), first[real], starts[real]], axis=1))
    cand = np.concatenate(cand)  # (c, 4)
    kept = cand[np.lexsort((cand[:, 2], cand[:, 1], cand[:, 0]))[:budget]]  # (k, 4) most frequent first
    inner = {(int(d) - 1, int(group_of[int(d) - 1][int(start)])) for _, d, _, start in kept if d > 0}
    return [rows[int(start), : int(d) + 1].tolist() for _, d, _, start in kept
            if (int(d), int(group_of[int(d)][int(start)])) not in inner]


def _grid(conts: Sequence[Sequence[int]]) -> np.ndarray:
    """Lists of tokens -> (m, longest) int64, -1 after each one's end."""
    grid = np.full((len(conts), max(map(len, conts), default=0)), -1, dtype=np.int64)
    for i, cont in enumerate(conts):
        grid[i, : len(cont)] = cont
    return grid


class Retrieval:
    """What a proposer grafts from a datastore each step: the `num_tokens` most frequent nodes
    of the continuations (up to `depth` tokens) of the longest matched suffix (>= min_ngram)."""

    def __init__(self, store: Datastore, num_tokens: int, depth: int, min_ngram: int = 2):
        if num_tokens < 1 or depth < 1 or not 1 <= min_ngram <= store.key_tokens:
            raise DraftsmithError(
                f"decode.datastore_tokens={num_tokens}, decode.datastore_depth={depth}, "
                f"decode.datastore_min_ngram={min_ngram}: need tokens >= 1, depth >= 1 and "
                f"1 <= min_ngram <= {store.key_tokens} (the datastore's key length)")
        self.store, self.num_tokens, self.depth, self.min_ngram = store, num_tokens, depth, min_ngram

    def paths(self, ids: Sequence[int]) -> list[list[int]]:
        return frequency_tree(self.store.continuation_grid(ids, self.depth, self.min_ngram), self.num_tokens)


@functools.lru_cache(maxsize=4)
def _load_store(path: str, stamp: tuple[int, int], key_tokens: int) -> Datastore:
    """A datastore file, searchable, cached per path and (mtime_ns, size): a server or a
    comparison builds its proposers from it without re-reading or re-packing it."""
    from safetensors.numpy import load_file

    arrays = load_file(path)
    return Datastore(arrays["tokens"], arrays["order"], key_tokens)


def load_datastore(path: str | Path, tokenizer=None) -> Datastore:
    """Load a datastore folder (its arrays cached per file version); with a tokenizer, refuse a
    datastore built with another vocabulary."""
    folder = Path(path)
    meta_file, data_file = folder / META_FILE, folder / DATASTORE_FILE
    if not (meta_file.is_file() and data_file.is_file()):
        raise DraftsmithError(f"decode.datastore={path}: no {META_FILE} + {DATASTORE_FILE} there; build one with "
                              f"python scripts/build_datastore.py data=<preset> output_dir={path}")
    try:
        meta = json.loads(meta_file.read_text())
        kind = meta.get("kind")
    except (json.JSONDecodeError, AttributeError):
        meta, kind = {}, None
    if kind != "datastore":
        raise DraftsmithError(f"decode.datastore={path}: {META_FILE} is not a datastore's (kind {kind!r}); "
                              f"rebuild it with python scripts/build_datastore.py")
    if tokenizer is not None and meta.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        raise DraftsmithError(f"decode.datastore={path} was built with tokenizer {meta.get('tokenizer')!r}, "
                              f"not the verifier's: rebuild it with python scripts/build_datastore.py model=<your verifier>")
    stat = data_file.stat()
    store = _load_store(str(data_file.resolve()), (stat.st_mtime_ns, stat.st_size), int(meta["key_tokens"]))
    store.meta = meta
    return store


def retrieval_for(decode_cfg, tokenizer=None) -> Retrieval | None:
    """The Retrieval a decode preset asks for (decode.datastore set), else None."""
    path = decode_cfg.get("datastore")
    if not path:
        return None
    return Retrieval(load_datastore(path, tokenizer), num_tokens=int(decode_cfg.get("datastore_tokens", 8)),
                     depth=int(decode_cfg.get("datastore_depth", 8)),
                     min_ngram=int(decode_cfg.get("datastore_min_ngram", 2)))
