"""Drafter folders as the serving engines read them, and the public layouts draftsmith imports.

One table per direction, facts read from the engines' loaders (not their code):

  kind    ours = vLLM names                          vLLM loader                       SGLang loader
  medusa  blocks.{k}.layers.{l}, lm_heads.{k},       models/medusa.py (MedusaModel)    none (refused)
          token_map; shared head -> lm_head.weight
          + original_lm_head
  eagle1  fc (2H->H, no bias), layers.0.* without    models/llama_eagle.py             models/llama_eagle.py
          input_layernorm, no final norm             (EagleLlamaForCausalLM)           (LlamaForCausalLMEagle)
  eagle3  fc (3H->H), midlayer.*, norm, lm_head,     models/llama_eagle3.py            models/llama_eagle3.py
          d2t offsets, t2d bool                      (LlamaForCausalLMEagle3)          (same architecture)
  draft   a plain HF causal-LM folder                draft_model method                STANDALONE algorithm

EAGLE-3 capture points: ours are verifier layer OUTPUTS (0-based, HF hidden_states[i + 1]);
vLLM's `eagle_aux_hidden_state_layer_ids` (top level of config.json) name hidden_states[j],
so j = i + 1; SGLang's (`eagle_config.eagle_aux_hidden_state_layer_ids`) add 1 themselves, so
they are ours. A config naming none means hidden_states[2], [L//2], [L-3] in both engines =
ours [1, L//2 - 1, L - 4] (models.verifier.default_fusion_layers).

Both engines capture each verifier layer ONCE, in ascending order (vLLM 0.32:
`aux_hidden_state_layers = tuple(sorted(set(ids)))`, models/interfaces.py; SGLang: the decoder's
layer loop appends the state of each listed layer as it passes it) and concatenate those states
in that order for fc. So an export refuses repeated fusion layers (vLLM's fc would get 2H inputs
for 3H weights) and writes fusion layers given out of order sorted, fc's column blocks permuted
to match (`engine_fusion_order`): the same drafter, in the order the engine feeds it.

The speculators format (vllm-project/speculators: src/speculators/config.py,
models/eagle3/config.py, convert/eagle/eagle3_converter.py), which vLLM detects by the
`speculators_config` key (vllm/transformers_utils/configs/speculators/): a top-level
`speculators_model_type` ("eagle3"), `speculators_version`, `transformer_layer_config` (the
drafter's Llama config; vocab_size = the verifier's), `speculators_config` {algorithm,
proposal_methods [{proposal_type "greedy", speculative_tokens, ...}], default_proposal_method,
verifier {name_or_path, architectures}}, and EAGLE-3's draft_vocab_size, norm_before_residual
(vLLM reads a missing key as TRUE, speculators as false: always written), target_hidden_size,
eagle_aux_hidden_state_layer_ids (vLLM's indexing: hidden_states[j]); weights `layers.0.*` for
`midlayer.*`. `vllm serve <folder>` loads the verifier named in it, with no method given.

P-EAGLE (an EAGLE-3 drafter with parallel_tokens = K, models/eagle.py) is vLLM's EAGLE-3 with
parallel drafting (vLLM 0.32: llama_eagle3.py + llm_base_proposer.py; the loader since vLLM PR
#32887): the EAGLE-3 folder plus `mask_hidden` ((L*H,) weights, fc's input space, which vLLM
projects with fc once at load) and the mask token in config.json (`mask_token_id`, the first key
the proposer reads; `pard_token` and `ptd_token_id` are its fallbacks). vLLM format: architecture
LlamaForCausalLMEagle3 (vLLM's EAGLEConfig would rename PeagleLlamaForCausalLM to an unknown
Eagle3PeagleLlamaForCausalLM), served with speculative_config {"method": "eagle3",
"parallel_drafting": true}; draftsmith also writes `parallel_tokens` (the depths trained, which
vLLM ignores). Speculators format: speculators_model_type "peagle" with mask_token_id, which vLLM
maps to method eagle3 + parallel_drafting and architecture PeagleLlamaForCausalLM. SGLang and
llama.cpp have no P-EAGLE loader: refused.

Public layouts imported (`import_public`): SpecForge / official EAGLE-3 folders, official
EAGLE-1 folders (yuhuili/EAGLE-*: fc with a bias, pytorch_model.bin), FasterDecoding Medusa
heads (medusa_lm_head.safetensors / .pt: `{k}.{l}.linear.*` then `{k}.{num_layers}.weight`),
vLLM Medusa folders, speculators EAGLE-3 folders, and draftsmith's own folders (config.json
carries a `draftsmith` block).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.models.errors import DraftsmithError

ENGINES = ("vllm", "sglang")
VLLM_CHECKED = "0.32.0"  # the vLLM these layouts were loaded in and drafted with (tests/engines/test_vllm.py)
SPECULATORS_VERSION = "0.7.0"  # the speculators release whose config format the export writes

EAGLE_ARCHITECTURES = {"eagle1": {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"},
                       "eagle3": {"vllm": "LlamaForCausalLMEagle3", "sglang": "LlamaForCausalLMEagle3"}}


def llama_keys(layer_config) -> dict:
    """The Llama config keys both engines read for a one-layer EAGLE drafter."""
    lc = layer_config
    rope = dict(getattr(lc, "rope_parameters", None) or {})
    out = {"model_type": "llama", "hidden_size": lc.hidden_size, "intermediate_size": lc.intermediate_size,
           "num_hidden_layers": 1, "num_attention_heads": lc.num_attention_heads,
           "num_key_value_heads": lc.num_key_value_heads, "head_dim": lc.head_dim, "hidden_act": lc.hidden_act,
           "rms_norm_eps": lc.rms_norm_eps, "max_position_embeddings": lc.max_position_embeddings,
           "vocab_size": lc.vocab_size, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "rope_theta": rope.get("rope_theta", 10000.0), "rope_parameters": rope}
    if rope.get("rope_type", "default") != "default":  # transformers-4 readers (vLLM) take rope_scaling
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def vllm_method(kind: str, config) -> str:
    """vLLM's speculative_config method for a drafter."""
    if kind == "eagle":
        return "eagle3" if config.variant == "eagle3" else "eagle"
    return {"medusa": "medusa", "draft": "draft_model"}[kind]


