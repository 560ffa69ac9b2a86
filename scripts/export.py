"""Export a drafter as the serving engines load it: vLLM, SGLang, or a plain HF folder.

    python scripts/export.py drafter=outputs/eagle3-smollm2-135m/final format=vllm output_dir=outputs/export/eagle3-vllm
    python scripts/export.py drafter=outputs/eagle3-smollm2-135m/final format=sglang output_dir=outputs/export/eagle3-sglang
    python scripts/export.py drafter=outputs/draft-smollm2-135m-draft-fkl/final format=hf output_dir=outputs/export/draft-hf

Writes output_dir/{config.json, model.safetensors (or the HF files), README.md with the exact
serve command, export.json (source drafter, verifier fingerprint, format)}. What the engines
read is in models/layouts.py. Weights the drafter shares with the verifier but the engine wants
in the folder (a shared Medusa head, a shared or gathered EAGLE-3 lm_head) are copied from the
verifier (`model=`); a drafter a format cannot express is refused in one line, naming why.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file

from draftsmith.models.checkpoint import MEDUSA2_PARTS, load_drafter, write_atomic_dir
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.layouts import engine_config

FORMATS = {"vllm": "vLLM", "sglang": "SGLang", "hf": "HF transformers"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def trained_verifier(drafter_dir: Path, meta: dict) -> str | None:
    """What an engine loads as the verifier: Medusa-2 heads' tuned verifier folder beside them,
    else the model.path the drafter was trained with (an HF id or a local folder, from its
    config.yaml), or None."""
    tuned = drafter_dir.parent / MEDUSA2_PARTS[1]
    if meta.get("original_verifier") and tuned.is_dir():
        return str(tuned)
    if not (drafter_dir / "config.yaml").is_file():
        return None
    path = OmegaConf.load(drafter_dir / "config.yaml").get("model", {}).get("path")
    return str(path) if path else None


def serve_command(kind: str, config, fmt: str, verifier: str, out: str) -> str:
    """The engine's command line serving `verifier` with this folder as its drafter."""
    if fmt == "hf":
        return (f"model.generate(**inputs, assistant_model=AutoModelForCausalLM.from_pretrained(\"{out}\"))  "
                f"# HF assisted generation; the draft schedule is in {out}/generation_config.json")
    if fmt == "vllm":
        method = {"medusa": "medusa", "draft": "draft_model"}.get(kind) or (
            "eagle3" if config.variant == "eagle3" else "eagle")
        n = config.num_heads if kind == "medusa" else 4 if kind == "draft" else 5
        spec = json.dumps({"method": method, "model": out, "num_speculative_tokens": n})
        return f"vllm serve {verifier} --speculative-config '{spec}'"
    algorithm = "STANDALONE" if kind == "draft" else "EAGLE3" if config.variant == "eagle3" else "EAGLE"
    return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens 8")


def verifier_lm_head(cfg, fingerprint: str) -> torch.Tensor:
    """(V, H) the verifier's lm_head weight, checked against the drafter's fingerprint."""
    from draftsmith.models.verifier import load_verifier

    verifier = load_verifier(cfg.model)
    if verifier.fingerprint != fingerprint and not cfg.allow_fingerprint_mismatch:
        raise DraftsmithError(f"model={cfg.model.name} is verifier {verifier.fingerprint}, the drafter was trained "
                              f"against {fingerprint}; pass the drafter's verifier as model=...")
    return verifier.lm_head.weight.detach().float().cpu()


