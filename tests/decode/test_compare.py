"""scripts/bench/compare.py: several methods x datasets x temperatures into one table (tiny model)."""
import json

from omegaconf import OmegaConf

from scripts.bench import compare
from scripts.bench.compare import run
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config


def test_compare_runs_every_cell_and_skips_untrained_drafters(tiny_model_dir, tmp_path, monkeypatch):
    cfg = compose_config("compare", tiny_model_overrides(tiny_model_dir) + [
        "datasets=[tiny]", "temperatures=[0.0,0.7]", "num_prompts=2", "max_new_tokens=6",
        "hf_with=prompt-lookup", "assistant=null", f"output_dir={tmp_path}", "plain_dtypes=[float32,bfloat16]", "only=[prompt-lookup,lookahead,eagle1]",
        "methods={prompt-lookup: ['proposer=prompt-lookup', 'decode=prompt-lookup', 'drafter=null'],"
        " lookahead: ['proposer=lookahead', 'decode=lookahead', 'drafter=null'],"
        f" eagle1: ['proposer=eagle', 'drafter={tmp_path / 'missing'}', 'decode=eagle-dynamic']}}"])
    result = run(cfg)
    rows = result["rows"]
    plain = {r["method"]: r for r in rows if r["method"].startswith("plain-")}
    assert set(plain) == {"plain-float32", "plain-bfloat16"}  # each timed alone, greedy
    fastest = max(plain.values(), key=lambda r: r["tokens_per_s"])
    assert fastest["vs_fastest_plain"] == 1.0 and all(r["vs_fastest_plain"] <= 1.0 for r in plain.values())
    assert all(r["vs_fastest_plain"] == r["tokens_per_s"] / fastest["tokens_per_s"] for r in rows)
    ours = [r for r in rows if not r["method"].startswith(("hf_", "plain-"))]
    assert {(r["method"], r["temperature"]) for r in ours} == {
        ("prompt-lookup", 0.0), ("prompt-lookup", 0.7), ("lookahead", 0.0), ("lookahead", 0.7)}
    assert all(r["tau"] >= 1.0 for r in ours)
    greedy = [r for r in ours if r["temperature"] == 0.0]
    assert all(r["greedy_identity_rate"] == 1.0 or r["unexplained_divergences"] == 0 for r in greedy)
    assert {r["method"] for r in rows if r["method"].startswith("hf_")} == {"hf_generate", "hf_prompt_lookup"}
    table = (tmp_path / "compare.md").read_text()
    assert "| prompt-lookup |" in table and "| lookahead |" in table and "eagle1" not in table
    assert json.loads((tmp_path / "compare.json").read_text())["rows"] == rows
    assert "(vs fastest plain)" in table and "| plain-float32 | 1.00 / - (" in table
    assert "Per-token latency" in table and all(r["latency_p99_ms"] >= r["latency_median_ms"] > 0 for r in ours)

    # a rerun reuses the finished cells; a cell without its cell.yaml (killed, or its config changed) re-runs
    calls = []
    real = compare.evaluate
    monkeypatch.setattr(compare, "evaluate", lambda cell: calls.append(cell.output_dir) or real(cell))
    (tmp_path / "lookahead-tiny-T0.7" / "cell.yaml").write_text("decode: {window: 99}\n")
    again = compare.run(cfg)["rows"]
    assert calls == [str(tmp_path / "lookahead-tiny-T0.7")]
    assert [(r["method"], r["tau"]) for r in again] == [(r["method"], r["tau"]) for r in rows]
    compare.run(OmegaConf.merge(cfg, {"rerun": True}))
    assert len(calls) == 1 + 2 + 4  # the two plain cells, then the four method cells
    bare = compare.run(OmegaConf.merge(cfg, {"plain_dtypes": []}))["rows"]  # no plain cells: no fastest ratio
    assert not any(r["method"].startswith("plain-") or "vs_fastest_plain" in r for r in bare)
    assert "fastest" not in (tmp_path / "compare.md").read_text()


