"""Run the frozen verifier once over the training data and write its features to disk.

    python scripts/prepare_features.py                                    # self-distilled data
    python scripts/prepare_features.py model=vicuna-7b-v1.3 data=sharegpt data.path=/data/sg.json
    python scripts/prepare_features.py layers='[2,15,27]' topk=32       # + EAGLE-3 layers, top-k logits
    accelerate launch scripts/prepare_features.py ...                     # shards split over processes
    python train/medusa.py data.features=outputs/data/features-smollm2-135m-selfdistill

Same tokenization and held-out split as the trainers (train/core/data.py), so training on
the features sees exactly the batches an online run sees. Shards are written to a temporary
name and renamed; rerunning skips finished shards (resume). Layout: train/core/features.py.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.sources import load_conversations
from draftsmith.models.verifier import DTYPES, load_verifier, resolve_layers
from draftsmith.train.core.accel import process_state
from draftsmith.train.core.data import collate_batch, split_heldout, tokenize_conversations
from draftsmith.train.core.features import MANIFEST, bytes_per_1k_tokens, shard_tensors


@torch.inference_mode()
def batch_features(verifier, input_ids, attention_mask, layers: list[int], topk: int) -> dict[str, torch.Tensor]:
    """{hidden (B, T, H), layer_hidden (B, T, L*H) if layers, topk_values/_indices (B, T, k) if topk}."""
    feats = verifier.features(input_ids, attention_mask, layers=layers)
    if topk:
        logits = verifier.lm_head(feats["hidden"])  # (B, T, V)
        values, indices = logits.topk(topk, dim=-1)  # (B, T, k)
        feats["topk_values"], feats["topk_indices"] = values, indices.to(torch.int32)
    return feats


def write_split(verifier, ds, out: Path, cfg, dtype, layers: list[int], state) -> dict:
    """Write one split's shards; shard i is done by process i % num_processes."""
    out.mkdir(parents=True, exist_ok=True)
    n_shards = (len(ds) + cfg.shard_size - 1) // cfg.shard_size
    mine = [i for i in range(n_shards) if i % state.num_processes == state.process_index]
    pad_id = verifier.tokenizer.pad_token_id
    for i in tqdm(mine, desc=f"features {out.name}", disable=not state.is_main_process):
        path = out / f"shard-{i:05d}.safetensors"
        if path.is_file():
            continue  # finished by an earlier run
        examples = [ds[j] for j in range(i * cfg.shard_size, min(len(ds), (i + 1) * cfg.shard_size))]
        features = []
        for b in range(0, len(examples), cfg.batch_size):
            chunk = examples[b:b + cfg.batch_size]
            batch = collate_batch(chunk, pad_id)
            feats = batch_features(verifier, batch["input_ids"].to(verifier.model.device),
                                   batch["attention_mask"].to(verifier.model.device), layers, cfg.topk)
            features += [{key: value[k, : len(ex["input_ids"])].to("cpu", dtype if value.is_floating_point() else None)
                          for key, value in feats.items()} for k, ex in enumerate(chunk)]
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        save_file(shard_tensors(examples, features), str(tmp))
        os.replace(tmp, path)
    return {"examples": len(ds), "tokens": int(sum(len(x) for x in ds["input_ids"])), "shards": n_shards}


def run(cfg: DictConfig) -> dict:
    state = process_state()
    dtype = choose(DTYPES, cfg.dtype, "dtype")
    out = Path(cfg.output_dir)
    verifier = load_verifier(cfg.model, device=state.device)
    layers = resolve_layers(cfg.layers, verifier.config.num_hidden_layers)
    if not 0 <= int(cfg.topk) <= verifier.config.vocab_size:
        raise DraftsmithError(f"topk={cfg.topk}: must be 0 (no logits) .. {verifier.config.vocab_size}")
    train_conv, eval_conv = split_heldout(load_conversations(cfg.data), cfg.data)
    splits = {"train": tokenize_conversations(train_conv, verifier.tokenizer, cfg.data.max_length),
              "eval": tokenize_conversations(eval_conv, verifier.tokenizer, cfg.data.max_length)}
    check_resume(out, cfg, layers, state)
    per_1k = bytes_per_1k_tokens(verifier.config.hidden_size, dtype, len(layers), int(cfg.topk))
    tokens = sum(int(sum(len(x) for x in ds["input_ids"])) for ds in splits.values())
    if state.is_main_process:
        print(f"features: {per_1k / 1e6:.2f} MB per 1k tokens ({cfg.dtype}, h={verifier.config.hidden_size}); "
              f"{tokens:,} tokens -> {tokens * per_1k / 1e9 / 1000:.3f} GB in {out}", flush=True)
    t0 = time.time()
    counts = {name: write_split(verifier, ds, out / name, cfg, dtype, layers, state) for name, ds in splits.items()}
    state.wait_for_everyone()
    manifest = {"verifier": {"name": verifier.name, "fingerprint": verifier.fingerprint}, "dtype": cfg.dtype,
                "hidden": "last", "layers": layers, "topk": int(cfg.topk), "num_hidden_layers":
                verifier.config.num_hidden_layers,
                "hidden_size": verifier.config.hidden_size, "vocab_size": verifier.config.vocab_size,
                "data": {"name": cfg.data.name, "path": cfg.data.get("path"), "max_length": cfg.data.max_length,
                         "eval_size": cfg.data.eval_size, "seed": cfg.data.seed},
                "splits": counts, "bytes_per_1k_tokens": per_1k, "complete": True}
    if state.is_main_process:
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        print(f"features: {counts['train']['examples']} train / {counts['eval']['examples']} held-out "
              f"conversations in {time.time() - t0:.0f}s -> {out}", flush=True)
    return manifest


def check_resume(out: Path, cfg, layers: list[int], state) -> None:
    """Refuse to mix shards of different content (layers, top-k, dtype) in one folder."""
    settings = {"layers": layers, "topk": int(cfg.topk), "dtype": cfg.dtype}
    path = out / "settings.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != settings:
            raise DraftsmithError(f"output_dir={out} holds features written with {old}, not {settings}; "
                                  f"pick another output_dir or delete that one")
    elif state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    state.wait_for_everyone()


if __name__ == "__main__":
    launch("prepare", run)
