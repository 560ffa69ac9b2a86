"""Choose a decode preset's tree / draft budget for THIS machine, from measured tokens/s.

    python scripts/bench/tune_decode.py drafter=outputs/eagle3-smollm2-135m/final      # EAGLE-3, eagle-dynamic grid
    python scripts/bench/tune_decode.py proposer=draft drafter=outputs/draft-smollm2-135m/final decode=draft-chain \
        grid='[{num_tokens: [2, 4, 6]}]'

EAGLE-2 fixes its draft-tree budget (total_tokens) for the GPU it runs on; the right budget on
another machine depends on what a verify forward over n tokens and a drafter step cost there.
This measures it: every candidate is the decode preset with some keys replaced (`grid`: the
product of each entry's per-key value lists; `candidates`: explicit maps, e.g. static-tree `paths`). On each
prompt, plain decoding and every candidate run through the same engine on the same verifier,
the order rotating from prompt to prompt. tau is a property of drafter and tree; tokens/s (new
tokens over wall time, prefill included) is the machine's. The fastest candidate is printed as
the overrides to pass to decode/evaluate.py / serve.py / compare.py. Greedy outputs are checked
against plain decoding, as in decode/evaluate.py.

Writes output_dir/tune_decode.{json,md,png} and best.txt (the fastest candidate's overrides).
"""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.decode import evaluate, sampling
from draftsmith.decode.build import build_proposer, check_drafter
from draftsmith.decode.engine import summarize
from draftsmith.decode.harness import compare_greedy, interleaved, prompt_ids
from draftsmith.decode.sampling import SamplingParams
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import load_prompts
from draftsmith.models.verifier import load_verifier, resolve_device


def candidate_list(cfg: DictConfig) -> list[dict]:
    """Every grid entry's product plus the explicit candidates, each a {decode key: value} map;
    every key must be one the decode preset has (a key it lacks would be ignored: refused).
    `grid` is a list (a command-line grid= replaces it whole) of maps from a decode key to the
    values to try."""
    grid = OmegaConf.to_container(cfg.grid, resolve=True) if cfg.grid else []
    extra = OmegaConf.to_container(cfg.candidates, resolve=True) if cfg.candidates else []
    if not isinstance(grid, list) or not all(isinstance(g, dict) and g and all(isinstance(v, list) and v
                                                                             for v in g.values()) for g in grid):
        raise DraftsmithError(f"grid={grid}: give a list of maps from decode keys to non-empty value lists, "
                              f"e.g. grid='[{{depth: [4, 6], total_tokens: [10, 24]}}]'")
    if not isinstance(extra, list) or not all(isinstance(c, dict) and c for c in extra):
        raise DraftsmithError(f"candidates={extra}: give a list of non-empty maps of decode keys, "
                              f"e.g. candidates='[{{depth: 5, top_k: 6, total_tokens: 16}}]'")
    out: list[dict] = []
    for g in grid:
        out += [c for c in (dict(zip(g, values)) for values in itertools.product(*g.values())) if c not in out]
    out += [c for c in extra if c not in out]
    if not out:
        raise DraftsmithError("grid and candidates are both empty: give at least one candidate to measure")
    for c in out:
        unknown = sorted(set(c) - set(cfg.decode) - {"name"})
        if unknown or "name" in c:
            bad = unknown[0] if unknown else "name"
            raise DraftsmithError(f"grid/candidates key {bad!r}: decode={cfg.decode.name} has no such setting to "
                                  f"tune; its keys: {', '.join(k for k in cfg.decode if k != 'name')}")
    return out


def label(candidate: dict, index: int) -> str:
    """A short unique name for candidate `index`: depth=6 top_k=8 total_tokens=24; a value whose
    JSON is long (a static tree's paths) by its length and the candidate's number."""
    def short(k, v):
        text = json.dumps(v).replace(" ", "")
        return f"{k}={text}" if len(text) <= 32 else f"{k}=<{len(v)} items, #{index}>"
    return " ".join(short(k, v) for k, v in candidate.items())


def overrides(candidate: dict) -> str:
    """The Hydra overrides that select this candidate on the command line."""
    return " ".join(f"decode.{k}={json.dumps(v).replace(' ', '')}" for k, v in candidate.items())


