"""EAGLE proposer: autoregressive drafting over features with the drafter's own KV cache.

The drafter (models/eagle.py) has one decoder layer and its own KV cache (decode.cache.new_cache).
Drafter cache slot j holds the input pair (x_{j+1}, f_j): the token at position j+1 and the verifier's
feature at position j (EAGLE-1: the final hidden state; EAGLE-3: the fused low/mid/high layer
states). Only pairs whose feature came from the verifier are kept between steps ("committed");
drafted nodes live in a per-step copy of the cache and are dropped with it.

One step (``propose_batch``; ``propose`` is one row of it). The rows of a batch that draft with
the same drafter and tree (``batch_key``; a server's rows are forks of one proposer) draft
TOGETHER: their caches are stacked side by side, padded (``DrafterStack``), and every stage
below is ONE drafter forward and one lm_head call for all of them:
  1. the pending pairs (every accepted node of the last verification with the token after it;
     at the first step the whole prompt: a backlog longer than CATCH_UP goes first, alone) go
     through the drafter in one causal forward on the cache, and stay in the row's own cache;
     the last output predicts the feature after the root, whose logits give depth 1;
  2. the tree is grown depth by depth, each depth ONE drafter forward over the nodes expanded
     there (their parents' predicted features as input, a tree mask over the cache):
     - static trees (Medusa-style path lists; a chain is one): node (i0, .., id) takes the
       id-th top candidate of its parent's draft distribution;
     - dynamic trees (EAGLE-2): every node scores its cumulative draft log-probability; at each
       depth the top_k best nodes are expanded, each into its top_k children, up to `depth`;
       then all drafted nodes are reranked and the best `total_tokens - 1` kept (a child never
       outranks its parent, so the kept set is a valid tree).
Each row's tree is built by its own generator (``_static_tree`` / ``_dynamic_tree``), which
asks for top-k lists and node forwards; ``_drive`` serves a stage's asks of every row at once.
A query sees only its own row's slots at its own positions, so a row drafts what it would
alone (the same tokens, up to the rounding of a wider matmul).

Children are deterministic functions of the context (top-k; q = delta), at every temperature,
so the engine's rules accept losslessly: greedy at T=0, recursive rejection sampling with
``draft_probs=None`` at T>0 (decode/sampling.py). The features of the next step come from the
verification forward itself: ``accept`` receives the verifier's hidden states of every tree
node (and, for EAGLE-3, the fusion layers' states via ``layer_hidden``; the engine asks the
verifier for them because this proposer has ``feature_layers``).

``quant="int8"`` drafts with an int8 copy of the drafter (decode/quant.py: every linear layer of
the drafter, its own lm_head included, as int8 rows and scales; the verifier's embedding and
lm_head, when the drafter borrows them, are never touched). Still top-k children of the int8
drafter's own distribution, so the same rules stay exact.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.cache_utils import Cache

from draftsmith.decode.cache import BufferedLayer, new_cache
from draftsmith.decode.proposers import CATCH_UP, DraftTree, Proposer, _is_chain, drive_together
from draftsmith.decode.quant import drafting_copy
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.tree import TreeBuffers, additive_mask
from draftsmith.models.errors import DraftsmithError


class EagleProposer(Proposer):
    """EAGLE-1/3 drafting over a static tree (``paths``) or an EAGLE-2 dynamic tree.

    drafter: an EagleDrafter in the verifier's dtype and device; embed_tokens / lm_head: the
    verifier's (shared, frozen). Give either ``paths`` (Medusa format, e.g. a chain
    [[0], [0, 0], ...]) or ``depth``, ``top_k`` and ``total_tokens`` (EAGLE-2: expand the top_k
    nodes per depth, up to depth `depth`, keep `total_tokens` nodes including the root).
    ``quant``: "none" or "int8" (an int8 copy of the drafter drafts; the one given is not changed);
    ``weights``: "plain", "packed" or "auto" (a copy on oneDNN-prepacked weights drafts: packed, or
    auto where the verifier's fast forward packs this dtype; decode.quant.drafting_copy).
    """

    name = "eagle"

    def __init__(self, drafter: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module | None,
                 paths: Sequence[Sequence[int]] | None = None, depth: int | None = None,
                 top_k: int | None = None, total_tokens: int | None = None, quant: str = "none",
                 weights: str = "plain"):
        self.drafter = drafting_copy(drafter.eval(), quant, weights)  # refuses unknown values in one line
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        cfg = drafter.config
        if cfg.lm_head != "own" and lm_head is None:
            raise DraftsmithError(f"this EAGLE drafter (lm_head={cfg.lm_head}) needs lm_head=verifier.lm_head")
        # The verifier layers whose states the engine must hand to prefill/accept (EAGLE-3).
        self.feature_layers = list(cfg.fusion_layers) if cfg.variant == "eagle3" else []
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.dynamic = paths is None
        if self.dynamic:
            if depth is None or top_k is None or total_tokens is None:
                raise DraftsmithError("a dynamic EAGLE tree needs depth, top_k and total_tokens (or pass paths)")
            if depth < 1 or top_k < 1 or total_tokens < 1:
                raise DraftsmithError(f"depth, top_k and total_tokens must be >= 1, got {depth}, {top_k}, {total_tokens}")
            if top_k > cfg.num_draft_tokens:
                raise DraftsmithError(f"top_k={top_k} exceeds the {cfg.num_draft_tokens}-token draft vocabulary")
            self.depth, self.top_k, self.total_tokens = int(depth), int(top_k), int(total_tokens)
        else:
            if depth is not None or top_k is not None or total_tokens is not None:
                raise DraftsmithError("pass either paths (a static tree) or depth/top_k/total_tokens (dynamic), not both")
            buffers = TreeBuffers.from_paths(paths)
            self.buffers = buffers.to(self.device)
            self.depth = int(buffers.depths.max())
            self.top_k = int(buffers.choices.max()) + 1 if buffers.size > 1 else 1
            if self.top_k > cfg.num_draft_tokens:
                raise DraftsmithError(f"the tree asks for top-{self.top_k} of a {cfg.num_draft_tokens}-token draft vocabulary")
            plist = buffers.parents.tolist()
            self.static_parents = plist
            self.static_choices = buffers.choices.tolist()
            self.static_depths = buffers.depths.tolist()
            self.has_children = [False] * len(plist)
            for p in plist[1:]:
                self.has_children[p] = True
            self.by_depth: list[list[int]] = [[] for _ in range(self.depth + 1)]  # nodes of each depth
            for i, d in enumerate(self.static_depths):
                self.by_depth[d].append(i)
            self.is_chain = _is_chain(plist)
        self.cache = None

    @property
    def max_depth(self) -> int:
        return self.depth

    # ------------------------------------------------------------------ state between steps

    def prefill(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, sampling: SamplingParams,
                layer_hidden: torch.Tensor | None = None) -> None:
        """prompt_ids (T,), hidden (T, H) [, layer_hidden (T, L*H)]: every prompt pair is pending."""
        self.cache = new_cache(self.drafter.layer_config)
        self.committed = 0  # drafter cache slots holding verifier features
        self.pending_tokens = prompt_ids[1:].tolist()  # x_1 .. x_{T-1}; the root completes them
        # the pending pairs' features: those already computed, then the verifier states (hidden,
        # layer_hidden) of the rest, through the drafter's fc only when it next drafts (`_settle`,
        # every row of a batch in one call): a row the budget keeps plain pays no drafter work
        self.pending_feats, self.raw = None, [(hidden, layer_hidden)]

    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor,
               layer_hidden: torch.Tensor | None = None) -> None:
        """The accepted nodes' verifier states become the next pending pairs."""
        idx = torch.as_tensor(path, device=hidden.device)
        self.pending_tokens = tree.tokens[path[1:]].tolist()  # the root (next_token) completes them
        self.pending_feats, self.raw = None, [(hidden[idx], None if layer_hidden is None else layer_hidden[idx])]

    def skip(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor,
             layer_hidden: torch.Tensor | None = None) -> None:
        """A plain step (the root alone, no propose): its pair joins the pending ones, which the
        next propose feeds to the drafter in one forward."""
        idx = torch.as_tensor(path, device=hidden.device)
        self.pending_tokens = self.pending_tokens + tree.tokens[[0, *path[1:]]].tolist()  # the old root completes them
        self.raw.append((hidden[idx], None if layer_hidden is None else layer_hidden[idx]))  # copies, not views

    @torch.no_grad()
    def _features(self, hidden: torch.Tensor, layer_hidden: torch.Tensor | None) -> torch.Tensor:
        return self.drafter.input_features(hidden.to(self.dtype),
                                           None if layer_hidden is None else layer_hidden.to(self.dtype))

    @torch.no_grad()
    def _feed_alone(self, n: int) -> None:
        """The first n pending pairs through the drafter on this row's own cache (causal), committed."""
        tokens = torch.tensor(self.pending_tokens[:n], dtype=torch.long, device=self.device)  # (n,)
        position_ids = torch.arange(self.committed, self.committed + n, device=self.device)[None]  # (1, n)
        self.drafter(self._embed(tokens)[None], self.pending_feats[None, :n], position_ids=position_ids,
                     cache=self.cache)
        self.committed += n
        self.pending_tokens, self.pending_feats = self.pending_tokens[n:], self.pending_feats[n:]

    # ------------------------------------------------------------------ drafter calls

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens.to(self.embed_tokens.weight.device)).to(self.dtype)

    def _log_probs(self, feats: torch.Tensor) -> torch.Tensor:
        """(m, H) predicted features -> (m, N) draft log-probabilities."""
        return torch.log_softmax(self.drafter.logits(feats, self.lm_head).float(), dim=-1)

    def batch_key(self):
        """Rows drafting with the same drafter (forks share it) over the same tree propose together."""
        tree = ((self.depth, self.top_k, self.total_tokens) if self.dynamic
                else (tuple(self.static_parents), tuple(self.static_choices)))
        return (type(self).__name__, id(self.drafter), id(self.embed_tokens), id(self.lm_head), tree)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        return self.propose_batch([self], [root], [hidden], [ids])[0]

    @staticmethod
    @torch.no_grad()
    def propose_batch(proposers, roots, hiddens, ids) -> list[DraftTree]:
        """Every row's tree with ONE drafter forward per stage for all rows: the pending pairs,
        then each depth's expanded nodes (DrafterStack); one lm_head call per depth."""
        first = proposers[0]
        stack = DrafterStack(proposers, roots, *first._placeholders())
        if first.depth == 0:
            trees = [DraftTree(tokens=torch.tensor([r], device=first.device), parents=first.buffers.parents,
                               buffers=first.buffers, is_chain=True) for r in roots]
        else:
            trees = first._trees(proposers, roots, stack)
        stack.commit(proposers)
        return trees

    def _placeholders(self) -> tuple[int, int | None, torch.Tensor | None]:
        """Extra slots fed after each row's root in the first forward: (count, token, feature)."""
        return 0, None, None

    def _drafted_slots(self) -> int:
        """Drafter cache slots a tree's expanded nodes take (static: nodes with children)."""
        return (self.depth - 1) * self.top_k if self.dynamic else sum(self.has_children[1:])

    def _trees(self, proposers, roots, stack: DrafterStack) -> list[DraftTree]:
        builders = [p._dynamic_tree(r, f) if p.dynamic else p._static_tree(r, f)
                    for p, r, f in zip(proposers, roots, stack.root_out)]
        return _drive(builders, stack, self)

    # ------------------------------------------------------------------ trees
    # A tree builder is a generator: it yields what it needs from the drafter and receives it,
    #   ("top", feats (f, H), k) -> (log-probs (f, k) float64 on the CPU, verifier ids (f, k))
    #   ("nodes", tokens (g,), feats (g, H), depths (g,), ancestors [[slot, ..]] * g)
    #       -> (predicted features (g, H), the drafted slot of the first node; the others follow)
    # and returns its DraftTree; `_drive` serves every row's request of a stage in one call.

    def _static_tree(self, root: int, root_feat: torch.Tensor):
        n = len(self.static_parents)
        tokens = torch.empty(n, dtype=torch.long, device=self.device)
        tokens[0] = root
        feat = {0: root_feat}  # node -> predicted feature after it (nodes with children only)
        slot: dict[int, int] = {}  # node -> drafted slot in the stacked cache
        for d in range(self.depth):
            parents = [u for u in self.by_depth[d] if self.has_children[u]]
            _, top = yield "top", torch.stack([feat[u] for u in parents]), self.top_k  # (p, k) verifier ids
            row = {u: r for r, u in enumerate(parents)}
            children = self.by_depth[d + 1]
            choice = torch.tensor([[row[self.static_parents[c]], self.static_choices[c]] for c in children],
                                  device=self.device)  # (c, 2)
            tokens[children] = top[choice[:, 0], choice[:, 1]].to(self.device)
            grow = [c for c in children if self.has_children[c]]
            if grow:  # their predicted features: one forward for the whole depth
                anc = [self._ancestor_slots(c, self.static_parents, slot) for c in grow]
                out, first = yield ("nodes", tokens[grow], torch.stack([feat[self.static_parents[c]] for c in grow]),
                                    torch.full((len(grow),), d + 1), anc)
                for j, c in enumerate(grow):
                    feat[c], slot[c] = out[j], first + j
        return DraftTree(tokens=tokens, parents=self.buffers.parents, buffers=self.buffers, is_chain=self.is_chain)

    @staticmethod
    def _ancestor_slots(node: int, parents: list[int], slot: dict[int, int]) -> list[int]:
        """Drafted slots of node's drafted ancestors (the root's pair is committed)."""
        out, u = [], parents[node]
        while u > 0:
            out.append(slot[u])
            u = parents[u]
        return out

    def _dynamic_tree(self, root: int, root_feat: torch.Tensor):
        """EAGLE-2: expand the top_k nodes by cumulative draft log-prob per depth, then rerank."""
        k = self.top_k
        tok, par, dep, score = [root], [-1], [0], [0.0]  # the pool of drafted nodes; 0 is the root
        feat = {0: root_feat}  # expanded node -> its predicted feature
        slot: dict[int, int] = {}  # expanded node -> drafted slot in the stacked cache
        frontier = [0]
        for d in range(1, self.depth + 1):
            values, top = yield "top", torch.stack([feat[u] for u in frontier]), k  # (f, k), (f, k)
            parent_score = torch.tensor([score[u] for u in frontier], dtype=torch.float64)[:, None]  # (f, 1)
            cum = (parent_score + values).tolist()  # (f, k) cumulative log-probs
            ids = top.tolist()  # (f, k) verifier ids
            first = len(tok)
            for r, u in enumerate(frontier):
                tok += ids[r]
                par += [u] * k
                dep += [d] * k
                score += cum[r]
            if d == self.depth:
                break
            # expand this depth's best k nodes (ties: the earlier created) in one drafter forward
            frontier = sorted(sorted(range(first, len(tok)), key=lambda i: -score[i])[:k])
            anc = [self._ancestor_slots(c, par, slot) for c in frontier]
            out, start = yield ("nodes", torch.tensor([tok[c] for c in frontier], device=self.device),
                                torch.stack([feat[par[c]] for c in frontier]), torch.full((len(frontier),), d), anc)
            for j, c in enumerate(frontier):
                feat[c], slot[c] = out[j], start + j
        return self._rerank(tok, par, dep, score)

    def _rerank(self, tok: list[int], par: list[int], dep: list[int], score: list[float]) -> DraftTree:
        """Keep the root and the best total_tokens - 1 drafted nodes by cumulative log-prob.

        Ties go to the shallower node, then the earlier created one: a child's score never
        exceeds its parent's (log-probs <= 0) and at equal score the parent is shallower, so
        every kept node's parent is kept, and kept before it. Kept nodes are numbered in that
        rank order, which is topological and best-first: a cut to the first w nodes (the
        load-aware budget's) is the tree EAGLE-2 would rerank with total_tokens = w.
        """
        ranked = sorted(range(1, len(tok)), key=lambda i: (-score[i], dep[i], i))[: self.total_tokens - 1]
        keep = [0] + ranked
        new = {old: j for j, old in enumerate(keep)}
        parents = [-1] + [new[par[i]] for i in keep[1:]]  # KeyError here would mean an invalid tree
        tokens = torch.tensor([tok[i] for i in keep], dtype=torch.long, device=self.device)
        return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long, device=self.device))


