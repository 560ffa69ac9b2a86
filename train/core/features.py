"""Offline verifier features: run the frozen verifier once, train many epochs without it.

Layout written by scripts/prepare_features.py:

    <dir>/manifest.json                  verifier name + fingerprint, dtype, hidden size, counts
    <dir>/<split>/shard-00000.safetensors
        input_ids (N,) int64, labels (N,) int64   N = tokens of the shard's examples, concatenated
        offsets (n+1,) int64                      example i is [offsets[i], offsets[i+1])
        hidden (N, H) <dtype>                     the verifier's final normed hidden state
        layer_hidden (N, L*H) <dtype>             only with layers=[...]: those layers' outputs,
                                                  concatenated (EAGLE-3 fusion input)
        topk_values (N, k) <dtype>, topk_indices (N, k) int32
                                                  only with topk=k: the verifier's k largest
                                                  next-token logits (soft distillation targets)

Shards are read with safetensors' lazy slices, so an epoch touches only the rows it uses.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from torch.utils.data import DataLoader, Dataset

from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import DTYPES, read_verifier_tensor
from draftsmith.train.core.data import LengthBucketBatchSampler, collate_batch

MANIFEST = "manifest.json"


FEATURE_KEYS = ("hidden", "layer_hidden", "topk_values", "topk_indices")  # per-token rows, padded by collate


def bytes_per_1k_tokens(hidden_size: int, dtype: torch.dtype, num_layers: int = 0, topk: int = 0) -> int:
    """Disk cost of 1,000 tokens: hidden (+ layer) rows, top-k logits, input id and label."""
    width = torch.finfo(dtype).bits // 8
    return 1000 * ((1 + num_layers) * hidden_size * width + topk * (width + 4) + 16)


def read_manifest(features_dir: str | Path) -> dict:
    path = Path(features_dir) / MANIFEST
    if not path.is_file():
        raise DraftsmithError(f"data.features={features_dir}: no {MANIFEST}; write it with "
                              f"python scripts/prepare_features.py (an interrupted run resumes)")
    manifest = json.loads(path.read_text())
    if not manifest.get("complete"):
        raise DraftsmithError(f"data.features={features_dir} is incomplete; rerun scripts/prepare_features.py "
                              f"with the same arguments to finish it")
    return manifest


class FeatureDataset(Dataset):
    """Examples of one split: {input_ids, labels, hidden (T, H)} plus `layer_hidden` (T, L*H)
    and `topk_values`/`topk_indices` (T, k) when the features hold them; `lengths` for bucketing."""

    def __init__(self, features_dir: str | Path, split: str):
        self.shards = sorted((Path(features_dir) / split).glob("shard-*.safetensors"))
        self.index: list[tuple[int, int, int]] = []  # (shard, start, end) per example
        self.keys: tuple[str, ...] = ()
        for s, path in enumerate(self.shards):
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                self.keys = tuple(k for k in FEATURE_KEYS if k in f.keys())
            self.index += [(s, a, b) for a, b in zip(offsets[:-1], offsets[1:])]
        self.lengths = [b - a for _, a, b in self.index]
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, s: int):
        if s not in self._open:
            self._open[s] = safe_open(str(self.shards[s]), framework="pt")
        return self._open[s]

    def __getitem__(self, i: int) -> dict:
        s, a, b = self.index[i]
        f = self._shard(s)
        example = {"input_ids": f.get_slice("input_ids")[a:b], "labels": f.get_slice("labels")[a:b]}  # (T,)
        example.update({key: f.get_slice(key)[a:b] for key in self.keys})  # (T, ...)
        return example

    def labels(self):
        """Every example's labels (T,), reading nothing else (for token statistics)."""
        for s, a, b in self.index:
            yield self._shard(s).get_slice("labels")[a:b]

    def __getstate__(self):  # DataLoader workers reopen the shards themselves
        return {**self.__dict__, "_open": {}}


def collate_features(examples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """collate_batch for the ids plus every feature row zero-padded to (B, T, ...)."""
    batch = collate_batch(examples, pad_id)
    T = batch["input_ids"].shape[1]
    for key in FEATURE_KEYS:
        if key not in examples[0]:
            continue
        first = examples[0][key]
        out = first.new_zeros((len(examples), T, *first.shape[1:]))  # (B, T, ...)
        for b, ex in enumerate(examples):
            out[b, : ex[key].shape[0]] = ex[key]
        batch[key] = out
    return batch


def make_feature_dataloader(ds: FeatureDataset, batch_size: int, shuffle: bool, seed: int,
                            drop_last: bool = False) -> DataLoader:
    sampler = LengthBucketBatchSampler(ds.lengths, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(ds, batch_sampler=sampler, collate_fn=collate_features)


@dataclass
class OfflineVerifier:
    """What a trainer needs of the verifier when features come from disk: no transformer body,
    only the tensors a drafter multiplies by, read from the verifier's checkpoint."""

    lm_head: torch.nn.Linear
    embed_tokens: torch.nn.Embedding | None
    fingerprint: str
    name: str
    config: SimpleNamespace


def offline_verifier(model_cfg, manifest: dict, embedding: bool = False) -> OfflineVerifier:
    """The lm_head (a tied one is the embedding) and, with `embedding`, the input embedding."""
    h, v = manifest["hidden_size"], manifest["vocab_size"]
    dtype = DTYPES[model_cfg.get("dtype", "float32")]
    weight = read_verifier_tensor(model_cfg, ("lm_head.weight", "model.embed_tokens.weight"), (v, h))
    lm_head = torch.nn.Linear(h, v, bias=False, dtype=dtype).requires_grad_(False)
    lm_head.weight.data.copy_(weight)
    embed = None
    if embedding:
        weight = read_verifier_tensor(model_cfg, ("model.embed_tokens.weight",), (v, h))
        embed = torch.nn.Embedding.from_pretrained(weight.float(), freeze=True)
    return OfflineVerifier(lm_head=lm_head, embed_tokens=embed, fingerprint=manifest["verifier"]["fingerprint"],
                           name=manifest["verifier"]["name"], config=SimpleNamespace(hidden_size=h, vocab_size=v))


def shard_tensors(examples: list[dict], features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One shard's tensors from tokenized examples and their per-token features ({key: (T_i, ...)})."""
    lengths = [len(ex["input_ids"]) for ex in examples]
    offsets = torch.tensor([0] + lengths).cumsum(0)  # (n+1,)
    out = {"input_ids": torch.tensor([t for ex in examples for t in ex["input_ids"]], dtype=torch.long),
           "labels": torch.tensor([t for ex in examples for t in ex["labels"]], dtype=torch.long),
           "offsets": offsets}
    for key in features[0]:
        out[key] = torch.cat([f[key] for f in features]).contiguous()  # (N, ...)
    return out
