"""Train Medusa heads: Medusa-1 on a frozen verifier, Medusa-2 jointly with it.

    python train/medusa.py                                   # offline default: SmolLM2-135M, Medusa-1
    python train/medusa.py model=smollm2-135m method.num_heads=4 trainer.max_steps=200
    python train/medusa.py method=medusa2 trainer.lr=2.5e-4  # LoRA backbone + heads (heads at lr x 4)
    accelerate launch --config_file conf/accelerate/ddp-8gpu.yaml train/medusa.py model=vicuna-7b-v1.3 data=sharegpt

Head k (0-based) reads the verifier's final hidden state at t and predicts token t+k+2.
Head loss = sum_k decay^k * CE_k over assistant tokens. The tokens are the data's
(method.targets=labels: right for self-distilled answers, which ARE the verifier's) or the
verifier's own greedy token at each assistant position given the text before it
(method.targets=verifier: for fixed text such as ShareGPT, the heads then learn what the
verifier will accept rather than what the human wrote; from the same forward, one lm_head).

Medusa-2 (method.name=medusa2) also tunes the backbone (method.backbone=lora via peft, or full)
so its last hidden state is easier to speculate from, while keeping the verifier's outputs:

    loss = lambda_lm * KL(original || tuned)  [or CE on the data: backbone_loss=ce]
         + heads_coefficient * ramp(step) * head loss          ramp: constant | linear | sine
    heads-only warm-up stage: the first warmup_stage_steps read the backbone detached
    heads' learning rate: trainer.lr * lr_multiplier

The teacher is exactly the original verifier: the same module with the LoRA adapters switched
off (or a frozen copy for full tuning). Every eval logs the drift (KL, greedy agreement,
perplexity of both) beside the heads' accuracies and simulated tau; `final` is refused when
the KL exceeds method.max_kl (method.allow_drift=true: a warning). final/ holds verifier/ (LoRA
merged: a plain HF folder) and heads/ (fingerprint of the TUNED verifier, the original's
recorded): decode/evaluate.py model.path=<final>/verifier drafter=<final>/heads.

The loop, resume, logging and saving are the shared skeleton (train/core/loop.py `fit`).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from draftsmith.models.checkpoint import MEDUSA2_PARTS, medusa2_parts, save_drafter, write_atomic_dir
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.medusa import MedusaConfig, MedusaHeads, MedusaJoint
from draftsmith.models.verifier import fingerprint, load_verifier
from draftsmith.models.vocab import IGNORE_INDEX, draft_vocab, target_to_draft
from draftsmith.train.core import loop
from draftsmith.train.core.accel import global_counts
from draftsmith.train.core.data import next_token_positions
from draftsmith.train.core.lora import merged, tunable
from draftsmith.train.core.losses import fkl, simulated_tau

BACKBONES = {"frozen": "Medusa-1", "lora": "Medusa-2, LoRA (peft)", "full": "Medusa-2, full fine-tuning"}
TARGETS = {"labels": "the data's tokens", "verifier": "the verifier's greedy token at each assistant position"}


def head_targets(labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose token t+k+2 is a supervised (assistant) token, and those tokens.

    labels (B, T) with IGNORE_INDEX on unsupervised tokens -> mask (B, T) bool, targets (N,)."""
    shift = k + 2
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-shift] = labels[:, shift:]  # target[b, t] = labels[b, t + k + 2]
    mask = target != IGNORE_INDEX
    return mask, target[mask]


def head_rows(labels: torch.Tensor, num_heads: int, t2d: torch.Tensor | None = None) -> list[tuple]:
    """Per head k: (mask (B, T) of the positions it is trained at, targets (N_k,) in the draft
    vocabulary, total supervised targets). t2d (V,): verifier id -> draft id (-1 outside a
    reduced draft vocabulary); targets outside it carry no loss (no head can emit them) but
    count as misses in the accuracy stats."""
    rows = []
    for k in range(num_heads):
        mask, target = head_targets(labels, k)  # (B, T), (N_k,)
        total = target.numel()
        if t2d is not None:  # keep only rows whose target the draft vocabulary holds
            drafted = t2d[target]  # (N_k,)
            keep = drafted >= 0
            mask = mask.clone()
            mask[mask.clone()] = keep
            target = drafted[keep]
        rows.append((mask, target, total))
    return rows


