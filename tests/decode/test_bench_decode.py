"""scripts/bench/bench_decode.py on a tiny verifier and Medusa checkpoint: T(k), the evaluate rows per
dtype, and which plain decoder counts as the fastest; a missing drafter stops it (and evaluate,
serve) before any work."""
import json

import pytest

from draftsmith.decode import evaluate, serve
from draftsmith.models.errors import DraftsmithError
from scripts.bench import bench_decode
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from tests.tiny import save_tiny_medusa


def test_bench_decode_with_hf_static_path(tiny_model_dir, tmp_path):
    drafter = save_tiny_medusa(tmp_path / "drafter")
    cfg = compose_config("bench_decode", tiny_model_overrides(tiny_model_dir) + ["model.dtype=null",  # dtypes= sets it
        f"drafter={drafter}", "decode=medusa-small", "data=tiny", "data.num_prompts=2", "max_new_tokens=8",
        "dtypes=[float32]", "ks=[1,4]", "repeats=1", "cache_len=16", "hf.static_cache=true",
        f"output_dir={tmp_path / 'bench'}"])
    report = bench_decode.run(cfg)
    entry = report["by_dtype"]["float32"]
    assert set(entry["T_ratio"]) == {"1", "4"} and entry["method"] == "medusa" and entry["tau"] >= 1.0
    methods = entry["methods"]
    assert {"vanilla", "medusa", "hf_generate", "hf_prompt_lookup", "hf_generate_static"} == set(methods)
    plain = {name: methods[name]["tokens_per_s"] for name in ("vanilla", "hf_generate_static")}
    assert report["fastest_plain_tokens_per_s"] == max(plain.values())  # HF eager generate is not a contender
    assert max(methods[name]["speedup_vs_fastest_plain"] for name in plain) == 1.0
    saved = json.loads((tmp_path / "bench" / "bench_decode.json").read_text())
    assert saved["fastest_plain_tokens_per_s"] == report["fastest_plain_tokens_per_s"]
    assert "hf_generate_static" in (tmp_path / "bench" / "bench_decode.md").read_text()
    assert (tmp_path / "bench" / "verify_cost.png").is_file()


def test_a_missing_drafter_is_refused_before_any_measurement(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_decode, "load_verifier", lambda *a, **k: pytest.fail("measured before the check"))
    monkeypatch.setattr(evaluate, "load_verifier", lambda *a, **k: pytest.fail("loaded before the check"))
    monkeypatch.setattr(serve, "load_verifier", lambda *a, **k: pytest.fail("loaded before the check"))
    missing = tmp_path / "never-trained"
    for config, run in [("bench_decode", bench_decode.run), ("evaluate", evaluate.run), ("serve", serve.Server)]:
        out = [] if config == "serve" else [f"output_dir={tmp_path / config}"]
        cfg = compose_config(config, tiny_model_overrides(tiny_model_dir) + [
            "proposer=medusa", f"drafter={missing}", *out] + (["model.dtype=null"] if config == "bench_decode" else []))
        with pytest.raises(DraftsmithError, match=rf"^drafter={missing}: no such checkpoint folder$"):
            run(cfg)
        assert not (tmp_path / config).exists()
    cfg = compose_config("evaluate", tiny_model_overrides(tiny_model_dir) + [
        "proposer=vanilla", "drafter=null", f"hf.assistant={missing}", f"output_dir={tmp_path / 'assisted'}"])
    with pytest.raises(DraftsmithError, match=rf"^hf.assistant={missing}: no such folder; pass a draft model folder"):
        evaluate.run(cfg)  # HF assisted generation with a draft that is not there: before the verifier loads
