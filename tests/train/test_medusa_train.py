
import pytest

from draftsmith.models.checkpoint import load_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.train.medusa import run
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config, logged


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "logger=csv", f"output_dir={out}",
        "method.num_heads=2", *extra])


def test_three_steps_loss_falls_and_checkpoint_reloads(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    summary = run(_cfg(tiny_model_dir, out))
    assert summary["steps"] == 3
    losses = logged(out, "train/loss")
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # the whole train split is one batch
    for k in range(2):
        assert 0.0 <= summary[f"eval/head{k}_top1"] <= summary[f"eval/head{k}_top5"] <= 1.0
    kind, heads, config, meta = load_drafter(summary["drafter_dir"])
    assert kind == "medusa" and config.num_heads == 2 and meta["metrics"]["step"] == 3
    assert (out / "final" / "config.yaml").is_file() and (out / "best" / "meta.json").is_file()
    # the heads trained: the ResBlocks moved away from their zero init
    assert any(b.layers[0].weight.abs().sum() > 0 for b in heads.blocks)
    assert (out / "checkpoints" / "step-00000003" / "trainer_state.json").is_file()


def test_resume_continues_and_other_config_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run(_cfg(tiny_model_dir, out))
    summary = run(_cfg(tiny_model_dir, out, "trainer.max_steps=5"))  # resumes at step 3
    assert summary["steps"] == 5
    assert len(logged(out, "train/loss")) == 5  # steps 1-3 from the first run, 4-5 from the resumed one
    with pytest.raises(DraftsmithError, match="another config"):
        run(_cfg(tiny_model_dir, out, "method.decay=0.5"))


def test_shared_lm_head_mode_trains(tiny_model_dir, tmp_path):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "method.lm_head=shared"))
    _, heads, config, _ = load_drafter(summary["drafter_dir"])
    assert config.lm_head == "shared" and not hasattr(heads, "lm_heads")


def test_draft_vocabulary_is_the_most_frequent_training_targets(tiny_model_dir, tmp_path):
    import torch

    from draftsmith.models.sources import load_conversations
    from draftsmith.models.verifier import load_verifier
    from draftsmith.train.core.data import split_heldout, tokenize_conversations

    cfg = _cfg(tiny_model_dir, tmp_path / "run", "method.draft_vocab_size=20", "method.lm_head=shared")
    summary = run(cfg)
    _, heads, config, _ = load_drafter(summary["drafter_dir"])
    assert config.draft_vocab_size == 20 and heads.token_map.shape == (20,)
    verifier = load_verifier(cfg.model)
    train_conv, _ = split_heldout(load_conversations(cfg.data), cfg.data)
    labels = torch.cat([torch.tensor(x) for x in tokenize_conversations(train_conv, verifier.tokenizer,
                                                                         cfg.data.max_length)["labels"]])
    counts = torch.bincount(labels[labels >= 0], minlength=128)
    assert counts[heads.token_map].min() >= counts.sort(descending=True).values[19]  # no rarer token got in


def test_bad_method_value_is_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="method.lm_head='tied'.*valid: own, shared"):
        run(_cfg(tiny_model_dir, tmp_path / "run", "method.lm_head=tied"))


def test_wandb_logger_works_offline(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    run(_cfg(tiny_model_dir, out, "logger=wandb", "logger.project=draftsmith-test"))
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs, list(out.iterdir())
    assert (out / "metrics.csv").is_file()  # the CSV copy is kept beside wandb


def test_max_minutes_stops_evaluates_saves_and_a_rerun_stays_stopped(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, out, "trainer.max_steps=50", "trainer.eval_every=25", "trainer.max_minutes=1e-6")
    summary = run(cfg)
    assert summary["steps"] == 1 and "eval/simulated_tau" in summary  # the budget ran out after the first step
    assert (out / "checkpoints" / "step-00000001").is_dir() and (out / "final" / "meta.json").is_file()
    assert run(cfg)["steps"] == 1  # resumed past its budget: nothing more is trained


def test_verifier_targets_are_its_greedy_tokens_and_equal_the_labels_of_its_own_greedy_answer():
    """method.targets=verifier: the token at each supervised position j is argmax of the verifier
    at j-1 (checked against HF logits); on the verifier's own greedy answer (self-distilled data)
    those are exactly the labels; and on other text they differ."""
    import torch

    from draftsmith.models.vocab import IGNORE_INDEX
    from draftsmith.train.medusa import verifier_labels
    from tests.tiny import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float64).eval()
    prompt = torch.randint(0, 128, (2, 5))
    answer = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)  # (2, 13) greedy
    labels = answer.clone()
    labels[:, :5] = IGNORE_INDEX  # the answer is supervised, the prompt is not
    with torch.no_grad():
        out = model(answer, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # (2, 13, H) final normed states
    got = verifier_labels(hidden, labels, model.lm_head)
    assert (got[:, :5] == IGNORE_INDEX).all()
    assert torch.equal(got[:, 5:], out.logits[:, 4:-1].argmax(-1))  # position j from the logits at j-1
    assert torch.equal(got, labels)  # the verifier's own greedy answer: its targets are the labels
    text = answer.clone()
    text[:, 5:] = torch.randint(0, 128, (2, 8))  # fixed text the verifier did not write
    with torch.no_grad():
        h = model(text, output_hidden_states=True).hidden_states[-1]
    other = verifier_labels(h, torch.where(labels == IGNORE_INDEX, labels, text), model.lm_head)
    assert not torch.equal(other[:, 5:], text[:, 5:])


def test_verifier_targets_train_and_are_refused_for_medusa2(tiny_model_dir, tmp_path):
    summary = run(_cfg(tiny_model_dir, tmp_path / "run", "method.targets=verifier"))
    assert summary["steps"] == 3 and 0.0 <= summary["eval/head0_top1"] <= 1.0
    with pytest.raises(DraftsmithError, match="method.targets='teacher' is not known; valid: labels, verifier"):
        run(_cfg(tiny_model_dir, tmp_path / "bad", "method.targets=teacher"))
    with pytest.raises(DraftsmithError, match="method.targets=verifier is for Medusa-1"):
        run(compose_config("medusa", tiny_model_overrides(tiny_model_dir) + [
            "method=medusa2", "method.targets=verifier", "data=tiny", "trainer=debug", f"output_dir={tmp_path / 'm2'}"]))
