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
        "method=medusa", "decode=medusa-small", f"drafter={medusa_dir}", "grid=[]", CANDIDATES,
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
    ev = compose_config("evaluate", ["method=medusa", "decode=medusa-small", *report["best"]["overrides"].split()])
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
    assert default.decode.name == "eagle-dynamic" and default.method.proposer == "eagle"
    assert len(cands) == 12 and all(set(c) == {"depth", "top_k", "total_tokens"} for c in cands)
    with pytest.raises(DraftsmithError, match="grid/candidates key 'depth': decode=medusa-small has no such setting"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "grid=[{depth: [2, 3]}]"))
    with pytest.raises(DraftsmithError, match="grid and candidates are both empty"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "candidates=[]"))
    with pytest.raises(DraftsmithError, match="grid=.*give a list of maps from decode keys to non-empty value lists"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "grid=[{paths: []}]"))
    with pytest.raises(DraftsmithError, match="grid/candidates key 'name'"):
        candidate_list(_cfg(tiny_model_dir, medusa_dir, tmp_path, "candidates=[{name: x}]"))


def test_compare_all_passes_the_tuned_tree_to_both_comparisons(tmp_path):
    """scripts/compare_all.sh trains EAGLE-3, continues it in warm-started stages (README
    "Results"), runs tune_decode.py on the last stage and hands that drafter with its best.txt to
    the eagle3 entry of both compare.py runs; each recorded command composes."""
    from tests.test_documented_commands import check, recorded_python_calls

    (tmp_path / "tune-eagle3").mkdir()
    (tmp_path / "tune-eagle3" / "best.txt").write_text("decode.depth=6 decode.top_k=8 decode.total_tokens=16\n")
    calls = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "eagle3"})
    assert [c[0] for c in calls] == ["scripts/generate_selfdistill.py", "train/eagle.py", "train/eagle.py",
                                     "train/eagle.py", "scripts/bench/learning_curve.py", "scripts/bench/tune_decode.py",
                                     "scripts/build_datastore.py", "scripts/bench/compare.py", "scripts/bench/compare.py"]
    base, cont, cont2 = calls[1:4]
    assert "method.noise=0" in base and f"output_dir={tmp_path}/eagle3" in base
    for call, data, steps, init, seed, out in ((cont, "sharegpt-mix", 200, "eagle3", 1, "eagle3-cont"),
                                               (cont2, "sharegpt-mix-full", 260, "eagle3-cont", 2, "eagle3-cont2")):
        check(call, "compare_all.sh")
        cfg = compose_config("eagle", call[1:])
        assert (cfg.data.name, cfg.trainer.max_steps, cfg.trainer.lr, cfg.seed, cfg.method.noise) == (data, steps, 5e-4, seed, 0)
        assert cfg.trainer.init_from == f"{tmp_path}/{init}/final" and cfg.output_dir == f"{tmp_path}/{out}"
        assert cfg.trainer.snapshot_every == steps // 4
    assert f"drafter={tmp_path}/eagle3-cont2/final" in calls[5]
    check(calls[6], "compare_all.sh")
    assert compose_config("build_datastore", calls[6][1:]).output_dir == f"{tmp_path}/datastore"
    calls = calls[:6] + calls[7:]  # the two comparisons at 6 and 7 from here
    assert "plain_static=true" in calls[6]  # HF's static-shape path competes for the fastest plain decoding
    assert "num_prompts={mtbench: 80, humaneval: 40}" in calls[6] and "num_prompts=6" in calls[7]  # issue #13's sets
    for call in calls[6:]:
        check(call, "compare_all.sh")
        cfg = compose_config("compare", [a for a in call[1:]])
        assert list(cfg.methods.eagle3) == ["method=eagle", f"drafter={tmp_path}/eagle3-cont2/final",
                                            "decode=eagle-dynamic", "decode.depth=6", "decode.top_k=8",
                                            "decode.total_tokens=16"]
        # the same drafter and tuned tree with prompt lookup grafted on: conf/compare.yaml's -pl settings
        assert list(cfg.methods["eagle3-pl"]) == [*cfg.methods.eagle3, *cfg.methods["medusa1-pl"][3:]]
        assert list(cfg.methods["medusa1-pl"][3:]) == ["decode.lookup_tokens=10", "decode.lookup_min_ngram=2"]
        # ... and with the datastore grafted on as well: conf/compare.yaml's -ds settings, the datastore built above
        assert list(cfg.methods["eagle3-ds"]) == [*cfg.methods["eagle3-pl"], *cfg.methods["medusa1-ds"][5:]]
        assert list(cfg.methods["medusa1-ds"][5:]) == [f"decode.datastore={tmp_path}/datastore", "decode.datastore_tokens=4"]
    assert cfg.only == ["eagle3", "eagle3-pl"]  # the T=0.7 run: the trained drafter, with and without the graft
    assert compose_config("compare", calls[6][1:]).only == ["eagle3", "eagle3-pl", "prompt-lookup", "lookahead",
                                                            "eagle3-ds", "prompt-lookup-ds"]
    untuned = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "eagle3",
                                                                    "TUNE": "0", "CONTINUE_eagle3": ""})
    assert [c[0] for c in untuned].count("train/eagle.py") == 1
    assert "scripts/bench/tune_decode.py" not in [c[0] for c in untuned]
    assert not any(a.startswith("methods.eagle3=") for c in untuned for a in c)
    one_stage = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "eagle3",
                                                                      "TUNE": "0", "CONTINUE_eagle3": "50:mix"})
    assert f"methods.eagle3=['method=eagle','drafter={tmp_path}/eagle3-cont/final','decode=eagle-dynamic']" in one_stage[-1]
    no_eagle = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "medusa1 draft-fkl"})
    assert [c[0] for c in no_eagle].count("train/eagle.py") == 0
    only = [compose_config("compare", c[1:]).only for c in no_eagle if c[0] == "scripts/bench/compare.py"]
    assert only == [["medusa1", "draft-fkl", "medusa1-pl", "draft-fkl-pl", "draft-fkl-cpu", "prompt-lookup", "lookahead",
                     "medusa1-ds", "draft-fkl-ds", "draft-fkl-cpu-ds", "prompt-lookup-ds"],
                    ["medusa1", "draft-fkl", "medusa1-pl"]]  # a draft model's graft is greedy only
    ungrafted = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "medusa1",
                                                                      "GRAFT": "0"})
    assert compose_config("compare", ungrafted[-2][1:]).only == ["medusa1", "prompt-lookup", "lookahead",
                                                                 "medusa1-ds", "prompt-lookup-ds"]
    no_store = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "medusa1",
                                                                     "DATASTORE": "0"})
    assert "scripts/build_datastore.py" not in [c[0] for c in no_store]
    assert compose_config("compare", no_store[-2][1:]).only == ["medusa1", "medusa1-pl", "prompt-lookup", "lookahead"]


