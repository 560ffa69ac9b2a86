"""The GPU device check: every GPU-only path of draftsmith measured in one run of under 8 minutes
(docs/gpu.md). Run it through the shell script, which sets the device and, on the CPU, toy sizes:

    bash scripts/device_check.sh                 # a GPU node: OUT=outputs/device-check
    DEVICE=cpu bash scripts/device_check.sh      # the same stages at toy sizes on the CPU

Stages (`stages`, in this order; each in a child process `scripts/device_check.py stage=<name>`
under its own limit, min(timeouts.<name>, what is left of budget_s); a stage that fails or runs
out of time is recorded with its one-line reason and the next one runs; the run exits 1 at the
end when any stage failed):

  verifier          load the verifier on the device (the first load converts the packaged GGUF)
  device_tests      the decoder's device tests (`device_tests`, pytest): passed / failed counts
  train_medusa      Medusa-1, EAGLE-3 and a draft model trained train.steps steps each in the
  train_eagle3      verifier's dtype, in the stage's own process: tokens/s (the trainer's own),
  train_draft       peak GPU memory, loss at start and end, and the share of a training step
                    spent outside the verifier's forward (every step after the first, synchronised)
  accelerate_1proc  train/medusa.py under `accelerate launch --config_file <launch.accelerate_config>`
  zero3_1proc       ... under DeepSpeed ZeRO-3, one process (<launch.zero3_config> --num_processes 1)
  decode_graph      MT-bench through the engine's graph path (engine.compile; CUDA graphs on a GPU):
                    plain and every trained drafter, against HF generate's StaticCache + compile:
                    tau, tokens/s, greedy identity with the same path's plain decoding
  batched           the engine at N rows (batched.sizes), plain and with one drafter: tokens/s, tau

Writes output_dir/device_check.{json,md} (rewritten after every stage), each stage's log in
output_dir/logs/ and what it trained under output_dir/train/.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftsmith.models.entry import CONF_DIR, config_problem, launch, model_overrides, run_overrides
from draftsmith.models.errors import DraftsmithError, choose

ROOT = CONF_DIR.parent
if str(ROOT) not in sys.path:  # `python scripts/device_check.py` puts scripts/ first; scripts.* needs the root
    sys.path.insert(0, str(ROOT))

TRAINERS = {"medusa": ("medusa", "draftsmith.train.medusa"), "eagle3": ("eagle", "draftsmith.train.eagle"),
            "draft": ("draft", "draftsmith.train.draft")}  # method -> (its config / script name, its module)


def log(msg: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def one_line(text: str) -> str:
    """The one-line reason in a failed process's output: its `draftsmith: error:` line, else its last
    exception line, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    refused = [line for line in lines if line.startswith("draftsmith: error: ")]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b", line)]
    line = (refused[-1].removeprefix("draftsmith: error: ") if refused else raised[-1] if raised
            else lines[-1] if lines else "no output")
    return line[:400]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync(device) -> None:
    from draftsmith.decode.engine import sync_device

    sync_device(device)


def peak_memory(device) -> dict:
    """Peak GPU memory allocated by torch (None on the CPU) and the process's peak RSS, in GB."""
    import torch

    gpu = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"peak_gpu_mem_gb": gpu, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def the_device(cfg):
    import torch

    from draftsmith.models.verifier import resolve_device

    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    return resolve_device(cfg.device)


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*:\s*(.+)$", info.read_text(), re.M) if info.is_file() else []
    return names[0] if names else platform.machine()


# ------------------------------------------------------------------ stages (each runs in its own child)


def stage_verifier(cfg, out: Path) -> dict:
    import torch
    import transformers

    from draftsmith.models.verifier import load_verifier

    device = the_device(cfg)
    t0 = time.perf_counter()
    verifier = load_verifier(cfg.model, device=device)
    seconds = time.perf_counter() - t0
    gpu = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {"load_s": seconds, "name": verifier.name, "fingerprint": verifier.fingerprint,
            "dtype": str(verifier.model.dtype), "device": str(device),
            "device_name": gpu.name if gpu else cpu_name(),
            "gpu_memory_gb": gpu.total_memory / 1e9 if gpu else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "cpus": os.cpu_count()}


