"""Multi-process training on CPU (DDP over gloo), launched the way users launch it."""
import os
import subprocess
from pathlib import Path

import pytest

from models.checkpoint import load_drafter
from tests.conftest import tiny_model_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _launch(tiny_model_dir, out, env_extra):
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml", "--main_process_port", "29533",
           "train/medusa.py", *tiny_model_overrides(tiny_model_dir), "data=tiny", "trainer=debug", "logger=none",
           "method.num_heads=2", f"output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    return subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", **env_extra},
                          capture_output=True, text=True, timeout=300)


def test_two_processes_train_with_ddp(tiny_model_dir, tmp_path):
    proc = _launch(tiny_model_dir, tmp_path / "out", {"ACCELERATE_USE_CPU": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    # 10 train conversations in batches of 2 = 5 batches, sharded over 2 ranks = 3 per rank
    assert "3 batches/epoch" in out and out.count("medusa done") == 1
    kind, _, config, meta = load_drafter(tmp_path / "out" / "final")
    assert kind == "medusa" and meta["metrics"]["step"] == 3


def test_processes_that_cannot_see_each_other_are_refused(tiny_model_dir, tmp_path):
    proc = _launch(tiny_model_dir, tmp_path / "out", {})
    assert proc.returncode != 0
    assert "ACCELERATE_USE_CPU=1" in proc.stderr
    assert not (tmp_path / "out" / "final").exists()
