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
One forward per step feeds each row's last token at slot L. When an eighth of the rows are
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

from draftsmith.decode.cache import check_compactable, new_cache
from draftsmith.decode.sampling import SamplingParams, logits_to_probs, sample_rows
from draftsmith.decode.tree import additive_mask
from draftsmith.models.errors import DraftsmithError


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens: argmax when greedy, else a draw from the law."""
    if params.greedy:
        return logits.argmax(-1)
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

    def prefill(self, prompts: list[list[int]]):
        """Run new prompts -> (their cache, right-aligned to the widest, (n,) next-token logits,
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
        cache = new_cache(self.model.config)
        for layer_index, layer in enumerate(cache.layers):
            pads = [(0, 0, width - w, 0) for _, _, w in parts]  # right-align every chunk at the widest
            keys = torch.cat([torch.nn.functional.pad(c.layers[layer_index].keys, p) for (c, _, _), p in zip(parts, pads)])
            values = torch.cat([torch.nn.functional.pad(c.layers[layer_index].values, p)
                                for (c, _, _), p in zip(parts, pads)])
            layer.set(keys, values)  # (n, H, W, D), rows in chunk order
        logits = torch.cat([lg for _, lg, _ in parts])  # (n, V) in chunk order
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor([i for c in chunks for i in c])] = torch.arange(len(order))
        back = back.to(self.device)  # prompt index -> its row in chunk order
        cache.batch_select_indices(back)
        return cache, logits[back], width

    def _prefill_chunk(self, prompts: list[list[int]]):
        """Run prompts left-padded together -> (their cache, (n,) next-token logits, width)."""
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, width, dtype=torch.long, device=self.device)  # (n, W)
        real = torch.zeros(n, width, dtype=torch.bool, device=self.device)  # (n, W)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.as_tensor(p, device=self.device)
            real[i, width - len(p):] = True
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (n, W)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        cache = new_cache(self.model.config)
        hidden = self.decoder(input_ids=ids, attention_mask=additive_mask(allowed, self.model.dtype)[:, None],
                              position_ids=positions, cache=cache, use_cache=True).last_hidden_state[:, -1]  # (n, H)
        return cache, self.lm_head(hidden), width

    def rebuild(self, keep: list[int], new_cache_, new_width: int, new_rows: list[int], new_lengths: list[int],
                new_last: torch.Tensor) -> None:
        """Keep rows `keep` (indices into the live rows), add the prefilled new rows right-aligned
        to slot L-1, and cut the slots no remaining row sees: one copy of every layer."""
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        starts = self.starts[keep_t]  # (k,)
        length = max(self.length, new_width)
        shift = length - self.length  # the old slots move right when the new prompts are wider than L
        new_starts = torch.tensor([length - n for n in new_lengths], dtype=torch.long, device=self.device)
        all_starts = torch.cat([starts + shift, new_starts])  # (k + m,)
        front = int(all_starts.min()) if all_starts.numel() else length  # slots before it are seen by no row
        layers = self.cache.layers if self.cache is not None else [None] * len(new_cache_.layers)
        for old, new in zip(layers, new_cache_.layers if new_cache_ is not None else [None] * len(layers)):
            parts_k, parts_v = [], []
            if old is not None and keep:
                k, v = old.keys[keep_t], old.values[keep_t]  # (k, H, L, D)
                parts_k.append(torch.nn.functional.pad(k, (0, 0, shift, 0))[:, :, front:])
                parts_v.append(torch.nn.functional.pad(v, (0, 0, shift, 0))[:, :, front:])
            if new is not None:
                pad = length - new_width  # right-align: the prompts end at slot length - 1
                parts_k.append(torch.nn.functional.pad(new.keys, (0, 0, pad, 0))[:, :, front:])
                parts_v.append(torch.nn.functional.pad(new.values, (0, 0, pad, 0))[:, :, front:])
            target = old if old is not None else new
            target.set(torch.cat(parts_k), torch.cat(parts_v))
        if self.cache is None:
            self.cache = new_cache_
        self.length = length - front
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


@torch.inference_mode()
def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   eos: Sequence[int], params: SamplingParams | None = None, batch_size: int = 64,
                   generator: torch.Generator | None = None) -> Iterator[tuple[int, list[int], str]]:
    """Decode every prompt (token ids); yield (prompt index, new tokens, "stop" | "length") as
    each finishes. Up to `batch_size` rows decode together; prompts join in the given order as
    rows finish (longest first keeps the cache narrow: a joining prompt never widens it)."""
    if max_new_tokens < 1 or batch_size < 1:
        raise DraftsmithError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}: both must be >= 1")
    params = SamplingParams() if params is None else params
    eos_set = frozenset(int(t) for t in eos)
    batch, waiting = _Batch(model), list(range(len(prompts)))
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
                cache, logits, width = batch.prefill([list(prompts[i]) for i in joining])
                first = next_tokens(logits, params, generator)  # (m,) the first new token of each
            else:
                cache, width, first = None, 0, torch.zeros(0, dtype=torch.long, device=batch.device)
            batch.rebuild(keep, cache, width, joining, [len(prompts[i]) for i in joining], first)
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
