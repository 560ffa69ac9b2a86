"""Accelerator, optimizer and schedule setup shared by every trainer.

One code path for every launch: `python train/X.py` (1 process), `accelerate launch` with
conf/accelerate/*.yaml (DDP, FSDP, DeepSpeed ZeRO-2/3; multi-node), or `torchrun`.

- `trainer.batch_size` is per process, unless `trainer.split_batches=true`: then it is the
  global batch, split across processes, so a step sees the same examples whatever the
  process count (1-process and N-process runs then train the same model, to rounding).
- The LR schedule advances once per optimizer step (not once per process, accelerate's
  default), so `trainer.max_steps` means the same schedule on 1 or 64 GPUs.
- DeepSpeed's batch fields are filled from the trainer config (they must agree, or DeepSpeed
  asserts); on a CPU box DeepSpeed runs over gloo.
- The frozen verifier is never in the optimizer; `place_frozen` puts it on each device, or
  shards it (ZeRO-3, FSDP) when the launch config shards parameters.
"""
from __future__ import annotations

import copy
import logging
import math
import os

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    InitProcessGroupKwargs,
    parse_flag_from_env,
    set_seed,
)
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import cpu_prepacks

PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
SCHEDULES = {"cosine": get_cosine_schedule_with_warmup, "constant": get_constant_schedule_with_warmup}


def process_state() -> PartialState:
    """The launch's processes for scripts that need no Accelerator (feature writing, self-
    distillation): honours ACCELERATE_USE_CPU like Accelerator does, and refuses a launch whose
    processes cannot see each other (each would redo all the work)."""
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_world(state.num_processes)
    return state


def check_world(num_processes: int) -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:
        raise DraftsmithError(
            f"the launcher started {launched} processes but accelerate sees {num_processes}: each would "
            f"work alone; on CPU launch with ACCELERATE_USE_CPU=1 (see conf/accelerate/cpu-2proc.yaml)")


# What `accelerate launch` puts in the environment when its config asks for an engine.
ENGINE_FLAGS = {"DeepSpeed": ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
                "FSDP": ("ACCELERATE_USE_FSDP", DistributedType.FSDP)}


def check_engine(acc: Accelerator) -> None:
    """Stop when the launch asked for DeepSpeed or FSDP and the accelerator is something else
    (e.g. ACCELERATE_USE_CPU=1 makes accelerate drop DeepSpeed and run DDP without a word)."""
    for engine, (flag, wanted) in ENGINE_FLAGS.items():
        if not parse_flag_from_env(flag) or acc.distributed_type == wanted:
            continue
        if parse_flag_from_env("ACCELERATE_USE_CPU"):
            fix = f"unset ACCELERATE_USE_CPU (on a CPU box {engine} runs over gloo without it)" if engine == "DeepSpeed" \
                else "accelerate's FSDP needs GPUs; on CPU use a DeepSpeed ZeRO-3 launch config (conf/accelerate/cpu-2proc-zero3.yaml)"
        elif engine == "FSDP" and not torch.cuda.is_available():
            fix = "accelerate's FSDP needs GPUs; on CPU use a DeepSpeed ZeRO-3 launch config (conf/accelerate/cpu-2proc-zero3.yaml)"
        else:
            fix = f"check that {engine} is installed and the launch config's {engine} section is valid"
        raise DraftsmithError(f"the launch asked for {engine} ({flag}=true) but accelerate would run "
                              f"{acc.distributed_type.value} without it; {fix}")


def emulated_precision(precision: str, device: torch.device) -> str | None:
    """A one-line warning when bf16 / fp16 training runs on a CPU that emulates them (an AVX2-only
    CPU has no oneDNN bf16 kernels: a quickstart Medusa step took 164 s in bf16, 10 s in fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if device.type == "cpu" and dtype is not None and not cpu_prepacks(dtype):
        return (f"warning: trainer.precision={precision} on this CPU ({torch.backends.cpu.get_cpu_capability()}) is "
                f"emulated, several times slower than fp32: pass trainer.precision=fp32 model.dtype=float32")
    return None


def make_accelerator(trainer_cfg, log_with=None, seed: int = 0) -> Accelerator:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file INFO lines on every save
    mixed = choose(PRECISIONS, trainer_cfg.precision, "trainer.precision")
    handlers = []
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and not torch.cuda.is_available():
        # accelerate picks no backend for DeepSpeed without GPUs; gloo makes CPU ranks see each other.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    acc = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=trainer_cfg.grad_accum,
                      log_with=log_with or None,
                      # (Accelerator's own split_batches= argument is accepted and ignored in accelerate 1.x)
                      dataloader_config=DataLoaderConfiguration(split_batches=bool(trainer_cfg.get("split_batches"))),
                      step_scheduler_with_optimizer=False, kwargs_handlers=handlers)
    check_world(acc.num_processes)
    check_engine(acc)
    if trainer_cfg.get("split_batches") and trainer_cfg.batch_size % acc.num_processes:
        raise DraftsmithError(f"trainer.batch_size={trainer_cfg.batch_size} is the global batch "
                              f"(trainer.split_batches=true) and must divide by the {acc.num_processes} processes")
    if acc.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_config(acc, trainer_cfg)
    set_seed(seed, device_specific=False)
    if trainer_cfg.threads and acc.device.type == "cpu":
        torch.set_num_threads(int(trainer_cfg.threads))
    return acc


def fill_deepspeed_config(acc: Accelerator, trainer_cfg) -> None:
    """DeepSpeed's batch, accumulation and clipping fields from the trainer config."""
    ds = acc.state.deepspeed_plugin.deepspeed_config
    micro = trainer_cfg.batch_size // acc.num_processes if trainer_cfg.get("split_batches") else trainer_cfg.batch_size
    wanted = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": trainer_cfg.grad_accum,
              "train_batch_size": micro * trainer_cfg.grad_accum * acc.num_processes,
              "gradient_clipping": float(trainer_cfg.max_grad_norm or 0.0)}
    for key, value in wanted.items():
        if ds.get(key, "auto") not in ("auto", value):
            raise DraftsmithError(f"the DeepSpeed config sets {key}={ds[key]} but the trainer config means {value}; "
                                  f"set it to \"auto\" in conf/deepspeed/*.json and use trainer.* instead")
        ds[key] = value


