"""train/draft.py on a tiny verifier: each divergence trains, on-policy steps, offline top-k
teacher logits, resume."""
import csv

import pytest
import torch

from draftsmith.models.draft import load_draft_model
from draftsmith.models.errors import DraftsmithError
from draftsmith.train.draft import run
from scripts.prepare_features import run as prepare
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("draft", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "trainer.max_steps=4", "trainer.eval_every=2",
        "logger=csv", f"output_dir={out}", "method.student.num_layers=1", *extra])


def _metric(out, key):
    with open(out / "metrics.csv") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["key"] == key]


@pytest.mark.parametrize("method", ["draft-fkl", "draft-rkl", "draft-jsd", "draft-tvd"])
def test_each_divergence_trains_and_raises_acceptance(tiny_model_dir, tmp_path, method):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, f"method={method}"))
    assert summary["steps"] == 4
    losses = _metric(out, "train/loss")
    assert len(losses) == 4 and losses[-1] < losses[0], losses  # the whole train split is one batch
    accept = _metric(out, "train/acceptance_rate")
    assert accept[-1] > accept[0]
    model, meta = load_draft_model(summary["drafter_dir"], vocab_size=128)
    assert meta["divergence"] == method.split("-")[1] and model.config.num_hidden_layers == 1
    assert 0 < summary["eval/acceptance_rate"] <= 1 and 1 <= summary["eval/chain_tau_sampled"] <= 5


def test_body_only_training_leaves_embeddings_and_lm_head_as_the_verifiers(tiny_model_dir, tmp_path):
    """trainable=body: the loss falls, the layers move, the saved draft still holds the
    verifier's own embeddings and lm_head bit for bit."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "method.student.trainable=body"))
    losses = _metric(out, "train/loss")
    assert losses[-1] < losses[0], losses
    draft, _ = load_draft_model(summary["drafter_dir"], vocab_size=128)
    verifier = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(draft.state_dict()[name], verifier.state_dict()[name]), name
    layer = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(draft.state_dict()[layer], verifier.state_dict()[layer])


def test_untrained_student_is_evaluated_and_saved(tiny_model_dir, tmp_path):
    """max_steps=0 saves the student before any distillation, with its held-out acceptance:
    the baseline a distilled draft must beat."""
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, "trainer.max_steps=0"))
    assert summary["steps"] == 0 and 0 < summary["eval/acceptance_rate"] <= 1
    assert _metric(out, "eval/acceptance_rate") == [summary["eval/acceptance_rate"]]
    _, meta = load_draft_model(summary["drafter_dir"], vocab_size=128)
    assert meta["metrics"]["eval/acceptance_rate"] == summary["eval/acceptance_rate"]


def test_on_policy_steps_and_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out, "method.onpolicy.ratio=0.5", "method.onpolicy.max_new_tokens=6")
    run(cfg)
    flags = _metric(out, "train/on_policy")
    assert 0 < sum(flags) < len(flags) == 4  # a mix of on-policy and fixed steps
    summary = run(_cfg(tiny_model_dir, out, "method.onpolicy.ratio=0.5", "method.onpolicy.max_new_tokens=6",
                       "trainer.max_steps=6"))
    assert summary["steps"] == 6 and len(_metric(out, "train/loss")) == 6


def test_offline_top_k_teacher(tiny_model_dir, tmp_path):
    features = tmp_path / "features"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "topk=16", f"output_dir={features}"]))
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", f"data.features={features}"))
    assert summary["steps"] == 4
    with pytest.raises(DraftsmithError, match="needs the verifier online"):
        run(_cfg(tiny_model_dir, tmp_path / "run2", f"data.features={features}", "method.onpolicy.ratio=0.5"))
    plain = tmp_path / "plain"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", f"output_dir={plain}"]))
    with pytest.raises(DraftsmithError, match="holds no teacher logits"):
        run(_cfg(tiny_model_dir, tmp_path / "run3", f"data.features={plain}"))
