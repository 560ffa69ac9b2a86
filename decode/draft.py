"""Draft-model proposer: a separate small causal LM proposes a chain or a small top-k tree.

The draft is any HF causal LM over the verifier's vocabulary (e.g. the verifier truncated to
its first layers, or a smaller model of the same family). It keeps its own KV cache
(``decode.cache.new_cache``, a transformers Cache) in step with the emitted text:

    prefill(prompt)       a fresh, empty draft cache
    propose(root, ids)    feed the tokens the draft has not seen yet (the prompt and the root
                          at the first step; later the root, plus the last accepted draft
                          token when the whole draft was accepted) -> q at the root; then
                          level by level: every node of depth d gets its children, and ONE
                          draft forward over the new level (tree mask on the cache) gives q
                          at each of them; the deepest level is never fed
    accept(path)          the draft cache is compacted to the committed tokens plus the
                          accepted draft nodes it already holds (decode.cache.compact_cache)

so after every step the draft's cache equals a fresh prefill of ids[:cached] (tested).

Rows of a batch drafting with the same draft (``batch_key``; a server's rows are forks of one
proposer) draft TOGETHER (``propose_batch``): their caches are stacked side by side, padded
(``_DraftStack``), and each forward above is ONE draft forward and one lm_head call for every
row, each token seeing only its own row's slots at its own positions; a backlog longer than
CATCH_UP (a new row's prompt) is fed alone first. Each row's tree is built by its own generator
(``_draft``: its own schedule, confidence cuts and seeded draws), so a row drafts what it would
alone; the fed tokens then move into the row's own cache.

Lossless by the engine's rules. Greedy (temperature 0): the children of a node are the draft's
top-``width`` tokens (a chain takes the argmax), and the greedy rule accepts exactly the
verifier's argmax path. Sampling: the children of node u are drawn one after another without
replacement from q_u = logits_to_probs(draft logits, T, top_k, top_p), the same transform the
engine applies to the verifier, and q_u is reported in ``DraftTree.draft_probs`` with
``sampled[u]`` set, so recursive rejection sampling is exact (decode/sampling.py). The draws
use the proposer's own generator (``seed``); any q works, a closer q is only accepted more.

Reduced draft vocabulary. ``vocab_rows`` (N,), the verifier ids the draft may propose
(train/draft.py ``method.draft_vocab_size``): each draft forward projects onto those N rows of
its lm_head only, and every other token gets logit -inf, so q is exactly zero there. Still
lossless: greedy drafts the argmax over the rows, sampling draws from that q and reports it,
and the verifier checks every token; only the draft's guesses outside the rows are lost.

Int8 weights. ``quant="int8"`` drafts with every linear layer of the draft (its layers and its
lm_head rows) kept as int8 rows with one scale each (decode/quant.py): a one-token draft
forward is memory-bound, so reading half the bytes makes it cheaper. The int8 draft is the
draft: greedy takes its argmax, sampling draws from and reports its own q, so the rules stay exact.

Draft length. ``length_schedule="fixed"`` drafts ``num_tokens`` each step; ``"heuristic"``
(HF assisted generation's schedule) adds 2 after a step whose whole draft was accepted and
takes 1 off otherwise, within [min_tokens, max_tokens], and keeps the length across generate
calls. "Whole draft accepted" means the accepted path holds the draft's own deepest node: with
prompt lookup grafted on (decode/lookup.py), a grafted branch that leaves the draft's chain and
runs deeper is the lookup's success, not the draft's, and does not lengthen the draft.
``confidence > 0`` stops growing a branch below depth 1 when the draft's largest probability at
its tip is below the threshold. Both stay lossless: a step's tree shape
depends only on earlier steps and on the draft's own state and draws, never on this step's
verification, and the rules are exact for any tree so drafted.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from draftsmith.decode import sampling
from draftsmith.decode.cache import check_compactable, compact_cache, new_cache
from draftsmith.decode.proposers import CATCH_UP, DraftTree, Proposer, drive_together
from draftsmith.decode.quant import QUANTS, int8_copy, int8_linear, quantize_rows
from draftsmith.decode.sampling import SamplingParams, logits_to_probs
from draftsmith.decode.tree import additive_mask
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.vocab import is_draft_vocab

LENGTH_SCHEDULES = {"fixed": "fixed", "heuristic": "heuristic"}
TREE_MASK_ATTENTION = ("eager", "sdpa", "grouped")


def sample_without_replacement(
    q: torch.Tensor, width: int, generator: torch.Generator
) -> list[int]:
    """Up to ``width`` distinct tokens drawn one after another from q (V,), each from q with the
    earlier draws zeroed and renormalised (the law ``rejection_walk`` assumes for siblings);
    fewer when q has fewer tokens with mass. Every draw is a float64 inverse CDF."""
    out: list[int] = []
    law = q.double()  # (V,)
    while len(out) < width and law is not None:
        out.append(sampling.sample(law, generator))
        law = sampling.without(q, out)
    return out


class DraftModelProposer(Proposer):
    """A separate causal LM drafts a chain (``tree_topk=()``) or a top-k tree.

    Args:
      model: the draft (HF causal LM); its output vocabulary must equal the verifier's.
      vocab_size: the verifier's vocabulary size (its lm_head rows).
      num_tokens: draft depth per step (the starting depth with the heuristic schedule).
      tree_topk: children per node at depth 1, 2, ... (deeper: 1), e.g. [2, 1] = two branches
        from the root, each continued as a chain. () = a chain.
      length_schedule: "fixed" or "heuristic" (+2 on full acceptance, -1 otherwise).
      min_tokens / max_tokens: bounds of the heuristic schedule (max defaults to 2*num_tokens).
      confidence: stop a branch below depth 1 when its largest draft probability is below this
        (0 = off). The probability is of q at temperature > 0, of softmax(logits) when greedy.
      seed: seed of the proposer's own generator for the draft's samples (the engine reseeds it
        from the call's generator before each sampled call: ``seed_draws``).
      vocab_rows: (N,) increasing verifier ids the draft drafts from (its reduced vocabulary);
        None = all V.
      quant: "none" (the weights as given) or "int8" (int8 rows and scales, decode/quant.py;
        the given model is not changed).
    """

    name = "draft"

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int,
        num_tokens: int = 4,
        tree_topk: Sequence[int] = (),
        length_schedule: str = "fixed",
        min_tokens: int = 1,
        max_tokens: int | None = None,
        confidence: float = 0.0,
        seed: int = 0,
        vocab_rows: torch.Tensor | None = None,
        quant: str = "none",
    ):
        lm_head = model.get_output_embeddings()
        draft_vocab = int(lm_head.weight.shape[0])
        if draft_vocab != int(vocab_size):
            raise DraftsmithError(
                f"the draft model's vocabulary has {draft_vocab} tokens but the verifier's has {vocab_size}: "
                "pass a draft that shares the verifier's tokenizer (drafter=...)"
            )
        self.length_schedule = choose(LENGTH_SCHEDULES, length_schedule, "decode.length_schedule")
        self.quant = choose(QUANTS, quant, "decode.draft_quant")
        max_tokens = 2 * num_tokens if max_tokens is None else max_tokens
        if not 1 <= min_tokens <= num_tokens <= max_tokens:
            raise DraftsmithError(
                f"decode.min_tokens={min_tokens}, decode.num_tokens={num_tokens}, decode.max_tokens={max_tokens}: "
                "need 1 <= min_tokens <= num_tokens <= max_tokens"
            )
        widths = [int(w) for w in tree_topk]
        if any(w < 1 for w in widths):
            raise DraftsmithError(f"decode.tree_topk={widths}: every width must be >= 1")
        if not 0.0 <= confidence < 1.0:
            raise DraftsmithError(f"decode.confidence={confidence}: must be in [0, 1) (0 = off)")
        attn = getattr(model.config, "_attn_implementation", None)
        if any(w > 1 for w in widths) and attn not in TREE_MASK_ATTENTION:
            raise DraftsmithError(
                f"decode.tree_topk={widths} needs a tree mask, which attn_implementation={attn!r} cannot take: "
                "load the draft with attn_implementation='sdpa', or use a chain (decode.tree_topk=[])"
            )
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = lm_head
        self.device = lm_head.weight.device
        self.rows, self.row_weight, self.row_bias = None, lm_head.weight, lm_head.bias
        if vocab_rows is not None:
            rows = torch.as_tensor(vocab_rows, device=self.device)  # (N,)
            if not is_draft_vocab(rows, draft_vocab):
                raise DraftsmithError(f"the draft vocabulary must be increasing token ids below {draft_vocab}; "
                                      f"retrain with method.draft_vocab_size=N, or decode with decode.draft_vocab=full")
            self.rows = rows.long()
            self.row_weight = lm_head.weight[self.rows].contiguous()  # (N, H)
            self.row_bias = None if lm_head.bias is None else lm_head.bias[self.rows].contiguous()
            draft_vocab = rows.numel()
        self.project = lambda h: F.linear(h, self.row_weight, self.row_bias)  # (m, H) -> (m, N)
        if self.quant == "int8":
            self.decoder = int8_copy(self.decoder)
            q, scale = quantize_rows(self.row_weight)  # (N, H) int8, (N,)
            self.project = lambda h: int8_linear(h, q, scale, self.row_bias)
        self.widths = [min(w, draft_vocab) for w in widths]
        self.length = int(num_tokens)
        self.min_tokens, self.max_tokens = int(min_tokens), int(max_tokens)
        self.confidence = float(confidence)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampling: SamplingParams | None = None
        self.cache: Cache | None = None
        self.cached = 0  # tokens in the draft cache that are committed text (ids[:cached])
        self.fed = 0  # tree nodes 1..fed of the last proposal sit in the cache after them

    @property
    def max_depth(self) -> int:
        return self.max_tokens if self.length_schedule == "heuristic" else self.length

    def samples_drafts(self, sampling: SamplingParams) -> bool:
        return not sampling.greedy  # greedy drafts the argmax; T > 0 draws from q

    def seed_draws(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def fork(self) -> "DraftModelProposer":
        twin = super().fork()
        twin.generator = torch.Generator(device=self.device)
        twin.generator.set_state(self.generator.get_state())  # its own stream, never the same object
        return twin

    def prefill(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, sampling: SamplingParams) -> None:
        """A fresh draft cache; the prompt is fed with the first root in the first ``propose``
        (one draft forward fewer than a separate prefill)."""
        self.sampling = sampling
        self.cache = new_cache(self.model.config)
        check_compactable(self.cache)
        self.cached, self.fed = 0, 0

    def _to_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(m, H) draft states -> (m, V) logits in at least float32; -inf outside the reduced
        vocabulary when there is one."""
        logits = self.project(hidden)  # (m, N): N = V without vocab_rows
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.rows is None:
            return logits
        full = logits.new_full((logits.shape[0], self.lm_head.weight.shape[0]), float("-inf"))  # (m, V)
        full[:, self.rows] = logits
        return full

    def _law(self, logits: torch.Tensor) -> torch.Tensor | None:
        """(m, V) logits -> (m, V) the draft law q (sampling), or softmax (greedy, only when a
        confidence threshold needs it), or None."""
        s = self.sampling
        if not s.greedy:
            return logits_to_probs(logits, s.temperature, s.top_k, s.top_p)
        return torch.softmax(logits, dim=-1) if self.confidence > 0 else None

    def batch_key(self):
        """Rows drafting with the same draft weights (forks share them) propose together; a draft
        whose attention takes no mask (padding needs one) drafts alone."""
        if getattr(self.model.config, "_attn_implementation", None) not in TREE_MASK_ATTENTION:
            return None
        return ("draft", id(self.decoder), id(self.row_weight), self.quant)  # an int8 draft: its own decoder copy

    def propose(self, root: int, hidden: torch.Tensor, ids: list[int]) -> DraftTree:
        return self.propose_batch([self], [root], [hidden], [ids])[0]

    @staticmethod
    @torch.inference_mode()
    def propose_batch(proposers, roots, hiddens, ids) -> list[DraftTree]:
        """Every row's tree, each level of every row in ONE draft forward (their caches stacked
        side by side: _DraftStack) and one lm_head call."""
        if any(p.sampling is None for p in proposers):
            raise RuntimeError("DraftModelProposer.propose before prefill: run it through decode.engine.generate")
        first = proposers[0]
        for p, i in zip(proposers, ids):  # a long backlog (the prompt at the first step) goes first, alone
            if len(i) - p.cached > CATCH_UP:
                p._feed_alone(i[p.cached: len(i) - CATCH_UP])
        stack = _DraftStack(proposers)
        try:
            trees = stack.drive([p._draft(r, i) for p, r, i in zip(proposers, roots, ids)], first)
        except BaseException:
            stack.undo()  # every row as it was: the engine retries each alone
            raise
        stack.commit(proposers)
        for p, (_, state) in zip(proposers, trees):
            p.cached, p.fed, p.drafted_depth, p.drafted = state
        return [tree for tree, _ in trees]

    @torch.inference_mode()
    def _feed_alone(self, tokens: list[int]) -> None:
        """Tokens through the draft on this row's own cache (causal), committed text."""
        self.decoder(input_ids=torch.tensor([tokens], dtype=torch.long, device=self.device), cache=self.cache,
                     use_cache=True)
        self.cached += len(tokens)

    def _draft(self, root: int, ids: list[int]):
        """This row's tree, as a generator: it yields each draft forward it needs as
        (tokens, positions, visible, last_only), where visible[j] lists the slots of this step's
        earlier fed tokens that token j sees (numbered from 0 in feeding order; the committed
        cache and the token itself are always seen), and receives the (q, V) logits (1 with
        last_only); it returns the DraftTree and the row's new state (the row is not changed
        here: a proposal that raises leaves it as it was). _DraftStack.drive serves every row's
        forward at once."""
        greedy = self.sampling.greedy
        committed = len(ids)  # after the first forward the draft cache holds all of ids, root last
        pending = ids[self.cached:]
        n0 = len(pending)
        logits = yield pending, [self.cached + j for j in range(n0)], [list(range(j)) for j in range(n0)], True
        tokens, parents, depths = [root], [-1], [0]
        laws: dict[int, torch.Tensor] = {}  # node -> (V,) the law its children were sampled from
        frontier, fed = [0], 0
        for d in range(1, self.length + 1):
            width = self.widths[d - 1] if d - 1 < len(self.widths) else 1
            law = self._law(logits)  # (m, V) or None
            new: list[int] = []
            for row, u in enumerate(frontier):
                if d > 1 and self.confidence > 0 and float(law[row].max()) < self.confidence:
                    continue  # the draft is unsure here: this branch stops
                if greedy:
                    children = torch.topk(logits[row], width).indices.tolist()
                else:
                    children = sample_without_replacement(law[row], width, self.generator)
                    laws[u] = law[row]
                for x in children:
                    tokens.append(x)
                    parents.append(u)
                    depths.append(d)
                    new.append(len(tokens) - 1)
            if not new or d == self.length:
                break
            # node i sits at slot n0 - 1 + i (the root is the last pending token): it sees the
            # pending tokens and its fed ancestors
            visible = []
            for i in new:
                seen, a = list(range(n0)), parents[i]
                while a > 0:
                    seen.append(n0 - 1 + a)
                    a = parents[a]
                visible.append(sorted(seen))
            logits = yield [tokens[i] for i in new], [committed - 1 + depths[i] for i in new], visible, False
            fed = new[-1]
            frontier = new
        # the row's state after this step (set by propose_batch once every row is drafted):
        # cached, fed, the draft's deepest level and its nodes 0..drafted-1 (a graft appends after them)
        return self._tree(tokens, parents, laws), (committed, fed, max(depths), len(tokens))

    def _tree(self, tokens: list[int], parents: list[int], laws: dict[int, torch.Tensor]) -> DraftTree:
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=self.device)  # (n,)
        parents_t = torch.tensor(parents, dtype=torch.long, device=self.device)  # (n,)
        if not laws:  # greedy: every child is a deterministic function of the draft state
            return DraftTree(tokens=tokens_t, parents=parents_t)
        first = next(iter(laws.values()))
        draft_probs = torch.zeros(len(tokens), first.numel(), dtype=first.dtype, device=self.device)  # (n, V)
        sampled = torch.zeros(len(tokens), dtype=torch.bool, device=self.device)  # (n,)
        for u, q in laws.items():
            draft_probs[u] = q
            sampled[u] = True
        return DraftTree(tokens=tokens_t, parents=parents_t, draft_probs=draft_probs, sampled=sampled)

    @torch.inference_mode()
    def accept(self, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor) -> None:
        # The root sits at slot cached - 1 and fed node j at slot cached - 1 + j; the accepted
        # nodes the draft already holds are a prefix of the path (they are the shallow ones).
        kept = [node for node in path[1:] if node <= self.fed]
        compact_cache(self.cache, self.cached - 1, [0, *kept])
        self.cached += len(kept)
        self.fed = 0
        if self.length_schedule == "heuristic":
            # the whole draft accepted: the path reaches the draft's deepest level through its own
            # nodes (a prompt-lookup graft may carry it deeper, or past a rejected draft node)
            if len(path) > self.drafted_depth and path[self.drafted_depth] < self.drafted:
                self.length = min(self.max_tokens, self.length + 2)
            else:
                self.length = max(self.min_tokens, self.length - 1)


