"""train/draft.py on a tiny verifier: each divergence trains, on-policy steps, offline top-k
teacher logits, resume."""

import pytest
import torch

from draftsmith.models.draft import load_draft_model
from draftsmith.models.errors import DraftsmithError
from draftsmith.train.draft import run
from scripts.prepare_features import run as prepare
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config, logged


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("draft", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "trainer.max_steps=4", "trainer.eval_every=2",
        "logger=csv", f"output_dir={out}", "method.student.num_layers=1", *extra])


@pytest.mark.parametrize("method", ["draft-fkl", "draft-rkl", "draft-jsd", "draft-tvd"])
def test_each_divergence_trains_and_raises_acceptance(tiny_model_dir, tmp_path, method):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out, f"method={method}"))
    assert summary["steps"] == 4
    losses = logged(out, "train/loss")
    assert len(losses) == 4 and losses[-1] < losses[0], losses  # the whole train split is one batch
    accept = logged(out, "train/acceptance_rate")
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
    losses = logged(out, "train/loss")
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
    assert logged(out, "eval/acceptance_rate") == [summary["eval/acceptance_rate"]]
    _, meta = load_draft_model(summary["drafter_dir"], vocab_size=128)
    assert meta["metrics"]["eval/acceptance_rate"] == summary["eval/acceptance_rate"]


def test_on_policy_steps_and_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out, "method.onpolicy.ratio=0.5", "method.onpolicy.max_new_tokens=6")
    run(cfg)
    flags = logged(out, "train/on_policy")
    assert 0 < sum(flags) < len(flags) == 4  # a mix of on-policy and fixed steps
    summary = run(_cfg(tiny_model_dir, out, "method.onpolicy.ratio=0.5", "method.onpolicy.max_new_tokens=6",
                       "trainer.max_steps=6"))
    assert summary["steps"] == 6 and len(logged(out, "train/loss")) == 6


def test_offline_top_k_teacher(tiny_model_dir, tmp_path):
    features = tmp_path / "features"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", "topk=16", f"output_dir={features}"]))
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", f"data.features={features}"))
    assert summary["steps"] == 4
    reduced = run(_cfg(tiny_model_dir, tmp_path / "reduced", f"data.features={features}", "method.draft_vocab_size=8"))
    assert load_draft_model(reduced["drafter_dir"], vocab_size=128)[0].draft_vocab.numel() == 8  # counted from features
    with pytest.raises(DraftsmithError, match="needs the verifier online"):
        run(_cfg(tiny_model_dir, tmp_path / "run2", f"data.features={features}", "method.onpolicy.ratio=0.5"))
    plain = tmp_path / "plain"
    prepare(compose_config("prepare", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "dtype=float32", f"output_dir={plain}"]))
    with pytest.raises(DraftsmithError, match="holds no teacher logits"):
        run(_cfg(tiny_model_dir, tmp_path / "run3", f"data.features={plain}"))


def test_reduced_draft_vocab_is_the_most_frequent_targets(tiny_model_dir, tmp_path):
    """method.draft_vocab_size=N saves the N most frequent supervised targets of the training
    split beside a model that keeps its whole lm_head; the held-out metrics score q restricted
    to them (a restriction can only lower greedy agreement on the same weights); bad sizes are
    refused in one line."""
    from transformers import AutoTokenizer

    from draftsmith.models.vocab import draft_vocab, label_counts
    from draftsmith.train.core.loop import load_train_data

    full = run(_cfg(tiny_model_dir, tmp_path / "full", "trainer.max_steps=0"))
    cfg = _cfg(tiny_model_dir, tmp_path / "run", "trainer.max_steps=0", "method.draft_vocab_size=8")
    summary = run(cfg)
    model, _ = load_draft_model(summary["drafter_dir"], vocab_size=128)
    assert model.lm_head.weight.shape[0] == 128
    train = load_train_data(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)).train
    assert torch.equal(model.draft_vocab, draft_vocab(label_counts(train["labels"], 128), 8))
    assert summary["eval/greedy_agreement"] <= full["eval/greedy_agreement"]
    assert summary["eval/acceptance_rate"] != full["eval/acceptance_rate"]  # q restricted (it may rise: renormalised)
    for bad in ("0", "129", "true"):
        with pytest.raises(DraftsmithError, match=f"method.draft_vocab_size={bad.replace('true', 'True')}: must be") as info:
            run(_cfg(tiny_model_dir, tmp_path / f"bad{bad}", "trainer.max_steps=0", f"method.draft_vocab_size={bad}"))
        assert "\n" not in str(info.value)


