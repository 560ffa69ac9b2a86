"""Draft models: a small causal LM sharing the verifier's tokenizer (classic speculative decoding).

Students (`method.student.init`):
- truncate (default): the verifier's own family with its first N decoder layers, embeddings,
  final norm and lm_head copied. Before any training it already reproduces the verifier's
  first N layers exactly, a cheap and strong starting point (DistillSpec, LayerSkip).
- config: a fresh model of the verifier's family at a chosen size (layers, hidden, heads,
  intermediate); embeddings and lm_head copied when the hidden size matches.
- pretrained: any local HF causal LM folder with the same vocabulary (e.g. SmolLM2-135M as the
  draft of SmolLM2-1.7B).

A trained draft is saved as a normal HF model folder (config.json + model.safetensors +
tokenizer) plus meta.json with the verifier fingerprint, so HF `generate(assistant_model=...)`,
vLLM and draftsmith's own decoder all load it.

Reduced draft vocabulary (`method.draft_vocab_size=N`): the folder also holds
draft_vocab.safetensors, {"d2t": (N,) int64}, the N verifier ids most frequent among the
training targets in increasing order (models/vocab.py). The model keeps its whole lm_head, so
HF and vLLM load it unchanged; draftsmith's decoder projects onto those N rows only
(decode/draft.py), which cuts the V x h projection that dominates a small draft's step.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, PreTrainedModel

from draftsmith.models.checkpoint import check_fingerprint, read_meta, write_atomic_dir
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import NO_HUB_KERNELS, gathered
from draftsmith.models.vocab import is_draft_vocab

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # {"d2t": (N,) int64 verifier ids}, beside the HF files


def causal_lm(config, dtype: torch.dtype) -> PreTrainedModel:
    """A randomly initialised causal LM of config's family, built directly rather than with
    from_config, which under DeepSpeed ZeRO-3 would partition it at birth (before the copied
    weights go in) and draw other random numbers than a 1-process run."""
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).to(dtype)


def truncated_student(verifier: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The verifier's first `num_layers` decoder layers + embeddings + final norm + lm_head."""
    total = verifier.config.num_hidden_layers
    if not 0 < num_layers < total:
        raise DraftsmithError(f"method.student.num_layers={num_layers}: must be 1..{total - 1} "
                              f"(the verifier has {total} layers)")
    config = verifier.config.__class__.from_dict(verifier.config.to_dict())
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (sliding / full) follow the layers
        config.layer_types = config.layer_types[:num_layers]
    student = causal_lm(config, verifier.dtype)
    state = {}
    for k, v in verifier.state_dict().items():
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers:
            with gathered(verifier, k, v) as full:  # a ZeRO-3-partitioned verifier: the whole tensor
                state[k] = full.detach().clone()
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise DraftsmithError(f"cannot truncate {config.model_type}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return student


def fresh_student(verifier: PreTrainedModel, student_cfg) -> PreTrainedModel:
    """A new model of the verifier's family at the size given by method.student.*."""
    config = verifier.config.__class__.from_dict(verifier.config.to_dict())
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads"):
        value = student_cfg.get(key.replace("num_hidden_layers", "num_layers"))
        if value is not None:
            setattr(config, key, int(value))
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    if hasattr(config, "head_dim"):
        config.head_dim = config.hidden_size // config.num_attention_heads
    student = causal_lm(config, verifier.dtype)
    if config.hidden_size == verifier.config.hidden_size:  # same width: start from the verifier's vocab rows
        student.get_input_embeddings().weight.data.copy_(verifier.get_input_embeddings().weight.data)
        if not config.tie_word_embeddings:
            student.get_output_embeddings().weight.data.copy_(verifier.get_output_embeddings().weight.data)
    return student


def pretrained_student(path: str, verifier: PreTrainedModel, verifier_tokenizer) -> PreTrainedModel:
    folder = Path(str(path)).expanduser()
    if not (folder / "config.json").is_file():
        raise DraftsmithError(f"method.student.path={path}: not a local HF model folder (no config.json)")
    config = AutoConfig.from_pretrained(folder)
    vocab = getattr(config, "vocab_size", None)
    if vocab != verifier.config.vocab_size:
        raise DraftsmithError(f"method.student.path={path}: vocabulary of {vocab} tokens, the verifier has "
                              f"{verifier.config.vocab_size}; a draft must share the verifier's tokenizer")
    try:
        from transformers import AutoTokenizer

        if AutoTokenizer.from_pretrained(folder).get_vocab() != verifier_tokenizer.get_vocab():
            raise DraftsmithError(f"method.student.path={path}: same vocabulary size but another tokenizer; "
                                  f"a draft must share the verifier's tokenizer")
    except OSError:
        pass  # no tokenizer files: the size check above is what we can do
    return AutoModelForCausalLM.from_pretrained(folder, dtype=verifier.dtype, **NO_HUB_KERNELS)


# method.student keys read by one init only (null in the presets): set under another init they
# would be ignored, so they are refused. num_layers and trainable are read by more than one.
STUDENT_KEYS_OF_INIT = {"hidden_size": "config", "intermediate_size": "config", "num_attention_heads": "config",
                        "num_key_value_heads": "config", "path": "pretrained"}


def check_student_keys(student_cfg) -> None:
    """Refuse a method.student key that method.student.init would ignore, in one line."""
    init = student_cfg.get("init")
    for key, reader in STUDENT_KEYS_OF_INIT.items():
        value = student_cfg.get(key)
        if value is not None and init != reader:
            raise DraftsmithError(f"method.student.{key}={value} would be ignored: it is read by "
                                  f"method.student.init={reader} only (init={init}); pass "
                                  f"method.student.init={reader}, or drop it")


def build_student(verifier: PreTrainedModel, verifier_tokenizer, student_cfg) -> PreTrainedModel:
    """method.student -> a trainable causal LM with the verifier's vocabulary."""
    check_student_keys(student_cfg)
    builders = {"truncate": lambda: truncated_student(verifier, int(student_cfg.num_layers)),
                "config": lambda: fresh_student(verifier, student_cfg),
                "pretrained": lambda: pretrained_student(student_cfg.get("path"), verifier, verifier_tokenizer)}
    student = choose(builders, student_cfg.init, "method.student.init")()
    student.generation_config.pad_token_id = verifier_tokenizer.pad_token_id
    student.train().requires_grad_(True)
    frozen_vocab = choose({"all": False, "body": True}, student_cfg.get("trainable", "all"), "method.student.trainable")
    if frozen_vocab:  # embeddings and lm_head (the verifier's, or a pretrained student's own) stay as they are
        if student_cfg.init == "config" and student.config.hidden_size != verifier.config.hidden_size:
            raise DraftsmithError(f"method.student.trainable=body keeps the embeddings frozen, but a "
                                  f"hidden_size={student.config.hidden_size} student has fresh random ones; "
                                  f"use method.student.trainable=all")
        student.get_input_embeddings().requires_grad_(False)
        student.get_output_embeddings().requires_grad_(False)
    return student


def save_draft_model(out_dir: str | Path, model: PreTrainedModel, tokenizer, *, verifier_fingerprint: str,
                     verifier_name: str, meta: dict | None = None, state_dict: dict | None = None,
                     resolved_config_yaml: str | None = None, draft_vocab: torch.Tensor | None = None) -> Path:
    """An HF model folder (one model.safetensors) + tokenizer + generation_config.json + meta.json,
    written atomically: what HF assisted generation (`assistant_model=`), vLLM's draft_model
    method and SGLang's STANDALONE algorithm load as they stand.

    generation_config.json carries the draft schedule of conf/decode/draft-chain.yaml as HF
    reads it: num_assistant_tokens 4, the heuristic schedule (+2 after a fully accepted draft,
    -1 otherwise) and no confidence cut (HF's default stops drafting below 0.4).
    `draft_vocab` (N,): the reduced vocabulary our decoder drafts from (DRAFT_VOCAB_FILE)."""
    generation = copy.deepcopy(model.generation_config)
    generation.num_assistant_tokens = 4
    generation.num_assistant_tokens_schedule = "heuristic"
    generation.assistant_confidence_threshold = 0.0

    def write(tmp: Path):
        model.save_pretrained(tmp, state_dict=state_dict, max_shard_size="1000GB")
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"kind": "draft", "verifier_fingerprint": verifier_fingerprint, "verifier_name": verifier_name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **(meta or {})}
        (tmp / "meta.json").write_text(json.dumps(info, indent=2, default=str))
        if resolved_config_yaml is not None:
            (tmp / "config.yaml").write_text(resolved_config_yaml)
        if draft_vocab is not None:
            save_file({"d2t": draft_vocab.detach().to("cpu", torch.long).contiguous()}, str(tmp / DRAFT_VOCAB_FILE))

    return write_atomic_dir(out_dir, write)


