"""Train Medusa-1 heads on a frozen verifier.

    python train/medusa.py                                   # offline default: SmolLM2-135M
    python train/medusa.py model=smollm2-135m method.num_heads=4 trainer.max_steps=200
    accelerate launch --config_file conf/accelerate/ddp-8gpu.yaml train/medusa.py model=vicuna-7b-v1.3 data=sharegpt

Head k (0-based) reads the verifier's final hidden state at t and predicts token t+k+2.
Loss = sum_k decay^k * CE_k over assistant tokens. Per-head top-1/top-5 accuracy and the
simulated acceptance length are measured on the held-out split at every eval. The loop,
resume, logging and saving are the shared skeleton (train/core/loop.py `fit`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from draftsmith.models.entry import launch
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.vocab import IGNORE_INDEX, draft_vocab, label_counts, target_to_draft
from draftsmith.train.core import loop
from draftsmith.train.core.accel import global_counts
from draftsmith.train.core.losses import simulated_tau


def head_targets(labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose token t+k+2 is a supervised (assistant) token, and those tokens.

    labels (B, T) with IGNORE_INDEX on unsupervised tokens -> mask (B, T) bool, targets (N,)."""
    shift = k + 2
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-shift] = labels[:, shift:]  # target[b, t] = labels[b, t + k + 2]
    mask = target != IGNORE_INDEX
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
        with torch.no_grad():  # every key on every process, even without targets (stats are summed across them)
            top5 = head_logits.topk(min(5, head_logits.shape[-1]), dim=-1).indices  # (N_k', 5)
            stats[f"head{k}/loss"] = ce_sum.item() / max(target.numel(), 1)
            stats[f"head{k}/top1_hits"] = (top5[:, 0] == target).sum().item()
            stats[f"head{k}/top5_hits"] = (top5 == target[:, None]).any(-1).sum().item()
            stats[f"head{k}/count"] = total  # targets outside the draft vocabulary are misses
    return loss, stats


@torch.no_grad()
def verifier_features(verifier, batch) -> torch.Tensor:
    """The verifier's final hidden states (B, T, H) in fp32: stored offline, or computed now."""
    if "hidden" in batch:
        return batch["hidden"].float()
    return verifier.hidden_states(batch["input_ids"], batch["attention_mask"]).float()


def evaluate(verifier, heads, loader, accelerator, decay: float, num_heads: int, lm_head, t2d=None) -> dict:
    """Held-out loss, per-head top-1 / top-5 accuracy and the simulated acceptance length."""
    totals, loss = loop.held_out_totals(accelerator, heads, loader, lambda batch: medusa_loss(
        heads, verifier_features(verifier, batch), batch["labels"], lm_head, decay, num_heads, t2d=t2d))
    metrics = {"eval/loss": loss}
    top1 = []
    for k in range(num_heads):
        count = max(totals.get(f"head{k}/count", 0.0), 1.0)
        top1.append(totals.get(f"head{k}/top1_hits", 0.0) / count)
        metrics[f"eval/head{k}_top1"] = top1[-1]
        metrics[f"eval/head{k}_top5"] = totals.get(f"head{k}/top5_hits", 0.0) / count
    metrics["eval/simulated_tau"] = simulated_tau(top1)
    return metrics


def run(cfg: DictConfig) -> dict:
    mcfg = cfg.method
    accelerator = loop.start(cfg)
    frozen = loop.frozen_verifier(cfg, accelerator)  # online, or only its lm_head with offline features
    verifier, lm_head = frozen.verifier, frozen.lm_head
    data, eval_loader = loop.training_data(cfg, accelerator, getattr(verifier, "tokenizer", None))

    # The model: K heads, optionally over the most frequent supervised tokens of the training split.
    config = MedusaConfig(hidden_size=verifier.config.hidden_size, vocab_size=verifier.config.vocab_size,
                          num_heads=mcfg.num_heads, num_layers=mcfg.num_layers, lm_head=mcfg.lm_head,
                          draft_vocab_size=mcfg.get("draft_vocab_size"))
    d2t = t2d = None
    vocab_note = "full vocabulary"
    if config.draft_vocab_size:
        counts = label_counts(data.train.labels() if data.offline else data.train["labels"], config.vocab_size)
        d2t = draft_vocab(counts, config.draft_vocab_size)
        t2d = target_to_draft(d2t, config.vocab_size).to(accelerator.device)
        vocab_note = (f"draft vocabulary of {config.draft_vocab_size:,} of {config.vocab_size:,} tokens covers "
                      f"{counts[d2t].sum() / max(counts.sum(), 1):.1%} of the training targets")
    heads = MedusaHeads(config, lm_head, token_map=d2t).to(accelerator.device)

    def loss_step(model, batch):
        """The loss step: frozen verifier features, then the heads' weighted CE."""
        hidden = verifier_features(verifier, batch)  # (B, T, H) frozen, fp32
        with accelerator.autocast():
            loss, stats = medusa_loss(model, hidden, batch["labels"], lm_head, mcfg.decay, config.num_heads,
                                      global_counts(accelerator), t2d)
        return loss, loop.loss_logs(stats)

    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=heads, param_groups=[{"params": list(heads.parameters())}], loss_step=loss_step,
        evaluate=lambda model: evaluate(verifier, model, eval_loader, accelerator, mcfg.decay, config.num_heads,
                                        lm_head, t2d),
        save=loop.drafter_saver(cfg, accelerator, "medusa", config, verifier), best_key="eval/simulated_tau",
        report=lambda m: loop.top1_report(m, "head{}_top1", "h", config.num_heads),
        describe=f"{config.num_heads} heads ({vocab_note}), {frozen.describe()}"))


if __name__ == "__main__":
    launch("medusa", run)
