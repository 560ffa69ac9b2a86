"""Training benchmark: tokens/s and peak RSS of Medusa-1, online vs offline features, 1 vs 2
processes, and the time to reach a simulated acceptance length, measured in one run.

    python scripts/bench/bench_train.py                                   # SmolLM2, self-distilled data
    python scripts/bench/bench_train.py steps=60 target_tau=1.4 cases=[online,offline]

Each case is a real `train/medusa.py` run in a subprocess; 2-process cases go through
`accelerate launch --config_file conf/accelerate/cpu-2proc*.yaml` (DDP, DeepSpeed ZeRO-2/3).
Every case uses trainer.split_batches=true, so all train on the same global batches; peak RSS
is the sum over the case's process tree, polled.
Offline features are written once by scripts/prepare_features.py (its time is reported).
Writes output_dir/bench_train.{json,md}.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.models.entry import launch, model_overrides, run_measured
from draftsmith.models.errors import choose

ROOT = Path(__file__).resolve().parents[2]


def read_metrics(out: Path) -> dict[str, list[tuple[int, float]]]:
    rows: dict[str, list[tuple[int, float]]] = {}
    with open(out / "metrics.csv") as f:
        for r in csv.DictReader(f):
            rows.setdefault(r["key"], []).append((int(r["step"]), float(r["value"])))
    return rows


def train_args(cfg: DictConfig) -> list[str]:
    """train/medusa.py overrides every case shares: this benchmark's verifier (model.*), data, steps."""
    return [*model_overrides(cfg.model), f"data={cfg.dataset}", f"trainer.max_steps={cfg.steps}",
            f"trainer.eval_every={cfg.eval_every}", f"trainer.save_every={cfg.steps}", "trainer.resume=false",
            f"method.lm_head={cfg.lm_head}", "logger=csv", *cfg.overrides]


def run(cfg: DictConfig) -> dict:
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "offline"}
    common = train_args(cfg)
    report = {"steps": cfg.steps, "batch_size": cfg.batch_size, "target_tau": cfg.target_tau, "cases": {},
              "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    features = out_dir / "features"
    if any(name.startswith("offline") for name in cfg.cases):
        seconds, rss = run_measured([sys.executable, "scripts/prepare_features.py", *model_overrides(cfg.model),
                                     f"data={cfg.dataset}",
                                     f"dtype={cfg.feature_dtype}", f"output_dir={features}",
                                     *[o for o in cfg.overrides if o.startswith(("model.", "data."))]], env)
        report["prepare_features"] = {"seconds": seconds, "peak_rss_gb": rss}
    def launch2(config: str) -> list[str]:
        return ["accelerate", "launch", "--config_file", f"conf/accelerate/{config}", "train/medusa.py"]

    one = [sys.executable, "train/medusa.py"]
    cases = {  # name -> (launcher, extra overrides, extra env); every case trains on the same global batches
        "online": (one, [], {}),
        "offline": (one, [f"data.features={features}"], {}),
        "online-2proc": (launch2("cpu-2proc.yaml"), [], {"ACCELERATE_USE_CPU": "1"}),
        "offline-2proc": (launch2("cpu-2proc.yaml"), [f"data.features={features}"], {"ACCELERATE_USE_CPU": "1"}),
        "online-zero2-2proc": (launch2("cpu-2proc-zero2.yaml"), [], {}),
        "online-zero3-2proc": (launch2("cpu-2proc-zero3.yaml"), [], {}),
        # the same pair with a reduced draft vocabulary: the heads' V x h projections shrink 6x
        "online-vocab8k": (one, ["method.draft_vocab_size=8192"], {}),
        "offline-vocab8k": (one, ["method.draft_vocab_size=8192", f"data.features={features}"], {}),
    }
    for name in cfg.cases:
        launcher, extra, extra_env = choose(cases, name, "cases[]")
        run_dir = out_dir / name
        seconds, rss = run_measured([*launcher, *common, f"trainer.batch_size={cfg.batch_size}",
                                     "trainer.split_batches=true", *extra, f"output_dir={run_dir}"],
                                    {**env, **extra_env})
        metrics = read_metrics(run_dir)
        tau = metrics.get("eval/simulated_tau", [])
        elapsed = dict(metrics.get("time/elapsed_s", []))
        reached = next((elapsed.get(s) for s, v in tau if v >= cfg.target_tau), None)
        report["cases"][name] = {"tokens_per_s": metrics["train/tokens_per_s"][-1][1], "wall_s": seconds,
                                 "peak_rss_gb": rss, "final_simulated_tau": tau[-1][1] if tau else None,
                                 "seconds_to_target_tau": reached}
    for name, case in report["cases"].items():  # against the online case of the same heads
        base = report["cases"].get("online-vocab8k" if name.endswith("vocab8k") else "online", {}).get("tokens_per_s")
        case["vs_online"] = case["tokens_per_s"] / base if base else None
    (out_dir / "bench_train.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "bench_train.md").write_text(table + "\n")
    print(table)
    return report


def markdown(report: dict) -> str:
    lines = [f"{report['steps']} steps, global batch {report['batch_size']}, {report['cpus']} CPUs, "
             f"load {report['load_avg_1m']:.1f}", ""]
    if "prepare_features" in report:
        p = report["prepare_features"]
        lines += [f"prepare_features: {p['seconds']:.0f} s, peak RSS {p['peak_rss_gb']:.2f} GB", ""]
    lines += [f"| case | train tokens/s | vs online | peak RSS GB | final simulated tau | s to tau >= {report['target_tau']} |",
              "|---|---|---|---|---|---|"]
    for name, c in report["cases"].items():
        reached = "not reached" if c["seconds_to_target_tau"] is None else f"{c['seconds_to_target_tau']:.0f}"
        lines.append(f"| {name} | {c['tokens_per_s']:.0f} | {c['vs_online'] or float('nan'):.2f}x | {c['peak_rss_gb']:.2f} | "
                     f"{c['final_simulated_tau']:.2f} | {reached} |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("bench_train", run)
