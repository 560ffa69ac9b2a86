"""Self-distillation data: the verifier answers a prompt set itself, so drafters learn the
distribution they must match (also the re-training path after a verifier fine-tune).

    python scripts/generate_selfdistill.py                                  # chit-chat prompts
    python scripts/generate_selfdistill.py data@data.prompts=mtbench num_prompts=80
    accelerate launch --num_processes 8 scripts/generate_selfdistill.py     # prompts split over 8 GPUs
    python scripts/generate_selfdistill.py backend=transformers batch_size=16   # HF generate, static batches
    python scripts/generate_selfdistill.py backend=vllm vllm.tensor_parallel_size=4   # vLLM (GPU)
    python train/medusa.py data=selfdistill                                 # train on the result

backend=batched (the default) is draftsmith's continuous batching (decode/batch.py): up to
batch_size rows decode in one forward, a finished row leaves and the next prompt joins.

Writes `output_dir/records.jsonl` ({"id", "category", "messages", "finish"} per line, appended
and fsynced as each answer finishes) and `output_dir/manifest.json` (verifier name + fingerprint,
generation settings, counts). Rerunning the same command resumes: ids already in
records.jsonl are skipped and a torn last line is dropped. With N processes each writes
`parts/records.<rank>.jsonl`; process 0 merges them into records.jsonl at the end (an
interrupted run resumes from the parts, with any process count). The folder loads with
`load_conversations({source: local, path: output_dir})`.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from draftsmith.decode import batch
from draftsmith.decode.sampling import SamplingParams
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import CONF_DIR, launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.sources import MANIFEST_FILE, RECORDS_FILE, DataError, load_prompts, read_jsonl, render
from draftsmith.models.verifier import load_verifier
from draftsmith.train.core.accel import process_state

BACKENDS = {"batched": "batched", "transformers": "transformers", "vllm": "vllm"}
PARTS_DIR = "parts"  # per-process records of a multi-process run, merged into records.jsonl at the end

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
    write_atomic_text(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")


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


def answer(tokenizer, row: list[int], eos_ids: list[int]) -> tuple[str, str, int]:
    """New tokens -> (answer text, finish "stop"|"length", tokens kept): cut at the first end token."""
    stop = next((t for t, tok in enumerate(row) if tok in eos_ids), None)
    kept = row if stop is None else row[:stop]
    return tokenizer.decode(kept, skip_special_tokens=True), "length" if stop is None else "stop", len(kept)


def in_batches(generate_batch_, batch_size: int):
    """A `generate(prompt_ids)` yielding (index, answer) from a function that answers one static batch."""
    def generate(prompt_ids: list[list[int]]):
        for start in range(0, len(prompt_ids), batch_size):
            yield from enumerate(generate_batch_(prompt_ids[start:start + batch_size]), start=start)
    return generate


def generate_batched(cfg: DictConfig, verifier, generator: torch.Generator):
    """draftsmith's continuous batching (decode.batch): answers stream out as rows finish."""
    eos_ids = end_token_ids(verifier)
    params = SamplingParams(temperature=float(cfg.temperature), top_p=float(cfg.top_p))

    def generate(prompt_ids: list[list[int]]):
        for i, tokens, _ in batch.generate_batch(verifier.model, prompt_ids, max_new_tokens=int(cfg.max_new_tokens),
                                                  eos=eos_ids, params=params, batch_size=int(cfg.batch_size),
                                                  generator=generator):
            yield i, answer(verifier.tokenizer, tokens, eos_ids)
    return generate


@torch.no_grad()
def generate_answers(verifier, prompt_ids: list[list[int]], cfg: DictConfig) -> list[tuple[str, str, int]]:
    """(answer text, finish "stop"|"length", new tokens) per prompt, one left-padded HF generate batch."""
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
    return [answer(tokenizer, row, eos_ids) for row in new_tokens]


