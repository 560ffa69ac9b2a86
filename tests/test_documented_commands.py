"""Every documented command works as typed: each command in README.md and in every page under docs/
(code blocks and inline code) and in the first line of every YAML under conf/ goes through the
entry script's own override check (misspelt keys, data keys the source would ignore) and Hydra's
composition with all its overrides, without running the job. Shell scripts (`bash scripts/X.sh ...`)
are run with `python` replaced by a recorder, so every Python command they would run is checked
with the arguments the real shell gives it; a named experiment (`python scripts/experiment.py
experiment=X ...`) has every step's command checked, as its dry run would give them. The pages themselves: the README stays a short page
for users (its opening commands, its length, no issue numbers or commit hashes), every relative
link of README.md and docs/ resolves (a file, and a heading for #anchors), and the README's results
table is the one scripts/bench/plot_results.py reads from the comparisons' JSON."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import (LAUNCHERS, ROOT, check, documented_pages, first_word, page_commands, python_invocations,
                            written_pages, yaml_commands)
from tests.hub import compose_config

README_OPENING = ("bash scripts/install.sh && bash scripts/quickstart.sh",
                  "bash scripts/install.sh && python -m pytest -q -n 2 --dist loadfile")  # .ci/run runs the second
README_MAX_LINES = 300


COMMANDS = [(page, c) for page in documented_pages() for c in page_commands(page)] + yaml_commands()


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_documented_command_composes(where, command):
    invocations = python_invocations(command)
    for invocation in invocations:
        check(invocation, f"{where}: {command}")


def test_the_commands_were_found():
    commands = [c for _, c in COMMANDS]
    assert any("scripts/quickstart.sh" in c for c in commands)
    assert any("data=chat-jsonl data.path=" in c for c in commands)
    assert sum(1 for w, _ in COMMANDS if w.startswith("conf/")) == len(list((ROOT / "conf").rglob("*.yaml")))
    readme = [c for w, c in COMMANDS if w == "README.md"]
    assert readme[:2] == list(README_OPENING), readme[:2]
    for c in ("python train/eagle.py", "python decode/evaluate.py", "python decode/serve.py", "python scripts/export.py",
              "python scripts/refresh.py"):
        assert any(r.startswith(c) for r in readme), f"README.md has no {c} command"
    # docs/: every page with a ```bash block of commands contributes them, and the guides' own commands are found
    for page in documented_pages()[1:]:
        blocks = re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S)
        if any(first_word(line) in LAUNCHERS for b in blocks for line in b.splitlines()):
            assert any(w == page for w, _ in COMMANDS), f"no command of {page} was found"
    docs = {w: c for w, c in COMMANDS if w.startswith("docs/")}
    assert len({w for w, _ in COMMANDS if w.startswith("docs/")}) >= 20, sorted(docs)
    for page, c in [("docs/refresh.md", "python scripts/refresh.py"), ("docs/training.md", "python train/eagle.py"),
                    ("docs/data.md", "python train/medusa.py data=chat-jsonl data.path="),
                    ("docs/benchmarks.md", "python scripts/bench/plot_results.py"),
                    ("docs/benchmarks.md", "python scripts/experiment.py experiment=compare-all"),
                    ("docs/peagle.md", "python scripts/experiment.py experiment=compare-peagle"),
                    ("docs/results/datastore.md", "python scripts/bench/compare.py")]:
        assert any(w == page and cmd.startswith(c) for w, cmd in COMMANDS), f"{page}: no {c} command"


def test_the_readme_is_a_short_page_for_users():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    blocks = re.findall(r"```bash\n(.*?)```", "\n".join(lines), re.S)
    opening = [c for c in blocks[0].splitlines() if c.strip() and not c.lstrip().startswith("#")]
    assert opening == list(README_OPENING), "the README opens with its two set-up commands, verbatim and in order"
    assert README_OPENING[1] in (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 --dist loadfile -m heavy" in (ROOT / ".ci" / "run").read_text()  # then the heavy tests


ISSUE_REF = re.compile(r"(?<![\w&])#\d+\b")  # "(issue #13)", "#13's"; not "&#39;" nor a URL's anchor
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")  # hex with letters and digits


def test_issue_refs_and_commit_hashes_are_caught():
    assert ISSUE_REF.search("measured (issue #13)") and ISSUE_REF.search("#14's layouts")
    assert not ISSUE_REF.search("see [x](page.md#sizing-2) or &#39;")
    assert COMMIT.search("the latest, on 6c6e23a (2026-12-04)") and COMMIT.search("5b7aa7b")
    assert not COMMIT.search("effaced 2026-12-04 1234567 decade")


@pytest.mark.parametrize("page", written_pages())
def test_pages_carry_no_issue_numbers(page):
    text = (ROOT / page).read_text()
    assert not ISSUE_REF.findall(text), f"{page}: issue references {ISSUE_REF.findall(text)}: say what was measured"


@pytest.mark.parametrize("page", documented_pages())
def test_pages_carry_no_commit_hashes(page):
    text = (ROOT / page).read_text()
    assert not COMMIT.findall(text), f"{page}: commit hashes {COMMIT.findall(text)}: give dates, not hashes"


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub makes of a markdown page's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def links(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", documented_pages())
def test_every_link_resolves(page):
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (ROOT / page).parent / path if path else ROOT / page
        rel = os.path.relpath(dest.resolve(), ROOT)
        assert dest.exists(), f"{page}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(dest), f"{page}: link to {target}: {rel} has no heading #{anchor}"


def test_the_link_check_has_teeth(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## What lossless means, per dtype\n\n```bash\n# not a heading\n```\n")
    assert anchors(page) == {"title", "what-lossless-means-per-dtype"}


def test_every_result_file_is_cited():
    """docs/results/<study>/ holds the files of one page: each is linked from a page (else it goes)."""
    text = "\n".join((ROOT / p).read_text() for p in written_pages())
    files = [p for p in (ROOT / "docs" / "results").glob("*/*") if p.is_file()]
    assert files
    uncited = [str(p.relative_to(ROOT)) for p in files if f"{p.parent.name}/{p.name})" not in text]
    assert not uncited, f"result files no page links to: {uncited}"


def test_the_readme_results_table_is_the_json():
    """The README's results table is what scripts/bench/plot_results.py reads from the JSON its config names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "scripts" / "bench" / "plot_results.py")
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    cfg = compose_config("plot_results")
    table = plot_results.table(plot_results.measured(cfg))
    assert table in (ROOT / "README.md").read_text(), f"README.md's results table is stale; it should be:\n{table}"
    assert f"]({cfg.output})" in (ROOT / "README.md").read_text()  # the README shows the plot the script writes


