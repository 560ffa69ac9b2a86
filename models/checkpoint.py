"""Drafter checkpoint folders, in the layout vLLM loads (models/layouts.py), written atomically.

    config.json        the engine's config (architectures, model_type, dimensions, ...) plus a
                       `draftsmith` block: {"kind", "config"} (the drafter dataclass)
    model.safetensors  weights under the engine's names (EAGLE's d2t as offsets, t2d a mask)
    meta.json          verifier fingerprint and name, metrics, method; config.yaml the resolved run

A folder is written to a temporary sibling and renamed into place, so a reader never sees a
half-written drafter. Loading against a verifier with another fingerprint stops unless
explicitly allowed (drift studies). `load_drafter` also reads draft-model folders (plain HF
causal LMs) and the public layouts (SpecForge / official EAGLE, FasterDecoding and vLLM Medusa).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.layouts import engine_config, import_public
from draftsmith.models.medusa import MedusaConfig, MedusaHeads

# kind -> (config dataclass, module class); a module is built as cls(config). Draft models
# ("draft") are HF causal-LM folders (models/draft.py).
DRAFTER_KINDS = {
    "medusa": (MedusaConfig, MedusaHeads),
    "eagle": (EagleConfig, EagleDrafter),  # the verifier's embedding / lm_head are not stored
}
FILES = ("config.json", "model.safetensors", "meta.json")


class Drafter(NamedTuple):
    """What load_drafter returns, whatever the kind: unpacks as (kind, module, config, meta)."""
    kind: str  # medusa | eagle | draft
    module: torch.nn.Module
    config: object  # MedusaConfig | EagleConfig | the draft model's HF config
    meta: dict


MEDUSA2_PARTS = ("heads", "verifier")  # a Medusa-2 output folder: the heads, the tuned verifier (HF folder)


def medusa2_parts(path: str | Path) -> tuple[Path, Path] | None:
    """(heads folder, tuned verifier folder) of a Medusa-2 output (meta.json kind "medusa2"), else None."""
    path = Path(path)
    if (path / "meta.json").is_file() and read_meta_file(path).get("kind") == "medusa2":
        return path / MEDUSA2_PARTS[0], path / MEDUSA2_PARTS[1]
    return None


def write_atomic_text(path: str | Path, text: str) -> Path:
    """path <- text, atomically: a temporary file beside it, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_atomic_dir(out_dir: str | Path, write) -> Path:
    """Call write(tmp_dir) then atomically swap tmp_dir into out_dir."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def save_drafter(out_dir: str | Path, kind: str, module: torch.nn.Module | None, config, *,
                 verifier_fingerprint: str, verifier_name: str, meta: dict | None = None,
                 resolved_config_yaml: str | None = None, state_dict: dict | None = None) -> Path:
    """`state_dict` (e.g. gathered by accelerator.get_state_dict under ZeRO-3) replaces module's."""
    config_cls, module_cls = choose(DRAFTER_KINDS, kind, "drafter kind")
    state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or module.state_dict()).items()}
    layer_config = module.layer_config if module is not None and kind == "eagle" else None
    if kind == "eagle" and layer_config is None:
        from draftsmith.models.eagle import llama_layer_config

        layer_config = llama_layer_config(config)
    # the weights' dtype: EAGLE-3's first tensors are its int64 vocabulary maps (d2t / t2d)
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    dtype = str(floats[0]).removeprefix("torch.") if floats else "float32"
    spec = {**engine_config(kind, config, layer_config, "vllm", dtype),
            "draftsmith": {"kind": kind, "config": dataclasses.asdict(config)}}

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(spec, indent=2))
        save_file(state, str(tmp / "model.safetensors"))
        info = {"kind": kind, "verifier_fingerprint": verifier_fingerprint, "verifier_name": verifier_name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2, default=str))
        if resolved_config_yaml is not None:
            (tmp / "config.yaml").write_text(resolved_config_yaml)

    return write_atomic_dir(out_dir, write)


