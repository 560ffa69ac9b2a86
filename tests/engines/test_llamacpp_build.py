"""scripts/engines/llamacpp_build.py on stand-in source trees (a CMake project of a few lines in
place of llama.cpp's, in a scratch DRAFTSMITH_ENGINES): a failed build fails with its reason and
leaves no BUILT marker, a finished one is marked and reused, a half build or one with other flags
is not reused, and the CPU flags never turn AMX on."""
from __future__ import annotations

import pytest

from draftsmith.models.gguf import LlamaCppError, llamacpp_home, llamacpp_source
from scripts.engines import llamacpp_build as build

SERVER = '#include <stdio.h>\nint main(void) { puts("version: stand-in"); return 0; }\n'


def stand_in(tmp_path, monkeypatch, cmake: str):
    monkeypatch.setenv("DRAFTSMITH_ENGINES", str(tmp_path))
    src = llamacpp_source()
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    (src / "CMakeLists.txt").write_text(cmake)
    (src / "server.c").write_text(SERVER)
    (llamacpp_home() / "src" / "UNPACKED").write_text("stand-in\n")


def test_a_failed_build_fails_with_its_reason(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, 'cmake_minimum_required(VERSION 3.14)\nproject(x C)\n'
                                    'message(FATAL_ERROR "no compiler for this CPU")\n')
    with pytest.raises(LlamaCppError) as e:
        build.ensure_built(log=lambda m: None)
    assert "configure failed" in str(e.value) and "no compiler for this CPU" in str(e.value)
    assert not (llamacpp_home() / "BUILT").exists() and build.built() is None
    assert build.main([]) == 2 and build.main(["--check"]) == 1


def test_a_finished_build_is_marked_reused_and_only_then(tmp_path, monkeypatch):
    stand_in(tmp_path, monkeypatch, 'cmake_minimum_required(VERSION 3.14)\nproject(x C)\n'
                                    'add_executable(llama-server server.c)\n'
                                    'set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY '
                                    '${CMAKE_BINARY_DIR}/bin)\n')
    binary = build.ensure_built(log=lambda m: None)
    assert binary.is_file() and build.built()["server_version"] == ["version: stand-in"]
    monkeypatch.setattr(build.subprocess, "call", lambda *a, **k: pytest.fail("a finished build was rebuilt"))
    assert build.ensure_built(log=lambda m: None) == binary and build.main(["--check"]) == 0
    (llamacpp_home() / "BUILT").unlink()  # the binary without its marker: a half build
    assert build.built() is None
    build.write_atomic_text(llamacpp_home() / "BUILT", '{"version": "11434.0.0", "flags": ["-DGGML_NATIVE=ON"]}')
    assert build.built() is None  # built with other flags (another CPU)


def test_cpu_flags_follow_cpuinfo_and_never_amx(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    avx512 = build.cmake_flags("flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert "-DGGML_NATIVE=OFF" in avx512 and "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512_BF16=ON" in avx512
    assert "-DGGML_AVX512_VNNI=OFF" in avx512 and "-DGGML_AMX_TILE=OFF" in avx512 and "-DGGML_AMX_BF16=OFF" in avx512
    old = build.cmake_flags("flags\t\t: fpu sse4_2 avx\n")
    assert "-DGGML_AVX=ON" in old and "-DGGML_AVX2=OFF" in old and "-DGGML_FMA=OFF" in old
