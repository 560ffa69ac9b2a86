"""An OpenAI-compatible HTTP server over the lossless speculative decoder.

    python decode/serve.py drafter=outputs/medusa-smollm2-135m/final proposer=medusa decode=medusa-cpu
    python decode/serve.py proposer=vanilla                                 # the plain baseline
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Endpoints: POST /v1/chat/completions (the verifier's chat template), POST /v1/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus text; speculative counters named like
vLLM's spec_decode_*). With an API key (`api_key=` or $DRAFTSMITH_API_KEY) every endpoint but
/health (and /metrics with open_metrics=true) needs `Authorization: Bearer <key>`; else 401.
Parameters: max_tokens, temperature, top_p, top_k (extra field), seed, stop, n, stream
(+ stream_options.include_usage); responses carry usage and are built from the `openai`
package's own types.

Concurrency: continuous batching. The engine thread decodes up to `engine.max_num_seqs` rows
together (decode/engine.py: every row's tree verified in one forward, each row accepted under
its own sampling parameters and seeded generator, so a seeded request is reproducible whatever
its neighbours); each choice of a request (n) is a row; rows join and leave at every step and a
prompt is read in chunks of `engine.prefill_chunk` tokens beside the rows that decode. How much
each row drafts is `engine.budget` (fixed | adaptive: speculation steps aside as the batch
grows; its choices are in /metrics). Requests beyond the rows wait in a bounded queue
(`max_queue`; past it: 429). A streaming client that disconnects, or a request past
`request_timeout_s`, leaves at the next step, freeing its row. Each step's accepted tokens are
streamed as soon as they are accepted; text is held back while it ends inside a multi-byte
character or could still become a stop string. A row whose proposer raises fails that request
alone (500, naming the cause); the others go on.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from omegaconf import DictConfig
from pydantic import BaseModel, ConfigDict, Field

from draftsmith.decode.budget import make_budget
from draftsmith.decode.engine import SLOT_BUCKET, Engine
from draftsmith.decode.forward import kv_shape
from draftsmith.decode.build import build_proposer, check_drafter
from draftsmith.decode.probe import read_probe
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import load_verifier, resolve_device

# ------------------------------------------------------------------ request schemas (strict: bad input -> 400)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    """The parameters both endpoints share; limits checked against the server's config later."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # extra field (vLLM's): 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(Sampling):
    prompt: str


# ------------------------------------------------------------------ the engine thread


@dataclass(eq=False)  # hashed by identity: the engine thread keys its bookkeeping on jobs
class Job:
    """One request's decoding work; `events` receives ("tokens", [ids]) / ("done", info) from the engine."""
    prompt_ids: torch.Tensor  # (1, T)
    params: dict  # max_new_tokens, temperature, top_p, top_k
    stop: list[str]
    n: int
    seed: int
    deadline: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)


