"""Self-distillation benchmark: new tokens/s of each generation backend on the same prompts,
measured in one run (each case a fresh `scripts/generate_selfdistill.py` process).

    python scripts/bench/bench_selfdistill.py                             # the cases in conf/bench_selfdistill.yaml
    python scripts/bench/bench_selfdistill.py num_prompts=32 cases=[hf-fp32-b16,batched-bf16-b64]

A case listed in `processes` runs under `accelerate launch` with that many CPU processes
(conf/accelerate/cpu-2proc.yaml, ACCELERATE_USE_CPU=1), the `threads` split between them; its
tok/s is every process's new tokens over the slowest process's time (the run's manifest).

Writes output_dir/bench_selfdistill.{json,md} and bench_selfdistill.png (tok/s per case).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.decode.evaluate import save_plot
from draftsmith.models.entry import launch, run_measured
from draftsmith.models.errors import DraftsmithError, choose


def run(cfg: DictConfig) -> dict:
    cases = {name: str(choose(cfg.table, name, "cases[]")).split() for name in cfg.cases}
    if cfg.baseline not in cases:
        raise DraftsmithError(f"baseline={cfg.baseline!r} is not one of cases ({', '.join(cases)}); name one of them")
    for name, n in cfg.processes.items():
        choose(cfg.table, name, "processes")  # a key that names no case would be ignored: refuse it
        if int(n) < 1 or int(n) > int(cfg.threads):
            raise DraftsmithError(f"processes.{name}={n}: must be 1..threads ({cfg.threads}), one thread each at least")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)}
    report = {"num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens, "threads": cfg.threads,
              "cpus": os.cpu_count(), "load_avg_1m_before": os.getloadavg()[0], "cases": {}}
    for name, overrides in cases.items():
        data_dir = out_dir / name
        shutil.rmtree(data_dir, ignore_errors=True)  # a fresh run, never a resume
        processes = int(cfg.processes.get(name, 1))
        launcher, case_env = [sys.executable], env
        if processes > 1:
            launcher = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml",
                        "--num_processes", str(processes), "--main_process_port", str(cfg.port)]
            per_process = str(max(1, int(cfg.threads) // processes))
            case_env = {**env, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": per_process, "MKL_NUM_THREADS": per_process}
        cmd = [*launcher, "scripts/generate_selfdistill.py", f"model={cfg.verifier}",
               f"data@data.prompts={cfg.prompts}", f"num_prompts={cfg.num_prompts}",
               f"max_new_tokens={cfg.max_new_tokens}", f"output_dir={data_dir}", *overrides]
        wall, rss = run_measured(cmd, case_env)
        counts = json.loads((data_dir / "manifest.json").read_text())["counts"]
        report["cases"][name] = {"overrides": overrides, "processes": processes, "wall_s": wall, "peak_rss_gb": rss,
                                 "records": counts["records"], "truncated": counts["truncated"],
                                 **counts["throughput"]}
        print(f"bench_selfdistill: {name}: {counts['throughput']['tokens_per_s']:.1f} tok/s", flush=True)
    base = report["cases"][cfg.baseline]["tokens_per_s"]
    for case in report["cases"].values():
        case["vs_baseline"] = case["tokens_per_s"] / base if base else None
    report["load_avg_1m_after"] = os.getloadavg()[0]
    report["baseline"] = cfg.baseline
    (out_dir / "bench_selfdistill.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "bench_selfdistill.md").write_text(table + "\n")
    names = list(report["cases"])
    save_plot(out_dir / "bench_selfdistill.png",
              lambda ax: ax.barh(names, [report["cases"][n]["tokens_per_s"] for n in names]),
              xlabel="new tokens / s", title=f"self-distillation, {cfg.num_prompts} prompts x {cfg.max_new_tokens}")
    print(table)
    return report


def markdown(report: dict) -> str:
    lines = [(f"{report['num_prompts']} prompts, max_new_tokens {report['max_new_tokens']}, "
              f"{report['threads']} threads on {report['cpus']} CPUs, load {report['load_avg_1m_before']:.1f} before "
              f"/ {report['load_avg_1m_after']:.1f} after"), "",
             f"| case | processes | new tokens | s | tok/s | vs {report['baseline']} | peak RSS GB | hit max_new_tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in report["cases"].items():
        lines.append(f"| {name} | {c.get('processes', 1)} | {c['new_tokens']} | {c['seconds']:.0f} | {c['tokens_per_s']:.1f} | "
                     f"{c['vs_baseline']:.2f}x | {c['peak_rss_gb']:.2f} | {c['truncated']}/{c['records']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("bench_selfdistill", run)
