"""EAGLE-3 against P-EAGLE, each with and without the LK loss: the table of experiment=compare-peagle.

    python scripts/bench/peagle_summary.py cmp_dir=outputs/peagle-cmp

Reads what the recipe wrote under cmp_dir: the comparison (compare/compare.json and each cell's
results.json: tau, the drafter's and the verifier's mean milliseconds per step, nodes per step,
the speedup against plain decoding in the same cell and against the fastest plain decoding timed
alone) and the learning curves (curves/learning_curve.json: held-out simulated tau against training
tokens, and each snapshot's decode tau). Writes cmp_dir/peagle.{md,json} with both tables and the
recipe's two targets checked per dataset: P-EAGLE's speedup above EAGLE-3's at the same budget, and
the LK loss's tau at or above the soft cross-entropy's.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError


def read_json(cmp_dir: str, name: str, what: str) -> dict:
    """cmp_dir/name, which the recipe wrote; missing: one line naming it and the command that writes it."""
    path = Path(cmp_dir) / name
    if not path.is_file():
        raise DraftsmithError(f"cmp_dir={cmp_dir}: no {name} ({what}); run python scripts/experiment.py "
                              f"experiment=compare-peagle out={cmp_dir} first")
    return json.loads(path.read_text())


def cells(cfg: DictConfig, compare: dict) -> list[dict]:
    """One row per method x dataset (greedy): compare.json's figures and the cell's step timings."""
    out = []
    for r in compare["rows"]:
        if r["method"] not in cfg.methods or r["temperature"] != 0.0:
            continue
        cell = read_json(cfg.cmp_dir, f"compare/{r['method']}-{r['dataset']}-T0.0/results.json", "a comparison cell")
        stats = next(v for k, v in cell["methods"].items() if k != "vanilla" and not k.startswith("hf_"))
        out.append({"method": r["method"], "dataset": r["dataset"], "tau": r["tau"],
                    "draft_ms": 1000 * stats["mean_propose_s"], "verify_ms": 1000 * stats["mean_verify_s"],
                    "nodes": stats["mean_nodes"], "speedup": r["speedup"],
                    "vs_fastest_plain": r.get("vs_fastest_plain"), "greedy_identity_rate": r["greedy_identity_rate"],
                    "unexplained_divergences": r["unexplained_divergences"]})
    datasets = list(dict.fromkeys(c["dataset"] for c in out))
    missing = [m for m in cfg.methods if not all(any(c["method"] == m and c["dataset"] == d for c in out)
                                                 for d in datasets or [None])]
    if missing:
        raise DraftsmithError(f"cmp_dir={cfg.cmp_dir}: compare/compare.json has no greedy cells of {missing} on "
                              f"datasets {datasets}; rerun step compare of experiment=compare-peagle")
    return out


def targets(cfg: DictConfig, rows: list[dict]) -> list[dict]:
    """The recipe's targets per dataset: (a, b, metric) with a's value > (or >=) b's."""
    for field in ("parallel_vs_sequential", "lk_vs_ce"):
        unknown = [m for pair in cfg[field].items() for m in pair if m not in cfg.methods]
        if unknown:
            raise DraftsmithError(f"{field}={dict(cfg[field])} names {unknown}, not in methods={list(cfg.methods)}; "
                                  f"add them to methods or drop the pair")
    by = {(r["method"], r["dataset"]): r for r in rows}
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        for a, b, metric, strict in [*[(p, e, "vs_fastest_plain", True) for p, e in cfg.parallel_vs_sequential.items()],
                                     *[(lk, ce, "tau", False) for lk, ce in cfg.lk_vs_ce.items()]]:
            x, y = by[(a, dataset)][metric], by[(b, dataset)][metric]
            met = x is not None and y is not None and (x > y if strict else x >= y)
            out.append({"dataset": dataset, "a": a, "b": b, "metric": metric, "a_value": x, "b_value": y,
                        "met": bool(met)})
    return out


def fmt(x: float | None, spec: str, unit: str = "") -> str:
    """A figure, or "-" where there is none (no plain cells timed alone: no vs_fastest_plain)."""
    return "-" if x is None else f"{x:{spec}}{unit}"


def setup(compare: dict) -> str:
    """The comparison's settings in one line: verifier, dtype, prompts, new tokens, the fastest plain decoding."""
    s = compare["settings"]
    prompts = s["num_prompts"]
    counts = (", ".join(f"{d} {n or 'all'}" for d, n in prompts.items()) + " prompts" if isinstance(prompts, dict)
              else f"{prompts or 'all'} prompts per dataset")
    plain = ", ".join(f"{d}: {f['dtype']} {f['tokens_per_s']:.1f} tok/s" for d, f in compare["fastest_plain"].items())
    return (f"{s['model']['name']} ({s['model']['dtype']}), greedy, {counts}, {s['max_new_tokens']} new tokens"
            + (f"; fastest plain decoding timed alone: {plain}" if plain else ""))


def markdown(rows: list[dict], checks: list[dict], curves: dict, compare: dict) -> str:
    lines = [setup(compare), "", "| drafter | dataset | tau | drafter ms / step | verify ms / step | nodes / step | "
             "speedup in cell | vs fastest plain | greedy identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fastest = fmt(r["vs_fastest_plain"], ".2f", "x")
        lines.append(f"| {r['method']} | {r['dataset']} | {r['tau']:.2f} | {r['draft_ms']:.1f} | "
                     f"{r['verify_ms']:.1f} | {r['nodes']:.1f} | {r['speedup']:.2f}x | {fastest} | "
                     f"{r['greedy_identity_rate']:.0%} ({r['unexplained_divergences']} non-tie) |")
    lines += ["", "| target | dataset | values | met |", "|---|---|---|---|"]
    for c in checks:
        op = ">" if c["metric"] == "vs_fastest_plain" else ">="
        lines.append(f"| {c['a']} {c['metric']} {op} {c['b']} | {c['dataset']} | {fmt(c['a_value'], '.3f')} vs "
                     f"{fmt(c['b_value'], '.3f')} | {'yes' if c['met'] else 'NO'} |")
    lines += ["", "| run | step | training tokens | held-out simulated tau | decode tau (snapshot) |",
              "|---|---|---|---|---|"]
    for name, run in curves.get("runs", {}).items():
        for p in run["points"]:
            lines.append(f"| {name} | {p['step']} | {p['tokens']:,} | {fmt(p['held_out_tau'], '.3f')} | "
                         f"{p['decode_tau']:.2f} |")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict:
    compare = read_json(cfg.cmp_dir, "compare/compare.json", "scripts/bench/compare.py's output")
    rows = cells(cfg, compare)
    checks = targets(cfg, rows)
    curves = read_json(cfg.cmp_dir, "curves/learning_curve.json", "scripts/bench/learning_curve.py's output")
    table = markdown(rows, checks, curves, compare)
    out = Path(cfg.cmp_dir)
    write_atomic_text(out / "peagle.md", table + "\n")
    write_atomic_text(out / "peagle.json", json.dumps({"cells": rows, "targets": checks, "curves": curves}, indent=2))
    print(table)
    return {"cells": rows, "targets": checks}


if __name__ == "__main__":
    launch("peagle_summary", run)