def heads_loss(logits: list[torch.Tensor], rows: list[tuple], decay: float, counts: torch.Tensor, world: int):
    """K head logits (N_k, N') -> (sum_k decay^k CE_k, each divided by its global count, stats)."""
    loss = logits[0].new_zeros(())
    stats = {}
    for k, (head_logits, (_, target, total)) in enumerate(zip(logits, rows)):
        ce_sum = F.cross_entropy(head_logits.float(), target, reduction="sum")
        loss = loss + (decay ** k) * ce_sum * (world / max(float(counts[k]), 1.0))
        with torch.no_grad():  # every key on every process, even without targets (stats are summed across them)
            top5 = head_logits.topk(min(5, head_logits.shape[-1]), dim=-1).indices  # (N_k', 5)
            stats[f"head{k}/loss"] = ce_sum.item() / max(target.numel(), 1)
            stats[f"head{k}/top1_hits"] = (top5[:, 0] == target).sum().item()
            stats[f"head{k}/top5_hits"] = (top5 == target[:, None]).any(-1).sum().item()
            stats[f"head{k}/count"] = total  # targets outside the draft vocabulary are misses
    return loss, stats


def medusa_loss(heads, hidden: torch.Tensor, labels: torch.Tensor, lm_head, decay: float, num_heads: int,
                reduce_counts=None, t2d: torch.Tensor | None = None):
    """hidden (B, T, H) from the frozen verifier -> (loss, per-head stats).

    Logits are computed only at supervised positions: the V x H projection is the dominant
    cost here, and prompt/padding positions carry no loss. CE is summed and divided by the
    head's supervised-token count over ALL processes (`reduce_counts` sums a (K,) tensor
    across them), times the process count that DDP/DeepSpeed average over: the gradient is
    then the global token mean, the same for 1 or N processes."""
    rows = head_rows(labels, num_heads, t2d)
    hidden = hidden.to(next(heads.parameters()).dtype)  # DeepSpeed bf16 holds the heads in bf16 (no autocast)
    counts = torch.tensor([t.numel() for _, t, _ in rows], dtype=torch.float64)  # (K,)
    counts, world = reduce_counts(counts) if reduce_counts is not None else (counts, 1)
    logits = heads([hidden[m] for m, _, _ in rows], lm_head)  # K x (N_k', N): one forward call, which DDP tracks
    return heads_loss(logits, rows, decay, counts, world)


@torch.no_grad()
def verifier_labels(hidden: torch.Tensor, labels: torch.Tensor, lm_head) -> torch.Tensor:
    """(B, T) labels -> the verifier's greedy token at each supervised position, IGNORE_INDEX elsewhere.

    Position j's token is argmax lm_head(f_{j-1}): what the verifier emits after the real text
    up to j-1 (teacher forcing, as EAGLE's targets). hidden (B, T, H) final verifier states."""
    pos = next_token_positions(labels)  # (B, T): t whose token t+1 is supervised
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, 1:][pos[:, :-1]] = lm_head(hidden[pos].to(lm_head.weight.dtype)).argmax(-1)  # (N,)
    return out


@torch.no_grad()
def verifier_features(verifier, batch) -> torch.Tensor:
    """The verifier's final hidden states (B, T, H) in fp32: stored offline, or computed now."""
    if "hidden" in batch:
        return batch["hidden"].float()
    return verifier.hidden_states(batch["input_ids"], batch["attention_mask"]).float()


def head_labels(hidden: torch.Tensor, batch: dict, lm_head, targets: str) -> torch.Tensor:
    """The tokens the heads learn (method.targets): the data's, or the verifier's greedy ones."""
    return verifier_labels(hidden, batch["labels"], lm_head) if targets == "verifier" else batch["labels"]


