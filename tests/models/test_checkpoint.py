import json

import pytest
import torch

from draftsmith.models.checkpoint import load_drafter, save_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads


def _save(tmp_path, fp="abc"):
    cfg = MedusaConfig(hidden_size=8, vocab_size=16, num_heads=2, lm_head="own")
    heads = MedusaHeads(cfg)
    out = save_drafter(tmp_path / "ckpt", "medusa", heads, cfg, verifier_fingerprint=fp, verifier_name="tiny",
                       meta={"metrics": {"x": 1.0}}, resolved_config_yaml="a: 1\n")
    return out, heads


def test_roundtrip(tmp_path):
    out, heads = _save(tmp_path)
    kind, loaded, cfg, meta = load_drafter(out, verifier_fingerprint="abc")
    assert kind == "medusa" and cfg.num_heads == 2 and meta["verifier_name"] == "tiny"
    for (n, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dirs left behind


def test_overwrite_is_atomic_swap(tmp_path):
    out, _ = _save(tmp_path, fp="one")
    out, _ = _save(tmp_path, fp="two")
    assert json.loads((out / "meta.json").read_text())["verifier_fingerprint"] == "two"


def test_fingerprint_mismatch_refused_then_allowed(tmp_path):
    out, _ = _save(tmp_path)
    with pytest.raises(DraftsmithError, match="abc.*other"):
        load_drafter(out, verifier_fingerprint="other")
    with pytest.warns(UserWarning, match="allowed"):
        load_drafter(out, verifier_fingerprint="other", allow_mismatch=True)


@pytest.mark.parametrize("damage,needle", [
    (lambda d: (d / "model.safetensors").unlink(), "missing model.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "unreadable"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json is corrupt"),
    (lambda d: (d / "meta.json").write_text("{"), "meta.json is corrupt"),
    (lambda d: (d / "config.json").write_text('{"kind": "medusa", "config": {"hidden_size": 8, "vocab_size": 16, '
                                              '"num_heads": 3}}'), "do not match"),
])
def test_corrupt_checkpoints_give_one_line(tmp_path, damage, needle):
    out, _ = _save(tmp_path)
    damage(out)
    with pytest.raises(DraftsmithError, match=needle) as info:
        load_drafter(out)
    assert "\n" not in str(info.value)


def test_missing_dir(tmp_path):
    with pytest.raises(DraftsmithError, match="no such checkpoint"):
        load_drafter(tmp_path / "nope")
