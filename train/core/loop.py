"""Training-loop plumbing shared by the trainers: data (online or offline), the batch stream
with its resumable data position, and the best-checkpoint bookkeeping. Each trainer keeps
its own loop and loss step in plain view (train/medusa.py, train/eagle.py, train/draft.py).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from draftsmith.models.checkpoint import save_drafter
from draftsmith.train.core.checkpoint import latest_checkpoint, load_training_state, save_training_state
from draftsmith.models.sources import load_conversations
from draftsmith.train.core.data import make_dataloader, split_heldout, tokenize_conversations
from draftsmith.train.core.features import FeatureDataset, make_feature_dataloader


@dataclass
class TrainData:
    """The two splits and how to batch them (token ids, or stored features)."""

    train: object  # datasets.Dataset or FeatureDataset
    eval: object
    offline: bool
    pad_id: int

    def loader(self, ds, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False):
        if self.offline:
            return make_feature_dataloader(ds, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return make_dataloader(ds, batch_size, self.pad_id, shuffle=shuffle, seed=seed, drop_last=drop_last)


def load_train_data(cfg, tokenizer) -> TrainData:
    """data.features set: the stored splits; else chat conversations -> assistant-only labels,
    with a held-out split never trained on (same split and tokenization either way)."""
    if cfg.data.get("features"):
        return TrainData(FeatureDataset(cfg.data.features, "train"), FeatureDataset(cfg.data.features, "eval"),
                         offline=True, pad_id=0)
    train_conv, eval_conv = split_heldout(load_conversations(cfg.data), cfg.data)
    return TrainData(tokenize_conversations(train_conv, tokenizer, cfg.data.max_length),
                     tokenize_conversations(eval_conv, tokenizer, cfg.data.max_length),
                     offline=False, pad_id=tokenizer.pad_token_id)


class BatchStream:
    """Endless training batches for one process, epoch after epoch, resumable.

    The data position is (optimizer steps done) x grad_accum micro-batches; a resumed run
    skips exactly the micro-batches already consumed in the current epoch. With
    trainer.split_batches only full global batches are formed, so every process count cuts
    the same batches the same way (accelerate would otherwise move a short last batch to the
    end and pad it with repeats)."""

    def __init__(self, accelerator, data: TrainData, tcfg, seed: int, step: int = 0):
        self.accelerator, self.data, self.tcfg, self.seed = accelerator, data, tcfg, seed
        self.per_epoch = len(self._epoch_loader(0))  # per process: ceil(batches / processes), or all when split
        self.epoch, offset = divmod(step * tcfg.grad_accum, self.per_epoch)
        loader = self._epoch_loader(self.epoch)
        self._it = iter(accelerator.skip_first_batches(loader, offset) if offset else loader)

    def _epoch_loader(self, epoch: int):
        loader = self.data.loader(self.data.train, self.tcfg.batch_size, shuffle=True, seed=self.seed + epoch,
                                  drop_last=bool(self.tcfg.get("split_batches")))
        return self.accelerator.prepare(loader)

    def __next__(self) -> dict:
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = iter(self._epoch_loader(self.epoch))
            return next(self._it)


def resume(accelerator, cfg) -> int:
    """Load the latest training state of cfg.output_dir (when trainer.resume); -> its step."""
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.trainer.resume else None
    if ckpt is None:
        return 0
    step = load_training_state(accelerator, ckpt)["step"]
    accelerator.print(f"resuming from {ckpt} at step {step}")
    return step


def best_so_far(output_dir, step: int, key: str) -> dict:
    """The metrics of output_dir/best (kept across resumes), or -inf for `key`."""
    meta = Path(output_dir) / "best" / "meta.json"
    if step and meta.is_file():
        return json.loads(meta.read_text())["metrics"]
    return {key: -math.inf}


def optimizer_step(accelerator, model, loss, optimizer, tcfg) -> None:
    """backward, clip (on the micro-batch that syncs), step, zero_grad; the LR schedule is
    stepped by the trainer once per optimizer step, outside the accumulation loop."""
    accelerator.backward(loss)
    if accelerator.sync_gradients and tcfg.max_grad_norm:
        accelerator.clip_grad_norm_(model.parameters(), tcfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad()


def after_step(accelerator, cfg, step: int, batches: BatchStream, evaluate, save, best: dict, key: str,
               t0: float) -> tuple[dict | None, dict]:
    """Every trainer.eval_every steps: evaluate(), log, keep the best by `key` (save(metrics,
    "best")); every trainer.save_every steps: the training state. -> (metrics or None, best)."""
    tcfg, metrics = cfg.trainer, None
    if step % tcfg.eval_every == 0 or step == tcfg.max_steps:
        metrics = evaluate()
        accelerator.log({**metrics, "time/elapsed_s": time.time() - t0}, step=step)
        accelerator.print(f"step {step}: " + " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items()))
        if metrics[key] > best[key]:
            best = {**metrics, "step": step}
            save(best, "best")
    if step % tcfg.save_every == 0 or step == tcfg.max_steps:
        save_training_state(accelerator, cfg.output_dir, step, {"epoch": batches.epoch}, tcfg.keep_last)
    return metrics, best


def save_drafter_dir(cfg, accelerator, model, kind: str, config, verifier, metrics: dict, name: str) -> str:
    """output_dir/<name> (final, best) as a drafter checkpoint of `kind`, from every process:
    ZeRO-3 gathers the shards in get_state_dict; no module is built here (under ZeRO-3 that
    would be a collective on one rank)."""
    out = f"{cfg.output_dir}/{name}"
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_drafter(out, kind, None, config, state_dict=state, verifier_fingerprint=verifier.fingerprint,
                     verifier_name=verifier.name, meta={"method": cfg.method.name, "metrics": metrics},
                     resolved_config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    return out