def test_compare_all_trains_medusa1_from_features_of_the_same_data(tmp_path):
    """Medusa-1's long recipe: prepare_features.py runs the verifier once over data=sharegpt-text
    (given the script's model overrides, not its trainer ones), then train/medusa.py trains from
    that folder with the same data preset; both commands compose."""
    from tests.test_documented_commands import check, recorded_python_calls

    calls = recorded_python_calls("scripts/compare_all.sh", ["model.dtype=float32", "trainer.lr=2e-3"],
                                  {"OUT": str(tmp_path), "METHODS": "medusa1"})
    # no self-distillation: Medusa-1 alone needs none
    assert [c[0] for c in calls][:2] == ["scripts/prepare_features.py", "train/medusa.py"]
    prepare, train = calls[0], calls[1]
    for call in (prepare, train):
        check(call, "compare_all.sh")
    prep_cfg = compose_config("prepare", prepare[1:])
    train_cfg = compose_config("medusa", train[1:])
    assert "trainer.lr=2e-3" not in prepare and prep_cfg.model.dtype == "float32"  # the last override wins
    assert prep_cfg.data.name == train_cfg.data.name == "sharegpt-text"
    assert train_cfg.data.features == prep_cfg.output_dir == f"{tmp_path}/features-sharegpt-text"
    assert (train_cfg.trainer.max_steps, train_cfg.trainer.snapshot_every, train_cfg.trainer.lr) == (880, 220, 2e-3)
    assert (train_cfg.method.targets, train_cfg.method.draft_vocab_size) == ("verifier", 8192)