def generate_vllm(cfg: DictConfig, verifier):
    """A `generate(prompt_ids) -> answers` of one chunk, backed by vLLM (GPU machines; one
    process, vLLM batches and shards internally: vllm.tensor_parallel_size for big verifiers;
    batch_size prompts per chunk, written before the next starts)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise DataError("backend=vllm needs vLLM on a GPU machine: pip install vllm (or use backend=transformers)") \
            from None
    llm = LLM(model=verifier.path, tokenizer=verifier.path, dtype=str(cfg.model.get("dtype", "auto")),
              seed=int(cfg.seed), tensor_parallel_size=int(cfg.vllm.tensor_parallel_size),
              gpu_memory_utilization=float(cfg.vllm.gpu_memory_utilization))
    eos_ids = end_token_ids(verifier)
    params = SamplingParams(max_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
                            top_p=float(cfg.top_p) if float(cfg.temperature) > 0 else 1.0,
                            stop_token_ids=eos_ids, seed=int(cfg.seed))

    def generate(prompt_ids: list[list[int]]) -> list[tuple[str, str, int]]:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        answers = [answer(verifier.tokenizer, list(out.outputs[0].token_ids), eos_ids) for out in outs]
        # vLLM may leave the stop token out of token_ids: its own finish_reason says which it was
        return [(text, "length" if out.outputs[0].finish_reason == "length" else "stop", n)
                for (text, _, n), out in zip(answers, outs)]

    return generate


def records_files(out_dir: Path) -> list[Path]:
    """records.jsonl plus the per-process parts of an unfinished multi-process run."""
    return [out_dir / RECORDS_FILE] + sorted((out_dir / PARTS_DIR).glob("records.*.jsonl"))


def merge_parts(out_dir: Path) -> None:
    """Append every process's part file to records.jsonl (skipping ids already there), then
    delete the parts: the folder then looks exactly like a 1-process run's."""
    records_path = out_dir / RECORDS_FILE
    done = read_done_ids(records_path)
    with open(records_path, "a", encoding="utf-8") as f:
        for part in sorted((out_dir / PARTS_DIR).glob("records.*.jsonl")):
            for record in read_jsonl(part):  # one record per "\n" (an answer may hold U+2028)
                if str(record["id"]) not in done:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")  # as the generator writes it
                    done.add(str(record["id"]))
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(out_dir / PARTS_DIR, ignore_errors=True)


def ignored_setting(cfg: DictConfig, backend: str) -> str | None:
    """One line naming a key that this run would ignore (top_p when decoding greedily, a vllm.*
    key set away from conf/selfdistill.yaml's default without backend=vllm), or None."""
    if float(cfg.temperature) == 0 and float(cfg.top_p) != 1.0:
        return (f"top_p={cfg.top_p} would be ignored: temperature=0 decodes greedily; set temperature>0 to "
                f"sample with it, or drop top_p")
    defaults = OmegaConf.load(CONF_DIR / "selfdistill.yaml").vllm
    for key, value in (cfg.get("vllm") or {}).items():
        if backend != "vllm" and value != defaults.get(key):
            return f"vllm.{key}={value} would be ignored: backend={backend}; pass backend=vllm, or drop vllm.{key}"
    return None


