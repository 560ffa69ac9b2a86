"""Fine-tune the verifier itself (SFT, LoRA via peft or every weight): the verifier update after
which a drafter must be refreshed (scripts/refresh.py).

    python scripts/finetune_verifier.py                                   # SmolLM2 on the stdlib's docstrings, LoRA
    python scripts/finetune_verifier.py method.backbone=full trainer.lr=2e-5
    python scripts/finetune_verifier.py data=chat-jsonl data.path=my_sft.jsonl trainer.max_steps=500
    accelerate launch --config_file conf/accelerate/cpu-2proc.yaml scripts/finetune_verifier.py

Loss: cross-entropy of the next token on assistant tokens, summed and divided by the global
token count (the same gradient for 1 or N processes). Every eval reports the fine-tune's
held-out loss and top-1 accuracy, and how far the model moved from the original on the drift
set (drift.data, chit-chat by default: the drafters' domain): KL(original || tuned) and greedy
next-token agreement on its assistant tokens. The original is the same model with the LoRA
adapters off (a frozen copy for full tuning).

Writes output_dir/final (and /best): a plain HF folder (LoRA merged, safetensors, tokenizer)
that loads as model.path=<that folder>, plus finetune.json (original and tuned fingerprints,
the drift). Training state resumes from output_dir/checkpoints (the shared loop, train/core/loop.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from draftsmith.models.checkpoint import write_atomic_dir
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.sources import load_conversations
from draftsmith.models.verifier import fingerprint, load_verifier
from draftsmith.train.core import loop
from draftsmith.train.core.accel import global_counts
from draftsmith.train.core.data import make_dataloader, next_token_positions, tokenize_conversations
from draftsmith.train.core.lora import merged, tunable

BACKBONES = {"lora": "LoRA (peft)", "full": "full fine-tuning"}


class NextTokenLogits(torch.nn.Module):
    """A causal LM whose forward returns the logits only where they are trained: (N, V) at the
    positions `pos` (B, T) whose next token is supervised (the V x h projection of every
    position would dominate the memory)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def base(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids, attention_mask, pos):
        hidden = self.base().model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.base().lm_head(hidden[pos])  # (N, V)


def sft_loss(model, batch, reduce_counts=None):
    """Sum of -log q(next token) over supervised positions / global count -> (loss, stats)."""
    pos = next_token_positions(batch["labels"])  # (B, T)
    logits = model(batch["input_ids"], batch["attention_mask"], pos).float()  # (N, V)
    target = batch["labels"][:, 1:][pos[:, :-1]]  # (N,)
    nll_sum = F.cross_entropy(logits, target, reduction="sum")
    count, world = torch.tensor([float(target.numel())], dtype=torch.float64), 1
    if reduce_counts is not None:
        count, world = reduce_counts(count)
    stats = {"nll_sum": nll_sum.item(), "hits": (logits.argmax(-1) == target).sum().item(), "count": target.numel()}
    return nll_sum * (world / max(float(count[0]), 1.0)), stats


@torch.no_grad()
def drift_stats(model, teacher, batch) -> tuple[torch.Tensor, dict]:
    """KL(original || tuned) and greedy agreement at the supervised positions of a batch."""
    inner = getattr(model, "module", model)
    pos = next_token_positions(batch["labels"])
    q_logits = model(batch["input_ids"], batch["attention_mask"], pos).double()  # (N, V) tuned
    if teacher is None:  # the same model with its adapters off is the original
        with inner.model.disable_adapter():
            p_logits = model(batch["input_ids"], batch["attention_mask"], pos).double()
    else:
        p_logits = NextTokenLogits(teacher)(batch["input_ids"], batch["attention_mask"], pos).double()
    log_p, log_q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (N,)
    stats = {"kl_sum": kl.sum().item(), "agree": (p_logits.argmax(-1) == q_logits.argmax(-1)).sum().item(),
             "count": kl.numel()}
    return torch.zeros(()), stats  # (no loss: only the stats are summed)


