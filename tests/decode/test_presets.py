"""The decode presets as users compose them: the graft keys stated once (conf/decode/graft/), and
`hw=cpu` as the one override that sizes the presets for a CPU (conf/hw/, conf/decode_hw/)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml
from omegaconf import OmegaConf

from draftsmith.decode.build import load_preset, resolve_hw
from draftsmith.decode.probe import check_config, decode_preset
from draftsmith.models.entry import config_problem
from draftsmith.models.errors import DraftsmithError
from tests.hub import CONF, compose_config

PRESETS = sorted(p.stem for p in (CONF / "decode").glob("*.yaml"))
GRAFT_PARTS = sorted((CONF / "decode" / "graft").glob("*.yaml"))
GRAFT_DEFAULTS = {k: v for part in GRAFT_PARTS for k, v in yaml.safe_load(part.read_text()).items()}
CPU_FILES = sorted((CONF / "decode_hw").glob("cpu-*.yaml"))


def _raw(name: str) -> dict:
    return yaml.safe_load((CONF / "decode" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_states_a_graft_key_only_to_change_it(name):
    """The graft keys live in conf/decode/graft/; a preset that repeated one at its default value
    would be a second home for it."""
    raw = _raw(name)
    repeated = {k for k in raw if k in GRAFT_DEFAULTS and raw[k] == GRAFT_DEFAULTS[k]}
    assert not repeated, f"conf/decode/{name}.yaml repeats {sorted(repeated)}: take them from conf/decode/graft/"


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "lookahead"])
def test_every_preset_composes_with_the_graft_keys(name):
    """What decode/evaluate.py composes for decode=<name> holds every graft key (the tree presets
    both grafts, prompt lookup the datastore), with the preset's own values where it sets them."""
    decode = compose_config("evaluate", [f"decode={name}"]).decode
    wanted = {k for part in GRAFT_PARTS if name != "prompt-lookup" or part.stem == "datastore"
              for k in yaml.safe_load(part.read_text())}
    assert wanted <= set(decode)
    for key in wanted:
        assert decode[key] == _raw(name).get(key, GRAFT_DEFAULTS[key])
    assert OmegaConf.to_container(load_preset(name)) == OmegaConf.to_container(decode)


@pytest.mark.parametrize("path", CPU_FILES, ids=lambda p: p.stem)
def test_hw_cpu_changes_only_the_sizes_of_an_existing_preset(path):
    """conf/decode_hw/cpu-<preset>.yaml names a preset and overrides keys it has, nothing new;
    hw=cpu composes to the preset with exactly those keys changed."""
    name = path.stem.removeprefix("cpu-")
    assert name in PRESETS, f"{path.name}: no conf/decode/{name}.yaml"
    gpu = OmegaConf.to_container(compose_config("evaluate", [f"decode={name}"]).decode)
    cpu = OmegaConf.to_container(compose_config("evaluate", [f"decode={name}", "hw=cpu"]).decode)
    assert set(cpu) == set(gpu)
    changed = {k for k in gpu if gpu[k] != cpu[k]}
    assert changed and changed <= {"name", "paths", "depth", "top_k", "total_tokens", "window", "ngram", "guess_set"}
    assert OmegaConf.to_container(load_preset(name, hw="cpu")) == cpu


def test_hw_cpu_sizes_the_defaults_a_gpu_user_does_not_get():
    """The GPU defaults are the papers' sizes; hw=cpu is the one override that makes them CPU-sized,
    and a preset without a CPU file is the same under both."""
    gpu, cpu = (compose_config("evaluate", [f"hw={hw}", "decode=eagle-dynamic"]).decode for hw in ("gpu", "cpu"))
    assert (gpu.depth, gpu.top_k, gpu.total_tokens) == (6, 10, 60)
    assert (cpu.depth, cpu.top_k, cpu.total_tokens) == (2, 8, 8)
    default_gpu, default_cpu = (compose_config("evaluate", [f"hw={hw}"]).decode for hw in ("gpu", "cpu"))
    assert default_gpu.name == "medusa-default" and len(default_gpu.paths) == 31
    assert list(default_cpu.paths) == _raw("medusa-cpu")["paths"] and default_cpu.name == "medusa-cpu"
    for name in ("eagle-chain", "medusa-cpu", "prompt-lookup", "draft-chain"):
        assert compose_config("serve", [f"decode={name}", "hw=cpu"]).decode == \
            compose_config("serve", [f"decode={name}"]).decode
    tuned = compose_config("tune_decode", ["hw=cpu"]).decode
    assert (tuned.name, tuned.total_tokens) == ("eagle-dynamic", 8)