def engine_fusion_order(fusion_layers, fmt: str) -> list[int]:
    """-> p, the order in which the engines feed EAGLE-3's captured states to fc: fc's input block b
    is fusion_layers[p[b]] (each layer once, ascending). Repeated layers are refused: both engines
    capture a layer once, and fc would get fewer states than it has weights for."""
    layers = [int(i) for i in fusion_layers]
    if len(set(layers)) != len(layers):
        raise DraftsmithError(f"format={fmt}: this EAGLE-3 drafter fuses verifier layers {layers}, one of them twice; "
                              f"vLLM and SGLang capture each layer once (vLLM {VLLM_CHECKED}: "
                              f"sorted(set(ids))), so fc would get {len(set(layers))} states for {len(layers)}; "
                              f"retrain with distinct method.fusion_layers (e.g. the default, null)")
    return sorted(range(len(layers)), key=layers.__getitem__)


def speculators_config(config, layer_config, verifier: str, verifier_architectures: list[str], dtype: str,
                       speculative_tokens: int) -> dict:
    """config.json of an EAGLE-3 (or P-EAGLE) drafter in the speculators format (fusion layers
    already ascending)."""
    layer = {**llama_keys(layer_config), "architectures": ["LlamaForCausalLM"], "torch_dtype": dtype}
    algorithm = "peagle" if config.parallel_tokens else "eagle3"
    extra = {"mask_token_id": int(config.mask_token_id)} if config.parallel_tokens else {}
    return {
        "architectures": ["PEagleSpeculator" if config.parallel_tokens else "Eagle3Speculator"],
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
        "draft_vocab_size": config.num_draft_tokens, "norm_before_residual": bool(config.norm_before_residual),
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in config.fusion_layers],
        "torch_dtype": dtype, **extra}


