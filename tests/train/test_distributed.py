"""Multi-process training on CPU (DDP over gloo), launched the way users launch it."""
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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


# The same global batch of 4 (split over the processes), 6 steps = 3 epochs of 2 full batches.
EQUIV = ["data=tiny", "trainer=debug", "logger=none", "method.num_heads=2", "trainer.batch_size=4",
         "trainer.split_batches=true", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def one_process_heads(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-process")
    cmd = ["python", "train/medusa.py", *tiny_model_overrides(tiny_model_dir), *EQUIV, f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "final" / "model.safetensors")


@pytest.mark.parametrize("launch_config,env_extra,placement", [
    ("cpu-2proc.yaml", {"ACCELERATE_USE_CPU": "1"}, "replicated on cpu"),
    ("cpu-2proc-zero2.yaml", {}, "replicated on cpu"),
    ("cpu-2proc-zero3.yaml", {}, "ZeRO-3 sharded over 2 processes (13,392 of 26,784 params held here)"),
])
def test_two_processes_train_the_same_heads_as_one(one_process_heads, tiny_model_dir, tmp_path, launch_config,
                                                   env_extra, placement):
    """DDP, DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes, global batch 4 split in halves, end
    with the heads of a 1-process run (rounding aside), across epoch boundaries; ZeRO-3 also
    partitions the frozen verifier (half of its parameters per process)."""
    out = tmp_path / "out"
    cmd = ["accelerate", "launch", "--config_file", f"conf/accelerate/{launch_config}", "--main_process_port",
           "29534", "train/medusa.py", *tiny_model_overrides(tiny_model_dir), *EQUIV, f"output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", **env_extra}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert placement in log and log.count("medusa done") == 1
    heads = load_file(out / "final" / "model.safetensors")
    assert heads.keys() == one_process_heads.keys()
    for name, ref in one_process_heads.items():
        torch.testing.assert_close(heads[name], ref, rtol=1e-4, atol=1e-5, msg=name)
    _, _, _, meta = load_drafter(out / "final")
    assert meta["metrics"]["step"] == 6