def test_plot_results_writes_the_plot_and_refuses_what_it_cannot_plot(tmp_path, capsys):
    import importlib.util

    from draftsmith.models.errors import DraftsmithError

    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "scripts" / "bench" / "plot_results.py")
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    out = tmp_path / "headline.png"
    report = plot_results.run(compose_config("plot_results", [f"output={out}"]))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["table"] in capsys.readouterr().out
    first = compose_config("plot_results").rows[0].file
    with pytest.raises(DraftsmithError, match=r"^rows.0.method='prompt-lookup-typo': .* valid: .*prompt-lookup"):
        plot_results.measured(compose_config("plot_results", ["rows.0.method=prompt-lookup-typo"]))
    with pytest.raises(DraftsmithError, match=r"^rows.0.file=.* was measured on model=smollm2-135m model.dtype=bfloat16, "
                                              r"not model=smollm2-135m model.dtype=float32"):
        plot_results.measured(compose_config("plot_results", ["model.dtype=float32"]))
    with pytest.raises(DraftsmithError, match=r"^rows.0.file=nowhere.json: no such file"):
        plot_results.measured(compose_config("plot_results", ["rows.0.file=nowhere.json"]))
    assert Path(first).is_file()


def test_the_check_refuses_what_the_scripts_would_refuse():
    """The same check is what the entry scripts run first: it has teeth."""
    from draftsmith.models.entry import config_problem

    assert "num_hedas" in config_problem("medusa", ["method.num_hedas=4"])
    assert "ignored by data.source='mtbench'" in config_problem("evaluate", ["data=mtbench", "data.path=x.jsonl"])
    assert config_problem("medusa", ["data=chat-jsonl", "data.path=my_chats.jsonl"]) is None
    # text where the config holds a number or a boolean, nested or top-level
    assert config_problem("eagle", ["method=eagle3", "method.draft_vocab_size=8k"]) == (
        "method.draft_vocab_size='8k': expected a number, like the default (method.draft_vocab_size=8192)")
    assert config_problem("compare", ["rerun=yes"]) == "rerun='yes': expected true or false, like the default (rerun=false)"
    assert "max_new_tokens='ten': expected a number" in config_problem("compare", ["max_new_tokens=ten"])
    assert "data.max_length='x'" in config_problem("medusa", ["data=tiny", "data.max_length=x"])
    assert config_problem("medusa", ["trainer.max_steps=true"]) == (
        "trainer.max_steps=True: expected a number, like the default (trainer.max_steps=300)")
    assert config_problem("medusa", ["trainer.max_steps='300'"]) == (
        "trainer.max_steps='300': expected a number, like the default (trainer.max_steps=300); it is a number as "
        "text (from ${oc.env:...}? wrap it in ${oc.decode:...})")
    assert config_problem("prepare", ["layers.0=1"]) == (
        "unknown config key 'layers.0': layers is an empty list; set it whole: layers='[...]'")
    # ... while numbers, booleans, group choices, maps and values for null defaults pass
    assert config_problem("compare", ["max_new_tokens=8", "rerun=true"]) is None
    assert config_problem("medusa", ["trainer=cpu-long", "trainer.lr=1", "trainer.max_steps=1e3",
                                     "trainer.max_minutes=30", "data=tiny"]) is None
    assert config_problem("compare", ["num_prompts={mtbench: 80, humaneval: 40}", "threads=2"]) is None
    # a list's items by index, as Hydra takes them (README: `data.parts.0.max_items=4800` doubles the set)
    assert config_problem("medusa", ["data=sharegpt-text", "data.parts.0.max_items=4800"]) is None
    assert compose_config("medusa", ["data=sharegpt-text", "data.parts.0.max_items=4800"]).data.parts[0].max_items == 4800
    assert config_problem("medusa", ["data=sharegpt-text", "data.parts.1.max_items=4800"]) == (
        "unknown config key 'data.parts.1.max_items': data.parts is a list of 1; index it 0..0")
    assert "data.parts.0 has no 'max_itemz'" in config_problem("medusa", ["data=sharegpt-text", "data.parts.0.max_itemz=1"])
    # a top-level key the script does not have, and a preset that does not exist (both were Hydra's
    # multi-line reports with exit status 1)
    assert config_problem("serve", ["output_dir=/tmp/x"]).startswith(
        "unknown config key 'output_dir': the top level has no 'output_dir'; valid: acceptance, allow_fingerprint_mismatch, ")
    assert "the top level has no 'max_new_token'" in config_problem("evaluate", ["max_new_token=8"])
    assert config_problem("medusa", ["model=smollm2-136m"]) == (
        "model='smollm2-136m' is not a preset of conf/model/; valid: llama2-7b, llama3.1-8b-instruct, "
        "mistral-7b-instruct, qwen2.5-7b-instruct, smollm2-135m, vicuna-13b-v1.3, vicuna-7b-v1.3")
    assert "data@data.prompts='mt-bench' is not a preset of conf/data/" in config_problem(
        "selfdistill", ["data@data.prompts=mt-bench"])
    assert config_problem("evaluate", ["model=smollm2-135m", "decode=eagle-dynamic", "device=cpu"]) is None
    # a group the config does not choose: refused, naming the group that does the job here
    assert config_problem("serve", ["method=medusa1"]).startswith("method=medusa1: serve takes no method= (a training")
    assert config_problem("tune_decode", ["proposer=draft", "decode=draft-chain"]) is None
    assert config_problem("draft", ["hw=cpu"]) == "hw=cpu: draft takes no hw= (no such group here)"
    assert config_problem("experiment", ["experiment=compare-peagle", "model=smollm2-135m"]) is None
    # ... while Hydra's own groups, sweeps and interpolations stay Hydra's to check
    assert config_problem("medusa", ["hydra/job_logging=disabled", "hydra.run.dir=/tmp/x"]) is None
    assert config_problem("medusa", ["-m", "model=smollm2-135m,llama2-7b"]) is None
    assert config_problem("medusa", ["model=smollm2-135m,llama2-7b"]) is None


