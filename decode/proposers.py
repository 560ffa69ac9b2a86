"""Proposers: turn the verifier's state at the last accepted node into a token tree to verify.

The engine (decode/engine.py) drives every proposer through the same calls:

    proposer.prefill(prompt_ids, hidden, sampling)    # once, after the verifier's prefill
    tree = proposer.propose(root, hidden_last, ids)   # each step, before the verifier forward
    ...one verifier forward over tree.tokens, acceptance rule -> path, next_token...
    proposer.accept(tree, path, next_token, hidden)   # each step, after acceptance
    proposer.skip(tree, path, next_token, hidden)     # instead, after a step it did not propose

- ``root`` is the last emitted token (node 0 of the tree; not yet in the verifier's KV cache).
- ``hidden_last`` (H,) is the verifier's final normed hidden state at the position BEFORE the
  root, i.e. the hidden state whose lm_head logits produced the root (Medusa head k on it
  predicts the token k + 1 places after the root).
- ``ids`` is every token so far (prompt + emitted, root included) as a Python list, for
  n-gram / prompt-lookup / lookahead proposers.
- ``hidden`` in ``accept`` (n, H) is the verifier's hidden state of every tree node from the
  same forward; ``hidden[path]`` are the accepted ones (EAGLE feeds them to its own KV cache).
- ``sampling`` (SamplingParams) tells a proposer that SAMPLES drafts how the engine processes
  the target law; it must draw from, and report in ``DraftTree.draft_probs``, the same
  transform of its own logits (decode.sampling.logits_to_probs), or the rejection rule is
  exact but accepts less. Such a proposer says so in ``samples_drafts(sampling)``, and the engine
  then calls ``seed_draws(seed)`` before ``prefill`` with a seed drawn from the call's generator:
  its draws follow the request's seed (a seeded request is reproducible) and are fresh on every
  call (a fixed stream would repeat the same "sample" and bias the law).

Adding a proposer: subclass ``Proposer``, implement ``propose`` (and ``prefill``/``accept`` if it
keeps state: a draft model's or EAGLE's own KV cache is rolled back to the accepted path in
``accept``), register it in ``PROPOSERS``. Dynamic trees (EAGLE-2) return a DraftTree with
``buffers=None``; the engine then builds the mask from ``parents``.
"""

import copy
import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.tree import TreeBuffers, verify_inputs
from draftsmith.models.errors import DraftsmithError


@dataclass(eq=False)
class DraftTree:
    """One step's token tree. Node 0 is the root (last emitted token), topological order.

    tokens (n,) long; parents (n,) long with parents[0] = -1.
    draft_probs (n, V) or None: row u is the law the children of u were drawn from, one
      after another without replacement, when sampled[u]; None = every child deterministic.
    sampled (n,) bool or None: whether node u's children were sampled (see draft_probs).
    buffers: precomputed TreeBuffers of a static tree (None = build the mask from parents).
    is_chain: a chain needs no tree mask (the model's causal mask is the same), so it runs with
      any attention implementation.
    """

    tokens: torch.Tensor  # (n,) long
    parents: torch.Tensor  # (n,) long
    draft_probs: torch.Tensor | None = None  # (n, V)
    sampled: torch.Tensor | None = None  # (n,) bool
    buffers: TreeBuffers | None = None
    is_chain: bool | None = None  # parents == [-1, 0, 1, ...]; None = work it out here

    def __post_init__(self):
        if self.is_chain is None:
            self.is_chain = _is_chain(self.parents.tolist())

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def verify_inputs(self, cache_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask (1, 1, n, cache_len + n), position_ids (1, n)) for the verifier."""
        if self.buffers is not None:
            mask, position_ids, _ = self.buffers.verify_inputs(cache_len, dtype)
        else:
            mask, position_ids, _ = verify_inputs(self.parents, cache_len, dtype, self.tokens.device)
        return mask, position_ids


def _is_chain(parents: Sequence[int]) -> bool:
    return list(parents) == [-1] + list(range(len(parents) - 1))


class Proposer:
    """Base class: the hooks a proposer may implement (see the module docstring)."""

    name: str = "base"
    cuttable: bool = True  # the engine may verify only a prefix of its trees (False: its accept reads every node)

    @property
    def max_depth(self) -> int:
        """Deepest drafted node this proposer can produce (0 = vanilla decoding)."""
        return 0

    def prefill(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, sampling: SamplingParams) -> None:
        """Once per generate call: prompt_ids (T,) and the verifier's hidden states (T, H)."""

    def samples_drafts(self, sampling: SamplingParams) -> bool:
        """Whether this proposer's trees carry sampled children (draft_probs) under `sampling`;
        False = every child is a deterministic function of the context (q = delta)."""
        return False

    def seed_draws(self, seed: int) -> None:
        """Reseed the proposer's own draws for the next call (only when ``samples_drafts``)."""

    def batch_key(self):
        """Rows whose proposers return the same key (not None) are proposed together by
        ``type(self).propose_batch`` (one drafter call for all of them); None: alone."""
        return None

    @staticmethod
    def propose_batch(proposers: list["Proposer"], roots: list[int], hiddens: list[torch.Tensor],
                      ids: list[list[int]]) -> list["DraftTree"]:
        """Each proposer's ``propose``, for rows of one batch_key: the same trees, fewer calls."""
        return [p.propose(r, h, i) for p, r, h, i in zip(proposers, roots, hiddens, ids)]

    def fork(self) -> "Proposer":
        """A proposer for another sequence decoded at the same time (a server's rows): it shares
        what is read only (the drafter's weights, trees, datastores) and owns its state, which
        ``prefill`` sets up; a proposer holding more (its own generator) copies that too."""
        return copy.copy(self)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        """The tree to verify this step; hidden (H,) is the verifier's state before the root."""
        raise NotImplementedError

    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor) -> None:
        """After acceptance: path (node indices from 0), hidden (n, H) of every tree node."""

    def skip(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor, **extra) -> None:
        """A step verified the root alone without calling ``propose`` (the engine's budget was 0:
        plain decoding). A proposer whose state follows the verified tokens catches up here, or
        in its next ``propose``; ``ids`` there always holds every token."""


