"""Train Medusa-1 heads on a frozen verifier.

    python train/medusa.py                                   # offline default: SmolLM2-135M
    python train/medusa.py model=smollm2-135m method.num_heads=4 trainer.max_steps=200
    accelerate launch train/medusa.py model=vicuna-7b-v1.3 data=sharegpt trainer=gpu

Head k (0-based) reads the verifier's final hidden state at t and predicts token t+k+2.
Loss = sum_k decay^k * CE_k over assistant tokens. Per-head top-1/top-5 accuracy and the
simulated acceptance length are measured on the held-out split at every eval.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.vocab import draft_vocab, label_counts, target_to_draft
from draftsmith.models.verifier import load_verifier
from draftsmith.train.core.accel import make_accelerator, make_optimizer, make_scheduler, full_copy, place_frozen, zero_stage
from draftsmith.train.core.checkpoint import claim_output_dir
from draftsmith.models.entry import launch
from draftsmith.train.core.data import check_data_verifier
from draftsmith.train.core.features import offline_verifier, read_manifest
from draftsmith.train.core.logging import init_trackers, trackers
from draftsmith.train.core.loop import (BatchStream, after_step, best_so_far, load_train_data, optimizer_step, resume,
                             save_drafter_dir)


def head_targets(labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose token t+k+2 is a supervised (assistant) token, and those tokens.

    labels (B, T) with -100 on unsupervised tokens -> mask (B, T) bool, targets (N,)."""
    shift = k + 2
    target = torch.full_like(labels, -100)
    target[:, :-shift] = labels[:, shift:]  # target[b, t] = labels[b, t + k + 2]
    mask = target != -100
    return mask, target[mask]


def medusa_loss(heads, hidden: torch.Tensor, labels: torch.Tensor, lm_head, decay: float, num_heads: int,
                reduce_counts=None, t2d: torch.Tensor | None = None):
    """hidden (B, T, H) from the frozen verifier -> (loss, per-head stats).

    Logits are computed only at supervised positions: the V x H projection is the dominant
    cost here, and prompt/padding positions carry no loss. CE is summed and divided by the
    head's supervised-token count over ALL processes (`reduce_counts` sums a (K,) tensor
    across them), times the process count that DDP/DeepSpeed average over: the gradient is
    then the global token mean, the same for 1 or N processes.

    t2d (V,): verifier id -> draft id (-1 outside a reduced draft vocabulary). Targets outside
    it carry no loss (no head can emit them) but count as misses in the accuracy stats."""
    targets, rows = [], []
    hidden = hidden.to(next(heads.parameters()).dtype)  # DeepSpeed bf16 holds the heads in bf16 (no autocast)
    for k in range(num_heads):
        mask, target = head_targets(labels, k)  # (B, T), (N_k,)
        if t2d is not None:  # keep only rows whose target the draft vocabulary holds
            drafted = t2d[target]  # (N_k,)
            keep = drafted >= 0
            mask = mask.clone()
            mask[mask.clone()] = keep
            targets.append((drafted[keep], target.numel()))
        else:
            targets.append((target, target.numel()))
        rows.append(hidden[mask])  # (N_k', H)
    counts = torch.tensor([t.numel() for t, _ in targets], dtype=torch.float64)  # (K,)
    world = 1
    if reduce_counts is not None:
        counts, world = reduce_counts(counts)
    logits = heads(rows, lm_head)  # K x (N_k', N): one forward call, which DDP/DeepSpeed track
    loss = hidden.new_zeros(())
    stats = {}
    for k, (head_logits, (target, total)) in enumerate(zip(logits, targets)):
        ce_sum = F.cross_entropy(head_logits.float(), target, reduction="sum")
        loss = loss + (decay ** k) * ce_sum * (world / max(float(counts[k]), 1.0))
        if total == 0:
            continue
        with torch.no_grad():
            top5 = head_logits.topk(min(5, head_logits.shape[-1]), dim=-1).indices  # (N_k', 5)
            stats[f"head{k}/loss"] = ce_sum.item() / max(target.numel(), 1)
            stats[f"head{k}/top1_hits"] = (top5[:, 0] == target).sum().item()
            stats[f"head{k}/top5_hits"] = (top5 == target[:, None]).any(-1).sum().item()
            stats[f"head{k}/count"] = total  # targets outside the draft vocabulary are misses
    return loss, stats


