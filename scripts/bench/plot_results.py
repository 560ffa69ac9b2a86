"""The README's results table and its plot, from the JSON of the comparisons that measured them.

    python scripts/bench/plot_results.py

Each entry of `rows` (conf/plot_results.yaml) names a scripts/bench/compare.py output (its compare.json),
a method in it, and the machine and date it ran on. The row's tau and in-cell speedup (against plain
decoding interleaved in the same cell) are read from that file, on `dataset` at `temperature`.
Writes `output` (a PNG: tau and speedup per row) and prints the markdown table README.md shows
(tests/test_documented_commands.py checks that README.md holds it). A file measured on another
verifier or in another dtype than `model`, or without the method, is refused in one line.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError

HEAD = ("| method | tau | speedup | measured on | date |", "|---|---|---|---|---|")


def verifier_of(settings: dict) -> tuple[str | None, str | None]:
    """(name, dtype) of the verifier a compare.json was measured with: its `model` node, whose dtype
    the top-level `dtype` key of an older compare.py overrode."""
    model = settings.get("model") or {}
    return model.get("name"), settings.get("dtype") or model.get("dtype")


def measured(cfg: DictConfig) -> list[dict]:
    """One dict per entry of cfg.rows: its label, machine and date, and tau / speedup from its file."""
    if not cfg.rows:
        raise DraftsmithError("rows is empty: list the table's rows ({label, file, method, machine, date})")
    want = (cfg.model.name, cfg.model.dtype)
    out = []
    for i, row in enumerate(cfg.rows):
        path = Path(str(row.file))
        if not path.is_file():
            raise DraftsmithError(f"rows.{i}.file={row.file}: no such file; give the compare.json of a "
                                  f"scripts/bench/compare.py run")
        report = json.loads(path.read_text())
        if verifier_of(report.get("settings", {})) != want:
            name, dtype = verifier_of(report.get("settings", {}))
            raise DraftsmithError(f"rows.{i}.file={row.file} was measured on model={name} model.dtype={dtype}, not "
                                  f"model={want[0]} model.dtype={want[1]}: the table holds one verifier in one dtype")
        cells = [r for r in report.get("rows", []) if r["dataset"] == cfg.dataset
                 and float(r["temperature"]) == float(cfg.temperature)]
        found = [r for r in cells if r["method"] == row.method and r.get("speedup") is not None]
        if not found:
            valid = sorted(r["method"] for r in cells if r.get("speedup") is not None)
            raise DraftsmithError(f"rows.{i}.method={row.method!r}: {row.file} has no such row with an in-cell speedup "
                                  f"on dataset={cfg.dataset} at temperature={cfg.temperature}; valid: "
                                  f"{', '.join(valid) or 'none'}")
        out.append({"label": str(row.label), "tau": float(found[0]["tau"]), "speedup": float(found[0]["speedup"]),
                    "machine": str(row.machine), "date": str(row.date), "file": str(row.file),
                    "method": str(row.method)})
    return out


def table(rows: list[dict]) -> str:
    """The markdown table of README.md's results."""
    return "\n".join([*HEAD, *(f"| {r['label']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['machine']} | "
                               f"{r['date']} |" for r in rows)])


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Two panels, one bar per row: tau (tokens per verifier forward) and the in-cell speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows][::-1]  # the table's first row on top
    fig, (tau_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 0.45 * len(rows) + 1.4), sharey=True)
    tau_ax.barh(labels, [r["tau"] for r in rows][::-1], color="tab:blue")
    speed_ax.barh(labels, [r["speedup"] for r in rows][::-1], color="tab:orange")
    speed_ax.axvline(1.0, color="grey", lw=1, ls="--")  # plain decoding
    for ax, key, fmt in ((tau_ax, "tau", "{:.2f}"), (speed_ax, "speedup", "{:.2f}x")):
        for y, r in enumerate(rows[::-1]):
            ax.text(r[key], y, " " + fmt.format(r[key]), va="center", fontsize=8)
        ax.set_xlim(0, max(r[key] for r in rows) * 1.2)
    tau_ax.set(xlabel="tau (tokens per verifier forward)")
    speed_ax.set(xlabel="speedup over plain decoding (same cell)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def run(cfg: DictConfig) -> dict:
    rows = measured(cfg)
    out = Path(str(cfg.output))
    how = "greedy" if float(cfg.temperature) == 0 else f"T={cfg.temperature}"
    plot(rows, out, f"{cfg.model.name}, {cfg.model.dtype} verifier, {cfg.dataset}, {how}")
    text = table(rows)
    print(text)
    print(f"plot_results: {len(rows)} rows -> {out}; README.md shows this table")
    return {"rows": rows, "table": text, "output": str(out)}


if __name__ == "__main__":
    launch("plot_results", run)
