"""EAGLE proposer: autoregressive drafting over features with the drafter's own KV cache.

The drafter (models/eagle.py) has one decoder layer and its own KV cache (decode.cache.new_cache).
Drafter cache slot j holds the input pair (x_{j+1}, f_j): the token at position j+1 and the verifier's
feature at position j (EAGLE-1: the final hidden state; EAGLE-3: the fused low/mid/high layer
states). Only pairs whose feature came from the verifier are kept between steps ("committed");
drafted nodes are appended while a tree is built and cropped afterwards.

One step (``propose``):
  1. the pending pairs (every accepted node of the last verification with the token after it;
     at the first step the whole prompt) go through the drafter in one causal forward on the
     cache; the last output predicts the feature after the root, whose logits give depth 1;
  2. the tree is grown depth by depth, each depth ONE drafter forward over the nodes expanded
     there (their parents' predicted features as input, a tree mask over the cache):
     - static trees (Medusa-style path lists; a chain is one): node (i0, .., id) takes the
       id-th top candidate of its parent's draft distribution;
     - dynamic trees (EAGLE-2): every node scores its cumulative draft log-probability; at each
       depth the top_k best nodes are expanded, each into its top_k children, up to `depth`;
       then all drafted nodes are reranked and the best `total_tokens - 1` kept (a child never
       outranks its parent, so the kept set is a valid tree);
  3. the drafted slots are cropped from the drafter cache.

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

from draftsmith.decode.cache import new_cache
from draftsmith.decode.proposers import DraftTree, Proposer, _is_chain
from draftsmith.decode.quant import QUANTS, int8_copy
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.tree import TreeBuffers, additive_mask
from draftsmith.models.errors import DraftsmithError, choose


class EagleProposer(Proposer):
    """EAGLE-1/3 drafting over a static tree (``paths``) or an EAGLE-2 dynamic tree.

    drafter: an EagleDrafter in the verifier's dtype and device; embed_tokens / lm_head: the
    verifier's (shared, frozen). Give either ``paths`` (Medusa format, e.g. a chain
    [[0], [0, 0], ...]) or ``depth``, ``top_k`` and ``total_tokens`` (EAGLE-2: expand the top_k
    nodes per depth, up to depth `depth`, keep `total_tokens` nodes including the root).
    ``quant``: "none" or "int8" (an int8 copy of the drafter drafts; the one given is not changed).
    """

    name = "eagle"

    def __init__(self, drafter: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module | None,
                 paths: Sequence[Sequence[int]] | None = None, depth: int | None = None,
                 top_k: int | None = None, total_tokens: int | None = None, quant: str = "none"):
        self.quant = choose(QUANTS, quant, "decode.draft_quant")
        self.drafter = int8_copy(drafter.eval()) if self.quant == "int8" else drafter.eval()
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
        self.pending_feats = self._features(hidden, layer_hidden)  # (T, H)

    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor,
               layer_hidden: torch.Tensor | None = None) -> None:
        """The accepted nodes' verifier features become the next pending pairs."""
        idx = torch.as_tensor(path, device=hidden.device)
        self.pending_tokens = tree.tokens[path[1:]].tolist()  # the root (next_token) completes them
        self.pending_feats = self._features(hidden[idx], None if layer_hidden is None else layer_hidden[idx])

    def skip(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor,
             layer_hidden: torch.Tensor | None = None) -> None:
        """A plain step (the root alone, no propose): its pair joins the pending ones, which the
        next propose feeds to the drafter in one forward."""
        idx = torch.as_tensor(path, device=hidden.device)
        self.pending_tokens = self.pending_tokens + tree.tokens[[0, *path[1:]]].tolist()  # the old root completes them
        self.pending_feats = torch.cat([self.pending_feats, self._features(
            hidden[idx], None if layer_hidden is None else layer_hidden[idx])])

    @torch.no_grad()
    def _features(self, hidden: torch.Tensor, layer_hidden: torch.Tensor | None) -> torch.Tensor:
        return self.drafter.input_features(hidden.to(self.dtype),
                                           None if layer_hidden is None else layer_hidden.to(self.dtype))

    # ------------------------------------------------------------------ drafter calls

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens.to(self.embed_tokens.weight.device)).to(self.dtype)

    def _log_probs(self, feats: torch.Tensor) -> torch.Tensor:
        """(m, H) predicted features -> (m, N) draft log-probabilities."""
        return torch.log_softmax(self.drafter.logits(feats, self.lm_head).float(), dim=-1)

    def _forward_nodes(self, tokens, feats, depths, anc_slots, n_slots) -> torch.Tensor:
        """One drafter forward over m new tree nodes appended after the committed pairs and the
        n_slots drafted ones already in the cache.

        tokens (m,) target ids, feats (m, H) their parents' predicted features, depths (m,) tree
        depths (position = committed - 1 + depth), anc_slots[i]: drafted cache slots node i sees.
        """
        m = tokens.numel()
        allowed = torch.zeros(m, self.committed + n_slots + m, dtype=torch.bool, device=self.device)
        allowed[:, : self.committed] = True
        for i, slots in enumerate(anc_slots):
            if slots:
                allowed[i, [self.committed + s for s in slots]] = True
            allowed[i, self.committed + n_slots + i] = True
        mask = additive_mask(allowed, self.dtype)  # (m, kv)
        position_ids = (self.committed - 1 + depths.to(self.device))[None]  # (1, m)
        out = self.drafter(self._embed(tokens)[None], feats[None], attention_mask=mask[None, None],
                           position_ids=position_ids, cache=self.cache)
        return out[0]  # (m, H)

    @torch.no_grad()
    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        tokens = torch.tensor(self.pending_tokens + [root], dtype=torch.long, device=self.device)  # (m,)
        feats = self.pending_feats  # (m, H)
        position_ids = torch.arange(self.committed, self.committed + tokens.numel(), device=self.device)[None]
        out = self.drafter(self._embed(tokens)[None], feats[None], position_ids=position_ids, cache=self.cache)
        self.committed += tokens.numel()
        root_feat = out[0, -1]  # (H,): the predicted feature after the root
        self.pending_tokens, self.pending_feats = [], feats[:0]
        if self.depth == 0:
            tree = DraftTree(tokens=torch.tensor([root], device=self.device), parents=self.buffers.parents,
                             buffers=self.buffers, is_chain=True)
        elif self.dynamic:
            tree = self._dynamic_tree(root, root_feat)
        else:
            tree = self._static_tree(root, root_feat)
        drafted = self.cache.get_seq_length() - self.committed
        if drafted:
            self.cache.crop(-drafted)  # negative = drop the last `drafted` slots (transformers 5)
        return tree

    # ------------------------------------------------------------------ trees

    def _static_tree(self, root: int, root_feat: torch.Tensor) -> DraftTree:
        n = len(self.static_parents)
        tokens = torch.empty(n, dtype=torch.long, device=self.device)
        tokens[0] = root
        feat = {0: root_feat}  # node -> predicted feature after it (nodes with children only)
        slot: dict[int, int] = {}  # node -> drafter cache slot (after the committed pairs)
        by_depth: list[list[int]] = [[] for _ in range(self.depth + 1)]
        for i, d in enumerate(self.static_depths):
            by_depth[d].append(i)
        for d in range(self.depth):
            parents = [u for u in by_depth[d] if self.has_children[u]]
            logp = self._log_probs(torch.stack([feat[u] for u in parents]))  # (p, N)
            top = torch.topk(logp, self.top_k, dim=-1).indices  # (p, k) draft ids
            row = {u: r for r, u in enumerate(parents)}
            children = by_depth[d + 1]
            choice = torch.tensor([[row[self.static_parents[c]], self.static_choices[c]] for c in children],
                                  device=self.device)  # (c, 2)
            tokens[children] = self.drafter.to_target_ids(top[choice[:, 0], choice[:, 1]])
            grow = [c for c in children if self.has_children[c]]
            if grow:  # their predicted features: one forward for the whole depth
                anc = [self._ancestor_slots(c, self.static_parents, slot) for c in grow]
                n_slots = len(slot)
                out = self._forward_nodes(tokens[grow], torch.stack([feat[self.static_parents[c]] for c in grow]),
                                          torch.full((len(grow),), d + 1), anc, n_slots)
                for j, c in enumerate(grow):
                    feat[c], slot[c] = out[j], n_slots + j
        return DraftTree(tokens=tokens, parents=self.buffers.parents, buffers=self.buffers, is_chain=self.is_chain)

    @staticmethod
    def _ancestor_slots(node: int, parents: list[int], slot: dict[int, int]) -> list[int]:
        """Drafter cache slots of node's drafted ancestors (the root's pair is committed)."""
        out, u = [], parents[node]
        while u > 0:
            out.append(slot[u])
            u = parents[u]
        return out

    def _dynamic_tree(self, root: int, root_feat: torch.Tensor) -> DraftTree:
        """EAGLE-2: expand the top_k nodes by cumulative draft log-prob per depth, then rerank."""
        k = self.top_k
        tok, par, dep, score = [root], [-1], [0], [0.0]  # the pool of drafted nodes; 0 is the root
        feat = {0: root_feat}  # expanded node -> its predicted feature
        slot: dict[int, int] = {}  # expanded node -> drafter cache slot
        frontier = [0]
        for d in range(1, self.depth + 1):
            logp = self._log_probs(torch.stack([feat[u] for u in frontier]))  # (f, N)
            top = torch.topk(logp, k, dim=-1)  # (f, k)
            parent_score = torch.tensor([score[u] for u in frontier], dtype=torch.float64)[:, None]  # (f, 1)
            cum = (parent_score + top.values.double().cpu()).tolist()  # (f, k) cumulative log-probs
            ids = self.drafter.to_target_ids(top.indices).tolist()  # (f, k) verifier ids
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
            n_slots = len(slot)
            out = self._forward_nodes(torch.tensor([tok[c] for c in frontier], device=self.device),
                                      torch.stack([feat[par[c]] for c in frontier]),
                                      torch.full((len(frontier),), d), anc, n_slots)  # (f, H)
            for j, c in enumerate(frontier):
                feat[c], slot[c] = out[j], n_slots + j
        return self._rerank(tok, par, dep, score)

    def _rerank(self, tok: list[int], par: list[int], dep: list[int], score: list[float]) -> DraftTree:
        """Keep the root and the best total_tokens - 1 drafted nodes by cumulative log-prob.

        Ties go to the shallower node, then the earlier created one: a child's score never
        exceeds its parent's (log-probs <= 0) and at equal score the parent is shallower, so
        every kept node's parent is kept. Kept nodes are renumbered in (depth, creation) order,
        which is topological.
        """
        ranked = sorted(range(1, len(tok)), key=lambda i: (-score[i], dep[i], i))[: self.total_tokens - 1]
        keep = [0] + sorted(ranked, key=lambda i: (dep[i], i))
        new = {old: j for j, old in enumerate(keep)}
        parents = [-1] + [new[par[i]] for i in keep[1:]]  # KeyError here would mean an invalid tree
        tokens = torch.tensor([tok[i] for i in keep], dtype=torch.long, device=self.device)
        return DraftTree(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long, device=self.device))
