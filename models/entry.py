"""Entry-point helpers for every Hydra script (trainers, evaluator, server, scripts/): compose
the config, refuse a bad override in one line before any work, run `run(cfg)` and turn a
DraftsmithError into one line and exit status 2. On the floor below train/ and decode/."""
from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from draftsmith.models.errors import DraftsmithError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def _override_keys(overrides: list[str]) -> list[str]:
    """The keys of the value overrides `a.b.c=value` and `key=value`: not additions (+),
    deletions (~), Hydra's own keys or `group@package` choices."""
    keys = [arg.split("=", 1)[0] for arg in overrides if "=" in arg and not arg.startswith(("+", "~", "hydra"))]
    return [key for key in keys if "@" not in key and "/" not in key]  # hydra/job_logging=..., group@pkg=...


def unknown_override(cfg: DictConfig, overrides: list[str]) -> str | None:
    """The first `a.b.c=value` or top-level `key=value` override whose key is not in cfg,
    explained; None if all exist.
    A key whose value is mandatory-missing (`???`, e.g. data.path of data=chat-jsonl) exists, and
    a list's items are numbered as Hydra numbers them (`data.parts.0.max_items=4800`)."""
    # every key but a group choice (`model=x`: config_problem checks the preset exists)
    for key in [k for k in _override_keys(overrides) if "." in k or not (CONF_DIR / k).is_dir()]:
        node, parts = cfg, key.split(".")
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "the top level"
            if isinstance(node, ListConfig):
                if not node:
                    return f"unknown config key {key!r}: {where} is an empty list; set it whole: {where}='[...]'"
                if not (part.isdigit() and int(part) < len(node)):
                    return f"unknown config key {key!r}: {where} is a list of {len(node)}; index it 0..{len(node) - 1}"
                node = node[int(part)]
                continue
            if not isinstance(node, DictConfig) or part not in node.keys():
                valid = ", ".join(sorted(str(k) for k in node)) if isinstance(node, DictConfig) else "(not a group)"
                return f"unknown config key {key!r}: {where} has no {part!r}; valid: {valid}"
            node = node._get_node(part) if OmegaConf.is_missing(node, part) else node[part]
    return None


AUTO_SIZES = (".eval_size",)  # number keys that also take `auto` (train/core/data.held_out_count)


def mistyped_override(base: DictConfig, full: DictConfig, overrides: list[str]) -> str | None:
    """The first override that puts text where the config holds a number or a boolean
    (`method.draft_vocab_size=8k`), or a boolean where it holds a number, explained; None if
    there is none. `base` is the config with the group choices only (a group's key holds its node
    there, not a scalar), `full` with every override; a null default accepts anything."""
    for key in _override_keys(overrides):
        try:
            default, value = OmegaConf.select(base, key), OmegaConf.select(full, key)
        except Exception:  # an interpolation that cannot resolve yet: the script reports it
            continue
        if not isinstance(default, (bool, int, float)) or (value == "auto" and key.endswith(AUTO_SIZES)):
            continue
        if isinstance(value, str) or (isinstance(value, bool) and not isinstance(default, bool)):  # max_steps=true
            kind, shown = ("true or false", str(default).lower()) if isinstance(default, bool) else ("a number", default)
            numeric = isinstance(value, str) and value.strip().lstrip("+-").replace(".", "", 1).isdigit()
            hint = "; it is a number as text (from ${oc.env:...}? wrap it in ${oc.decode:...})" if numeric else ""
            return f"{key}={value!r}: expected {kind}, like the default ({key}={shown}){hint}"
    return None


def config_problem(config_name: str, argv: list[str]) -> str | None:
    """What the entry script would refuse in these overrides, before any work: a misspelt key,
    text where a number or boolean belongs, or a data key that the chosen data source would
    ignore. None when all are fine (and when Hydra itself cannot compose them: it reports its
    own errors)."""
    from hydra import compose, initialize_config_dir

    from draftsmith.models.sources import source_key_problem

    args = [a for a in argv if not a.startswith("-")]

    def is_choice(a: str) -> bool:  # a group selection: `model=x`, `data@data.prompts=y` (not `rerun=true`)
        key = a.split("=", 1)[0]
        return "=" in a and ("@" in key or (CONF_DIR / key).is_dir()) and not a.startswith(("+", "~"))

    sweep = any(a in ("-m", "--multirun") or a.startswith("hydra.searchpath") for a in argv)
    groups = None  # the groups of the config's defaults list, composed once when needed
    for a in [] if sweep else filter(is_choice, args):  # `model=nope`: one line naming the presets
        key, value = a.split("=", 1)
        if any(c in value for c in ",()*[]{}$"):  # a sweep, glob(...), an interpolation: Hydra's to parse
            continue
        group = key.split("@", 1)[0]
        if "@" not in key:
            try:
                groups = config_groups(config_name) if groups is None else groups
            except Exception:  # the config does not compose as it stands: Hydra reports why
                return None
            if key not in groups:
                return f"{key}={value}: {config_name} takes no {key}= ({GROUP_HINTS.get(key, 'no such group here')})"
        options = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        if (CONF_DIR / group).is_dir() and value not in ("null", "") and value not in options:
            return f"{key}={value!r} is not a preset of conf/{group}/; valid: {', '.join(options)}"
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=[a for a in args if is_choice(a)])
            problem = unknown_override(cfg, args)
            if problem:
                return problem
            full = compose(config_name=config_name, overrides=args)
    except Exception:
        return None  # let Hydra report its own composition errors (unknown group options etc.)
    return mistyped_override(cfg, full, args) or (source_key_problem(full.data) if "data" in full else None)