def evaluate(verifier, heads, loader, accelerator, decay: float, num_heads: int, lm_head, t2d=None,
             targets: str = "labels") -> dict:
    """Held-out loss, per-head top-1 / top-5 accuracy and the simulated acceptance length
    (against method.targets: with `verifier`, agreement with the verifier's greedy tokens)."""
    def one(batch):
        hidden = verifier_features(verifier, batch)
        return medusa_loss(heads, hidden, head_labels(hidden, batch, lm_head, targets), lm_head, decay, num_heads,
                           t2d=t2d)
    totals, loss = loop.held_out_totals(accelerator, heads, loader, one)
    return {"eval/loss": loss, **head_metrics(totals, num_heads)}


# ----------------------------------------------------------------------------------------
# Medusa-2: the backbone tuned with the heads


def head_ramp(step: int, mcfg) -> float:
    """heads_coefficient x the schedule's ramp at `step` (constant | linear | sine over heads_ramp_steps)."""
    ramp = float(mcfg.heads_ramp_steps)
    x = 1.0 if ramp <= 0 else min(1.0, step / ramp)
    shape = choose({"constant": 1.0, "linear": x, "sine": math.sin(math.pi / 2 * x)}, mcfg.heads_schedule,
                   "method.heads_schedule")
    return float(mcfg.heads_coefficient) * shape


@torch.no_grad()
def teacher_logits(joint: MedusaJoint, teacher, batch, pos: torch.Tensor) -> torch.Tensor:
    """(N, V) logits of the ORIGINAL verifier at `pos`: the LoRA adapters switched off, or the
    frozen copy kept for full tuning."""
    if teacher is None:
        with joint.backbone.disable_adapter():
            return joint.lm_head()(joint.hidden(batch["input_ids"], batch["attention_mask"])[pos])
    hidden = teacher.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return teacher.get_output_embeddings()(hidden.last_hidden_state[pos])


def upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def medusa2_loss(model, teacher, batch, mcfg, step: int, num_heads: int, t2d=None, reduce_counts=None):
    """(loss, stats): lambda_lm x backbone loss + ramped heads_coefficient x head loss, each term
    normalised by its global token count (as medusa_loss)."""
    joint = getattr(model, "module", model)
    labels = batch["labels"]
    pos = next_token_positions(labels)  # (B, T)
    rows = head_rows(labels, num_heads, t2d)
    detach = step < int(mcfg.warmup_stage_steps)  # the heads-only stage
    logits, head_logits = model(batch["input_ids"], batch["attention_mask"], pos, [m for m, _, _ in rows], detach)
    p_logits = teacher_logits(joint, teacher, batch, pos)  # (N, V)
    counts = torch.tensor([float(pos.sum())] + [t.numel() for _, t, _ in rows], dtype=torch.float64)  # (1+K,)
    counts, world = reduce_counts(counts) if reduce_counts is not None else (counts, 1)
    logits, p_logits = upcast(logits), upcast(p_logits)  # fp32 at least (fp64 stays fp64)
    log_q = torch.log_softmax(logits, dim=-1)  # (N, V) tuned
    p = torch.softmax(p_logits, dim=-1)  # (N, V) original
    kl = fkl(p, log_q, None)  # (N,) KL(original || tuned)
    target = labels[:, 1:][pos[:, :-1]]  # (N,) the next tokens
    nll = -log_q.gather(-1, target[:, None])[:, 0]  # (N,)
    backbone_sum = choose({"kl": kl, "ce": nll}, mcfg.backbone_loss, "method.backbone_loss").sum()
    h_loss, stats = heads_loss(head_logits, rows, mcfg.decay, counts[1:], world)
    loss = mcfg.lambda_lm * backbone_sum * (world / max(float(counts[0]), 1.0)) + head_ramp(step, mcfg) * h_loss
    with torch.no_grad():
        stats.update({"lm/kl_sum": kl.sum().item(), "lm/count": pos.sum().item(),
                      "lm/agree": (logits.argmax(-1) == p_logits.argmax(-1)).sum().item(),
                      "lm/nll_tuned": nll.sum().item(),
                      "lm/nll_original": -torch.log_softmax(p_logits, -1).gather(-1, target[:, None]).sum().item()})
    return loss, stats


EVAL_STEP = 10**9  # held-out losses at the schedule's full weights, past any warm-up stage