def deliver(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    """In the HTTP event loop: a turn's events of the engine loop, to their jobs' queues in order."""
    for queue_, event in events:
        queue_.put_nowait(event)


class Metrics:
    """Prometheus counters: requests, tokens, verifier forwards, drafts and accepted tokens per depth."""

    def __init__(self, max_depth: int, probe_tau: float | None = None):
        self.lock = threading.Lock()
        self.probe_tau = probe_tau  # the drafter's tau recorded at training (its probe.json), if any
        self.counts = {"requests_total": 0, "request_errors_total": 0, "requests_rejected_total": 0,
                       "requests_cancelled_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
                       "verifier_forwards_total": 0, "verification_steps_total": 0, "spec_decode_num_drafts_total": 0,
                       "spec_decode_num_draft_tokens_total": 0, "spec_decode_num_accepted_tokens_total": 0}
        self.per_pos = [0] * max_depth
        self.gauges = {"batch_rows": 0, "batch_width": 0, "batch_drafting_rows": 0, "waiting_requests": 0}
        self.widths: dict[int, int] = {}  # step width -> decoding steps (the budget policy's choices)
        self.counts["engine_steps_total"] = 0
        self.counts["prompt_tokens_beside_decoding_total"] = 0  # prompt chunks read in the decoding rows' forward

    def step(self, engine) -> None:
        """After an engine step: the batch it ran (rows, width, rows that drafted) and what waits."""
        last = engine.last_step
        with self.lock:
            self.gauges["waiting_requests"] = len(engine.waiting)
            if last:
                self.counts["engine_steps_total"] += 1
                self.counts["prompt_tokens_beside_decoding_total"] += last["prompt_tokens"]
                self.gauges.update(batch_rows=last["rows"], batch_width=last["width"],
                                   batch_drafting_rows=last["drafting"])
                self.widths[last["width"]] = self.widths.get(last["width"], 0) + 1
                engine.last_step = {}

    def add(self, **counts) -> None:
        with self.lock:
            for key, value in counts.items():
                self.counts[key] += value

    def record(self, out) -> None:
        with self.lock:
            self.counts["prompt_tokens_total"] += out.prompt_len
            self.counts["generation_tokens_total"] += len(out.tokens)
            self.counts["verifier_forwards_total"] += 1 + len(out.steps)  # the prefill, then one per step
            self.counts["verification_steps_total"] += len(out.steps)
            for s in out.steps:
                if s.num_nodes > 1:
                    self.counts["spec_decode_num_drafts_total"] += 1
                    self.counts["spec_decode_num_draft_tokens_total"] += s.num_nodes - 1
                self.counts["spec_decode_num_accepted_tokens_total"] += s.accepted
                for d in range(min(s.accepted, len(self.per_pos))):
                    self.per_pos[d] += 1

    def text(self) -> str:
        with self.lock:
            c, per_pos = dict(self.counts), list(self.per_pos)
            gauges, widths = dict(self.gauges), dict(self.widths)
        lines = []
        for key, value in c.items():
            lines += [f"# TYPE draftsmith:{key} counter", f"draftsmith:{key} {value}"]
        lines.append("# TYPE draftsmith:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [f'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{{position="{d}"}} {v}'
                  for d, v in enumerate(per_pos)]
        for key, value in gauges.items():
            lines += [f"# TYPE draftsmith:{key} gauge", f"draftsmith:{key} {value}"]
        lines.append("# HELP draftsmith:engine_steps_by_width_total decoding steps by the width the budget chose")
        lines.append("# TYPE draftsmith:engine_steps_by_width_total counter")
        lines += [f'draftsmith:engine_steps_by_width_total{{width="{w}"}} {n}' for w, n in sorted(widths.items())]
        steps = c["verification_steps_total"]
        mean = (c["spec_decode_num_accepted_tokens_total"] + steps) / steps if steps > 0 else float("nan")
        lines += ["# HELP draftsmith:spec_decode_mean_acceptance_length tokens per verification step (tau)",
                  "# TYPE draftsmith:spec_decode_mean_acceptance_length gauge",
                  f"draftsmith:spec_decode_mean_acceptance_length {mean}"]
        if self.probe_tau is not None:  # the baseline: a served tau far below it asks for scripts/refresh.py
            lines += ["# HELP draftsmith:drafter_probe_tau the drafter's probe tau recorded at training",
                      "# TYPE draftsmith:drafter_probe_tau gauge", f"draftsmith:drafter_probe_tau {self.probe_tau}"]
        return "\n".join(lines) + "\n"


class Server:
    """The verifier, the proposer and the engine loop: continuous batching of every request's
    choices (decode.engine.Engine, up to engine.max_num_seqs rows), fed from a bounded queue.
    thread=True runs the loop in a thread of its own (tests, your own app); `run` (the script) runs
    it in the main thread with the HTTP server in a thread (serve_forever)."""

    def __init__(self, cfg: DictConfig, thread: bool = True):
        self.cfg = cfg
        check_drafter(cfg)  # a missing drafter folder: refused before the verifier loads
        device = resolve_device(cfg.device)
        self.verifier = load_verifier(cfg.model, device=device)
        self.model, self.tokenizer = self.verifier.model, self.verifier.tokenizer
        self.proposer, self.drafter_meta = build_proposer(cfg, self.verifier)  # each row decodes with a fork
        self.name = cfg.served_model_name or cfg.model.name
        probe = read_probe(cfg.drafter) if self.proposer is not None and Path(str(cfg.drafter)).is_dir() else None
        rows = int(cfg.engine.max_num_seqs)
        longest = int(cfg.max_prompt_tokens) + int(cfg.max_tokens_limit) + 2 * SLOT_BUCKET
        check_memory(self.model, rows, longest, device)
        self.engine = Engine(self.model, max_num_seqs=rows, max_len=min(longest, 1024), forward=cfg.engine.forward,
                             prefill_chunk=int(cfg.engine.prefill_chunk), invariant=cfg.engine.invariant,
                             compile=cfg.engine.compile, weights=cfg.engine.weights)
        self.engine.budget = make_budget(cfg.engine.budget, self.engine.forward, rows)
        self.metrics = Metrics(self.proposer.max_depth if self.proposer is not None else 0,
                               None if probe is None else probe["tau"])
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=int(cfg.max_queue))
        self.live: dict = {}  # engine request -> (job, choice index)
        self.pending: dict = {}  # job -> choices not yet finished
        self.outbox: list[tuple[Job, str, object]] = []  # this turn's events, handed over once the step is done
        self.stopping = threading.Event()  # set: the loop ends after its current step
        if thread:
            threading.Thread(target=self.work, daemon=True, name="draftsmith-engine").start()

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def work(self, keep_going=lambda: True) -> None:
        """The engine loop: admit queued jobs, step every live row, hand out what finished; until
        `stopping` is set or keep_going() is false."""
        while not self.stopping.is_set() and keep_going():
            try:
                self._turn()
            finally:
                self._post()

    def _turn(self) -> None:
        try:
            self._admit(block=not self.live)
            self._cancel_gone()
            finished = self.engine.step() if self.engine.busy else []
        except Exception as e:  # noqa: BLE001 - the step itself failed: every live request hears it, the
            self.engine.reset()  # rows are dropped and the server goes on with the next requests
            self.live.clear()
            for job in list(self.pending):
                self._fail(job, f"{type(e).__name__}: {e}")
            return
        for request in finished:
            self._finish(request)
        self.metrics.step(self.engine)

    def _emit(self, job: Job, kind: str, payload) -> None:
        self.outbox.append((job, kind, payload))

    def _post(self) -> None:
        """Hand the turn's events to the HTTP event loop(s): one wake-up per loop and step, not one per
        row (16 rows: 16 cross-thread wake-ups a step, each taking the GIL from the engine thread)."""
        by_loop: dict = {}
        for job, kind, payload in self.outbox:
            by_loop.setdefault(job.loop, []).append((job.events, (kind, payload)))
        self.outbox = []
        for loop, events in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a loop already closed (its app is gone): nobody listens
                loop.call_soon_threadsafe(deliver, events)

    def _admit(self, block: bool) -> None:
        """Take queued jobs while rows are free (waiting for one when nothing decodes)."""
        while not self.engine.waiting and len(self.live) < self.engine.max_num_seqs:
            try:
                job = self.jobs.get(block=block, timeout=IDLE_POLL_S if block else 0)
            except queue.Empty:
                return
            block = False
            if job.cancelled.is_set() or time.monotonic() > job.deadline:
                self._cancelled(job)
                continue
            self.pending[job] = job.n
            try:
                for index in range(job.n):
                    self._start(job, index)
            except Exception as e:  # noqa: BLE001 - this request alone fails, naming the cause
                self._fail(job, f"{type(e).__name__}: {e}")

    def _start(self, job: "Job", index: int) -> None:
        generator = torch.Generator(device=self.model.device).manual_seed(job.seed + index)

        def on_tokens(tokens: list[int]) -> bool:
            self._emit(job, "tokens", (index, tokens))
            return not job.cancelled.is_set() and time.monotonic() <= job.deadline

        proposer = self.proposer.fork() if self.proposer is not None else None
        request = self.engine.add(job.prompt_ids[0].tolist(), proposer=proposer, generator=generator,
                                  acceptance=serving_rule(self.cfg, job.params["temperature"]),
                                  stop_strings=job.stop or None, tokenizer=self.tokenizer, on_tokens=on_tokens,
                                  **job.params)
        self.live[request] = (job, index)

    def _cancel_gone(self) -> None:
        """A client gone, or a request past its deadline: its rows leave at this step."""
        now = time.monotonic()
        for request, (job, _) in list(self.live.items()):
            if job.cancelled.is_set() or now > job.deadline:
                self.engine.cancel(request)

    def _finish(self, request) -> None:
        job, index = self.live.pop(request)
        if job not in self.pending:
            return  # the job failed or was cancelled through another of its choices
        if request.error is not None:
            self._fail(job, f"{type(request.error).__name__}: {request.error}")
            return
        self.metrics.record(request.result())
        if request.stop.reason == "cancelled":
            self._cancelled(job)
            return
        self._emit(job, "finished", (index, request.stop.reason, len(request.prompt)))
        self.pending[job] -= 1
        if not self.pending[job]:
            del self.pending[job]
            self._emit(job, "done", None)

    def _drop(self, job: "Job") -> None:
        self.pending.pop(job, None)
        for request, (other, _) in list(self.live.items()):
            if other is job:
                self.engine.cancel(request)

    def _cancelled(self, job: "Job") -> None:
        self._drop(job)
        self.metrics.add(requests_cancelled_total=1)
        self._emit(job, "cancelled", "timeout" if time.monotonic() > job.deadline else "client gone")

    def _fail(self, job: "Job", message: str) -> None:
        self._drop(job)
        self.metrics.add(request_errors_total=1)
        self._emit(job, "error", message)


