"""Batched plain decoding for throughput (self-distillation, data generation): the verifier's
own law, many sequences per forward, no drafter.

    for index, tokens, finish in generate_batch(model, prompts, max_new_tokens=256, eos=[2],
                                                params=SamplingParams(), batch_size=64): ...

Continuous batching on one KV cache (decode.cache.BufferedLayer, keys written in place):

    slots   0 ........................ L-1 | L
    row a   [pad][ prompt a ][ answer a ...]| next token of a
    row b   [pad  pad ][ prompt b ][ ans b ]| next token of b       every row writes slot L
    row c   [ pad  pad  pad  ][ prompt c  ]| (joined later: its prompt ends at L-1)

Every row owns the contiguous slots [start_r, L) and sees only those (an additive mask),
positions count its own tokens (0 at start_r), so a row's logits are its own prompt's alone.
One forward per step feeds each row's last token at slot L. The prompts' common prefix (a
chat template's system prompt: about half of every chit-chat prompt's tokens) runs once;
joining rows copy its keys/values into their slots and prefill only their own suffix
(``share_prefix``). When an eighth of the rows are
done, the batch is rebuilt in ONE copy of the cache: finished rows leave, waiting prompts
join (prefilled together, right-aligned so their prompt ends at slot L-1), and slots no row
sees any more are cut from the front. Greedy rows are the verifier's argmax decoding up to
the dtype's rounding of a batched forward (a bf16 batch rounds differently from one row);
sampling draws each row from logits_to_probs (float64) by inverse CDF (sampling.sample_rows),
one uniform per row and step from ``generator``. A row that stops (EOS, included as in HF generate, or
max_new_tokens) is yielded at once.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from draftsmith.decode.cache import SLACK, check_compactable, new_cache
from draftsmith.decode.sampling import SamplingParams, logits_to_probs, sample_rows
from draftsmith.decode.tree import additive_mask
from draftsmith.models.errors import DraftsmithError


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens: argmax when greedy, else a draw from the law."""
    if params.greedy:  # a bf16 argmax is slow on CPU; widening is exact, so the argmax is the same
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).argmax(-1)
    return sample_rows(logits_to_probs(logits, params.temperature, params.top_k, params.top_p), generator)


