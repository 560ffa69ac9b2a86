"""The documented commands as data: the pages (README.md, docs/), the commands each holds, the
Python invocations a command makes (shell scripts recorded, experiments expanded into their
steps), and the check every invocation passes (the entry script's own override check, then Hydra's
composition with all its overrides). Used by tests/test_documented_commands.py and by the tests
that check other pages' commands."""
from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from pathlib import Path

from tests.hub import compose_config

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r'^\s*launch\("([\w-]+)", run\)', re.M)
LAUNCHERS = {"python", "accelerate", "torchrun", "bash"}
NOT_JOBS = ("-m", "-c")  # python -m pytest / -c ...: not an entry script


def documented_pages() -> list[str]:
    """README.md and every markdown file under docs/ (the result folders' tables too), relative to ROOT."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def written_pages() -> list[str]:
    """The pages people write (README.md, docs/*.md, docs/results/*.md), not the tables scripts wrote."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in [*(ROOT / "docs").glob("*.md"),
                                                                      *(ROOT / "docs" / "results").glob("*.md")])


def page_commands(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        commands += [c for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.lstrip().startswith("#")]
    # inline code that runs something (a bare mention like `accelerate launch` names no script)
    commands += [c for c in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text) if re.search(r"\.(py|sh)\b", c)]
    return [c for c in commands if first_word(c) in LAUNCHERS]


def first_line(path: Path) -> str:
    """The first line of a YAML file after Hydra's `# @package` header, if it has one (a named
    experiment's `# @package _global_` must come first)."""
    lines = path.read_text().splitlines()
    return lines[1] if lines[0].startswith("# @package ") else lines[0]


def yaml_commands() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        first = first_line(path)
        assert first.startswith("# "), f"{path} does not start with the command that uses it"
        out.append((str(path.relative_to(ROOT)), re.split(r"\s{2,}", first[2:].strip())[0]))
    return out


def strip(command: str) -> list[str]:
    """The words of a shell command, without a trailing comment and leading VAR=value."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return words


def first_word(command: str) -> str | None:
    try:
        words = strip(command)
    except ValueError:
        return None
    return words[0] if words else None


def env_of(command: str) -> dict:
    words = shlex.split(command, comments=True)
    env = {}
    for w in words:
        if not re.match(r"^[A-Z_][A-Z0-9_]*=", w):
            break
        key, value = w.split("=", 1)
        env[key] = value
    return env


def python_invocations(command: str) -> list[list[str]]:
    """Each entry-script invocation [script, *overrides] that the command runs."""
    out = []
    for part in re.split(r"&&|;", command):
        words = strip(part)
        if not words:
            continue
        if words[0] == "python":
            if words[1] in NOT_JOBS:
                continue
            out.append(words[1:])
            if words[1] == "scripts/experiment.py":
                out += experiment_steps(words[2:])
        elif words[0] in ("accelerate", "torchrun"):
            script = next(i for i, w in enumerate(words) if w.endswith(".py"))
            config = [words[i + 1] for i, w in enumerate(words) if w == "--config_file"]
            for c in config:
                assert (ROOT / c).is_file(), f"{c} does not exist ({part})"
            out.append(words[script:])
        elif words[0] == "bash":
            if words[1] == "scripts/install.sh":
                continue  # CI runs it as the README says
            out += recorded_python_calls(words[1], words[2:], env_of(part))
    return out


def experiment_steps(args: list[str]) -> list[list[str]]:
    """Each step command [script, *overrides] of the experiment these overrides choose (what
    `dry_run=true` prints)."""
    return [list(c) for c in _experiment_steps(tuple(a for a in args if not a.startswith("-")))]


@functools.lru_cache(maxsize=None)  # many pages cite the same experiment command
def _experiment_steps(args: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    from scripts.experiment import commands

    return tuple(tuple(command) for _, command in commands(compose_config("experiment", list(args))))


def recorded_python_calls(script: str, args: list[str], env: dict) -> list[list[str]]:
    """Run a shell script with `python` recording its arguments instead of running (`python -c`, a
    snippet whose output the script reads, such as its dtype, runs)."""
    assert (ROOT / script).is_file(), script
    recorder = ('python() { if [ "$1" = -c ]; then command python "$@"; return; fi; '
                'printf "%s\\037" "$@" >> "$DRAFTSMITH_RECORD"; printf "\\036" >> "$DRAFTSMITH_RECORD"; }')
    record = ROOT / ".pytest_cache" / f"record-{os.getpid()}"
    record.parent.mkdir(exist_ok=True)
    record.write_text("")
    full_env = {**os.environ, **env, "DRAFTSMITH_RECORD": str(record)}
    proc = subprocess.run(["bash", "-c", f"{recorder}; export -f python; bash {shlex.quote(script)} "
                           + " ".join(shlex.quote(a) for a in args)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [c.split("\x1f")[:-1] for c in record.read_text().split("\x1e") if c]
    record.unlink()
    assert calls, f"{script} runs no python command"
    return calls


def entry_config(script: str) -> str:
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    match = ENTRY.search(path.read_text())
    assert match, f"{script} is not a Hydra entry script (no launch(...))"
    return match.group(1)


CHECKED: set[tuple[str, ...]] = set()  # invocations that passed (pages repeat commands; experiments share steps)


def check(invocation: list[str], where: str) -> None:
    from draftsmith.models.entry import config_problem

    if tuple(invocation) in CHECKED:
        return
    script, args = invocation[0], invocation[1:]
    for a in args:
        assert "<" not in a and a != "..." and not a.endswith("..."), f"placeholder {a!r} in {where}"
    name = entry_config(script)
    problem = config_problem(name, args)
    assert problem is None, f"{where}: {problem}"
    compose_config(name, [a for a in args if not a.startswith("-")])  # Hydra accepts every override
    CHECKED.add(tuple(invocation))
