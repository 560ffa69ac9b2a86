"""Offline features: prepare once, then train without the verifier body; same loss as online."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import load_verifier
from draftsmith.train.core.features import FeatureDataset, collate_features, read_manifest
from draftsmith.train.medusa import medusa_loss
from draftsmith.train.medusa import run as train
from scripts.prepare_features import run as prepare
from tests.hub import free_port  # a port per launch: fixed ones collide between xdist workers
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config


@pytest.fixture()
def features(tiny_model_dir, tmp_path):
    out = tmp_path / "features"
    cfg = compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "shard_size=4", "batch_size=3", f"output_dir={out}"])
    manifest = prepare(cfg)
    return out, manifest, cfg


def test_manifest_and_shards(features, tiny_model_dir):
    out, manifest, _ = features
    verifier = load_verifier(OmegaConf.create(compose_config("medusa", tiny_model_overrides(tiny_model_dir)).model))
    assert manifest["verifier"]["fingerprint"] == verifier.fingerprint
    assert manifest["splits"]["train"]["examples"] == 10 and manifest["splits"]["eval"]["examples"] == 2
    assert len(list((out / "train").glob("shard-*.safetensors"))) == 3  # 10 conversations, 4 per shard
    assert manifest["bytes_per_1k_tokens"] == 1000 * (32 * 4 + 16)
    assert read_manifest(out)["complete"]


def test_online_and_offline_give_the_same_loss(features, tiny_model_dir):
    out, _, _ = features
    verifier = load_verifier(OmegaConf.create(compose_config("medusa", tiny_model_overrides(tiny_model_dir)).model))
    ds = FeatureDataset(out, "train")
    batch = collate_features([ds[i] for i in range(5)], pad_id=verifier.tokenizer.pad_token_id)
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(32, 128, num_heads=2), verifier.lm_head)
    for p in heads.parameters():
        p.data += 0.05 * torch.randn_like(p)
    online_hidden = verifier.hidden_states(batch["input_ids"], batch["attention_mask"])
    online, _ = medusa_loss(heads, online_hidden, batch["labels"], verifier.lm_head, 0.8, 2)
    offline, _ = medusa_loss(heads, batch["hidden"], batch["labels"], verifier.lm_head, 0.8, 2)
    torch.testing.assert_close(offline, online, rtol=1e-6, atol=1e-6)


def test_training_from_features_and_resume_of_prepare(features, tiny_model_dir, tmp_path):
    out, manifest, prep_cfg = features
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("shard-*.safetensors")}
    prepare(prep_cfg)  # a rerun finds every shard done and rewrites none
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("shard-*.safetensors")}

    cfg = compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", f"data.features={out}", "trainer=debug", "trainer.batch_size=16", "logger=csv",
        "method.num_heads=2", f"output_dir={tmp_path / 'run'}"])
    summary = train(cfg)
    assert summary["steps"] == 3
    _, _, _, meta = load_drafter(summary["drafter_dir"], verifier_fingerprint=manifest["verifier"]["fingerprint"])
    assert meta["verifier_name"] == "tiny"


def test_incomplete_features_are_refused(features, tmp_path):
    out, _, _ = features
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DraftsmithError, match="incomplete"):
        read_manifest(out)
    with pytest.raises(DraftsmithError, match="no manifest.json"):
        read_manifest(tmp_path / "nowhere")


def test_layer_features_and_topk_logits(tiny_model_dir, tmp_path):
    """EAGLE-3 layers and the verifier's top-k logits, stored next to the final hidden state,
    equal what the verifier computes online for the same conversation."""
    out = tmp_path / "features"
    cfg = compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "shard_size=4", "layers=[0,-1]", "topk=5", f"output_dir={out}"])
    manifest = prepare(cfg)
    assert manifest["layers"] == [0, 1] and manifest["topk"] == 5
    assert manifest["bytes_per_1k_tokens"] == 1000 * (3 * 32 * 4 + 5 * (4 + 4) + 16)
    ds = FeatureDataset(out, "train")
    batch = collate_features([ds[i] for i in range(3)])
    B, T = batch["input_ids"].shape
    assert batch["layer_hidden"].shape == (B, T, 64) and batch["topk_indices"].shape == (B, T, 5)
    verifier = load_verifier(OmegaConf.create(cfg.model))
    example = ds[0]
    ids = example["input_ids"][None]
    online = verifier.features(ids, layers=[0, 1])
    torch.testing.assert_close(example["hidden"], online["hidden"][0])
    torch.testing.assert_close(example["layer_hidden"], online["layer_hidden"][0])
    values, indices = verifier.lm_head(online["hidden"][0]).topk(5, dim=-1)
    torch.testing.assert_close(example["topk_values"], values)
    assert torch.equal(example["topk_indices"].long(), indices)
    with pytest.raises(DraftsmithError, match="holds features written with"):  # no mixing in one folder
        prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
            "data=tiny", "dtype=float32", "shard_size=4", f"output_dir={out}"]))
    with pytest.raises(DraftsmithError, match="feature layer 7 does not exist"):
        prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
            "data=tiny", "layers=[7]", f"output_dir={tmp_path / 'bad'}"]))


@pytest.mark.slow
@pytest.mark.heavy
def test_two_processes_write_the_same_features(features, tiny_model_dir, tmp_path):
    """accelerate launch with 2 CPU processes: shards split over the processes, same content."""
    import os
    import subprocess
    from pathlib import Path

    one, _, _ = features
    out = tmp_path / "two"
    root = Path(__file__).resolve().parents[2]
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml",
           "--main_process_port", str(free_port()),
           "scripts/prepare_features.py", *tiny_model_overrides(tiny_model_dir), "data=tiny", "dtype=float32",
           "shard_size=4", "batch_size=3", f"output_dir={out}"]
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_manifest(out)["splits"] == read_manifest(one)["splits"]
    a, b = FeatureDataset(one, "train"), FeatureDataset(out, "train")
    assert len(a) == len(b) == 10
    for i in range(10):
        for key, value in a[i].items():
            torch.testing.assert_close(b[i][key], value)
