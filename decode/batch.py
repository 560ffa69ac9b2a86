"""Batched plain decoding for throughput (self-distillation, data generation): the verifier's
own law, many sequences at once, no drafter: the engine (decode/engine.py) with plain rows.

    for index, tokens, finish in generate_batch(model, prompts, max_new_tokens=256, eos=[2],
                                                params=SamplingParams(), batch_size=64): ...

Up to `batch_size` rows decode together, one verifier forward a step; prompts join in the given
order as rows finish, read in chunks beside the rows that decode. The prompts' common prefix (a
chat template's system prompt: about half of every chit-chat prompt's tokens) is read once
(``share_prefix``): a joining row copies its keys / values and reads only its own suffix. Greedy
rows are the verifier's argmax decoding up to the dtype's rounding of a batched forward (a bf16
batch rounds differently from one row); sampling draws each row from logits_to_probs (float64)
by inverse CDF, uniforms from ``generator``. A row that stops (EOS, included as in HF generate,
or max_new_tokens) is yielded at once.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from draftsmith.decode.engine import Engine
from draftsmith.decode.sampling import SamplingParams
from draftsmith.models.errors import DraftsmithError


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
                   generator: torch.Generator | None = None, share_prefix: bool = True, forward: str = "auto",
                   prefill_chunk: int = 2048) -> Iterator[tuple[int, list[int], str]]:
    """Decode every prompt (token ids); yield (prompt index, new tokens, "stop" | "length") as
    each finishes. share_prefix: read the prompts' common prefix once."""
    if max_new_tokens < 1 or batch_size < 1:
        raise DraftsmithError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}: both must be >= 1")
    if not prompts:
        return
    params = SamplingParams() if params is None else params
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = Engine(model, max_num_seqs=batch_size, max_len=longest + 2, forward=forward, prefill_chunk=prefill_chunk)
    if share_prefix:
        engine.set_prefix(common_prefix(prompts))
    index = {}
    for i, prompt in enumerate(prompts):
        request = engine.add(prompt, max_new_tokens=max_new_tokens, temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, eos_token_id=list(eos), generator=generator)
        index[id(request)] = i
    while engine.busy:
        for request in engine.step():
            yield index[id(request)], request.out, "stop" if request.stop.reason == "eos" else "length"
