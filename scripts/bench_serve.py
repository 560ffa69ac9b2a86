"""Load test of decode/serve.py: N concurrent streaming clients on 127.0.0.1, with the drafter and
without, for a bounded number of requests each.

    python scripts/bench_serve.py                                    # conf/bench_serve.yaml
    python scripts/bench_serve.py clients=[1,4] requests=8 servers.medusa="method=medusa drafter=... decode=medusa-cpu"

Each server is a fresh `python decode/serve.py` process. Every request is greedy and its text
is compared with the offline engine's output for the same prompt (decode.engine.generate, no
drafter). Reports per (server, N): throughput (completion tokens/s over the wall time), time
to first token p50/p99, per-token latency p50/p99 (each request's (t_last - t_first) /
(tokens - 1)), failed and different requests. Writes output_dir/bench_serve.{json,md,png}.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from draftsmith.decode.engine import generate
from draftsmith.decode.evaluate import percentile, prompt_ids, save_plot
from draftsmith.models.entry import CONF_DIR, compose_main, launch, model_overrides
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import load_prompts
from draftsmith.models.verifier import load_verifier, resolve_device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(overrides: list[str], port: int, env: dict, log: Path):
    cmd = [sys.executable, "decode/serve.py", *overrides, f"port={port}", "log_level=error"]
    proc = subprocess.Popen(cmd, cwd=CONF_DIR.parent, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise DraftsmithError(f"decode/serve.py {' '.join(overrides)} exited: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise DraftsmithError(f"decode/serve.py did not start in 300 s: see {log}")


def one_request(client, model: str, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, last, text, usage = None, None, "", None
    try:
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or now
                last = now
                text += chunk.choices[0].delta.content
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tokens = usage.completion_tokens if usage is not None else 0
    return {"ok": True, "text": text, "tokens": tokens, "ttft_s": (first or time.perf_counter()) - t0,
            "per_token_s": ((last - first) / (tokens - 1)) if first and tokens > 1 else None}


def load_test(url: str, model: str, prompts: list, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads, each sending its share of `requests` streaming requests in turn."""
    import openai

    results: list[dict] = []
    lock = threading.Lock()
    todo = list(range(requests))

    def worker():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            r = one_request(client, model, prompts[i % len(prompts)]["messages"], max_tokens)
            with lock:
                results.append({"prompt": i % len(prompts), **r})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.perf_counter() - t0, "results": results}


def run(cfg: DictConfig) -> dict:
    for noisy in ("httpx", "httpx2"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    device = resolve_device(cfg.device)  # refused before any work
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)}
    torch.set_num_threads(int(cfg.threads))
    base = server_args(cfg)
    # the offline reference: the engine's plain greedy output per prompt (lossless = the same text)
    serve_cfg = compose_main("serve", base)
    verifier = load_verifier(serve_cfg.model, device=device)
    prompts = load_prompts(compose_data(cfg))
    reference = []
    for p in prompts:
        ids = prompt_ids(verifier.tokenizer, p["messages"]).to(verifier.model.device)
        out = generate(verifier.model, ids, max_new_tokens=cfg.max_tokens)
        reference.append(verifier.tokenizer.decode(out.tokens, skip_special_tokens=True))
    del verifier
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the servers load their own copies on the same GPU
    report = {"verifier": cfg.model.name, "dtype": cfg.model.dtype, "device": str(device),
              "threads": cfg.threads, "cpus": os.cpu_count(),
              "max_tokens": cfg.max_tokens, "load_avg_1m_before": os.getloadavg()[0], "runs": {}}
    for name, overrides in cfg.servers.items():
        port = free_port()
        proc = start_server(base + str(overrides).split(), port, env, out_dir / f"server-{name}.log")
        try:
            for n in cfg.clients:
                requests = max(int(cfg.requests), int(n))
                res = load_test(f"http://127.0.0.1:{port}", cfg.model.name, prompts, int(n), requests, cfg.max_tokens)
                ok = [r for r in res["results"] if r["ok"]]
                tokens = sum(r["tokens"] for r in ok)
                ttft = [r["ttft_s"] for r in ok]
                per_token = [r["per_token_s"] for r in ok if r["per_token_s"] is not None]
                row = {"clients": n, "requests": requests, "failed": len(res["results"]) - len(ok),
                       "different": sum(r["text"] != reference[r["prompt"]] for r in ok), "tokens": tokens,
                       "wall_s": res["wall_s"], "tokens_per_s": tokens / res["wall_s"],
                       "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
                       "per_token_p50_ms": 1000 * percentile(per_token, 0.5),
                       "per_token_p99_ms": 1000 * percentile(per_token, 0.99)}
                report["runs"].setdefault(name, []).append(row)
                print(f"bench_serve: {name} N={n}: {row['tokens_per_s']:.1f} tok/s, ttft p50 {row['ttft_p50_s']:.2f} s, "
                      f"failed {row['failed']}, different {row['different']}", flush=True)
            import httpx

            report.setdefault("metrics", {})[name] = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    report["load_avg_1m_after"] = os.getloadavg()[0]
    (out_dir / "bench_serve.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "bench_serve.md").write_text(table + "\n")

    def draw(ax):
        for name, rows in report["runs"].items():
            ax.plot([r["clients"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
        ax.legend()

    save_plot(out_dir / "bench_serve.png", draw, xlabel="concurrent streaming clients", ylabel="tokens / s",
              xscale="log", title=f"decode/serve.py, {cfg.model.name} {cfg.model.dtype}")
    print(table)
    return report


def server_args(cfg: DictConfig) -> list[str]:
    """decode/serve.py overrides every server shares: this benchmark's verifier (model.*), device, threads."""
    return [*model_overrides(cfg.model), f"device={cfg.device}", f"threads={cfg.threads}",
            f"max_queue={max(cfg.clients) + 1}"]


def compose_data(cfg):
    return compose_main("evaluate", [f"data={cfg.prompts}", f"data.num_prompts={cfg.num_prompts}"]).data


def markdown(report: dict) -> str:
    lines = [(f"{report['verifier']} {report['dtype']}, {report['threads']} threads on {report['cpus']} CPUs, greedy, "
              f"max_tokens {report['max_tokens']}, load {report['load_avg_1m_before']:.1f} before / "
              f"{report['load_avg_1m_after']:.1f} after"), "",
             "| server | clients | requests | tok/s | TTFT p50 / p99 s | per-token p50 / p99 ms | failed | different |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rows in report["runs"].items():
        for r in rows:
            lines.append(f"| {name} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['per_token_p50_ms']:.0f} / "
                         f"{r['per_token_p99_ms']:.0f} | {r['failed']} | {r['different']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    launch("bench_serve", run)
