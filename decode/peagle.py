"""P-EAGLE proposer: K draft tokens from ONE drafter forward (parallel drafting).

The drafter is an EAGLE-3 drafter trained with placeholder slots (models/eagle.py,
``parallel_tokens`` = K; train/eagle.py method=peagle). Its state between steps is EAGLE's
(decode/eagle.py: the drafter's own KV cache of committed pairs (x_{j+1}, f_j), the pending pairs
of the last verification), so prefill / accept / skip are EagleProposer's. One step (``propose``):

  one causal drafter forward over [pending pairs, the root's pair, K' - 1 placeholders], where the
  placeholders sit at the positions after the root and read the mask token's embedding and
  fc(mask_hidden); the outputs at the root and at placeholder d (1..K'-1) give the draft laws of
  depths 1 and d + 1, over the draft vocabulary, in ONE lm_head call (K' = the tree's depth);
  the placeholders' cache slots are cropped again, the pairs stay.

A placeholder never reads a drafted token, so depth d's law is the same under every node at
depth d - 1: the tree is a product of per-depth top-k lists, as Medusa's heads give:
  - static trees (Medusa-style path lists; a chain is one): node (i0, .., id) takes rank id of
    depth d+1's law;
  - dynamic trees: best-first over that product, each depth offering its top_k tokens, a node
    scored by the sum of its path's log-probabilities; the best total_tokens - 1 nodes are kept
    (a child never outscores its parent, so they form a tree; nodes are numbered in the order
    taken, which is topological and puts the best first: the engine may cut it to a prefix).
Every child is a deterministic function of the context (q = delta), so the engine's rules stay
lossless at every temperature: greedy at T = 0, recursive rejection sampling with
``draft_probs=None`` at T > 0, exactly as for EAGLE's top-k trees.

Trees deeper than K (the depths the drafter was trained for) are refused: deeper placeholder
slots were never trained.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import nn

from draftsmith.decode.eagle import EagleProposer
from draftsmith.decode.proposers import DraftTree
from draftsmith.models.errors import DraftsmithError


class PEagleProposer(EagleProposer):
    """P-EAGLE drafting over a static tree (``paths``) or a best-first dynamic tree (``depth``,
    ``top_k``, ``total_tokens``), one drafter forward a step. Arguments as EagleProposer's."""

    name = "peagle"

    def __init__(self, drafter: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module | None,
                 paths: Sequence[Sequence[int]] | None = None, depth: int | None = None,
                 top_k: int | None = None, total_tokens: int | None = None, quant: str = "none"):
        k = getattr(drafter.config, "parallel_tokens", 0)
        if not k:
            raise DraftsmithError("the peagle proposer needs a P-EAGLE drafter (method=peagle: parallel_tokens >= 2); "
                                  "this one drafts sequentially: use the eagle proposer")
        super().__init__(drafter, embed_tokens, lm_head, paths=paths, depth=depth, top_k=top_k,
                         total_tokens=total_tokens, quant=quant)
        if self.depth > k:
            raise DraftsmithError(f"the decode tree is {self.depth} deep but this P-EAGLE drafter proposes {k} tokens "
                                  f"per forward (the depths it was trained for): use a tree of depth <= {k} "
                                  f"(decode=peagle-chain, peagle-dynamic, or decode.depth / paths)")
        with torch.no_grad():
            self.mask_embed = self._embed(torch.tensor([drafter.config.mask_token_id], device=self.device))  # (1, H)
            self.mask_feat = self.drafter.placeholder_features()[None].to(self.dtype)  # (1, H)
        if not self.dynamic:  # per drafted node: its depth's law (depth - 1) and its rank there
            self.depth_index = self.buffers.depths[1:] - 1  # (n-1,)
            self.rank_index = self.buffers.choices[1:]  # (n-1,)

    @torch.no_grad()
    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        tokens = torch.tensor(self.pending_tokens + [root], dtype=torch.long, device=self.device)  # (m,)
        m, slots = tokens.numel(), max(self.depth - 1, 0)  # pairs, placeholders
        embeds = torch.cat([self._embed(tokens), self.mask_embed.expand(slots, -1)])  # (m + slots, H)
        feats = torch.cat([self.pending_feats, self.mask_feat.expand(slots, -1)])  # (m + slots, H)
        position_ids = torch.arange(self.committed, self.committed + m + slots, device=self.device)[None]
        out = self.drafter(embeds[None], feats[None], position_ids=position_ids, cache=self.cache)[0]  # causal
        self.committed += m
        self.pending_tokens, self.pending_feats = [], self.pending_feats[:0]
        drafted = self.cache.get_seq_length() - self.committed
        if drafted:
            self.cache.crop(-drafted)  # the placeholders' slots (transformers 5: negative = drop the last)
        if self.depth == 0:
            return DraftTree(tokens=tokens[-1:], parents=self.buffers.parents, buffers=self.buffers, is_chain=True)
        logp = self._log_probs(out[m - 1:])  # (depth, N): row d is depth d+1's law, in one lm_head call
        return self._dynamic_tree(root, logp) if self.dynamic else self._static_tree(root, logp)

    def _static_tree(self, root: int, logp: torch.Tensor) -> DraftTree:
        top = self.drafter.to_target_ids(torch.topk(logp, self.top_k, dim=-1).indices)  # (depth, top_k) verifier ids
        tokens = torch.cat([torch.tensor([root], device=self.device), top[self.depth_index, self.rank_index]])  # (n,)
        return DraftTree(tokens=tokens, parents=self.buffers.parents, buffers=self.buffers, is_chain=self.is_chain)

    def _dynamic_tree(self, root: int, logp: torch.Tensor) -> DraftTree:
        """Best-first over the product of the per-depth top_k lists, up to total_tokens nodes."""
        top = torch.topk(logp, self.top_k, dim=-1)  # (depth, k)
        score = top.values.double().cpu().tolist()  # (depth, k) log-probs
        ids = self.drafter.to_target_ids(top.indices).tolist()  # (depth, k) verifier ids
        tok, par = [root], [-1]
        order = 0  # creation order: ties go to the shallower, then the earlier offered node
        heap = []  # (-path score, depth, order, parent node, rank)
        for r in range(self.top_k):
            heap.append((-score[0][r], 1, order, 0, r))
            order += 1
        heapq.heapify(heap)
        while heap and len(tok) < self.total_tokens:
            neg, d, _, parent, r = heapq.heappop(heap)
            node = len(tok)
            tok.append(ids[d - 1][r])
            par.append(parent)
            if d < self.depth:
                for c in range(self.top_k):
                    heapq.heappush(heap, (neg - score[d][c], d + 1, order, node, c))
                    order += 1
        return DraftTree(tokens=torch.tensor(tok, dtype=torch.long, device=self.device),
                         parents=torch.tensor(par, dtype=torch.long, device=self.device))
