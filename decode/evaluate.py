"""Evaluate a drafter: tau, wall speedup vs plain decoding, losslessness, per category.

    python decode/evaluate.py drafter=outputs/medusa-smollm2-135m/final            # MT-bench, greedy
    python decode/evaluate.py drafter=... data=humaneval temperature=0.7 num_samples=4
    python decode/evaluate.py proposer=vanilla data=chat-jsonl data.path=prompts.jsonl

Every prompt runs with the chosen method AND with plain decoding through the same engine,
interleaved (decode/harness.py: the order rotates per prompt), with the same seeds; HF `generate` (plain,
prompt lookup, assisted when `hf.assistant` names a draft model, at the draft's own schedule
and at HF's defaults, and with `hf.static_cache=true` its StaticCache + torch.compile path) runs
on the same prompts.
Writes output_dir/{results.json, outputs.jsonl, results.md, acceptance_hist.png,
accepted_per_depth.png}.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftsmith.decode import sampling
from draftsmith.decode.budget import BUDGETS, FixedBudget
from draftsmith.decode.build import build_proposer, check_drafter
from draftsmith.decode.engine import generate, summarize
from draftsmith.decode.harness import compare_greedy, interleaved, method_stats, prompt_ids, token_latencies
from draftsmith.decode.lookup import PromptLookupGraft
from draftsmith.decode.sampling import SamplingParams
from draftsmith.models.entry import compose_main, launch, run_overrides
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.sources import load_prompts
from draftsmith.models.verifier import load_verifier, resolve_device


# HF assisted generation reads its draft length and schedule from the ASSISTANT's generation
# config (transformers/generation/candidate_generator.py: AssistedCandidateGenerator). `draft`:
# the folder's generation_config.json as it stands (models/draft.py writes conf/decode/draft-chain's
# schedule there: 4 tokens, heuristic, no confidence cut); `hf-defaults`: those three keys reset
# to GenerationConfig's global defaults (20 tokens, constant, confidence 0.4 in transformers 5).
ASSISTED_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
ASSISTED_SCHEDULES = {"draft": "hf_assisted", "hf-defaults": "hf_assisted_hf_defaults"}
HF_ASSISTED_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                        "assistant_confidence_threshold": 0.4}  # GenerationConfig's documented defaults


def assisted_runs(cfg, device: torch.device) -> dict[str, dict]:
    """run name -> HF generate kwargs, one assistant model per schedule (HF's heuristic schedule
    keeps its length on the assistant's generation_config across calls, so none is shared)."""
    from transformers import GenerationConfig

    runs = {}
    for schedule in cfg.hf.assisted_schedules:
        name = choose(ASSISTED_SCHEDULES, schedule, "hf.assisted_schedules")
        assistant = load_verifier(OmegaConf.merge(cfg.model, {"name": "assistant", "source": "hf",
                                                              "path": cfg.hf.assistant}),
                                  device=device).model
        defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: HF_ASSISTED_DEFAULTS)()
        gen = assistant.generation_config
        for key in ASSISTED_KEYS:
            if schedule == "hf-defaults" or getattr(gen, key, None) is None:
                setattr(gen, key, defaults[key])
        runs[name] = {"assistant_model": assistant}
    return runs


def assisted_schedule(kwargs: dict) -> dict:
    """The schedule an assisted run starts from (for results.json)."""
    return {key: getattr(kwargs["assistant_model"].generation_config, key) for key in ASSISTED_KEYS}


def hf_generate(model, input_ids, cfg, generator_seed: int, **extra) -> tuple[list[int], float]:
    """HF generate with the evaluator's sampling settings (no other logits processors)."""
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=model.generation_config.pad_token_id,
                  repetition_penalty=None, top_k=None, top_p=None, temperature=None, do_sample=False)
    if cfg.temperature > 0:
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0)
        torch.manual_seed(generator_seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs, **extra)
    return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - t0