def run(cfg: DictConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    if int(cfg.num_samples) < 1:
        raise DraftsmithError(f"num_samples={cfg.num_samples}: measure at least one sample per prompt (num_samples=1)")
    acceptance = cfg.acceptance
    sampling.resolve_rule(acceptance, SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p))  # refuse before any work
    candidates = candidate_list(cfg)
    device = resolve_device(cfg.device)
    check_drafter(cfg)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verifier = load_verifier(cfg.model, device=device)
    model, tokenizer = verifier.model, verifier.tokenizer
    proposers, names = {}, [label(c, i) for i, c in enumerate(candidates)]
    for name, c in zip(names, candidates):  # each candidate's proposer, built (and its settings checked) before any timing
        cand_cfg = OmegaConf.merge(cfg, {"decode": c})
        proposer, _ = build_proposer(cand_cfg, verifier)
        if proposer is None:
            raise DraftsmithError(f"proposer={cfg.proposer.name} drafts nothing to tune; pick a drafter's proposer (medusa, eagle or draft)")
        proposers[name] = proposer
    runs = {"vanilla": None, **proposers}
    prompts = load_prompts(cfg.data)
    outputs = {name: [] for name in runs}
    checks = {name: {"identical": 0, "ties": 0, "unexplained": 0} for name in runs}
    load_before = os.getloadavg()[0]
    prompts_ids = [prompt_ids(tokenizer, p["messages"]).to(model.device) for p in prompts]
    for i, _, _, outs in interleaved(model, prompts_ids, runs, num_samples=cfg.num_samples, seed=cfg.seed,
                                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     top_k=cfg.top_k, top_p=cfg.top_p, acceptance=acceptance,
                                     desc=f"tune {cfg.decode.name}"):
        for name, out in outs.items():
            outputs[name].append(out)
            if cfg.temperature == 0:  # greedy: every candidate must reproduce plain decoding
                check = compare_greedy(model, prompts_ids[i][0].tolist(), out.tokens, outs["vanilla"].tokens,
                                       cfg.tie_tolerance, cfg.tie_ulps)
                checks[name]["identical" if check["identical"] else "ties" if check.get("tie") else "unexplained"] += 1
    stats = {name: summarize(outs) for name, outs in outputs.items()}  # the evaluator's aggregation
    rows = []
    for name, st in stats.items():
        row = {"candidate": name, "tau": st["tau"], "tokens_per_s": st["tokens_per_s"],
               "speedup": st["tokens_per_s"] / stats["vanilla"]["tokens_per_s"], "mean_nodes": st["mean_nodes"],
               "mean_propose_ms": 1000 * st["mean_propose_s"], "mean_verify_ms": 1000 * st["mean_verify_s"],
               "num_tokens": st["num_tokens"], "greedy_identical": checks[name]["identical"],
               "greedy_ties": checks[name]["ties"], "greedy_unexplained": checks[name]["unexplained"]}
        if name != "vanilla":
            row["overrides"] = overrides(candidates[names.index(name)])
        rows.append(row)
    best = max((r for r in rows if r["candidate"] != "vanilla"), key=lambda r: r["tokens_per_s"])
    report = {"model": verifier.name, "dtype": str(model.dtype), "method": cfg.proposer.name, "drafter": cfg.drafter,
              "decode": cfg.decode.name, "data": cfg.data.name, "num_prompts": len(prompts),
              "num_samples": cfg.num_samples, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
              "lossy": acceptance in sampling.LOSSY_RULES, "device": str(model.device), "threads": torch.get_num_threads(),
              "load_avg_1m_before": load_before,
              "load_avg_1m_after": os.getloadavg()[0], "rows": rows, "best": best}
    write_atomic_text(out_dir / "tune_decode.json", json.dumps(report, indent=2))
    write_atomic_text(out_dir / "best.txt", best["overrides"] + "\n")  # compare.py tuned.<method>= reads it
    table = markdown(report)
    write_atomic_text(out_dir / "tune_decode.md", table + "\n")
    plot(report, out_dir)
    print(table)
    print(f"fastest on this machine: {best['candidate']} (tau {best['tau']:.2f}, {best['speedup']:.2f}x plain); "
          f"pass: decode={cfg.decode.name} {best['overrides']}")
    print(f"results -> {out_dir}/tune_decode.json")
    return report


def markdown(report: dict) -> str:
    where = report["device"] if report.get("device", "cpu") != "cpu" else f"{report['threads']} threads"
    head = (f"{report['model']} ({report['dtype']}, {where}, load "
            f"{report['load_avg_1m_before']:.1f} -> {report['load_avg_1m_after']:.1f}), method={report['method']}, "
            f"decode={report['decode']}, data={report['data']} x{report['num_prompts']}, T={report['temperature']}, "
            f"max_new_tokens={report['max_new_tokens']}; speedup against plain decoding interleaved in this run"
            + (" — LOSSY (typical acceptance)" if report["lossy"] else ""))
    lines = ["| candidate | tau | tokens/s | speedup | nodes / step | propose ms | verify ms | greedy identical / ties / unexplained |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        mark = "**" if r["candidate"] == report["best"]["candidate"] else ""
        lines.append(f"| {mark}{r['candidate']}{mark} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x "
                     f"| {r['mean_nodes']:.1f} | {r['mean_propose_ms']:.1f} | {r['mean_verify_ms']:.1f} "
                     f"| {r['greedy_identical']} / {r['greedy_ties']} / {r['greedy_unexplained']} |")
    return head + "\n\n" + "\n".join(lines)


def plot(report: dict, out_dir: Path) -> None:
    rows = [r for r in report["rows"] if r["candidate"] != "vanilla"]

    def draw(ax):
        ax.scatter([r["tau"] for r in rows], [r["speedup"] for r in rows])
        for r in rows:
            ax.annotate(r["candidate"].replace("total_tokens", "n"), (r["tau"], r["speedup"]), fontsize=5)
        ax.axhline(1.0, color="gray", lw=0.8)

    evaluate.save_plot(out_dir / "tune_decode.png", draw, xlabel="tau (tokens per verifier forward)",
                       ylabel="speedup vs plain", title=f"{report['method']} / {report['decode']}: tree budget")


if __name__ == "__main__":
    launch("tune_decode", run)
