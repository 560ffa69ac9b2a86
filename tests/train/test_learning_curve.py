"""Snapshots during training (trainer.snapshot_every) and scripts/bench/learning_curve.py over them:
tokens and seconds accumulate across a resume, every snapshot is a drafter the evaluator
decodes, and the curve's JSON / table / plot are written (tiny verifier)."""
import json

import pytest

from draftsmith.models.errors import DraftsmithError
from draftsmith.train.eagle import run as train
from scripts.bench import learning_curve
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("eagle", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=8", "logger=csv", f"output_dir={out}", "method=eagle1",
        "trainer.eval_every=2", "trainer.save_every=2", "trainer.snapshot_every=2", *extra])


def test_snapshots_accumulate_tokens_across_a_resume_and_feed_the_curve(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(tiny_model_dir, run_dir, "trainer.max_steps=4"))
    summary = train(_cfg(tiny_model_dir, run_dir, "trainer.max_steps=6"))  # resumes at step 4
    snaps = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert snaps == ["step-00000002", "step-00000004", "step-00000006"]
    metas = [json.loads((run_dir / "snapshots" / s / "meta.json").read_text())["metrics"] for s in snaps]
    tokens = [m["tokens"] for m in metas]
    assert 0 < tokens[0] < tokens[1] < tokens[2] == summary["tokens"]
    assert tokens[2] - tokens[1] == pytest.approx(tokens[1] - tokens[0], rel=0.5)  # the resume kept the count
    assert metas[2]["seconds"] > metas[1]["seconds"] > 0

    cfg = compose_config("learning_curve", tiny_model_overrides(tiny_model_dir) + [
        f"runs.eagle3={run_dir}", "decode.eagle3='proposer=eagle decode=eagle-static'", "dataset=tiny",
        "num_prompts=2", "max_new_tokens=8", f"output_dir={tmp_path / 'curve'}"])
    report = learning_curve.run(cfg)
    points = report["runs"]["eagle3"]["points"]
    assert [p["step"] for p in points] == [2, 4, 6] and [p["tokens"] for p in points] == tokens
    assert all(p["decode_tau"] >= 1.0 and p["held_out_tau"] >= 1.0 for p in points)
    assert {p["held_out_metric"] for p in points} == {"eval/simulated_tau"}
    assert (tmp_path / "curve" / "learning_curve.png").stat().st_size > 1000
    assert "| eagle3 | 6 |" in (tmp_path / "curve" / "learning_curve.md").read_text()


def test_snapshot_every_must_be_a_multiple_of_eval_every(tiny_model_dir, tmp_path):
    with pytest.raises(DraftsmithError, match="trainer.snapshot_every=3 is not a multiple of trainer.eval_every=2"):
        train(_cfg(tiny_model_dir, tmp_path / "r", "trainer.snapshot_every=3"))


def test_a_run_without_snapshots_is_a_one_line_error(tiny_model_dir, tmp_path):
    cfg = compose_config("learning_curve", tiny_model_overrides(tiny_model_dir) + [
        f"runs.eagle3={tmp_path}", f"output_dir={tmp_path / 'curve'}"])
    with pytest.raises(DraftsmithError, match="has no step-\\* folders; train with trainer.snapshot_every=N"):
        learning_curve.run(cfg)


def test_a_draft_models_curve_reads_its_greedy_chain_tau(tiny_model_dir, tmp_path):
    """A draft model logs no simulated tau: its held-out point is the chain tau of its greedy agreement."""
    from draftsmith.train.draft import run as train_draft

    run_dir = tmp_path / "draft"
    train_draft(compose_config("draft", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "trainer.max_steps=4", "trainer.eval_every=2",
        "trainer.save_every=2", "trainer.snapshot_every=2", "logger=csv", f"output_dir={run_dir}",
        "method.student.num_layers=1", "probe.num_prompts=0"]))
    cfg = compose_config("learning_curve", tiny_model_overrides(tiny_model_dir) + [
        f"runs.draft={run_dir}", "dataset=tiny", "num_prompts=2", "max_new_tokens=8",
        f"output_dir={tmp_path / 'curve'}"])
    points = learning_curve.run(cfg)["runs"]["draft"]["points"]
    metas = [json.loads((run_dir / "snapshots" / f"step-0000000{s}" / "meta.json").read_text())["metrics"] for s in (2, 4)]
    assert [p["held_out_metric"] for p in points] == ["eval/chain_tau_greedy"] * 2
    assert [p["held_out_tau"] for p in points] == [m["eval/chain_tau_greedy"] for m in metas]
    assert "| draft | 4 |" in (tmp_path / "curve" / "learning_curve.md").read_text()
