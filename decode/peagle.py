"""P-EAGLE proposer: K draft tokens from ONE drafter forward (parallel drafting).

The drafter is an EAGLE-3 drafter trained with placeholder slots (models/eagle.py,
``parallel_tokens`` = K; train/eagle.py method=peagle). Its state between steps is EAGLE's
(decode/eagle.py: the drafter's own KV cache of committed pairs (x_{j+1}, f_j), the pending pairs
of the last verification), so prefill / accept / skip are EagleProposer's. One step (``propose``):

  one causal drafter forward over [pending pairs, the root's pair, K' - 1 placeholders], where the
  placeholders sit at the positions after the root and read the mask token's embedding and
  fc(mask_hidden); the outputs at the root and at placeholder d (1..K'-1) give the draft laws of
  depths 1 and d + 1, over the draft vocabulary, in ONE lm_head call (K' = the tree's depth);
  only the pairs stay in the drafter's cache. Rows of a batch do this together: one drafter
  forward and one lm_head call for all of them (decode/eagle.py DrafterStack).

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
                 top_k: int | None = None, total_tokens: int | None = None, quant: str = "none",
                 weights: str = "plain"):
        k = getattr(drafter.config, "parallel_tokens", 0)
        if not k:
            raise DraftsmithError("the peagle proposer needs a P-EAGLE drafter (method=peagle: parallel_tokens >= 2); "
                                  "this one drafts sequentially: use the eagle proposer")
        super().__init__(drafter, embed_tokens, lm_head, paths=paths, depth=depth, top_k=top_k,
                         total_tokens=total_tokens, quant=quant, weights=weights)
        if self.depth > k:
            raise DraftsmithError(f"the decode tree is {self.depth} deep but this P-EAGLE drafter proposes {k} tokens "
                                  f"per forward (the depths it was trained for): use a tree of depth <= {k} "
                                  f"(decode=peagle-chain, peagle-dynamic, or decode.depth / paths)")
        with torch.no_grad():
            self.mask_feat = self.drafter.placeholder_features()[None].to(self.dtype)  # (1, H)
        if not self.dynamic:  # per drafted node: its depth's law (depth - 1) and its rank there
            self.depth_index = self.buffers.depths[1:] - 1  # (n-1,)
            self.rank_index = self.buffers.choices[1:]  # (n-1,)

    def _placeholders(self) -> tuple[int, int | None, torch.Tensor | None]:
        """depth - 1 placeholder slots after each row's root: the mask token and fc(mask_hidden)."""
        return max(self.depth - 1, 0), self.drafter.config.mask_token_id, self.mask_feat

    def _drafted_slots(self) -> int:
        return 0  # every depth's law comes from the first forward

    def _trees(self, proposers, roots, stack) -> list[DraftTree]:
        """Row b's laws: its root's output and its placeholders' (depth, H), every row in ONE lm_head call."""
        m, P = len(proposers), stack.P
        rows = torch.arange(m, device=self.device)[:, None]  # (m, 1)
        cols = torch.cat([torch.tensor(stack.pending, device=self.device)[:, None] - 1,
                          P + torch.arange(self.depth - 1, device=self.device)[None].expand(m, -1)], dim=1)  # (m, depth)
        logp = self._log_probs(stack.out[rows, cols].flatten(0, 1)).view(m, self.depth, -1)  # (m, depth, N)
        return [p._dynamic_tree(r, lp) if p.dynamic else p._static_tree(r, lp) for p, r, lp in zip(proposers, roots, logp)]

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