def engine_config(kind: str, config, layer_config=None, engine: str = "vllm", dtype: str = "float32") -> dict:
    """config.json of a drafter folder for `engine` (draftsmith's own folders are the vLLM one)."""
    if kind == "medusa":
        if engine != "vllm":
            raise DraftsmithError(f"format={engine} cannot express Medusa heads (no Medusa loader in {engine}); "
                                  f"use format=vllm")
        return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size, "num_heads": config.num_heads,
                "num_hidden_layers": config.num_layers, "truncated_vocab_size": config.out_size,
                "medusa_fc_bias": True, "original_lm_head": config.lm_head == "shared", "max_paths": 64, "topk": 10,
                "torch_dtype": dtype}
    if kind != "eagle":
        raise DraftsmithError(f"no engine config for drafter kind {kind!r}")
    if config.parallel_tokens and engine != "vllm":
        raise DraftsmithError(f"format={engine}: {engine} has no P-EAGLE (parallel drafting) loader; use format=vllm "
                              f"or format=speculators (vLLM {VLLM_CHECKED} loads it)")
    out = {"architectures": [EAGLE_ARCHITECTURES[config.variant][engine]], **llama_keys(layer_config),
           "torch_dtype": dtype}
    if config.variant == "eagle3":
        out.update(draft_vocab_size=config.num_draft_tokens, target_hidden_size=config.hidden_size,
                   norm_before_residual=config.norm_before_residual)
        if engine == "vllm":
            out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config.fusion_layers]
            out["eagle_config"] = {"use_aux_hidden_state": True}
            if config.parallel_tokens:  # P-EAGLE: vLLM's proposer reads mask_token_id; parallel_tokens is ours
                out.update(mask_token_id=int(config.mask_token_id), parallel_tokens=int(config.parallel_tokens))
        else:
            out["eagle_config"] = {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": list(config.fusion_layers)}
    return out


# ---------------------------------------------------------------------------------------------
# Import


def read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The first of `names` present in folder: safetensors, or a torch pickle of tensors only."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(str(path))
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as e:
            raise DraftsmithError(f"drafter={folder}: {name} is unreadable ({type(e).__name__}: {e})") from None
        if not isinstance(state, dict):
            raise DraftsmithError(f"drafter={folder}: {name} holds no state dict")
        return state
    raise DraftsmithError(f"drafter={folder}: no weights ({' or '.join(names)})")


def check_verifier(folder, hidden: int, vocab: int, verifier_dims: tuple[int, int] | None) -> None:
    if verifier_dims is not None and (hidden, vocab) != tuple(verifier_dims):
        raise DraftsmithError(f"drafter={folder} has hidden size {hidden} and a {vocab}-token vocabulary; the "
                              f"verifier has {verifier_dims[0]} and {verifier_dims[1]}: it was trained for another "
                              f"verifier")


def import_medusa(folder: Path, spec: dict, state: dict, verifier_dims):
    """FasterDecoding `{k}.{l}.linear.*` + `{k}.{L}.weight`, or vLLM `blocks.* / lm_heads.*` -> ours."""
    from draftsmith.models.medusa import MedusaConfig

    if any(k.startswith("blocks.") for k in state):  # vLLM MedusaModel
        num_heads = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
        num_layers = len({k.split(".")[3] for k in state if k.startswith("blocks.0.layers.")})
        out = {k: v for k, v in state.items() if k.startswith(("blocks.", "lm_heads.", "token_map"))}
        shared = "lm_head.weight" in state or spec.get("original_lm_head", False)
        if shared:  # one head weight (vLLM gathers a full-vocabulary one by token_map): own rows per head
            lm = state.get("lm_head.weight", state.get("lm_heads.0.weight"))
            if "token_map" in state and lm.shape[0] > state["token_map"].numel():
                lm = lm[state["token_map"].long()]
            out = {k: v for k, v in out.items() if not k.startswith("lm_heads.")}
            out.update({f"lm_heads.{k}.weight": lm.clone() for k in range(num_heads)})
    else:  # FasterDecoding: medusa_head = ModuleList(Sequential(*[ResBlock] * L, Linear))
        num_heads = 1 + max(int(k.split(".")[0]) for k in state)
        num_layers = int(spec.get("medusa_num_layers", 1))
        out = {}
        for k in range(num_heads):
            for layer in range(num_layers):
                for p in ("weight", "bias"):
                    out[f"blocks.{k}.layers.{layer}.{p}"] = state[f"{k}.{layer}.linear.{p}"]
            out[f"lm_heads.{k}.weight"] = state[f"{k}.{num_layers}.weight"]
    hidden = out["blocks.0.layers.0.weight"].shape[1] if num_layers else out["lm_heads.0.weight"].shape[1]
    vocab = int(spec.get("vocab_size") or out["lm_heads.0.weight"].shape[0])
    draft = out["token_map"].numel() if "token_map" in out and out["token_map"].numel() < vocab else None
    if draft is None:
        out.pop("token_map", None)
    check_verifier(folder, hidden, vocab, verifier_dims)
    config = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                          lm_head="own", draft_vocab_size=draft)
    return "medusa", config, out