class _DraftStack:
    """The rows' draft caches side by side for one batched proposal (every layer).

    Slots [0, C) hold each row's committed text (row b's first cached_b; C = their max); each
    ``feed`` appends g slots to every row (g = the most tokens a row feeds; the others pad),
    and row b's j-th fed token of the step sits at column C + cols[b][j]. A token sees its row's
    committed slots, the fed tokens its ``visible`` list names, and itself, at its row's
    positions. ``commit`` moves each row's fed tokens, in feeding order, into its own cache
    (where accept compacts them). One row decodes on its own cache, no copy."""

    def __init__(self, proposers: list[DraftModelProposer]):
        self.m, first = len(proposers), proposers[0]
        self.device, self.decoder, self.dtype = first.device, first.decoder, first.model.dtype
        self.lens = [p.cached for p in proposers]
        self.cols: list[list[int]] = [[] for _ in proposers]
        if self.m == 1:
            self.cache, self.C = first.cache, self.lens[0]
            return
        self.C = max(self.lens)
        self.cache = new_cache(first.model.config)
        filled = [p for p in proposers if p.cached]
        if filled:
            for i, layer in enumerate(self.cache.layers):
                own = filled[0].cache.layers[i].keys  # (1, H_kv, L, D)
                keys = own.new_zeros(self.m, own.shape[1], self.C + 128, own.shape[3])
                values = torch.zeros_like(keys)
                for b, p in enumerate(proposers):
                    if p.cached:
                        keys[b, :, :p.cached] = p.cache.layers[i].keys[0]
                        values[b, :, :p.cached] = p.cache.layers[i].values[0]
                layer.adopt(keys, values, self.C)

    def feed(self, asks: dict) -> torch.Tensor:
        """asks {row: (tokens, positions, visible)} -> the draft's last hidden states (m, g, H)."""
        g = max(len(a[0]) for a in asks.values())
        S = self.cache.get_seq_length() - self.C if self.cache.layers[0].is_initialized else 0  # fed columns so far
        tokens = torch.zeros(self.m, g, dtype=torch.long, device=self.device)
        positions = torch.zeros(self.m, g, dtype=torch.long, device=self.device)
        allowed = torch.zeros(self.m, g, self.C + S + g, dtype=torch.bool, device=self.device)
        allowed[:, torch.arange(g), self.C + S + torch.arange(g)] = True  # itself (a pad: only itself)
        causal = self.m == 1
        for b, (toks, pos, visible) in asks.items():
            n = len(toks)
            tokens[b, :n] = torch.tensor(toks, device=self.device)
            positions[b, :n] = torch.tensor(pos, device=self.device)
            allowed[b, :n, : self.lens[b]] = True
            before = len(self.cols[b])
            self.cols[b] += [S + j for j in range(n)]
            rows = [j for j, seen in enumerate(visible) for _ in seen]
            cols = [self.C + self.cols[b][s] for seen in visible for s in seen]
            if rows:
                allowed[b, rows, cols] = True
            causal = causal and all(seen == list(range(before + j)) for j, seen in enumerate(visible))
        # one row whose tokens each see everything before them: the model's own causal mask
        mask = None if causal else additive_mask(allowed, self.dtype)[:, None]  # (m, 1, g, C + S + g)
        return self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                            use_cache=True).last_hidden_state

    def drive(self, builders: list, proposer: DraftModelProposer) -> list:
        """Run every row's generator (``DraftModelProposer._draft``; decode.proposers.drive_together):
        each round's forwards of all rows in one ``feed`` and their logits in one lm_head call ->
        what each returns."""
        return drive_together(builders, lambda asks: self._serve(asks, proposer))

    def _serve(self, asks: dict, proposer: DraftModelProposer) -> dict:
        hidden = self.feed({b: ask[:3] for b, ask in asks.items()})  # (m, g, H)
        picks = [(b, len(ask[0]) - 1 if ask[3] else 0, len(ask[0])) for b, ask in sorted(asks.items())]
        logits = proposer._to_logits(torch.cat([hidden[b, lo:hi] for b, lo, hi in picks]))  # each row's last or all
        replies, start = {}, 0
        for b, lo, hi in picks:
            replies[b] = logits[start:start + hi - lo]
            start += hi - lo
        return replies

    def undo(self) -> None:
        """A proposal that raised: one row's own cache loses what this step fed (more rows fed
        only the stack)."""
        if self.m == 1 and self.cache.layers[0].is_initialized:
            extra = self.cache.get_seq_length() - self.C
            if extra:
                self.cache.crop(-extra)

    def commit(self, proposers: list[DraftModelProposer]) -> None:
        """Each row's fed tokens, in feeding order, into its own cache (after its committed text)."""
        if self.m == 1:
            return
        for b, p in enumerate(proposers):
            cols = torch.tensor(self.cols[b], dtype=torch.long, device=self.device) + self.C
            for layer, own in zip(self.cache.layers, p.cache.layers):
                own.update(layer.keys[b:b + 1].index_select(2, cols), layer.values[b:b + 1].index_select(2, cols))