@pytest.mark.parametrize("argv, message", [
    (["decode/serve.py", "output_dir=/tmp/x"], "draftsmith: error: unknown config key 'output_dir': the top level"),
    (["train/eagle.py", "method=eagle-3"], "draftsmith: error: method='eagle-3' is not a preset of conf/method/; valid: "),
    # training recipes (method=) and what the decoder drafts with (proposer=) are separate groups
    (["decode/evaluate.py", "method=eagle", "drafter=x"], "draftsmith: error: method=eagle: evaluate takes no method= "
     "(a training recipe of train/*.py; what the decoder drafts with is proposer=, conf/proposer/: draft, eagle, "),
    (["train/medusa.py", "proposer=medusa"], "draftsmith: error: proposer=medusa: medusa takes no proposer= (what the "
     "decoder drafts with; a training script takes its recipe as method=, conf/method/)"),
])
def test_an_unknown_key_or_preset_stops_the_script_in_one_line(argv, message):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]  # one line
    assert proc.stderr.strip().startswith(message), proc.stderr[-2000:]


def test_a_mistyped_value_stops_the_script_in_one_line():
    proc = subprocess.run([sys.executable, "train/medusa.py", "trainer.max_steps=10k"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "draftsmith: error: trainer.max_steps='10k': expected a number, like the default (trainer.max_steps=300)")


def test_a_benchmark_reports_its_childs_refusal_in_one_line():
    """scripts/bench/bench_*.py run the entry scripts as children (models.entry.run_measured): a child
    that refuses its input ends the benchmark with that one line, not a wrapped traceback."""
    from draftsmith.models.entry import run_measured
    from draftsmith.models.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match=r"^medusa.py: trainer.max_steps='10k': expected a number"):
        run_measured([sys.executable, "train/medusa.py", "trainer.max_steps=10k"], dict(os.environ))
    with pytest.raises(RuntimeError, match=r"(?s)failed: .*ZeroDivisionError"):  # a crash keeps its traceback
        run_measured([sys.executable, "-c", "1/0"], dict(os.environ))
