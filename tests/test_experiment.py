"""scripts/experiment.py and conf/experiment/: every step of every named experiment composes under
its script's own config; the steps run in order, as subprocesses, and the first that fails stops
the run naming it; a rerun skips the steps whose `done` file exists; bad keys and step names are
refused in one line; the hand-offs between steps (features, continued stages, the tuned tree, the
comparison's and curves' folders) line up. Nothing is trained: the subprocess call is recorded
(one test lets a real step fail)."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.models.errors import DraftsmithError
from scripts import experiment as runner
from tests.hub import compose_config
from tests.commands import check

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def composed(name: str, *overrides: str):
    return compose_config("experiment", [f"experiment={name}", *overrides])


@pytest.fixture()
def recorder(monkeypatch):
    """The runner's subprocess.run, recorded: each call's [script, *overrides]; a step can be made
    to fail (exit status 1) or to write a file, as the real script would."""
    calls, fail, writes = [], set(), {}

    def fake_run(argv, env):
        assert argv[0] == sys.executable and env["WANDB_MODE"]
        command = [str(Path(argv[1]).relative_to(ROOT)), *argv[2:]]
        calls.append(command)
        for path, text in writes.pop(command[0], {}).items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return SimpleNamespace(returncode=1 if command[0] in fail else 0)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    return SimpleNamespace(calls=calls, fail=fail, writes=writes)


def arg(command: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in command if a.startswith(f"{key}="))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_step_of_every_experiment_composes_under_its_script(name):
    cfg = composed(name)
    commands = runner.commands(cfg)
    assert [step for step, _ in commands] == list(cfg.steps)  # in the order written, none dropped
    for step, command in commands:
        assert (ROOT / command[0]).is_file()
        check(command, f"conf/experiment/{name}.yaml, step {step}")
    for step, command in commands:  # the trainer's own run-time check: snapshots are taken at evaluations
        if command[0].startswith("train/"):
            trainer = compose_config(runner.script_config(command[0]), command[1:]).trainer
            assert trainer.snapshot_every % trainer.eval_every == 0, (name, step)


def test_the_steps_run_in_order_and_a_failing_step_stops_the_run_naming_it(tmp_path, recorder, capsys):
    cfg = composed("compare-peagle", f"out={tmp_path}")
    planned = runner.commands(cfg)
    report = runner.run(cfg)
    assert recorder.calls == [command for _, command in planned] and report["ran"] == list(cfg.steps)
    out = capsys.readouterr().out
    assert "step 1/7 eagle3: python train/eagle.py" in out and "step 7/7 summary" in out

    recorder.calls.clear()
    recorder.fail.add("scripts/bench/learning_curve.py")
    with pytest.raises(DraftsmithError, match=r"^step 5/7 curves failed \(exit status 1; its output is above\); fix it "
                                              r"and rerun the same command"):
        runner.run(cfg)
    assert [c[0] for c in recorder.calls] == ["train/eagle.py"] * 4 + ["scripts/bench/learning_curve.py"]


def test_a_rerun_skips_the_steps_whose_output_is_done(tmp_path, recorder):
    """The trainers, self-distillation, features, curves and comparisons resume by themselves (they
    run again); tune_decode and build_datastore declare `done`: once it exists they are skipped,
    unless named in rerun."""
    cfg = composed("compare-all", f"out={tmp_path}")
    done = {name: step.done for name, step in cfg.steps.items() if step.get("done")}
    assert set(done) == {"tune-eagle3", "datastore"}
    recorder.writes["scripts/bench/tune_decode.py"] = {done["tune-eagle3"]: "decode.depth=3\n"}
    recorder.writes["scripts/build_datastore.py"] = {done["datastore"]: "{}"}
    first = runner.run(cfg)
    assert first["ran"] == list(cfg.steps) and first["skipped"] == []
    again = runner.run(cfg)
    assert again["skipped"] == ["tune-eagle3", "datastore"]
    assert again["ran"] == [s for s in cfg.steps if s not in ("tune-eagle3", "datastore")]
    forced = runner.run(composed("compare-all", f"out={tmp_path}", "rerun=[datastore]"))
    assert forced["skipped"] == ["tune-eagle3"]
    skipped = runner.run(composed("compare-all", f"out={tmp_path}", "skip=[selfdistill,learning-curve]"))
    assert "selfdistill" not in skipped["steps"] and "learning-curve" not in skipped["steps"]


def test_dry_run_prints_every_command_and_runs_none(recorder, capsys):
    cfg = composed("compare-all", "dry_run=true")
    report = runner.run(cfg)
    assert recorder.calls == [] and report["ran"] == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python ")]
    # each printed line is the very command, as a shell reads it back
    assert [shlex.split(line)[1:] for line in lines] == [command for _, command in runner.commands(cfg)]


def test_the_tuned_tree_and_the_last_eagle3_stage_reach_both_comparisons(tmp_path, recorder):
    """compare-all continues EAGLE-3 in stages, each warm-started from the one before; the last
    stage's drafter is the one tune_decode sizes a tree for and the eagle3 rows (also grafted) of
    both comparisons decode with, with that tree (compare.py reads tune_decode's best.txt)."""
    from scripts.bench import compare

    cfg = composed("compare-all", f"out={tmp_path}")
    commands = dict(runner.commands(cfg))
    stages = [compose_config("eagle", c[1:]) for name, c in commands.items()
              if c[0] == "train/eagle.py" and compose_config("eagle", c[1:]).method.name == "eagle3"]
    assert len(stages) == 3
    for before, after in zip(stages, stages[1:]):
        assert after.trainer.init_from == f"{before.output_dir}/final"
    last = f"{stages[-1].output_dir}/final"
    tune = compose_config("tune_decode", commands["tune-eagle3"][1:])
    assert tune.drafter == last
    (Path(tune.output_dir)).mkdir(parents=True)
    (Path(tune.output_dir) / "best.txt").write_text("decode.depth=6 decode.top_k=8 decode.total_tokens=16\n")
    for step in ("compare", "compare-t07"):
        cmp = compose_config("compare", commands[step][1:])
        for row in ("eagle3", "eagle3-pl"):
            overrides = compare.method_overrides(cmp, row)
            assert compare.drafter_of(overrides) == last
            assert overrides[-3:] == ["decode.depth=6", "decode.top_k=8", "decode.total_tokens=16"]
        assert set(cmp.methods["medusa1-pl"][3:]) <= set(compare.method_overrides(cmp, "eagle3-pl"))  # the graft
    assert compare.datastore_of(compare.method_overrides(compose_config("compare", commands["compare"][1:]),
                                                         "eagle3-ds")) == compose_config(
        "build_datastore", commands["datastore"][1:]).output_dir  # the datastore this run built


def test_the_steps_hand_their_outputs_to_the_next(tmp_path):
    """Medusa-1 trains from the features of the same data; the curves read the trainings' folders;
    the P-EAGLE summary reads the folders its comparison and curves wrote."""
    from scripts.bench import compare

    commands = dict(runner.commands(composed("compare-all", f"out={tmp_path}")))
    prep = compose_config("prepare", commands["medusa1-features"][1:])
    medusa = compose_config("medusa", commands["medusa1"][1:])
    assert medusa.data.features == prep.output_dir and medusa.data.name == prep.data.name
    curves = compose_config("learning_curve", commands["learning-curve"][1:])
    trained = {compose_config(runner.script_config(c[0]), c[1:]).output_dir for c in commands.values()
               if c[0].startswith("train/")}
    assert {v for v in curves.runs.values() if v} <= trained

    commands = dict(runner.commands(composed("compare-peagle", f"out={tmp_path}")))
    summary = compose_config("peagle_summary", commands["summary"][1:])
    assert compose_config("compare", commands["compare"][1:]).output_dir == f"{summary.cmp_dir}/compare"
    assert compose_config("learning_curve", commands["curves"][1:]).output_dir == f"{summary.cmp_dir}/curves"
    cmp = compose_config("compare", commands["compare"][1:])
    runs = {compose_config("eagle", c[1:]).output_dir for c in commands.values() if c[0] == "train/eagle.py"}
    assert {compare.drafter_of(cmp.methods[m]).removesuffix("/final") for m in summary.methods} == runs


def test_model_and_train_overrides_reach_the_steps_that_take_them():
    cfg = composed("compare-peagle", "model=vicuna-7b-v1.3", "model.dtype=float32",
                   "train_overrides=['trainer.max_minutes=30']")
    for name, command in runner.commands(cfg):
        script = command[0]
        if script == "scripts/bench/peagle_summary.py":  # reads what the others wrote: no verifier
            assert not any(a.startswith("model") for a in command)
            continue
        composed_step = compose_config(runner.script_config(script), command[1:])
        assert (composed_step.model.name, composed_step.model.dtype) == ("vicuna-7b-v1.3", "float32"), name
        assert ("trainer.max_minutes=30" in command) == script.startswith("train/"), name
    # no model given: each step keeps its own (the recipe's bf16 included)
    plain = dict(runner.commands(composed("compare-peagle")))
    assert compose_config("eagle", plain["eagle3"][1:]).model.dtype == "bfloat16"
    assert not any(a.startswith("model=") for c in plain.values() for a in c)
    # the preset's own dtype is not passed: the recipe's stays
    same = dict(runner.commands(composed("compare-peagle", "model=vicuna-7b-v1.3")))
    assert compose_config("eagle", same["eagle3"][1:]).model.dtype == "bfloat16"


@pytest.mark.parametrize("overrides, message", [
    (["skip=[eagel3]"], r"^skip=\['eagel3'\]: no step 'eagel3'; this experiment's steps: eagle3, eagle3-lk, "),
    (["rerun=summary"], r"^rerun=summary: give a list, rerun='\[summary\]'"),
    (["+steps.eagle3.argz=[]"], r"^steps.eagle3 has 'argz'; valid: run \(the entry script\), args"),
    (["+steps.extra.args=[]"], r"^steps.extra has no run: name its entry script"),
    (["+steps.extra.run=scripts/nowhere.py"], r"^scripts/nowhere.py: not an entry script of this repository"),
    (["steps.eagle3.args=['trainer.max_stepz=3']"], r"^step eagle3 \(train/eagle.py\): unknown config key "
                                                  r"'trainer.max_stepz': trainer has no 'max_stepz'; valid: "),
    (["train_overrides=['data=nosuch']"], r"^step eagle3 \(train/eagle.py\): data='nosuch' is not a preset of "
                                          r"conf/data/; valid: "),
    (["steps.eagle3.args=['trainer.max_steps=${budgett}']"],
     r"^steps.eagle3.args: Interpolation key 'budgett' not found"),
])
def test_a_bad_step_or_setting_is_refused_before_anything_runs(overrides, message, recorder):
    with pytest.raises(DraftsmithError, match=message):
        runner.run(composed("compare-peagle", *overrides))
    assert recorder.calls == []


def test_an_unknown_key_or_experiment_stops_the_runner_in_one_line():
    for argv, message in ((["experiment=compare-peagle", "max_step=3"],
                           "draftsmith: error: unknown config key 'max_step': the top level has no 'max_step'; valid: "),
                          (["experiment=compare-al"], "draftsmith: error: experiment='compare-al' is not a preset of "
                                                      "conf/experiment/; valid: compare-all, compare-peagle")):
        proc = subprocess.run([sys.executable, "scripts/experiment.py", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)


def test_a_real_failing_step_ends_the_runner_in_one_line_after_its_own(tmp_path):
    """Unrecorded: the runner starts the step's script with this python; the step's own refusal
    is printed, then the runner's line naming the step, and the exit status is 2."""
    out = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, "scripts/experiment.py", "experiment=compare-peagle", f"out={out}",
                           "skip=[eagle3,eagle3-lk,peagle,peagle-lk,curves,compare]"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-2].startswith(f"draftsmith: error: cmp_dir={out}: no compare/compare.json")
    assert lines[-1].startswith("draftsmith: error: step 1/1 summary failed (exit status 2")
    assert "step 1/1 summary: python scripts/bench/peagle_summary.py" in proc.stdout
