"""What engine.invariant buys and costs: speculation against plain decoding in bf16 / fp16.

    python scripts/bench/bench_invariance.py                                        # prompt lookup, MT-bench
    python scripts/bench/bench_invariance.py proposer=medusa drafter=outputs/medusa-smollm2-135m/final decode=medusa-cpu

For each dtype in `dtypes` and each engine.invariant mode in `modes` (false, rows, float64: the
two ways of making a row's logits shape-invariant, decode/forward.py), on the same prompts in one
process (the runs interleaved per prompt): plain decoding and the method, greedy and sampled at
`temperature` with the same seed (coupled sampling, so with the mode on every token must be
plain sampling's). Reports, per (dtype, mode): greedy identity with plain decoding (prompts
whose whole output is identical), same-seed agreement at T (prompts identical, and the share of
tokens equal up to the first divergence), tau and tokens/s of both and the speedup. Writes
output_dir/bench_invariance.{json,md,png}.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.decode.engine import generate, summarize
from draftsmith.decode.build import build_proposer
from draftsmith.decode.harness import prompt_ids
from draftsmith.decode.evaluate import save_plot
from draftsmith.decode.forward import invariant_mode
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import load_prompts
from draftsmith.models.verifier import load_verifier, resolve_device


def agreement(a: list[int], b: list[int]) -> float:
    """Share of the longer output that two outputs share before they first differ."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def run(cfg: DictConfig) -> dict:
    if cfg.model.dtype is not None:
        raise DraftsmithError(f"model.dtype={cfg.model.dtype} would be ignored: bench_invariance measures each of "
                              f"dtypes={list(cfg.dtypes)}; pass dtypes=[{cfg.model.dtype}] instead")
    for mode in cfg.modes:
        invariant_mode(mode)  # an unknown mode: refused before any work
    if not cfg.modes:
        raise DraftsmithError("modes=[]: give the engine.invariant modes to compare, e.g. modes=[false,rows,float64]")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = resolve_device(cfg.device)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(cfg.data)
    report = {"method": cfg.proposer.name, "drafter": cfg.drafter, "data": cfg.data.name, "prompts": len(prompts),
              "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "threads": torch.get_num_threads(),
              "load_avg_1m_before": os.getloadavg()[0], "rows": []}
    for dtype in cfg.dtypes:
        verifier = load_verifier(OmegaConf.merge(cfg.model, {"dtype": dtype}), device=device)
        run_cfg = OmegaConf.merge(cfg, {"model": {"dtype": dtype}})
        proposer, _ = build_proposer(run_cfg, verifier)
        if proposer is None:
            raise DraftsmithError(f"proposer={cfg.proposer.name} drafts nothing: pick a drafting method (this compares it "
                                  f"with plain decoding)")
        for invariant in cfg.modes:
            if invariant_mode(invariant) == "float64" and dtype in ("float32", "float64"):
                continue  # float64 mode is for bf16 / fp16 verifiers (make_forward refuses it here)
            outs = {key: [] for key in ("plain", "spec", "plain_t", "spec_t")}
            for i, prompt in enumerate(prompts):
                ids = prompt_ids(verifier.tokenizer, prompt["messages"]).to(verifier.model.device)
                for key in (("plain", "spec", "plain_t", "spec_t") if i % 2 == 0 else ("spec", "plain", "spec_t", "plain_t")):
                    sampled = key.endswith("_t")
                    kwargs = dict(temperature=cfg.temperature, acceptance="coupled",
                                  generator=torch.Generator(device=device).manual_seed(cfg.seed + i)) if sampled else {}
                    outs[key].append(generate(verifier.model, ids, proposer=proposer if key.startswith("spec") else None,
                                              max_new_tokens=cfg.max_new_tokens, invariant=invariant, **kwargs))
            pairs = list(zip(outs["plain"], outs["spec"]))
            sampled = list(zip(outs["plain_t"], outs["spec_t"]))
            plain, spec = summarize(outs["plain"]), summarize(outs["spec"])
            row = {"dtype": dtype, "invariant": invariant_mode(invariant) or "off",
                   "greedy_identical": sum(a.tokens == b.tokens for a, b in pairs) / len(pairs),
                   "sampled_identical": sum(a.tokens == b.tokens for a, b in sampled) / len(sampled),
                   "sampled_agreement": sum(agreement(a.tokens, b.tokens) for a, b in sampled) / len(sampled),
                   "tau": spec["tau"], "plain_tokens_per_s": plain["tokens_per_s"],
                   "spec_tokens_per_s": spec["tokens_per_s"], "speedup": spec["tokens_per_s"] / plain["tokens_per_s"]}
            report["rows"].append(row)
            report["load_avg_1m_after"] = os.getloadavg()[0]
            write_atomic_text(out_dir / "bench_invariance.json", json.dumps(report, indent=2))  # kept if a later one fails
            print(f"bench_invariance: {dtype} invariant={row['invariant']}: greedy identical {row['greedy_identical']:.0%}, "
                  f"T={cfg.temperature} identical {row['sampled_identical']:.0%}, {row['spec_tokens_per_s']:.1f} tok/s "
                  f"({row['speedup']:.2f}x plain)", flush=True)
        del verifier
    report["load_avg_1m_after"] = os.getloadavg()[0]
    write_atomic_text(out_dir / "bench_invariance.json", json.dumps(report, indent=2))
    table = markdown(report)
    write_atomic_text(out_dir / "bench_invariance.md", table + "\n")
    labels = [f"{r['dtype']}\n{r['invariant']}" for r in report["rows"]]

    def bars(ax):
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [100 * r["greedy_identical"] for r in report["rows"]], 0.4, label="greedy")
        ax.bar([i + 0.2 for i in x], [100 * r["sampled_identical"] for r in report["rows"]], 0.4,
               label=f"T={cfg.temperature}, same seed")
        ax.set_xticks(list(x), labels)
        ax.legend(fontsize=7)

    save_plot(out_dir / "bench_invariance.png", bars, ylabel="% prompts equal to plain decoding",
              title=f"engine.invariant, {cfg.proposer.name}")
    print(table)
    return report


def markdown(report: dict) -> str:
    lines = [f"{report['method']} on {report['data']} x{report['prompts']}, {report['max_new_tokens']} new tokens, "
             f"{report['threads']} threads, load {report['load_avg_1m_before']:.1f} -> {report['load_avg_1m_after']:.1f}",
             "", f"| dtype | engine.invariant | greedy identical to plain | T={report['temperature']} same seed: identical "
             f"| tokens agreeing | tau | plain tok/s | tok/s | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['dtype']} | {r['invariant']} | {r['greedy_identical']:.0%} | "
                     f"{r['sampled_identical']:.0%} | {r['sampled_agreement']:.1%} | {r['tau']:.2f} | "
                     f"{r['plain_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("bench_invariance", run)
