"""Offline training data at scale: ShareGPT from PyPI (a torn JSON dump), mixing sources,
decontamination against the evaluation sets, and scripts/build_data.py on the real presets."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from draftsmith.models import sources
from draftsmith.models.sources import DataError, load_items, load_prompts

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = str(ROOT / "conf")


@pytest.fixture(scope="module")
def sharegpt():
    return load_items({"source": "sharegpt_package", "name": "sharegpt-pypi"})


def test_a_torn_json_array_keeps_its_complete_records(tmp_path):
    full = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} [x], {{y}}"}]} for i in range(5)]
    text = json.dumps(full, indent=2)
    path = tmp_path / "dump.json"
    path.write_text(text)
    assert sources.read_json_array_prefix(path) == full
    cut = text.index('"id": 4') - 5  # inside the fifth record
    path.write_text(text[:cut])
    assert sources.read_json_array_prefix(path) == full[:4]
    path.write_text("[]")
    assert sources.read_json_array_prefix(path) == []


def test_sharegpt_from_pypi_is_clean_and_large(sharegpt):
    assert len(sharegpt) > 15000
    assert len({i["id"] for i in sharegpt}) == len(sharegpt)
    assert {i["category"] for i in sharegpt} == {"sharegpt", "sharegpt-code"}
    code = sum(i["category"] == "sharegpt-code" for i in sharegpt)
    assert 0.1 < code / len(sharegpt) < 0.6
    for item in sharegpt[::211]:
        roles = [m["role"] for m in item["messages"]]
        assert roles[0] in ("user", "system") and "user" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # same-speaker turns were joined
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in item["messages"])
    assert sum(len(m["content"]) for i in sharegpt for m in i["messages"]) > 40_000_000  # characters


def test_decontamination_drops_what_shares_a_13_word_span_with_the_eval_sets():
    mtbench = load_prompts({"source": "mtbench"})
    question = mtbench[3]["messages"][0]["content"]
    words = sources._words(question)
    assert len(words) >= 13
    leaked = "Please help. " + " ".join(words[:13]).upper() + " thanks"  # case and punctuation do not hide it
    near = " ".join(words[:12]) + " zebra " + " ".join(words[13:20])  # no 13-word window survives
    items = [{"id": str(i), "category": "x", "messages": [{"role": "user", "content": text}]}
             for i, text in enumerate([leaked, near, "an ordinary question about cooking rice"])]
    kept, dropped = sources.decontaminated(items)
    assert dropped == 1 and [i["id"] for i in kept] == ["1", "2"]
    humaneval = load_prompts({"source": "humaneval"})[7]["messages"][0]["content"]
    code_leak = [{"id": "h", "category": "x", "messages": [{"role": "assistant", "content": humaneval}]}]
    assert sources.decontaminated(code_leak)[1] == 1


def test_mix_concatenates_parts_and_refuses_bad_ones():
    mixed = load_items({"source": "mix", "name": "mix", "parts": [
        {"name": "tiny", "source": "tiny", "max_items": 3}, {"name": "tiny2", "source": "tiny"}]})
    assert [i["id"] for i in mixed[:4]] == ["tiny-0", "tiny-1", "tiny-2", "tiny-0"] and len(mixed) == 15
    with pytest.raises(DataError, match=r"data.source='mix' needs data.parts"):
        load_items({"source": "mix", "name": "mix"})
    with pytest.raises(DataError, match=r"data.parts\[1\].path='x.jsonl' is ignored by data.parts\[1\].source='tiny'"):
        load_items({"source": "mix", "parts": [{"source": "tiny"}, {"source": "tiny", "path": "x.jsonl"}]})
    with pytest.raises(DataError, match=r"data.parts\[0\].source='mix': parts cannot nest"):
        load_items({"source": "mix", "parts": [{"source": "mix", "parts": [{"source": "tiny"}]}]})
    with pytest.raises(DataError, match=r"data.parts=.* is ignored by data.source='tiny'"):
        load_items({"source": "tiny", "parts": [{"source": "tiny"}]})


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.heavy
def test_build_data_on_the_mix_preset_is_over_a_million_tokens(tmp_path):
    """The documented build (python scripts/build_data.py data=mix), capped for time: the full
    mix is ~20k conversations; 2,000 of them evenly over both sources already exceed 1M tokens."""
    build = load_script("build_data")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("build_data", overrides=["max_conversations=2000", f"output_dir={tmp_path}"])
    assert cfg.data.name == "mix" and cfg.data.decontaminate
    manifest = build.run(cfg)
    counts = manifest["counts"]
    assert {"chitchat", "sharegpt", "sharegpt-code"} <= set(counts)
    assert manifest["total"]["tokens"] > 1_000_000 and manifest["total"]["conversations"] == 2000
    records = (tmp_path / "records.jsonl").read_text().split("\n")[:-1]  # not splitlines: U+2028 is in the text
    assert len(records) == 2000 and json.loads((tmp_path / "manifest.json").read_text())["total"] == manifest["total"]
    assert load_items({"source": "local", "path": str(tmp_path), "name": "built"})[0]["messages"]
