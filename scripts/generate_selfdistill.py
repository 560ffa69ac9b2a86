"""Self-distillation data: the verifier answers a prompt set itself, so drafters learn the
distribution they must match (also the re-training path after a verifier fine-tune).

    python scripts/generate_selfdistill.py                                  # chit-chat prompts
    python scripts/generate_selfdistill.py data@data.prompts=mtbench num_prompts=80
    python train/medusa.py data=selfdistill                                 # train on the result

Writes `output_dir/records.jsonl` ({"id", "category", "messages", "finish"} per line, appended
and fsynced after every batch) and `output_dir/manifest.json` (verifier name + fingerprint,
generation settings, counts). Rerunning the same command resumes: ids already in
records.jsonl are skipped and a torn last line is dropped. The folder loads with
`load_conversations({source: local, path: output_dir})`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from models.verifier import load_verifier
from train.core.cli import launch
from train.core.data import MANIFEST_FILE, RECORDS_FILE, DataError, load_prompts, render

# Settings that change what the answers look like: a resumed run must match them.
RESUME_KEYS = ("verifier_fingerprint", "dtype", "prompts", "max_new_tokens", "temperature", "top_p")


def prompt_config(cfg: DictConfig) -> DictConfig:
    """cfg.data.prompts with num_prompts taken from the top-level key."""
    if "prompts" not in cfg.data:
        raise DataError(f"data={cfg.data.get('name')!r} has no 'prompts' node; use data=selfdistill "
                        f"(prompt source: data@data.prompts=<preset>)")
    prompts = OmegaConf.to_container(cfg.data.prompts, resolve=True)
    prompts["num_prompts"] = cfg.num_prompts
    return OmegaConf.create(prompts)


def read_done_ids(records_path: Path) -> set[str]:
    """Ids already in records.jsonl. A torn tail (text after the last newline, or a last line
    that is not valid JSON) is cut off the file so appending continues cleanly."""
    if not records_path.is_file():
        return set()
    data = records_path.read_bytes()
    keep = data.rfind(b"\n") + 1  # bytes after the last newline are a torn write
    lines = data[:keep].split(b"\n")[:-1]
    ids, offset = set(), 0
    for lineno, line in enumerate(lines, start=1):
        try:
            if line.strip():
                ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            if lineno < len(lines):
                raise DataError(f"line {lineno} of {records_path} is not a record; delete that line "
                                f"and rerun to resume") from None
            keep = offset  # the last line is torn
        offset += len(line) + 1
    if keep < len(data):
        print(f"selfdistill: dropping a torn last line of {records_path} ({len(data) - keep} bytes)", flush=True)
        with open(records_path, "r+b") as f:
            f.truncate(keep)
    return ids


def check_resume(out_dir: Path, settings: dict) -> None:
    """Refuse to append to data made by another verifier or with other generation settings."""
    manifest_path = out_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        return
    before = json.loads(manifest_path.read_text()).get("settings", {})
    changed = [k for k in RESUME_KEYS if k in before and before[k] != settings[k]]
    if changed:
        diff = ", ".join(f"{k}: {before[k]!r} -> {settings[k]!r}" for k in changed)
        raise DataError(f"output_dir={str(out_dir)!r} holds data generated with other settings ({diff}); "
                        f"pass a fresh output_dir=... or delete that folder")


def write_manifest(out_dir: Path, verifier, settings: dict, counts: dict, complete: bool) -> None:
    manifest = {
        "kind": "selfdistill",
        "verifier": {"name": verifier.name, "fingerprint": verifier.fingerprint},
        "settings": settings,
        "counts": counts,
        "complete": complete,
        "records_file": RECORDS_FILE,
        "format": "openai",
    }
    tmp = out_dir / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out_dir / MANIFEST_FILE)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), T), dtype=torch.long)     # (B, T)
    for b, row in enumerate(rows):
        input_ids[b, T - len(row):] = torch.as_tensor(row, dtype=torch.long)
        attention_mask[b, T - len(row):] = 1
    return input_ids, attention_mask


def end_token_ids(verifier) -> list[int]:
    """The tokenizer's eos (the chat end-of-turn token) plus the model's generation eos ids."""
    ids = {verifier.tokenizer.eos_token_id}
    gen_eos = verifier.model.generation_config.eos_token_id
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def generate_answers(verifier, prompt_ids: list[list[int]], cfg: DictConfig) -> list[tuple[str, str, int]]:
    """(answer text, finish "stop"|"length", new tokens) per prompt, one left-padded batch."""
    tokenizer, model = verifier.tokenizer, verifier.model
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = end_token_ids(verifier)
    input_ids, attention_mask = left_pad(prompt_ids, pad_id)
    sampling = float(cfg.temperature) > 0
    kwargs = dict(max_new_tokens=int(cfg.max_new_tokens), do_sample=sampling, pad_token_id=pad_id,
                  eos_token_id=eos_ids)
    if sampling:
        kwargs.update(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=0)
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         **kwargs)
    new_tokens = out[:, input_ids.shape[1]:].tolist()  # (B, <= max_new_tokens)
    answers = []
    for row in new_tokens:
        stop = next((t for t, tok in enumerate(row) if tok in eos_ids), None)
        kept = row if stop is None else row[:stop]
        answers.append((tokenizer.decode(kept, skip_special_tokens=True), "length" if stop is None else "stop",
                        len(kept)))
    return answers


def run(cfg: DictConfig) -> dict:
    out_dir = Path(str(cfg.output_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / RECORDS_FILE
    prompts_cfg = prompt_config(cfg)
    prompts = load_prompts(prompts_cfg)  # fail on a bad prompt source before loading the model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier = load_verifier(cfg.model, device=device)
    settings = {
        "verifier_fingerprint": verifier.fingerprint,
        "dtype": str(cfg.model.get("dtype", "float32")),
        "prompts": {"name": prompts_cfg.get("name"), "source": prompts_cfg.get("source")},
        "max_new_tokens": int(cfg.max_new_tokens),
        "temperature": float(cfg.temperature),
        "top_p": float(cfg.top_p),
        "seed": int(cfg.seed),
        "batch_size": int(cfg.batch_size),
    }
    check_resume(out_dir, settings)
    done = read_done_ids(records_path)
    todo = [p for p in prompts if p["id"] not in done]
    counts = {"prompts": len(prompts), "resumed": len(done), "generated": 0, "truncated": 0,
              "records": len(done)}
    write_manifest(out_dir, verifier, settings, counts, complete=False)

    # Longest prompts first: batches of similar length waste little padding, and a memory
    # problem shows up in the first batch.
    tokenizer = verifier.tokenizer
    encoded = [(p, tokenizer(render(tokenizer, p["messages"], add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) for p in todo]
    long = [p["id"] for p, ids in encoded if len(ids) > int(cfg.max_prompt_tokens)]
    if long:  # a single very long prompt would pad its whole batch (and rarely fits data.max_length)
        print(f"selfdistill: skipping {len(long)} prompts longer than max_prompt_tokens={cfg.max_prompt_tokens}")
        encoded = [(p, ids) for p, ids in encoded if len(ids) <= int(cfg.max_prompt_tokens)]
    counts["skipped_long"] = len(long)
    encoded.sort(key=lambda pair: -len(pair[1]))
    torch.manual_seed(int(cfg.seed))
    new_tokens, t0 = 0, time.time()
    with open(records_path, "a", encoding="utf-8") as f, \
            tqdm(total=len(encoded), desc="selfdistill", unit="prompt") as bar:
        for start in range(0, len(encoded), int(cfg.batch_size)):
            batch = encoded[start:start + int(cfg.batch_size)]
            answers = generate_answers(verifier, [ids for _, ids in batch], cfg)
            for (prompt, _), (text, finish, n_new) in zip(batch, answers):
                record = {"id": prompt["id"], "category": prompt["category"],
                          "messages": prompt["messages"] + [{"role": "assistant", "content": text}],
                          "finish": finish}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                counts["truncated"] += finish == "length"
                new_tokens += n_new
            f.flush()
            os.fsync(f.fileno())
            counts["generated"] += len(batch)
            counts["records"] += len(batch)
            bar.update(len(batch))
    seconds = time.time() - t0
    write_manifest(out_dir, verifier, settings, counts, complete=True)
    tok_s = new_tokens / seconds if seconds > 0 else 0.0
    print(f"selfdistill: {counts['records']} records in {out_dir} ({counts['generated']} generated now, "
          f"{counts['resumed']} resumed, {counts['truncated']} hit max_new_tokens={cfg.max_new_tokens}); "
          f"{new_tokens} new tokens at {tok_s:.1f} tok/s; verifier {verifier.name} {verifier.fingerprint}",
          flush=True)
    return {"output_dir": str(out_dir), **counts, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": tok_s, "verifier": verifier.name, "fingerprint": verifier.fingerprint}


if __name__ == "__main__":
    launch("selfdistill", run)
