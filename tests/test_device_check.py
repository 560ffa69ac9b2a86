"""`DEVICE=cpu bash scripts/device_check.sh` end to end: every stage at toy size on the CPU (the tests'
tiny random verifier, in bf16) runs in its child and reports its numbers in device_check.json; a
broken stage (a refused override, a stage past its time limit) is recorded as failed with its
one-line reason, the next stage still runs, and the exit status is non-zero."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts.device_check import one_line
from tests.conftest import tiny_model_overrides

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STAGES = yaml.safe_load((ROOT / "conf" / "device_check.yaml").read_text())["stages"]


def device_check(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(out)}
    proc = subprocess.run(["bash", "scripts/device_check.sh", *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    report = json.loads((out / "device_check.json").read_text()) if (out / "device_check.json").is_file() else {}
    return proc, report


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.heavy
def test_every_stage_runs_and_reports_its_numbers(tmp_path):
    proc, report = device_check(tmp_path / "out")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert list(report["stages"]) == STAGES and report["failed"] == [] and report["model"].startswith("toy")
    for name in STAGES:
        assert f"{name}: ok in" in proc.stdout, name  # progress, stage by stage
    st = report["stages"]
    assert all(s["status"] == "ok" and s["reason"] is None and 0 < s["seconds"] <= s["limit_s"] for s in st.values())
    assert number(st["verifier"]["load_s"]) and st["verifier"]["device"] == "cpu" and st["verifier"]["fingerprint"]
    assert (st["device_tests"]["passed"], st["device_tests"]["failed"]) == (3, 0)
    for method in ("medusa", "eagle3", "draft"):
        s = st[f"train_{method}"]
        assert s["steps"] == 4 and s["peak_gpu_mem_gb"] is None, method  # the CPU: no GPU memory to report
        for key in ("tokens_per_s", "loss_start", "loss_end", "peak_rss_gb", "step_ms", "verifier_forward_ms"):
            assert number(s[key]) and s[key] >= 0, (method, key, s[key])
        # the verifier's forward was clocked inside the steps: a share strictly between 0 and 1
        assert 0 < s["verifier_forward_ms"] < s["step_ms"] and 0 < s["outside_verifier_share"] < 1, (method, s)
        assert (Path(s["drafter"]) / "config.json").is_file()
    assert st["accelerate_1proc"]["placement"] == "replicated on cpu"
    assert st["zero3_1proc"]["placement"].startswith("ZeRO-3 sharded over 1 processes")
    for name in ("accelerate_1proc", "zero3_1proc"):
        assert number(st[name]["tokens_per_s"]) and number(st[name]["loss_end"]) and st[name]["steps"] == 4
    rows = st["decode_graph"]["rows"]
    assert list(rows) == ["plain", "medusa", "eagle3", "draft", "hf_static"]
    assert rows["plain"]["tau"] == 1.0 and rows["hf_static"]["vs_hf_static"] == 1.0
    for name, r in rows.items():
        assert number(r["tokens_per_s"]) and r["tokens_per_s"] > 0, name
        assert r["greedy_identical"] + r["greedy_ties"] + r["greedy_unexplained"] == 2, name
        if name != "hf_static":
            assert r["tau"] >= 1.0 and r["num_tokens"] > 0, name
    assert st["decode_graph"]["compile"] == "count" and rows["eagle3"]["tree"] == "eagle-dynamic"
    sizes = st["batched"]["sizes"]
    assert list(sizes) == ["1", "8", "32"]
    for n, r in sizes.items():
        assert r["plain"]["num_tokens"] == 4 * int(n) and r["plain"]["tau"] == 1.0, n  # 4 new tokens a row
        spec = r["spec"]
        assert number(spec["tokens_per_s"]) and spec["tau"] >= 1.0 and spec["greedy_identical_rows"] <= int(n), n
    assert [t["value"] is not None for t in report["targets"]] == [True] * 5
    table = (tmp_path / "out" / "device_check.md").read_text()
    assert "| decode_graph | ok |" in table and "| hf_static |" in table and "| 32 |" in table
    assert "failed stages: none" in table


@pytest.mark.heavy
def test_a_broken_stage_is_recorded_and_the_next_one_runs(tmp_path):
    """EAGLE-3 refused by its trainer (a mistyped override) and the draft stopped at a 1-second
    limit: both failed with their one-line reasons, the launch after them trained, and decoding
    measured plain decoding and HF's static path while naming the drafter it did not have; exit 1."""
    proc, report = device_check(tmp_path / "out", "stages=[train_eagle3,train_draft,accelerate_1proc,decode_graph]",
                                "timeout_scale=1", "timeouts.train_draft=1", "decode.drafters=[eagle3]",
                                "train.methods.eagle3=['method=eagle3','method.draft_vocab_size=lots']")
    assert proc.returncode == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    st = report["stages"]
    assert report["failed"] == ["train_eagle3", "train_draft", "decode_graph"]
    assert st["train_eagle3"]["reason"] == ("train/eagle.py: method.draft_vocab_size='lots': expected a number, like "
                                            "the default (method.draft_vocab_size=8192)")
    assert st["train_draft"]["reason"].startswith("timed out after 1 s (timeouts.train_draft=1")
    assert st["accelerate_1proc"]["status"] == "ok" and number(st["accelerate_1proc"]["tokens_per_s"])
    assert st["decode_graph"]["reason"] == "no drafter: eagle3 (stage train_eagle3 left no drafter)"
    assert list(st["decode_graph"]["rows"]) == ["plain", "hf_static"]  # what it could measure, it measured
    assert all(number(r["tokens_per_s"]) for r in st["decode_graph"]["rows"].values())
    assert "failed stages: train_eagle3, train_draft, decode_graph" in proc.stdout
    assert "| train_draft | failed |" in (tmp_path / "out" / "device_check.md").read_text()


