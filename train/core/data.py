"""Chat data for drafter training: held-out split, assistant-only labels, batching.

Conversations come from draftsmith.models.sources (every `data.source`); here they are split
into train / held-out, rendered with the verifier's chat template and tokenized with loss only
on assistant tokens (content + the end-of-turn token), then batched by length.

    convs = load_conversations(cfg.data)                      # draftsmith.models.sources
    train_convs, eval_convs = split_heldout(convs, cfg.data)  # eval is never trained on
    train_tok = tokenize_conversations(train_convs, tokenizer, cfg.data.max_length)
    loader = make_dataloader(train_tok, batch_size=8, pad_id=tokenizer.pad_token_id,
                             shuffle=True, seed=cfg.data.seed)
"""
from __future__ import annotations

import bisect
import hashlib
import json
import warnings
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

from draftsmith.models.sources import MANIFEST_FILE, DataError, cfg_value, render
from draftsmith.models.vocab import IGNORE_INDEX


def split_heldout(ds: datasets.Dataset, data_cfg) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval): the `data.eval_size` conversations whose prompts rank first under a hash
    seeded with `data.seed`, the rest train.

    A conversation's rank depends only on its prompt (the messages before its first assistant
    turn) and the seed, never on its position, so the split holds across runs, resumes, record
    orders and re-generated answers: a refresh that re-answers the same prompts with a new
    verifier (scripts/refresh.py) holds out the same prompts, and the probe recorded from the
    old held-out split is never trained on. Conversations sharing a prompt rank together.
    Split BEFORE tokenizing (tokenization may drop some). Train keeps the original order; eval
    comes in rank order, so its first k conversations (the probe's prompts) are the same k
    whatever order the records were written in.
    """
    eval_size = held_out_count(cfg_value(data_cfg, "eval_size"), len(ds), cfg_value(data_cfg, "name") or "?")
    seed = int(cfg_value(data_cfg, "seed") or 0)
    ranks = [split_rank(messages, seed) for messages in ds["messages"]]
    order = sorted(range(len(ds)), key=lambda i: (ranks[i], i))
    eval_idx, train_idx = order[:eval_size], sorted(order[eval_size:])
    return ds.select(train_idx), ds.select(eval_idx)


EVAL_AUTO = (10, 1, 64)  # data.eval_size=auto: a tenth of the conversations, at least 1, at most 64


def held_out_count(eval_size, n: int, name: str) -> int:
    """How many of the n conversations data.eval_size holds out: a number, or `auto` (EVAL_AUTO:
    a tenth, 1..64, so that a small file of your own trains as it is). A number that does not fit
    is refused, never shrunk."""
    if eval_size == "auto":
        share, low, high = EVAL_AUTO
        if n < 2:
            raise DataError(f"data={name} has {n} conversation(s): data.eval_size=auto holds out at least 1 and "
                            f"trains on the rest; give it more conversations")
        count = min(high, max(low, n // share))
        print(f"data.eval_size=auto: {count} of the {n} conversations of data={name} held out (a tenth, "
              f"{low}..{high}; set data.eval_size=N to choose)")
        return count
    if isinstance(eval_size, bool) or not isinstance(eval_size, int | None):
        raise DataError(f"data.eval_size={eval_size!r}: a number of conversations >= 0, or auto")
    eval_size = int(eval_size or 0)
    if eval_size < 0 or eval_size >= n:
        more = ("; self-distilled data grows with scripts/generate_selfdistill.py num_prompts=N (it resumes)"
                if str(name).startswith("selfdistill") else "")
        raise DataError(f"data.eval_size={eval_size} must be in [0, {n}) for the {n} conversations of "
                        f"data={name}: lower data.eval_size (or data.eval_size=auto) or give it more conversations{more}")
    return eval_size


def split_rank(messages: list[dict], seed: int) -> bytes:
    """The held-out rank of a conversation: a seeded hash of its prompt (the messages before its
    first assistant turn; the whole conversation when it has none)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:first]] or list(messages)
    key = json.dumps([seed, prompt], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def next_token_positions(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions t whose next token t+1 is supervised (where the verifier's law,
    or the next token, is trained)."""
    pos = torch.zeros_like(labels, dtype=torch.bool)
    pos[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return pos


# ----------------------------------------------------------------------------------------
# Tokenization with assistant-only labels

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
    path = cfg_value(data_cfg, "path") if cfg_value(data_cfg, "source") == "local" else None
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
    message = (f"data at {cfg_value(data_cfg, 'path')} was generated by verifier {made_by.get('name')!r} "
               f"(fingerprint {made_by['fingerprint']}), not this one ({fingerprint}); "
               f"regenerate it with scripts/generate_selfdistill.py")
    warnings.warn(message, stacklevel=2)
    return message

