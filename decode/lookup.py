"""Draft-free proposers: prompt lookup (n-gram match) and lookahead decoding (Jacobi + n-gram pool).

Both propose DETERMINISTIC candidates (q = delta): token paths hanging off the root, merged
into a trie (``build_trie``) so that siblings carry distinct tokens and every node is one
distinct context. The verifier scores the whole trie in one forward and the engine's rule
(greedy, or recursive rejection sampling with deterministic children) accepts only tokens it
has checked against the verifier, so both are lossless at any temperature.

Prompt lookup (Saxena 2023; HF ``prompt_lookup_num_tokens``): find the last n tokens
(max_ngram down to min_ngram) earlier in prompt + output, propose the num_tokens that followed
the match. The most recent match first; ``num_matches > 1`` merges several continuations.

Lookahead decoding (Fu et al. 2024): a Jacobi window of N-1 levels x W columns and a pool of
n-grams keyed by their first token. Cell (l, i) of the window sits at depth i + 1 + l and sees
the root, level-0 cells 0..i and the cells of column i above it, i.e. it is the trie node of
the path ``level0[:i+1] + column_i[1:l+1]``: the lookahead branch IS a set of root paths,
verified with the same rule as the verification branch (up to G pooled n-grams starting with
the root), all in the SAME verifier forward. After the forward, the verifier's argmax at each
top-level cell (its lm_head over the engine's ``hidden``; the proposer is given the lm_head)
is the next Jacobi level; each column then yields an n-gram
(level0[i], ..., level_{N-2}[i], new[i]) for the pool and the oldest level is dropped.
"""

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from draftsmith.decode.datastore import Retrieval
from draftsmith.decode.proposers import DraftTree, Proposer
from draftsmith.decode.sampling import SamplingParams, argmax_ids
from draftsmith.models.errors import DraftsmithError


def build_trie(
    root: int, paths: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[list[int]]]:
    """Merge token paths that hang off ``root`` into one tree (a trie).

    Returns (tokens, parents, nodes): tokens (n,) and parents (n,) of the trie with node 0 the
    root and nodes in topological order (a node is created after its parent); nodes[k][j] is
    the trie node holding paths[k][j]. Two paths share a node exactly when they share the
    prefix up to it, so siblings carry distinct tokens and equal contexts are verified once.
    """
    return graft([int(root)], [-1], paths)


def graft(
    tokens: Sequence[int], parents: Sequence[int], paths: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[list[int]]]:
    """``build_trie`` onto an existing tree: tokens (n,) / parents (n,) in topological order,
    siblings distinct (every proposer's tree). A path follows the existing nodes while its
    tokens match and continues with new nodes appended after them, so the first n nodes keep
    their indices and the result is again topological with distinct siblings."""
    tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
    children: list[dict[int, int]] = [{} for _ in tokens]
    for v in range(1, len(tokens)):
        children[parents[v]][tokens[v]] = v
    nodes: list[list[int]] = []
    for path in paths:
        u, here = 0, []
        for t in path:
            t = int(t)
            v = children[u].get(t)
            if v is None:
                v = len(tokens)
                tokens.append(t)
                parents.append(u)
                children.append({})
                children[u][t] = v
            u = v
            here.append(v)
        nodes.append(here)
    return tokens, parents, nodes


