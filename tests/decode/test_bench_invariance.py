"""scripts/bench/bench_invariance.py at toy size: each invariant mode (rows, float64) makes every
speculative output plain decoding's (greedy and same-seed sampled); the report, table and plot are
written; an unknown mode is refused before any work."""
import json

import pytest

from scripts.bench import bench_invariance
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from draftsmith.models.errors import DraftsmithError


def test_bench_invariance_on_a_tiny_verifier(tiny_model_dir, tmp_path):
    cfg = compose_config("bench_invariance", tiny_model_overrides(tiny_model_dir) + [
        "model.dtype=null", "dtypes=[bfloat16]", "data=tiny", "data.num_prompts=2", "max_new_tokens=10",
        f"output_dir={tmp_path}"])
    report = bench_invariance.run(cfg)
    assert [r["invariant"] for r in report["rows"]] == ["off", "rows", "float64"]
    for on in report["rows"][1:]:
        assert on["greedy_identical"] == 1.0 and on["sampled_identical"] == 1.0 and on["sampled_agreement"] == 1.0
    assert json.loads((tmp_path / "bench_invariance.json").read_text())["rows"] == report["rows"]
    table = (tmp_path / "bench_invariance.md").read_text()
    assert "| bfloat16 | rows | 100% | 100% |" in table and "| bfloat16 | float64 | 100% | 100% |" in table
    assert (tmp_path / "bench_invariance.png").is_file()
    with pytest.raises(DraftsmithError, match="engine.invariant='exact' is not known"):
        bench_invariance.run(compose_config("bench_invariance", tiny_model_overrides(tiny_model_dir) + [
            "model.dtype=null", "modes=[false,exact]", "data=tiny", f"output_dir={tmp_path}/m"]))
    with pytest.raises(DraftsmithError, match="proposer=vanilla drafts nothing"):
        bench_invariance.run(compose_config("bench_invariance", tiny_model_overrides(tiny_model_dir) + [
            "model.dtype=null", "proposer=vanilla", "decode=chain4", "data=tiny", f"output_dir={tmp_path}/v"]))
