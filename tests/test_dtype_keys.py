"""model.dtype is the one dtype of the verifier: every script that composes another script's
config (or starts one) passes it on, or refuses it in one line; never replaced by a key of its
own (`python scripts/bench/compare.py model.dtype=float32` once ran in bfloat16)."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.decode.evaluate import evaluate_config
from draftsmith.models.entry import config_problem, model_overrides
from draftsmith.models.errors import DraftsmithError
from tests.hub import compose_config

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    """scripts/<name>.py (a pipeline step) or scripts/bench/<name>.py (a benchmark), loaded as a module."""
    import importlib.util

    path = next(p for p in (ROOT / "scripts" / f"{name}.py", ROOT / "scripts" / "bench" / f"{name}.py") if p.is_file())
    spec = importlib.util.spec_from_file_location(f"dtype_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compare_runs_every_cell_in_model_dtype(tmp_path, dtype):
    compare = script("compare")
    cfg = compose_config("compare", [f"model.dtype={dtype}", "model.path=/some/verifier"])
    cell = compare.cell_config(cfg, ["proposer=prompt-lookup", "decode=prompt-lookup", "drafter=null"], "mtbench", 0.0,
                               tmp_path, hf=False)
    assert cell.model.dtype == dtype and cell.model.path == "/some/verifier"  # the whole node, not a rebuilt one
    plain = compare.cell_config(cfg, ["proposer=vanilla", "drafter=null"], "mtbench", 0.0, tmp_path, hf=False,
                                dtype="bfloat16")  # plain_dtypes' cells: that dtype, the same verifier
    assert plain.model.dtype == "bfloat16" and plain.model.path == "/some/verifier"
    with pytest.raises(DraftsmithError, match=r"^model.dtype=float64: the verifier \(model.\*\) is set once"):
        compare.cell_config(cfg, ["proposer=vanilla", "model.dtype=float64"], "mtbench", 0.0, tmp_path, hf=False)


def test_learning_curve_decodes_snapshots_in_model_dtype(tmp_path):
    curve = script("learning_curve")
    cfg = compose_config("learning_curve", ["model.dtype=float16"])
    assert curve.snapshot_config(cfg, "eagle3", tmp_path / "step-10", tmp_path).model.dtype == "float16"
    assert compose_config("learning_curve", []).model.dtype == "bfloat16"  # its default, stated as model.dtype


def test_tune_decode_and_the_entry_scripts_read_model_dtype():
    for config in ("tune_decode", "evaluate", "serve", "medusa", "eagle", "draft", "selfdistill", "prepare",
                   "build_datastore", "finetune_verifier"):
        assert compose_config(config, ["model.dtype=float16"]).model.dtype == "float16", config


def test_refresh_takes_model_dtype_or_the_old_runs():
    refresh = script("refresh")
    old = OmegaConf.create({"model": {"dtype": "bfloat16"}})
    assert refresh.verifier_config(compose_config("refresh", ["model.dtype=float16"]), old).dtype == "float16"
    assert refresh.verifier_config(compose_config("refresh", []), old).dtype == "bfloat16"  # null: the old run's


def test_the_benchmarks_pass_model_dtype_to_their_children():
    serve_args = script("bench_serve").server_args(compose_config("bench_serve", ["model.dtype=bfloat16"]))
    train_args = script("bench_train").train_args(compose_config("bench_train", ["model.dtype=float32"]))
    assert "model.dtype=bfloat16" in serve_args and "model=smollm2-135m" in serve_args
    assert "model.dtype=float32" in train_args  # (bench_train's default is bfloat16)
    cfg = compose_config("bench_serve", [])  # the config's own dtype, passed too: the child's main config may
    assert f"model.dtype={cfg.model.dtype}" in script("bench_serve").server_args(cfg)  # set another (serve.yaml)
    assert "model.dtype=float32" in script("bench_serve").server_args(compose_config("bench_serve", ["model.dtype=float32"]))


def test_bench_decode_refuses_model_dtype_it_would_ignore(tmp_path):
    bench = script("bench_decode")
    cfg = compose_config("bench_decode", ["model.dtype=float16", "proposer=vanilla", "drafter=null",
                                          f"output_dir={tmp_path}"])
    with pytest.raises(DraftsmithError, match=r"^model.dtype=float16 would be ignored: .* pass dtypes=\[float16\]"):
        bench.run(cfg)
    assert not tmp_path.joinpath("eval-float32").exists()


def test_a_script_without_a_verifier_node_refuses_model_dtype():
    problem = config_problem("bench_selfdistill", ["model.dtype=float16"])
    assert problem.startswith("unknown config key 'model.dtype'")


def test_model_overrides_name_the_preset_and_what_differs():
    cfg = compose_config("evaluate", ["model.dtype=bfloat16", "model.path=/v"])
    assert model_overrides(cfg.model) == ["model=smollm2-135m", "model.path=/v", "model.dtype=bfloat16"]
    assert model_overrides(compose_config("evaluate", []).model) == ["model=smollm2-135m", "model.dtype=float32"]
    tiny = OmegaConf.create({**OmegaConf.to_container(cfg.model), "name": "tiny", "extra": 1})
    args = model_overrides(tiny)
    assert "model.name=tiny" in args and "++model.extra=1" in args and not any(a.startswith("model=") for a in args)
    again = compose_config("evaluate", args)  # what a child entry script composes from them
    assert again.model.path == "/v" and again.model.dtype == "bfloat16" and again.model.extra == 1
    assert evaluate_config([], model=cfg.model).model == cfg.model


def test_profile_step_refuses_model_dtype_it_would_ignore(tmp_path):
    profile = script("profile_step")
    cfg = compose_config("profile_step", ["model.dtype=float16", f"output_dir={tmp_path}"])
    with pytest.raises(DraftsmithError, match=r"^model.dtype=float16 would be ignored: .* pass dtypes=\[float16\]"):
        profile.run(cfg)
