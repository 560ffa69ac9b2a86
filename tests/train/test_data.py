"""models/sources.py and train/core/data.py: sources, schemas, errors, assistant-only masks, splits, batching."""
from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from draftsmith.models.sources import SOURCES, DataError, load_conversations, load_prompts
from draftsmith.models.vocab import IGNORE_INDEX
from draftsmith.train.core.data import (
    LengthBucketBatchSampler,
    check_data_verifier,
    make_dataloader,
    padding_fraction,
    split_heldout,
    tokenize_conversation,
    tokenize_conversations,
)

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
COMMON_KEYS = {"name", "source", "path", "hf_name", "hf_split", "format", "max_length", "eval_size",
               "num_prompts", "seed"}

CONV = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How are you?"},
    {"role": "user", "content": "Fine, and you?"},
    {"role": "assistant", "content": "Great.\n\nThanks for asking."},
]
SHAREGPT = {"id": "c1", "conversations": [
    {"from": "system", "value": "Be nice."}, {"from": "human", "value": "Hi there"},
    {"from": "gpt", "value": "Hello! How are you?"}, {"from": "human", "value": "Fine, and you?"},
    {"from": "gpt", "value": "Great.\n\nThanks for asking."}]}
OPENAI = {"id": "c1", "messages": CONV}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def labelled_runs(input_ids, labels) -> list[list[int]]:
    """Contiguous runs of labelled tokens (each should be one assistant turn)."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# ---------------------------------------------------------------------------------------- schemas

def test_sharegpt_and_openai_load_to_the_same_messages(tmp_path):
    sharegpt_file = tmp_path / "sharegpt.json"
    sharegpt_file.write_text(json.dumps([SHAREGPT, SHAREGPT]))
    openai_file = write_jsonl(tmp_path / "openai.jsonl", [OPENAI, OPENAI])
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([OPENAI, OPENAI]).save_to_disk(str(saved))
    records_dir = tmp_path / "records"
    records_dir.mkdir()
    write_jsonl(records_dir / "records.jsonl", [SHAREGPT, OPENAI])

    loaded = [load_conversations({"source": "local", "path": str(p), "format": fmt})
              for p, fmt in [(sharegpt_file, "auto"), (sharegpt_file, "sharegpt"), (openai_file, "auto"),
                             (openai_file, "openai"), (saved, "auto"), (records_dir, "auto")]]
    for ds in loaded:
        assert ds.column_names == ["messages"]
        assert len(ds) == 2
        assert ds[0]["messages"] == CONV and ds[1]["messages"] == CONV


@pytest.mark.parametrize("record, field, message", [
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
     "conversations[1].from", "is 'bot', expected one of human/gpt/system"),
    ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value", "expected a string"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
     "messages[1].role", "expected one of system/user/assistant"),
    ({"messages": []}, "messages", "expected a non-empty list"),
    ({"text": "hello"}, None, "neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)"),
])
def test_malformed_record_gives_one_line_error_naming_it(tmp_path, record, field, message):
    path = write_jsonl(tmp_path / "data.jsonl", [OPENAI, SHAREGPT, record])
    with pytest.raises(ValueError) as err:
        load_conversations({"source": "local", "path": str(path)})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("record 2 of ") and "data.jsonl" in text and message in text
    if field:
        assert f"'{field}'" in text


def test_forced_format_rejects_the_other_schema_and_bad_json(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [OPENAI])
    with pytest.raises(ValueError, match=r"record 0 of .*'conversations' is None"):
        load_conversations({"source": "local", "path": str(path), "format": "sharegpt"})
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(OPENAI) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"^line 2 of .*broken.jsonl: invalid JSON"):
        load_conversations({"source": "local", "path": str(broken)})


def test_unknown_keys_fail_listing_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        load_conversations({"source": "s3"})
    assert "data.source='s3'" in str(err.value)
    for key in SOURCES:
        assert key in str(err.value)
    assert set(SOURCES) == {"local", "hf", "chitchat", "mtbench", "humaneval", "tiny", "sharegpt_package", "mix",
                            "python_stdlib"}
    path = write_jsonl(tmp_path / "data.jsonl", [OPENAI])
    with pytest.raises(ValueError, match="data.format='alpaca' is not known; valid: auto, openai, sharegpt"):
        load_conversations({"source": "local", "path": str(path), "format": "alpaca"})
    with pytest.raises(ValueError, match="does not exist"):
        load_conversations({"source": "local", "path": str(tmp_path / "nope.jsonl")})


def test_hf_source_fails_offline_in_one_line(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/ultrachat_200k' on the Hub (OfflineModeIsEnabled)\nmore")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as err:
        load_conversations({"source": "hf", "hf_name": "HuggingFaceH4/ultrachat_200k", "hf_split": "train_sft"})
    assert "\n" not in str(err.value) and "data.hf_name='HuggingFaceH4/ultrachat_200k'" in str(err.value)


def test_hf_source_normalises_records(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: datasets.Dataset.from_list([SHAREGPT]))
    ds = load_conversations({"source": "hf", "hf_name": "org/sharegpt", "hf_split": "train"})
    assert ds[0]["messages"] == CONV


# ---------------------------------------------------------------------------------------- tokenization

def test_rendering_matches_the_chat_template(tokenizer):
    input_ids, labels = tokenize_conversation(CONV, tokenizer)
    assert input_ids == list(tokenizer.apply_chat_template(CONV, tokenize=True)["input_ids"])
    assert len(labels) == len(input_ids)
    text = tokenizer.decode(input_ids)
    assert text == tokenizer.apply_chat_template(CONV, tokenize=False)
    no_system = CONV[1:]
    assert tokenizer.decode(tokenize_conversation(no_system, tokenizer)[0]).startswith(
        "<|im_start|>system\nYou are tiny.<|im_end|>\n<|im_start|>user\nHi there")


@pytest.mark.parametrize("messages", [
    CONV,
    CONV[1:],  # default system turn from the template
    [{"role": "user", "content": "assistant"}, {"role": "assistant", "content": "user"},
     {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],  # contents equal to role names, empty
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  spaced  "},
     {"role": "user", "content": "x"}],
] + [item["messages"] for item in SOURCES["tiny"]({})])
def test_assistant_masks_are_exact(tokenizer, messages):
    input_ids, labels = tokenize_conversation(messages, tokenizer)
    runs = labelled_runs(input_ids, labels)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == [c + "<|im_end|>" for c in assistant]
    # everything else (system, user, headers, the newline after <|im_end|>) is unlabelled
    unlabelled = "".join(tokenizer.decode([t]) for t, lab in zip(input_ids, labels) if lab == IGNORE_INDEX)
    rendered = tokenizer.apply_chat_template(
        [m for m in messages[: max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]],
        tokenize=False)
    assert len(unlabelled) == len(rendered) - sum(len(c) + len("<|im_end|>") for c in assistant)
    assert input_ids[-1] == tokenizer.convert_tokens_to_ids("\n") and labels[-1] == IGNORE_INDEX


def test_masks_with_a_template_that_trims_content(tokenizer):
    trimming = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>")
    trimming.chat_template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                              "message['content'] | trim + '<|im_end|>\n' }}{% endfor %}")
    messages = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": " hello there \n"}]
    input_ids, labels = tokenize_conversation(messages, trimming)
    assert [trimming.decode(r) for r in labelled_runs(input_ids, labels)] == ["hello there<|im_end|>"]


def test_tokenize_conversations_truncates_and_drops(tokenizer):
    long_user = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]
    prompt_only = [{"role": "user", "content": "no answer"}]
    ds = datasets.Dataset.from_dict({"messages": [CONV, long_user, prompt_only, CONV[1:3] + CONV[3:4]]})
    tok = tokenize_conversations(ds, tokenizer, max_length=64)
    assert set(tok.column_names) == {"input_ids", "labels", "length"}
    assert len(tok) == 2  # long_user lost its answer to truncation, prompt_only has none
    for ex in tok:
        assert len(ex["input_ids"]) == len(ex["labels"]) == ex["length"] <= 64
        assert any(label != IGNORE_INDEX for label in ex["labels"])
    full_ids, full_labels = tokenize_conversation(CONV, tokenizer)
    assert tok[0]["input_ids"] == full_ids[:64] and tok[0]["labels"] == full_labels[:64]
    # a trailing user turn is dropped before rendering: it carries no loss
    assert tok[1]["input_ids"] == tokenize_conversation(CONV[1:3], tokenizer, max_length=64)[0]


# ---------------------------------------------------------------------------------------- split + batching

def test_split_heldout_is_disjoint_and_deterministic():
    ds = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": str(i)}] for i in range(50)]})
    cfg = {"eval_size": 7, "seed": 3}
    train, held = split_heldout(ds, cfg)
    ids = lambda d: [m[0]["content"] for m in d["messages"]]  # noqa: E731
    assert len(held) == 7 and len(train) == 43
    assert not set(ids(train)) & set(ids(held)) and set(ids(train)) | set(ids(held)) == set(ids(ds))
    train2, held2 = split_heldout(ds, cfg)
    assert ids(held2) == ids(held) and ids(train2) == ids(train)
    assert ids(split_heldout(ds, {"eval_size": 7, "seed": 4})[1]) != ids(held)
    assert len(split_heldout(ds, {"eval_size": 0, "seed": 0})[1]) == 0
    with pytest.raises(ValueError, match="data.eval_size=50") as err:
        split_heldout(ds, {"eval_size": 50, "seed": 0, "name": "chitchat"})
    assert "lower data.eval_size" in str(err.value) and "data=chitchat" in str(err.value)
    with pytest.raises(ValueError, match="generate_selfdistill.py num_prompts=N"):  # too few answers yet
        split_heldout(ds, {"eval_size": 50, "seed": 0, "name": "selfdistill"})


def test_eval_size_auto_fits_any_size_and_an_explicit_size_that_cannot_fit_is_refused(capsys):
    """data.eval_size=auto (chat-jsonl's and selfdistill's default): a tenth, 1..64, printed; an
    explicit number is kept, and refused when it does not fit (never shrunk behind the user's back)."""
    def convs(n):
        return datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": str(i)}] for i in range(n)]})

    for n, held in ((40, 4), (5, 1), (2, 1), (639, 63), (5000, 64)):
        train, eval_ = split_heldout(convs(n), {"eval_size": "auto", "seed": 0, "name": "chat-jsonl"})
        assert (len(train), len(eval_)) == (n - held, held), n
    assert "data.eval_size=auto: 4 of the 40 conversations of data=chat-jsonl held out" in capsys.readouterr().out
    assert len(split_heldout(convs(40), {"eval_size": 10, "seed": 0})[1]) == 10
    with pytest.raises(DataError, match=r"data.eval_size=64 must be in \[0, 40\).*or data.eval_size=auto"):
        split_heldout(convs(40), {"eval_size": 64, "seed": 0, "name": "chat-jsonl"})
    with pytest.raises(DataError, match="has 1 conversation"):
        split_heldout(convs(1), {"eval_size": "auto", "seed": 0, "name": "chat-jsonl"})
    with pytest.raises(DataError, match="data.eval_size='most': a number of conversations >= 0, or auto"):
        split_heldout(convs(40), {"eval_size": "most", "seed": 0})


def test_split_heldout_follows_the_prompts_not_the_positions():
    """Re-answered prompts in another order (a refresh's re-generated data) are held out again,
    and conversations sharing a prompt fall on the same side."""
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"old answer {i}"}]
             for i in range(60)]
    ds = datasets.Dataset.from_dict({"messages": convs})
    cfg = {"eval_size": 8, "seed": 0}
    prompts = lambda d: sorted(m[0]["content"] for m in d["messages"])  # noqa: E731
    held = prompts(split_heldout(ds, cfg)[1])
    new = [[c[0], {"role": "assistant", "content": f"new answer to {c[0]['content']}"}] for c in reversed(convs)]
    in_order = lambda d: [m[0]["content"] for m in d["messages"]]  # noqa: E731
    assert in_order(split_heldout(datasets.Dataset.from_dict({"messages": new}), cfg)[1]) == in_order(
        split_heldout(ds, cfg)[1])  # the same prompts, in the same (rank) order: the probe takes the first ones
    assert held != sorted(f"q{i}" for i in range(8))  # not the first positions
    twice = datasets.Dataset.from_dict({"messages": convs + new})
    train, held2 = split_heldout(twice, {"eval_size": 16, "seed": 0})
    assert prompts(held2) == sorted(held * 2) and not set(prompts(train)) & set(held)