def lead_with(tokens: Sequence[int], parents: Sequence[int], first: Sequence[Sequence[int]]
              ) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, order): the same tree with the nodes of the paths ``first`` (lists of node
    indices, root-down, as ``graft`` returns them) moved to the front, in the order given, and every
    other node after them in its old order: still topological (a path lists a node after its
    parent); order[i] is the old index of new node i. A budget that verifies a tree's first w nodes
    (decode.engine.truncate) then keeps these paths before the rest."""
    order = list(dict.fromkeys([0, *(v for path in first for v in path), *range(len(tokens))]))
    where = {old: new for new, old in enumerate(order)}
    return [int(tokens[v]) for v in order], [-1] + [where[int(parents[v])] for v in order[1:]], order


def ngram_continuations(
    ids: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int, num_matches: int = 1
) -> list[list[int]]:
    """Continuations of earlier occurrences of the last n tokens of ids (L,), n = max..min.

    Longer n-grams first; for each n the most recent occurrence first (an occurrence must be
    followed by at least one token, so the trailing n-gram never matches itself). Each
    continuation is the up to ``num_tokens`` tokens after the occurrence; duplicates are
    skipped; at most ``num_matches`` are returned.
    """
    length = ids.numel()
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # (L - n, n): window i = ids[i:i+n], i + n < L
        hits = (windows == ids[length - n :]).all(dim=1).nonzero().flatten()  # (h,) start indices
        for i in reversed(hits.tolist()):
            cont = ids[i + n : i + n + num_tokens].tolist()
            if tuple(cont) in seen:
                continue
            seen.add(tuple(cont))
            out.append(cont)
            if len(out) == num_matches:
                return out
    return out


def _deterministic_tree(tokens: list[int], parents: list[int], device) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
    )


class PromptLookupProposer(Proposer):
    """N-gram match of the last tokens in prompt + output; the continuation is the draft.

    num_tokens: tokens proposed per continuation; max_ngram / min_ngram: n-gram sizes tried,
    longest first; num_matches: continuations merged into a trie (1 = a chain). retrieval
    (decode/datastore.py, decode.datastore=<folder>): also the most frequent continuations of
    the context's longest suffix in a corpus datastore (REST), merged into the same trie.
    """

    name = "prompt_lookup"

    def __init__(
        self,
        num_tokens: int = 10,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_matches: int = 1,
        device: torch.device | str = "cpu",
        retrieval: Retrieval | None = None,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(
                f"decode.min_ngram={min_ngram}, decode.max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram"
            )
        if num_tokens < 1 or num_matches < 1:
            raise DraftsmithError(
                f"decode.num_tokens={num_tokens}, decode.num_matches={num_matches}: both must be >= 1"
            )
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.num_matches = num_matches
        self.device = torch.device(device)
        self.retrieval = retrieval
        if retrieval is not None:
            self.name = "prompt_lookup+datastore"

    @property
    def max_depth(self) -> int:
        return max(self.num_tokens, self.retrieval.depth if self.retrieval else 0)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        conts = ngram_continuations(
            torch.tensor(ids, dtype=torch.long), self.max_ngram, self.min_ngram, self.num_tokens, self.num_matches
        )
        if self.retrieval is not None:
            conts += self.retrieval.paths(ids)
        tokens, parents, _ = build_trie(root, conts)
        return _deterministic_tree(tokens, parents, self.device)


class PromptLookupGraft(Proposer):
    """A drafter's tree with prompt lookup's continuation grafted on, verified in ONE forward.

    The drafter (``inner``) proposes its tree; the last max_ngram..min_ngram tokens are looked
    up in prompt + output and the up to num_tokens tokens after the most recent match are
    grafted onto that tree (``graft``): while the drafter proposed the same tokens the
    continuation shares its nodes, from the first disagreement on it hangs new ones. A trained
    drafter predicts the next few tokens; a match copies a long span of the context (code,
    quoted text, names), at depths the drafter's tree does not reach and with no drafter
    forward. decode.lookup_tokens > 0 on an EAGLE, Medusa or draft-model preset builds this;
    decode.datastore=<folder> grafts a corpus datastore's most frequent continuations of the
    context's longest suffix as well (``retrieval``, decode/datastore.py: REST), with or without
    prompt lookup's.

    Lossless at any temperature when the drafter's tree is deterministic (EAGLE, Medusa; a
    draft model when greedy): every node's children are then distinct deterministic tokens,
    which greedy verification and recursive rejection sampling with q = delta accept exactly. A
    draft model samples its drafts at temperature > 0 (q != delta beside a grafted q = delta
    child would need a mixed rule): such a call decodes with the draft's tree alone, so a
    server grafts its greedy requests and samples the others (decode/evaluate.py refuses the
    combination outright). The drafter's state follows the accepted path whatever its nodes'
    origin (EAGLE takes the verifier's features of the accepted nodes, a draft model re-feeds
    the accepted tokens it did not draft).

    The grafted tree leads with the continuations (``lead_with``), the drafter's other nodes after
    them: a step the load-aware budget cuts to its first w nodes keeps the continuations. On the
    AVX2 box (MT-bench x 8, fp32, Medusa-1 heads with both grafts, engine.budget=adaptive) a step
    accepted 1.33 tokens on average instead of 1.19 with the drafter's nodes first. The drafter is
    told the step in graft's own order (its nodes numbered as it proposed them).
    """

    def __init__(self, inner: Proposer, num_tokens: int, max_ngram: int = 3, min_ngram: int = 1,
                 retrieval: Retrieval | None = None):
        if num_tokens < 0 or (num_tokens == 0 and retrieval is None) or not 1 <= min_ngram <= max_ngram:
            raise DraftsmithError(
                f"decode.lookup_tokens={num_tokens}, decode.lookup_max_ngram={max_ngram}, "
                f"decode.lookup_min_ngram={min_ngram}: need lookup_tokens >= 1 (0 turns the graft off) and 1 <= min <= max"
            )
        self.inner = inner
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.retrieval = retrieval  # decode.datastore: a corpus datastore's continuations too (decode/datastore.py)
        sources = (["prompt_lookup"] if num_tokens else []) + (["datastore"] if retrieval is not None else [])
        self.name = "+".join([inner.name, *sources])
        self.feature_layers = list(getattr(inner, "feature_layers", None) or ())  # EAGLE-3's, for the engine
        self.active = True  # False while the drafter samples its drafts (set per call in prefill)
        self.grafted_as = None  # (the tree in graft's order, lead_with's order) of the last graft

    @property
    def max_depth(self) -> int:
        return max(self.inner.max_depth, self.num_tokens, self.retrieval.depth if self.retrieval else 0)

    def grafts_nothing(self, sampling: SamplingParams) -> bool:
        """True when the drafter samples its drafts under `sampling` (a draft model at T > 0):
        then every call decodes with the drafter's tree alone."""
        return self.samples_drafts(sampling)

    def samples_drafts(self, sampling: SamplingParams) -> bool:
        return self.inner.samples_drafts(sampling)

    def seed_draws(self, seed: int) -> None:
        self.inner.seed_draws(seed)

    def fork(self) -> "PromptLookupGraft":
        twin = super().fork()
        twin.inner = self.inner.fork()
        return twin

    def prefill(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, sampling: SamplingParams, **extra) -> None:
        self.active = not self.grafts_nothing(sampling)
        self.inner.prefill(prompt_ids, hidden, sampling, **extra)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        return self.grafted(self.inner.propose(root, hidden, ids), ids)

    def batch_key(self):
        key = self.inner.batch_key()
        return None if key is None else ("graft", key)

    @staticmethod
    def propose_batch(proposers, roots, hiddens, ids) -> list[DraftTree]:
        inner = [p.inner for p in proposers]
        trees = type(inner[0]).propose_batch(inner, roots, hiddens, ids)
        return [p.grafted(tree, i) for p, tree, i in zip(proposers, trees, ids)]

    def grafted(self, tree: DraftTree, ids: list[int]) -> DraftTree:
        """The drafter's tree with the prompt-lookup / datastore continuations grafted on."""
        self.grafted_as = None
        if not self.active:
            return tree
        if tree.draft_probs is not None:
            raise DraftsmithError(f"decode.lookup_tokens: the {self.inner.name} proposer sampled this tree and prompt "
                                  f"lookup grafts onto deterministic trees only; set decode.lookup_tokens=0")
        conts = ngram_continuations(
            torch.tensor(ids, dtype=torch.long), self.max_ngram, self.min_ngram, self.num_tokens
        ) if self.num_tokens else []
        if self.retrieval is not None:
            conts += self.retrieval.paths(ids)
        if not conts:
            return tree
        tokens, parents, nodes = graft(tree.tokens.tolist(), tree.parents.tolist(), conts)
        if len(tokens) == tree.size:  # the drafter had proposed the whole continuation already
            return tree
        # the continuations first: a step the budget cuts (decode.engine.truncate keeps a tree's
        # first nodes) keeps them before the drafter's wider nodes, which a cut step rarely accepts
        led_tokens, led_parents, order = lead_with(tokens, parents, nodes)
        self.grafted_as = (_deterministic_tree(tokens, parents, tree.tokens.device), order)
        return _deterministic_tree(led_tokens, led_parents, tree.tokens.device)

    def _inner_order(self, tree: DraftTree, path: list[int], hidden: torch.Tensor, extra: dict):
        """The verified step in the order ``graft`` made (the drafter's own nodes first, as it numbered
        them: a draft model tells its nodes by index): the grafted tree, the path's nodes and every
        per-node tensor (hidden (n, H), EAGLE's layer_hidden) mapped back; nodes a cut step left out
        get zero rows, which no accepted path reads."""
        if self.grafted_as is None:
            return tree, path, hidden, extra
        unled, order = self.grafted_as
        index = torch.as_tensor(order[:tree.size], device=hidden.device)

        def back(x):
            if not isinstance(x, torch.Tensor) or x.shape[:1] != hidden.shape[:1]:
                return x
            out = x.new_zeros((unled.size, *x.shape[1:]))
            out[index] = x
            return out

        return unled, [order[v] for v in path], back(hidden), {k: back(v) for k, v in extra.items()}

    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor, **extra) -> None:
        tree, path, hidden, extra = self._inner_order(tree, path, hidden, extra)
        self.inner.accept(tree, path, next_token, hidden, **extra)

    def skip(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor, **extra) -> None:
        self.inner.skip(tree, path, next_token, hidden, **extra)


