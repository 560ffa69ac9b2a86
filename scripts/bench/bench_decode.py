"""Decoding benchmark: verify cost T(k), tau, wall speedup, the cost-model ceiling, efficiency.

    python scripts/bench/bench_decode.py drafter=outputs/medusa-smollm2-135m/final
    python scripts/bench/bench_decode.py drafter=... dtypes=[float32] data.num_prompts=16 decode=chain4

For each dtype in `dtypes`, in one process on the same prompts:
  1. T(k): the verifier's forward over k new tokens on top of a `cache_len`-token KV cache
     (median of `repeats`), for k in `ks`; reported as T(k)/T(1).
  2. decode/evaluate.run: plain vs speculative decoding through the same engine, interleaved,
     plus HF generate (plain and prompt lookup) -> tau, tokens/s, speedup.
  3. ceiling = tau * T(1) / (T(verify tree) + T(proposal)), from the same run's per-step
     timings; efficiency = speedup / ceiling (how much of the cost model the engine delivers).
Every speedup is also quoted against plain decoding in its FASTEST dtype on this machine (with
`hf.static_cache=true`, HF generate's StaticCache + torch.compile path also competes).
Writes output_dir/bench_decode.{json,md} and verify_cost.png.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import DynamicCache

from draftsmith.decode import evaluate
from draftsmith.decode.build import check_drafter
from draftsmith.decode.engine import sync_device
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import load_verifier, resolve_device


# Plain decoders that compete for "the fastest plain decoding": the engine without a drafter, and
# HF generate's StaticCache + torch.compile path when hf.static_cache=true (as in compare.py).
PLAIN = ("vanilla", "hf_generate_static")


@torch.inference_mode()
def verify_cost(model, cache_len: int, ks: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one decoder forward over k new tokens after a cache_len-token prefix."""
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (1, cache_len), generator=g).to(model.device)
    times: dict[int, float] = {}
    for k in ks:
        samples = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cache = DynamicCache(config=model.config)
            decoder(input_ids=prefix, cache=cache, use_cache=True)
            new = torch.randint(0, model.config.vocab_size, (1, k), generator=g).to(model.device)
            sync_device(model.device)
            t0 = time.perf_counter()
            lm_head(decoder(input_ids=new, cache=cache, use_cache=True).last_hidden_state)
            sync_device(model.device)
            samples.append(time.perf_counter() - t0)
        times[k] = statistics.median(samples[1:])
    return times


def run(cfg: DictConfig) -> dict:
    if cfg.model.dtype is not None:  # each run's dtype comes from dtypes: a model.dtype would be ignored
        raise DraftsmithError(f"model.dtype={cfg.model.dtype} would be ignored: bench_decode measures each of "
                              f"dtypes={list(cfg.dtypes)}; pass dtypes=[{cfg.model.dtype}] instead")
    check_drafter(cfg)  # before the verify-cost measurement, not after it
    device = resolve_device(cfg.device)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    report = {"device": str(device), "threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
              "cache_len": cfg.cache_len,
              "decode_tree": cfg.decode.name, "data": cfg.data.name, "num_prompts": cfg.data.num_prompts,
              "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "by_dtype": {}}
    for dtype in cfg.dtypes:
        run_cfg = OmegaConf.merge(cfg, {"model": {"dtype": dtype}, "output_dir": str(out_dir / f"eval-{dtype}")})
        model = load_verifier(run_cfg.model, device=device).model
        cost = verify_cost(model, cfg.cache_len, list(cfg.ks), cfg.repeats)
        del model
        ev = evaluate.run(run_cfg)
        methods = ev["methods"]
        plain = methods["vanilla"]
        entry = {"T1_ms": 1000 * cost[1], "T_ratio": {str(k): cost[k] / cost[1] for k in cost}, "methods": methods}
        spec_name = next((m for m in methods if m not in ("vanilla",) and not m.startswith("hf_")), None)
        if spec_name is not None:
            spec = methods[spec_name]
            # Per-step timings of the same run: T(1) from plain steps, T(tree) and T(draft) from ours.
            ceiling = spec["tau"] * plain["mean_verify_s"] / (spec["mean_verify_s"] + spec["mean_propose_s"])
            entry.update(method=spec_name, tau=spec["tau"], speedup=spec["speedup"], ceiling=ceiling,
                         efficiency=spec["speedup"] / ceiling, tree_nodes=spec["mean_nodes"])
        report["by_dtype"][dtype] = entry
    best_plain = max(m["tokens_per_s"] for e in report["by_dtype"].values()  # ours, or HF's static path if timed
                     for name, m in e["methods"].items() if name in PLAIN)
    report["fastest_plain_tokens_per_s"] = best_plain
    for entry in report["by_dtype"].values():
        for m in entry["methods"].values():
            m["speedup_vs_fastest_plain"] = m["tokens_per_s"] / best_plain
    (out_dir / "bench_decode.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "bench_decode.md").write_text(table + "\n")
    plot(report, out_dir)
    print(table)
    return report


def markdown(report: dict) -> str:
    lines = [f"device={report.get('device', 'cpu')}, threads={report['threads']}, load={report['load_avg_1m']:.1f}, "
             f"cache={report['cache_len']} tokens, "
             f"tree={report['decode_tree']}, data={report['data']} x{report['num_prompts']}, "
             f"T={report['temperature']}, max_new_tokens={report['max_new_tokens']}", "",
             "| dtype | T(1) ms | " + " | ".join(f"T({k})/T(1)" for k in next(iter(report['by_dtype'].values()))['T_ratio']
                                               if k != "1") + " |",
             "|---|---|" + "---|" * (len(next(iter(report['by_dtype'].values()))['T_ratio']) - 1)]
    for dtype, e in report["by_dtype"].items():
        lines.append(f"| {dtype} | {e['T1_ms']:.1f} | " + " | ".join(f"{v:.2f}" for k, v in e["T_ratio"].items()
                                                                       if k != "1") + " |")
    lines += ["", "| dtype | method | tau | tokens/s | speedup (same dtype) | speedup vs fastest plain | ceiling | efficiency |",
              "|---|---|---|---|---|---|---|---|"]
    for dtype, e in report["by_dtype"].items():
        for name, m in e["methods"].items():
            is_spec = name == e.get("method")
            lines.append(f"| {dtype} | {name} | {m['tau']:.2f} | " if "tau" in m else f"| {dtype} | {name} | – | ")
            lines[-1] += (f"{m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {m['speedup_vs_fastest_plain']:.2f}x | "
                          + (f"{e['ceiling']:.2f}x | {e['efficiency']:.2f} |" if is_spec else "– | – |"))
    return "\n".join(lines)


def plot(report: dict, out_dir: Path) -> None:
    def draw(ax):
        for dtype, e in report["by_dtype"].items():
            ks = [int(k) for k in e["T_ratio"]]
            ax.plot(ks, list(e["T_ratio"].values()), marker="o", label=f"{dtype} (T(1)={e['T1_ms']:.0f} ms)")
        ax.legend()

    evaluate.save_plot(out_dir / "verify_cost.png", draw, xscale="log", ylabel="T(k) / T(1)",
                       xlabel="tokens verified in one forward (k)",
                       title=f"verify cost on a {report['cache_len']}-token cache")


if __name__ == "__main__":
    launch("bench_decode", run)