def test_a_bad_hw_or_preset_is_refused_in_one_line():
    assert config_problem("evaluate", ["hw=tpu"]) == "hw='tpu' is not a preset of conf/hw/; valid: cpu, gpu"
    with pytest.raises(DraftsmithError, match=r"^hw='tpu' is not known; valid: cpu, gpu$"):
        load_preset("eagle-dynamic", hw="tpu")
    with pytest.raises(DraftsmithError, match=r"^decode='eagle-dynamc': no conf/decode/eagle-dynamc.yaml; valid: "):
        load_preset("eagle-dynamc")
    with pytest.raises(DraftsmithError, match=r"^probe.hw='tpu' is not known; valid: auto, cpu, gpu$"):
        check_config(OmegaConf.create({"num_prompts": 2, "max_new_tokens": 8, "decode": "auto", "hw": "tpu"}))


def test_the_probe_sizes_its_preset_for_the_device_it_runs_on():
    """probe.hw=auto: a drafter trained on a CPU is probed with the CPU tree, on a GPU with the GPU one."""
    assert (resolve_hw("auto", "cpu"), resolve_hw("auto", "cuda:0"), resolve_hw("cpu", "cuda:0")) == ("cpu", "gpu", "cpu")
    medusa = SimpleNamespace(kind="medusa", config=SimpleNamespace(num_heads=4))
    assert list(decode_preset("auto", medusa, "cpu").paths) == _raw("medusa-cpu")["paths"]
    assert decode_preset("auto", medusa, "gpu").name == "medusa-default"
    three = SimpleNamespace(kind="medusa", config=SimpleNamespace(num_heads=3))
    cut = decode_preset("auto", three, "gpu")
    assert cut.paths and max(map(len, cut.paths)) == 3 and cut.name == "medusa-default, paths cut to 3 heads"
    assert decode_preset("eagle-dynamic", None, "cpu").total_tokens == 8


def test_a_gpu_sized_tree_on_a_cpu_says_how_to_size_it(capsys):
    from draftsmith.decode.build import hint_hw

    hint_hw(compose_config("evaluate", ["decode=eagle-dynamic"]), "cpu")
    assert "decode=eagle-dynamic is sized for a GPU (hw=gpu, the default) and runs on the CPU: pass hw=cpu" \
        in capsys.readouterr().out
    for overrides, device in ((["decode=eagle-dynamic", "hw=cpu"], "cpu"), (["decode=eagle-dynamic"], "cuda:0"),
                              (["decode=eagle-chain"], "cpu")):
        hint_hw(compose_config("evaluate", overrides), device)
        assert capsys.readouterr().out == ""


def test_the_comparisons_pass_hw_to_every_decoding_run(tmp_path):
    """compare.py's cells and learning_curve.py's snapshots decode with the comparison's hw; a
    method's own hw= still wins."""
    from scripts.bench.compare import cell_config
    from scripts.bench.learning_curve import snapshot_config

    for hw, nodes in (("cpu", 8), ("gpu", 60)):
        cfg = compose_config("compare", [f"hw={hw}"])
        cell = cell_config(cfg, list(cfg.methods.eagle3), "mtbench", 0.0, tmp_path, hf=False)
        assert (cell.hw.name, cell.decode.name, cell.decode.total_tokens) == (hw, "eagle-dynamic", nodes)
        curve = compose_config("learning_curve", [f"hw={hw}"])
        snap = snapshot_config(curve, "eagle3", tmp_path / "snap", tmp_path / "out")
        assert (snap.hw.name, snap.decode.total_tokens) == (hw, nodes)
    cfg = compose_config("compare", ["hw=cpu"])
    assert cell_config(cfg, [*cfg.methods.eagle3, "hw=gpu"], "mtbench", 0.0, tmp_path, hf=False).decode.total_tokens == 60
