"""Where a verifier step's time goes: HF's eager forward against the engine's own (decode/forward.py).

    python scripts/bench/profile_step.py                                   # SmolLM2, bf16 + fp32, 1 and 16 tokens
    python scripts/bench/profile_step.py dtypes=[bfloat16] tokens=[1,8,32] cache_len=512
    python scripts/bench/profile_step.py dtypes=[bfloat16] forwards=[packed] batch=[1,16] tokens=[1]

For each forward (hf: the HF decoder over the static cache, what the engine ran before; fast:
the Llama-family forward; compiled: fast under torch.compile when compile=true) x dtype x
rows x tokens per step: the median step time over `repeats` steps on a `cache_len`-token cache, with
the lm_head over the step's tokens, and torch.profiler's top operators by self CPU time for one
step. Writes output_dir/profile_step.{json,md}.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.decode.engine import batch_inputs, chain_tree, sync_device
from draftsmith.decode.forward import make_forward
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import load_verifier, resolve_device

KINDS = {"hf": ("hf", "plain"), "fast": ("fast", "plain"), "packed": ("fast", "packed"), "compiled": ("fast", "plain")}


def step_fn(model, kind: str, tokens: int, cache_len: int, rows: int = 1):
    """A closure running one verify step of `tokens` tokens in each of `rows` rows, each over its
    own `cache_len`-token cache."""
    name, weights = KINDS[kind]
    forward = make_forward(model, name, max_rows=rows, max_len=cache_len + tokens + 64,
                           compile="inductor" if kind == "compiled" else "none", weights=weights)
    device = model.device
    for row in range(rows):  # each row's own prompt read into its cache row
        prompt = chain_tree(torch.randint(0, 1000, (cache_len,)).tolist(), device)
        first = batch_inputs([prompt], [0], cache_len, device)
        forward(first.tokens, first.positions, first.slots, first.allowed(cache_len),
                torch.tensor([row], device=device), cache_len)
    trees = [chain_tree(torch.randint(0, 1000, (tokens,)).tolist(), device) for _ in range(rows)]
    inputs = batch_inputs(trees, [cache_len] * rows, tokens, device)
    length = cache_len + tokens
    allowed = inputs.allowed(length)

    def step():
        hidden, _ = forward(inputs.tokens, inputs.positions, inputs.slots, allowed, rows, length)
        forward.logits(hidden.reshape(-1, hidden.shape[-1]))  # the lm_head as the engine runs it
        sync_device(device)
    return step


def measure(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def top_ops(step, n: int = 8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in rows[:n]]


def run(cfg: DictConfig) -> dict:
    if cfg.model.dtype is not None:
        raise DraftsmithError(f"model.dtype={cfg.model.dtype} would be ignored: profile_step measures each of "
                              f"dtypes={list(cfg.dtypes)}; pass dtypes=[{cfg.model.dtype}] instead")
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    for kind in cfg.forwards:
        choose(KINDS, kind, "forwards[]")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"model": cfg.model.name, "device": str(device), "threads": torch.get_num_threads(),
              "load_avg_1m": os.getloadavg()[0], "cache_len": cfg.cache_len, "rows": []}
    for dtype in cfg.dtypes:
        verifier = load_verifier(OmegaConf.merge(cfg.model, {"dtype": dtype}), device=device)
        with torch.inference_mode():
            for rows in cfg.batch:
                for tokens in cfg.tokens:
                    for kind in cfg.forwards:
                        try:
                            step = step_fn(verifier.model, kind, int(tokens), int(cfg.cache_len), int(rows))
                        except DraftsmithError as e:  # packed weights this CPU / device cannot run: a row says so
                            if kind != "packed":
                                raise
                            report["rows"].append({"forward": kind, "dtype": dtype, "batch": int(rows),
                                                   "tokens": int(tokens), "ms": None, "top_ops": []})
                            print(f"profile_step: packed {dtype}: not here ({e})", flush=True)
                            continue
                        seconds = measure(step, int(cfg.repeats))
                        row = {"forward": kind, "dtype": dtype, "batch": int(rows), "tokens": int(tokens),
                               "ms": 1000 * seconds, "top_ops": top_ops(step)}
                        report["rows"].append(row)
                        print(f"profile_step: {kind} {dtype} {rows} rows x {tokens} tokens: {1000 * seconds:.1f} ms",
                              flush=True)
        del verifier
    write_atomic_text(out_dir / "profile_step.json", json.dumps(report, indent=2))
    table = markdown(report)
    write_atomic_text(out_dir / "profile_step.md", table + "\n")
    print(table)
    return report


def markdown(report: dict) -> str:
    lines = [f"{report['model']} on {report['device']}, {report['threads']} threads, load {report['load_avg_1m']:.1f}, "
             f"cache {report['cache_len']} tokens per row; one verify step (forward + lm_head), median", "",
             "| forward | dtype | rows | tokens per row | ms / step | top operators (self CPU share) |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ops = ", ".join(f"{o['op']} {o['share']:.0%}" for o in r["top_ops"][:4])
        ms = "not here" if r["ms"] is None else f"{r['ms']:.1f}"
        lines.append(f"| {r['forward']} | {r['dtype']} | {r['batch']} | {r['tokens']} | {ms} | {ops} |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("profile_step", run)
