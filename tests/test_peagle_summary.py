"""scripts/bench/peagle_summary.py on what the recipe's own steps write (experiment=compare-peagle at toy
size: four tiny drafters trained by train/eagle.py, scripts/bench/learning_curve.py over their snapshots,
scripts/bench/compare.py over their finals): one table row per drafter x dataset with the comparison's
figures and its cell's step timings, the curves' points, and the two targets checked, including
a target that is not met; a cmp_dir without the recipe's outputs is refused in one line."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.models.errors import DraftsmithError
from draftsmith.train.eagle import run as train
from scripts.bench import compare, learning_curve, peagle_summary
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"eagle3": ("eagle3", "ce"), "eagle3-lk": ("eagle3", "lk"), "peagle": ("peagle", "ce"),
        "peagle-lk": ("peagle", "lk")}  # the recipe's four runs: name -> (method, method.loss)
TINY = ["method.draft_vocab_size=48", "method.fusion_layers=[0,1,-1]"]  # the tiny verifier has 2 layers
DECODE = {"eagle3": "proposer=eagle decode=eagle-dynamic", "peagle": "proposer=eagle decode=peagle-dynamic"}


@pytest.fixture(scope="module")
def cmp_dir(tiny_model_dir, tmp_path_factory):
    """The recipe's OUT at toy size: OUT/<run> (training, snapshots at steps 2 and 4), OUT/curves, OUT/compare."""
    out = tmp_path_factory.mktemp("peagle-cmp")
    tiny = tiny_model_overrides(tiny_model_dir)
    for name, (method, loss) in RUNS.items():
        train(compose_config("eagle", tiny + [
            "data=tiny", "trainer=debug", "trainer.batch_size=16", "logger=csv", f"method={method}", *TINY,
            *(["method.mask_token_id=5"] if method == "peagle" else []), f"method.loss={loss}",
            "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=2", "trainer.snapshot_every=2",
            "probe.num_prompts=0", f"output_dir={out / name}"]))
    learning_curve.run(compose_config("learning_curve", tiny + [
        *[f"{'' if name == 'eagle3' else '+'}runs.{name}={out / name}" for name in RUNS],
        *[f"+decode.{name}='{DECODE[method]}'" for name, (method, _) in RUNS.items() if name != "eagle3"],
        "dataset=tiny", "num_prompts=1", "max_new_tokens=6", f"output_dir={out / 'curves'}"]))
    compare.run(compose_config("compare", tiny + [  # as the recipe: eagle3 from the catalog under cmp_dir, 3 added
        f"cmp_dir={out}", "datasets=[tiny]", "temperatures=[0.0]", "num_prompts=2", "max_new_tokens=6",
        "hf_with=none", "assistant=null", "plain_dtypes=[float32]", f"only=[{','.join(RUNS)}]",
        *[f"+methods.{name}=['proposer=eagle','drafter={out / name}/final','{DECODE[method].split()[1]}']"
          for name, (method, _) in RUNS.items() if name != "eagle3"], f"output_dir={out / 'compare'}"]))
    return out


def summary(cmp_dir: Path) -> dict:
    return peagle_summary.run(compose_config("peagle_summary", [f"cmp_dir={cmp_dir}"]))


def test_the_table_holds_the_comparison_and_the_curves(cmp_dir, capsys):
    result = summary(cmp_dir)
    rows = json.loads((cmp_dir / "compare" / "compare.json").read_text())["rows"]
    assert [(c["method"], c["dataset"]) for c in result["cells"]] == [(name, "tiny") for name in RUNS]
    table = (cmp_dir / "peagle.md").read_text()
    assert table.strip() in capsys.readouterr().out
    fastest = json.loads((cmp_dir / "compare" / "compare.json").read_text())["fastest_plain"]["tiny"]
    assert table.splitlines()[0] == ("tiny (float32), greedy, 2 prompts per dataset, 6 new tokens; fastest plain "
                                     f"decoding timed alone: tiny: float32 {fastest['tokens_per_s']:.1f} tok/s")
    for cell in result["cells"]:
        row = next(r for r in rows if r["method"] == cell["method"])
        steps = json.loads((cmp_dir / "compare" / f"{cell['method']}-tiny-T0.0" / "results.json").read_text())
        stats = next(v for k, v in steps["methods"].items() if k != "vanilla")  # the drafter's (hf_with=none)
        assert steps["decode_tree"] == ("peagle-dynamic" if cell["method"].startswith("peagle") else "eagle-dynamic")
        assert cell["tau"] == row["tau"] >= 1.0 and cell["speedup"] == row["speedup"]
        assert cell["vs_fastest_plain"] == row["vs_fastest_plain"]
        assert cell["draft_ms"] == pytest.approx(1000 * stats["mean_propose_s"]) and cell["draft_ms"] > 0
        assert cell["verify_ms"] == pytest.approx(1000 * stats["mean_verify_s"])
        assert cell["nodes"] == stats["mean_nodes"]
        assert f"| {cell['method']} | tiny | {cell['tau']:.2f} | {cell['draft_ms']:.1f} | {cell['verify_ms']:.1f} | " \
               f"{cell['nodes']:.1f} | {cell['speedup']:.2f}x | {cell['vs_fastest_plain']:.2f}x | " in table
    curves = json.loads((cmp_dir / "curves" / "learning_curve.json").read_text())
    for name in RUNS:
        points = curves["runs"][name]["points"]
        assert [p["step"] for p in points] == [2, 4]
        for p in points:
            held, decoded = f"{p['held_out_tau']:.3f}", f"{p['decode_tau']:.2f}"
            assert f"| {name} | {p['step']} | {p['tokens']:,} | {held} | {decoded} |" in table
    saved = json.loads((cmp_dir / "peagle.json").read_text())
    assert saved["cells"] == result["cells"] and saved["targets"] == result["targets"]