def drift_metrics(totals: dict) -> dict:
    n = max(totals.get("lm/count", 0.0), 1.0)
    return {"eval/kl": totals.get("lm/kl_sum", 0.0) / n, "eval/greedy_agreement": totals.get("lm/agree", 0.0) / n,
            "eval/ppl_tuned": math.exp(totals.get("lm/nll_tuned", 0.0) / n),
            "eval/ppl_original": math.exp(totals.get("lm/nll_original", 0.0) / n)}


def build_backbone(model, mcfg):
    """-> (trainable backbone, teacher): LoRA on the projections (teacher = adapters off, None)
    or the full model (teacher = a frozen copy of the original)."""
    return tunable(model, mcfg.backbone, mcfg.lora)


def merged_verifier(joint: MedusaJoint, state: dict, mcfg):
    """The tuned verifier as a plain HF model (LoRA merged), from a full state dict of the joint
    module (gathered under ZeRO-3), built on this process only."""
    base = joint.backbone.get_base_model() if mcfg.backbone == "lora" else joint.backbone
    prefix = "backbone."
    return merged(base, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, mcfg.backbone,
                  mcfg.lora)


def medusa2_saver(cfg, accelerator, config, verifier, warm: dict | None):
    """Recipe.save for Medusa-2: <name>/verifier (merged HF folder + tokenizer) and <name>/heads
    (fingerprint of the tuned verifier, the original's recorded); `final` gated by method.max_kl."""
    mcfg = cfg.method

    def save(model, metrics: dict, name: str) -> str:
        out = f"{cfg.output_dir}/{name}"
        drift = metrics.get("eval/kl")
        if name == "final" and drift is not None and drift > mcfg.max_kl:
            msg = (f"the tuned verifier drifted: KL(original || tuned) = {drift:.4f} > method.max_kl = {mcfg.max_kl} "
                   f"(greedy agreement {metrics.get('eval/greedy_agreement', float('nan')):.3f})")
            if not mcfg.allow_drift:
                raise DraftsmithError(msg + "; final not written: lower trainer.lr or raise method.lambda_lm, or pass "
                                      "method.allow_drift=true")
            warnings.warn(msg + " (written anyway: method.allow_drift=true)")
        state = accelerator.get_state_dict(model)  # every process: ZeRO-3 gathers the shards here
        if accelerator.is_main_process:
            joint = accelerator.unwrap_model(model)
            tuned = merged_verifier(joint, state, mcfg)
            heads_state = {k[len("heads."):]: v for k, v in state.items() if k.startswith("heads.")}
            tuned_fp = fingerprint(tuned)
            meta = {"method": mcfg.name, "metrics": metrics, "backbone": mcfg.backbone, "warm_start": warm,
                    "original_verifier": {"fingerprint": verifier.fingerprint, "name": verifier.name,
                                          "model": OmegaConf.to_container(cfg.model, resolve=True)},
                    "note": "lossless with respect to the TUNED verifier in verifier/, not the original"}

            def write(tmp: Path):
                heads_dir, verifier_dir = (tmp / part for part in MEDUSA2_PARTS)
                tuned.save_pretrained(verifier_dir, max_shard_size="1000GB")
                verifier.tokenizer.save_pretrained(verifier_dir)
                save_drafter(heads_dir, "medusa", None, config, state_dict=heads_state,
                             verifier_fingerprint=tuned_fp, verifier_name=f"{verifier.name}-medusa2", meta=meta,
                             resolved_config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
                (tmp / "meta.json").write_text(json.dumps({"kind": "medusa2", "tuned_fingerprint": tuned_fp, **meta},
                                                          indent=2, default=str))

            write_atomic_dir(out, write)
        accelerator.wait_for_everyone()
        return out

    return save


def run_medusa2(cfg: DictConfig, accelerator, config: MedusaConfig, verifier, data, eval_loader, t2d, token_map):
    """Medusa-2's recipe: the joint module, its loss step, drift-gated evals and saves."""
    mcfg = cfg.method
    backbone, teacher = build_backbone(verifier.model, mcfg)
    heads = MedusaHeads(config, backbone.get_output_embeddings(), token_map=token_map)
    if mcfg.init_heads and cfg.trainer.init_from:
        raise DraftsmithError(f"method.init_heads={mcfg.init_heads} and trainer.init_from={cfg.trainer.init_from} both "
                              f"warm-start the heads; pass one")
    if mcfg.init_heads:  # trained Medusa-1 heads of this verifier
        warm = loop.warm_start(mcfg.init_heads, heads, "medusa", cfg.trainer.keep_vocab,
                               verifier_fingerprint=verifier.fingerprint, field="method.init_heads")
    else:  # a drafter of any verifier (scripts/refresh.py)
        warm = loop.warm_start(cfg.trainer.init_from, heads, "medusa", cfg.trainer.keep_vocab)
    t2d = t2d if not config.draft_vocab_size else target_to_draft(heads.token_map.cpu(), config.vocab_size).to(
        accelerator.device)  # the map the heads hold (a warm start's)
    joint = MedusaJoint(backbone, heads).to(accelerator.device)
    if teacher is not None:
        teacher.to(accelerator.device)
    step_box = {"step": 0}

    def prepare_batch(model, batch, step):
        step_box["step"] = step
        return batch

    def loss_step(model, batch):
        """The loss step: lambda_lm x KL(original || tuned) + ramped head loss."""
        with accelerator.autocast():
            loss, stats = medusa2_loss(model, teacher, batch, mcfg, step_box["step"], config.num_heads, t2d,
                                       global_counts(accelerator))
        return loss, {**loop.loss_logs(stats), "train/kl": stats["lm/kl_sum"] / max(stats["lm/count"], 1),
                      "train/heads_coefficient": head_ramp(step_box["step"], mcfg)}

    def evaluate(model) -> dict:
        """Drift (KL, greedy agreement, perplexities) and the heads' accuracies / simulated tau."""
        totals, loss = loop.held_out_totals(accelerator, model, eval_loader, lambda batch: medusa2_loss(
            model, teacher, batch, mcfg, EVAL_STEP, config.num_heads, t2d))
        metrics = {"eval/loss": loss, **drift_metrics(totals), **head_metrics(totals, config.num_heads)}
        return metrics

    def report(m: dict) -> str:
        return (loop.top1_report(m, "head{}_top1", "h", config.num_heads) +
                f"; drift: KL(original || tuned) {m.get('eval/kl', float('nan')):.4f}, greedy agreement "
                f"{m.get('eval/greedy_agreement', float('nan')):.3f}, perplexity {m.get('eval/ppl_original', 0):.2f} "
                f"-> {m.get('eval/ppl_tuned', 0):.2f}")

    groups = [{"params": [p for p in backbone.parameters() if p.requires_grad]},
              {"params": list(heads.parameters()), "lr": cfg.trainer.lr * mcfg.lr_multiplier}]
    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=joint, param_groups=groups, loss_step=loss_step, prepare_batch=prepare_batch,
        evaluate=evaluate, save=medusa2_saver(cfg, accelerator, config, verifier, warm), best_key="eval/simulated_tau",
        report=report, probe=lambda final: (medusa2_parts(final)[0], load_verifier(OmegaConf.merge(
            cfg.model, {"path": str(medusa2_parts(final)[1])}), accelerator.device)),
        describe=f"{config.num_heads} heads + {mcfg.backbone} backbone ({mcfg.backbone_loss} x {mcfg.lambda_lm}, heads "
                 f"{mcfg.heads_coefficient} {mcfg.heads_schedule}, lr x {mcfg.lr_multiplier}); verifier "
                 f"{verifier.name} [{verifier.fingerprint}]"))


