"""Build a training set from offline sources: load a data preset (e.g. data=mix: chit-chat +
ShareGPT, decontaminated against MT-bench and HumanEval), count its tokens per domain with the
verifier's tokenizer and chat template, and write it as one folder any trainer reads.

    python scripts/build_data.py data=mix                      # ~2.5k + 17k conversations
    python train/eagle.py method=eagle3 data=chat-jsonl data.path=outputs/data/mix-smollm2-135m

Writes output_dir/records.jsonl ({"id", "category", "messages"} per line) and manifest.json
({"counts": {category: {"conversations", "tokens", "assistant_tokens"}}, ...}: the tokens a
trainer sees, each conversation cut at data.max_length), atomically.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoTokenizer

from draftsmith.models.entry import launch
from draftsmith.models.sources import MANIFEST_FILE, RECORDS_FILE, even_cap, load_items
from draftsmith.models.verifier import apply_chat_template_setting, resolve_path
from draftsmith.train.core.data import tokenize_conversation


def run(cfg: DictConfig) -> dict:
    t0 = time.time()
    out_dir = Path(str(cfg.output_dir))
    items = even_cap(load_items(cfg.data), cfg.max_conversations)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg.model))
    apply_chat_template_setting(tokenizer, cfg.model)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"conversations": 0, "tokens": 0, "assistant_tokens": 0})
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (RECORDS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for item in tqdm(items, desc="build_data", unit="conv"):
            input_ids, labels = tokenize_conversation(item["messages"], tokenizer, cfg.data.get("max_length"))
            c = counts[item["category"]]
            c["conversations"] += 1
            c["tokens"] += len(input_ids)
            c["assistant_tokens"] += sum(label >= 0 for label in labels)
            f.write(json.dumps({"id": item["id"], "category": item["category"], "messages": item["messages"]},
                               ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / RECORDS_FILE)
    total = {k: sum(c[k] for c in counts.values()) for k in ("conversations", "tokens", "assistant_tokens")}
    manifest = {"kind": "built", "data": OmegaConf.to_container(cfg.data, resolve=True), "tokenizer": cfg.model.name,
                "counts": dict(counts), "total": total, "records_file": RECORDS_FILE, "format": "openai",
                "seconds": round(time.time() - t0, 1)}
    (out_dir / (MANIFEST_FILE + ".tmp")).write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(out_dir / (MANIFEST_FILE + ".tmp"), out_dir / MANIFEST_FILE)
    for name, c in sorted(counts.items()):
        print(f"build_data: {name}: {c['conversations']} conversations, {c['tokens']} tokens "
              f"({c['assistant_tokens']} assistant)")
    print(f"build_data: {total['conversations']} conversations, {total['tokens']} tokens in {out_dir} "
          f"({manifest['seconds']:.0f} s); train with data=chat-jsonl data.path={out_dir}", flush=True)
    return manifest


if __name__ == "__main__":
    launch("build_data", run)
