"""Drafter checkpoint folders: config.json + model.safetensors + meta.json (+ config.yaml).

A folder is written to a temporary sibling and renamed into place, so a reader never sees a
half-written drafter. meta.json records the verifier fingerprint; loading against a verifier
with another fingerprint stops unless explicitly allowed (drift studies).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.medusa import MedusaConfig, MedusaHeads

# kind -> (config dataclass, module class); a module is built as cls(config).
DRAFTER_KINDS = {
    "medusa": (MedusaConfig, MedusaHeads),
    "eagle": (EagleConfig, EagleDrafter),  # the verifier's embedding / lm_head are not stored
}
FILES = ("config.json", "model.safetensors", "meta.json")


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
    choose(DRAFTER_KINDS, kind, "drafter kind")
    state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or module.state_dict()).items()}

    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps({"kind": kind, "config": dataclasses.asdict(config)}, indent=2))
        save_file(state, str(tmp / "model.safetensors"))
        info = {"verifier_fingerprint": verifier_fingerprint, "verifier_name": verifier_name,
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
        raise DraftsmithError(msg + "; retrain it, or pass allow_fingerprint_mismatch=true to use it anyway")
    warnings.warn(msg + " (allowed by allow_fingerprint_mismatch)")


def load_drafter(ckpt_dir: str | Path, *, verifier_fingerprint: str | None = None,
                 allow_mismatch: bool = False, verifier_lm_head=None):
    """-> (kind, module, config, meta). Every failure is a one-line DraftsmithError."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    check_fingerprint(ckpt_dir, meta, verifier_fingerprint, allow_mismatch)
    try:
        spec = json.loads((ckpt_dir / "config.json").read_text())
        config_cls, module_cls = choose(DRAFTER_KINDS, spec["kind"], f"{ckpt_dir}/config.json kind")
        config = config_cls(**spec["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: config.json is corrupt ({type(e).__name__}: {e})") from None
    try:
        state = load_file(str(ckpt_dir / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"drafter={ckpt_dir}: model.safetensors is unreadable ({e})") from None
    module = module_cls(config)
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise DraftsmithError(f"drafter={ckpt_dir}: weights do not match config.json "
                              f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})")
    return spec["kind"], module.eval(), config, meta