def run(cfg: DictConfig) -> dict:
    state = process_state()  # 1 process, or one per `accelerate launch` / torchrun rank
    backend = choose(BACKENDS, cfg.backend, "backend")
    ignored = ignored_setting(cfg, backend)
    if ignored:
        raise DraftsmithError(ignored)
    if backend == "vllm" and state.num_processes > 1:
        raise DataError("backend=vllm runs as ONE process (vLLM batches and shards itself); "
                        "launch with python, not accelerate launch")
    out_dir = Path(str(cfg.output_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_cfg = prompt_config(cfg)
    prompts = load_prompts(prompts_cfg)  # fail on a bad prompt source before loading the model

    verifier = load_verifier(cfg.model, device="cpu" if backend == "vllm" else state.device)
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
    # Process 0 repairs torn tails first; then every process reads the same set of done ids.
    if state.is_main_process:
        for path in records_files(out_dir):
            read_done_ids(path)
    state.wait_for_everyone()
    done = set().union(*(read_done_ids(path) for path in records_files(out_dir)))
    todo = [p for p in prompts if p["id"] not in done]
    counts = {"prompts": len(prompts), "resumed": len(done), "generated": 0, "truncated": 0,
              "records": len(done), "processes": state.num_processes}
    if state.is_main_process:
        write_manifest(out_dir, verifier, settings, counts, complete=False)

    # Longest prompts first: batches of similar length waste little padding, and a memory
    # problem shows up in the first batch.
    tokenizer = verifier.tokenizer
    encoded = [(p, tokenizer(render(tokenizer, p["messages"], add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) for p in todo]
    long = [p["id"] for p, ids in encoded if len(ids) > int(cfg.max_prompt_tokens)]
    if long and state.is_main_process:  # one very long prompt would pad its whole batch
        print(f"selfdistill: skipping {len(long)} prompts longer than max_prompt_tokens={cfg.max_prompt_tokens}")
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= int(cfg.max_prompt_tokens)]
    counts["skipped_long"] = len(long)
    encoded.sort(key=lambda pair: -len(pair[1]))
    encoded = encoded[state.process_index::state.num_processes]  # strided: every process gets long and short
    if state.num_processes == 1:
        mine = out_dir / RECORDS_FILE
    else:
        (out_dir / PARTS_DIR).mkdir(exist_ok=True)
        mine = out_dir / PARTS_DIR / f"records.{state.process_index}.jsonl"
    torch.manual_seed(int(cfg.seed) + state.process_index)
    generator = torch.Generator(device=verifier.model.device).manual_seed(int(cfg.seed) + state.process_index)
    if backend == "vllm":
        generate = in_batches(generate_vllm(cfg, verifier), int(cfg.batch_size))
    elif backend == "batched":
        generate = generate_batched(cfg, verifier, generator)
    else:
        generate = in_batches(lambda prompt_ids: generate_answers(verifier, prompt_ids, cfg), int(cfg.batch_size))
    new_tokens, t0 = 0, time.time()
    with open(mine, "a", encoding="utf-8") as f, \
            tqdm(total=len(encoded), desc="selfdistill", unit="prompt", disable=not state.is_main_process) as bar:
        for i, (text, finish, n_new) in generate([ids for _, ids in encoded]):
            prompt = encoded[i][0]
            record = {"id": prompt["id"], "category": prompt["category"],
                      "messages": prompt["messages"] + [{"role": "assistant", "content": text}],
                      "finish": finish}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())  # an answer on disk is never generated again
            counts["truncated"] += finish == "length"
            counts["generated"] += 1
            new_tokens += n_new
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.0f}")
    seconds = time.time() - t0
    tok_s = new_tokens / seconds if seconds > 0 else 0.0
    print(f"selfdistill: process {state.process_index}/{state.num_processes}: {counts['generated']} answers, "
          f"{new_tokens} new tokens at {tok_s:.1f} tok/s", flush=True)
    # This run over every process: all new tokens over the slowest process's time.
    runs = gather_object([(new_tokens, seconds)]) if state.num_processes > 1 else [(new_tokens, seconds)]
    total, slowest = sum(n for n, _ in runs), max(s for _, s in runs)
    counts["throughput"] = {"new_tokens": total, "seconds": round(slowest, 3),
                            "tokens_per_s": round(total / slowest, 2) if slowest > 0 else 0.0,
                            "backend": backend, "batch_size": int(cfg.batch_size), "processes": state.num_processes,
                            "threads_per_process": torch.get_num_threads()}
    state.wait_for_everyone()
    if state.is_main_process:
        if (out_dir / PARTS_DIR).is_dir():  # this run's parts, or an interrupted N-process run's
            merge_parts(out_dir)
        records = read_jsonl(out_dir / RECORDS_FILE)  # file lines: not cut at a U+2028 inside an answer
        counts.update(records=len(records), generated=len(records) - len(done),
                      truncated=sum(r.get("finish") == "length" for r in records))
        write_manifest(out_dir, verifier, settings, counts, complete=True)
        print(f"selfdistill: {counts['records']} records in {out_dir} ({counts['generated']} generated now by "
              f"{state.num_processes} process(es), {counts['resumed']} resumed, {counts['truncated']} hit "
              f"max_new_tokens={cfg.max_new_tokens}); verifier {verifier.name} {verifier.fingerprint}", flush=True)
    state.wait_for_everyone()
    # new_tokens / seconds / tokens_per_s: this process; counts["throughput"]: the whole run
    return {"output_dir": str(out_dir), **counts, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": tok_s, "verifier": verifier.name, "fingerprint": verifier.fingerprint}


if __name__ == "__main__":
    launch("selfdistill", run)