def stage_device_tests(cfg, out: Path) -> dict:
    xml = out / "logs" / "device_tests.xml"
    xml.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                           *cfg.device_tests], cwd=ROOT)
    if not xml.is_file():
        raise RuntimeError(f"pytest exited with status {proc.returncode} and wrote no report")
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    result = {"passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
              "failed": count["failures"] + count["errors"], "skipped": count["skipped"], "failed_tests": failed,
              "seconds": time.perf_counter() - t0}
    if result["failed"] or not count["tests"]:
        result["error"] = (f"{result['failed']} of {count['tests']} device tests failed: {', '.join(failed[:4])}"
                           if count["tests"] else f"no device test ran (pytest status {proc.returncode})")
    return result


def refused(config_name: str, args: list[str]) -> None:
    """What the entry script would refuse in these overrides, in one line, before any work.
    config_problem composes in a Hydra context of its own: this process's (the stage's Hydra app)
    is lent aside meanwhile, and restored."""
    from hydra.core.global_hydra import GlobalHydra

    instance = GlobalHydra.instance()
    saved = instance.hydra if instance.is_initialized() else None
    instance.clear()
    try:
        problem = config_problem(config_name, args)
    finally:
        instance.clear()
        if saved is not None:
            instance.initialize(saved)
    if problem:
        raise DraftsmithError(f"train/{config_name}.py: {problem}")


def train_args(cfg, method: str, run_dir: Path) -> list[str]:
    """The overrides of one training run: this check's verifier and data, train.steps steps logged
    every step, evaluated and saved once at the end, no probe."""
    t = cfg.train
    return [*model_overrides(cfg.model), f"data={t.data}", f"data.max_length={t.max_length}",
            f"data.eval_size={t.eval_size}", f"trainer.max_steps={t.steps}", f"trainer.batch_size={t.batch_size}",
            "trainer.log_every=1", f"trainer.eval_every={t.steps}", f"trainer.save_every={t.steps}",
            "trainer.resume=false", "logger=csv", "probe.num_prompts=0",
            *([f"trainer.threads={cfg.threads}"] if cfg.threads else []), *t.methods[method], *t.overrides,
            f"output_dir={run_dir}"]


