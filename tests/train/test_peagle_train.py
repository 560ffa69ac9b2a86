"""train/eagle.py method=peagle (and method.loss for EAGLE): P-EAGLE trains on the shared
skeleton, online and from offline features, with a reduced draft vocabulary; its placeholder steps
are the slots the decoder appends (the training forward and the decoder's one forward agree);
the saved drafter carries mask_hidden and its keys and decodes losslessly through
decode/evaluate.py; keys the run would ignore are refused in one line."""
import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.decode.evaluate import run as evaluate
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.train.eagle import run, unroll, unroll_mask
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config, logged


def _cfg(tiny_model_dir, out, method, *extra):
    return compose_config("eagle", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "logger=csv", f"output_dir={out}",
        f"method={method}", *extra])


PEAGLE = ("method.draft_vocab_size=48", "method.fusion_layers=[0,1,-1]", "method.mask_token_id=5")


@pytest.mark.parametrize("loss", ["ce", "lk"])
def test_peagle_trains_and_saves_a_parallel_drafter(tiny_model_dir, tmp_path, loss):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "peagle", *PEAGLE, f"method.loss={loss}"))
    assert summary["steps"] == 3
    losses = logged(out, "train/loss")
    assert losses[-1] < losses[0], losses
    metrics = {r["key"] for r in csv.DictReader(open(out / "metrics.csv")) if r["key"].startswith("train/step")}
    assert metrics == {f"train/step{s}/loss" for s in range(4)}  # the 4 parallel depths
    assert all(0.0 <= summary[f"eval/step{s}_top1"] <= 1.0 for s in range(4)) and "eval/step4_top1" not in summary
    kind, drafter, config, _ = load_drafter(summary["drafter_dir"])
    assert kind == "eagle" and config.variant == "eagle3" and config.parallel_tokens == 4
    assert config.mask_token_id == 5 and config.draft_vocab_size == 48
    state = load_file(str(out / "final" / "model.safetensors"))
    assert state["mask_hidden"].shape == (3 * 32,) and not any("embed" in k for k in state)
    spec = json.loads((out / "final" / "config.json").read_text())
    assert spec["mask_token_id"] == 5 and spec["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (out / "final" / "config.yaml").read_text().count(f"loss: {loss}") == 1


def test_placeholder_steps_are_the_decoders_slots():
    """The trainer's unrolled step s at index t (a placeholder at position t + s seeing the real
    pairs up to t and index t's earlier placeholders) equals the decoder's view: ONE causal
    forward over the pairs 0..t and s placeholders, its last output. So are depth-0 outputs."""
    from tests.tiny import tiny_llama

    model = tiny_llama()
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(32, 128, model.config.to_dict(), variant="eagle3", fusion_layers=[0, 1, 1],
                                       parallel_tokens=3, mask_token_id=7)).double()
    T = 9
    embeds, feats = torch.randn(1, T, 32, dtype=torch.float64), torch.randn(1, T, 32, dtype=torch.float64)
    mask_embed = torch.randn(32, dtype=torch.float64)
    placeholder = (mask_embed, drafter.placeholder_features())
    with torch.no_grad():
        steps = list(unroll(drafter, embeds, feats, torch.ones(1, T, dtype=torch.bool), 3, placeholder))
        for t in range(T - 1):
            for s in range(3):
                e = torch.cat([embeds[0, 1:t + 2], mask_embed[None].expand(s, -1)])  # pair j = (x_{j+1}, g_j)
                f = torch.cat([feats[0, :t + 1], placeholder[1][None].expand(s, -1)])
                direct = drafter(e[None], f[None])[0, -1]
                torch.testing.assert_close(steps[s][0, t], direct, msg=f"t={t} s={s}")
    # teeth: without placeholders the unroll feeds its own outputs back (EAGLE), which differs
    with torch.no_grad():
        eagle = list(unroll(drafter, embeds, feats, torch.ones(1, T, dtype=torch.bool), 3))
    torch.testing.assert_close(eagle[0], steps[0])
    assert not torch.allclose(eagle[1], steps[1])
    assert unroll_mask(torch.ones(1, T, dtype=torch.bool), 2, torch.float64).shape == (1, 1, T, 3 * T)


@pytest.mark.parametrize("decode", ["peagle-chain", "peagle-dynamic", "eagle-dynamic"])
def test_evaluate_decodes_losslessly_with_the_trained_peagle(tiny_model_dir, tmp_path, decode):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "peagle", *PEAGLE))
    report = evaluate(compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=2", "max_new_tokens=12", f"output_dir={tmp_path / 'eval'}",
        "proposer=eagle", f"drafter={summary['drafter_dir']}", f"decode={decode}", "hw=cpu", "hf.enabled=false"]))
    ours = report["methods"]["eagle"]
    assert report["proposer"] == "peagle"
    assert ours["greedy_identity_rate"] == 1.0 or ours["greedy_divergences_unexplained"] == 0, ours
    assert ours["tau"] >= 1.0


@pytest.fixture()
def features(tiny_model_dir, tmp_path):
    from scripts.prepare_features import run as prepare

    out = tmp_path / "features"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "shard_size=4", "batch_size=3", "layers=[0,1,1]", f"output_dir={out}"]))
    return out


