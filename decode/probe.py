"""The probe: a drafter's acceptance length on a fixed set of prompts, recorded when it is
trained and measured again when its verifier changes (scripts/refresh.py).

    probe.json (in the drafter folder)
        prompts          [[int]]  the prompts as fed to the verifier (token ids: chat template and
                                  generation prompt included), from the run's held-out split
        max_new_tokens   int      greedy tokens decoded per prompt
        decode           dict     the decode preset the drafter is measured with
        dtype            str      the verifier's dtype
        verifier_fingerprint      the verifier it was measured on
        tau, per_prompt_tau       emitted tokens per verifier forward (prefill excluded)

A drafter's tau on the verifier it was trained for, then on a fine-tuned one, on the same
prompts with the same tree and dtype: their ratio is the drift. Greedy, so the probe itself
is deterministic; it is a measurement of the drafter, never of the output (decoding is
lossless either way).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from draftsmith.decode.build import load_preset, proposer_for, proposer_name, resolve_hw
from draftsmith.decode.engine import generate, summarize
from draftsmith.models.checkpoint import write_atomic_text
from draftsmith.models.entry import CONF_DIR
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.vocab import IGNORE_INDEX

PROBE_FILE = "probe.json"
# the conf/decode preset decode='auto' means, per proposer (decode/build.py: proposer_name)
DEFAULT_DECODE = {"medusa": "medusa-default", "eagle": "eagle-dynamic", "peagle": "peagle-dynamic", "draft": "draft-chain"}


def probe_prompts(dataset, num_prompts: int) -> list[list[int]]:
    """The first num_prompts conversations of a tokenized split (input_ids, labels) -> their
    prompts: the tokens before the first supervised (assistant) token, i.e. the chat template
    up to and including the generation prompt."""
    prompts = []
    for i in range(len(dataset)):
        if len(prompts) == num_prompts:
            break
        example = dataset[i]
        ids, labels = list(example["input_ids"]), list(example["labels"])
        start = next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), None)
        if start:  # a conversation with a prompt and a supervised answer
            prompts.append([int(x) for x in ids[:start]])
    return prompts


def decode_preset(decode, drafter, hw: str = "gpu"):
    """decode: a preset name (conf/decode/<name>.yaml, sized for `hw`), a dict, or 'auto':
    DEFAULT_DECODE of its proposer, a Medusa tree cut to the drafter's number of heads."""
    if not isinstance(decode, str):
        return OmegaConf.create(OmegaConf.to_container(decode, resolve=True) if OmegaConf.is_config(decode) else decode)
    name = DEFAULT_DECODE[proposer_name(drafter)] if decode == "auto" else decode
    preset_path(name)  # a name that is no preset: refused as probe.decode, in one line
    preset = load_preset(name, hw)
    if decode == "auto" and drafter.kind == "medusa":
        kept = [p for p in preset.paths if len(p) <= drafter.config.num_heads]
        if len(kept) < len(preset.paths):
            preset.paths, preset.name = kept, f"{preset.name}, paths cut to {drafter.config.num_heads} heads"
    return preset


def preset_path(name: str) -> Path:
    path = CONF_DIR / "decode" / f"{name}.yaml"
    if not path.is_file():
        valid = ", ".join(sorted(p.stem for p in (CONF_DIR / "decode").glob("*.yaml")))
        raise DraftsmithError(f"probe.decode={name!r}: no conf/decode/{name}.yaml; valid: auto, {valid}")
    return path


FULL_PROBE = (16, 100)  # probe.num_prompts=auto: 16 prompts for a run of >= 100 steps, fewer in proportion (>= 2)


def probe_size(num_prompts, max_steps: int) -> int:
    """The prompts a run's probe decodes: probe.num_prompts, or for `auto` a share proportionate to
    the run (a 3-step debug run gets 2 prompts, not a probe longer than its training)."""
    if num_prompts != "auto":
        return int(num_prompts)
    full, steps = FULL_PROBE
    return max(2, min(full, round(full * int(max_steps) / steps)))