def test_warm_start_adds_a_reduced_vocab_to_a_trained_draft(tiny_model_dir, tmp_path):
    """trainer.init_from=<draft> trainer.max_steps=0 method.draft_vocab_size=N: the trained
    weights, saved again with a reduced vocabulary. The saved folder's config.json differs from
    a fresh student's in bookkeeping only (here: no `architectures`, as a GGUF-converted
    verifier's students have); that must not stop the warm start."""
    import json

    first = run(_cfg(tiny_model_dir, tmp_path / "first"))
    config = tmp_path / "first" / "final" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": None}))
    summary = run(_cfg(tiny_model_dir, tmp_path / "v8", "trainer.max_steps=0", "method.draft_vocab_size=8",
                       f"trainer.init_from={first['drafter_dir']}"))
    old, _ = load_draft_model(first["drafter_dir"], vocab_size=128)
    new, meta = load_draft_model(summary["drafter_dir"], vocab_size=128)
    for name, weight in old.state_dict().items():
        assert torch.equal(new.state_dict()[name], weight), name
    assert new.draft_vocab.numel() == 8 and meta["warm_start"]["path"] == first["drafter_dir"]


@pytest.mark.parametrize("extra, message", [
    (["method=draft-fkl", "method.beta=0.3"], "method.beta=0.3 would be ignored: it is the JSD mixing weight, read by "
                                              "method.divergence=jsd only (divergence=fkl)"),
    (["method.student.hidden_size=16"], "method.student.hidden_size=16 would be ignored: it is read by "
                                        "method.student.init=config only (init=truncate)"),
    (["method.student.init=config", "method.student.path=/x"], "method.student.path=/x would be ignored"),
])
def test_a_method_key_this_run_would_ignore_is_refused_before_any_work(tiny_model_dir, tmp_path, monkeypatch, extra,
                                                                      message):
    from draftsmith.train import draft

    monkeypatch.setattr(draft.loop, "start", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(DraftsmithError) as refused:
        run(_cfg(tiny_model_dir, tmp_path, *extra))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_every_draft_preset_holds_the_beta_the_refusal_takes_as_default():
    """check_method_keys refuses a beta other than JSD_BETA outside jsd: the presets must hold it.
    The four divergences are one method (draft-fkl) with divergence=: the other three inherit it
    and state only their name and divergence."""
    from pathlib import Path

    import yaml

    from draftsmith.train.draft import JSD_BETA, check_method_keys

    presets = sorted((Path(__file__).resolve().parents[2] / "conf" / "method").glob("draft-*.yaml"))
    assert [p.stem for p in presets] == ["draft-fkl", "draft-jsd", "draft-rkl", "draft-tvd"]
    full = compose_config("draft", ["method=draft-fkl"]).method
    for path in presets:
        method = compose_config("draft", [f"method={path.stem}"]).method
        assert method.beta == JSD_BETA and method.name == path.stem, path
        assert {k: v for k, v in method.items() if k not in ("name", "divergence")} == {
            k: v for k, v in full.items() if k not in ("name", "divergence")}
        check_method_keys(method)  # every preset as it stands passes
        own = yaml.safe_load(path.read_text())
        if path.stem != "draft-fkl":
            assert set(own) == {"defaults", "name", "divergence"}, own
