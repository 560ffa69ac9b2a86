"""train/eagle.py: smoke runs of EAGLE-1 and EAGLE-3 on the tiny verifier, resume, the saved
checkpoint (no verifier embedding / lm_head inside, d2t map for a reduced vocabulary), and the
evaluator decoding with it (proposer=eagle, static and dynamic trees)."""
import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.decode.evaluate import run as evaluate
from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.train.eagle import run
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config, logged


def _cfg(tiny_model_dir, out, method, *extra):
    return compose_config("eagle", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "logger=csv", f"output_dir={out}",
        f"method={method}", "method.eval_steps=3", *extra])


def test_eagle1_three_steps_loss_falls_and_checkpoint_reloads(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "eagle1"))
    assert summary["steps"] == 3
    losses = logged(out, "train/loss")
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # the whole train split is one batch
    for s in range(3):
        assert 0.0 <= summary[f"eval/step{s}_top1"] <= 1.0
    assert summary["eval/simulated_tau"] >= 1.0
    kind, drafter, config, meta = load_drafter(summary["drafter_dir"])
    assert kind == "eagle" and config.variant == "eagle1" and meta["metrics"]["step"] == 3
    state = load_file(str(out / "final" / "model.safetensors"))
    assert not any("embed" in k or k.startswith("lm_head") for k in state)  # shared, never stored
    assert config.decoder_config["model_type"] == "llama" and len(drafter.layers) == 1
    spec = json.loads((out / "final" / "config.json").read_text())
    assert spec["architectures"] == ["EagleLlamaForCausalLM"] and spec["draftsmith"]["kind"] == "eagle"
    assert (out / "best" / "meta.json").is_file() and (out / "checkpoints" / "step-00000003").is_dir()


def test_eagle3_reduced_vocab_and_training_time_test(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "eagle3", "method.draft_vocab_size=48", "method.fusion_layers=[0,1,-1]"))
    _, drafter, config, _ = load_drafter(summary["drafter_dir"])
    assert config.variant == "eagle3" and config.fusion_layers == [0, 1, 1] and config.draft_vocab_size == 48
    assert drafter.fc.weight.shape == (32, 3 * 32) and drafter.lm_head.weight.shape == (48, 32)
    d2t = drafter.target_ids
    assert d2t.shape == (48,) and bool((d2t[1:] > d2t[:-1]).all()) and int(d2t.max()) < 128
    assert logged(out, "train/loss")[-1] < logged(out, "train/loss")[0]
    metrics = [r for r in csv.DictReader(open(out / "metrics.csv")) if r["key"].startswith("train/step")]
    assert {r["key"] for r in metrics} == {f"train/step{s}/loss" for s in range(3)}  # 3 unrolled steps


def test_resume_continues_and_other_config_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run(_cfg(tiny_model_dir, out, "eagle1"))
    summary = run(_cfg(tiny_model_dir, out, "eagle1", "trainer.max_steps=5"))
    assert summary["steps"] == 5 and len(logged(out, "train/loss")) == 5
    with pytest.raises(DraftsmithError, match="another config"):
        run(_cfg(tiny_model_dir, out, "eagle1", "method.w_cls=0.5"))


def test_bad_method_values_are_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(DraftsmithError, match="method.variant='eagle2'.*valid: eagle1, eagle3"):
        run(_cfg(tiny_model_dir, tmp_path / "a", "eagle1", "method.variant=eagle2"))
    with pytest.raises(DraftsmithError, match="feature layer 7 does not exist"):
        run(_cfg(tiny_model_dir, tmp_path / "b", "eagle3", "method.fusion_layers=[0,1,7]",
                 "method.draft_vocab_size=48"))
    with pytest.raises(DraftsmithError, match="draft_vocab_size=500"):
        run(_cfg(tiny_model_dir, tmp_path / "c", "eagle3", "method.draft_vocab_size=500"))


@pytest.mark.parametrize("method, decode", [("eagle1", "eagle-static"), ("eagle3", "eagle-dynamic")])
def test_evaluate_decodes_losslessly_with_the_trained_drafter(tiny_model_dir, tmp_path, method, decode):
    extra = ["method.draft_vocab_size=48"] if method == "eagle3" else []
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", method, *extra))
    report = evaluate(compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=2", "max_new_tokens=12", f"output_dir={tmp_path / 'eval'}",
        "proposer=eagle", f"drafter={summary['drafter_dir']}", f"decode={decode}", "hf.enabled=false"]))
    ours = report["methods"]["eagle"]
    assert ours["greedy_identity_rate"] == 1.0 or ours["greedy_divergences_unexplained"] == 0, ours
    assert ours["tau"] >= 1.0


