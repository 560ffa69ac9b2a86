"""The evaluation harness: every decoder on the same prompts, interleaved, with the same seeds.

    for i, s, seed, outs in interleaved(model, prompts_ids, {"vanilla": None, "eagle": proposer}, ...):
        compare_greedy(model, prompts_ids[i][0].tolist(), outs["eagle"].tokens, outs["vanilla"].tokens, tol)

Each prompt is decoded by every decoder in turn (name -> proposer, None = plain decoding), the one
that goes first rotating with the prompt (none always meets a warm or a cold machine), each sample
seeded the same for all, so their speeds are measured side by side in one run and their outputs are
comparable token for token. decode/evaluate.py (the report, HF's baselines, plots) and
scripts/bench/tune_decode.py (tree candidates) both run it; here too: the greedy comparison with plain
decoding (ties in reduced precision), per-token latencies and each decoder's statistics.
"""
from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm

from draftsmith.decode.engine import generate, summarize


def prompt_ids(tokenizer, messages) -> torch.Tensor:
    """(1, T) ids exactly as fed to the verifier: the chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([ids["input_ids"]], dtype=torch.long)


def plain_rule(acceptance: str) -> str:
    """Plain decoding's rule beside a method's: coupled sampling stays coupled (then the same seed
    draws the same tokens, and any difference would be a loss), anything else is auto."""
    return "coupled" if acceptance == "coupled" else "auto"


def interleaved(model, prompts_ids: list[torch.Tensor], runs: dict, *, num_samples: int, seed: int,
                max_new_tokens: int, temperature: float, top_k: int, top_p: float, acceptance: str = "auto",
                forward: str = "auto", invariant=False, weights: str = "auto", budget: str = "fixed",
                desc: str = "evaluate"):
    """Yield (prompt index, sample index, sample seed, {name: GenerateOutput}) for every prompt
    (prompts_ids: (1, T) each) and sample: each decoder of `runs` on the same ids, generator seeded
    the same, the order rotating with the prompt; plain decoding keeps coupled sampling (plain_rule);
    `budget` (engine.budget) is the drafting runs'."""
    names = list(runs)
    for i, ids in enumerate(tqdm(prompts_ids, desc=desc)):
        order = names[i % len(names):] + names[: i % len(names)]  # rotate who goes first
        for s in range(num_samples):
            sample_seed = seed * 1_000_003 + i * 1_009 + s
            outs = {}
            for name in order:
                gen = torch.Generator(device=model.device).manual_seed(sample_seed)
                outs[name] = generate(model, ids, proposer=runs[name], max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, top_k=top_k, generator=gen,
                                      acceptance=plain_rule(acceptance) if runs[name] is None else acceptance,
                                      forward=forward, invariant=invariant, weights=weights,
                                      budget="fixed" if runs[name] is None else budget)
            yield i, s, sample_seed, {name: outs[name] for name in names}


def tie_tolerance(dtype: torch.dtype, logits: torch.Tensor, base: float, ulps: float) -> float:
    """Largest logit gap still called a numerical tie in this dtype.

    fp32: `base` (1e-4). bf16/fp16: the verifier's kernels for a 1-token and an n-token forward
    round differently, so two decoders can legitimately flip a near-tie; a gap within `ulps`
    rounding units of the dtype at the logits' magnitude is such a flip."""
    if dtype in (torch.float32, torch.float64):
        return base
    return max(base, ulps * torch.finfo(dtype).eps * float(logits.abs().max()))


def compare_greedy(model, ids: list[int], ours: list[int], reference: list[int], tol: float,
                   ulps: float = 2.0) -> dict:
    """Identical, or where the first divergence is and whether it is a numerical tie."""
    n = min(len(ours), len(reference))
    first = next((i for i in range(n) if ours[i] != reference[i]), None)
    if first is None:
        return {"identical": len(ours) == len(reference), "diverged_at": None if len(ours) == len(reference) else n}
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + ours[:first]], device=model.device)).logits[0, -1]  # (V,)
    pair = logits[[ours[first], reference[first]]].float()  # (2,)
    gap = float((pair[0] - pair[1]).abs())
    tol = tie_tolerance(logits.dtype, pair, tol, ulps)
    return {"identical": False, "diverged_at": first, "logit_gap": gap, "tie_tolerance": tol, "tie": gap <= tol}


def token_latencies(output) -> list[float]:
    """Per emitted token: its step's wall time divided by the tokens that step emitted."""
    lat = [output.prefill_s]  # the first token comes from the prefill
    for step in output.steps:
        lat += [step.time_s / step.emitted] * step.emitted if step.emitted else []
    return lat


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def method_stats(outputs, latencies, max_depth: int) -> dict:
    stats = summarize(outputs)
    steps = [s for o in outputs for s in o.steps]
    stats["latency_median_ms"] = 1000 * statistics.median(latencies) if latencies else float("nan")
    stats["latency_p99_ms"] = 1000 * percentile(latencies, 0.99)
    stats["accept_length_hist"] = {str(k): sum(s.emitted == k for s in steps) for k in range(1, max_depth + 2)}
    # P(accepted depth >= d) per step: how deep into the tree the verifier follows the draft.
    stats["accepted_per_depth"] = [sum(s.accepted >= d for s in steps) / max(len(steps), 1)
                                   for d in range(1, max_depth + 1)]
    return stats