def global_counts(accelerator):
    """counts (K,) on this process -> (sum over processes, number of processes)."""
    def reduce(counts: torch.Tensor):
        if accelerator.num_processes == 1:
            return counts, 1
        return accelerator.reduce(counts.to(accelerator.device), "sum").cpu(), accelerator.num_processes
    return reduce


def simulated_tau(top1: list[float]) -> float:
    """Expected tokens per verifier pass for greedy chain verification with these heads:
    1 (the verifier's own token) + sum_k prod_{j<=k} acc_j (SpecForge / ModelOpt style)."""
    tau, run = 1.0, 1.0
    for acc in top1:
        run *= acc
        tau += run
    return tau


@torch.no_grad()
def verifier_features(verifier, batch) -> torch.Tensor:
    """The verifier's final hidden states (B, T, H) in fp32: stored offline, or computed now."""
    if "hidden" in batch:
        return batch["hidden"].float()
    return verifier.hidden_states(batch["input_ids"], batch["attention_mask"]).float()


@torch.no_grad()
def evaluate(verifier, heads, loader, accelerator, decay: float, num_heads: int, lm_head, t2d=None) -> dict:
    heads.eval()
    totals: dict[str, float] = {}
    loss_sum, batches = 0.0, 0
    for batch in loader:
        hidden = verifier_features(verifier, batch)  # (B, T, H)
        with accelerator.autocast():
            loss, stats = medusa_loss(heads, hidden, batch["labels"], lm_head, decay, num_heads, t2d=t2d)
        loss_sum, batches = loss_sum + loss.item(), batches + 1
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
    heads.train()
    totals = {k: accelerator.reduce(torch.tensor(v, device=accelerator.device), "sum").item()
              for k, v in sorted(totals.items())}
    metrics = {"eval/loss": loss_sum / max(batches, 1)}
    top1 = []
    for k in range(num_heads):
        count = max(totals.get(f"head{k}/count", 0.0), 1.0)
        top1.append(totals.get(f"head{k}/top1_hits", 0.0) / count)
        metrics[f"eval/head{k}_top1"] = top1[-1]
        metrics[f"eval/head{k}_top5"] = totals.get(f"head{k}/top5_hits", 0.0) / count
    metrics["eval/simulated_tau"] = simulated_tau(top1)
    return metrics