def test_compare_all_trains_the_draft_on_sharegpt_text_with_a_frozen_vocabulary(tmp_path):
    """The draft's long recipe (README "A draft with a frozen vocabulary"): ShareGPT text with
    the verifier's law as the target, so no self-distillation; 4 layers, embeddings and lm_head
    frozen, lr 1e-3, an 8,192-token draft vocabulary, 220 steps with a snapshot every 55; the command composes."""
    from tests.test_documented_commands import check, recorded_python_calls

    calls = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "draft-fkl"})
    assert calls[0][0] == "train/draft.py" and "scripts/generate_selfdistill.py" not in [c[0] for c in calls]
    check(calls[0], "compare_all.sh")
    cfg = compose_config("draft", calls[0][1:])
    assert (cfg.data.name, cfg.method.name, cfg.method.student.num_layers, cfg.method.student.trainable,
            cfg.method.draft_vocab_size) == ("sharegpt-text", "draft-fkl", 4, "body", 8192)
    assert (cfg.trainer.max_steps, cfg.trainer.snapshot_every, cfg.trainer.lr) == (220, 55, 1e-3)
    assert cfg.output_dir == f"{tmp_path}/draft-fkl"


@pytest.mark.parametrize("env, message", [
    ({"TUNE": "yes"}, "TUNE=yes; valid: 1"),
    ({"GRAFT": "on"}, "GRAFT=on; valid: 1"),
    ({"CONTINUE_eagle3": "200"}, "CONTINUE_eagle3 has '200'; give space-separated steps:data stages"),
    ({"CONTINUE_eagle3": "x:sharegpt-mix"}, "CONTINUE_eagle3 has 'x:sharegpt-mix'"),
    ({"CONTINUE_eagle3": "100:", "METHODS": "eagle3"}, "CONTINUE_eagle3 has '100:'"),
    ({"CONTINUE_eagle3": "100:mix", "METHODS": "medusa1"}, "METHODS='medusa1' does not train it; add eagle3"),
])
def test_compare_all_refuses_a_bad_setting_before_any_work(env, message):
    import subprocess

    from pathlib import Path

    proc = subprocess.run(["bash", "scripts/compare_all.sh"], env={**env, "PATH": "/usr/bin:/bin"},
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_compare_all_compares_the_draft_as_sized_for_the_cpus(tmp_path):
    """With the draft among METHODS, the greedy comparison also runs it as decode=draft-cpu
    (int8, top-2 at depth 1, the graft); the T=0.7 run leaves out both grafted draft rows (the
    graft is greedy only: decode/evaluate.py refuses it at T > 0)."""
    from tests.test_documented_commands import check, recorded_python_calls

    calls = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "draft-fkl"})
    greedy, t07 = [c for c in calls if c[0] == "scripts/bench/compare.py"]
    for call in (greedy, t07):
        check(call, "compare_all.sh")
    cfg = compose_config("compare", greedy[1:])
    assert cfg.only == ["draft-fkl", "draft-fkl-pl", "draft-fkl-cpu", "prompt-lookup", "lookahead", "draft-fkl-ds",
                        "draft-fkl-cpu-ds", "prompt-lookup-ds"]
    assert list(cfg.methods["draft-fkl-cpu-ds"]) == [*cfg.methods["draft-fkl-cpu"], f"decode.datastore={tmp_path}/datastore",
                                                     "decode.datastore_tokens=4"]
    assert list(cfg.methods["draft-fkl-cpu"]) == ["method=draft", f"drafter={tmp_path}/draft-fkl/final", "decode=draft-cpu"]
    assert compose_config("compare", t07[1:]).only == ["draft-fkl"]
    ungrafted = recorded_python_calls("scripts/compare_all.sh", [], {"OUT": str(tmp_path), "METHODS": "draft-fkl",
                                                                      "GRAFT": "0"})
    assert compose_config("compare", [c for c in ungrafted if c[0] == "scripts/bench/compare.py"][0][1:]).only == [
        "draft-fkl", "prompt-lookup", "lookahead", "draft-fkl-ds", "prompt-lookup-ds"]