def loss_summary(run_dir: Path) -> dict:
    """From the run's metrics.csv: its tokens/s (the trainer's own, at the last step) and its loss
    at the start and end (first / last step, and the means of the first and last quarter)."""
    from scripts.bench.bench_train import read_metrics

    metrics = read_metrics(run_dir)
    losses = [v for _, v in metrics["train/loss"]]
    q = max(1, len(losses) // 4)
    first, last = statistics.fmean(losses[:q]), statistics.fmean(losses[-q:])
    return {"steps": len(losses), "tokens_per_s": metrics["train/tokens_per_s"][-1][1], "loss_start": losses[0],
            "loss_end": losses[-1], "loss_first_quarter": first, "loss_last_quarter": last, "loss_fell": last < first}


@dataclasses.dataclass
class StepClock:
    """Wall time of each training step (the recipe's prepare_batch + loss step + backward and
    optimizer step) and of the verifier's forward inside it, the device synchronised at each edge."""

    device: object
    inside: bool = False
    t0: float = 0.0
    verifier_s: float = 0.0
    steps: list = dataclasses.field(default_factory=list)  # (step seconds, verifier seconds)

    def start(self, fn):
        def timed(*args, **kwargs):
            if not self.inside:
                sync(self.device)
                self.inside, self.t0, self.verifier_s = True, time.perf_counter(), 0.0
            return fn(*args, **kwargs)
        return timed

    def end(self, fn):
        def timed(*args, **kwargs):
            result = fn(*args, **kwargs)
            sync(self.device)
            self.steps.append((time.perf_counter() - self.t0, self.verifier_s))
            self.inside = False
            return result
        return timed

    def verifier(self, fn):
        def timed(*args, **kwargs):
            if not self.inside:  # held-out evaluation: not a training step
                return fn(*args, **kwargs)
            sync(self.device)
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            sync(self.device)
            self.verifier_s += time.perf_counter() - t
            return result
        return timed


@contextlib.contextmanager
def clocked(clock: StepClock):
    """The trainers' loop with the clock's edges: every recipe's steps start at its prepare_batch or
    loss step and end after loop.optimizer_step; the verifier's forward is Verifier.hidden_states /
    Verifier.features (what every trainer calls). Restored on exit."""
    from draftsmith.models.verifier import Verifier
    from draftsmith.train.core import loop

    saved = {(loop, "fit"): loop.fit, (loop, "optimizer_step"): loop.optimizer_step,
             (Verifier, "hidden_states"): Verifier.hidden_states, (Verifier, "features"): Verifier.features}
    fit = loop.fit

    def timed_fit(cfg, accelerator, data, recipe):
        before = recipe.prepare_batch
        recipe = dataclasses.replace(recipe, loss_step=clock.start(recipe.loss_step),
                                     prepare_batch=clock.start(before) if before is not None else None)
        return fit(cfg, accelerator, data, recipe)

    loop.fit, loop.optimizer_step = timed_fit, clock.end(loop.optimizer_step)
    Verifier.hidden_states = clock.verifier(Verifier.hidden_states)
    Verifier.features = clock.verifier(Verifier.features)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def stage_train(cfg, out: Path, method: str) -> dict:
    """One trainer in this process, its steps clocked (StepClock)."""
    import importlib

    import torch

    from draftsmith.models.entry import compose_main

    device = the_device(cfg)
    config_name, module = TRAINERS[method]
    run_dir = out / "train" / method
    shutil.rmtree(run_dir, ignore_errors=True)
    args = train_args(cfg, method, run_dir)
    refused(config_name, args)
    trainer = importlib.import_module(module)
    clock = StepClock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with clocked(clock):
        summary = trainer.run(compose_main(config_name, args))
    timed = clock.steps[1:] or clock.steps  # the first step warms up kernels and the allocator
    step_s, verifier_s = sum(s for s, _ in timed), sum(v for _, v in timed)
    return {"script": f"train/{config_name}.py", "overrides": args, "wall_s": time.perf_counter() - t0,
            **loss_summary(run_dir), **peak_memory(device), "step_ms": 1000 * step_s / len(timed),
            "verifier_forward_ms": 1000 * verifier_s / len(timed), "outside_verifier_share": 1 - verifier_s / step_s,
            "drafter": summary["drafter_dir"]}


def stage_launched(cfg, out: Path, kind: str) -> dict:
    """train/medusa.py (train.methods.medusa) through `accelerate launch`: one process, plain or
    DeepSpeed ZeRO-3; its log's start line says where the verifier was placed."""
    launch_cfg = {"accelerate_1proc": [cfg.launch.accelerate_config],
                  "zero3_1proc": [cfg.launch.zero3_config, "--num_processes", "1"]}[kind]
    if not (ROOT / launch_cfg[0]).is_file():
        raise DraftsmithError(f"launch config {launch_cfg[0]} does not exist; pass a file under conf/accelerate/")
    run_dir = out / "train" / kind
    shutil.rmtree(run_dir, ignore_errors=True)
    args = train_args(cfg, "medusa", run_dir)
    refused("medusa", args)
    cmd = ["accelerate", "launch", "--config_file", *launch_cfg, "--main_process_port", str(free_port()),
           "train/medusa.py", *args]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it would drop DeepSpeed
    log_path = out / "logs" / f"{kind}.train.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log_path.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])}: {one_line(text)}")
    start = next((line for line in text.splitlines() if re.search(r"medusa\d: .* trainable params", line)), "")
    placement = re.search(r"\] (.*?); [\d,]+ trainable", start)
    result = {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, **loss_summary(run_dir),
              "placement": placement.group(1) if placement else None}
    if kind == "zero3_1proc" and "ZeRO-3" not in (result["placement"] or ""):
        result["error"] = f"the launch did not run ZeRO-3: the verifier was {result['placement']}"
    return result


def drafter_rows(cfg, out: Path) -> tuple[dict, list[str]]:
    """name -> (proposer preset, tree, folder) of every drafter to decode with, and what is missing."""
    d = cfg.decode
    rows, missing = {}, []
    for name in d.drafters:
        folder = out / "train" / name / "final"
        if not folder.is_dir():
            missing.append(f"{name} (stage train_{name} left no drafter)")
            continue
        rows[name] = (choose(d.proposers, name, "decode.drafters[]"), choose(d.trees, name, "decode.drafters[]"), folder)
    if d.main_drafter:
        if not Path(str(d.main_drafter)).is_dir():
            raise DraftsmithError(f"decode.main_drafter={d.main_drafter}: no such folder; pass the main job's drafter "
                                  f"folder (e.g. outputs/medusa-smollm2-135m/final) or null")
        rows["main"] = (d.main_proposer, d.main_tree, Path(str(d.main_drafter)))
    return rows, missing


