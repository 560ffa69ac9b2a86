"""draftsmith beside vLLM-CPU and llama.cpp as peers: the same verifier, prompts and drafters, in one run.

    python scripts/bench/bench_peers.py drafters='{eagle3: outputs/cmp/eagle3/final}'      # conf/bench_peers.yaml
    python scripts/bench/bench_peers.py data.num_prompts=2 max_new_tokens=8 vllm_batch=false ngram=null

Rows, all greedy, `max_new_tokens` each with EOS ignored (every row writes the same tokens):

  draftsmith plain, batch 1 (decode.engine.generate) and batched (decode.batch.generate_batch);
  draftsmith + each drafter, with its `decode` preset and with a chain of k (what vLLM drafts);
  vLLM plain, batch 1 (one request at a time) and batched (every prompt in one call);
  vLLM + each drafter, exported by scripts/export.py format=vllm (num_speculative_tokens k);
  vLLM's ngram proposer (prompt lookup), k tokens;
  llama.cpp (`llamacpp`: scripts/engines/llamacpp.bench_rows) in each of llamacpp.dtypes: plain, each
  drafter exported with format=gguf (EAGLE-3 and draft models; any other kind is a row saying why),
  its n-gram proposer, one `llama-server -np N` per N in llamacpp.clients.

vLLM runs in its own venv (scripts/engines/vllm_cpu.py builds it once) in one subprocess
(scripts/engines/vllm_runner.py), after draftsmith's rows, then llama.cpp's servers (built once by
scripts/engines/llamacpp_build.py), so no two engines share the cores.
Each row is warmed up on a short generation first. Reported per row: tokens/s, tau (tokens per
verifier forward, 1 + accepted drafts per step, in both engines before the max_new_tokens cut, as
vLLM's counters count them), whether its text
equals its engine's plain decoding, and the speedup against the FASTEST plain decoding of the
same batching on this machine, whichever engine it is. Writes output_dir/bench_peers.{json,md}.
Time it alone on the box (nothing else running): both engines are timed by wall clock.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.models.checkpoint import load_drafter, write_atomic_text
from draftsmith.models.entry import compose_main, launch, model_overrides
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.layouts import vllm_method
from draftsmith.models.sources import load_prompts

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python scripts/bench/bench_peers.py` puts scripts/bench/ first; scripts.* needs it
    sys.path.insert(0, str(ROOT))


def draftsmith_rows(cfg: DictConfig, verifier, prompts: list[list[int]], drafters: dict) -> list[dict]:
    from draftsmith.decode.batch import generate_batch
    from draftsmith.decode.build import proposer_for
    from draftsmith.decode.engine import generate
    from draftsmith.decode.probe import decode_preset
    from scripts.engines.vllm_parity import chain_preset

    n = cfg.max_new_tokens

    def timed(name: str, proposer_of=None, **extra) -> dict:
        generate(verifier.model, torch.tensor([prompts[0]]), proposer=proposer_of() if proposer_of else None,
                 max_new_tokens=min(8, n), eos_token_id=())  # warm-up
        tokens, steps, accepted, seconds = [], 0, 0, 0.0
        for prompt in prompts:
            proposer = proposer_of() if proposer_of else None
            t = time.perf_counter()
            out = generate(verifier.model, torch.tensor([prompt]), proposer=proposer, max_new_tokens=n,
                           eos_token_id=())
            seconds += time.perf_counter() - t
            tokens.append(out.tokens)
            steps += len(out.steps)
            accepted += sum(s.accepted for s in out.steps)
        row = {"engine": "draftsmith", "row": name, "batch": 1, "tokens": tokens, "seconds": seconds,
               "tau": 1 + accepted / steps if steps else None, **extra}
        print(f"bench_peers: draftsmith {name}: {sum(map(len, tokens)) / seconds:.1f} tok/s", flush=True)
        return row

    rows = [timed("plain")]
    if cfg.draftsmith_batch:
        t = time.perf_counter()
        out = dict((i, toks) for i, toks, _ in generate_batch(verifier.model, prompts, max_new_tokens=n, eos=[],
                                                               batch_size=len(prompts)))
        rows.append({"engine": "draftsmith", "row": "plain", "batch": len(prompts), "seconds": time.perf_counter() - t,
                     "tokens": [out[i] for i in range(len(prompts))], "tau": None})
    for name, drafter in drafters.items():
        preset = decode_preset(cfg.decode, drafter, cfg.hw)
        rows.append(timed(f"+ {name} ({preset.name})", lambda d=drafter, p=preset: proposer_for(d, verifier, p)))
        if cfg.k:
            chain = chain_preset(drafter.kind, cfg.k)
            rows.append(timed(f"+ {name} (chain of {cfg.k})", lambda d=drafter, p=chain: proposer_for(d, verifier, p)))
    return rows


def vllm_rows(cfg: DictConfig, folder: str, prompts: list[list[int]], exports: dict) -> list[dict]:
    from scripts.engines.vllm_parity import run_vllm

    n, k = cfg.max_new_tokens, cfg.k or 4
    job = {"model": folder, "prompts": prompts, "max_tokens": n, "warmup": min(8, n)}
    jobs = [{"name": "plain", **job, "speculative_config": None}]
    if cfg.vllm_batch:
        jobs.append({"name": "plain batched", **job, "speculative_config": None, "mode": "batch"})
    for name, (method, path) in exports.items():
        jobs.append({"name": f"+ {name}", **job, "speculative_config": {"method": method, "model": path,
                                                                        "num_speculative_tokens": k}})
    if cfg.ngram:
        jobs.append({"name": "ngram", **job, "speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                                                    **OmegaConf.to_container(cfg.ngram)}})
    result = run_vllm(jobs, dtype=cfg.model.dtype, max_model_len=cfg.max_model_len, threads=cfg.vllm_threads,
                      kv_cache_mib=cfg.kv_cache_mib, timeout=cfg.timeout_s)
    rows = []
    for j in jobs:
        r = result["jobs"][j["name"]]
        row = {"engine": f"vLLM {result['vllm']}", "row": j["name"].replace(" batched", ""),
               "batch": len(prompts) if j.get("mode") == "batch" else 1, "error": r["error"]}
        if not r["error"]:
            m = r["metrics"]
            row.update(tokens=r["tokens"], seconds=sum(r["gen_s"]),
                       tau=1 + m["num_accepted_tokens"] / m["num_drafts"] if m["num_drafts"] else None)
        rows.append(row)
    return rows


def finish(rows: list[dict]) -> list[dict]:
    """tokens/s, text = its engine's plain text, speedup over the fastest plain row of the same batching."""
    plain = {(r["engine"], r["batch"] > 1): r["tokens"] for r in rows if r["row"] == "plain" and "tokens" in r}
    for r in rows:
        if "tokens" in r:
            r["tokens_per_s"] = sum(map(len, r["tokens"])) / r["seconds"]
            ref = plain.get((r["engine"], False))
            r["same_text"] = None if ref is None else r["tokens"] == ref
    for batched in (False, True):
        best = max((r for r in rows if r["row"] == "plain" and (r["batch"] > 1) == batched and "tokens_per_s" in r),
                   key=lambda r: r["tokens_per_s"], default=None)
        for r in rows:
            if best and (r["batch"] > 1) == batched and "tokens_per_s" in r:
                r["speedup"] = r["tokens_per_s"] / best["tokens_per_s"]
                r["vs"] = f"{best['engine']} plain"
    return rows