@functools.lru_cache(maxsize=None)
def config_groups(config_name: str) -> frozenset[str]:
    """The config groups conf/<config_name>.yaml's defaults list chooses (`model`, `decode@...`)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        choices = compose(config_name=config_name, return_hydra_config=True).hydra.runtime.choices
    return frozenset(str(key) for key in choices if not str(key).startswith("hydra"))


# what a choice of a group the script does not take means instead
GROUP_HINTS = {
    "method": "a training recipe of train/*.py; what the decoder drafts with is proposer=, conf/proposer/: "
              + ", ".join(sorted(f.stem for f in (CONF_DIR / "proposer").glob("*.yaml"))),
    "proposer": "what the decoder drafts with; a training script takes its recipe as method=, conf/method/",
}


def model_overrides(model: DictConfig) -> list[str]:
    """The command-line overrides that give a child entry script this `model` node: its preset
    (`model=<name>`, when conf/model/<name>.yaml exists), its dtype and every key that differs. For
    a script run in this process, pass the node itself (OmegaConf.merge), never these strings."""
    preset = CONF_DIR / "model" / f"{model.name}.yaml"
    base = OmegaConf.load(preset if preset.is_file() else CONF_DIR / "model" / f"{DEFAULT_MODEL}.yaml")
    args = [f"model={model.name}"] if preset.is_file() else []
    for key, value in model.items():
        if key not in base or base[key] != value or key == "dtype":  # (a main config may set its own dtype)
            args.append(f"{'' if key in base else '++'}model.{key}={'null' if value is None else value}")
    return args


DEFAULT_MODEL = "smollm2-135m"  # the model preset every main config starts from


def run_overrides() -> list[str] | None:
    """The overrides this run's command line gave Hydra (its task overrides, as typed), or None
    outside a run started by `launch` (a config composed in a test or a notebook)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def check_cli_overrides(config_name: str, argv: list[str] | None = None) -> None:
    """Compose the config like Hydra would and stop on a bad override before any work starts."""
    problem = config_problem(config_name, sys.argv[1:] if argv is None else argv)
    if problem:
        print(f"draftsmith: error: {problem}", file=sys.stderr)
        sys.exit(2)


def compose_main(config_name: str, overrides: list[str]):
    """conf/<config_name>.yaml with these overrides, from plain Python or from inside another
    entry script's Hydra app (which has Hydra initialised already)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def launch(config_name: str, run) -> None:
    """The `if __name__ == "__main__"` of every entry script: check the overrides, then let
    Hydra compose conf/<config_name>.yaml and call run(cfg); bad input ends in one line."""
    import hydra

    from draftsmith.models.errors import exit_on_user_error

    check_cli_overrides(config_name)
    fresh = first_missing_dir(run_dir(config_name, sys.argv[1:]))

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def main(cfg: DictConfig) -> None:
        with exit_on_user_error(), forget_refused_run(fresh):
            run(cfg)

    main()
    end_process_group()


def run_dir(config_name: str, argv: list[str]) -> Path | None:
    """The folder Hydra will create for this run (hydra.run.dir, resolved), or None when it cannot
    be told before Hydra starts (a sweep, a composition error: Hydra reports those itself)."""
    from hydra import compose, initialize_config_dir

    args = [a for a in argv if not a.startswith("-")]
    if len(args) < len(argv):  # -m / --multirun / --cfg ...: Hydra's own modes
        return None
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=args, return_hydra_config=True)
            return Path(str(cfg.hydra.run.dir)).absolute()
    except Exception:
        return None


def first_missing_dir(path: Path | None) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what a run creates), or None."""
    if path is None or path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


HYDRA_FILES = {".hydra"}  # what Hydra writes into a run folder before run(cfg) starts, besides *.log


@contextlib.contextmanager
def forget_refused_run(fresh: Path | None):
    """A run refused before any work leaves nothing behind: on a DraftsmithError, the folder this
    run created (`fresh`) is removed when it holds only Hydra's own files (.hydra/, the job log);
    anything the run itself wrote keeps it."""
    try:
        yield
    except DraftsmithError:
        if fresh is not None and fresh.is_dir() and only_hydra_files(fresh):
            logging.shutdown()  # the job log's handler holds its file open
            shutil.rmtree(fresh, ignore_errors=True)
        raise


def only_hydra_files(folder: Path) -> bool:
    """Every file under `folder` is Hydra's: inside .hydra/ or a job log (*.log)."""
    return all(path.is_dir() or HYDRA_FILES & set(path.relative_to(folder).parts) or path.suffix == ".log"
               for path in folder.rglob("*"))


def end_process_group() -> None:
    """Leave a multi-process launch cleanly once the script's work is done (the trainers keep
    their process group across runs: scripts/refresh.py trains twice in one launch)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_measured(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS in GB over the process tree) of one command run from the repository
    root; its stderr goes to a file (a pipe would fill and stall it) and its tail is raised on failure."""
    import psutil

    t0, peak = time.time(), 0
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=CONF_DIR.parent, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [parent, *parent.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.2)
        if proc.returncode != 0:
            err.seek(0)
            text = err.read()
            refused = [line for line in text.splitlines() if line.startswith("draftsmith: error: ")]
            if refused:  # bad input in the child: its one line, not a wrapped traceback
                from draftsmith.models.errors import DraftsmithError

                script = next((Path(c).name for c in cmd if c.endswith(".py")), cmd[0])
                raise DraftsmithError(f"{script}: {refused[-1].removeprefix('draftsmith: error: ')}")
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed: {text[-2000:]}")
    return time.time() - t0, peak / 1e9
