"""Compare decoding methods on the same verifier, prompts and settings; one table.

    python scripts/compare.py                                            # conf/compare.yaml
    python scripts/compare.py only='[prompt-lookup,lookahead]' datasets='[humaneval]'
    python scripts/compare.py num_prompts=4 temperatures='[0.0]' \
        "methods={fkl: ['method=draft', 'drafter=outputs/draft-smollm2-135m-draft-fkl/final', 'decode=draft-chain']}"

Every cell (method x dataset x temperature) is one decode/evaluate.py run in this process,
with plain decoding interleaved on the same prompts, so speedups are same-run ratios; tau does
not depend on the machine. Writes output_dir/compare.{json,md} and each cell's evaluate folder.
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from decode.evaluate import run as evaluate
from train.core.cli import CONF_DIR, launch


def cell_config(cfg: DictConfig, overrides: list[str], dataset: str, temperature: float, out: Path, hf: bool):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    model = [f"++model.{k}={'null' if v is None else v}" for k, v in cfg.model.items() if k != "dtype"]
    overrides = [*model, f"model.dtype={cfg.dtype}", f"data={dataset}",
                 f"data.num_prompts={cfg.num_prompts}", f"max_new_tokens={cfg.max_new_tokens}",
                 f"temperature={temperature}", f"hf.enabled={str(hf).lower()}",
                 f"hf.assistant={cfg.assistant if hf and cfg.assistant else 'null'}",
                 f"threads={cfg.threads or 'null'}", f"output_dir={out}", *overrides]
    if GlobalHydra.instance().is_initialized():  # inside this script's own Hydra app
        return compose("evaluate", overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # called from Python (tests)
        return compose("evaluate", overrides=overrides)


def run(cfg: DictConfig) -> dict:
    out_dir = Path(cfg.output_dir)
    rows = []
    if cfg.assistant and not Path(cfg.assistant).is_dir():
        print(f"compare: no HF assisted generation: no draft model at assistant={cfg.assistant}", flush=True)
        cfg.assistant = None
    for name, overrides in cfg.methods.items():
        if cfg.only is not None and name not in cfg.only:
            continue
        drafter = next((o.split("=", 1)[1] for o in overrides if o.startswith("drafter=")), "null")
        if drafter != "null" and not Path(drafter).is_dir():
            print(f"compare: skipping {name}: no drafter at {drafter} (train it first)", flush=True)
            continue
        for dataset in cfg.datasets:
            for temperature in cfg.temperatures:
                out = out_dir / f"{name}-{dataset}-T{temperature}"
                report = evaluate(cell_config(cfg, list(overrides), dataset, float(temperature), out,
                                              hf=name == cfg.hf_with))
                method = next(m for m in report["methods"] if m != "vanilla" and not m.startswith("hf_"))
                ours = report["methods"][method]
                row = {"method": name, "dataset": dataset, "temperature": float(temperature), "tau": ours["tau"],
                       "speedup": ours["speedup"], "tokens_per_s": ours["tokens_per_s"],
                       "vanilla_tokens_per_s": report["methods"]["vanilla"]["tokens_per_s"],
                       "greedy_identity_rate": ours.get("greedy_identity_rate"),
                       "unexplained_divergences": ours.get("greedy_divergences_unexplained"), "lossy": report["lossy"]}
                rows.append(row)
                for hf_name in ("hf_generate", "hf_prompt_lookup", "hf_assisted"):
                    if hf_name in report["methods"]:
                        rows.append({"method": hf_name, "dataset": dataset, "temperature": float(temperature),
                                     "tau": None, "speedup": report["methods"][hf_name]["speedup"],
                                     "tokens_per_s": report["methods"][hf_name]["tokens_per_s"],
                                     "vanilla_tokens_per_s": row["vanilla_tokens_per_s"],
                                     "greedy_identity_rate": report["methods"][hf_name].get("greedy_identity_rate"),
                                     "unexplained_divergences": report["methods"][hf_name].get(
                                         "greedy_divergences_unexplained"), "lossy": False})
                (out_dir / "compare.json").write_text(json.dumps({"settings": OmegaConf.to_container(cfg, resolve=True),
                                                                  "rows": rows}, indent=2))
    table = markdown(rows, cfg)
    (out_dir / "compare.md").write_text(table + "\n")
    print(table)
    return {"rows": rows}


def markdown(rows: list[dict], cfg) -> str:
    """One line per method: tau and speedup vs plain decoding per dataset x temperature."""
    cells = [(d, float(t)) for d in cfg.datasets for t in cfg.temperatures]
    head = " | ".join(f"{d} T={t:g} tau / speedup" for d, t in cells)
    lines = [f"{cfg.model.name} ({cfg.dtype}), {cfg.num_prompts} prompts per dataset, {cfg.max_new_tokens} new tokens; "
             f"speedup = tokens/s vs plain decoding in the same run", "", f"| method | {head} | greedy identical |",
             "|---|" + "---|" * (len(cells) + 1)]
    for method in dict.fromkeys(r["method"] for r in rows):
        parts, ident = [], []
        for d, t in cells:
            r = next((r for r in rows if r["method"] == method and r["dataset"] == d and r["temperature"] == t), None)
            if r is None:
                parts.append("-")
                continue
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            parts.append(f"{tau} / {r['speedup']:.2f}x")
            if t == 0.0 and r["greedy_identity_rate"] is not None:
                ident.append(f"{r['greedy_identity_rate']:.0%} ({r['unexplained_divergences']} non-tie)")
        lines.append(f"| {method} | " + " | ".join(parts) + f" | {', '.join(ident) or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("compare", run)
