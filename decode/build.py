"""Building a proposer: the one place that turns a config, a drafter folder or a loaded drafter
into the proposer the engine drives (decode/proposers.py holds the protocol and the registry of
proposer classes, make_proposer).

    kind = check_drafter(cfg)                            # proposer.kind, refused before the verifier loads
    proposer, meta = build_proposer(cfg, verifier)       # the proposer (None: plain decoding)
    proposer = proposer_for(drafter, verifier, preset)   # a loaded drafter (models.checkpoint.load_drafter)
    preset = load_preset("eagle-dynamic", hw="cpu")      # a preset by name, as the entry scripts compose it

A decode preset (conf/decode/<name>.yaml) configures the tree and the grafts (prompt lookup, a
datastore: with_lookup; their keys live once, in conf/decode/graft/); `hw=cpu` sizes it for a CPU
(conf/decode_hw/cpu-<name>.yaml). A key the chosen proposer would ignore is refused in one line.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from draftsmith.decode.proposers import PROPOSERS, Proposer, make_proposer
from draftsmith.models.checkpoint import drafter_dir, load_drafter
from draftsmith.models.entry import CONF_DIR, compose_main
from draftsmith.models.errors import DraftsmithError, choose

HW = ("gpu", "cpu")  # conf/hw/: the hardware the decode presets are sized for


def resolve_hw(hw: str, device, field: str = "hw") -> str:
    """`auto` -> cpu when decoding runs on a CPU, else gpu; gpu / cpu as given; others refused."""
    if hw == "auto":
        return "cpu" if str(device).startswith("cpu") else "gpu"
    return choose({**dict(zip(HW, HW)), "auto": "auto"}, hw, field)


def load_preset(name: str, hw: str = "gpu", key: str = "decode"):
    """conf/decode/<name>.yaml composed as decode/evaluate.py composes decode=<name> hw=<hw>: its
    graft keys from conf/decode/graft/ and, for hw=cpu, conf/decode_hw/cpu-<name>.yaml over its
    sizes. `key` names the setting in the one-line error for a preset that does not exist."""
    if not (CONF_DIR / "decode" / f"{name}.yaml").is_file():
        valid = ", ".join(sorted(p.stem for p in (CONF_DIR / "decode").glob("*.yaml")))
        raise DraftsmithError(f"{key}={name!r}: no conf/decode/{name}.yaml; valid: {valid}")
    choose(dict(zip(HW, HW)), hw, "hw")
    return compose_main("evaluate", [f"decode={name}", f"hw={hw}"]).decode


def check_drafter(cfg) -> str:
    """The proposer's kind (conf/proposer/); one that needs a trained drafter without its folder is
    refused here, before the verifier loads (load_drafter checks the folder's contents)."""
    kind = choose(dict(zip(PROPOSERS, PROPOSERS)), cfg.proposer.kind, "proposer.kind")
    if kind == "vanilla" or kind in DRAFT_FREE:
        # a drafter the caller named would be ignored: refused. A config's own default drafter
        # (evaluate.yaml's outputs/medusa-${model.name}/final) is an interpolation, no request.
        if cfg.drafter is not None and not OmegaConf.is_interpolation(cfg, "drafter"):
            raise DraftsmithError(f"drafter={cfg.drafter} would be ignored: proposer={cfg.proposer.name} decodes "
                                  f"without a trained drafter; drop drafter=, or pick the proposer that decodes "
                                  f"with it (proposer=medusa, eagle or draft)")
        return kind
    if not cfg.drafter:
        raise DraftsmithError(f"proposer={cfg.proposer.name} needs a trained drafter: pass drafter=<checkpoint dir> "
                              f"(draftsmith's, or a public EAGLE / Medusa / HF draft folder)")
    drafter_dir(cfg.drafter)
    return kind


def build_proposer(cfg, verifier):
    """The proposer (None = plain decoding) and the drafter's metadata."""
    kind = check_drafter(cfg)
    if kind == "vanilla":
        return None, {}
    hint_hw(cfg, verifier.model.device)
    if kind in DRAFT_FREE:
        return build_draft_free(cfg, verifier, kind), {}
    drafter = load_drafter(cfg.drafter, verifier_fingerprint=verifier.fingerprint,
                           allow_mismatch=cfg.allow_fingerprint_mismatch,
                           verifier_dims=(verifier.config.hidden_size, verifier.lm_head.weight.shape[0]),
                           verifier_num_layers=verifier.config.num_hidden_layers, dtype=verifier.model.dtype)
    if drafter.kind != kind:
        raise DraftsmithError(f"drafter={cfg.drafter} is a {drafter.kind!r} checkpoint; "
                              f"proposer={cfg.proposer.name} needs {kind}")
    return proposer_for(drafter, verifier, cfg.decode, seed=cfg.seed), drafter.meta


def hint_hw(cfg, device) -> None:
    """One line when a preset sized for a GPU (hw=gpu, the default) decodes on a CPU and hw=cpu
    would size it for one (conf/decode_hw/cpu-<preset>.yaml exists)."""
    hw = cfg.get("hw")
    name = cfg.decode.get("name")
    if hw is not None and hw.get("name") == "gpu" and str(device).startswith("cpu") and name and \
            (CONF_DIR / "decode_hw" / f"cpu-{name}.yaml").is_file():
        print(f"draftsmith: decode={name} is sized for a GPU (hw=gpu, the default) and runs on the CPU: pass "
              f"hw=cpu for the CPU-sized tree (conf/decode_hw/cpu-{name}.yaml)", flush=True)


DRAFT_FREE = ("prompt_lookup", "lookahead")  # proposers that need no trained drafter
DECODE_PRESETS = {"prompt_lookup": "prompt-lookup", "lookahead": "lookahead"}


def build_draft_free(cfg, verifier, kind: str):
    """Proposers configured entirely by their decode preset."""
    d = cfg.decode
    if d.get("proposer") != kind:
        raise DraftsmithError(f"proposer={cfg.proposer.name} needs a {kind} decode preset and decode={d.name} is not "
                              f"one: pass decode={DECODE_PRESETS[kind]}")
    device = verifier.model.device
    if kind == "prompt_lookup":
        from draftsmith.decode.datastore import retrieval_for

        return make_proposer(kind, num_tokens=d.num_tokens, max_ngram=d.max_ngram, min_ngram=d.min_ngram,
                             num_matches=d.num_matches, device=device,
                             retrieval=retrieval_for(d, verifier.tokenizer))
    return make_proposer(kind, lm_head=verifier.lm_head, window=d.window, ngram=d.ngram, guess_set=d.guess_set,
                         pool_from_prompt=d.pool_from_prompt, seed=cfg.seed, device=device)


def eagle_tree(decode_cfg) -> dict:
    """EAGLE tree settings from a decode preset: a static path list, or EAGLE-2 depth/top_k/total_tokens."""
    if "paths" in decode_cfg:
        return {"paths": [tuple(p) for p in decode_cfg.paths]}
    missing = [k for k in ("depth", "top_k", "total_tokens") if decode_cfg.get(k) is None]
    if missing:
        raise DraftsmithError(f"decode={decode_cfg.name} has neither paths nor {', '.join(missing)}; "
                              f"use decode=eagle-chain, eagle-static or eagle-dynamic")
    return {k: int(decode_cfg[k]) for k in ("depth", "top_k", "total_tokens")}


def _medusa_from(drafter, verifier, d, seed):
    if "paths" not in d:
        raise DraftsmithError(f"decode={d.name} is a dynamic tree (EAGLE-2 only); proposer=medusa needs "
                              f"a static tree such as decode=medusa-small")
    if d.get("draft_quant", "none") != "none":  # an eagle-* preset's key: refused, not ignored
        raise DraftsmithError(f"decode.draft_quant={d.draft_quant}: int8 drafting is for EAGLE drafters and draft "
                              f"models; Medusa heads draft through the verifier's lm_head: set decode.draft_quant=none")
    if d.get("draft_weights", "auto") == "packed":  # auto: nothing of the heads' own to pack, as plain
        raise DraftsmithError("decode.draft_weights=packed: prepacked drafting is for EAGLE drafters; Medusa heads "
                              "draft through the verifier's lm_head: set decode.draft_weights=auto")
    return make_proposer("medusa", heads=drafter.module, paths=[tuple(p) for p in d.paths], lm_head=verifier.lm_head)


def proposer_name(drafter) -> str:
    """The proposer a loaded drafter decodes with: its kind, or peagle for an EAGLE drafter that drafts
    its depths in parallel (P-EAGLE: decode/peagle.py)."""
    return "peagle" if drafter.kind == "eagle" and getattr(drafter.config, "parallel_tokens", 0) else drafter.kind


def _eagle_from(drafter, verifier, d, seed):
    return make_proposer(proposer_name(drafter), drafter=drafter.module, embed_tokens=verifier.embed_tokens,
                         lm_head=verifier.lm_head, quant=d.get("draft_quant", "none"),
                         weights=d.get("draft_weights", "plain"), **eagle_tree(d))


def _draft_from(drafter, verifier, d, seed):
    if d.get("proposer") != "draft":
        raise DraftsmithError(f"a draft model needs a draft decode preset and decode={d.name} is not one: "
                              f"pass decode=draft-chain or draft-tree")
    # decode.draft_vocab: saved = the reduced vocabulary the draft folder holds (if any), full = all V rows
    saved = choose({"saved": True, "full": False}, d.get("draft_vocab", "saved"), "decode.draft_vocab")
    return make_proposer("draft", model=drafter.module, vocab_size=verifier.lm_head.weight.shape[0],
                         num_tokens=d.num_tokens, tree_topk=list(d.tree_topk), length_schedule=d.length_schedule,
                         min_tokens=d.min_tokens, max_tokens=d.max_tokens, confidence=d.confidence, seed=seed,
                         vocab_rows=getattr(drafter.module, "draft_vocab", None) if saved else None,
                         quant=d.get("draft_quant", "none"))


# drafter kind (models/checkpoint.py) -> proposer factory (drafter, verifier, decode preset, seed)
FROM_DRAFTER = {"medusa": _medusa_from, "eagle": _eagle_from, "draft": _draft_from}


def proposer_for(drafter, verifier, decode_cfg, seed: int = 0) -> Proposer:
    """The proposer of a loaded drafter (models.checkpoint.Drafter) on `verifier`, in its dtype and
    device, configured by a decode preset."""
    build = FROM_DRAFTER[drafter.kind]
    module = drafter.module.to(device=verifier.model.device, dtype=verifier.model.dtype)
    tokenizer = verifier.tokenizer if decode_cfg.get("datastore") else None  # the datastore is checked against it
    return with_lookup(build(drafter._replace(module=module), verifier, decode_cfg, seed), decode_cfg, tokenizer)


def with_lookup(proposer: Proposer, decode_cfg, tokenizer=None) -> Proposer:
    """Graft prompt lookup onto the drafter's tree when the preset asks (decode.lookup_tokens > 0;
    decode/lookup.py: PromptLookupGraft), and a corpus datastore's continuations when
    decode.datastore is set (decode/datastore.py; checked against the verifier's `tokenizer`):
    EAGLE and Medusa trees (deterministic), a draft model's when greedy (it samples its drafts
    at temperature > 0)."""
    from draftsmith.decode.datastore import retrieval_for  # numpy + safetensors, only when asked

    n = decode_cfg.get("lookup_tokens", 0)
    retrieval = retrieval_for(decode_cfg, tokenizer)
    if not n and retrieval is None:
        return proposer
    if proposer.name not in ("eagle", "peagle", "medusa", "draft"):
        what = f"decode.lookup_tokens={n}" if n else f"decode.datastore={decode_cfg.datastore}"
        raise DraftsmithError(f"{what}: the graft (prompt lookup, a datastore) grafts onto EAGLE, Medusa and "
                              f"draft-model trees only, not a {proposer.name} proposer's; "
                              f"set decode.lookup_tokens=0 decode.datastore=null")
    from draftsmith.decode.lookup import PromptLookupGraft  # decode/lookup.py imports decode/proposers.py

    return PromptLookupGraft(proposer, num_tokens=int(n), max_ngram=int(decode_cfg.get("lookup_max_ngram", 3)),
                             min_ngram=int(decode_cfg.get("lookup_min_ngram", 1)), retrieval=retrieval)