def proposers(cfg, out: Path, verifier, names=None) -> tuple[dict, dict, list[str]]:
    """name -> proposer of every drafter to decode with (those in `names`), their rows, what is missing."""
    from draftsmith.decode.build import build_proposer
    from draftsmith.decode.evaluate import evaluate_config

    rows, missing = drafter_rows(cfg, out)
    built = {}
    for name, (proposer, tree, folder) in rows.items():
        if names is None or name in names:
            try:
                ecfg = evaluate_config([f"proposer={proposer}", f"drafter={folder}", f"decode={tree}"], model=cfg.model)
                built[name] = build_proposer(ecfg, verifier)[0]
            except Exception as e:  # this drafter alone: the others still decode
                traceback.print_exc()
                missing.append(f"{name} ({reason(e)})")
    return built, rows, missing


def decode_one(engine, ids: list[int], proposer, max_new_tokens: int):
    request = engine.add(ids, proposer=proposer, max_new_tokens=max_new_tokens)
    try:
        while engine.busy:
            engine.step()
    except Exception:
        engine.reset()  # the engine takes the next row with an empty batch
        raise
    if request.error is not None:
        raise request.error
    return request.result()


def reason(e: Exception) -> str:
    """An exception in one line: a DraftsmithError's message, else its type and its message's first line."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:400]
    if isinstance(e, DraftsmithError):
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def stage_decode_graph(cfg, out: Path) -> dict:
    """MT-bench through the graph path, one row per decoder; a row that fails is recorded with its
    reason and the others go on (one device run shows every fault)."""
    import torch

    from draftsmith.decode.engine import SLOT_BUCKET, Engine, summarize
    from draftsmith.decode.harness import compare_greedy, prompt_ids
    from draftsmith.decode.evaluate import StaticCompiled, hf_generate
    from draftsmith.models.sources import load_prompts
    from draftsmith.models.verifier import load_verifier

    d = cfg.decode
    device = the_device(cfg)
    verifier = load_verifier(cfg.model, device=device)
    model = verifier.model
    prompts = [prompt_ids(verifier.tokenizer, p["messages"])[0].tolist() for p in load_prompts(cfg.data)]
    built, drafters, missing = proposers(cfg, out, verifier)
    rows = {"plain": None, **built}
    longest = max(len(p) for p in prompts)
    engine = Engine(model, max_num_seqs=1, max_len=longest + d.max_new_tokens + 3 * SLOT_BUCKET, forward=d.forward,
                    compile=d.compile, prefill_chunk=1 << 30)
    static = StaticCompiled(model, longest + d.max_new_tokens)
    static.compile_config.backend = d.hf_backend
    hf_cfg = OmegaConf.create({"max_new_tokens": d.max_new_tokens, "temperature": 0.0})

    def hf_static(ids: list[int]) -> tuple[list[int], float]:
        return hf_generate(model, torch.tensor([ids], device=device), hf_cfg, 0, **static.kwargs())

    decoders = {**{name: (lambda ids, p=p: decode_one(engine, ids, p, d.max_new_tokens)) for name, p in rows.items()},
                "hf_static": hf_static}
    warm, errors = {}, {}
    for name, decode in list(decoders.items()):  # compile / capture every row's graphs before timing
        t0 = time.perf_counter()
        try:
            for ids in prompts[: d.warmup_prompts]:
                decode(ids)
        except Exception as e:
            traceback.print_exc()
            errors[name] = reason(e)
            del decoders[name]
        warm[name] = time.perf_counter() - t0
    outputs = {name: [] for name in decoders}  # GenerationOutput, or (tokens, seconds) for HF
    for i, ids in enumerate(prompts):
        order = list(decoders) if i % 2 == 0 else list(reversed(decoders))  # interleaved, who goes first alternates
        for name in order:
            try:
                outputs[name].append(decoders[name](ids))
            except Exception as e:
                traceback.print_exc()
                errors[name] = f"prompt {i}: {reason(e)}"
                del decoders[name], outputs[name]
    result = {"num_prompts": len(prompts), "max_new_tokens": d.max_new_tokens, "compile": d.compile,
              "hf_backend": d.hf_backend, "warmup_s": warm, "rows": {}, "row_errors": errors}
    tokens = {name: [o[0] if name == "hf_static" else o.tokens for o in outs] for name, outs in outputs.items()}
    hf_rate = (sum(map(len, tokens["hf_static"])) / sum(s for _, s in outputs["hf_static"])
               if "hf_static" in outputs else None)
    for name, outs in outputs.items():
        if name == "hf_static":
            stats = {"tokens_per_s": hf_rate, "num_tokens": sum(map(len, tokens[name])),
                     "total_s": sum(s for _, s in outs)}
        else:
            stats = {k: v for k, v in summarize(outs).items() if not isinstance(v, bool)}
        row = {**stats, "vs_hf_static": stats["tokens_per_s"] / hf_rate if hf_rate else None}
        if "plain" in tokens:  # greedy identity with the same path's plain decoding
            checks = [compare_greedy(model, p, ours, ref, d.tie_tolerance, d.tie_ulps)
                      for p, ours, ref in zip(prompts, tokens[name], tokens["plain"])]
            same, ties = sum(c["identical"] for c in checks), sum(bool(c.get("tie")) for c in checks)
            row.update(greedy_identical=same, greedy_ties=ties, greedy_unexplained=len(checks) - same - ties)
        result["rows"][name] = row
    for name, (proposer, tree, folder) in drafters.items():
        if name in result["rows"]:
            result["rows"][name].update(proposer=proposer, tree=tree, drafter=str(folder))
    problems = [f"{name}: {why}" for name, why in errors.items()] + [f"no drafter: {m}" for m in missing]
    if problems:
        result["error"] = "; ".join(problems)
    return result


def stage_batched(cfg, out: Path) -> dict:
    """At each N: N rows plain, then N rows with the drafter (forks of one proposer), each run once
    untimed (its shapes) and once timed; a cell that fails is recorded and the others go on."""
    from draftsmith.decode.engine import SLOT_BUCKET, Engine, summarize
    from draftsmith.decode.harness import prompt_ids
    from draftsmith.models.sources import load_prompts
    from draftsmith.models.verifier import load_verifier

    b = cfg.batched
    device = the_device(cfg)
    verifier = load_verifier(cfg.model, device=device)
    prompts = [prompt_ids(verifier.tokenizer, p["messages"])[0].tolist() for p in load_prompts(cfg.data)]
    built, _, missing = proposers(cfg, out, verifier, names=[b.drafter])
    if b.drafter not in built:
        why = next((m for m in missing if m.startswith(f"{b.drafter} ")), None)
        valid = ", ".join([*cfg.decode.drafters, "main"])
        raise DraftsmithError(f"batched.drafter={b.drafter}: " + (f"no drafter: {why}" if why else
                              f"not decoded in this run; valid: {valid} (main with decode.main_drafter)"))
    # cache slots: a prompt, its new tokens and a tree, and room for a step's padding: rows reading their
    # prompts in one step are padded to the widest chunk (up to prefill_chunk tokens) past their own length
    engine = Engine(verifier.model, max_num_seqs=max(b.sizes), forward=cfg.decode.forward, compile=b.compile,
                    prefill_chunk=PREFILL_CHUNK, max_len=max(len(p) for p in prompts) + b.max_new_tokens
                    + PREFILL_CHUNK + 3 * SLOT_BUCKET)

    def run_rows(n: int, proposer) -> tuple[list, float]:
        sync(device)
        t0 = time.perf_counter()
        requests = [engine.add(prompts[i % len(prompts)], max_new_tokens=b.max_new_tokens,
                               proposer=None if proposer is None else proposer.fork()) for i in range(n)]
        try:
            while engine.busy:
                engine.step()
        except Exception:
            engine.reset()
            raise
        sync(device)
        for r in requests:
            if r.error is not None:
                raise r.error
        return [r.result() for r in requests], time.perf_counter() - t0

    result = {"drafter": b.drafter, "max_new_tokens": b.max_new_tokens, "compile": b.compile, "sizes": {}}
    errors = []
    for n in b.sizes:
        row, tokens = {}, {}
        for kind, proposer in [("plain", None), ("spec", built[b.drafter])]:
            try:
                run_rows(n, proposer)  # warm-up: this batch shape's graphs
                outs, seconds = run_rows(n, proposer)
            except Exception as e:
                traceback.print_exc()
                row[kind] = {"error": reason(e)}
                errors.append(f"N={n} {kind}: {reason(e)}")
                continue
            stats = summarize(outs)
            tokens[kind] = [o.tokens for o in outs]
            row[kind] = {"tokens_per_s": stats["num_tokens"] / seconds, "tau": stats["tau"],
                         "num_tokens": stats["num_tokens"], "wall_s": seconds}
        if len(tokens) == 2:
            row["spec"]["speedup"] = row["spec"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            row["spec"]["greedy_identical_rows"] = sum(a == s for a, s in zip(tokens["plain"], tokens["spec"]))
        result["sizes"][str(n)] = row
    if device.type == "cuda":
        result.update(peak_memory(device))
    if errors:
        result["error"] = "; ".join(errors)
    return result


PREFILL_CHUNK = 512  # the batched engine's prompt tokens per step (Engine's default)

STAGES = {"verifier": stage_verifier, "device_tests": stage_device_tests,
          "train_medusa": lambda cfg, out: stage_train(cfg, out, "medusa"),
          "train_eagle3": lambda cfg, out: stage_train(cfg, out, "eagle3"),
          "train_draft": lambda cfg, out: stage_train(cfg, out, "draft"),
          "accelerate_1proc": lambda cfg, out: stage_launched(cfg, out, "accelerate_1proc"),
          "zero3_1proc": lambda cfg, out: stage_launched(cfg, out, "zero3_1proc"),
          "decode_graph": stage_decode_graph, "batched": stage_batched}


def run_stage_here(cfg, out: Path) -> dict:
    """A child: one stage; its result (with `error` when it failed) -> output_dir/stages/<stage>.json."""
    stage = choose(STAGES, cfg.stage, "stage")
    try:
        result = stage(cfg, out)
    except Exception as e:  # recorded with its one-line reason; the traceback stays in the stage's log
        traceback.print_exc()
        result = {"error": reason(e)}
    (out / "stages" / f"{cfg.stage}.json").write_text(json.dumps(result, indent=2, default=str))
    if result.get("error"):
        print(f"draftsmith: error: {cfg.stage}: {result['error']}", file=sys.stderr, flush=True)
        sys.exit(1)
    return result


# ------------------------------------------------------------------ the run (the parent)


def toy_verifier(out: Path) -> list[str]:
    """toy_verifier=true (DEVICE=cpu): the tests' tiny random Llama (tests/tiny.py: 2 layers, hidden
    32, a character tokenizer with a chat template) saved into output_dir/toy-verifier, and the
    overrides that make every stage use it."""
    import torch

    from tests.tiny import tiny_llama, tiny_tokenizer

    folder = out / "toy-verifier"
    tiny_llama(dtype=torch.float32).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return ["model.name=toy", "model.source=hf", f"model.path={folder}"]


def child_overrides(cfg) -> list[str]:
    """The parent's own command-line overrides, for every child (stage= replaced)."""
    overrides = run_overrides()
    if overrides is None:
        raise DraftsmithError("stage=null runs the stages as children with this run's overrides: start it as "
                              "`python scripts/device_check.py ...` (or bash scripts/device_check.sh)")
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "stage"]