def run(cfg: DictConfig) -> dict:
    mcfg = cfg.method
    choose(BACKBONES, mcfg.backbone, "method.backbone")
    if cfg.trainer.get("init_from") or not cfg.trainer.get("keep_vocab", True):
        raise DraftsmithError("trainer.init_from / trainer.keep_vocab warm-start a drafter; a verifier fine-tune starts "
                              "from model= (pass the folder to fine-tune as model.path=); drop them")
    if cfg.data.get("features"):
        raise DraftsmithError(f"data.features={cfg.data.features}: a fine-tune trains on token ids, not stored "
                              f"verifier features; drop data.features")
    accelerator = loop.start(cfg)
    verifier = load_verifier(cfg.model)
    original_fp = verifier.fingerprint
    data, eval_loader = loop.training_data(cfg, accelerator, verifier.tokenizer)
    drift_conv = load_conversations(cfg.drift.data).select(range(int(cfg.drift.num_conversations)))
    drift_ds = tokenize_conversations(drift_conv, verifier.tokenizer, cfg.drift.data.max_length)
    drift_loader = accelerator.prepare(make_dataloader(drift_ds, cfg.trainer.eval_batch_size, data.pad_id,
                                                       shuffle=False, seed=0))
    backbone, teacher = tunable(verifier.model, mcfg.backbone, mcfg.lora)
    model = NextTokenLogits(backbone).to(accelerator.device)
    if teacher is not None:
        teacher.to(accelerator.device)

    def loss_step(model, batch):
        """The loss step: next-token cross-entropy on the assistant tokens."""
        with accelerator.autocast():
            loss, stats = sft_loss(model, batch, global_counts(accelerator))
        return loss, {"train/nll": stats["nll_sum"] / max(stats["count"], 1)}

    def evaluate(model) -> dict:
        """The fine-tune's held-out loss / top-1, and the drift from the original on drift.data."""
        totals, _ = loop.held_out_totals(accelerator, model, eval_loader, lambda batch: sft_loss(model, batch))
        drift, _ = loop.held_out_totals(accelerator, model, drift_loader, lambda b: drift_stats(model, teacher, b))
        n, m = max(totals.get("count", 0), 1), max(drift.get("count", 0), 1)
        return {"eval/loss": totals.get("nll_sum", 0.0) / n, "eval/top1": totals.get("hits", 0.0) / n,
                "eval/drift_kl": drift.get("kl_sum", 0.0) / m, "eval/drift_greedy_agreement": drift.get("agree", 0.0) / m}

    def save(model, metrics: dict, name: str) -> str:
        """<name>/: the tuned verifier as a plain HF folder (LoRA merged) + finetune.json."""
        out = f"{cfg.output_dir}/{name}"
        state = accelerator.get_state_dict(model)  # every process: ZeRO-3 gathers here
        if accelerator.is_main_process:
            inner = accelerator.unwrap_model(model)
            sub = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
            tuned = merged(inner.base(), sub, mcfg.backbone, mcfg.lora)
            info = {"kind": "finetuned-verifier", "original": {"name": verifier.name, "fingerprint": original_fp,
                                                               "path": verifier.path},
                    "fingerprint": fingerprint(tuned), "backbone": mcfg.backbone, "data": cfg.data.name,
                    "drift_data": cfg.drift.data.name, "metrics": metrics}

            def write(tmp: Path):
                tuned.save_pretrained(tmp, max_shard_size="1000GB")
                verifier.tokenizer.save_pretrained(tmp)
                (tmp / "finetune.json").write_text(json.dumps(info, indent=2, default=str))
                (tmp / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

            write_atomic_dir(out, write)
        accelerator.wait_for_everyone()
        return out

    def report(m: dict) -> str:
        return (f"held-out loss {m.get('eval/loss', float('nan')):.3f}, top-1 {m.get('eval/top1', float('nan')):.3f}; "
                f"drift on {cfg.drift.data.name}: KL(original || tuned) {m.get('eval/drift_kl', float('nan')):.4f}, "
                f"greedy agreement {m.get('eval/drift_greedy_agreement', float('nan')):.3f}")

    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=model, param_groups=[{"params": [p for p in backbone.parameters() if p.requires_grad]}],
        loss_step=loss_step, evaluate=evaluate, save=save, best_key="eval/top1", report=report,
        describe=f"{BACKBONES[mcfg.backbone]} of {verifier.name} [{original_fp}] on data={cfg.data.name}"))


if __name__ == "__main__":
    launch("finetune_verifier", run)