def read_meta(ckpt_dir: str | Path) -> dict:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise DraftsmithError(f"drafter={ckpt_dir}: no such checkpoint folder")
    missing = [f for f in FILES if not (ckpt_dir / f).is_file()]
    if missing:
        raise DraftsmithError(f"drafter={ckpt_dir}: incomplete checkpoint, missing {', '.join(missing)}")
    try:
        return json.loads((ckpt_dir / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: meta.json is corrupt ({e})") from None


def check_fingerprint(ckpt_dir, meta: dict, verifier_fingerprint: str | None, allow_mismatch: bool) -> None:
    recorded = meta.get("verifier_fingerprint")
    if verifier_fingerprint is None or recorded == verifier_fingerprint:
        return
    msg = (f"drafter={ckpt_dir} was trained against verifier {recorded} "
           f"({meta.get('verifier_name')}) but the loaded verifier is {verifier_fingerprint}")
    if not allow_mismatch:
        raise DraftsmithError(msg + f"; refresh it for this verifier (python scripts/refresh.py drafter={ckpt_dir} "
                              f"model.path=<the verifier>), or pass allow_fingerprint_mismatch=true to use it anyway")
    warnings.warn(msg + " (allowed by allow_fingerprint_mismatch)")


def old_medusa_names(state: dict) -> dict:
    """draftsmith <= 0.1 Medusa names (blocks.k.l.linear.*, d2t) -> vLLM's (blocks.k.layers.l.*, token_map)."""
    out = {}
    for name, value in state.items():
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) == 5 and parts[3] == "linear":
            name = f"blocks.{parts[1]}.layers.{parts[2]}.{parts[4]}"
        out["token_map" if name == "d2t" else name] = value
    return out


def drafter_dir(ckpt_dir: str | Path) -> Path:
    """The drafter folder, refused in one line when it is not there (callers check it before
    loading the verifier; load_drafter checks it again for Python callers)."""
    ckpt_dir = Path(str(ckpt_dir))
    if not ckpt_dir.is_dir():
        raise DraftsmithError(f"drafter={ckpt_dir}: no such checkpoint folder")
    return ckpt_dir


def load_drafter(ckpt_dir: str | Path, *, verifier_fingerprint: str | None = None, allow_mismatch: bool = False,
                 verifier_dims: tuple[int, int] | None = None, verifier_num_layers: int | None = None,
                 dtype: torch.dtype | None = None) -> Drafter:
    """Any drafter folder -> Drafter(kind, module, config, meta). Every failure is one line.

    draftsmith folders are checked against `verifier_fingerprint`; public layouts (no meta.json)
    against `verifier_dims` = (hidden size, vocabulary). `dtype` applies to draft models."""
    ckpt_dir = drafter_dir(ckpt_dir)
    meta_kind = None
    if (ckpt_dir / "meta.json").is_file():
        meta_kind = read_meta_file(ckpt_dir).get("kind")
    if meta_kind == "medusa2":
        heads, tuned = medusa2_parts(ckpt_dir)
        raise DraftsmithError(f"drafter={ckpt_dir} is a Medusa-2 output: pass drafter={heads} and "
                              f"model.path={tuned} (the heads decode against the tuned verifier)")
    if meta_kind == "draft":
        return load_draft_folder(ckpt_dir, verifier_fingerprint, allow_mismatch, verifier_dims, dtype)
    spec = read_config(ckpt_dir) if (ckpt_dir / "config.json").is_file() else {}
    if "draftsmith" in spec or ("kind" in spec and "config" in spec) or (ckpt_dir / "meta.json").is_file():
        return load_native(ckpt_dir, spec, verifier_fingerprint, allow_mismatch)
    public = import_public(ckpt_dir, verifier_dims, verifier_num_layers)
    if public is None:
        return load_draft_folder(ckpt_dir, verifier_fingerprint, allow_mismatch, verifier_dims, dtype)
    kind, config, state = public
    meta = {"kind": kind, "imported_from": str(ckpt_dir), "note": "public checkpoint, not trained by draftsmith"}
    if (ckpt_dir / "export.json").is_file():  # exported by scripts/export.py: it knows its verifier
        meta = {**json.loads((ckpt_dir / "export.json").read_text()), "imported_from": str(ckpt_dir)}
        check_fingerprint(ckpt_dir, meta, verifier_fingerprint, allow_mismatch)
    return Drafter(kind, build_module(ckpt_dir, kind, config, state), config, meta)


def read_config(ckpt_dir: Path) -> dict:
    try:
        return json.loads((ckpt_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: config.json is corrupt ({e})") from None


def read_meta_file(ckpt_dir: Path) -> dict:
    try:
        return json.loads((ckpt_dir / "meta.json").read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: meta.json is corrupt ({e})") from None


def load_native(ckpt_dir: Path, spec: dict, verifier_fingerprint, allow_mismatch) -> Drafter:
    meta = read_meta(ckpt_dir)
    check_fingerprint(ckpt_dir, meta, verifier_fingerprint, allow_mismatch)
    block = spec.get("draftsmith")
    if block is None and "kind" in spec:  # draftsmith <= 0.1: {"kind", "config"} and our own names
        block = spec
        if spec["kind"] == "eagle":
            raise DraftsmithError(f"drafter={ckpt_dir} is a draftsmith 0.1 EAGLE layout (fuse/fc with a bias, "
                                  f"an HF layer with its own norms) that no engine loads and that cannot be "
                                  f"converted: retrain it with python train/eagle.py method=<eagle1|eagle3>")
    try:
        config_cls, _ = choose(DRAFTER_KINDS, block["kind"], f"{ckpt_dir}/config.json kind")
        config = config_cls(**block["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: config.json is corrupt ({type(e).__name__}: {e})") from None
    try:
        state = load_file(str(ckpt_dir / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: model.safetensors is unreadable ({e})") from None
    if "draftsmith" not in spec:
        state = old_medusa_names(state)
        warnings.warn(f"drafter={ckpt_dir} is a draftsmith 0.1 Medusa folder: loaded with its weights renamed "
                      f"to vLLM's layout; save it again (scripts/export.py) to convert it")
    return Drafter(block["kind"], build_module(ckpt_dir, block["kind"], config, state), config, meta)


def build_module(ckpt_dir, kind: str, config, state: dict) -> torch.nn.Module:
    _, module_cls = DRAFTER_KINDS[kind]
    module = module_cls(config)
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise DraftsmithError(f"drafter={ckpt_dir}: weights do not match config.json "
                              f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})")
    return module.eval()


def load_draft_folder(ckpt_dir: Path, verifier_fingerprint, allow_mismatch, verifier_dims, dtype) -> Drafter:
    from draftsmith.models.draft import load_draft_model

    model, meta = load_draft_model(ckpt_dir, verifier_fingerprint=verifier_fingerprint, allow_mismatch=allow_mismatch,
                                   dtype=dtype, vocab_size=None if verifier_dims is None else verifier_dims[1])
    return Drafter("draft", model, model.config, meta)