def engine_state(kind: str, module, config, fmt: str, lm_head) -> tuple[dict, dict]:
    """-> (state dict under the engine's names, extra config keys). lm_head: () -> (V, H) weight."""
    state = dict(module.state_dict())
    if kind == "medusa":
        if config.lm_head == "shared":  # vLLM's original_lm_head: one lm_head.weight (gathered by token_map)
            state["lm_head.weight"] = lm_head()
        return state, {}
    if config.variant == "eagle1":
        if config.fc_bias:
            raise DraftsmithError(f"format={fmt}: this EAGLE-1 drafter's fc has a bias, which the engines' EAGLE-1 "
                                  f"loaders drop; retrain it with python train/eagle.py method=eagle1")
        if config.lm_head != "shared":
            raise DraftsmithError(f"format={fmt}: the engines' EAGLE-1 projects with the verifier's own lm_head; "
                                  f"this drafter has lm_head={config.lm_head} (retrain with method.lm_head=shared)")
        return state, {}
    if config.norm_before_residual and fmt != "vllm":
        raise DraftsmithError(f"format={fmt}: this EAGLE-3 drafter uses norm_before_residual, which only vLLM's "
                              f"loader reads (config key norm_before_residual); use format=vllm")
    if len(config.fusion_layers) != 3:
        raise DraftsmithError(f"format={fmt}: the engines' EAGLE-3 fc reads exactly 3 verifier layers, this drafter "
                              f"fuses {len(config.fusion_layers)} ({config.fusion_layers})")
    if config.lm_head == "gathered":
        state["lm_head.weight"] = lm_head()[module.target_ids]
    elif config.lm_head == "shared":  # the full vocabulary: the verifier's head, identity maps
        weight = lm_head()
        state.update({"lm_head.weight": weight, "d2t": torch.zeros(weight.shape[0], dtype=torch.long),
                      "t2d": torch.ones(weight.shape[0], dtype=torch.bool)})
        return state, {"draft_vocab_size": weight.shape[0]}
    return state, {}


def run(cfg: DictConfig) -> dict:
    choose(FORMATS, cfg.format, "format")
    fmt = cfg.format
    if cfg.dtype is not None:
        choose(DTYPES, cfg.dtype, "dtype")
    if not cfg.drafter:
        raise DraftsmithError("drafter= is required: a drafter folder (e.g. outputs/eagle3-smollm2-135m/final)")
    drafter = load_drafter(cfg.drafter)
    kind, module, config, meta = drafter
    fingerprint = meta.get("verifier_fingerprint")
    if kind != "draft" and fmt == "hf":
        raise DraftsmithError(f"format=hf cannot express a {kind} drafter (transformers has no {kind} loader); "
                              f"use format=vllm" + ("" if kind == "medusa" else " or format=sglang"))
    out = Path(cfg.output_dir)
    verifier_name = cfg.verifier_name or trained_verifier(Path(cfg.drafter), meta) or meta.get("verifier_name") or \
        cfg.model.path

    if kind == "draft":
        def write(tmp: Path):
            dtype = DTYPES[cfg.dtype] if cfg.dtype else module.dtype
            module.to(dtype).save_pretrained(tmp, max_shard_size="1000GB")
            for f in Path(cfg.drafter).iterdir():  # tokenizer files, generation_config.json (draft schedule)
                if f.is_file() and not (tmp / f.name).exists() and f.name not in ("meta.json", "config.yaml"):
                    shutil.copy2(f, tmp / f.name)
            finish(tmp)
    else:
        state, extra = engine_state(kind, module, config, fmt, lambda: verifier_lm_head(cfg, fingerprint))
        dtype_name = cfg.dtype or str(next(module.parameters()).dtype).removeprefix("torch.")
        dtype = DTYPES[dtype_name]
        state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in state.items()}
        spec = {**engine_config(kind, config, getattr(module, "layer_config", None), fmt, dtype_name), **extra}

        def write(tmp: Path):
            (tmp / "config.json").write_text(json.dumps(spec, indent=2))
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            finish(tmp)

    command = serve_command(kind, config, fmt, verifier_name, str(out))

    def finish(tmp: Path):
        info = {"format": fmt, "kind": kind, "exported_from": str(cfg.drafter), "verifier_fingerprint": fingerprint,
                "verifier_name": meta.get("verifier_name"), "serve": command}
        (tmp / "export.json").write_text(json.dumps(info, indent=2))
        (tmp / "README.md").write_text(f"# {kind} drafter for {verifier_name}, exported for {FORMATS[fmt]}\n\n"
                                       f"Exported by draftsmith from `{cfg.drafter}` (verifier fingerprint "
                                       f"{fingerprint}). Serve it with:\n\n```bash\n{command}\n```\n")

    write_atomic_dir(out, write)
    print(f"export: {kind} drafter -> {out} ({FORMATS[fmt]}); serve with:\n  {command}")
    return {"output_dir": str(out), "format": fmt, "kind": kind, "serve": command,
            "config": json.loads((out / "config.json").read_text())}


if __name__ == "__main__":
    launch("export", run)