def run(cfg: DictConfig) -> dict:
    tcfg, mcfg = cfg.trainer, cfg.method
    accelerator = make_accelerator(tcfg, log_with=trackers(cfg.logger, cfg.output_dir), seed=cfg.seed)
    if cfg.data.get("features"):  # offline: stored hidden states, only the lm_head is loaded
        verifier = offline_verifier(cfg.model, read_manifest(cfg.data.features))
        lm_head = verifier.lm_head.to(accelerator.device)
        placement = "not loaded (offline features)"
    else:  # online: the frozen verifier runs inside every step
        verifier = load_verifier(cfg.model)
        # The heads need the verifier's lm_head as a whole matrix: a frozen copy, kept out of any sharding.
        lm_head = full_copy(verifier.lm_head).to(accelerator.device) if zero_stage(accelerator) == 3 or \
            accelerator.distributed_type == DistributedType.FSDP else None
        placement = place_frozen(accelerator, verifier.model)
        lm_head = lm_head if lm_head is not None else verifier.lm_head
        check_data_verifier(cfg.data, verifier.fingerprint)  # warns if another verifier wrote the data
    data = load_train_data(cfg, getattr(verifier, "tokenizer", None))
    train_ds, eval_ds = data.train, data.eval
    claim_output_dir(cfg.output_dir, cfg, accelerator.is_main_process)
    eval_loader = accelerator.prepare(data.loader(eval_ds, tcfg.eval_batch_size, shuffle=False, seed=0))

    config = MedusaConfig(hidden_size=verifier.config.hidden_size, vocab_size=verifier.config.vocab_size,
                          num_heads=mcfg.num_heads, num_layers=mcfg.num_layers, lm_head=mcfg.lm_head,
                          draft_vocab_size=mcfg.get("draft_vocab_size"))
    d2t = t2d = None
    if config.draft_vocab_size:  # the most frequent supervised tokens of the training split
        counts = label_counts(train_ds.labels() if data.offline else train_ds["labels"],
                              config.vocab_size)
        d2t = draft_vocab(counts, config.draft_vocab_size)
        t2d = target_to_draft(d2t, config.vocab_size).to(accelerator.device)
        accelerator.print(f"medusa: draft vocabulary of {config.draft_vocab_size:,} of {config.vocab_size:,} "
                          f"tokens covers {counts[d2t].sum() / max(counts.sum(), 1):.1%} of the training targets")
    heads = MedusaHeads(config, lm_head, d2t=d2t).to(accelerator.device)
    trainable = sum(p.numel() for p in heads.parameters())  # before prepare: ZeRO-3 partitions them
    optimizer = make_optimizer([{"params": list(heads.parameters())}], tcfg)
    scheduler = make_scheduler(optimizer, tcfg)
    heads, optimizer, scheduler = accelerator.prepare(heads, optimizer, scheduler)
    init_trackers(accelerator, cfg.logger, f"medusa-{cfg.model.name}", OmegaConf.to_container(cfg, resolve=True),
                  cfg.output_dir)

    step = resume(accelerator, cfg)
    batches = BatchStream(accelerator, data, tcfg, cfg.seed, step)
    accelerator.print(f"medusa: {config.num_heads} heads ({trainable:,} "
                      f"trainable params), {len(train_ds)} train / {len(eval_ds)} held-out conversations, "
                      f"{batches.per_epoch} batches/epoch, verifier {verifier.name} [{verifier.fingerprint}] "
                      f"{placement}")
    metrics: dict = {}
    best = best_so_far(cfg.output_dir, step, "eval/simulated_tau")
    tokens, t0 = 0, time.time()
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="medusa", disable=not accelerator.is_main_process)
    heads.train()
    while step < tcfg.max_steps:
        for _ in range(tcfg.grad_accum):
            batch = next(batches)
            with accelerator.accumulate(heads):
                # The loss step: frozen verifier features, then the heads' weighted CE.
                hidden = verifier_features(verifier, batch)  # (B, T, H) frozen, fp32
                with accelerator.autocast():
                    loss, stats = medusa_loss(heads, hidden, batch["labels"], lm_head, mcfg.decay,
                                              config.num_heads, global_counts(accelerator), t2d)
                optimizer_step(accelerator, heads, loss, optimizer, tcfg)
            tokens += int(batch["attention_mask"].sum())
        scheduler.step()  # once per optimizer step, whatever the process count
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % tcfg.log_every == 0 or step == tcfg.max_steps:
            log = {"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                   "train/tokens_per_s": tokens * accelerator.num_processes / (time.time() - t0)}
            log.update({f"train/{k}": v for k, v in stats.items() if k.endswith("/loss")})
            accelerator.log(log, step=step)
        new_metrics, best = after_step(
            accelerator, cfg, step, batches, best=best, key="eval/simulated_tau", t0=t0,
            evaluate=lambda: evaluate(verifier, heads, eval_loader, accelerator, mcfg.decay, config.num_heads,
                                      lm_head, t2d),
            save=lambda m, name: save_drafter_dir(cfg, accelerator, heads, "medusa", config, verifier, m, name))
        metrics = new_metrics or metrics
    bar.close()

    final = save_drafter_dir(cfg, accelerator, heads, "medusa", config, verifier, {**metrics, "step": step}, "final")
    elapsed = time.time() - t0
    summary = {"drafter_dir": str(final), "steps": step, **metrics, "best_step": best.get("step"),
               "train_tokens_per_s": tokens * accelerator.num_processes / max(elapsed, 1e-9)}
    accelerator.end_training()
    top1 = " ".join(f"h{k}={metrics.get(f'eval/head{k}_top1', float('nan')):.3f}" for k in range(config.num_heads))
    accelerator.print(f"medusa done: {step} steps in {elapsed:.0f}s, held-out top-1 {top1}, "
                      f"simulated tau {metrics.get('eval/simulated_tau', float('nan')):.2f}, drafter -> {final}")
    return summary


if __name__ == "__main__":
    launch("medusa", run)
