"""scripts/generate_selfdistill.py on a tiny saved verifier: generation, resume, loading."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import DataError, load_conversations, read_jsonl
from draftsmith.train.core.data import check_data_verifier, tokenize_conversations
from tests.hub import free_port  # a port per launch: fixed ones collide between xdist workers
from tests.tiny import tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = str(ROOT / "conf")
SCRIPT = ROOT / "scripts" / "generate_selfdistill.py"


def load_script():
    spec = importlib.util.spec_from_file_location("generate_selfdistill", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_script()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-verifier")
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def make_cfg(model_dir, output_dir, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("selfdistill", overrides=[
            f"model.path={model_dir}", "model.name=tiny", "model.source=hf", "model.dtype=float64",
            "data@data.prompts=tiny", "num_prompts=7", "max_new_tokens=8", "batch_size=3",
            f"output_dir={output_dir}", *overrides])


def read_records(path: Path) -> list[dict]:
    return read_jsonl(path / "records.jsonl")


def test_default_config_composes():
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("selfdistill")
    assert cfg.model.name == "smollm2-135m" and cfg.data.name == "selfdistill"
    assert cfg.data.prompts.source == "chitchat" and cfg.num_prompts == cfg.data.prompts.num_prompts
    assert cfg.output_dir == cfg.data.path
    assert cfg.data.path.endswith("data/selfdistill-smollm2-135m") and not os.path.isabs(cfg.data.path)
    assert (cfg.max_new_tokens, cfg.temperature, cfg.batch_size, cfg.backend) == (128, 0.0, 128, "batched")
    assert (cfg.model.dtype, cfg.model.attn_implementation) == ("bfloat16", "grouped")
    assert (ROOT / "conf" / "selfdistill.yaml").read_text().startswith("# python scripts/generate_selfdistill.py")


def test_generate_resume_and_load(model_dir, tmp_path):
    full_dir = tmp_path / "full"
    result = gen.run(make_cfg(model_dir, full_dir))
    assert (result["records"], result["generated"], result["resumed"]) == (7, 7, 0)
    full = read_records(full_dir)
    assert sorted(r["id"] for r in full) == sorted(f"tiny-{i}" for i in range(7))
    for record in full:
        assert record["messages"][-1]["role"] == "assistant" and record["messages"][-2]["role"] == "user"
        assert record["finish"] in ("stop", "length")
    manifest = json.loads((full_dir / "manifest.json").read_text())
    assert manifest["verifier"] == {"name": "tiny", "fingerprint": result["fingerprint"]}
    assert manifest["complete"] and manifest["counts"]["records"] == 7
    assert manifest["settings"]["max_new_tokens"] == 8 and manifest["settings"]["temperature"] == 0.0

    # the output is training data
    convs = load_conversations({"source": "local", "path": str(full_dir), "name": "selfdistill"})
    assert len(convs) == 7 and convs[0]["messages"] == full[0]["messages"]
    assert check_data_verifier({"source": "local", "path": str(full_dir)}, result["fingerprint"]) is None
    with pytest.warns(UserWarning):
        check_data_verifier({"source": "local", "path": str(full_dir)}, "0" * 16)

    # a killed run: two finished records and a torn third line
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    lines = (full_dir / "records.jsonl").read_text().splitlines(keepends=True)
    (resumed_dir / "records.jsonl").write_text(lines[0] + lines[1] + lines[2][:25])
    result = gen.run(make_cfg(model_dir, resumed_dir))
    assert (result["records"], result["generated"], result["resumed"]) == (7, 5, 2)
    resumed = read_records(resumed_dir)
    assert len(resumed) == len({r["id"] for r in resumed}) == 7
    assert resumed[:2] == [json.loads(lines[0]), json.loads(lines[1])]
    # greedy answers do not depend on the batch a prompt landed in (left padding is masked)
    by_id = {r["id"]: r for r in full}
    assert all(r == by_id[r["id"]] for r in resumed)

    # a complete run resumes to a no-op; more prompts extend it
    assert gen.run(make_cfg(model_dir, resumed_dir))["generated"] == 0
    assert gen.run(make_cfg(model_dir, resumed_dir, "num_prompts=9"))["generated"] == 2
    assert len(read_records(resumed_dir)) == 9

    # other generation settings must not be mixed into the same folder
    with pytest.raises(DataError, match=r"max_new_tokens: 8 -> 4"):
        gen.run(make_cfg(model_dir, resumed_dir, "max_new_tokens=4"))


def test_batched_and_hf_generate_backends_write_the_same_greedy_answers(model_dir, tmp_path):
    """Continuous batching (the default) against HF generate in static batches, float64."""
    batched = gen.run(make_cfg(model_dir, tmp_path / "batched", "backend=batched", "max_new_tokens=12"))
    hf = gen.run(make_cfg(model_dir, tmp_path / "hf", "backend=transformers", "max_new_tokens=12"))
    assert batched["records"] == hf["records"] == 7 and batched["new_tokens"] == hf["new_tokens"] > 0
    by_id = {r["id"]: r for r in read_records(tmp_path / "hf")}
    assert all(r == by_id[r["id"]] for r in read_records(tmp_path / "batched"))
    throughput = json.loads((tmp_path / "batched" / "manifest.json").read_text())["counts"]["throughput"]
    assert throughput["backend"] == "batched" and throughput["new_tokens"] == batched["new_tokens"]


def test_sampling_runs_and_trains(model_dir, tmp_path, tokenizer):
    result = gen.run(make_cfg(model_dir, tmp_path, "temperature=0.8", "top_p=0.9", "num_prompts=3"))
    assert result["records"] == 3
    convs = load_conversations({"source": "local", "path": str(tmp_path)})
    tokenized = tokenize_conversations(convs, tokenizer, max_length=128)
    assert len(tokenized) == 3  # every answer (even an empty one) labels at least <|im_end|>


def test_bad_middle_line_is_an_error(model_dir, tmp_path):
    (tmp_path / "records.jsonl").write_text('{"id": "tiny-0"}\n{torn\n{"id": "tiny-1"}\n')
    with pytest.raises(DataError, match=r"line 2 of .*records.jsonl is not a record"):
        gen.read_done_ids(tmp_path / "records.jsonl")
    (tmp_path / "records.jsonl").write_text('{"id": "tiny-0"}\n{"id": "tiny-1"')
    assert gen.read_done_ids(tmp_path / "records.jsonl") == {"tiny-0"}
    assert (tmp_path / "records.jsonl").read_text() == '{"id": "tiny-0"}\n'


@pytest.mark.slow
def test_cli_entry_point(model_dir, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, str(SCRIPT), f"model.path={model_dir}", "model.name=tiny", "model.source=hf",
           "data@data.prompts=tiny", "num_prompts=2", "max_new_tokens=4", f"output_dir={out}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "selfdistill: 2 records" in done.stdout
    assert len(read_records(out)) == 2


@pytest.mark.slow
@pytest.mark.heavy
def test_two_processes_split_the_prompts_and_merge(model_dir, tmp_path):
    """accelerate launch with 2 CPU processes: each answers half the prompts into its part
    file, process 0 merges; greedy answers equal a 1-process run's, prompt for prompt."""
    one = gen.run(make_cfg(model_dir, tmp_path / "one"))
    out = tmp_path / "two"
    cmd = ["accelerate", "launch", "--config_file", "conf/accelerate/cpu-2proc.yaml",
           "--main_process_port", str(free_port()),
           str(SCRIPT), f"model.path={model_dir}", "model.name=tiny", "model.source=hf", "model.dtype=float64",
           "data@data.prompts=tiny", "num_prompts=7", "max_new_tokens=8", "batch_size=3", f"output_dir={out}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "process 0/2: 4 answers" in log and "process 1/2: 3 answers" in log
    assert "7 generated now by 2 process(es)" in log
    assert not (out / "parts").exists()
    by_id = {r["id"]: r for r in read_records(tmp_path / "one")}
    two = read_records(out)
    assert len(two) == 7 and all(r == by_id[r["id"]] for r in two)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["processes"] == 2
    # the run's throughput counts both processes' tokens (the 1-process run's, since the answers are equal)
    assert counts["throughput"]["new_tokens"] == one["new_tokens"] and counts["throughput"]["processes"] == 2
    assert one["records"] == 7


def test_an_interrupted_multi_process_run_resumes_from_its_parts(model_dir, tmp_path):
    full = tmp_path / "full"
    gen.run(make_cfg(model_dir, full))
    lines = (full / "records.jsonl").read_text().splitlines(keepends=True)
    out = tmp_path / "resumed"
    (out / "parts").mkdir(parents=True)
    (out / "parts" / "records.0.jsonl").write_text(lines[0] + lines[1])
    (out / "parts" / "records.1.jsonl").write_text(lines[2] + lines[3][:20])  # killed mid-write
    result = gen.run(make_cfg(model_dir, out))  # now 1 process
    assert (result["resumed"], result["generated"], result["records"]) == (3, 4, 7)
    assert not (out / "parts").exists()
    assert sorted(r["id"] for r in read_records(out)) == sorted(json.loads(x)["id"] for x in lines)


def test_answers_holding_unicode_line_separators_stay_one_record(model_dir, tmp_path):
    """JSON Lines are split at "\n" only: an answer with U+2028 / U+2029 (ShareGPT has them; json.dumps
    with ensure_ascii=False writes them raw) is one record, in records.jsonl and in a part file alike
    (str.splitlines() cut such a record in two and the finished run crashed)."""
    full = tmp_path / "full"
    gen.run(make_cfg(model_dir, full))
    records = [json.loads(x) for x in (full / "records.jsonl").read_text().split("\n") if x.strip()]
    for r in records[:2]:
        r["messages"][-1]["content"] = "line\u2028separator\u2029paragraph " + r["messages"][-1]["content"]
    out = tmp_path / "resumed"
    (out / "parts").mkdir(parents=True)
    (out / "records.jsonl").write_text(json.dumps(records[0], ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "parts" / "records.0.jsonl").write_text(json.dumps(records[1], ensure_ascii=False) + "\n", encoding="utf-8")
    assert "\u2028" in (out / "records.jsonl").read_text(encoding="utf-8")  # written raw, as the generator writes
    result = gen.run(make_cfg(model_dir, out))
    assert (result["resumed"], result["generated"], result["records"]) == (2, 5, 7)
    back = {r["id"]: r for r in read_records(out)}
    assert back[records[0]["id"]] == records[0] and back[records[1]["id"]] == records[1]


def test_vllm_backend_without_vllm_is_a_one_line_error(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without vLLM, installed or not
    with pytest.raises(DataError, match="backend=vllm needs vLLM on a GPU machine: pip install vllm"):
        gen.run(make_cfg(model_dir, tmp_path, "backend=vllm"))
    with pytest.raises(DraftsmithError, match="backend=.tgi. is not known; valid: batched, transformers, vllm"):
        gen.run(make_cfg(model_dir, tmp_path / "x", "backend=tgi"))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_selfdistill", ROOT / "scripts" / "bench" / "bench_selfdistill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("bench_selfdistill", overrides=[f"output_dir={tmp_path}", *overrides])


def test_bench_runs_a_processes_case_under_accelerate_with_the_threads_split(tmp_path, monkeypatch):
    """The bench's command per case (the generation itself is tested above): a `processes` case
    goes through accelerate launch, one thread per process, and its tok/s is the manifest's."""
    bench = load_bench()
    seen = {}

    def fake_run(cmd, env):
        out = Path(next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        seen[out.name] = (cmd, env)
        tokens = 400 if "accelerate" in cmd else 100
        (out / "manifest.json").write_text(json.dumps({"counts": {"records": 4, "truncated": 0, "throughput": {
            "new_tokens": tokens, "seconds": 10.0, "tokens_per_s": tokens / 10.0}}}))
        return 10.0, 1.0

    monkeypatch.setattr(bench, "run_measured", fake_run)
    report = bench.run(bench_cfg(tmp_path, "cases=[hf-fp32-b16,batched-bf16-b128-2proc]", "threads=2"))
    cmd, env = seen["batched-bf16-b128-2proc"]
    assert cmd[:2] == ["accelerate", "launch"] and cmd[cmd.index("--num_processes") + 1] == "2"
    assert env["ACCELERATE_USE_CPU"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert seen["hf-fp32-b16"][0][0] == sys.executable and seen["hf-fp32-b16"][1]["OMP_NUM_THREADS"] == "2"
    assert report["cases"]["batched-bf16-b128-2proc"]["vs_baseline"] == pytest.approx(4.0)
    assert "| batched-bf16-b128-2proc | 2 |" in (tmp_path / "bench_selfdistill.md").read_text()


def test_bench_refuses_a_processes_key_naming_no_case(tmp_path):
    bench = load_bench()
    with pytest.raises(DraftsmithError, match="processes"):
        bench.run(bench_cfg(tmp_path, "+processes.no-such-case=2"))
    with pytest.raises(DraftsmithError, match="must be 1..threads"):
        bench.run(bench_cfg(tmp_path, "processes.batched-bf16-b128-2proc=4", "threads=2"))


@pytest.mark.parametrize("overrides, message", [
    (["top_p=0.9"], "top_p=0.9 would be ignored: temperature=0 decodes greedily"),
    (["vllm.tensor_parallel_size=4"], "vllm.tensor_parallel_size=4 would be ignored: backend=batched"),
    (["backend=transformers", "vllm.gpu_memory_utilization=0.5"], "vllm.gpu_memory_utilization=0.5 would be ignored"),
])
def test_a_key_this_run_would_ignore_is_refused_before_loading(tmp_path, overrides, message, monkeypatch):
    monkeypatch.setattr(gen, "load_verifier", lambda *a, **k: pytest.fail("the verifier loaded"))
    with pytest.raises(DraftsmithError, match=f"^{message}"):
        gen.run(make_cfg("unused", tmp_path, *overrides))
    # ... while the same keys where they are read, and the defaults anywhere, pass this check
    assert gen.ignored_setting(make_cfg("unused", tmp_path, "temperature=0.7", "top_p=0.9"), "batched") is None
    assert gen.ignored_setting(make_cfg("unused", tmp_path, "vllm.tensor_parallel_size=4"), "vllm") is None
    assert gen.ignored_setting(make_cfg("unused", tmp_path), "transformers") is None
