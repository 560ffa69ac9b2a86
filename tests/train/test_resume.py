"""Exact resume: a run killed with SIGKILL mid-epoch and re-run with the same command ends
with weights identical to an uninterrupted run."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_model_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _command(tiny_model_dir, out):
    # 40 steps over a 10-conversation split in batches of 4: several epochs, resumes mid-epoch.
    return [sys.executable, "train/medusa.py", *tiny_model_overrides(tiny_model_dir), "data=tiny",
            "trainer=debug", "trainer.max_steps=40", "trainer.batch_size=4", "trainer.save_every=5",
            "trainer.eval_every=20", "trainer.keep_last=3", "trainer.schedule=cosine", "trainer.warmup_steps=4",
            "logger=none", "method.num_heads=2", f"output_dir={out}"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_sigkill_then_rerun_matches_uninterrupted(tiny_model_dir, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(_command(tiny_model_dir, straight), cwd=ROOT, env=_env(), check=True, capture_output=True)

    proc = subprocess.Popen(_command(tiny_model_dir, killed), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step-00000010").is_dir():  # mid-run, before the end
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists()  # it really died before finishing
    done = sorted(p.name for p in (killed / "checkpoints").glob("step-*"))
    assert done and done[-1] < "step-00000040"

    rerun = subprocess.run(_command(tiny_model_dir, killed), cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming from" in rerun.stdout + rerun.stderr

    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(killed / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