def read_draft_vocab(ckpt_dir: Path, vocab_size: int) -> torch.Tensor | None:
    """The folder's reduced draft vocabulary d2t (N,), checked, or None when it has none."""
    path = ckpt_dir / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        d2t = load_file(str(path))["d2t"]
    except Exception as e:  # a torn or foreign file
        raise DraftsmithError(f"drafter={ckpt_dir}: {DRAFT_VOCAB_FILE} is corrupt ({type(e).__name__}); "
                              f"delete it to draft from the whole vocabulary") from None
    if not is_draft_vocab(d2t, vocab_size):
        raise DraftsmithError(f"drafter={ckpt_dir}: {DRAFT_VOCAB_FILE} is not an increasing list of token ids "
                              f"below {vocab_size}; delete it to draft from the whole vocabulary")
    return d2t.long()


def load_draft_model(ckpt_dir: str | Path, *, verifier_fingerprint: str | None = None,
                     allow_mismatch: bool = False, dtype: torch.dtype | None = None,
                     vocab_size: int | None = None) -> tuple[PreTrainedModel, dict]:
    """-> (frozen eval-mode model, meta). Any HF causal LM folder works; a draftsmith-trained
    one also carries meta.json, whose verifier fingerprint is checked. A reduced draft
    vocabulary (DRAFT_VOCAB_FILE) becomes the model's non-persistent buffer `draft_vocab` (N,):
    it moves with the model and is never written into its weights."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "meta.json").is_file():
        meta = read_meta(ckpt_dir)
        check_fingerprint(ckpt_dir, meta, verifier_fingerprint, allow_mismatch)
    elif (ckpt_dir / "config.json").is_file():
        meta = {"kind": "draft", "note": "plain HF model folder, not trained by draftsmith"}
    else:
        raise DraftsmithError(f"drafter={ckpt_dir}: not a draft model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=dtype, **NO_HUB_KERNELS)
    if vocab_size is not None and model.config.vocab_size != vocab_size:
        raise DraftsmithError(f"drafter={ckpt_dir}: vocabulary of {model.config.vocab_size} tokens, the verifier "
                              f"has {vocab_size}; a draft must share the verifier's tokenizer")
    d2t = read_draft_vocab(ckpt_dir, model.config.vocab_size)
    if d2t is not None:
        model.register_buffer("draft_vocab", d2t, persistent=False)
    return model.eval().requires_grad_(False), meta