def check_config(probe_cfg) -> None:
    """Refuse a bad `probe` node before training (the probe itself runs after it)."""
    n, k, decode = probe_cfg.num_prompts, probe_cfg.max_new_tokens, probe_cfg.decode
    if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise DraftsmithError(f"probe.num_prompts={n}: an integer >= 0 (0 records no probe), or auto")
    if n and (not isinstance(k, int) or isinstance(k, bool) or k < 2):
        raise DraftsmithError(f"probe.max_new_tokens={k}: an integer >= 2 (the first token comes from the prefill, "
                              f"tau counts the ones after it)")
    if isinstance(decode, str) and decode != "auto":
        preset_path(decode)
    if probe_cfg.get("hw", "auto") != "auto":
        resolve_hw(probe_cfg.hw, "cpu", "probe.hw")


@torch.no_grad()
def measure(verifier, drafter, decode_cfg, prompts: list[list[int]], max_new_tokens: int, seed: int = 0,
            progress: bool = True) -> dict:
    """Greedy decoding of every prompt with the drafter -> {"tau", "per_prompt_tau", "tokens", "seconds"}."""
    proposer = proposer_for(drafter, verifier, decode_cfg, seed=seed)
    device = verifier.model.device
    outputs, t0 = [], time.time()
    bar = tqdm(prompts, desc="probe", unit="prompt", disable=not progress)
    for ids in bar:
        outputs.append(generate(verifier.model, torch.tensor([ids], device=device), proposer=proposer,
                                max_new_tokens=max_new_tokens))
        done = sum(len(o.tokens) for o in outputs)
        bar.set_postfix_str(f"{done / (time.time() - t0):.1f} tok/s, tau {summarize(outputs)['tau']:.2f}")
    bar.close()
    stats = summarize(outputs)
    return {"tau": stats["tau"], "per_prompt_tau": [summarize([o])["tau"] for o in outputs],
            "tokens": stats["num_tokens"], "seconds": round(time.time() - t0, 3)}


def record(verifier, drafter, decode, prompts: list[list[int]], max_new_tokens: int, hw: str = "auto") -> dict:
    """The probe.json content: the prompts, settings and the drafter's tau on this verifier; a
    preset by name is sized for `hw` (auto: cpu when the verifier is on a CPU)."""
    decode_cfg = decode_preset(decode, drafter, resolve_hw(hw, verifier.model.device))
    result = measure(verifier, drafter, decode_cfg, prompts, max_new_tokens)
    return remeasured({"prompts": prompts, "max_new_tokens": int(max_new_tokens),
                       "decode": OmegaConf.to_container(decode_cfg, resolve=True)}, verifier, result)


def remeasured(probe: dict, verifier, result: dict) -> dict:
    """A probe's prompts and settings with a new measurement (measure's result) on `verifier`:
    the probe.json of a drafter measured on that verifier."""
    return {"prompts": probe["prompts"], "max_new_tokens": int(probe["max_new_tokens"]), "decode": probe["decode"],
            "dtype": str(verifier.model.dtype), "verifier_fingerprint": verifier.fingerprint,
            "verifier_name": verifier.name, **{k: result[k] for k in ("tau", "per_prompt_tau", "tokens", "seconds")}}


def write_probe(drafter_dir: str | Path, probe: dict) -> Path:
    """drafter_dir/probe.json, atomically (temporary file, fsync, rename)."""
    return write_atomic_text(Path(drafter_dir) / PROBE_FILE, json.dumps(probe, indent=1))


def read_probe(drafter_dir: str | Path) -> dict | None:
    """The recorded probe of a drafter folder, or None (a drafter from before probes, or public)."""
    path = Path(drafter_dir) / PROBE_FILE
    if not path.is_file():
        return None
    try:
        probe = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"drafter={drafter_dir}: {PROBE_FILE} is corrupt ({e}); delete it to re-record "
                              f"the probe") from None
    missing = [k for k in ("prompts", "max_new_tokens", "decode", "dtype", "tau") if k not in probe]
    if missing:
        raise DraftsmithError(f"drafter={drafter_dir}: {PROBE_FILE} lacks {', '.join(missing)}; delete it to "
                              f"re-record the probe")
    return probe
