"""Accelerator, optimizer and schedule setup shared by every trainer."""
from __future__ import annotations

import logging
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import get_cosine_schedule_with_warmup, get_constant_schedule_with_warmup

from models.errors import DraftsmithError, choose

PRECISIONS = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
SCHEDULES = {"cosine": get_cosine_schedule_with_warmup, "constant": get_constant_schedule_with_warmup}


def make_accelerator(trainer_cfg, log_with=None, seed: int = 0) -> Accelerator:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file INFO lines on every save
    mixed = choose(PRECISIONS, trainer_cfg.precision, "trainer.precision")
    acc = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=trainer_cfg.grad_accum,
                      log_with=log_with or None)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != acc.num_processes:
        raise DraftsmithError(
            f"the launcher started {launched} processes but accelerate sees {acc.num_processes}: each would "
            f"train alone; on CPU launch with ACCELERATE_USE_CPU=1 (see conf/accelerate/cpu-2proc.yaml)")
    set_seed(seed, device_specific=False)
    if trainer_cfg.threads and acc.device.type == "cpu":
        torch.set_num_threads(int(trainer_cfg.threads))
    return acc


def make_optimizer(param_groups, trainer_cfg) -> torch.optim.Optimizer:
    if not any(p.requires_grad for g in param_groups for p in g["params"]):
        raise DraftsmithError("nothing to train: no parameter requires grad (check method settings)")
    return torch.optim.AdamW(param_groups, lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay,
                             betas=(0.9, 0.95))


def make_scheduler(optimizer, trainer_cfg):
    make = choose(SCHEDULES, trainer_cfg.schedule, "trainer.schedule")
    warmup = trainer_cfg.warmup_steps
    if isinstance(warmup, float) and warmup < 1:
        warmup = math.ceil(warmup * trainer_cfg.max_steps)
    if make is get_constant_schedule_with_warmup:
        return make(optimizer, num_warmup_steps=warmup)
    return make(optimizer, num_warmup_steps=warmup, num_training_steps=trainer_cfg.max_steps)
