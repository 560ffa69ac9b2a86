"""decode/evaluate.py end to end on a tiny saved verifier and a tiny Medusa checkpoint."""
import json

import pytest
import torch

from draftsmith.decode.evaluate import run
from draftsmith.models.checkpoint import save_drafter
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.verifier import fingerprint, resolve_device
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import save_tiny_medusa, tiny_llama


@pytest.fixture()
def drafter(tmp_path):
    return save_tiny_medusa(tmp_path / "drafter")


def _cfg(tiny_model_dir, out, *extra):
    return compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "data.num_prompts=3", "max_new_tokens=12", f"output_dir={out}", *extra])


def test_greedy_run_writes_every_artifact_and_is_identical(tiny_model_dir, drafter, tmp_path):
    out = tmp_path / "eval"
    report = run(_cfg(tiny_model_dir, out, f"drafter={drafter}", "decode=medusa-small",
                      f"hf.assistant={tiny_model_dir}"))  # the verifier as its own HF assistant
    methods = report["methods"]
    names = {"vanilla", "medusa", "hf_generate", "hf_prompt_lookup", "hf_assisted", "hf_assisted_hf_defaults"}
    assert set(methods) == names
    for name in names:
        m = methods[name]
        # every decoder reproduces plain greedy decoding (or differs only at a numerical tie)
        assert m["greedy_identity_rate"] == 1.0 or m["greedy_divergences_unexplained"] == 0, (name, m)
    assert methods["vanilla"]["tau"] == 1.0 and methods["medusa"]["tau"] >= 1.0
    assert methods["vanilla"]["speedup"] == 1.0
    assert len(methods["medusa"]["accepted_per_depth"]) == 4
    lines = [json.loads(l) for l in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * len(names) and all(l["tokens"] for l in lines)
    ours = [l for l in lines if l["method"] == "medusa"]
    assert all(l["prompt_ids"] and len(l["tokens"]) <= 12 for l in ours)
    for name in ("results.json", "results.md", "acceptance_hist.png", "accepted_per_depth.png"):
        assert (out / name).is_file(), name
    assert "| medusa |" in (out / "results.md").read_text()


def test_sampled_run_records_every_sample_and_typical_is_labelled_lossy(tiny_model_dir, drafter, tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(DraftsmithError, match="typical.*cannot honour top_k=0 / top_p=0.9"):
        run(_cfg(tiny_model_dir, out, f"drafter={drafter}", "temperature=0.7", "top_p=0.9", "acceptance=typical"))
    report = run(_cfg(tiny_model_dir, out, f"drafter={drafter}", "temperature=0.7",
                      "num_samples=2", "hf.enabled=false", "acceptance=typical"))
    assert report["lossy"] and "medusa (LOSSY typical acceptance)" in report["methods"]
    assert "LOSSY" in (out / "results.md").read_text()
    lines = [json.loads(l) for l in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 2 * 2 and {l["sample"] for l in lines} == {0, 1}
    again = run(_cfg(tiny_model_dir, tmp_path / "again", f"drafter={drafter}", "temperature=0.7",
                     "num_samples=2", "hf.enabled=false", "acceptance=typical"))
    again_lines = [json.loads(l) for l in (tmp_path / "again" / "outputs.jsonl").read_text().splitlines()]
    assert [l["tokens"] for l in lines] == [l["tokens"] for l in again_lines]  # seed makes it reproducible
    assert again["methods"].keys() == report["methods"].keys()


def test_drafter_for_another_verifier_is_refused(tiny_model_dir, tmp_path):
    other = tiny_llama(dtype=torch.float32, seed=5)
    cfg = MedusaConfig(hidden_size=32, vocab_size=128, num_heads=4)
    path = save_drafter(tmp_path / "d", "medusa", MedusaHeads(cfg), cfg, verifier_fingerprint=fingerprint(other),
                        verifier_name="other")
    with pytest.raises(DraftsmithError, match="trained against verifier"):
        run(_cfg(tiny_model_dir, tmp_path / "eval", f"drafter={path}"))
    with pytest.warns(UserWarning, match="allowed"):
        run(_cfg(tiny_model_dir, tmp_path / "eval", f"drafter={path}", "allow_fingerprint_mismatch=true",
                 "hf.enabled=false", "data.num_prompts=1", "max_new_tokens=3"))


def test_tree_deeper_than_heads_is_one_line(tiny_model_dir, tmp_path):
    cfg = MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2)
    path = save_drafter(tmp_path / "d", "medusa", MedusaHeads(cfg), cfg,
                        verifier_fingerprint=fingerprint(tiny_llama(dtype=torch.float32)), verifier_name="tiny")
    with pytest.raises(DraftsmithError, match="4 deep.*2 heads"):
        run(_cfg(tiny_model_dir, tmp_path / "eval", f"drafter={path}", "decode=medusa-small"))


def test_vanilla_method_needs_no_drafter_and_unknown_proposer_is_refused(tiny_model_dir, tmp_path):
    report = run(_cfg(tiny_model_dir, tmp_path / "eval", "proposer=vanilla", "drafter=null", "hf.enabled=false",
                      "data.num_prompts=1", "max_new_tokens=4"))
    assert list(report["methods"]) == ["vanilla"] and report["methods"]["vanilla"]["tau"] == 1.0
    assert report["device"] == str(resolve_device("auto"))  # device=auto: where it decoded, in results.json
    with pytest.raises(DraftsmithError, match="proposer.kind='eagle9'.*valid: draft, eagle, lookahead, medusa, peagle, prompt_lookup, vanilla"):
        run(_cfg(tiny_model_dir, tmp_path / "eval", "proposer.kind=eagle9"))


def test_the_adaptive_budget_evaluates_losslessly_and_is_refused_where_nothing_drafts(tiny_model_dir, drafter, tmp_path):
    """engine.budget=adaptive: the drafting run verifies what pays on this machine (recorded in the
    report and its table's head), still plain greedy's output; with proposer=vanilla the key would
    be ignored, so it is refused, as is an unknown policy, before any model loads."""
    report = run(_cfg(tiny_model_dir, tmp_path / "eval", f"drafter={drafter}", "decode=medusa-small",
                      "engine.budget=adaptive", "hf.enabled=false"))
    assert report["budget"] == "adaptive" and "budget=adaptive" in (tmp_path / "eval" / "results.md").read_text()
    assert report["methods"]["medusa"]["greedy_identity_rate"] == 1.0
    with pytest.raises(DraftsmithError, match="engine.budget=adaptive with proposer=vanilla: nothing drafts") as e:
        run(_cfg(tiny_model_dir, tmp_path / "eval2", "proposer=vanilla", "drafter=null", "engine.budget=adaptive"))
    assert "\n" not in str(e.value) and not (tmp_path / "eval2").exists()
    with pytest.raises(DraftsmithError, match="engine.budget='load' is not known; valid: adaptive, fixed"):
        run(_cfg(tiny_model_dir, tmp_path / "eval3", f"drafter={drafter}", "engine.budget=load"))


def test_the_table_head_names_the_decode_keys_the_command_line_replaced(tiny_model_dir, drafter, tmp_path):
    """Run as a user runs it: a command line that replaces a preset's keys (decode.paths=[[0]]) has
    them in the table's head and the report beside the preset's name, so "tree=medusa-small" never
    stands for a tree the run did not verify; the one-node tree verifies 2 nodes a step."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "eval"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "decode/evaluate.py", *tiny_model_overrides(tiny_model_dir), "data=tiny",
                    "data.num_prompts=2", "max_new_tokens=8", f"output_dir={out}", f"drafter={drafter}",
                    "decode=medusa-small", "decode.paths=[[0]]", "hf.enabled=false"], cwd=root, check=True,
                   capture_output=True)
    report = json.loads((out / "results.json").read_text())
    assert report["decode_tree"] == "medusa-small" and report["decode_overrides"] == ["decode.paths=[[0]]"]
    assert "tree=medusa-small decode.paths=[[0]]" in (out / "results.md").read_text()
    assert report["methods"]["medusa"]["mean_nodes"] <= 2 < len(compose_config("evaluate", ["decode=medusa-small"]).decode.paths) + 1
    plain = run(_cfg(tiny_model_dir, tmp_path / "eval2", f"drafter={drafter}", "decode=medusa-small", "hf.enabled=false"))
    assert plain["decode_overrides"] == []  # composed without a command line: the preset as it is


@pytest.mark.parametrize("method,decode", [("prompt-lookup", "prompt-lookup"), ("lookahead", "lookahead"),
                                           ("draft", "draft-chain"), ("draft", "draft-tree")])
def test_decode_only_methods_run_losslessly(tiny_model_dir, tmp_path, method, decode):
    """Prompt lookup, lookahead and a draft model (a trained-by-nobody truncated verifier,
    saved as a draft folder) through the evaluator: greedy output equals plain decoding; the
    draft is also HF's assistant, for the assisted-generation comparison."""
    from omegaconf import OmegaConf

    from draftsmith.models.draft import build_student, save_draft_model
    from tests.tiny import tiny_tokenizer

    extra = [f"proposer={method}", f"decode={decode}", "drafter=null"]
    if method == "draft":
        verifier = tiny_llama(dtype=torch.float32)
        student = build_student(verifier, tiny_tokenizer(), OmegaConf.create({"init": "truncate", "num_layers": 1}))
        draft = save_draft_model(tmp_path / "draft", student, tiny_tokenizer(),
                                 verifier_fingerprint=fingerprint(verifier), verifier_name="tiny")
        extra = [f"proposer={method}", f"decode={decode}", f"drafter={draft}", f"hf.assistant={draft}"]
    report = run(_cfg(tiny_model_dir, tmp_path / "eval", *extra))
    ours = report["methods"][method]
    assert ours["greedy_identity_rate"] == 1.0 or ours["greedy_divergences_unexplained"] == 0, ours
    assert ours["tau"] >= 1.0
    if method == "draft":  # HF assisted at the draft's own schedule (its generation_config.json) and at HF's
        methods = report["methods"]
        assert methods["hf_assisted"]["assistant_schedule"] == {
            "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0}
        assert methods["hf_assisted_hf_defaults"]["assistant_schedule"] == {
            "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4}
        for name in ("hf_assisted", "hf_assisted_hf_defaults"):
            assert methods[name]["greedy_identity_rate"] == 1.0 or methods[name]["greedy_divergences_unexplained"] == 0
        with pytest.raises(DraftsmithError, match="hf.assisted_schedules"):
            run(_cfg(tiny_model_dir, tmp_path / "eval3", *extra, "hf.assisted_schedules=[ours]"))
    with pytest.raises(DraftsmithError, match="needs a .* decode preset"):
        run(_cfg(tiny_model_dir, tmp_path / "eval2", f"proposer={method}", "decode=medusa-small",
                 *extra[2:]))


def test_hf_static_path_captures_cuda_graphs_only_on_a_gpu():
    """HF's own default on a GPU (reduce-overhead: the decode step replayed as a CUDA graph), so the
    fastest plain decoding there is not timed without it; the CPU compiles plain code."""
    from draftsmith.decode.evaluate import static_compile_mode

    assert static_compile_mode(torch.device("cuda", 1)) == static_compile_mode("cuda") == "reduce-overhead"
    assert static_compile_mode(torch.device("cpu")) == "default"


def test_hf_static_cache_row_is_compiled_once_and_greedy_identical(tiny_model_dir, tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    report = run(_cfg(tiny_model_dir, tmp_path / "eval", "proposer=vanilla", "drafter=null", "hf.static_cache=true"))
    static = report["methods"]["hf_generate_static"]
    assert static["greedy_identity_rate"] == 1.0 or static["greedy_divergences_unexplained"] == 0, static
    assert static["num_tokens"] > 0 and static["compile_s"] > 0
    assert counters["stats"]["unique_graphs"] >= 1  # transformers really compiled the decode step on the CPU
    frames = counters["stats"]["unique_graphs"]
    longest = max(len(json.loads(l)["prompt_ids"]) for l in (tmp_path / "eval" / "outputs.jsonl").read_text().splitlines()
                  if json.loads(l)["method"] == "vanilla")
    assert static["cache_slots"] == longest + 12  # one cache shape for every prompt: the longest + max_new_tokens
    again = run(_cfg(tiny_model_dir, tmp_path / "again", "proposer=vanilla", "drafter=null", "hf.static_cache=true"))
    assert again["methods"]["hf_generate_static"]["num_tokens"] == static["num_tokens"]
    assert counters["stats"]["unique_graphs"] == frames  # a second evaluation compiles nothing new