class _Batch:
    """The live rows of a continuous batch and their shared cache."""

    def __init__(self, model: PreTrainedModel):
        check_compactable(new_cache(model.config))  # full attention only: rows are cut and joined by slot
        self.model, self.decoder, self.lm_head = model, model.get_decoder(), model.get_output_embeddings()
        self.device = self.lm_head.weight.device
        self.cache = None
        self.length = 0  # L: slots in the cache
        self.rows: list[int] = []  # prompt index of each row
        self.starts = torch.zeros(0, dtype=torch.long, device=self.device)  # (b,) first slot of each row
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # (b,) each row's token for slot L
        self.prefix: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (1, H, P, D): the shared prefix
        self.prefix_len = 0  # P

    def set_prefix(self, prefix: list[int]) -> None:
        """Run the prompts' common prefix once; every joining row gets a copy of its keys/values."""
        if not prefix:
            return
        P = len(prefix)
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        cache = new_cache(self.model.config)
        self.decoder(input_ids=torch.tensor([prefix], device=self.device),
                     attention_mask=additive_mask(causal, self.model.dtype)[None, None],
                     position_ids=torch.arange(P, device=self.device)[None], cache=cache, use_cache=True)
        self.prefix = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]  # (1, H, P, D) each
        self.prefix_len = P

    def prefill(self, prompts: list[list[int]]):
        """Run new prompts -> (per layer (keys, values) right-aligned to the widest, (n,) next-token logits,
        width). Prompts of similar length are prefilled together (sorted, cut where padding would
        pass a quarter of a chunk), so a long prompt never pads many short ones: compute stays
        proportional to real tokens."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        chunks, chunk = [], []
        for i in order:  # longest first: a chunk's width is its first prompt's length
            if chunk and len(prompts[chunk[0]]) * (len(chunk) + 1) > 1.25 * sum(len(prompts[j]) for j in chunk + [i]):
                chunks.append(chunk)
                chunk = []
            chunk.append(i)
        chunks.append(chunk)
        parts = [self._prefill_chunk([prompts[i] for i in c]) for c in chunks]
        width = max(w for _, _, w in parts)
        kv = []  # per layer (keys, values), each (n, H, W, D): prompt order, right-aligned at the widest
        for layer_index in range(len(parts[0][0])):
            pair = []
            for j in range(2):  # keys, values
                first = parts[0][0][layer_index][j]
                out = first.new_zeros(len(prompts), first.shape[1], width, first.shape[-1])  # (n, H, W, D)
                for (chunk_kv, _, w), c in zip(parts, chunks):  # one copy of each chunk into place
                    out[torch.tensor(c, device=self.device), :, width - w:] = chunk_kv[layer_index][j]
                pair.append(out)
            kv.append(tuple(pair))
        logits = torch.empty(len(prompts), parts[0][1].shape[-1], dtype=parts[0][1].dtype, device=self.device)
        for (_, lg, _), c in zip(parts, chunks):
            logits[torch.tensor(c, device=self.device)] = lg
        return kv, logits, width

    def _prefill_chunk(self, prompts: list[list[int]]):
        """Run prompts left-padded together -> (per layer (keys, values) (n, H, W, D), (n,)
        next-token logits, width W).

        With a shared prefix of P tokens (every prompt is longer), only the suffixes run, on a
        cache holding the prefix: keys [prefix P | left-padded suffixes S]. Each row is then
        gathered into the right-aligned layout [pad | prefix | suffix] the batch expects."""
        n, P = len(prompts), self.prefix_len
        suffixes = [p[P:] for p in prompts]
        S = max(len(p) for p in suffixes)
        ids = torch.zeros(n, S, dtype=torch.long, device=self.device)  # (n, S)
        real = torch.zeros(n, S, dtype=torch.bool, device=self.device)  # (n, S)
        for i, p in enumerate(suffixes):
            ids[i, S - len(p):] = torch.as_tensor(p, device=self.device)
            real[i, S - len(p):] = True
        positions = P + (real.long().cumsum(-1) - 1).clamp(min=0)  # (n, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=self.device).tril()
        own = (causal[None] & real[:, None, :]) | torch.eye(S, dtype=torch.bool, device=self.device)[None]  # (n, S, S)
        allowed = torch.cat([own.new_ones(n, S, P), own], dim=-1)  # (n, S, P + S): the prefix is seen by all
        cache = new_cache(self.model.config)
        for layer, (keys, values) in zip(cache.layers, self.prefix):
            layer.set(keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1))
        hidden = self.decoder(input_ids=ids, attention_mask=additive_mask(allowed, self.model.dtype)[:, None],
                              position_ids=positions, cache=cache, use_cache=True).last_hidden_state[:, -1]  # (n, H)
        kv = [(layer.keys, layer.values) for layer in cache.layers]  # (n, H, P + S, D) each
        if P:  # row i's prefix moves from slots [0, P) to [S - s_i, S - s_i + P); its suffix stays
            offset = torch.tensor([S - len(p) for p in suffixes], device=self.device)[:, None]  # (n, 1)
            slots = torch.arange(P + S, device=self.device)[None]  # (1, W)
            in_prefix = (slots >= offset) & (slots < offset + P)  # (n, W)
            source = torch.where(in_prefix, slots - offset, slots)  # (n, W); pad slots read finite values
            index = source[:, None, :, None].expand(n, kv[0][0].shape[1], P + S, kv[0][0].shape[-1])
            kv = [(keys.gather(2, index), values.gather(2, index)) for keys, values in kv]
        return kv, self.lm_head(hidden), P + S

    def rebuild(self, keep: list[int], new_kv, new_width: int, new_rows: list[int], new_lengths: list[int],
                new_last: torch.Tensor) -> None:
        """Keep rows `keep` (indices into the live rows), add the prefilled new rows (new_kv: per
        layer (keys, values) (m, H, new_width, D), right-aligned) so that their prompts end at slot
        L-1, and cut the slots no remaining row sees: every layer written once into a new buffer."""
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        starts = self.starts[keep_t]  # (k,)
        length = max(self.length, new_width)
        shift = length - self.length  # the old slots move right when the new prompts are wider than L
        new_starts = torch.tensor([length - n for n in new_lengths], dtype=torch.long, device=self.device)
        all_starts = torch.cat([starts + shift, new_starts])  # (k + m,)
        front = int(all_starts.min()) if all_starts.numel() else length  # slots before it are seen by no row
        size = length - front
        if self.cache is None:
            self.cache = new_cache(self.model.config)
        for index, layer in enumerate(self.cache.layers):
            buffers = []
            for j, name in enumerate(("keys", "values")):
                old = getattr(layer, name) if keep and layer.is_initialized else None  # (b, H, L, D)
                new = new_kv[index][j] if new_kv else None  # (m, H, new_width, D)
                like = old if old is not None else new
                buf = like.new_zeros(len(keep) + len(new_rows), like.shape[1], size + SLACK, like.shape[-1])
                if old is not None:  # old slot i -> i + shift - front
                    d = shift - front
                    buf[: len(keep), :, max(d, 0): size] = old[keep_t, :, max(-d, 0):]
                if new is not None:  # new slot i -> i + length - new_width - front
                    e = length - new_width - front
                    buf[len(keep):, :, max(e, 0): size] = new[:, :, max(-e, 0):]
                buffers.append(buf)
            layer.adopt(*buffers, size)
        self.length = size
        self.starts = all_starts - front
        self.rows = [self.rows[j] for j in keep] + new_rows
        self.last = torch.cat([self.last[keep_t], new_last])

    def step(self, params: SamplingParams, generator) -> torch.Tensor:
        """Feed every row's last token at slot L -> (b,) the next tokens."""
        slots = torch.arange(self.length + 1, device=self.device)  # (L+1,)
        allowed = slots[None, :] >= self.starts[:, None]  # (b, L+1) each row's own slots
        mask = additive_mask(allowed, self.model.dtype)[:, None, None]  # (b, 1, 1, L+1)
        positions = (self.length - self.starts)[:, None]  # (b, 1)
        hidden = self.decoder(input_ids=self.last[:, None], attention_mask=mask, position_ids=positions,
                              cache=self.cache, use_cache=True).last_hidden_state[:, -1]  # (b, H)
        self.length += 1
        return next_tokens(self.lm_head(hidden), params, generator)


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The longest prefix every prompt shares, one token shorter than the shortest prompt (each
    row's next-token logits must come from a token of its own)."""
    first, limit = list(prompts[0]), min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return first[:n]


@torch.inference_mode()
def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   eos: Sequence[int], params: SamplingParams | None = None, batch_size: int = 64,
                   generator: torch.Generator | None = None,
                   share_prefix: bool = True) -> Iterator[tuple[int, list[int], str]]:
    """Decode every prompt (token ids); yield (prompt index, new tokens, "stop" | "length") as
    each finishes. Up to `batch_size` rows decode together; prompts join in the given order as
    rows finish (longest first keeps the cache narrow: a joining prompt never widens it).
    share_prefix: run the prompts' common prefix once (each row keeps at least its last token)."""
    if max_new_tokens < 1 or batch_size < 1:
        raise DraftsmithError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}: both must be >= 1")
    params = SamplingParams() if params is None else params
    eos_set = frozenset(int(t) for t in eos)
    batch, waiting = _Batch(model), list(range(len(prompts)))
    if share_prefix and prompts:
        batch.set_prefix(common_prefix(prompts))
    out: dict[int, list[int]] = {}
    done: list[bool] = []  # per live row
    while waiting or batch.rows:
        # Rebuild when an eighth of the rows are done (or at the start): finished leave, new join.
        finished = sum(done)
        if not batch.rows or (finished * 8 >= len(batch.rows) and (finished or waiting)):
            keep = [j for j, d in enumerate(done) if not d]
            joining = waiting[: batch_size - len(keep)]
            waiting = waiting[len(joining):]
            if joining:
                kv, logits, width = batch.prefill([list(prompts[i]) for i in joining])
                first = next_tokens(logits, params, generator)  # (m,) the first new token of each
            else:
                kv, width, first = None, 0, torch.zeros(0, dtype=torch.long, device=batch.device)
            batch.rebuild(keep, kv, width, joining, [len(prompts[i]) for i in joining], first)
            done = [False] * len(batch.rows)
            for j, (i, tok) in enumerate(zip(joining, first.tolist()), start=len(keep)):
                out[i] = [tok]
                if tok in eos_set or max_new_tokens == 1:
                    done[j] = True
                    yield i, out.pop(i), "stop" if tok in eos_set else "length"
            if all(done):
                batch.rows, batch.starts, batch.last, done = [], batch.starts[:0], batch.last[:0], []
                batch.cache, batch.length = None, 0
                continue
        nxt = batch.step(params, generator).tolist()
        for j, (i, tok) in enumerate(zip(batch.rows, nxt)):
            if done[j]:
                continue  # finished: its slot is computed until the next rebuild, never read
            out[i].append(tok)
            if tok in eos_set or len(out[i]) == max_new_tokens:
                done[j] = True
                yield i, out.pop(i), "stop" if tok in eos_set else "length"
        batch.last = torch.tensor(nxt, dtype=torch.long, device=batch.device)
        if all(done) and not waiting:
            return