def test_medusa_refuses_an_eagle_checkpoint(tiny_model_dir, tmp_path):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "eagle1"))
    base = tiny_model_overrides(tiny_model_dir) + ["data=tiny", "data.num_prompts=1", "max_new_tokens=4",
                                                   f"output_dir={tmp_path / 'eval'}", "hf.enabled=false"]
    with pytest.raises(DraftsmithError, match="is a 'eagle' checkpoint; proposer=medusa needs medusa"):
        evaluate(compose_config("evaluate", base + ["proposer=medusa", f"drafter={summary['drafter_dir']}"]))


@pytest.fixture()
def features(tiny_model_dir, tmp_path):
    from scripts.prepare_features import run as prepare

    out = tmp_path / "features"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "shard_size=4", "batch_size=3", "layers=[0,1,1]", f"output_dir={out}"]))
    return out


def test_online_and_offline_give_the_same_loss(features, tiny_model_dir):
    from omegaconf import OmegaConf

    from draftsmith.models.eagle import EagleConfig, EagleDrafter
    from draftsmith.models.verifier import load_verifier
    from draftsmith.train.core.features import FeatureDataset, collate_features
    from draftsmith.train.eagle import eagle_loss, verifier_inputs

    verifier = load_verifier(OmegaConf.create(compose_config("eagle", tiny_model_overrides(tiny_model_dir)).model))
    ds = FeatureDataset(features, "train")
    batch = collate_features([ds[i] for i in range(5)], pad_id=verifier.tokenizer.pad_token_id)
    mcfg = compose_config("eagle", ["method=eagle3"]).method
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(32, 128, verifier.config.to_dict(), variant="eagle3", fusion_layers=[0, 1, 1]))
    online_batch = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
    embed = verifier.embed_tokens
    online, _ = eagle_loss(drafter, verifier_inputs(verifier, online_batch, [0, 1, 1], embed), verifier.lm_head, mcfg, 3)
    offline, _ = eagle_loss(drafter, verifier_inputs(verifier, batch, [0, 1, 1], embed), verifier.lm_head, mcfg, 3)
    torch.testing.assert_close(offline, online, rtol=1e-5, atol=1e-6)


def test_training_from_features(features, tiny_model_dir, tmp_path):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "eagle3", f"data.features={features}",
                       "method.draft_vocab_size=48"))
    _, drafter, config, meta = load_drafter(summary["drafter_dir"])
    assert config.fusion_layers == [0, 1, 1] and summary["steps"] == 3  # the layers the features hold
    with pytest.raises(DraftsmithError, match="data.features holds layers"):
        run(_cfg(tiny_model_dir, tmp_path / "other", "eagle3", f"data.features={features}",
                 "method.draft_vocab_size=48", "method.fusion_layers=[0,1,0]"))


def test_training_from_features_with_topk_logits(tiny_model_dir, tmp_path):
    from scripts.prepare_features import run as prepare

    out = tmp_path / "features"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "topk=16", f"output_dir={out}"]))
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "eagle1", f"data.features={out}"))
    assert summary["steps"] == 3 and logged(tmp_path / "run", "train/loss")[-1] < logged(tmp_path / "run", "train/loss")[0]