def zero_stage(acc: Accelerator) -> int:
    if acc.distributed_type != DistributedType.DEEPSPEED:
        return 0
    return int(acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def place_frozen(acc: Accelerator, model: torch.nn.Module) -> str:
    """Put a frozen model (the verifier) where the launch wants it; returns how, for the log.

    ZeRO-3: partitioned across ranks by a parameter-only DeepSpeed engine (no optimizer),
    gathered layer by layer in each forward. FSDP: each decoder layer and the root wrapped
    with FSDP2 `fully_shard`. Otherwise: a full copy on this process's device."""
    model.requires_grad_(False).eval()
    if zero_stage(acc) == 3:
        import deepspeed

        ds = acc.state.deepspeed_plugin.deepspeed_config
        config = {"train_micro_batch_size_per_gpu": ds["train_micro_batch_size_per_gpu"],
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "bf16": {"enabled": model.dtype == torch.bfloat16},
                  "fp16": {"enabled": model.dtype == torch.float16}}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        total = sum(p.ds_numel for p in model.parameters())
        local = sum(p.ds_tensor.numel() for p in model.parameters())
        return f"ZeRO-3 sharded over {acc.num_processes} processes ({local:,} of {total:,} params held here)"
    if acc.distributed_type == DistributedType.FSDP:
        return shard_fsdp(model)
    model.to(acc.device)
    return f"replicated on {acc.device}"


def full_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen, unsharded copy of a (possibly ZeRO-3-partitioned) module, e.g. the verifier's
    lm_head that Medusa/EAGLE heads multiply by as a whole matrix."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # loaded under ZeRO-3: gather it first
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            clone = copy.deepcopy(module)
        for p in clone.parameters():  # a deep copy keeps ZeRO's attributes; make it a plain tensor again
            for attr in [a for a in vars(p) if a.startswith("ds_")]:
                delattr(p, attr)
    else:
        clone = copy.deepcopy(module)
    return clone.requires_grad_(False)


def shard_fsdp(model: torch.nn.Module) -> str:
    """FSDP2: shard each decoder layer, the decoder (embeddings, norm), the lm_head and the root
    across the default process group. Each is its own unit, so calling the decoder or the lm_head
    directly (as trainers do) gathers just what that call needs."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(decoder)
    fully_shard(model.get_output_embeddings())
    fully_shard(model)
    return f"FSDP-sharded ({len(decoder.layers)} layers) over {torch.distributed.get_world_size()} processes"


def make_optimizer(param_groups, trainer_cfg) -> torch.optim.Optimizer:
    if not any(p.requires_grad for g in param_groups for p in g["params"]):
        raise DraftsmithError("nothing to train: no parameter requires grad (check method settings)")
    return torch.optim.AdamW(param_groups, lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay,
                             betas=(0.9, 0.95), eps=float(trainer_cfg.get("adam_eps", 1e-8)))


def make_scheduler(optimizer, trainer_cfg):
    make = choose(SCHEDULES, trainer_cfg.schedule, "trainer.schedule")
    warmup = trainer_cfg.warmup_steps
    if isinstance(warmup, float) and warmup < 1:
        warmup = math.ceil(warmup * trainer_cfg.max_steps)
    if make is get_constant_schedule_with_warmup:
        return make(optimizer, num_warmup_steps=warmup)
    return make(optimizer, num_warmup_steps=warmup, num_training_steps=trainer_cfg.max_steps)


def global_counts(accelerator):
    """A reducer for token-normalised losses: counts (K,) on this process -> (their sum over
    every process, the number of processes that DDP / DeepSpeed average gradients over)."""
    def reduce(counts: torch.Tensor):
        if accelerator.num_processes == 1:
            return counts, 1
        return accelerator.reduce(counts.to(accelerator.device), "sum").cpu(), accelerator.num_processes
    return reduce
