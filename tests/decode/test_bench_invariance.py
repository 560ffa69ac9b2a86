"""scripts/bench_invariance.py at toy size: the mode on makes every speculative output plain
decoding's (greedy and same-seed sampled); the report, table and plot are written."""
import json

import pytest

from scripts import bench_invariance
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config
from draftsmith.models.errors import DraftsmithError


def test_bench_invariance_on_a_tiny_verifier(tiny_model_dir, tmp_path):
    cfg = compose_config("bench_invariance", tiny_model_overrides(tiny_model_dir) + [
        "model.dtype=null", "dtypes=[bfloat16]", "data=tiny", "data.num_prompts=2", "max_new_tokens=10",
        f"output_dir={tmp_path}"])
    report = bench_invariance.run(cfg)
    on = next(r for r in report["rows"] if r["invariant"])
    assert on["greedy_identical"] == 1.0 and on["sampled_identical"] == 1.0 and on["sampled_agreement"] == 1.0
    assert json.loads((tmp_path / "bench_invariance.json").read_text())["rows"] == report["rows"]
    assert "| bfloat16 | on | 100% | 100% |" in (tmp_path / "bench_invariance.md").read_text()
    assert (tmp_path / "bench_invariance.png").is_file()
    with pytest.raises(DraftsmithError, match="method=vanilla drafts nothing"):
        bench_invariance.run(compose_config("bench_invariance", tiny_model_overrides(tiny_model_dir) + [
            "model.dtype=null", "method=vanilla", "decode=chain4", "data=tiny", f"output_dir={tmp_path}/v"]))