def test_target_law_from_topk_logits_and_a_draft_vocab_match_the_full_law_on_those_tokens():
    """target_law: the verifier's law from lm_head(f) or from stored top-k logits, over the full
    vocabulary or renormalised over a draft vocabulary (then only those lm_head rows are used)."""
    from types import SimpleNamespace

    from draftsmith.train.eagle import target_law

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 20, bias=False).double()
    hidden = torch.randn(2, 4, 8, dtype=torch.float64)  # (B, T, H)
    logits = lm_head(hidden).detach()  # (B, T, V)
    exact = torch.softmax(logits, dim=-1)  # the law itself
    values, indices = logits.topk(20, dim=-1)  # all 20 stored
    full = SimpleNamespace(config=SimpleNamespace(vocab_size=20, draft_vocab_size=None))
    torch.testing.assert_close(target_law(full, {"hidden": hidden}, lm_head).double(), exact)
    torch.testing.assert_close(target_law(full, {"topk_values": values, "topk_indices": indices}, lm_head).double(),
                               exact, atol=1e-6, rtol=1e-5)  # the stored path computes in fp32
    ids = torch.tensor([3, 7, 11, 19, 0])  # a draft vocabulary, in draft order
    draft = SimpleNamespace(config=SimpleNamespace(vocab_size=20, draft_vocab_size=5), target_ids=ids)
    restricted = exact[..., ids] / exact[..., ids].sum(-1, keepdim=True)  # (B, T, 5)
    torch.testing.assert_close(target_law(draft, {"hidden": hidden}, lm_head).double(), restricted)
    top6 = logits.topk(6, dim=-1)  # some draft tokens fall outside the stored k: no mass there
    law6 = torch.zeros_like(exact).scatter_(-1, top6.indices, torch.softmax(top6.values, dim=-1))[..., ids]
    torch.testing.assert_close(target_law(draft, {"topk_values": top6.values, "topk_indices": top6.indices},
                                          lm_head).double(),
                               law6 / law6.sum(-1, keepdim=True).clamp_min(1e-12), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_fc_passthrough_starts_on_the_verifiers_state(tiny_model_dir, tmp_path, method):
    """method.fc_init=passthrough: the saved untrained drafter's fc is [0 | I] (EAGLE-3: the last
    fused layer's state; EAGLE-1: f_t), so fc(x) equals that state; the rest is the random init,
    and training from it runs and its loss falls."""
    extra = ["method.draft_vocab_size=48", "method.fusion_layers=[0,1,-1]"] if method == "eagle3" else []
    summary = run(_cfg(tiny_model_dir, tmp_path / "init", method, *extra, "method.fc_init=passthrough",
                       "trainer.max_steps=0"))
    _, drafter, config, _ = load_drafter(summary["drafter_dir"])
    h = config.hidden_size
    x = torch.randn(3, drafter.fc.weight.shape[1])
    torch.testing.assert_close(drafter.fc(x), x[:, -h:])
    random = load_drafter(run(_cfg(tiny_model_dir, tmp_path / "rand", method, *extra, "trainer.max_steps=0"))
                          ["drafter_dir"]).module
    assert not torch.allclose(random.fc(x), x[:, -h:], atol=0.1)  # the default is not a pass-through
    torch.testing.assert_close(drafter.layer.self_attn.q_proj.weight, random.layer.self_attn.q_proj.weight)
    trained = run(_cfg(tiny_model_dir, tmp_path / "run", method, *extra, "method.fc_init=passthrough"))
    assert trained["steps"] == 3 and logged(tmp_path / "run", "train/loss")[-1] < logged(tmp_path / "run", "train/loss")[0]


def test_fc_init_refusals(tiny_model_dir, tmp_path):
    with pytest.raises(DraftsmithError, match=r"method.fc_init='identity' is not known; valid: passthrough, random"):
        run(_cfg(tiny_model_dir, tmp_path / "a", "eagle1", "method.fc_init=identity"))
    first = run(_cfg(tiny_model_dir, tmp_path / "b", "eagle1"))
    with pytest.raises(DraftsmithError, match="method.fc_init=passthrough would be overwritten by trainer.init_from"):
        run(_cfg(tiny_model_dir, tmp_path / "c", "eagle1", "method.fc_init=passthrough",
                 f"trainer.init_from={first['drafter_dir']}"))


def test_an_eagle_run_from_before_fc_init_still_resumes(tiny_model_dir, tmp_path):
    """A run whose config predates method.fc_init (no such key) has the digest of the same run at
    the default, so it resumes; passthrough is another config."""
    from omegaconf import OmegaConf

    from draftsmith.train.core.checkpoint import config_digest

    cfg = _cfg(tiny_model_dir, tmp_path / "run", "eagle3")
    older = OmegaConf.to_container(cfg)
    del older["method"]["fc_init"]
    assert config_digest(OmegaConf.create(older)) == config_digest(cfg)
    assert config_digest(_cfg(tiny_model_dir, tmp_path / "run", "eagle3", "method.fc_init=passthrough")) \
        != config_digest(cfg)