def run_child(cfg, name: str, limit: float, out: Path, env: dict, overrides: list[str]) -> dict:
    """One stage in a child process (its own session: on timeout the whole group is killed)."""
    result_file = out / "stages" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    log_path = out / "logs" / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "scripts" / "device_check.py"), f"stage={name}", *overrides]
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
            reason = None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reason = (f"timed out after {limit:.0f} s (timeouts.{name}={cfg.timeouts[name]} x timeout_scale="
                      f"{cfg.timeout_scale}, budget_s={cfg.budget_s})")
    seconds = time.perf_counter() - t0
    result = json.loads(result_file.read_text()) if result_file.is_file() and reason is None else {}
    if reason is None and proc.returncode != 0:
        reason = result.get("error") or f"exited with status {proc.returncode}: {one_line(log_path.read_text())}"
    result.pop("error", None)
    return {"status": "failed" if reason else "ok", "reason": reason, "seconds": seconds, "limit_s": limit,
            "log": str(log_path.relative_to(out)), **result}


def check_config(cfg) -> None:
    for name in cfg.stages:
        choose(STAGES, name, "stages[]")
        if name not in cfg.timeouts:
            raise DraftsmithError(f"timeouts.{name} is not set; give every stage a limit in seconds")
    if not cfg.timeout_scale > 0:
        raise DraftsmithError(f"timeout_scale={cfg.timeout_scale}: must be > 0 (it multiplies every stage's timeout)")
    if len(set(cfg.stages)) < len(cfg.stages):
        raise DraftsmithError(f"stages={list(cfg.stages)} names a stage twice; name each once")
    for name in cfg.decode.drafters:
        choose(TRAINERS, name, "decode.drafters[]")
    choose({**{n: n for n in cfg.decode.drafters}, "main": "main"}, cfg.batched.drafter, "batched.drafter")