IDLE_POLL_S = 0.5  # an idle engine loop looks at `stopping` this often


def serve_forever(engine: Server, app, cfg: DictConfig) -> None:
    """uvicorn in a thread, the engine loop in this one (the main thread). A step run from another
    thread took ~1.7x as long on the CPU boxes (69 against 40 ms a token, bf16 SmolLM2, 2 threads):
    torch's OpenMP team of the main thread stays hot between parallel regions, a thread's own team
    does not. SIGINT / SIGTERM end both; an HTTP server that cannot start ends the run in one line."""
    import signal

    import uvicorn

    http = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=int(cfg.port), log_level=cfg.log_level))

    def run_http():
        with contextlib.suppress(SystemExit):  # uvicorn exits when it cannot start; it logged why
            http.run()

    thread = threading.Thread(target=run_http, daemon=True, name="draftsmith-http")

    def stop(*_):
        http.should_exit = True
        engine.stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread.start()
    try:
        engine.work(keep_going=thread.is_alive)
    finally:
        stop()
        thread.join(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not http.started:
        raise DraftsmithError(f"the HTTP server did not start on {cfg.host}:{cfg.port} (its reason is above); "
                              f"pick another port= or host=")


def serving_rule(cfg: DictConfig, temperature: float) -> str:
    """The acceptance rule of a request: greedy at temperature 0; above, cfg.acceptance, whose
    `auto` here is coupled sampling (decode/sampling.py: the tokens of plain sampling with the
    request's seed, whatever the drafts and the batch: a seeded request is reproducible)."""
    acceptance = cfg.acceptance
    if temperature == 0:
        return "auto"
    return "coupled" if acceptance == "auto" else acceptance


def check_memory(model, rows: int, max_len: int, device: torch.device) -> None:
    """Refuse, in one line before any work, a KV cache of rows x max_len slots that cannot fit."""
    import psutil

    layers, kv_heads, head_dim = kv_shape(model)
    need = 2 * layers * kv_heads * head_dim * model.dtype.itemsize * rows * max_len
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if need > 0.9 * free:
        raise DraftsmithError(f"engine.max_num_seqs={rows} rows x {max_len} slots (max_prompt_tokens + "
                              f"max_tokens_limit + a tree) need {need / 1e9:.1f} GB of KV cache and {free / 1e9:.1f} GB "
                              f"are free: lower engine.max_num_seqs, max_prompt_tokens or max_tokens_limit")


# ------------------------------------------------------------------ text: streaming detokenization


class TextStream:
    """Incremental text of a growing token list: never cut inside a multi-byte character, and
    never past text that could still turn out to be (the start of) a stop string. Each push decodes
    only the new tokens, beside the previous push's as context (a tokenizer may write a token
    differently at the start of a text): a push costs the same at token 4,000 as at token 4."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""  # the text of tokens[:read]
        self.context = self.read = 0  # tokens[context:read] are decoded again beside the new ones
        self.sent = 0  # characters already sent
        self.longest_stop = max(map(len, stop), default=0)

    def _decode(self, final: bool) -> None:
        """Extend `text` with the tokens past `read`, unless they end inside a character (and more may come)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.tokens[self.context:self.read])
        after = decode(self.tokens[self.context:])
        if after.startswith(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.context, self.read = self.read, len(self.tokens)
        elif not after.startswith(before):  # the tokenizer rewrote the context: decode the whole text again
            text = decode(self.tokens)
            if final or not text.endswith("\ufffd"):
                self.text, self.context, self.read = text, self.read, len(self.tokens)

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        self._decode(final=False)
        text, end = self.text, len(self.text)
        for s in self.stop:  # hold back a suffix that is a prefix of a stop string
            for k in range(min(len(s), end - self.sent), 0, -1):
                if s.startswith(text[end - k:end]):
                    end -= k
                    break
        cut = first_stop(text, self.stop, start=max(0, self.sent - self.longest_stop))
        end = min(end, cut) if cut is not None else end
        piece, self.sent = text[self.sent:max(end, self.sent)], max(end, self.sent)
        return piece

    def finish(self) -> str:
        self._decode(final=True)
        cut = first_stop(self.text, self.stop, start=max(0, self.sent - self.longest_stop))
        text = self.text if cut is None else self.text[:cut]
        piece, self.sent = text[self.sent:], max(len(text), self.sent)
        return piece


def first_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Where the first stop string in text[start:] begins (an index into text), or None."""
    hits = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ------------------------------------------------------------------ who may call the server
# Self-contained: an ASGI middleware in front of the whole app, a key resolved once at start. The
# engine and the endpoints know nothing of it.

API_KEY_ENV = "DRAFTSMITH_API_KEY"
API_KEY_ARG = "api_key="
ALWAYS_OPEN = ("/health",)  # liveness probes never carry a key


def resolve_api_key(cfg: DictConfig, environ=os.environ) -> str | None:
    """The key requests must carry: `api_key`, else $DRAFTSMITH_API_KEY, else None (no key: open).
    A key that HTTP cannot carry as typed is refused in one line that never shows the key."""
    key, source = cfg.get("api_key"), "api_key"
    if key is None:
        key, source = environ.get(API_KEY_ENV), f"${API_KEY_ENV}"
    if key is None:
        if cfg.get("open_metrics"):
            raise DraftsmithError(f"open_metrics=true would be ignored: without an API key (api_key= or "
                                  f"${API_KEY_ENV}) every endpoint is open; drop open_metrics or set a key")
        return None
    if not isinstance(key, str):  # composed by Hydra, api_key=12345 is a number and api_key=1e3 is 1000.0
        raise DraftsmithError(f"{source} must be text, not a {type(key).__name__}: quote it "
                              f"(api_key=\"'...'\") or pass it in ${API_KEY_ENV}")
    if not key:
        raise DraftsmithError(f"{source} is set but empty: set a key, or unset it to serve without one")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise DraftsmithError(f"{source} holds a space, a control or a non-ASCII character, which an HTTP "
                              f"Authorization header cannot carry as typed; use printable ASCII")
    return key


def take_api_key_argument(argv: list[str], environ=os.environ) -> list[str]:
    """argv without `api_key=...`, whose value moves to $DRAFTSMITH_API_KEY verbatim: Hydra then
    never parses it (a key of digits stays text; one holding `,` or `=` is no grammar error, which
    Hydra would print with the key in it) and never prints it (its crash report lists every override)."""
    rest = []
    for arg in argv:
        if arg.startswith(API_KEY_ARG):
            value = arg[len(API_KEY_ARG):]
            if value.startswith(("'", '"')) and len(value) >= 2 and value[-1] == value[0]:
                value = value[1:-1]  # api_key="'0123'": Hydra's quoting, taken off as Hydra would
            if value == "null":  # api_key=null: the yaml's own "no key from the command line"
                continue
            environ[API_KEY_ENV] = value
        else:
            rest.append(arg)
    return rest


def bearer_matches(header: bytes | None, key: bytes) -> bool:
    """Does an Authorization header value carry `Bearer <key>`? Constant-time in the key."""
    scheme, _, token = (header or b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class ApiKeyAuth:
    """ASGI middleware: a request to any path but `open_paths` without `Authorization: Bearer
    <key>` gets a 401 with an OpenAI-style error body (the openai client raises AuthenticationError)."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...]):
        self.app, self.key, self.open_paths = app, key.encode("ascii"), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        if bearer_matches(header, self.key):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        message = ("this server needs an API key: send the header 'Authorization: Bearer <key>' (the openai "
                   "client's api_key)" if header is None else
                   "incorrect API key: send the server's key as 'Authorization: Bearer <key>'")
        body = error_body(message, None, "invalid_request_error", "invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def require_api_key(app, cfg: DictConfig) -> str | None:
    """Put ApiKeyAuth in front of `app` when a key is set; -> a line describing who may call."""
    key = resolve_api_key(cfg)
    if key is None:
        return None
    open_paths = ALWAYS_OPEN + (("/metrics",) if cfg.get("open_metrics") else ())
    app.add_middleware(ApiKeyAuth, key=key, open_paths=open_paths)
    return f"API key required (except {', '.join(open_paths)})"


def is_loopback(host: str) -> bool:
    """Does `host` (an address or a name) reach this machine only? Unresolvable names: no."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def exposure_warning(host: str, port: int, key: str | None) -> str | None:
    """One line when the server listens beyond this machine with no key; None otherwise."""
    if key is not None or is_loopback(str(host)):
        return None
    return (f"draftsmith serve: warning: host={host} listens beyond this machine and no API key is set: anyone who "
            f"can reach port {port} may use this server; set ${API_KEY_ENV} (or api_key=), or host=127.0.0.1")


# ------------------------------------------------------------------ the app


FINISH = {"eos": "stop", "stop_string": "stop", "length": "length"}


def make_app(engine: "Server", cfg: DictConfig):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from openai.types import Completion, CompletionChoice, CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice
    from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

    app = FastAPI(title="draftsmith", version="0.1.0")
    app.state.access = require_api_key(app, cfg)  # who may call: self-contained, in front of every route
    created = int(time.time())

    def bad(message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"):
        return JSONResponse(error_body(message, param, kind), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            return bad(f"malformed JSON body: {err.get('msg')}", None)
        if err.get("type") == "extra_forbidden":
            return bad(f"unknown field {param!r}: remove it (this server takes model, messages or prompt, max_tokens, "
                       f"temperature, top_p, top_k, seed, stop, n, stream, stream_options, user)", param)
        return bad(f"{param}: {err.get('msg')} (got {json.dumps(err.get('input'), default=str)[:80]})", param)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "queued": engine.jobs.qsize(), "busy": engine.busy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": created,
                                             "owned_by": "draftsmith", "root": str(cfg.model.path),
                                             "verifier_fingerprint": engine.verifier.fingerprint,
                                             "drafter": cfg.drafter if engine.proposer is not None else None}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    def check(req: Sampling, prompt_ids: torch.Tensor, prompt_param: str):
        if req.model != engine.name:
            return bad(f"model {req.model!r} is not served here; GET /v1/models lists {engine.name!r}", "model",
                       status=400)
        if req.max_tokens is not None and req.max_tokens > int(cfg.max_tokens_limit):
            return bad(f"max_tokens={req.max_tokens} exceeds this server's max_tokens_limit={cfg.max_tokens_limit}",
                       "max_tokens")
        if prompt_ids.shape[1] > int(cfg.max_prompt_tokens):
            return bad(f"the prompt has {prompt_ids.shape[1]} tokens, more than max_prompt_tokens="
                       f"{cfg.max_prompt_tokens}; shorten it", prompt_param)
        if req.stream_options is not None and not req.stream:
            return bad("stream_options needs stream=true", "stream_options")
        return None

    def submit(req: Sampling, prompt_ids: torch.Tensor):
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        params = {"max_new_tokens": req.max_tokens or int(cfg.default_max_tokens), "temperature": req.temperature,
                  "top_p": req.top_p, "top_k": req.top_k}
        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, params, stop, req.n, seed, time.monotonic() + float(cfg.request_timeout_s), loop,
                  asyncio.Queue())
        try:
            engine.jobs.put_nowait(job)
        except queue.Full:
            engine.metrics.add(requests_rejected_total=1)
            return None, bad(f"the server is at capacity ({cfg.max_queue} requests queued); retry later", None,
                             status=429, kind="rate_limit_error")
        engine.metrics.add(requests_total=1)
        return job, None

    async def collect(job: Job):
        """Wait for a whole job -> ([tokens per choice], [finish reason per choice], prompt_len) or an error."""
        tokens = [[] for _ in range(job.n)]
        finish = [None] * job.n
        while True:
            kind, payload = await job.events.get()
            if kind == "tokens":
                tokens[payload[0]] += payload[1]
            elif kind == "finished":
                finish[payload[0]] = FINISH[payload[1]]
            elif kind == "done":
                return tokens, finish, None
            elif kind == "cancelled":
                return tokens, finish, bad(f"the request exceeded request_timeout_s={cfg.request_timeout_s}",
                                           None, status=504, kind="timeout")
            else:
                return tokens, finish, bad(f"decoding failed: {payload}", None, status=500, kind="server_error")

    def texts(tokens: list[int], stop: list[str]) -> str:
        stream = TextStream(engine.tokenizer, stop)
        return stream.push(tokens) + stream.finish()

    async def stream_events(job: Job, make_chunk, include_usage: bool, usage_chunk):
        streams = [TextStream(engine.tokenizer, job.stop) for _ in range(job.n)]
        completion = 0
        try:
            yield make_chunk(0, None, None, role=True)
            while True:
                kind, payload = await job.events.get()
                if kind == "tokens":
                    index, tokens = payload
                    completion += len(tokens)
                    piece = streams[index].push(tokens)
                    if piece:
                        yield make_chunk(index, piece, None)
                elif kind == "finished":
                    index, reason, prompt_len = payload
                    yield make_chunk(index, streams[index].finish(), FINISH[reason])
                elif kind == "done":
                    if include_usage:
                        yield usage_chunk(job.prompt_ids.shape[1], completion)
                    yield "data: [DONE]\n\n"
                    return
                else:
                    message = (f"the request exceeded request_timeout_s={cfg.request_timeout_s}" if kind == "cancelled"
                               else f"decoding failed: {payload}")
                    yield f"data: {json.dumps(error_body(message, None, 'timeout' if kind == 'cancelled' else 'server_error'))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled.set()  # a client gone mid-stream frees the engine at its next step

    def usage(prompt: int, completion: int) -> CompletionUsage:
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def sse(obj) -> str:
        return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"

    async def respond(req: Sampling, ids: torch.Tensor, param: str, chunk, usage_chunk, final):
        """Check, queue, then stream `chunk(index, text, finish[, role])` events or return final(tokens, finish)."""
        refused = check(req, ids, param)
        if refused is not None:
            return refused
        job, refused = submit(req, ids.to(engine.model.device))
        if refused is not None:
            return refused
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream_events(job, chunk, include, usage_chunk), media_type="text/event-stream")
        try:
            tokens, finish, error = await collect(job)
        finally:
            job.cancelled.set()
        if error is not None:
            return error
        texts_ = [texts(t, job.stop) for t in tokens]
        return final(texts_, finish, usage(ids.shape[1], sum(map(len, tokens)))).model_dump(exclude_none=True)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        from draftsmith.decode.harness import prompt_ids

        ids = prompt_ids(engine.tokenizer, [m.model_dump() for m in req.messages])
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": engine.name}

        def chunk(index, text, finish, role=False):
            delta = ChoiceDelta(role="assistant", content="") if role else ChoiceDelta(content=text)
            return sse(ChatCompletionChunk(object="chat.completion.chunk", **head,
                                           choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish)]))

        def usage_chunk(prompt, completion):
            return sse(ChatCompletionChunk(object="chat.completion.chunk", **head, choices=[],
                                           usage=usage(prompt, completion)))

        def final(texts_, finish, use):
            choices = [Choice(index=i, finish_reason=finish[i],
                              message=ChatCompletionMessage(role="assistant", content=t)) for i, t in enumerate(texts_)]
            return ChatCompletion(object="chat.completion", **head, choices=choices, usage=use)

        return await respond(req, ids, "messages", chunk, usage_chunk, final)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        ids = torch.tensor([engine.tokenizer(req.prompt, add_special_tokens=True)["input_ids"]], dtype=torch.long)
        if ids.shape[1] == 0:
            return bad("prompt is empty", "prompt")
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": engine.name}

        def chunk(index, text, finish, role=False):
            if role:
                return ""
            body = {"object": "text_completion", **head,
                    "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": None}]}
            return f"data: {json.dumps(body)}\n\n"

        def usage_chunk(prompt, completion):
            return sse(Completion(object="text_completion", **head, choices=[], usage=usage(prompt, completion)))

        def final(texts_, finish, use):
            choices = [CompletionChoice(index=i, text=t, finish_reason=finish[i]) for i, t in enumerate(texts_)]
            return Completion(object="text_completion", **head, choices=choices, usage=use)

        return await respond(req, ids, "prompt", chunk, usage_chunk, final)

    return app


def run(cfg: DictConfig) -> dict:
    key = resolve_api_key(cfg)  # a bad key setting: refused before the verifier loads
    warning = exposure_warning(cfg.host, cfg.port, key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    engine = Server(cfg, thread=False)
    app = make_app(engine, cfg)
    drafter = f"{cfg.proposer.name} drafter {cfg.drafter} (decode={cfg.decode.name})" if engine.proposer is not None \
        else "no drafter (proposer=vanilla: plain decoding)"
    print(f"draftsmith serve: http://{cfg.host}:{cfg.port}/v1  model {engine.name!r} = verifier "
          f"{engine.verifier.name} [{engine.verifier.fingerprint}] in {engine.model.dtype} on {engine.model.device}; "
          f"{drafter}; "
          f"continuous batching of up to {cfg.engine.max_num_seqs} rows (engine.forward={engine.engine.forward.name}, "
          f"engine.budget={cfg.engine.budget}) behind a queue of {cfg.max_queue}; {app.state.access or 'no API key'}",
          flush=True)
    serve_forever(engine, app, cfg)
    return {"url": f"http://{cfg.host}:{cfg.port}/v1"}


if __name__ == "__main__":
    sys.argv[1:] = take_api_key_argument(sys.argv[1:])  # the key never reaches Hydra's parser or its reports
    try:
        launch("serve", run)
    except DraftsmithError as e:  # pragma: no cover - launch already prints one line
        raise SystemExit(str(e)) from None