def head_metrics(totals: dict, num_heads: int) -> dict:
    """Per-head top-1 / top-5 accuracy and the simulated acceptance length from summed stats."""
    metrics, top1 = {}, []
    for k in range(num_heads):
        count = max(totals.get(f"head{k}/count", 0.0), 1.0)
        top1.append(totals.get(f"head{k}/top1_hits", 0.0) / count)
        metrics[f"eval/head{k}_top1"] = top1[-1]
        metrics[f"eval/head{k}_top5"] = totals.get(f"head{k}/top5_hits", 0.0) / count
    metrics["eval/simulated_tau"] = simulated_tau(top1)
    return metrics


def run(cfg: DictConfig) -> dict:
    mcfg = cfg.method
    choose(BACKBONES, mcfg.backbone, "method.backbone")
    accelerator = loop.start(cfg)
    targets = mcfg.get("targets", "labels")
    choose(TARGETS, targets, "method.targets")
    if mcfg.backbone != "frozen" and targets != "labels":
        raise DraftsmithError(f"method.targets={targets} is for Medusa-1 (a frozen verifier to take the tokens "
                              f"from); method.backbone={mcfg.backbone} trains on the data: set method.targets=labels")
    if mcfg.backbone != "frozen" and cfg.data.get("features"):
        raise DraftsmithError(f"method.backbone={mcfg.backbone} tunes the verifier, so stored features cannot stand "
                              f"in for it; set data.features=null")
    if mcfg.backbone == "frozen":
        frozen = loop.frozen_verifier(cfg, accelerator)  # online, or only its lm_head with offline features
        verifier, lm_head = frozen.verifier, frozen.lm_head
    else:
        verifier, lm_head = load_verifier(cfg.model), None
    data, eval_loader = loop.training_data(cfg, accelerator, getattr(verifier, "tokenizer", None))

    # The model: K heads, optionally over the most frequent supervised tokens of the training split.
    config = MedusaConfig(hidden_size=verifier.config.hidden_size, vocab_size=verifier.config.vocab_size,
                          num_heads=mcfg.num_heads, num_layers=mcfg.num_layers, lm_head=mcfg.lm_head,
                          draft_vocab_size=mcfg.get("draft_vocab_size"))
    d2t = t2d = None
    vocab_note = "full vocabulary"
    if config.draft_vocab_size:
        counts = data.target_counts(config.vocab_size)
        d2t = draft_vocab(counts, config.draft_vocab_size)
        t2d = target_to_draft(d2t, config.vocab_size).to(accelerator.device)
        vocab_note = loop.vocab_note(counts, d2t)
    if mcfg.backbone != "frozen":
        return run_medusa2(cfg, accelerator, config, verifier, data, eval_loader, t2d, d2t)
    heads = MedusaHeads(config, lm_head, token_map=d2t).to(accelerator.device)
    warm = loop.warm_start(cfg.trainer.init_from, heads, "medusa", cfg.trainer.keep_vocab)
    if config.draft_vocab_size:  # the map the heads hold (a warm start's, unless trainer.keep_vocab=false)
        t2d = target_to_draft(heads.token_map.cpu(), config.vocab_size).to(accelerator.device)
        if warm and warm["keep_vocab"]:
            vocab_note = "the warm start's " + loop.vocab_note(counts, heads.token_map.cpu())

    def loss_step(model, batch):
        """The loss step: frozen verifier features, then the heads' weighted CE."""
        hidden = verifier_features(verifier, batch)  # (B, T, H) frozen, fp32
        labels = head_labels(hidden, batch, lm_head, targets)  # (B, T)
        with accelerator.autocast():
            loss, stats = medusa_loss(model, hidden, labels, lm_head, mcfg.decay, config.num_heads,
                                      global_counts(accelerator), t2d)
        return loss, loop.loss_logs(stats)

    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=heads, param_groups=[{"params": list(heads.parameters())}], loss_step=loss_step,
        evaluate=lambda model: evaluate(verifier, model, eval_loader, accelerator, mcfg.decay, config.num_heads,
                                        lm_head, t2d, targets),
        save=loop.drafter_saver(cfg, accelerator, "medusa", config, verifier, warm_start=warm),
        best_key="eval/simulated_tau", probe=loop.probe_on(cfg, accelerator, frozen),
        report=lambda m: loop.top1_report(m, "head{}_top1", "h", config.num_heads),
        describe=f"{config.num_heads} heads ({vocab_note}; targets: {TARGETS[targets]}), {frozen.describe()}"))


if __name__ == "__main__":
    launch("medusa", run)