def test_catalog_follows_cmp_dir(tmp_path):
    """experiment=compare-all trains into `out` and passes cmp_dir=out: every catalog drafter and the HF
    assistant must point there (a stale outputs/cmp path would silently skip the methods)."""
    cfg = compose_config("compare", [f"cmp_dir={tmp_path}"])
    drafters = {name: next(o.split("=", 1)[1] for o in ov if o.startswith("drafter=")) for name, ov in cfg.methods.items()}
    trained = {name: path for name, path in drafters.items() if path != "null"}
    assert {"medusa1", "eagle1", "eagle3", "draft-fkl", "draft-untrained"} <= set(trained)
    assert all(path.startswith(f"{tmp_path}/") for path in trained.values()), trained
    assert cfg.assistant == f"{tmp_path}/draft-fkl/final"


def test_num_prompts_per_dataset(tmp_path):
    """num_prompts='{mtbench: 80, humaneval: 40}' (issue #13's table) gives each dataset its own
    count; a map without a dataset, or with one the run does not evaluate, is refused before any
    cell runs, and so is a method name in `only` that is not in `methods`."""
    import pytest

    from draftsmith.models.errors import DraftsmithError

    cfg = compose_config("compare", ["num_prompts={mtbench: 80, humaneval: null}", f"output_dir={tmp_path / 'c'}"])
    cells = {d: compare.cell_config(cfg, ["proposer=vanilla", "drafter=null"], d, 0.0, tmp_path, hf=False)
             for d in ("mtbench", "humaneval")}
    assert cells["mtbench"].data.num_prompts == 80 and cells["humaneval"].data.num_prompts is None
    assert "mtbench 80, humaneval all prompts" in compare.markdown([], cfg, {})
    bad = compose_config("compare", ["num_prompts={mtbench: 80}", f"output_dir={tmp_path / 'bad'}"])
    with pytest.raises(DraftsmithError, match="num_prompts=.*has no count for dataset 'humaneval'; add humaneval"):
        run(bad)
    assert not (tmp_path / "bad").exists()
    unused = compose_config("compare", ["num_prompts={mtbench: 80, humaneval: 40}", "datasets=[mtbench]",
                                        f"output_dir={tmp_path / 'unused'}"])
    with pytest.raises(DraftsmithError, match=r"counts \['humaneval'\], not in datasets=\['mtbench'\]; drop"):
        run(unused)
    assert not (tmp_path / "unused").exists()
    misspelt = compose_config("compare", ["only=[eagle3,prompt-lookpu]", f"output_dir={tmp_path / 'misspelt'}"])
    with pytest.raises(DraftsmithError, match=r"only=\['eagle3', 'prompt-lookpu'\]: \['prompt-lookpu'\] not in "
                                              r"methods; choose from medusa1, .*prompt-lookup"):
        run(misspelt)  # silently leaving the method out of the table would look like a finished run
    with pytest.raises(DraftsmithError, match=r"only=eagle3: give a list of method names, only='\[eagle3\]'"):
        run(compose_config("compare", ["only=eagle3", f"output_dir={tmp_path / 'bare'}"]))
    untrained = compose_config("compare", [f"cmp_dir={tmp_path / 'none'}", "only=[eagle3,medusa1-pl]",
                                           f"output_dir={tmp_path / 'untrained'}"])
    with pytest.raises(DraftsmithError, match=r"^no drafter for \['eagle3', 'medusa1-pl'\] \(looked in \[.*none/eagle3/final"
                                              r".*\]\); train them first \(python scripts/experiment.py experiment=compare-all"):
        run(untrained)  # every named method untrained: an empty table would look like a finished run
    assert not (tmp_path / "untrained").exists()
    assert not (tmp_path / "misspelt").exists()