class VanillaProposer(Proposer):
    """No drafting: the tree is just the root, so each step is one plain decoding step."""

    name = "vanilla"

    def __init__(self, device: torch.device | str = "cpu"):
        self.parents = torch.tensor([-1], dtype=torch.long, device=device)  # (1,)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        tokens = torch.tensor([root], dtype=torch.long, device=self.parents.device)  # (1,)
        return DraftTree(tokens=tokens, parents=self.parents, is_chain=True)


class MedusaProposer(Proposer):
    """Medusa heads over a static tree in Medusa's path format (``medusa_choices``).

    A path (i0, i1, ..., id-1) is the node at depth d whose token is the i_{d-1}-th top
    candidate of head d-1, under the node (i0, ..., i_{d-2}). All heads read the same hidden
    state (the verifier's state before the root), so the node tokens are the per-head top-k
    lists gathered at the tree's (depth, choice) pairs; siblings get distinct tokens. The
    children are deterministic functions of the verifier state (q = delta), which recursive
    rejection sampling handles exactly at any temperature (``sampled=None``).
    """

    name = "medusa"

    def __init__(
        self,
        heads: nn.Module,
        paths: Sequence[Sequence[int]],
        lm_head: nn.Module | None = None,
        device: torch.device | str | None = None,
    ):
        num_heads = heads.config.num_heads
        buffers = TreeBuffers.from_paths(paths)
        depth = int(buffers.depths.max())
        if depth > num_heads:
            raise DraftsmithError(f"the decode tree is {depth} deep but the Medusa drafter has {num_heads} heads: "
                                  f"pick a shallower decode=... tree (e.g. decode=medusa-cpu)")
        if getattr(heads.config, "lm_head", "own") == "shared" and lm_head is None:
            raise DraftsmithError("these Medusa heads share the verifier's lm_head: pass lm_head=verifier.lm_head")
        param = next(heads.parameters())
        device = param.device if device is None else device
        self.dtype = param.dtype
        self.heads = heads
        self.lm_head = lm_head
        self.buffers = buffers.to(device)
        self.depth = depth
        self.topk = int(buffers.choices.max()) + 1 if buffers.size > 1 else 1
        if self.topk > heads.config.vocab_size:
            raise DraftsmithError(
                f"the tree asks for top-{self.topk} candidates of a {heads.config.vocab_size}-token vocabulary"
            )
        # Per drafted node: which head's top-k list (depth - 1) and which rank (choice) it takes.
        self.head_index = self.buffers.depths[1:] - 1  # (n-1,)
        self.rank_index = self.buffers.choices[1:]  # (n-1,)
        self.is_chain = _is_chain(buffers.parents.tolist())

    @property
    def max_depth(self) -> int:
        return self.depth

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> (D, ..., V) logits of the first D = tree-depth heads only."""
        return self.heads(hidden, self.lm_head, num_heads=self.depth)

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        return self.propose_batch([self], [root], [hidden], [ids])[0]

    def batch_key(self):
        return ("medusa", id(self.heads), id(self.buffers), id(self.lm_head))  # forks share all three

    @staticmethod
    def propose_batch(proposers, roots, hiddens, ids) -> list[DraftTree]:
        """Every row's heads in ONE call over the stacked states (m, H) -> each row's tree."""
        first = proposers[0]
        device = first.buffers.parents.device
        roots_t = torch.tensor(roots, dtype=torch.long, device=device)[:, None]  # (m, 1)
        if first.depth == 0:
            tokens = roots_t
        else:
            logits = first.head_logits(torch.stack(hiddens).to(first.dtype))  # (D, m, V)
            candidates = torch.topk(logits, first.topk, dim=-1).indices  # (D, m, topk)
            drafted = candidates[first.head_index, :, first.rank_index].T  # (m, n-1)
            tokens = torch.cat([roots_t, drafted], dim=1)  # (m, n)
        return [DraftTree(tokens=row, parents=first.buffers.parents, buffers=first.buffers, is_chain=first.is_chain)
                for row in tokens]


CATCH_UP = 16  # tokens a row brings to a batched drafter forward; a longer backlog (a new row's prompt,
#                the tokens of many plain steps) goes through its drafter alone first, not padded for every row


def drive_together(builders: list, serve) -> list:
    """Run one generator per row side by side: each round takes every live generator's next
    request, ``serve({row: request}) -> {row: reply}`` answers them all at once (one drafter call
    for every row), and each reply is sent back; -> what each generator returns."""
    replies, results = [None] * len(builders), [None] * len(builders)
    live = list(range(len(builders)))
    while live:
        asks = {}
        for b in live:
            try:
                asks[b] = builders[b].send(replies[b])
            except StopIteration as done:
                results[b] = done.value
        live = sorted(asks)
        if live:
            replies = [None] * len(builders)
            for b, reply in serve(asks).items():
                replies[b] = reply
    return results


# name -> "module:Class". Proposers in other modules are imported when first built (they
# import this module for the base class, so importing them here would be circular).
PROPOSERS: dict[str, str] = {
    "vanilla": "draftsmith.decode.proposers:VanillaProposer",
    "medusa": "draftsmith.decode.proposers:MedusaProposer",
    "eagle": "draftsmith.decode.eagle:EagleProposer",
    "peagle": "draftsmith.decode.peagle:PEagleProposer",
    "draft": "draftsmith.decode.draft:DraftModelProposer",
    "prompt_lookup": "draftsmith.decode.lookup:PromptLookupProposer",
    "lookahead": "draftsmith.decode.lookup:LookaheadProposer",
}


def make_proposer(name: str, **kwargs) -> Proposer:
    """Build the proposer registered under ``name`` with its constructor's keyword arguments.

    vanilla: (device="cpu"); medusa: (heads, paths, lm_head=None, device=None);
    eagle: (drafter, embed_tokens, lm_head, paths=None | depth, top_k, total_tokens, quant="none");
    peagle: as eagle, with a P-EAGLE drafter (one forward drafts every depth);
    draft: (model, vocab_size, num_tokens, tree_topk, length_schedule, min_tokens, max_tokens, confidence, seed,
           vocab_rows=None, quant="none");
    prompt_lookup: (num_tokens, max_ngram, min_ngram, num_matches, device, retrieval=None);
    lookahead: (lm_head, window, ngram, guess_set, pool_from_prompt, seed, device).
    Unknown names raise a one-line DraftsmithError listing the valid ones.
    """
    try:
        module, cls = PROPOSERS[name].split(":")
    except KeyError:
        raise DraftsmithError(f"unknown proposer {name!r}; valid: {', '.join(sorted(PROPOSERS))}") from None
    return getattr(importlib.import_module(module), cls)(**kwargs)
