"""Run llama.cpp's `llama-server` (the pinned build) and measure it: prompts as token ids through
`/completion`, greedy, one request at a time or N at once.

    python -m scripts.engines.llamacpp --model out/verifier.gguf --prompts prompts.json   # [[token ids], ...]
    python -m scripts.engines.llamacpp --model out/verifier.gguf --draft out/drafter.gguf --spec-type draft-eagle3 \\
        --n-draft 3 --data mtbench --num-prompts 12 --max-new-tokens 64 --clients 1 4

`LlamaServer` starts the server on a free port and waits for /health; `complete(ids, n)` returns the
generated ids, `draft_n` / `draft_n_accepted` (llama.cpp's own counters: drafted and accepted tokens)
and its timings; `run(prompts, n, clients)` sends them from `clients` threads (the server gets
`-np clients` slots) and returns per-request results plus the wall-clock throughput. Every request
sets `cache_prompt: false` (no prefix reuse between requests) and temperature 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.models.errors import DraftsmithError
from draftsmith.models.gguf import OUTTYPES, LlamaCppError, llamacpp_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Completion:
    tokens: list[int]
    draft_n: int  # tokens drafted (llama.cpp: timings.draft_n; 0 without a drafter)
    draft_n_accepted: int  # of which the verifier accepted
    predicted_n: int
    predicted_ms: float  # llama.cpp's own generation time (prompt excluded)
    prompt_ms: float
    wall_s: float  # request round trip seen by the client
    stop_type: str


@dataclass
class RunResult:
    completions: list[Completion]
    clients: int
    wall_s: float
    tokens_per_s: float = field(init=False)  # generated tokens / wall time, all clients together
    tau: float = field(init=False)  # tokens per verifier forward after the prefill (draftsmith's tau)

    def __post_init__(self):
        n = sum(len(c.tokens) for c in self.completions)
        self.tokens_per_s = n / self.wall_s if self.wall_s > 0 else float("nan")
        after_prefill = sum(c.predicted_n - 1 for c in self.completions)  # the first token comes from the prefill
        accepted = sum(c.draft_n_accepted for c in self.completions)
        steps = after_prefill - accepted  # each forward emits its accepted drafts + 1
        self.tau = after_prefill / steps if steps > 0 else float("nan")


def server_argv(model: str | Path, draft: str | Path | None = None, spec_type: str | None = None, n_draft: int = 3,
                parallel: int = 1, ctx: int = 4096, threads: int | None = None, args: list[str] | None = None,
                binary: str | Path | None = None, poll: int | None = None) -> list[str]:
    """llama-server's command line (without --host / --port) for a verifier GGUF and an optional drafter.
    poll: llama.cpp's --poll (its threads busy-wait for work, default 50); 0 lets them sleep, which a box
    shared with other work needs: with one other busy process on the 2 cores, 2 spinning threads ran a
    tiny model at 9.5 tok/s, and 340 with --poll 0."""
    argv = [str(binary or llamacpp_server()), "-m", str(model), "-np", str(parallel), "-c", str(ctx * parallel)]
    if threads:
        argv += ["-t", str(threads), "-tb", str(threads)]
    if poll is not None:
        argv += ["--poll", str(poll)] + (["--poll-draft", str(poll)] if draft is not None else [])
    if draft is not None:
        argv += ["-md", str(draft), "--spec-draft-n-max", str(n_draft)]
        if threads:
            argv += ["-td", str(threads), "-tbd", str(threads)]
    if spec_type is not None:
        argv += ["--spec-type", spec_type]
    return argv + list(args or [])


class LlamaServer:
    """llama-server running `argv` (server_argv, or a printed command split; no --host / --port: it
    gets 127.0.0.1 and a free port) as a context manager."""

    def __init__(self, argv: list[str], log: str | Path | None = None, startup_s: float = 120.0):
        if "--port" in argv or "--host" in argv:
            raise DraftsmithError(f"llama-server argv {argv}: leave --host/--port out (a free local port is chosen)")
        if not Path(argv[0]).is_file():
            raise LlamaCppError(f"llama.cpp: no llama-server at {argv[0]}; build it with "
                                f"python -m scripts.engines.llamacpp_build")
        self.port = free_port()
        self.cmd = [*argv, "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        self.log_path = Path(log) if log else None
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        out = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-800:] if self.log_path else "(no log; pass log=...)"
                raise LlamaCppError(f"llama-server exited with {self.proc.returncode} at start: {tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise LlamaCppError(f"llama-server did not answer /health within {self.startup_s:.0f}s: {' '.join(self.cmd)}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False,
                 timeout: float = 600.0) -> Completion:
        """One greedy completion of the prompt `ids` (token ids, fed as they are). ignore_eos: llama.cpp
        then never picks an end-of-generation token (its logit is masked), so it writes max_new_tokens."""
        body = {"prompt": [int(i) for i in ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True, "stream": False, "ignore_eos": bool(ignore_eos)}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                res = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(f"llama-server /completion: HTTP {e.code}: {e.read()[:300]!r}") from None
        wall = time.perf_counter() - t0
        timings = res.get("timings", {})
        return Completion(tokens=[int(t) for t in res.get("tokens", [])], draft_n=int(timings.get("draft_n", 0)),
                          draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
                          predicted_n=int(timings.get("predicted_n", 0)),
                          predicted_ms=float(timings.get("predicted_ms", 0.0)),
                          prompt_ms=float(timings.get("prompt_ms", 0.0)), wall_s=wall,
                          stop_type=str(res.get("stop_type", "")))

    def run(self, prompts: list[list[int]], max_new_tokens: int, clients: int = 1,
            ignore_eos: bool = False) -> RunResult:
        """All prompts, `clients` requests in flight at a time (in prompt order per client)."""
        results: list[Completion | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        next_i = iter(range(len(prompts)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(next_i, None)
                if i is None or errors:
                    return
                try:
                    results[i] = self.complete(prompts[i], max_new_tokens, ignore_eos)
                except BaseException as e:  # reported after the join
                    errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(max(1, clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return RunResult(completions=results, clients=clients, wall_s=time.perf_counter() - t0)


EXACT_F32 = ["-fa", "off", "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"]  # models.gguf.serve_command


def bench_rows(model_overrides: list[str], drafters: dict[str, str], prompts: list[list[int]], max_new_tokens: int,
               out_dir: str | Path, dtypes: tuple[str, ...] = ("float32", "bfloat16"), k: int = 3,
               clients: tuple[int, ...] = (1,), threads: int = 2, ngram: str | None = "ngram-simple",
               poll: int | None = None, log=print) -> list[dict]:
    """llama.cpp's rows for a peer benchmark (scripts/bench/bench_peers.py's row dicts: engine, row, batch,
    tokens, seconds, tau; `error` for a drafter llama.cpp cannot run): for each dtype, plain decoding
    and each drafter (exported with scripts/export.py format=gguf into out_dir/gguf-<dtype>/<name>,
    drafting k tokens a step) at every concurrency in `clients` (one server with -np N; batch = N,
    wall time of all prompts), plus llama.cpp's own n-gram proposer. Greedy with EOS ignored (every
    row writes max_new_tokens; llama.cpp masks the EOS logit where draftsmith writes EOS and goes on,
    so texts compare within an engine, not across). f32 rows run with f32 KV caches, no flash attention."""
    from draftsmith.models.entry import compose_main
    from scripts.export import run as export

    rows = []
    for dtype in dtypes:
        out = Path(out_dir) / f"gguf-{dtype}"
        engine = f"llama.cpp ({OUTTYPES[dtype]})"
        exact = EXACT_F32 if dtype == "float32" else []
        exports, verifier_gguf = {}, None
        for name, path in drafters.items():
            try:
                r = export(compose_main("export", model_overrides + [f"drafter={path}", "format=gguf",
                                                                     f"dtype={dtype}", f"output_dir={out / name}"]))
            except DraftsmithError as e:
                rows.append({"engine": engine, "row": f"+ {name}", "batch": 1, "error": f"export refused: {e}"})
                continue
            spec = {"eagle3": "draft-eagle3", "draft": "draft-simple"}[r["kind"]]
            exports[name] = (out / name / "drafter.gguf", spec)
            verifier_gguf = out / name / "verifier.gguf"
        if verifier_gguf is None:  # no drafter to export: the verifier alone
            from draftsmith.models.gguf import convert_lm
            from draftsmith.models.verifier import resolve_path

            out.mkdir(parents=True, exist_ok=True)
            verifier_gguf = convert_lm(Path(resolve_path(compose_main("export", model_overrides).model)),
                                       out / "verifier.gguf", OUTTYPES[dtype])
        setups = [("plain", None, None)] + [(f"+ {n}", p, s) for n, (p, s) in exports.items()]
        if ngram:
            setups.append((ngram, None, ngram))
        for row, draft, spec in setups:
            for n in clients:
                argv = server_argv(verifier_gguf, draft, spec, k, parallel=n, threads=threads, args=exact, poll=poll)
                try:
                    with LlamaServer(argv, log=out / f"server-{row.strip('+ ')}-{n}.log") as server:
                        server.run(prompts[:1], min(8, max_new_tokens), 1)  # warm-up
                        r = server.run(prompts, max_new_tokens, n, ignore_eos=True)
                except LlamaCppError as e:
                    rows.append({"engine": engine, "row": row, "batch": n, "error": str(e)})
                    continue
                seconds = sum(c.wall_s for c in r.completions) if n == 1 else r.wall_s
                rows.append({"engine": engine, "row": row, "batch": n, "tokens": [c.tokens for c in r.completions],
                             "seconds": seconds, "tau": r.tau if spec else None,
                             "draft_n": sum(c.draft_n for c in r.completions),
                             "draft_n_accepted": sum(c.draft_n_accepted for c in r.completions)})
                log(f"bench: {engine} {row} N={n}: {sum(len(c.tokens) for c in r.completions) / seconds:.1f} tok/s"
                    + (f", tau {r.tau:.2f}" if spec else ""))
    return rows


def prompt_token_ids(data: str, num_prompts: int | None, tokenizer_dir: str | Path) -> list[list[int]]:
    """A data preset's prompts (conf/data/<data>.yaml: first user turn) as the verifier's chat template
    renders and tokenizes them: the ids draftsmith's own decoder is fed (decode.harness.prompt_ids)."""
    from transformers import AutoTokenizer

    from draftsmith.models.entry import compose_main
    from draftsmith.models.sources import load_prompts

    cfg = compose_main("evaluate", [f"data={data}"])
    prompts = load_prompts(cfg.data)[:num_prompts]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for p in prompts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the verifier GGUF (scripts/export.py format=gguf: verifier.gguf)")
    p.add_argument("--draft", help="a drafter GGUF (drafter.gguf)")
    p.add_argument("--spec-type", help="llama.cpp --spec-type (draft-eagle3, draft-simple, ngram-simple, ...)")
    p.add_argument("--n-draft", type=int, default=3)
    p.add_argument("--prompts", help="a JSON file: a list of token-id lists")
    p.add_argument("--data", help="instead of --prompts: a conf/data preset (mtbench, chitchat, ...), rendered with "
                                  "the verifier's chat template")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--tokenizer", help="with --data: the verifier's HF folder (default: verifier_path in the "
                                       "export.json beside --model)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, nargs="+", default=[1], help="concurrencies (one server with -np N each)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--poll", type=int, default=None, help="llama.cpp's --poll; 0 on a box shared with other work")
    p.add_argument("--ignore-eos", action="store_true", help="never stop at EOS (every request writes "
                                                                 "--max-new-tokens, as scripts/bench/bench_peers.py's rows)")
    p.add_argument("--args", default="", help="more llama-server flags, one string (e.g. '-fa off -ctk f32')")
    p.add_argument("--out", help="write the results here as JSON")
    a = p.parse_args(argv)
    try:
        if (a.prompts is None) == (a.data is None):
            raise DraftsmithError("give one of --prompts (a JSON file of token-id lists) or --data (a data preset)")
        if a.prompts:
            prompts = json.loads(Path(a.prompts).read_text())
            if not (isinstance(prompts, list) and all(isinstance(x, list) and x for x in prompts)):
                raise DraftsmithError(f"--prompts {a.prompts}: expected a JSON list of token-id lists")
            prompts = prompts[:a.num_prompts]
        else:
            info = Path(a.model).parent / "export.json"
            tokenizer = a.tokenizer or (json.loads(info.read_text())["verifier_path"] if info.is_file() else None)
            if tokenizer is None:
                raise DraftsmithError(f"--data needs the verifier's tokenizer: no {info}; pass --tokenizer <HF folder>")
            prompts = prompt_token_ids(a.data, a.num_prompts, tokenizer)
        rows = []
        for n in a.clients:
            argv = server_argv(a.model, a.draft, a.spec_type, a.n_draft, parallel=n, threads=a.threads,
                               args=a.args.split(), poll=a.poll)
            with LlamaServer(argv) as server:
                server.run(prompts[:1], 8, 1)  # warm-up
                r = server.run(prompts, a.max_new_tokens, n, ignore_eos=a.ignore_eos)
            rows.append({"clients": n, "tokens_per_s": r.tokens_per_s, "tau": r.tau, "wall_s": r.wall_s,
                         "completions": [asdict(c) for c in r.completions]})
            print(f"llama.cpp N={n}: {r.tokens_per_s:.1f} tok/s, tau {r.tau:.3f}, {len(prompts)} prompts x "
                  f"{a.max_new_tokens} tokens", flush=True)
    except DraftsmithError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv[1:], "load": os.getloadavg(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