def test_tuned_gives_a_method_the_tree_tune_decode_chose(tmp_path):
    """tuned.<method>: a scripts/bench/tune_decode.py best.txt whose overrides the method's cells get
    (after its own); a missing file or a name not among the methods is refused before any work."""
    import pytest

    from draftsmith.models.errors import DraftsmithError

    best = tmp_path / "tune" / "best.txt"
    best.parent.mkdir()
    best.write_text("decode.depth=3 decode.top_k=4 decode.total_tokens=12\n")
    cfg = compose_config("compare", [f"cmp_dir={tmp_path}", f"tuned={{eagle3: {best}, eagle3-pl: {best}}}"])
    assert compare.method_overrides(cfg, "eagle3") == [*cfg.methods.eagle3, "decode.depth=3", "decode.top_k=4",
                                                       "decode.total_tokens=12"]
    assert compare.method_overrides(cfg, "eagle3-pl")[-3:] == ["decode.depth=3", "decode.top_k=4", "decode.total_tokens=12"]
    assert compare.method_overrides(cfg, "medusa1") == list(cfg.methods.medusa1)
    evaluated = compose_config("evaluate", compare.method_overrides(cfg, "eagle3-pl"))  # they compose, the graft kept
    assert (evaluated.decode.depth, evaluated.decode.total_tokens, evaluated.decode.lookup_tokens) == (3, 12, 10)
    missing = compose_config("compare", [f"tuned={{eagle3: {tmp_path / 'none.txt'}}}", "only=[eagle3]",
                                         f"output_dir={tmp_path / 'missing'}"])
    with pytest.raises(DraftsmithError, match=r"^tuned.eagle3=.*none.txt: no such file; size the tree first"):
        run(missing)
    stray = compose_config("compare", [f"tuned={{eagle33: {best}}}", f"output_dir={tmp_path / 'stray'}"])
    with pytest.raises(DraftsmithError, match=r"^tuned=\{'eagle33': .*\['eagle33'\] not in methods; choose from medusa1"):
        run(stray)
    assert not (tmp_path / "missing").exists() and not (tmp_path / "stray").exists()


def test_plain_static_adds_hf_static_compile_to_the_fastest_plain_contenders(tiny_model_dir, tmp_path):
    cfg = compose_config("compare", tiny_model_overrides(tiny_model_dir) + [
        "datasets=[tiny]", "temperatures=[0.0]", "num_prompts=2", "max_new_tokens=6",
        "assistant=null", f"output_dir={tmp_path}", "plain_dtypes=[float32]", "plain_static=true", "only=[]"])
    result = run(cfg)
    plain = {r["method"]: r for r in result["rows"] if r["method"].startswith("plain-")}
    assert set(plain) == {"plain-float32", "plain-hf-static-float32"}
    static = plain["plain-hf-static-float32"]
    assert static["tokens_per_s"] > 0 and static["unexplained_divergences"] == 0  # greedy, checked against plain
    fastest = max(plain.values(), key=lambda r: r["tokens_per_s"])
    label = {"plain-float32": "float32", "plain-hf-static-float32": "float32, HF static cache + compile"}
    saved = json.loads((tmp_path / "compare.json").read_text())["fastest_plain"]
    assert saved["tiny"] == {"dtype": label[fastest["method"]], "tokens_per_s": fastest["tokens_per_s"]}
    assert f"tiny: {label[fastest['method']]} " in (tmp_path / "compare.md").read_text()
    assert fastest["vs_fastest_plain"] == 1.0


def test_datastore_rows_need_their_datastore(tiny_model_dir, tmp_path, capsys):
    """The -ds rows graft the top-level `datastore`: a run whose every chosen method lacks its
    datastore is refused before any work, and a missing one skips only its rows."""
    import pytest

    from draftsmith.models.errors import DraftsmithError

    cfg = compose_config("compare", [f"datastore={tmp_path / 'ds'}", f"output_dir={tmp_path / 'none'}"])
    assert all(f"decode.datastore={tmp_path / 'ds'}" in cfg.methods[name] for name in cfg.methods if name.endswith("-ds"))
    assert {"prompt-lookup-ds", "eagle3-ds", "medusa1-ds", "draft-fkl-ds", "draft-fkl-cpu-ds"} <= set(cfg.methods)
    with pytest.raises(DraftsmithError, match=r"^no datastore for \['prompt-lookup-ds'\] \(looked in \[.*/ds'\]\); "
                                              r"build it first: python scripts/build_datastore.py"):
        run(compose_config("compare", [f"datastore={tmp_path / 'ds'}", "only=[prompt-lookup-ds]",
                                       f"output_dir={tmp_path / 'none'}"]))
    assert not (tmp_path / "none").exists()
    result = run(compose_config("compare", tiny_model_overrides(tiny_model_dir) + [
        "datasets=[tiny]", "temperatures=[0.0]", "num_prompts=1", "max_new_tokens=4",
        "assistant=null", "plain_dtypes=[]", f"datastore={tmp_path / 'ds'}", "only=[prompt-lookup,prompt-lookup-ds]",
        f"output_dir={tmp_path / 'some'}"]))
    assert [r["method"] for r in result["rows"]] == ["prompt-lookup"]
    assert f"compare: skipping prompt-lookup-ds: no datastore at {tmp_path / 'ds'}" in capsys.readouterr().out