def targets(report: dict, cfg) -> list[dict]:
    """The targets docs/gpu.md sets, judged on this run's numbers (None: a stage they need failed)."""
    out = []
    rows = report["stages"].get("decode_graph", {}).get("rows", {})
    hf, plain = rows.get("hf_static", {}).get("tokens_per_s"), rows.get("plain", {}).get("tokens_per_s")
    main = "main" if "main" in rows else "medusa"
    spec = rows.get(main, {}).get("tokens_per_s")
    out.append({"target": f"graph-path plain decoding >= {cfg.targets.graph_vs_hf_static}x HF static cache + compile",
                "value": plain / hf if plain and hf else None, "met": plain / hf >= cfg.targets.graph_vs_hf_static
                if plain and hf else None})
    out.append({"target": f"speculation with the main drafter ({main}) >= {cfg.targets.spec_vs_hf_static}x HF static "
                          f"cache + compile", "value": spec / hf if spec and hf else None,
                "met": spec / hf >= cfg.targets.spec_vs_hf_static if spec and hf else None})
    for method in TRAINERS:
        stage = report["stages"].get(f"train_{method}", {})
        value = (f"loss {stage['loss_first_quarter']:.4g} -> {stage['loss_last_quarter']:.4g} at "
                 f"{stage['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in stage else None)
        out.append({"target": f"{method}: the training loss falls (mean of the last quarter of steps below the "
                              f"first quarter's)", "value": value, "met": stage.get("loss_fell")})
    return out


def fmt(x, spec: str = ".1f") -> str:
    if x is None or isinstance(x, bool):
        return {None: "-", True: "yes", False: "no"}[x]
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def markdown(report: dict) -> str:
    st = report["stages"]
    v = st.get("verifier", {})
    lines = [f"# Device check: {v.get('device_name', report['device'])} ({report['device']})", "",
             f"{report['model']} in {report['dtype']}, torch {v.get('torch', '-')}, CUDA {v.get('cuda') or '-'}, "
             f"transformers {v.get('transformers', '-')}; {report['wall_s']:.0f} s of budget {report['budget_s']} s; "
             f"failed stages: {', '.join(report['failed']) or 'none'}", "",
             "| stage | status | seconds (limit) | result |", "|---|---|---|---|"]
    for name, s in st.items():
        what = s.get("reason") or ""
        if name == "device_tests" and "passed" in s:
            what = f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped" + (f"; {what}" if what else "")
        elif name.startswith(("train_", "accelerate_", "zero3_")) and "tokens_per_s" in s:
            what = (f"{s['tokens_per_s']:.0f} tok/s, loss {s['loss_start']:.4g} -> {s['loss_end']:.4g}"
                    + (f", {s['placement']}" if s.get("placement") else "") + (f"; {what}" if what else ""))
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.0f} ({s['limit_s']:.0f}) | {what} |")
    train = {n: st[n] for n in st if n.startswith("train_") and "tokens_per_s" in st[n]}
    if train:
        lines += ["", "| trainer | steps | tokens/s | peak GPU GB | peak RSS GB | loss start -> end | "
                      "step ms | verifier forward ms | outside the verifier forward |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for n, s in train.items():
            lines.append(f"| {n} | {s['steps']} | {s['tokens_per_s']:.0f} | {fmt(s['peak_gpu_mem_gb'], '.2f')} | "
                         f"{s['peak_rss_gb']:.2f} | {s['loss_start']:.4g} -> {s['loss_end']:.4g} | "
                         f"{s['step_ms']:.1f} | {s['verifier_forward_ms']:.1f} | {s['outside_verifier_share']:.0%} |")
    rows = st.get("decode_graph", {}).get("rows")
    if rows:
        d = st["decode_graph"]
        lines += ["", f"MT-bench x{d['num_prompts']}, {d['max_new_tokens']} new tokens, greedy; engine.compile="
                      f"{d['compile']}, HF static cache + compile backend {d['hf_backend']}", "",
                  "| row | tau | tokens/s | vs HF static | greedy identical / ties / unexplained (vs plain) |",
                  "|---|---|---|---|---|"]
        for name, r in rows.items():
            same = (f"{r['greedy_identical']} / {r['greedy_ties']} / {r['greedy_unexplained']}"
                    if "greedy_identical" in r else "- (plain failed)")
            lines.append(f"| {name} | {fmt(r.get('tau'), '.2f')} | {r['tokens_per_s']:.1f} | "
                         f"{fmt(r['vs_hf_static'], '.2f')}x | {same} |")
        for name, why in d.get("row_errors", {}).items():
            lines.append(f"| {name} | failed: {why} | | | |")
    sizes = st.get("batched", {}).get("sizes")
    if sizes:
        b = st["batched"]
        lines += ["", f"Batched engine (engine.compile={b['compile']}), drafter {b['drafter']}, "
                      f"{b['max_new_tokens']} new tokens a row", "",
                  "| N | plain tok/s | spec tok/s | spec tau | speedup | identical rows |", "|---|---|---|---|---|---|"]
        for n, r in sizes.items():
            plain, spec = r.get("plain", {}), r.get("spec", {})
            lines.append(f"| {n} | {fmt(plain.get('tokens_per_s')) if 'error' not in plain else 'failed'} | "
                         f"{fmt(spec.get('tokens_per_s')) if 'error' not in spec else 'failed'} | "
                         f"{fmt(spec.get('tau'), '.2f')} | {fmt(spec.get('speedup'), '.2f')}x | "
                         f"{fmt(spec.get('greedy_identical_rows'), 'd')}/{n} |")
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {fmt(t['value'], '.2f')} | {fmt(t['met'])} |" for t in report["targets"]]
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "device_check.md").write_text(markdown(report) + "\n")


