"""Training-state checkpoints: model, optimizer, scheduler, RNG states and data position.

Layout: <output_dir>/checkpoints/step-00000100/ (accelerate.save_state + trainer_state.json),
written to a temporary name and renamed, so a killed run never leaves a half checkpoint that
looks complete; the last `keep_last` are kept. <output_dir>/run.json holds a digest of the
config: pointing a run with another config at the same output dir is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from draftsmith.models.errors import DraftsmithError

# Keys that may change between a run and its resumption (they do not change the result).
VOLATILE = ("trainer.max_steps", "trainer.eval_every", "trainer.save_every", "trainer.log_every",
            "trainer.keep_last", "trainer.threads", "trainer.max_minutes", "logger", "output_dir", "hydra",
            "probe")  # the probe is measured after training
WARM_START_KEYS = ("trainer.init_from", "trainer.keep_vocab")  # left out without a warm start: older runs resume
LATER_KEYS = {"method.fc_init": "random", "method.loss": "ce"}  # keys added since: left out at their default, so older runs resume


def config_digest(cfg) -> str:
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in VOLATILE:
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    for key, default in LATER_KEYS.items():
        parent, leaf = key.split(".")
        if data.get(parent, {}).get(leaf) == default:
            data[parent].pop(leaf)
    trainer = data.get("trainer", {})
    if trainer.get("init_from") is None:
        for key in WARM_START_KEYS:
            trainer.pop(key.split(".")[1], None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_output_dir(output_dir: str | Path, cfg, is_main: bool) -> None:
    """Record this config's digest in output_dir, or refuse if another config owns it."""
    path = Path(output_dir) / "run.json"
    digest = config_digest(cfg)
    if path.exists():
        owner = json.loads(path.read_text()).get("config_digest")
        if owner != digest:
            raise DraftsmithError(
                f"output_dir={output_dir} holds a run with another config (digest {owner}, this one {digest}); "
                f"use a new output_dir=... or delete the old run")
    elif is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config_digest": digest}))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save_training_state(accelerator, output_dir: str | Path, step: int, state: dict, keep_last: int) -> Path:
    root = Path(output_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in root.glob("step-*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_training_state(accelerator, ckpt: Path) -> dict:
    accelerator.load_state(str(ckpt))
    return json.loads((ckpt / "trainer_state.json").read_text())
