"""Run a named experiment: an ordered list of steps, each one entry script with its Hydra overrides.

    python scripts/experiment.py experiment=compare-all dry_run=true      # print every step's command
    python scripts/experiment.py experiment=compare-all                   # EAGLE-3, Medusa-1, a draft: README "Results"
    python scripts/experiment.py experiment=compare-peagle max_steps=4 every=2 out=outputs/peagle-smoke
    python scripts/experiment.py experiment=compare-all model=vicuna-7b-v1.3 train_overrides="['trainer.max_minutes=600']"

An experiment is conf/experiment/<name>.yaml: its own settings (output folder, budgets, prompt
counts: plain keys the steps interpolate, so `out=...` or `budget.eagle3.steps=600` changes them on
the command line) and `steps`, a map from step name to

    run:  the entry script (train/eagle.py, scripts/prepare_features.py, scripts/bench/compare.py, ...)
    args: its Hydra overrides, as you would type them
    done: (optional) a file the step writes last; when it exists the step is skipped on a rerun

Before anything runs, every step's full command is checked against its script's own config (a
misspelt key, a missing preset, a mistyped value stop the run in one line, naming the step). Then
the steps run in order as subprocesses of this python, each printed with its place (step 3/12);
a failing step stops the run, naming it. Rerunning the same command resumes: the trainers,
self-distillation, feature extraction, learning curves and comparisons resume or reuse what they
finished; a step with `done` is skipped once its file exists (rerun=[name] runs it again).

Every training step (train/*.py) also gets `train_overrides`; `model=<preset>` (and model.* keys)
go to every step whose script takes a verifier.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftsmith.models.entry import CONF_DIR, config_problem, launch, model_overrides
from draftsmith.models.errors import DraftsmithError

ROOT = CONF_DIR.parent
STEP_KEYS = {"run": "the entry script", "args": "its Hydra overrides", "done": "a file that marks it finished"}
ENTRY = re.compile(r'^\s*launch\("([\w-]+)", run\)', re.M)  # the config an entry script composes


def script_config(script: str) -> str:
    """The main config (conf/<name>.yaml) the entry script at `script` composes."""
    path = ROOT / script
    match = ENTRY.search(path.read_text()) if path.is_file() else None
    if match is None:
        raise DraftsmithError(f"{script}: not an entry script of this repository (no such file, or no "
                              f"launch(...)); give a path like train/eagle.py or scripts/bench/compare.py")
    return match.group(1)


def model_args(cfg: DictConfig) -> list[str]:
    """The model this run was given (model=<preset> and the model.* keys changed), as overrides for
    the steps that take a verifier; [] when none was given. The preset's own dtype is not passed,
    so a step's model.dtype stays its own unless model.dtype= was given."""
    if cfg.get("model") is None:
        return []
    preset = CONF_DIR / "model" / f"{cfg.model.name}.yaml"
    own = OmegaConf.load(preset).get("dtype") if preset.is_file() else None
    return [a for a in model_overrides(cfg.model) if a != f"model.dtype={own}"]


def check_steps(cfg: DictConfig) -> None:
    """Refuse a malformed step, or a skip / rerun name that is no step, in one line."""
    if not cfg.steps:
        raise DraftsmithError("steps is empty: choose an experiment, e.g. experiment=compare-all "
                              f"(conf/experiment/: {', '.join(experiments())})")
    for name, step in cfg.steps.items():
        if not isinstance(step, DictConfig):
            raise DraftsmithError(f"steps.{name}: give a map with {', '.join(STEP_KEYS)}")
        unknown = sorted(set(step) - set(STEP_KEYS))
        if unknown:
            raise DraftsmithError(f"steps.{name} has {unknown[0]!r}; valid: "
                                  + ", ".join(f"{k} ({v})" for k, v in STEP_KEYS.items()))
        if not step.get("run"):
            raise DraftsmithError(f"steps.{name} has no run: name its entry script, e.g. run: train/eagle.py")
        if step.get("args") is not None and not isinstance(step.args, ListConfig):
            raise DraftsmithError(f"steps.{name}.args: give a list of overrides, e.g. args: [data=sharegpt-text]")
    for key in ("skip", "rerun", "train_overrides"):
        names = cfg[key]
        if isinstance(names, str) or names is None:
            example = f"\"['{names}']\"" if key == "train_overrides" else f"'[{names}]'"
            raise DraftsmithError(f"{key}={names}: give a list, {key}={example}")
        unknown = [n for n in names if n not in cfg.steps]
        if unknown and key != "train_overrides":
            raise DraftsmithError(f"{key}={list(names)}: no step {unknown[0]!r}; this experiment's steps: "
                                  f"{', '.join(cfg.steps)}")


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@contextlib.contextmanager
def hydra_lent_aside():
    """Compose the steps' configs in Hydra contexts of their own: this process's (the experiment's
    Hydra app, when run as a script) is lent aside meanwhile, and restored."""
    from hydra.core.global_hydra import GlobalHydra

    instance = GlobalHydra.instance()
    saved = instance.hydra if instance.is_initialized() else None
    instance.clear()
    try:
        yield
    finally:
        instance.clear()
        if saved is not None:
            instance.initialize(saved)