def import_eagle(folder: Path, spec: dict, state: dict, verifier_dims, verifier_num_layers: int | None):
    """Official / SpecForge EAGLE-1 and EAGLE-3 folders -> ours (an embed_tokens copy is dropped:
    the verifier's is used, as both engines do)."""
    from draftsmith.models.eagle import EagleConfig
    from draftsmith.models.verifier import default_fusion_layers

    state = {k.removeprefix("model."): v for k, v in state.items() if "embed_tokens" not in k}
    hidden, vocab = int(spec["hidden_size"]), int(spec["vocab_size"])
    check_verifier(folder, hidden, vocab, verifier_dims)
    decoder = {k: v for k, v in spec.items()
               if k not in ("architectures", "draft_vocab_size", "eagle_config", "norm_before_residual",
                            "mask_token_id", "parallel_tokens")}
    decoder["model_type"] = "llama"
    if "midlayer.hidden_norm.weight" in state:
        if "eagle_aux_hidden_state_layer_ids" in spec:  # vLLM indexing: hidden_states[j] = output of j - 1
            layers = [int(j) - 1 for j in spec["eagle_aux_hidden_state_layer_ids"]]
        elif (spec.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):  # SGLang = ours
            layers = [int(j) for j in spec["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        elif verifier_num_layers is not None:
            layers = default_fusion_layers(verifier_num_layers)
        else:
            raise DraftsmithError(f"drafter={folder} names no capture layers; load it against a verifier "
                                  f"(its layer count gives the engines' default)")
        n = int(spec.get("draft_vocab_size") or vocab)
        if "lm_head.weight" not in state:
            if n < vocab:
                raise DraftsmithError(f"drafter={folder}: a {n}-token draft vocabulary but no lm_head.weight")
            config = EagleConfig(hidden, vocab, decoder, variant="eagle3", fusion_layers=layers,
                                 norm_before_residual=bool(spec.get("norm_before_residual", False)),
                                 **parallel_keys(folder, spec, state))  # verifier's lm_head
            return "eagle", config, {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
        parallel = parallel_keys(folder, spec, state)
        if n < vocab and "d2t" not in state:
            raise DraftsmithError(f"drafter={folder}: draft_vocab_size {n} < vocabulary {vocab} but no d2t tensor")
        state.setdefault("d2t", torch.zeros(n, dtype=torch.long))  # offsets 0: the first n ids (all of them)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(n) + state["d2t"].long()] = True
        state["t2d"] = t2d  # recomputed from d2t: the two cannot disagree
        config = EagleConfig(hidden, vocab, decoder, variant="eagle3", fusion_layers=layers,
                             draft_vocab_size=n, lm_head="own",
                             norm_before_residual=bool(spec.get("norm_before_residual", False)), **parallel)
        return "eagle", config, state
    config = EagleConfig(hidden, vocab, decoder, variant="eagle1", fc_bias="fc.bias" in state)
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # EAGLE-1 uses the verifier's
    return "eagle", config, state


def parallel_keys(folder: Path, spec: dict, state: dict) -> dict:
    """A P-EAGLE folder's EagleConfig keys (mask_hidden in the weights), else {}."""
    if "mask_hidden" not in state:
        return {}
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)  # vLLM reads any shape as (1, L*H)
    if spec.get("mask_token_id") is None or spec.get("parallel_tokens") is None:
        raise DraftsmithError(f"drafter={folder} is a P-EAGLE drafter (mask_hidden) whose config.json lacks "
                              f"mask_token_id or parallel_tokens (the depths it was trained for); add them")
    return {"parallel_tokens": int(spec["parallel_tokens"]), "mask_token_id": int(spec["mask_token_id"])}


def from_speculators(folder: Path, spec: dict, state: dict) -> tuple[dict, dict]:
    """A speculators EAGLE-3 folder's (config.json, weights) -> the vLLM-format ones import_eagle reads."""
    kind = spec.get("speculators_model_type")
    if kind not in ("eagle3", "peagle"):
        raise DraftsmithError(f"drafter={folder} is a speculators {kind!r} model; draftsmith imports speculators "
                              f"eagle3 and peagle folders only")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if spec.get(key):
            raise DraftsmithError(f"drafter={folder} sets {key}=true; draftsmith's EAGLE-3 has no such variant")
    if "norm_before_residual" not in spec:
        raise DraftsmithError(f"drafter={folder} has no norm_before_residual: vLLM reads it as true, speculators as "
                              f"false; add the key to its config.json")
    layer = spec.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "llama") != "llama":
        raise DraftsmithError(f"drafter={folder}: transformer_layer_config must be a Llama layer's config "
                              f"(model_type llama), got {layer if not isinstance(layer, dict) else layer.get('model_type')!r}")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise DraftsmithError(f"drafter={folder} has {layer['num_hidden_layers']} decoder layers; draftsmith's "
                              f"EAGLE-3 has one")
    if spec.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise DraftsmithError(f"drafter={folder}: target_hidden_size {spec['target_hidden_size']} differs from the "
                              f"layer's hidden_size {layer.get('hidden_size')}; draftsmith's EAGLE-3 needs them equal")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "torch_dtype", "dtype")}
    flat.update(model_type="llama", architectures=["LlamaForCausalLMEagle3"], norm_before_residual=spec[
        "norm_before_residual"], draft_vocab_size=spec.get("draft_vocab_size") or layer.get("vocab_size"))
    if spec.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = spec["eagle_aux_hidden_state_layer_ids"]
    if kind == "peagle":  # the depths: the proposal method's speculative_tokens
        if any("embed_tokens" in k for k in state):
            raise DraftsmithError(f"drafter={folder} is a speculators P-EAGLE with its own embed_tokens (trained); "
                                  f"draftsmith's P-EAGLE reads the verifier's embedding and cannot import it")
        methods = (spec.get("speculators_config") or {}).get("proposal_methods") or [{}]
        flat.update(mask_token_id=spec.get("mask_token_id"), parallel_tokens=methods[0].get("speculative_tokens"))
    state = {"midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k: v for k, v in state.items()}
    return flat, state


def import_public(folder: Path, verifier_dims: tuple[int, int] | None = None,
                  verifier_num_layers: int | None = None):
    """-> (kind, config, state) for a folder in one of the public layouts, or None if none matches
    (then the caller treats it as a plain HF draft model)."""
    spec = {}
    if (folder / "config.json").is_file():
        try:
            spec = json.loads((folder / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"drafter={folder}: config.json is corrupt ({e})") from None
    if any((folder / f).is_file() for f in ("medusa_lm_head.safetensors", "medusa_lm_head.pt")):
        return import_medusa(folder, spec, read_weights(folder, ("medusa_lm_head.safetensors", "medusa_lm_head.pt")),
                             verifier_dims)
    arch = " ".join(spec.get("architectures") or [])
    if spec.get("model_type") == "medusa" or "MedusaModel" in arch:
        return import_medusa(folder, spec, read_weights(folder, ("model.safetensors", "pytorch_model.bin")),
                             verifier_dims)
    weights = ("model.safetensors", "pytorch_model.bin")
    if "speculators_model_type" in spec:
        spec, state = from_speculators(folder, spec, read_weights(folder, weights))
        return import_eagle(folder, spec, state, verifier_dims, verifier_num_layers)
    if "Eagle" in arch or "eagle_config" in spec:
        return import_eagle(folder, spec, read_weights(folder, weights), verifier_dims, verifier_num_layers)
    if spec and int(spec.get("num_hidden_layers", 0)) == 1 and any((folder / w).is_file() for w in weights):
        state = read_weights(folder, weights)
        if "fc.weight" in state or "model.fc.weight" in state:  # official EAGLE-1: architectures LlamaForCausalLM
            return import_eagle(folder, spec, state, verifier_dims, verifier_num_layers)
    return None
