"""Multi-process training on CPU (DDP over gloo), launched the way users launch it."""
import json
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


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_fsdp_shards_the_frozen_verifier_and_keeps_its_outputs(tmp_path, tied):
    """FSDP2 on 2 gloo processes: each holds part of the verifier, hidden states are unchanged.
    (accelerate's FSDP launch needs GPUs; this runs the same shard_fsdp under torchrun.)"""
    out = tmp_path / "fsdp.json"
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", "29535", "-m", "tests.train.fsdp_worker",
           str(out), tied]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["how"] == "FSDP-sharded (3 layers) over 2 processes"
    assert result["local"] < 0.6 * result["total"]
    assert result["max_diff"] == 0.0 and result["lm_head_is_plain"]


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_every_launch_config_loads_and_names_itself(path):
    """Each launch config parses with accelerate's own loader, shows its launch command, and
    any DeepSpeed file it names exists and leaves the batch fields to trainer.* ("auto")."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert f"--config_file conf/accelerate/{path.name}" in path.read_text().splitlines()[0] + \
        path.read_text().splitlines()[1]
    ds_file = (config.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file:
        ds = json.loads((ROOT / ds_file).read_text())
        assert all(ds[k] == "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                             "train_batch_size", "gradient_clipping"))
        assert "mixed_precision" not in path.read_text()  # accelerate refuses it beside a DeepSpeed file


def test_deepspeed_batch_fields_come_from_the_trainer_config():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from models.errors import DraftsmithError
    from train.core.accel import fill_deepspeed_config

    def acc(ds):
        return SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
            deepspeed_config=ds)))

    trainer = OmegaConf.create({"batch_size": 8, "split_batches": True, "grad_accum": 3, "max_grad_norm": 1.0})
    a = acc({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})
    fill_deepspeed_config(a, trainer)
    assert a.state.deepspeed_plugin.deepspeed_config == {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "train_batch_size": 24,
        "gradient_clipping": 1.0}
    with pytest.raises(DraftsmithError, match="sets train_micro_batch_size_per_gpu=16 but the trainer config means 4"):
        fill_deepspeed_config(acc({"train_micro_batch_size_per_gpu": 16}), trainer)


@pytest.mark.parametrize("script,extra,launch_config,env_extra", [
    ("train/eagle.py", ["method=eagle3", "method.draft_vocab_size=64", "method.noise=0"], "cpu-2proc.yaml",
     {"ACCELERATE_USE_CPU": "1"}),
    ("train/eagle.py", ["method=eagle3", "method.draft_vocab_size=64", "method.noise=0"], "cpu-2proc-zero3.yaml", {}),
    ("train/draft.py", ["method=draft-tvd", "method.student.num_layers=1", "trainer.lr=1e-2"], "cpu-2proc-zero3.yaml",
     {}),
], ids=["eagle3-ddp", "eagle3-zero3", "draft-zero3"])
def test_eagle_and_draft_trainers_match_one_process_too(tiny_model_dir, tmp_path, script, extra, launch_config,
                                                        env_extra):
    """EAGLE-3 (training-time test: several drafter forwards per backward, reduced vocabulary)
    and draft distillation (the whole student trained, the truncated copy of a ZeRO-3-sharded
    verifier) give the 1-process result on 2 processes. Feature noise off: each process would
    draw its own."""
    outs = {}
    for name, launcher, env in [("one", ["python"], {}),
                                ("two", ["accelerate", "launch", "--config_file", f"conf/accelerate/{launch_config}",
                                         "--main_process_port", "29538"], env_extra)]:
        out = tmp_path / name
        cmd = [*launcher, script, *tiny_model_overrides(tiny_model_dir), "data=tiny", "trainer=debug", "logger=none",
               "trainer.batch_size=4", "trainer.split_batches=true", "trainer.max_steps=4", *extra,
               f"output_dir={out}"]
        base = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
        proc = subprocess.run(cmd, cwd=ROOT, env={**base, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[name] = load_file(out / "final" / "model.safetensors")
    for key, ref in outs["one"].items():
        torch.testing.assert_close(outs["two"][key], ref, rtol=1e-4, atol=1e-5, msg=key)


def test_deepspeed_bf16_trains(tiny_model_dir, tmp_path):
    """DeepSpeed bf16 holds the trained module in bf16 and accelerate's autocast is off under
    DeepSpeed: the trainers cast their fp32 verifier features to the module's dtype."""
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc-zero2.yaml", "--main_process_port",
           "29539", "train/medusa.py", *tiny_model_overrides(tiny_model_dir), *EQUIV[:-1], "trainer.max_steps=2",
           "trainer.precision=bf16", f"output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_drafter(tmp_path / "out" / "final")[3]["metrics"]["step"] == 2
