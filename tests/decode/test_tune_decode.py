"""scripts/bench/tune_decode.py: candidates measured against plain decoding, the fastest printed as
overrides that compose, greedy losslessness checked per candidate, bad grids refused."""
import json

import pytest
import torch

from draftsmith.decode import sampling
from draftsmith.decode.tree import path_to
from draftsmith.models.errors import DraftsmithError
from scripts.bench.tune_decode import candidate_list, run
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import save_tiny_medusa

CANDIDATES = "candidates=[{paths: [[0]]}, {paths: [[0], [0, 0], [1]]}, {paths: [[0], [0, 0], [0, 0, 0]]}]"


@pytest.fixture()
def medusa_dir(tmp_path):
    return save_tiny_medusa(tmp_path / "medusa", num_heads=3)


def _cfg(tiny_model_dir, medusa_dir, out, *extra):
    return compose_config("tune_decode", tiny_model_overrides(tiny_model_dir) + [
        "proposer=medusa", "decode=medusa-small", f"drafter={medusa_dir}", "grid=[]", CANDIDATES,
        "data=tiny", "data.num_prompts=3", "max_new_tokens=10", f"output_dir={out}", *extra])


def test_every_candidate_is_timed_against_plain_and_the_fastest_composes(tiny_model_dir, medusa_dir, tmp_path):
    report = run(_cfg(tiny_model_dir, medusa_dir, tmp_path / "tune"))
    rows = {r["candidate"]: r for r in report["rows"]}
    assert list(rows) == ["vanilla", "paths=[[0]]", "paths=[[0],[0,0],[1]]", "paths=[[0],[0,0],[0,0,0]]"]
    assert rows["vanilla"]["tau"] == 1.0 and rows["vanilla"]["speedup"] == 1.0
    plain = rows["vanilla"]["tokens_per_s"]
    for r in report["rows"]:
        assert r["num_tokens"] == 3 * 10 and r["greedy_identical"] == 3  # fp32: token-identical to plain
        assert r["greedy_ties"] == 0 and r["greedy_unexplained"] == 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain)
    spec = [r for r in report["rows"] if r["candidate"] != "vanilla"]
    assert all(1.0 <= r["tau"] <= 1 + r["mean_nodes"] for r in spec)
    assert report["best"] == max(spec, key=lambda r: r["tokens_per_s"])
    # the printed overrides select that candidate's tree in the evaluator
    ev = compose_config("evaluate", ["proposer=medusa", "decode=medusa-small", *report["best"]["overrides"].split()])
    index = [r["candidate"] for r in spec].index(report["best"]["candidate"])
    assert [list(p) for p in ev.decode.paths] == candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path))[index]["paths"]
    out = tmp_path / "tune"
    assert json.loads((out / "tune_decode.json").read_text())["rows"] == report["rows"]
    assert "| **" + report["best"]["candidate"] + "** |" in (out / "tune_decode.md").read_text()
    assert (out / "tune_decode.png").stat().st_size > 0
    assert (out / "best.txt").read_text() == report["best"]["overrides"] + "\n"


def test_a_lossy_rule_shows_as_unexplained_divergences(tiny_model_dir, medusa_dir, tmp_path, monkeypatch):
    """The losslessness column has teeth: a greedy rule that accepts every drafted token
    diverges from plain decoding, and the report says so."""
    def accept_first_child(tokens, parents, target_logits):  # node 1 always passes
        last = 1 if len(tokens) > 1 else 0
        return path_to(torch.as_tensor(parents), last), int(target_logits[last].argmax())
    monkeypatch.setattr(sampling, "greedy_walk", accept_first_child)
    report = run(_cfg(tiny_model_dir, medusa_dir, tmp_path / "tune"))
    spec = [r for r in report["rows"] if r["candidate"] != "vanilla"]
    assert sum(r["greedy_unexplained"] for r in spec) > 0


def test_the_default_grid_is_eagle2s_tree_and_bad_grids_are_refused(tiny_model_dir, medusa_dir, tmp_path):
    default = compose_config("tune_decode", [])
    cands = candidate_list(default)
    assert default.decode.name == "eagle-dynamic" and default.proposer.kind == "eagle"
    assert len(cands) == 12 and all(set(c) == {"depth", "top_k", "total_tokens"} for c in cands)
    with pytest.raises(DraftsmithError, match="grid/candidates key 'depth': decode=medusa-small has no such setting"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "grid=[{depth: [2, 3]}]"))
    with pytest.raises(DraftsmithError, match="grid and candidates are both empty"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "candidates=[]"))
    with pytest.raises(DraftsmithError, match="grid=.*give a list of maps from decode keys to non-empty value lists"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "grid=[{paths: []}]"))
    with pytest.raises(DraftsmithError, match="grid/candidates key 'name'"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "candidates=[{name: x}]"))
