"""Multi-process training on CPU (DDP over gloo), launched the way users launch it."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.models.checkpoint import load_drafter
from tests.hub import free_port  # a port per launch: fixed ones collide between xdist workers
from tests.conftest import tiny_model_overrides
from tests.tiny import save_tiny_verifier

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _launch(tiny_model_dir, out, env_extra):
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml",
           "--main_process_port", str(free_port()),
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
    assert "3 batches/epoch" in out and out.count("medusa1 done") == 1
    kind, _, config, meta = load_drafter(tmp_path / "out" / "final")
    assert kind == "medusa" and meta["metrics"]["step"] == 3


@pytest.mark.heavy
def test_processes_that_cannot_see_each_other_are_refused(tiny_model_dir, tmp_path):
    proc = _launch(tiny_model_dir, tmp_path / "out", {})
    assert proc.returncode != 0
    assert "ACCELERATE_USE_CPU=1" in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


# The same global batch of 4 (split over the processes), 6 steps = 3 epochs of 2 full batches.
EQUIV = ["data=tiny", "trainer=debug", "logger=none", "method.num_heads=2", "trainer.batch_size=4",
         "trainer.split_batches=true", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A tiny verifier with tied embeddings, as SmolLM2 has (a tied lm_head.weight is the
    embedding: under ZeRO-3 it is partitioned under both names)."""
    return save_tiny_verifier(tmp_path_factory.mktemp("tied-verifier"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def verifier_fingerprint(tied_model_dir):
    from omegaconf import OmegaConf

    from draftsmith.models.verifier import load_verifier

    return load_verifier(OmegaConf.create({"name": "tiny", "source": "hf", "path": str(tied_model_dir)})).fingerprint


@pytest.fixture(scope="module")
def one_process_heads(tied_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-process")
    cmd = ["python", "train/medusa.py", *tiny_model_overrides(tied_model_dir), *EQUIV, f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "final" / "model.safetensors"), out / "final"


def loads_in_the_evaluator(drafter_dir, model_dir) -> str:
    """decode/build.py's proposer construction (fingerprint check included) -> the
    fingerprint the drafter recorded."""
    from draftsmith.decode.build import build_proposer
    from draftsmith.models.verifier import load_verifier
    from tests.hub import compose_config

    cfg = compose_config("evaluate", [*tiny_model_overrides(model_dir), "proposer=medusa", f"drafter={drafter_dir}",
                                      "decode=chain4", "decode.paths=[[0],[0,0]]"])
    proposer, meta = build_proposer(cfg, load_verifier(cfg.model))
    assert proposer is not None
    return meta["verifier_fingerprint"]


@pytest.mark.heavy
@pytest.mark.parametrize("launch_config,env_extra,placement", [
    ("cpu-2proc.yaml", {"ACCELERATE_USE_CPU": "1"}, "replicated on cpu"),
    ("cpu-2proc-zero2.yaml", {}, "replicated on cpu"),
    ("cpu-2proc-zero3.yaml", {}, "ZeRO-3 sharded over 2 processes (11,344 of 22,688 params held here)"),
])
def test_two_processes_train_the_same_heads_as_one(one_process_heads, tied_model_dir, verifier_fingerprint, tmp_path,
                                                   launch_config, env_extra, placement):
    """DDP, DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes, global batch 4 split in halves, end
    with the heads of a 1-process run (rounding aside), across epoch boundaries; ZeRO-3 also
    partitions the frozen verifier (half of its parameters per process). Every run records the
    verifier's one fingerprint, however it was loaded and sharded, and loads in the evaluator."""
    reference, one_dir = one_process_heads
    out = tmp_path / "out"
    cmd = ["accelerate", "launch", "--config_file", f"conf/accelerate/{launch_config}", "--main_process_port",
           str(free_port()), "train/medusa.py", *tiny_model_overrides(tied_model_dir), *EQUIV, f"output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", **env_extra}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert placement in log and log.count("medusa1 done") == 1
    heads = load_file(out / "final" / "model.safetensors")
    assert heads.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(heads[name], ref, rtol=1e-4, atol=1e-5, msg=name)
    _, _, _, meta = load_drafter(out / "final")
    assert meta["metrics"]["step"] == 6
    assert loads_in_the_evaluator(one_dir, tied_model_dir) == verifier_fingerprint
    assert loads_in_the_evaluator(out / "final", tied_model_dir) == verifier_fingerprint


@pytest.mark.heavy
def test_offline_features_record_the_same_fingerprint(tied_model_dir, verifier_fingerprint, tmp_path):
    """Heads trained from stored features carry the fingerprint of the verifier that wrote them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    model = tiny_model_overrides(tied_model_dir)
    prep = subprocess.run(["python", "scripts/prepare_features.py", *model, "data=tiny", f"output_dir={tmp_path / 'f'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    train = subprocess.run(["python", "train/medusa.py", *model, *EQUIV, f"data.features={tmp_path / 'f'}",
                            f"output_dir={tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert loads_in_the_evaluator(tmp_path / "out" / "final", tied_model_dir) == verifier_fingerprint


@pytest.mark.heavy
def test_a_launch_that_would_drop_deepspeed_is_refused(tied_model_dir, tmp_path):
    """ACCELERATE_USE_CPU=1 (right for the DDP config) makes accelerate drop DeepSpeed from a
    ZeRO-3 launch and train with DDP: the trainer stops in one line saying so."""
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc-zero3.yaml", "--main_process_port",
           str(free_port()), "train/medusa.py", *tiny_model_overrides(tied_model_dir), *EQUIV, f"output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("draftsmith: error: the launch asked for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but accelerate would "
            "run MULTI_CPU without it; unset ACCELERATE_USE_CPU") in proc.stderr
    assert not (tmp_path / "final").exists()


@pytest.mark.heavy
@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_fsdp_shards_the_frozen_verifier_and_keeps_its_outputs(tmp_path, tied):
    """FSDP2 on 2 gloo processes: each holds part of the verifier, hidden states are unchanged.
    (accelerate's FSDP launch needs GPUs; this runs the same shard_fsdp under torchrun.)"""
    out = tmp_path / "fsdp.json"
    cmd = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "tests.train.fsdp_worker",
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

    from draftsmith.models.errors import DraftsmithError
    from draftsmith.train.core.accel import fill_deepspeed_config

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


@pytest.mark.heavy
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
                                         "--main_process_port", str(free_port())], env_extra)]:
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


@pytest.mark.heavy
def test_deepspeed_bf16_trains(tiny_model_dir, tmp_path):
    """DeepSpeed bf16 holds the trained module in bf16 and accelerate's autocast is off under
    DeepSpeed: the trainers cast their fp32 verifier features to the module's dtype."""
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc-zero2.yaml", "--main_process_port",
           str(free_port()), "train/medusa.py", *tiny_model_overrides(tiny_model_dir), *EQUIV[:-1],
           "trainer.max_steps=2", "trainer.precision=bf16", f"output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_drafter(tmp_path / "out" / "final")[3]["metrics"]["step"] == 2


# Medusa-2: the same global batch, LoRA backbone + heads, 4 steps (the head loss at full weight).
EQUIV2 = ["data=tiny", "trainer=debug", "logger=none", "method=medusa2", "method.num_heads=2", "trainer.batch_size=4",
          "trainer.split_batches=true", "trainer.max_steps=4", "method.heads_ramp_steps=0", "method.allow_drift=true"]


@pytest.mark.heavy
def test_medusa2_two_processes_train_the_same_backbone_and_heads_as_one(tiny_model_dir, tmp_path):
    """1 process, DDP and ZeRO-2 on 2 processes end with the same merged verifier and heads."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    runs = {"one": ["python"], "ddp": ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml",
                                       "--main_process_port", str(free_port())],
            "zero2": ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc-zero2.yaml",
                      "--main_process_port", str(free_port())]}
    weights = {}
    for name, launcher in runs.items():
        out = tmp_path / name
        extra = {"ACCELERATE_USE_CPU": "1"} if name == "ddp" else {}
        proc = subprocess.run([*launcher, "train/medusa.py", *tiny_model_overrides(tiny_model_dir), *EQUIV2,
                               f"output_dir={out}"], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", **extra},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        weights[name] = {**{f"verifier.{k}": v for k, v in load_file(out / "final" / "verifier" / "model.safetensors").items()},
                         **{f"heads.{k}": v for k, v in load_file(out / "final" / "heads" / "model.safetensors").items()}}
    reference = weights.pop("one")
    original = load_file(tiny_model_dir / "model.safetensors")
    moved = [k for k, v in original.items() if (reference[f"verifier.{k}"] - v).abs().max() > 1e-6]
    for name, got in weights.items():
        assert got.keys() == reference.keys(), name
        for key, ref in reference.items():  # heads lr 1e-2 x 4: 4 Adam steps move a weight by up to 0.16;
            # Adam's m / sqrt(v) turns fp32 rounding of a near-zero gradient (all-reduce vs one sum: another order,
            # and another kernel on another CPU) into ~2e-5 (seen on a Xeon with AMX), so atol is 1e-4 of a step
            torch.testing.assert_close(got[key], ref, rtol=1e-4, atol=1e-4, msg=f"{name}: {key}")
    assert moved  # the backbone was tuned (so the equality above is about the LoRA updates too)
