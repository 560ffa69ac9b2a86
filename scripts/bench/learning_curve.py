"""Learning curves: how acceptance grows with training, per method, from the snapshots a
training run saved (trainer.snapshot_every=N writes output_dir/snapshots/step-N).

    python train/eagle.py method=eagle3 data=mix trainer=cpu-long output_dir=outputs/long/eagle3
    python scripts/bench/learning_curve.py runs.eagle3=outputs/long/eagle3

For every snapshot: the held-out tau the trainer measured (its meta.json metrics, with the
training tokens and seconds so far: the simulated acceptance length of Medusa / EAGLE heads,
or a draft model's chain tau from its greedy agreement, `HELD_OUT`) and the real greedy decode tau on `dataset`
(one decode/evaluate.py run, plain decoding interleaved; a snapshot already evaluated with the
same settings is reused). Writes output_dir/learning_curve.{json,md} and learning_curve.png
(tau against training tokens, and against training hours).
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftsmith.decode.evaluate import evaluate_config
from draftsmith.decode.evaluate import run as evaluate
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import resolve_device


HELD_OUT = ("eval/simulated_tau", "eval/chain_tau_greedy")  # heads / EAGLE; a draft model's greedy chain


def held_out(metrics: dict) -> tuple[str | None, float | None]:
    """The snapshot's held-out tau: (metric name, value), or (None, None) if it logged none."""
    key = next((k for k in HELD_OUT if k in metrics), None)
    return key, (metrics[key] if key else None)


def snapshots(run_dir: Path) -> list[Path]:
    found = sorted((run_dir / "snapshots").glob("step-*"))
    if not found:
        raise DraftsmithError(f"{run_dir}/snapshots has no step-* folders; train with trainer.snapshot_every=N "
                              f"(a multiple of trainer.eval_every) into output_dir={run_dir}")
    return found


def decode_tau(cfg: DictConfig, name: str, snap: Path, out: Path) -> dict:
    """The greedy decode report of one snapshot (reused when out/results.json has the same settings)."""
    cell = snapshot_config(cfg, name, snap, out)
    want = OmegaConf.to_yaml(cell, resolve=True)
    done = out / "cell.yaml"
    if done.is_file() and done.read_text() == want and (out / "results.json").is_file():
        return json.loads((out / "results.json").read_text())
    report = evaluate(cell)
    done.write_text(want)
    return report


def snapshot_config(cfg: DictConfig, name: str, snap: Path, out: Path) -> DictConfig:
    """The evaluate config that decodes one snapshot: this run's `model` node (model.dtype too)."""
    return evaluate_config([f"hw={cfg.hw.name}", *str(choose(cfg.decode, name, "decode")).split(), f"drafter={snap}", f"data={cfg.dataset}",
                            f"data.num_prompts={cfg.num_prompts}", f"max_new_tokens={cfg.max_new_tokens}",
                            "temperature=0.0", "hf.enabled=false", f"device={resolve_device(cfg.device)}",
                            f"threads={cfg.threads or 'null'}", f"output_dir={out}"], model=cfg.model)


def run(cfg: DictConfig) -> dict:
    resolve_device(cfg.device)  # a device this torch cannot use: refused before any work
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {name: Path(str(d)) for name, d in OmegaConf.to_container(cfg.runs).items() if d is not None}
    if not runs:
        raise DraftsmithError("no runs given; pass runs.<method>=<training output_dir>, e.g. "
                              "runs.eagle3=outputs/long/eagle3")
    report = {"dataset": cfg.dataset, "num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens,
              "dtype": cfg.model.dtype, "runs": {}}
    for name, run_dir in runs.items():
        points = []
        for snap in snapshots(run_dir):
            metrics = json.loads((snap / "meta.json").read_text())["metrics"]
            decoded = decode_tau(cfg, name, snap, out_dir / name / snap.name)
            method = next(m for m in decoded["methods"] if m not in ("vanilla",) and not m.startswith("hf"))
            stats = decoded["methods"][method]
            key, tau = held_out(metrics)
            points.append({"step": metrics["step"], "tokens": metrics["tokens"], "seconds": metrics["seconds"],
                           "held_out_tau": tau, "held_out_metric": key, "decode_tau": stats["tau"],
                           "speedup": stats["speedup"], "snapshot": str(snap)})
            print(f"learning_curve: {name} step {points[-1]['step']}: {points[-1]['tokens']:,} tokens, "
                  f"held-out tau {fmt(tau)} ({key}), decode tau {stats['tau']:.2f}", flush=True)
        report["runs"][name] = {"run_dir": str(run_dir), "points": points}
    (out_dir / "learning_curve.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "learning_curve.md").write_text(table + "\n")
    plot(report, out_dir / "learning_curve.png")
    print(table)
    return report


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(report: dict) -> str:
    lines = [f"{report['dataset']}, {report['num_prompts']} prompts, greedy, {report['max_new_tokens']} new tokens, "
             f"{report['dtype']}; held-out tau: {' | '.join(HELD_OUT)}", "",
             "| run | step | training tokens | training h | held-out tau | decode tau | speedup |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        for p in r["points"]:
            lines.append(f"| {name} | {p['step']} | {p['tokens']:,} | {p['seconds'] / 3600:.2f} | "
                         f"{fmt(p['held_out_tau'])} | {p['decode_tau']:.2f} | {p['speedup']:.2f}x |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for name, r in report["runs"].items():
        pts = r["points"]
        for ax, x in zip(axes, ([p["tokens"] / 1e6 for p in pts], [p["seconds"] / 3600 for p in pts])):
            line, = ax.plot(x, [p["decode_tau"] for p in pts], marker="o", label=f"{name} decode")
            ax.plot(x, [p["held_out_tau"] for p in pts], ls="--", color=line.get_color(), label=f"{name} held-out")
    axes[0].set(xlabel="training tokens (M)", ylabel="tau (tokens per verifier step)")
    axes[1].set(xlabel="training hours (this machine)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{report['dataset']} greedy decode tau (solid) and held-out tau (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    launch("learning_curve", run)