def compose_step(config: str, args: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config, overrides=args)


def composition_problem(config: str, args: list[str]) -> str | None:
    """What the step's script would refuse in these overrides (its own check, then Hydra's
    composition), in one line; None when it composes. Call inside hydra_lent_aside()."""
    problem = config_problem(config, args)
    if problem:
        return problem
    try:
        compose_step(config, args)
    except Exception as e:  # Hydra's own composition error, in one line
        return str(e).strip().splitlines()[0]
    return None


def commands(cfg: DictConfig) -> list[tuple[str, list[str]]]:
    """(step name, [script, *overrides]) per step to run, in order, with train_overrides on the
    training steps and the model on the steps whose script takes one. Each command is checked
    against its script's config here, before anything runs."""
    check_steps(cfg)
    model, extra = model_args(cfg), [str(a) for a in cfg.train_overrides]
    out = []
    with hydra_lent_aside():
        for name, step in cfg.steps.items():
            if name in cfg.skip:
                continue
            config = script_config(step.run)
            try:
                args = [str(a) for a in step.get("args") or []]
            except OmegaConfBaseException as e:  # ${a_key_the_experiment_lacks}
                raise DraftsmithError(f"steps.{name}.args: {str(e).strip().splitlines()[0]}") from None
            if model and "model" in compose_step(config, []):  # the script loads a verifier
                args += model
            if step.run.startswith("train/"):
                args += extra
            problem = composition_problem(config, args)
            if problem:
                raise DraftsmithError(f"step {name} ({step.run}): {problem}")
            out.append((name, [str(step.run), *args]))
    return out


def quoted(arg: str) -> str:
    """`arg` as a shell word, in double quotes when it holds single ones (Hydra's list items)."""
    if "'" in arg and not any(c in arg for c in '"$`\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


def shown(command: list[str]) -> str:
    """The command as one copyable shell line, run from the repository root."""
    return " ".join(["python", *map(quoted, command)])


def run(cfg: DictConfig) -> dict:
    todo = commands(cfg)
    if cfg.dry_run:
        for i, (name, command) in enumerate(todo, 1):
            print(f"# step {i}/{len(todo)}: {name}\n{shown(command)}", flush=True)
        return {"steps": [name for name, _ in todo], "ran": []}
    env = {**{k: str(v) for k, v in cfg.env.items()}, **os.environ}  # the caller's environment wins
    ran, skipped = [], []
    for i, (name, command) in enumerate(todo, 1):
        done = cfg.steps[name].get("done")
        if done and Path(done).exists() and name not in cfg.rerun:
            print(f"experiment: step {i}/{len(todo)} {name}: done ({done} exists; rerun='[{name}]' runs it again)",
                  flush=True)
            skipped.append(name)
            continue
        print(f"experiment: step {i}/{len(todo)} {name}: {shown(command)}", flush=True)
        proc = subprocess.run([sys.executable, str(ROOT / command[0]), *command[1:]], env=env)
        if proc.returncode != 0:
            raise DraftsmithError(f"step {i}/{len(todo)} {name} failed (exit status {proc.returncode}; its output "
                                  f"is above); fix it and rerun the same command: finished steps resume or are skipped")
        ran.append(name)
    print(f"experiment: {len(ran)} step(s) ran, {len(skipped)} already done", flush=True)
    return {"steps": [name for name, _ in todo], "ran": ran, "skipped": skipped}


if __name__ == "__main__":
    launch("experiment", run)