def test_each_target_is_checked_against_the_figures(cmp_dir):
    """The targets: P-EAGLE's speedup over the fastest plain decoding above EAGLE-3's (each loss),
    the LK loss's tau at or above the soft cross-entropy's (each drafter), per dataset."""
    rows = {r["method"]: r for r in json.loads((cmp_dir / "compare" / "compare.json").read_text())["rows"]}
    checks = {(c["a"], c["b"]): c for c in summary(cmp_dir)["targets"]}
    assert set(checks) == {("peagle", "eagle3"), ("peagle-lk", "eagle3-lk"), ("eagle3-lk", "eagle3"),
                           ("peagle-lk", "peagle")}
    for (a, b), c in checks.items():
        metric = "vs_fastest_plain" if a.startswith("peagle") and b.startswith("eagle3") else "tau"
        x, y = rows[a][metric], rows[b][metric]
        assert (c["metric"], c["a_value"], c["b_value"], c["dataset"]) == (metric, x, y, "tiny")
        assert c["met"] == (x > y if metric == "vs_fastest_plain" else x >= y)


@pytest.mark.parametrize("met", [False, True])
def test_a_target_not_met_is_reported_as_not_met(cmp_dir, tmp_path, met):
    """The same outputs with P-EAGLE's speedup set below (or above) EAGLE-3's and the LK loss's tau
    below (or equal to) the cross-entropy's: the table says NO (or yes) for exactly those."""
    doctored = tmp_path / "cmp"
    doctored.mkdir()
    for part in ("compare", "curves"):
        subprocess.run(["cp", "-r", str(cmp_dir / part), str(doctored / part)], check=True)
    report = json.loads((cmp_dir / "compare" / "compare.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    rows["peagle"]["vs_fastest_plain"] = rows["eagle3"]["vs_fastest_plain"] * (1.5 if met else 0.5)
    rows["eagle3-lk"]["tau"] = rows["eagle3"]["tau"] if met else rows["eagle3"]["tau"] - 0.25
    (doctored / "compare" / "compare.json").write_text(json.dumps(report))
    checks = {(c["a"], c["b"]): c["met"] for c in summary(doctored)["targets"]}
    assert checks[("peagle", "eagle3")] is met and checks[("eagle3-lk", "eagle3")] is met
    table = (doctored / "peagle.md").read_text()
    word = "yes" if met else "NO"
    assert f"| peagle vs_fastest_plain > eagle3 | tiny | {rows['peagle']['vs_fastest_plain']:.3f} vs " \
           f"{rows['eagle3']['vs_fastest_plain']:.3f} | {word} |" in table
    assert f"| eagle3-lk tau >= eagle3 | tiny | {rows['eagle3-lk']['tau']:.3f} vs {rows['eagle3']['tau']:.3f} | " \
           f"{word} |" in table


def test_a_missing_comparison_curve_or_method_is_refused(cmp_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "nowhere", tmp_path / "empty"):
        with pytest.raises(DraftsmithError, match=rf"^cmp_dir={re.escape(str(folder))}: no compare/compare.json \("
                                                  rf"scripts/bench/compare.py's output\); run python scripts/experiment.py "
                                                  rf"experiment=compare-peagle out={re.escape(str(folder))} first$"):
            summary(folder)
    partial = tmp_path / "partial"
    partial.mkdir()
    subprocess.run(["cp", "-r", str(cmp_dir / "compare"), str(partial / "compare")], check=True)
    report = json.loads((cmp_dir / "compare" / "compare.json").read_text())
    report["rows"] = [r for r in report["rows"] if r["method"] != "peagle-lk"]
    (partial / "compare" / "compare.json").write_text(json.dumps(report))
    with pytest.raises(DraftsmithError, match=r"compare/compare.json has no greedy cells of \['peagle-lk'\]"):
        summary(partial)
    (partial / "compare" / "peagle-tiny-T0.0" / "results.json").unlink()  # a cell compare.json names, gone
    with pytest.raises(DraftsmithError, match=r"no compare/peagle-tiny-T0.0/results.json \(a comparison cell\)"):
        summary(partial)
    no_curves = tmp_path / "no-curves"
    no_curves.mkdir()
    subprocess.run(["cp", "-r", str(cmp_dir / "compare"), str(no_curves / "compare")], check=True)
    with pytest.raises(DraftsmithError, match=r"no curves/learning_curve.json \(scripts/bench/learning_curve.py's output\)"):
        summary(no_curves)
    assert not (no_curves / "peagle.md").exists()


def test_the_script_refuses_a_missing_cmp_dir_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/bench/peagle_summary.py", f"cmp_dir={tmp_path / 'nowhere'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    nowhere = tmp_path / "nowhere"
    assert lines == [f"draftsmith: error: cmp_dir={nowhere}: no compare/compare.json (scripts/bench/compare.py's output); "
                     f"run python scripts/experiment.py experiment=compare-peagle out={nowhere} first"], proc.stderr
    assert not (tmp_path / "nowhere").exists()  # nothing written where nothing was found