class LookaheadProposer(Proposer):
    """Lookahead decoding: Jacobi window (W columns, N-1 levels), n-gram pool, guess set G.

    lm_head: the verifier's output embedding (its logits at the window's cells drive the Jacobi
    update). window: W; ngram: N (>= 2); guess_set: G, n-grams verified per step and kept per
    key in the pool (least recently produced dropped first); pool_from_prompt: also seed the
    pool with the prompt's n-grams; seed: the window's first level is drawn from the prompt.
    """

    name = "lookahead"

    cuttable = False  # accept reads the Jacobi cells of the whole tree

    def __init__(
        self,
        lm_head: nn.Module,
        window: int = 5,
        ngram: int = 4,
        guess_set: int = 5,
        pool_from_prompt: bool = False,
        seed: int = 0,
        device: torch.device | str | None = None,
    ):
        if window < 1 or ngram < 2 or guess_set < 0:
            raise DraftsmithError(
                f"decode.window={window}, decode.ngram={ngram}, decode.guess_set={guess_set}: "
                "need window >= 1, ngram >= 2, guess_set >= 0"
            )
        self.lm_head = lm_head
        self.window, self.ngram, self.guess_set = window, ngram, guess_set
        self.pool_from_prompt = pool_from_prompt
        self.seed = seed
        self.device = torch.device(device) if device is not None else lm_head.weight.device
        self.levels: list[list[int]] = []  # Jacobi trajectory, oldest level first, each W tokens
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.top_cells: list[int] = []  # trie node of each column's newest cell in the last tree

    @property
    def max_depth(self) -> int:
        return max(self.window + self.ngram - 2, self.ngram - 1)

    def prefill(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, sampling: SamplingParams) -> None:
        prompt = prompt_ids.cpu()
        g = torch.Generator().manual_seed(self.seed)
        pick = torch.randint(0, prompt.numel(), (self.window,), generator=g)  # (W,)
        self.levels = [prompt[pick].tolist()]
        self.pool = {}
        if self.pool_from_prompt and prompt.numel() >= self.ngram:
            for gram in prompt.unfold(0, self.ngram, 1).tolist():  # (T - N + 1, N)
                self.add_ngram(gram)

    def add_ngram(self, gram: Sequence[int]) -> None:
        """Pool the n-gram under its first token (most recent last, at most G per key)."""
        if self.guess_set == 0:
            return
        entries = self.pool.setdefault(int(gram[0]), OrderedDict())
        key = tuple(int(t) for t in gram[1:])
        entries[key] = None
        entries.move_to_end(key)
        while len(entries) > self.guess_set:
            entries.popitem(last=False)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        guesses = list(reversed(self.pool.get(root, {})))[: self.guess_set]  # most recent first
        level0 = self.levels[0]
        columns = [
            level0[: i + 1] + [level[i] for level in self.levels[1:]] for i in range(self.window)
        ]  # column i: the root path of its newest cell
        tokens, parents, nodes = build_trie(root, [*guesses, *columns])
        self.top_cells = [path[-1] for path in nodes[len(guesses) :]]  # (W,)
        return _deterministic_tree(tokens, parents, self.device)

    @torch.inference_mode()
    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor) -> None:
        cells = torch.tensor(self.top_cells, dtype=torch.long, device=hidden.device)  # (W,)
        new = argmax_ids(self.lm_head(hidden[cells])).tolist()  # (W,) one Jacobi step per column
        if len(self.levels) == self.ngram - 1:  # full window: harvest one n-gram per column
            for i in range(self.window):
                self.add_ngram([level[i] for level in self.levels] + [new[i]])
            self.levels = self.levels[1:]
        self.levels.append(new)