def run(cfg: DictConfig) -> dict:
    out = Path(cfg.output_dir).absolute()
    if cfg.stage is None:
        check_config(cfg)
    for sub in ("stages", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    if cfg.stage is not None:
        return run_stage_here(cfg, out)
    from draftsmith.models.verifier import resolve_device

    device = resolve_device(cfg.device)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "USE_HUB_KERNELS": "NO"}
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # every stage on the CPU, whatever the machine has
        if not cfg.toy_verifier:
            log("device=cpu at the GPU sizes: stages will run past their limits; DEVICE=cpu bash "
                "scripts/device_check.sh runs toy sizes")
    overrides = child_overrides(cfg) + (toy_verifier(out) if cfg.toy_verifier else [])
    report = {"device": str(device), "model": "toy (a tiny random Llama)" if cfg.toy_verifier else cfg.model.name,
              "dtype": cfg.model.dtype, "budget_s": cfg.budget_s,
              "stages": {}, "failed": [], "targets": [], "wall_s": 0.0,
              "config": OmegaConf.to_container(cfg, resolve=True)}
    t0 = time.monotonic()
    for i, name in enumerate(cfg.stages, 1):
        left = cfg.budget_s - (time.monotonic() - t0)
        timeout = float(cfg.timeouts[name]) * cfg.timeout_scale
        limit = min(timeout, left)
        if left < min(timeout, 5.0):  # nothing useful fits in what is left
            stage = {"status": "failed", "reason": f"not run: {max(left, 0):.0f} s of budget_s={cfg.budget_s} left",
                     "seconds": 0.0, "limit_s": max(limit, 0.0)}
        else:
            log(f"{i}/{len(cfg.stages)} {name} (limit {limit:.0f} s, log {out / 'logs' / name}.log)")
            stage = run_child(cfg, name, limit, out, env, overrides)
        report["stages"][name] = stage
        report["failed"] = [n for n, s in report["stages"].items() if s["status"] != "ok"]
        report["wall_s"] = time.monotonic() - t0
        report["targets"] = targets(report, cfg)
        write(report, out)
        why = f": {stage['reason']}" if stage["reason"] else ""
        log(f"{name}: {stage['status']} in {stage['seconds']:.0f} s{why}")
    print(markdown(report), flush=True)
    log(f"-> {out / 'device_check.json'}, {out / 'device_check.md'}")
    if report["failed"]:
        log(f"failed stages: {', '.join(report['failed'])}")
        sys.exit(1)
    return report


if __name__ == "__main__":
    launch("device_check", run)