def table(rows: list[dict]) -> str:
    out = ["| engine | row | batch | tok/s | tau | text = plain | speedup (vs fastest plain) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            out.append(f"| {r['engine']} | {r['row']} | {r['batch']} | failed: {r['error'][:120]} | | | |")
            continue
        tau = f"{r['tau']:.2f}" if r.get("tau") else ""
        same = "" if r.get("same_text") is None else "yes" if r["same_text"] else "**no**"
        out.append(f"| {r['engine']} | {r['row']} | {r['batch']} | {r['tokens_per_s']:.1f} | {tau} | {same} | "
                   f"{r['speedup']:.2f}x ({r['vs']}) |")
    return "\n".join(out)


def plot(report: dict, path: Path) -> None:
    """tokens/s of every timed row, one panel per batching, coloured by engine, tau beside each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in report["rows"] if "tokens_per_s" in r]
    panels = [("one request at a time", [r for r in timed if r["batch"] == 1]),
              ("every prompt in one batch", [r for r in timed if r["batch"] > 1])]
    panels = [(title, rows) for title, rows in panels if rows]
    engines = sorted({r["engine"] for r in timed})
    colour = {e: f"C{i}" for i, e in enumerate(engines)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.42 * max(len(r) for _, r in panels) + 1.6),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        y = range(len(rows))
        ax.barh(list(y), [r["tokens_per_s"] for r in rows], color=[colour[r["engine"]] for r in rows])
        ax.set_yticks(list(y), [f"{r['engine']}: {r['row']}" for r in rows], fontsize=7)
        ax.invert_yaxis()
        for i, r in zip(y, rows):
            tau = f" (tau {r['tau']:.2f})" if r.get("tau") else ""
            ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:.1f}{tau}", va="center", fontsize=7)
        ax.set(xlabel="tokens / s", title=title)
        ax.margins(x=0.25)
    fig.suptitle(f"{report['model']} {report['dtype']}, {report['prompts']} prompts x {report['max_new_tokens']} "
                 f"tokens, greedy, {report['threads']} threads")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def run(cfg: DictConfig) -> dict:
    from draftsmith.decode.harness import prompt_ids
    from draftsmith.models.verifier import load_verifier, resolve_path
    from scripts.export import run as export

    lc = cfg.llamacpp
    if lc is not None:
        unknown = set(lc) - {"dtypes", "clients", "threads", "ngram", "poll"}
        if unknown:
            raise DraftsmithError(f"llamacpp.{sorted(unknown)[0]}: not a key of llamacpp (dtypes, clients, threads, "
                                  f"ngram, poll; llamacpp=null: no llama.cpp rows)")
        bad = [d for d in lc.dtypes if d not in ("float32", "bfloat16", "float16")]
        if bad or not lc.dtypes:
            raise DraftsmithError(f"llamacpp.dtypes={list(lc.dtypes)}: give float32, bfloat16 and/or float16")
        if not lc.clients or any(int(n) < 1 for n in lc.clients):
            raise DraftsmithError(f"llamacpp.clients={list(lc.clients)}: give concurrencies >= 1")
    if cfg.k is not None and int(cfg.k) < 1:
        raise DraftsmithError(f"k={cfg.k}: the drafted tokens per step must be >= 1 (null: no chain rows)")
    folder = resolve_path(cfg.model)
    if not (Path(folder) / "config.json").is_file():
        raise DraftsmithError(f"model.path={cfg.model.path}: vLLM needs the verifier as a local HF folder; "
                              f"{folder} is not one")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(cfg.threads))
    verifier = load_verifier(cfg.model)
    prompts = [prompt_ids(verifier.tokenizer, p["messages"])[0].tolist() for p in load_prompts(cfg.data)]
    given = dict(cfg.drafters or {})
    drafters = {name: load_drafter(path, verifier_fingerprint=verifier.fingerprint) for name, path in given.items()}
    exports, refused = {}, []
    for name, path in given.items():
        target = out / "export" / name
        try:
            export(compose_main("export", model_overrides(cfg.model) + [
                f"drafter={path}", "format=vllm", f"output_dir={target}", f"dtype={cfg.model.dtype}",
                f"verifier_name={folder}"]))
        except DraftsmithError as e:  # a drafter vLLM cannot load: its vLLM row says why
            refused.append({"engine": "vLLM", "row": f"+ {name}", "batch": 1, "error": f"export refused: {e}"})
            continue
        exports[name] = (vllm_method(drafters[name].kind, drafters[name].config), str(target))
    t0 = time.perf_counter()
    rows = draftsmith_rows(cfg, verifier, prompts, drafters)
    del verifier, drafters
    if cfg.vllm:
        rows += vllm_rows(cfg, str(folder), prompts, exports) + refused
    if cfg.llamacpp is not None:
        from scripts.engines.llamacpp import bench_rows

        lc = cfg.llamacpp
        rows += bench_rows(model_overrides(cfg.model), given, prompts, cfg.max_new_tokens, out / "llamacpp",
                           dtypes=tuple(lc.dtypes), k=cfg.k or 3, clients=tuple(lc.clients), threads=lc.threads,
                           ngram=lc.ngram, poll=lc.poll)
    rows = finish(rows)
    report = {"model": cfg.model.name, "dtype": cfg.model.dtype, "prompts": len(prompts),
              "max_new_tokens": cfg.max_new_tokens, "k": cfg.k, "threads": cfg.threads,
              "vllm_threads": cfg.vllm_threads, "seconds": time.perf_counter() - t0,
              "llamacpp": None if cfg.llamacpp is None else OmegaConf.to_container(cfg.llamacpp),
              "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    md = table(rows)
    write_atomic_text(out / "bench_peers.json", json.dumps(report, indent=2))
    write_atomic_text(out / "bench_peers.md", f"{cfg.model.name} ({cfg.model.dtype}), {len(prompts)} prompts x "
                                              f"{cfg.max_new_tokens} tokens, greedy, {cfg.threads} threads\n\n{md}\n")
    plot(report, out / "bench_peers.png")
    print(md)
    return report


if __name__ == "__main__":
    launch("bench_peers", run)