class DrafterStack:
    """m rows' drafter caches side by side for one batched proposal (a ragged batch, padded).

    Row b's own cache holds c_b committed pairs; its pending pairs (p_b, the root's pair last)
    and X placeholder slots (P-EAGLE) are fed by the first forward, here. The stacked cache
    (m, H_kv, S, D):
        [0, C)               committed pairs: row b's first c_b slots (C = max c_b)
        [C, C + P)           pending pairs: row b's first p_b slots (P = max p_b)
        [C + P, C + P + X)   placeholders
        [C + P + X, ...)     drafted nodes, appended by ``nodes`` (slot s of every row at C + P + X + s)
    Every query sees only its own row's real slots (additive mask), at its row's own positions,
    so each row's outputs are what its own forward would give. ``commit`` moves the pending pairs'
    entries into the rows' own caches once the trees are built; the rest is dropped with the stack.
    """

    def __init__(self, proposers: list[EagleProposer], roots: list[int], placeholders: int = 0,
                 placeholder_token: int | None = None, placeholder_feat: torch.Tensor | None = None):
        first = proposers[0]
        self.drafter, self.device, self.dtype = first.drafter, first.device, first.drafter.compute_dtype
        _settle(proposers)
        for p in proposers:  # long backlogs go first, alone
            if len(p.pending_tokens) + 1 > CATCH_UP:
                p._feed_alone(len(p.pending_tokens) + 1 - CATCH_UP)
        m, X = len(proposers), placeholders
        lens = torch.tensor([p.committed for p in proposers], device=self.device)  # (m,) c_b
        pend = [len(p.pending_tokens) + 1 for p in proposers]  # p_b
        C, P = int(lens.max()), max(pend)
        lc = self.drafter.layer_config
        cap = C + P + X + first._drafted_slots()
        keys = torch.zeros(m, lc.num_key_value_heads, cap, lc.head_dim, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        for b, p in enumerate(proposers):
            if p.committed:
                own = p.cache.layers[0]
                keys[b, :, : p.committed], values[b, :, : p.committed] = own.keys[0], own.values[0]
        self.cache = Cache(layers=[BufferedLayer()])
        self.cache.layers[0].adopt(keys, values, C)

        # The first forward: each row's pending pairs (index i < p_b), padding (-1), placeholders (p_b + j).
        H = first.pending_feats.shape[-1]
        tokens = torch.zeros(m, P + X, dtype=torch.long, device=self.device)
        feats = torch.zeros(m, P + X, H, dtype=self.dtype, device=self.device)
        index = torch.full((m, P + X), -1, device=self.device)
        for b, p in enumerate(proposers):
            n = pend[b]
            tokens[b, :n] = torch.tensor(p.pending_tokens + [roots[b]], device=self.device)
            feats[b, :n] = p.pending_feats
            index[b, :n] = torch.arange(n, device=self.device)
            index[b, P:] = n + torch.arange(X, device=self.device)
        if X:
            tokens[:, P:], feats[:, P:] = placeholder_token, placeholder_feat
        real = index >= 0  # (m, P + X)
        committed = torch.arange(C, device=self.device)[None] < lens[:, None]  # (m, C)
        sees = real[:, None, :] & (index[:, None, :] <= index[:, :, None])  # (m, q, k) causal within the row
        sees |= torch.eye(P + X, dtype=torch.bool, device=self.device)  # a pad sees itself alone
        allowed = torch.cat([committed[:, None, :] & real[:, :, None], sees], dim=2)  # (m, P+X, C+P+X)
        positions = lens[:, None] + index.clamp(min=0)  # (m, P+X)
        self.out = self.drafter(first._embed(tokens), feats, attention_mask=additive_mask(allowed, self.dtype)[:, None],
                                position_ids=positions, cache=self.cache)  # (m, P+X, H)
        pend_t = torch.tensor(pend, device=self.device)
        self.root_out = self.out[torch.arange(m, device=self.device), pend_t - 1]  # (m, H) predicted after each root
        self.pending, self.P = pend, P

        # what a drafted node sees besides its drafted ancestors: its row's committed slots
        self.base = torch.cat([committed, real & (index < pend_t[:, None])], dim=1)  # (m, C+P+X)
        self.committed = lens + pend_t  # (m,) the rows' committed pairs; the root's position is one less
        self.C = C

    def commit(self, proposers: list[EagleProposer]) -> None:
        """The pending pairs are committed: into each row's own cache. Called once every tree is
        built, so a proposal that raises leaves every row as it was (the engine retries alone)."""
        layer, C = self.cache.layers[0], self.C
        for b, p in enumerate(proposers):
            n = self.pending[b]
            p.cache.layers[0].update(layer.keys[b:b + 1, :, C:C + n], layer.values[b:b + 1, :, C:C + n])
            p.committed += n
            p.pending_tokens, p.pending_feats = [], None

    def nodes(self, tokens: torch.Tensor, feats: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
              real: torch.Tensor, embed) -> tuple[torch.Tensor, int]:
        """One forward over g drafted nodes per row: tokens (m, g), feats (m, g, H), depths (m, g),
        ancestors (m, g, S) bool over the S drafted slots so far, real (m, g) bool (the others
        pad) -> (predicted features (m, g, H), the drafted slot of node 0; node j's is that + j)."""
        m, g = tokens.shape
        S = self.cache.get_seq_length() - self.base.shape[1]
        allowed = torch.cat([self.base[:, None, :] & real[:, :, None], ancestors & real[:, :, None],
                             torch.eye(g, dtype=torch.bool, device=self.device).expand(m, g, g)], dim=2)
        positions = self.committed[:, None] - 1 + depths.to(self.device)  # (m, g)
        out = self.drafter(embed(tokens), feats, attention_mask=additive_mask(allowed, self.dtype)[:, None],
                           position_ids=positions, cache=self.cache)
        return out, S


@torch.no_grad()
def _settle(proposers: list[EagleProposer]) -> None:
    """Every row's pending verifier states through the drafter's fc (EAGLE-3; EAGLE-1 reads the
    state as it is) in ONE call, appended to its pending features."""
    todo = [p for p in proposers if p.raw]
    if not todo:
        return
    states = [state for p in todo for state in p.raw]
    hidden = torch.cat([h for h, _ in states])  # (sum k, H)
    layers = None if states[0][1] is None else torch.cat([lh for _, lh in states])  # (sum k, L*H)
    feats = todo[0]._features(hidden, layers)
    start = 0
    for p in todo:
        n = sum(h.shape[0] for h, _ in p.raw)
        mine = feats[start:start + n]
        start += n
        p.pending_feats = mine if p.pending_feats is None else torch.cat([p.pending_feats, mine])
        p.raw = []


def _drive(builders: list, stack: DrafterStack, proposer: EagleProposer) -> list[DraftTree]:
    """Run every row's tree builder (decode.proposers.drive_together), each stage's asks of all rows
    served in one call: one lm_head + top-k over every row's features, one drafter forward over
    every row's nodes."""
    return drive_together(builders, lambda asks: _serve(asks, stack, proposer))


def _serve(asks: dict, stack: DrafterStack, proposer: EagleProposer) -> dict:
    """{row: ask} -> {row: reply} (the asks of EagleProposer's tree builders)."""
    m, live, replies = stack.root_out.shape[0], sorted(asks), {}
    for k in sorted({asks[b][2] for b in live if asks[b][0] == "top"}):
        members = [b for b in live if asks[b][0] == "top" and asks[b][2] == k]
        feats = [asks[b][1] for b in members]
        top = torch.topk(proposer._log_probs(torch.cat(feats)), k, dim=-1)  # (sum f, k)
        values, ids = top.values.double().cpu(), proposer.drafter.to_target_ids(top.indices)
        start = 0
        for b, f in zip(members, feats):
            replies[b] = values[start:start + len(f)], ids[start:start + len(f)]
            start += len(f)
    members = [b for b in live if asks[b][0] == "nodes"]
    if members:
        g = max(asks[b][1].numel() for b in members)
        S = stack.cache.get_seq_length() - stack.base.shape[1]
        H = stack.root_out.shape[-1]
        tokens = torch.zeros(m, g, dtype=torch.long, device=stack.device)
        feats = torch.zeros(m, g, H, dtype=stack.dtype, device=stack.device)
        depths = torch.zeros(m, g, dtype=torch.long)
        real = torch.zeros(m, g, dtype=torch.bool, device=stack.device)
        rows, cols, slots = [], [], []
        for b in members:
            _, t, f, d, anc = asks[b]
            n = t.numel()
            tokens[b, :n], feats[b, :n], depths[b, :n], real[b, :n] = t, f, d, True
            for i, a in enumerate(anc):
                rows += [b] * len(a)
                cols += [i] * len(a)
                slots += a
        ancestors = torch.zeros(m, g, S, dtype=torch.bool, device=stack.device)
        if slots:
            ancestors[rows, cols, slots] = True
        out, first = stack.nodes(tokens, feats, depths, ancestors, real, proposer._embed)
        for b in members:
            replies[b] = out[b, : asks[b][1].numel()], first
    return replies