def test_online_and_offline_give_the_same_peagle_loss(features, tiny_model_dir):
    from omegaconf import OmegaConf

    from draftsmith.models.verifier import load_verifier
    from draftsmith.train.core.features import FeatureDataset, collate_features
    from draftsmith.train.eagle import eagle_loss, verifier_inputs

    verifier = load_verifier(OmegaConf.create(compose_config("eagle", tiny_model_overrides(tiny_model_dir)).model))
    ds = FeatureDataset(features, "train")
    batch = collate_features([ds[i] for i in range(5)], pad_id=verifier.tokenizer.pad_token_id)
    mcfg = compose_config("eagle", ["method=peagle", "method.loss=nla"]).method
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(32, 128, verifier.config.to_dict(), variant="eagle3", fusion_layers=[0, 1, 1],
                                       parallel_tokens=4, mask_token_id=5))
    online_batch = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
    embed = verifier.embed_tokens
    args = (verifier.lm_head, mcfg, 4)
    online, _ = eagle_loss(drafter, verifier_inputs(verifier, online_batch, [0, 1, 1], embed, 5), *args)
    offline, _ = eagle_loss(drafter, verifier_inputs(verifier, batch, [0, 1, 1], embed, 5), *args)
    torch.testing.assert_close(offline, online, rtol=1e-5, atol=1e-6)
    other, _ = eagle_loss(drafter, verifier_inputs(verifier, batch, [0, 1, 1], embed, 6), *args)
    assert not torch.allclose(other, offline)  # the mask token's embedding is read


def test_training_peagle_from_features(features, tiny_model_dir, tmp_path):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "peagle", f"data.features={features}",
                       "method.draft_vocab_size=48"))
    _, drafter, config, _ = load_drafter(summary["drafter_dir"])
    assert config.fusion_layers == [0, 1, 1] and config.parallel_tokens == 4 and summary["steps"] == 3
    assert all(torch.isfinite(torch.tensor(logged(tmp_path / "run", "train/loss"))))


def test_keys_the_run_would_ignore_are_refused(tiny_model_dir, tmp_path):
    cases = {
        "method.loss='kl' is not known; valid: ce, lk, nla": ("eagle3", "method.loss=kl"),
        "method.ttt_steps=3 is EAGLE's sequential unroll": ("peagle", "+method.ttt_steps=3"),
        "method.eval_steps=5 > method.parallel_tokens=4": ("peagle", "method.eval_steps=5"),
        "method.parallel_tokens=1: P-EAGLE proposes K >= 2": ("peagle", "method.parallel_tokens=1", "method.eval_steps=1"),
        "method.mask_token_id=128: .* 0..127": ("peagle", "method.mask_token_id=128"),
        "method.parallel_tokens=4 is P-EAGLE, which drafts with an EAGLE-3 drafter": (
            "peagle", "method.variant=eagle1", "method.fusion_layers=null", "method.draft_vocab_size=null",
            "method.lm_head=shared"),
        "method.mask_token_id=3 is read by P-EAGLE only": ("eagle3", "+method.mask_token_id=3"),
    }
    for i, (message, (method, *extra)) in enumerate(cases.items()):
        with pytest.raises(DraftsmithError, match=message) as info:
            run(_cfg(tiny_model_dir, tmp_path / f"r{i}", method, *extra))
        assert "\n" not in str(info.value)


def test_an_eagle_run_from_before_method_loss_still_resumes(tiny_model_dir, tmp_path):
    from omegaconf import OmegaConf

    from draftsmith.train.core.checkpoint import config_digest

    cfg = _cfg(tiny_model_dir, tmp_path / "run", "eagle3")
    older = OmegaConf.to_container(cfg)
    del older["method"]["loss"]
    assert config_digest(OmegaConf.create(older)) == config_digest(cfg)
    assert config_digest(_cfg(tiny_model_dir, tmp_path / "run", "eagle3", "method.loss=lk")) != config_digest(cfg)


def test_eagle3_checkpoints_are_unchanged_by_the_parallel_keys():
    """An EAGLE-3 drafter has no mask_hidden, the same weights at the same seed as before the keys
    existed (P-EAGLE draws mask_hidden after them), and an old config without the keys loads."""
    from tests.tiny import tiny_llama

    cfg = tiny_llama().config.to_dict()
    torch.manual_seed(0)
    eagle3 = EagleDrafter(EagleConfig(32, 128, cfg, variant="eagle3", fusion_layers=[0, 1, 1]))
    torch.manual_seed(0)
    peagle = EagleDrafter(EagleConfig(32, 128, cfg, variant="eagle3", fusion_layers=[0, 1, 1], parallel_tokens=2,
                                      mask_token_id=0))
    assert "mask_hidden" not in eagle3.state_dict()
    assert set(peagle.state_dict()) - set(eagle3.state_dict()) == {"mask_hidden"}
    assert all(torch.equal(v, peagle.state_dict()[k]) for k, v in eagle3.state_dict().items())
    old = {k: v for k, v in EagleConfig(32, 128, cfg, variant="eagle3", fusion_layers=[0, 1, 1]).__dict__.items()
           if k not in ("parallel_tokens", "mask_token_id")}
    assert EagleConfig(**old).parallel_tokens == 0


def test_decode_auto_is_the_peagle_tree_for_a_parallel_drafter():
    """decode=auto (the end-of-training probe, bench_peers) drafts a P-EAGLE drafter with its own
    preset, an EAGLE one with the EAGLE-2 tree."""
    from types import SimpleNamespace

    from draftsmith.decode.probe import decode_preset

    peagle = SimpleNamespace(kind="eagle", config=SimpleNamespace(parallel_tokens=4))
    eagle3 = SimpleNamespace(kind="eagle", config=SimpleNamespace(parallel_tokens=0))
    assert decode_preset("auto", peagle).name == "peagle-dynamic"
    assert decode_preset("auto", eagle3).name == "eagle-dynamic"