def static_compile_mode(device: torch.device) -> str:
    """torch.compile's mode for HF's static-cache path: CUDA graphs on a GPU, plain code elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


class StaticCompiled:
    """HF ``generate``'s static-shape fast path: a StaticCache of ``capacity`` slots (one for the
    whole prompt set, reset before each call) and its decode step compiled with torch.compile.

    transformers compiles only on CUDA/XPU-like devices unless its CompileConfig is told
    otherwise, so it is told to: this times the path on the CPU too. On a GPU the step is also
    captured as a CUDA graph (mode "reduce-overhead", HF's own default there), which removes the
    kernel-launch cost a small verifier's decode step is made of; the CPU has no graphs to capture.
    ``warm_up`` compiles once, outside the timed calls (its seconds are reported as compile_s);
    the decode step then has one shape for every prompt, so it never recompiles."""

    def __init__(self, model, capacity: int):
        from transformers import CompileConfig, StaticCache

        self.capacity = capacity
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=static_compile_mode(model.device))
        self.compile_config._compile_all_devices = True  # transformers' switch for compiling on any device
        self.compile_s = 0.0

    def kwargs(self) -> dict:
        with torch.inference_mode():  # its tensors were made in generate's inference mode
            self.cache.reset()
        return {"cache": self.cache, "compile_config": self.compile_config}

    def warm_up(self, model, input_ids, cfg) -> None:
        t0 = time.perf_counter()
        hf_generate(model, input_ids, OmegaConf.create({"max_new_tokens": 3, "temperature": 0.0}), 0, **self.kwargs())
        self.compile_s = time.perf_counter() - t0


def evaluate_config(overrides: list[str], model: DictConfig | None = None) -> DictConfig:
    """The conf/evaluate.yaml config with these overrides and, when given, this whole `model` node
    (the caller's verifier, dtype included), composed from Python or from inside another
    script's Hydra app (scripts/bench/compare.py, scripts/bench/learning_curve.py)."""
    if model is not None:
        given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "model"]
        if given:
            raise DraftsmithError(f"{given[0]}: the verifier (model.*) is set once for the whole run, not per "
                                  f"cell; set it at the top level (e.g. model.dtype=..., model.path=...)")
    cfg = compose_main("evaluate", overrides)
    if model is not None:
        OmegaConf.update(cfg, "model", OmegaConf.create(OmegaConf.to_container(model, resolve=True)), merge=False)
    return cfg


def run(cfg: DictConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    acceptance = cfg.acceptance
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    sampling.resolve_rule(acceptance, params)  # refuse before any work
    device = resolve_device(cfg.device)
    kind = check_drafter(cfg)
    if choose(BUDGETS, cfg.engine.budget, "engine.budget") is not FixedBudget and kind == "vanilla":
        raise DraftsmithError(f"engine.budget={cfg.engine.budget} with proposer=vanilla: nothing drafts, so there is "
                              f"no budget to choose; set engine.budget=fixed or pick a proposer that drafts")
    if cfg.hf.assistant and cfg.hf.enabled and not Path(str(cfg.hf.assistant)).is_dir():
        raise DraftsmithError(f"hf.assistant={cfg.hf.assistant}: no such folder; pass a draft model folder "
                              f"(train/draft.py's final/) or hf.assistant=null")
    for schedule in cfg.hf.assisted_schedules:
        choose(ASSISTED_SCHEDULES, schedule, "hf.assisted_schedules")
    if len(set(cfg.hf.assisted_schedules)) < len(cfg.hf.assisted_schedules):
        raise DraftsmithError(f"hf.assisted_schedules={list(cfg.hf.assisted_schedules)} names a schedule twice; "
                              f"name each once")
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verifier = load_verifier(cfg.model, device=device)
    model, tokenizer = verifier.model, verifier.tokenizer
    proposer, drafter_meta = build_proposer(cfg, verifier)
    if isinstance(proposer, PromptLookupGraft) and proposer.grafts_nothing(params):
        what = (f"decode.lookup_tokens={cfg.decode.lookup_tokens}" if proposer.num_tokens
                else f"decode.datastore={cfg.decode.datastore}")
        raise DraftsmithError(f"{what} with a draft model at temperature={cfg.temperature}: its drafts are sampled "
                              f"and the graft would not run; set decode.lookup_tokens=0 decode.datastore=null "
                              f"or temperature=0")
    lossy = acceptance == "typical"
    method = cfg.proposer.name + (" (LOSSY typical acceptance)" if lossy else "")
    prompts = load_prompts(cfg.data)
    runs = {"vanilla": None, method: proposer} if proposer is not None else {"vanilla": None}
    max_depth = proposer.max_depth if proposer is not None else 0
    hf_runs = {"hf_generate": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": cfg.hf.prompt_lookup_num_tokens}}
    if cfg.hf.assistant:
        hf_runs.update(assisted_runs(cfg, device))
    if not cfg.hf.enabled:
        hf_runs = {}
    if cfg.hf.static_cache:  # one cache for every prompt: the longest prompt + max_new_tokens
        longest = max(prompt_ids(tokenizer, p["messages"]).shape[1] for p in prompts)
        static = StaticCompiled(model, longest + cfg.max_new_tokens)
        static.warm_up(model, prompt_ids(tokenizer, prompts[0]["messages"]).to(model.device), cfg)
        hf_runs["hf_generate_static"] = static.kwargs  # a callable: a freshly reset cache for every call
    hf_extra = {name: {"assistant_schedule": assisted_schedule(kwargs)} for name, kwargs in hf_runs.items()
                if isinstance(kwargs, dict) and "assistant_model" in kwargs}  # reported beside each HF row
    if cfg.hf.static_cache:
        hf_extra["hf_generate_static"] = {"compile_s": static.compile_s, "cache_slots": static.capacity}

    outputs = {name: [] for name in runs}
    latencies = {name: [] for name in runs}
    hf_time = {name: [0.0, 0] for name in hf_runs}
    identity = {name: [] for name in [*runs, *hf_runs]}
    categories: dict[str, dict[str, list]] = {}
    prompts_ids = [prompt_ids(tokenizer, p["messages"]).to(model.device) for p in prompts]
    records = open(out_dir / "outputs.jsonl", "w")
    for i, s, seed, results in interleaved(model, prompts_ids, runs, num_samples=cfg.num_samples, seed=cfg.seed,
                                           max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                           top_k=cfg.top_k, top_p=cfg.top_p, acceptance=acceptance,
                                           forward=cfg.engine.forward, invariant=cfg.engine.invariant,
                                           weights=cfg.engine.weights, budget=cfg.engine.budget,
                                           desc=f"evaluate {method}"):
        prompt, ids = prompts[i], prompts_ids[i]
        for name, out in results.items():
            outputs[name].append(out)
            latencies[name] += token_latencies(out)
            categories.setdefault(prompt["category"], {}).setdefault(name, []).append(out)
            records.write(json.dumps({"id": prompt["id"], "category": prompt["category"], "method": name,
                                      "sample": s, "seed": seed, "prompt_ids": ids[0].tolist(),
                                      "tokens": out.tokens, "text": tokenizer.decode(out.tokens),
                                      "tau": out.tau, "lossy": out.lossy, "stop_reason": out.stop_reason}) + "\n")
        for name, kwargs in hf_runs.items():  # fixed kwargs, or a callable that makes them per call
            tokens, seconds = hf_generate(model, ids, cfg, seed, **(kwargs() if callable(kwargs) else kwargs))
            hf_time[name][0] += seconds
            hf_time[name][1] += len(tokens)
            results[name] = tokens
            records.write(json.dumps({"id": prompt["id"], "category": prompt["category"], "method": name,
                                      "sample": s, "seed": seed, "tokens": tokens}) + "\n")
        if cfg.temperature == 0:  # greedy: every decoder must reproduce plain decoding exactly
            reference = results["vanilla"].tokens
            for name, res in results.items():
                tokens = res.tokens if hasattr(res, "tokens") else res
                check = compare_greedy(model, ids[0].tolist(), tokens, reference, cfg.tie_tolerance, cfg.tie_ulps)
                identity[name].append({"id": prompt["id"], **check})
        records.flush()
    records.close()

    base = summarize(outputs["vanilla"])
    report = {"model": verifier.name, "verifier_fingerprint": verifier.fingerprint, "dtype": str(model.dtype),
              "data": cfg.data.name, "num_prompts": len(prompts), "num_samples": cfg.num_samples,
              "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
              "top_k": cfg.top_k, "decode_tree": cfg.decode.name if proposer is not None else None,
              "decode_overrides": decode_overrides() if proposer is not None else [],
              "proposer": proposer.name if proposer is not None else None,  # e.g. eagle+prompt_lookup
              "drafter": cfg.drafter if proposer is not None else None, "drafter_meta": drafter_meta,
              "device": str(model.device), "threads": torch.get_num_threads(), "lossy": lossy,
              "budget": cfg.engine.budget, "methods": {}}
    for name in runs:
        stats = method_stats(outputs[name], latencies[name], max_depth)
        stats["speedup"] = stats["tokens_per_s"] / base["tokens_per_s"]
        report["methods"][name] = stats
    for name, (seconds, n) in hf_time.items():
        report["methods"][name] = {"tokens_per_s": n / seconds, "speedup": (n / seconds) / base["tokens_per_s"],
                                   "num_tokens": n, "total_s": seconds}
        report["methods"][name].update(hf_extra.get(name, {}))
    for name, checks in identity.items():
        if checks:
            same = sum(c["identical"] for c in checks)
            ties = sum(bool(c.get("tie")) for c in checks)
            report["methods"][name]["greedy_identity_rate"] = same / len(checks)
            report["methods"][name]["greedy_divergences_explained_by_ties"] = ties
            report["methods"][name]["greedy_divergences_unexplained"] = len(checks) - same - ties
            report["methods"][name]["greedy_checks"] = [c for c in checks if not c["identical"]]
    report["per_category"] = {}
    for cat, by_method in sorted(categories.items()):
        stats = {name: summarize(outs) for name, outs in by_method.items()}
        report["per_category"][cat] = {name: {"tau": st["tau"], "tokens_per_s": st["tokens_per_s"]}
                                       for name, st in stats.items()}
    original = (drafter_meta or {}).get("original_verifier")
    if original and original.get("model") and cfg.temperature == 0:  # a Medusa-2 drafter: the verifier was tuned
        report["tuned_vs_original"] = tuned_vs_original(original, cfg, prompts_ids,
                                                        outputs["vanilla"][:: cfg.num_samples], device)
        print(f"the tuned verifier against the original ({original['name']}): "
              f"{report['tuned_vs_original']['identical_outputs']:.0%} of greedy outputs identical, "
              f"{report['tuned_vs_original']['token_agreement']:.1%} of tokens before the first divergence")
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    table = markdown_table(report)
    (out_dir / "results.md").write_text(table + "\n")
    plot(report, out_dir, method, max_depth)
    print(table)
    print(f"results -> {out_dir}/results.json")
    return report


def tuned_vs_original(original: dict, cfg, prompts_ids: list[torch.Tensor], tuned_outputs,
                      device: torch.device) -> dict:
    """Medusa-2 changes the verifier: the ORIGINAL verifier (recorded with the heads) decodes the
    same prompts greedily, and its outputs are compared with the tuned verifier's plain outputs."""
    model_cfg = OmegaConf.create({**original["model"], "dtype": cfg.model.dtype})
    model = load_verifier(model_cfg, device=device).model
    same, agree, total = 0, 0, 0
    for ids, tuned in zip(prompts_ids, tuned_outputs):
        ref = generate(model, ids, max_new_tokens=cfg.max_new_tokens, forward=cfg.engine.forward,
                       invariant=cfg.engine.invariant, weights=cfg.engine.weights).tokens
        n = next((i for i, (a, b) in enumerate(zip(tuned.tokens, ref)) if a != b), min(len(tuned.tokens), len(ref)))
        same += tuned.tokens == ref
        agree, total = agree + n, total + max(len(tuned.tokens), len(ref))
    return {"original_fingerprint": original.get("fingerprint"), "prompts": len(prompts_ids),
            "identical_outputs": same / max(len(prompts_ids), 1), "token_agreement": agree / max(total, 1),
            "note": "greedy, plain decoding of both verifiers; the decoder is lossless w.r.t. the tuned one"}


def decode_overrides() -> list[str]:
    """The decode.* keys this run's command line set over its preset (e.g. decode.paths=[[0]]), so
    a table head does not name a preset whose tree was replaced; [] outside a Hydra run."""
    return [o for o in run_overrides() or [] if o.lstrip("+~").startswith("decode.")]


def markdown_table(report: dict) -> str:
    where = report["device"] if report.get("device", "cpu") != "cpu" else f"{report['threads']} threads"
    tree = " ".join([f"tree={report['decode_tree']}", *report.get("decode_overrides", [])])
    budget = f", budget={report['budget']}" if report.get("budget", "fixed") != "fixed" else ""
    lossy = " — LOSSY (typical acceptance)" if report["lossy"] else ""
    head = (f"{report['model']} ({report['dtype']}, {where}), data={report['data']} "
            f"x{report['num_prompts']}, T={report['temperature']}, max_new_tokens={report['max_new_tokens']}, "
            f"{tree}{budget}{lossy}")
    rows = ["| method | tau | tokens/s | speedup vs vanilla | median ms/token | p99 ms/token | greedy identical |",
            "|---|---|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        ident = m.get("greedy_identity_rate")
        ident_s = "n/a" if ident is None else f"{ident:.0%}" + (
            f" ({m['greedy_divergences_explained_by_ties']} ties)" if m.get("greedy_divergences_explained_by_ties") else "")
        fmt = lambda key, spec: format(m[key], spec) if key in m else "–"  # noqa: E731
        rows.append(f"| {name} | {fmt('tau', '.2f')} | {fmt('tokens_per_s', '.1f')} | {fmt('speedup', '.2f')}x "
                    f"| {fmt('latency_median_ms', '.1f')} | {fmt('latency_p99_ms', '.1f')} | {ident_s} |")
    return head + "\n\n" + "\n".join(rows)


def save_plot(path: Path, draw, **axes) -> None:
    """One small PNG: draw(ax) plots, `axes` go to ax.set (labels, title, limits, scales)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    draw(ax)
    ax.set(**axes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(report: dict, out_dir: Path, method: str, max_depth: int) -> None:
    stats = report["methods"].get(method)
    if stats is None:
        return
    hist = stats["accept_length_hist"]
    save_plot(out_dir / "acceptance_hist.png", lambda ax: ax.bar([int(k) for k in hist], list(hist.values())),
              xlabel="tokens emitted per verifier forward", ylabel="steps", title=f"{method}: tau={stats['tau']:.2f}")
    save_plot(out_dir / "accepted_per_depth.png",
              lambda ax: ax.plot(range(1, max_depth + 1), stats["accepted_per_depth"], marker="o"),
              xlabel="tree depth d", ylabel="P(accepted depth >= d)", ylim=(0, 1),
              title=f"{method}: acceptance by depth")


if __name__ == "__main__":
    launch("evaluate", run)