def test_a_decoder_that_fails_is_recorded_and_the_others_are_measured(tiny_model_dir, tmp_path, monkeypatch):
    """decode_graph in this process: HF's static path raising on every call leaves plain decoding
    measured, the failure named in row_errors and the stage's reason."""
    from scripts import device_check
    from tests.hub import compose_config

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nCompile with TORCH_USE_CUDA_DSA to enable device-side "
                           "assertions.")

    monkeypatch.setattr("draftsmith.decode.evaluate.hf_generate", out_of_memory)
    cfg = compose_config("device_check", tiny_model_overrides(tiny_model_dir) + [
        "device=cpu", "data.num_prompts=2", "decode.max_new_tokens=4", "decode.compile=none", "decode.drafters=[]",
        f"output_dir={tmp_path}"])
    result = device_check.stage_decode_graph(cfg, tmp_path)
    assert result["row_errors"] == {"hf_static": "RuntimeError: CUDA error: out of memory"}
    assert result["error"] == "hf_static: RuntimeError: CUDA error: out of memory"
    assert list(result["rows"]) == ["plain"] and result["rows"]["plain"]["num_tokens"] == 8
    assert result["rows"]["plain"]["vs_hf_static"] is None and result["rows"]["plain"]["greedy_identical"] == 2


def test_an_unknown_stage_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/device_check.py", "stages=[verifier,decode_grpah]",
                           f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "draftsmith: error: stages[]='decode_grpah' is not known; valid: accelerate_1proc, batched, decode_graph, ")


def test_the_one_line_reason_of_a_failed_process():
    assert one_line("Traceback ...\n  File x\nValueError: bad\n") == "ValueError: bad"
    assert one_line("noise\ndraftsmith: error: medusa.py: data.path is missing\ntorch.OutOfMemoryError: x\n") == (
        "medusa.py: data.path is missing")
    assert one_line("a\n\nlast words\n") == "last words" and one_line("") == "no output"