def mixed_length_dataset(n=400, seed=0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.8, rng.integers(5, 40, n), rng.integers(100, 400, n))
    ids = [rng.integers(4, 100, int(k)).tolist() for k in lengths]
    labels = [[IGNORE_INDEX] * (len(x) // 2) + x[len(x) // 2:] for x in ids]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "length": [len(x) for x in ids]})


def test_bucketing_reduces_padding_and_collates_right():
    ds = mixed_length_dataset()
    bucketed = make_dataloader(ds, batch_size=8, pad_id=1, shuffle=True, seed=0, chunk_batches=16)
    plain = make_dataloader(ds, batch_size=8, pad_id=1, shuffle=True, seed=0, bucket=False)
    frac_bucketed, frac_plain = padding_fraction(bucketed), padding_fraction(plain)
    assert frac_bucketed < 0.25 and frac_bucketed < frac_plain / 3

    seen, real, total = [], 0, 0
    for batch in bucketed:
        B, T = batch["input_ids"].shape
        assert batch["labels"].shape == batch["attention_mask"].shape == (B, T) and B <= 8
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
        lengths = batch["attention_mask"].sum(1)
        assert int(lengths.max()) == T
        pad = batch["attention_mask"] == 0
        assert (batch["input_ids"][pad] == 1).all() and (batch["labels"][pad] == IGNORE_INDEX).all()
        real, total = real + int(lengths.sum()), total + B * T
        seen += batch["input_ids"][:, 0].tolist()
    assert len(seen) == len(ds)
    assert abs((1 - real / total) - frac_bucketed) < 1e-9  # the lengths-only estimate is exact


def test_batches_are_deterministic_reshuffled_per_epoch_and_cover_everything():
    lengths = mixed_length_dataset()["length"]
    a = LengthBucketBatchSampler(lengths, batch_size=8, shuffle=True, seed=5, chunk_batches=4)
    b = LengthBucketBatchSampler(lengths, batch_size=8, shuffle=True, seed=5, chunk_batches=4)
    first = list(a)
    assert first == list(b) and a.epoch == 1
    second = list(a)
    assert second != first
    assert sorted(i for batch in second for i in batch) == list(range(len(lengths)))
    b.set_epoch(1)
    assert list(b) == second
    assert len(a) == len(first) == 50
    assert len(LengthBucketBatchSampler(lengths[:17], 8, drop_last=True)) == len(
        list(LengthBucketBatchSampler(lengths[:17], 8, drop_last=True))) == 2


def test_dataloader_works_with_accelerate_prepare():
    from accelerate import Accelerator

    ds = mixed_length_dataset(n=37)
    loader = make_dataloader(ds, batch_size=4, pad_id=0, shuffle=True, seed=0)
    prepared = Accelerator(cpu=True).prepare(loader)
    batches = list(prepared)
    assert len(batches) == len(loader) == 10
    assert sum(b["input_ids"].shape[0] for b in batches) == 37
    assert padding_fraction(prepared) < 0.3


def test_tiny_pipeline_end_to_end(tokenizer):
    cfg = {"source": "tiny", "name": "tiny", "eval_size": 2, "seed": 0}
    train, held = split_heldout(load_conversations(cfg), cfg)
    tok = tokenize_conversations(train, tokenizer, max_length=256)
    loader = make_dataloader(tok, batch_size=4, pad_id=tokenizer.pad_token_id, shuffle=True, seed=0)
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 4 and (batch["labels"] != IGNORE_INDEX).any()
    assert len(tok) == 10 and len(held) == 2
    empty = tokenize_conversations(split_heldout(train, {"eval_size": 0})[1], tokenizer, max_length=256)
    assert empty.column_names == ["input_ids", "labels", "length"] and len(empty) == 0
    assert list(make_dataloader(empty, 4, pad_id=0, shuffle=False, seed=0)) == []


# ---------------------------------------------------------------------------------------- prompt sources

@pytest.fixture(scope="module")
def chitchat():
    return load_conversations({"source": "chitchat", "name": "chitchat"})


def test_chitchat_conversations(chitchat):
    assert len(chitchat) > 7000
    for messages in chitchat.select(range(0, len(chitchat), 97))["messages"]:
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)
        assert all(m["content"].strip() == m["content"] and m["content"] for m in messages)


def check_prompt(prompt):
    assert set(prompt) == {"id", "category", "messages"}
    assert isinstance(prompt["id"], str) and isinstance(prompt["category"], str)
    assert prompt["messages"][-1]["role"] == "user" and prompt["messages"][-1]["content"].strip()
    assert all(m["role"] in ("system", "user") for m in prompt["messages"])


def test_prompt_loaders_counts_and_shape():
    mtbench = load_prompts({"source": "mtbench", "name": "mtbench"})
    assert len(mtbench) == 80 and len({p["id"] for p in mtbench}) == 80
    assert {p["category"] for p in mtbench} == {"writing", "roleplay", "reasoning", "math", "coding",
                                                "extraction", "stem", "humanities"}
    assert all(len(p["messages"]) == 1 for p in mtbench)
    humaneval = load_prompts({"source": "humaneval", "name": "humaneval"})
    assert len(humaneval) == 164 and humaneval[0]["id"] == "HumanEval/0"
    assert "def has_close_elements" in humaneval[0]["messages"][0]["content"]
    assert len(load_conversations({"source": "humaneval"})) == 164
    assert load_prompts({"source": "mtbench", "num_prompts": 5}) == mtbench[:5]
    for prompt in mtbench + humaneval + load_prompts({"source": "tiny"}):
        check_prompt(prompt)
    tiny = load_prompts({"source": "tiny"})
    assert tiny[2]["messages"][0]["role"] == "system" and len(tiny[2]["messages"]) == 2


def test_chitchat_prompts():
    prompts = load_prompts({"source": "chitchat", "name": "chitchat", "num_prompts": None})
    assert 4000 < len(prompts) < 7168  # exact duplicate first turns dropped
    assert len({json.dumps(p["messages"]) for p in prompts}) == len(prompts)
    for prompt in prompts[::50]:
        check_prompt(prompt)


# ---------------------------------------------------------------------------------------- configs

DATA_PRESETS = sorted(p.stem for p in (Path(CONF_DIR) / "data").glob("*.yaml"))


def test_data_presets_compose_with_common_keys():
    assert {"tiny", "selfdistill", "chat-jsonl", "sharegpt", "ultrachat", "mtbench", "humaneval",
            "chitchat"} <= set(DATA_PRESETS)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for preset in DATA_PRESETS:
            assert (Path(CONF_DIR) / "data" / f"{preset}.yaml").read_text().startswith("# python ")
            cfg = compose("selfdistill", overrides=[f"data={preset}"])
            assert COMMON_KEYS <= set(cfg.data), preset
            assert cfg.data.source in SOURCES and cfg.data.name == preset
        cfg = compose("selfdistill", overrides=["data=tiny"])
        assert len(load_conversations(cfg.data)) == 12
        cfg = compose("selfdistill", overrides=["data=chat-jsonl"])
        with pytest.raises(ValueError, match="data.path is not set"):
            load_conversations(cfg.data)


def test_check_data_verifier_warns_on_another_verifier(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"verifier": {"name": "v", "fingerprint": "abc"}}))
    cfg = {"source": "local", "path": str(tmp_path)}
    assert check_data_verifier(cfg, "abc") is None
    with pytest.warns(UserWarning, match="generated by verifier 'v'"):
        assert "fingerprint abc" in check_data_verifier(cfg, "xyz")
    assert check_data_verifier({"source": "tiny"}, "xyz") is None


def test_the_stdlib_source_documents_the_running_python_from_its_own_source():
    import ast
    import sysconfig

    from omegaconf import OmegaConf

    from draftsmith.models.sources import load_items

    items = load_items(OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "data" / "python-stdlib.yaml"))
    assert len(items) > 500 and len({i["id"] for i in items}) == len(items)
    by_id = {i["id"]: i for i in items}
    json_dumps = by_id["stdlib-json.dumps"]["messages"]
    assert json_dumps[0] == {"role": "user", "content": "Explain `json.dumps` from the Python standard library."}
    source = ast.parse((Path(sysconfig.get_paths()["stdlib"]) / "json" / "__init__.py").read_text())
    doc = ast.get_docstring(next(n for n in source.body if getattr(n, "name", None) == "dumps"))
    assert json_dumps[1]["content"].startswith("`json.dumps(obj, *, skipkeys=False") and json_dumps[1]["content"].endswith(doc)
    assert not any(i["id"].startswith(("stdlib-test.", "stdlib-antigravity", "stdlib-idlelib")) for i in items)
