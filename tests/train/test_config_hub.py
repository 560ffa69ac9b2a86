import pytest
from hydra.errors import ConfigCompositionException

from tests.hub import CONF, compose_config

MAIN_CONFIGS = sorted(p.stem for p in CONF.glob("*.yaml"))
MODEL_PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
LAUNCHERS = {"bench_selfdistill": "verifier"}  # runs other entry scripts, naming a model preset
NO_MODEL = {"peagle_summary"}  # reads what other runs wrote: a model= it would ignore is refused
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "accelerate")


def test_the_presets_users_expect_exist():
    for name in ["smollm2-135m", "llama2-7b", "vicuna-7b-v1.3", "llama3.1-8b-instruct",
                 "qwen2.5-7b-instruct", "mistral-7b-instruct"]:
        assert name in MODEL_PRESETS
    assert "medusa" in MAIN_CONFIGS and "selfdistill" in MAIN_CONFIGS


@pytest.mark.parametrize("main", MAIN_CONFIGS)
@pytest.mark.parametrize("model", MODEL_PRESETS)
def test_every_main_config_composes_with_every_model(main, model):
    if main in NO_MODEL:
        with pytest.raises(ConfigCompositionException, match="model"):
            compose_config(main, [f"model={model}"])
        return
    if main in LAUNCHERS:  # runs other entry scripts; names the preset in a plain key
        cfg = compose_config(main, [f"{LAUNCHERS[main]}={model}"])
        assert cfg[LAUNCHERS[main]] == model
        return
    cfg = compose_config(main, [f"model={model}"])
    assert cfg.model.name == model
    # null: the dtype comes from elsewhere (refresh: the old run's; bench_decode: each of dtypes)
    assert cfg.model.dtype in ("float32", "bfloat16", "float16") or (main in ("refresh", "bench_decode", "profile_step", "bench_invariance")
                                                                     and cfg.model.dtype is None)
    for key in cfg:  # everything resolves (interpolations included)
        _ = cfg[key]


@pytest.mark.parametrize("group", GROUPS)
def test_every_yaml_starts_with_the_command_that_uses_it(group):
    from tests.commands import first_line

    for path in sorted((CONF / group).glob("*.yaml")) + sorted(CONF.glob("*.yaml")):
        first = first_line(path)  # (after Hydra's `# @package` header, where one is needed)
        assert first.startswith("# ") and ("python " in first or "accelerate " in first), path


def test_unknown_keys_are_rejected():
    with pytest.raises(ConfigCompositionException, match="num_hedas"):
        compose_config("medusa", ["method.num_hedas=4"])
    with pytest.raises(ConfigCompositionException, match="llama9"):
        compose_config("medusa", ["model=llama9"])


def test_misspelt_keys_fail_in_one_line_listing_the_valid_ones(capsys):
    from draftsmith.models.entry import check_cli_overrides

    with pytest.raises(SystemExit) as info:
        check_cli_overrides("medusa", ["method.num_hedas=4"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'method.num_hedas'" in err and "num_heads" in err
    check_cli_overrides("medusa", ["method=medusa1", "method.num_heads=2", "+extra=1", "trainer=debug"])  # fine
    check_cli_overrides("selfdistill", ["data@data.prompts=mtbench", "data.prompts.num_prompts=3"])


def test_trainer_presets_state_only_what_differs_from_default():
    """trainer=debug / cpu-long inherit trainer/default.yaml (Hydra defaults) and set only their own
    differences: composed, each has every key of default; written, none repeats default's value."""
    import yaml

    default = yaml.safe_load((CONF / "trainer" / "default.yaml").read_text())
    presets = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml") if p.stem != "default")
    assert presets
    for name in presets:
        own = yaml.safe_load((CONF / "trainer" / f"{name}.yaml").read_text())
        assert own.pop("defaults") == ["default", "_self_"], name
        assert own and all(default[k] != v for k, v in own.items()), (name, own)
        composed = compose_config("medusa", [f"trainer={name}"]).trainer
        assert set(composed) == set(default) and all(composed[k] == own.get(k, default[k]) for k in default), name
