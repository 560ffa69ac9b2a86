"""Train an EAGLE-1, EAGLE-3 or P-EAGLE drafter on a frozen verifier.

    python train/eagle.py                                     # EAGLE-1 on SmolLM2-135M (offline default)
    python train/eagle.py method=eagle3 trainer.max_steps=200
    python train/eagle.py method=peagle method.loss=lk trainer.max_steps=200
    python train/eagle.py method=eagle3 data.features=outputs/data/features-smollm2-135m-selfdistill
    accelerate launch train/eagle.py model=vicuna-7b-v1.3 data=sharegpt method=eagle3

Drafter index t reads (x_{t+1}, verifier feature at t) and predicts the verifier's final hidden
state f_{t+1}; lm_head(f_hat_{t+1}) predicts x_{t+2}. EAGLE-1's feature is f_t, EAGLE-3's the
fused low/mid/high layer states. Training-time test (method.ttt_steps = n): the drafter is
unrolled n steps on its own outputs (step s, index t predicts f_{t+s+1} from its step s-1
output), each step's queries attending to the real prefix and to their own earlier steps, as
at decode time; step s has loss weight decay^s. Per step and position:

    loss = w_feat * SmoothL1(f_hat, f) + w_cls * token loss(draft logits, verifier token law)

on positions whose predicted token is an assistant token, with uniform noise on the verifier
features (EAGLE's augmentation). The token loss is method.loss: ce (soft cross-entropy, EAGLE's),
or an LK loss toward the acceptance rate itself (lk, nla: train/core/losses.py). Held-out evals
unroll method.eval_steps steps and report each step's top-1 agreement with the verifier's greedy
token and the simulated acceptance length.

P-EAGLE (method=peagle: method.parallel_tokens = K): step 0 is EAGLE-3's; steps 1..K-1 read the
placeholder (the embedding of method.mask_token_id, fc(mask_hidden)) at every index instead of
the next token and the previous step's output, with the same keys (the real prefix up to t and
index t's earlier steps) and positions t + s: exactly the slots the decoder appends after the
root, so the K depths the decoder drafts in one forward are the K steps trained here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from draftsmith.decode.tree import additive_mask
from draftsmith.models.eagle import FC_INITS, EagleConfig, EagleDrafter
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import default_fusion_layers, resolve_layers, resolve_path
from draftsmith.models.vocab import IGNORE_INDEX, draft_vocab
from draftsmith.train.core import loop
from draftsmith.train.core.accel import global_counts
from draftsmith.train.core.features import read_manifest
from draftsmith.train.core.losses import TOKEN_LOSSES, simulated_tau, token_loss


def shift(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """(B, T, ...) -> (B, T, ...) with out[:, t] = x[:, t + s], `fill` past the end."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def unroll_mask(pad_ok: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """4D additive mask (B, 1, T, (step+1)*T) for unrolled step `step`.

    Query t sees step-0 keys j <= t (the real prefix; padded keys hidden, its own key always)
    and its own earlier unrolled keys (step s' in 1..step, index t): the decode-time tree path.
    pad_ok (B, T) bool: step-0 key j is a real token."""
    B, T = pad_ok.shape
    eye = torch.eye(T, dtype=torch.bool, device=pad_ok.device)  # (T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=pad_ok.device).tril()  # (T, T)
    real = (causal[None] & pad_ok[:, None, :]) | eye[None]  # (B, T, T)
    allowed = torch.cat([real] + [eye[None].expand(B, T, T)] * step, dim=-1)  # (B, T, (step+1)T)
    return additive_mask(allowed, dtype)[:, None]  # (B, 1, T, (step+1)T)


def target_law(drafter, target: dict, lm_head) -> torch.Tensor:
    """The verifier's next-token law at every position, over the draft vocabulary: (B, T, V').

    From the stored top-k logits when the features have them (renormalised over the k), else
    softmax(lm_head(f)). A reduced draft vocabulary keeps its tokens' mass, renormalised: the
    softmax over those rows of lm_head only, so the V x H projection is never paid in full.
    Computed once per batch; unrolled step s reads position t + s + 1."""
    drafter_vocab = drafter.config.draft_vocab_size
    if "topk_values" in target:
        values = target["topk_values"].float()  # (B, T, k)
        indices = target["topk_indices"].long()  # (B, T, k)
        law = torch.softmax(values, dim=-1)  # (B, T, k)
        width = drafter.config.vocab_size
        if drafter_vocab is not None:  # verifier id -> draft index, -1 outside the draft vocabulary
            ids = drafter.target_ids.to(indices.device)
            where = torch.full((width,), -1, dtype=torch.long, device=indices.device)
            where[ids] = torch.arange(ids.numel(), device=indices.device)
            indices, width = where[indices], ids.numel()
            law = law * (indices >= 0)
            indices = indices.clamp_min(0)
        probs = law.new_zeros(*values.shape[:2], width).scatter_add_(-1, indices, law)  # (B, T, V')
    else:
        weight = lm_head.weight  # (V, H)
        bias = getattr(lm_head, "bias", None)
        if drafter_vocab is not None:
            ids = drafter.target_ids.to(weight.device)
            weight, bias = weight[ids], (bias[ids] if bias is not None else None)  # (V', H)
        logits = F.linear(target["hidden"].to(weight.dtype), weight, bias).float()  # (B, T, V')
        probs = torch.softmax(logits, dim=-1)
    if drafter_vocab is not None:
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    return probs


def unroll(drafter, embeds: torch.Tensor, feature: torch.Tensor, attn: torch.Tensor, steps: int,
           placeholder: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Yield the drafter's predictions (B, T, H) of each unrolled step: at step s, index t holds
    the prediction of f_{t+s+1}, made from the real pairs up to t and its own steps before.

    embeds (B, T, H) of the tokens, feature (B, T, H) the drafter's input feature at each t,
    attn (B, T) the padding mask. One cache holds every step's keys (see unroll_mask).
    placeholder (P-EAGLE): (embedding (H,), feature (H,)) that steps >= 1 read at every index
    instead of the token x_{t+s+1} and the previous step's output."""
    B, T, _ = embeds.shape
    cache = getattr(drafter, "module", drafter).new_cache()
    pad_ok = shift(attn, 1, False)  # step-0 key j is the pair (x_{j+1}, f_j): real iff x_{j+1} is
    for s in range(steps):
        position_ids = (torch.arange(T, device=embeds.device) + s)[None].expand(B, T)  # (B, T)
        mask = unroll_mask(pad_ok, s, feature.dtype)
        token = shift(embeds, s + 1)  # (B, T, H): input token x_{t+s+1}
        if placeholder is not None and s > 0:
            token, feature = (x.expand(B, T, -1) for x in placeholder)  # (B, T, H) each
        feature = drafter(token, feature, attention_mask=mask, position_ids=position_ids, cache=cache)  # (B, T, H)
        yield feature


def eagle_loss(drafter, inputs: dict, lm_head, mcfg, steps: int, noise: float = 0.0, reduce_counts=None):
    """One batch -> (loss, stats). inputs: embeds (B, T, H) of the tokens, hidden (B, T, H) final
    verifier states, layer_hidden (B, T, L*H) for EAGLE-3, labels / attention_mask (B, T),
    optionally topk_values / topk_indices (B, T, k).

    Each step's loss is summed over its positions and divided by that step's position count
    over ALL processes (`reduce_counts`, as in train/medusa.py), times the process count that
    DDP/DeepSpeed average over: the same gradient for 1 or N processes."""
    drafter_ = getattr(drafter, "module", drafter)  # unwrap DDP for the helper calls
    hidden, labels, attn = inputs["hidden"], inputs["labels"], inputs["attention_mask"].bool()
    valid = [shift(attn, s + 1, False) & (shift(labels, s + 2, IGNORE_INDEX) != IGNORE_INDEX)  # (B, T) per step
             for s in range(steps)]
    counts = torch.tensor([float(v.sum()) for v in valid], dtype=torch.float64)  # (steps,)
    world = 1
    if reduce_counts is not None:
        counts, world = reduce_counts(counts)
    source = inputs.get("layer_hidden") if drafter_.config.variant == "eagle3" else hidden
    if noise:  # EAGLE's uniform feature noise, on the verifier states the drafter reads
        source = source + (torch.rand_like(source) - 0.5) * noise
    dtype = next(drafter_.parameters()).dtype  # DeepSpeed bf16 holds the drafter in bf16 (no autocast)
    feature = drafter_.input_features(source.to(dtype), source.to(dtype))  # (B, T, H)
    law = target_law(drafter_, inputs, lm_head)  # (B, T, V'): the targets of every step
    placeholder = None
    if drafter_.config.parallel_tokens:  # P-EAGLE: steps >= 1 are the placeholder slots
        placeholder = (inputs["mask_embed"].to(dtype), drafter_.placeholder_features())  # (H,), (H,)
    kind = getattr(mcfg, "loss", "ce")
    loss = hidden.new_zeros(())
    stats: dict[str, float] = {}
    for s, feature in enumerate(unroll(drafter, inputs["embeds"].to(dtype), feature, attn, steps, placeholder)):
        b, t = valid[s].nonzero(as_tuple=True)  # (N,) each: step s predicts position t + s + 1 (< T: valid)
        pred = feature[b, t]  # (N, H)
        f_true = hidden[b, t + s + 1].to(pred.dtype)  # (N, H)
        probs = law[b, t + s + 1]  # (N, V')
        logits = drafter_.logits(pred, lm_head).float()  # (N, V')
        feat_sum = F.smooth_l1_loss(pred.float(), f_true.float(), reduction="sum") / pred.shape[-1]
        cls_sum = token_loss(logits, probs, kind)
        step_sum = mcfg.w_feat * feat_sum + mcfg.w_cls * cls_sum
        loss = loss + mcfg.decay ** s * step_sum * (world / max(float(counts[s]), 1.0))
        with torch.no_grad():  # every key on every process, even without rows (stats are summed across them)
            stats[f"step{s}/loss"] = step_sum.item() / max(b.numel(), 1)
            stats[f"step{s}/top1_hits"] = (logits.argmax(-1) == probs.argmax(-1)).sum().item()
            stats[f"step{s}/count"] = b.numel()
    return loss, stats


@torch.no_grad()
def verifier_inputs(verifier, batch, layers: list[int], embed, mask_token_id: int | None = None) -> dict:
    """What the loss needs from the frozen verifier: stored offline, or computed now (fp32);
    with a P-EAGLE mask token, its embedding (H,) as mask_embed."""
    if "hidden" in batch:
        feats = {k: batch[k] for k in ("hidden", "layer_hidden", "topk_values", "topk_indices") if k in batch}
        if layers and "layer_hidden" not in feats:
            raise DraftsmithError("data.features holds no layer states; rerun scripts/prepare_features.py with "
                                  f"layers={layers} for method=eagle3")
    else:
        feats = verifier.features(batch["input_ids"], batch["attention_mask"], layers=layers)
    out = {k: (v.float() if v.is_floating_point() else v) for k, v in feats.items()}
    out.update(labels=batch["labels"], attention_mask=batch["attention_mask"],
               embeds=embed(batch["input_ids"]).float())
    if mask_token_id is not None:
        out["mask_embed"] = embed(torch.tensor([mask_token_id], device=batch["input_ids"].device))[0].float()
    return out


def evaluate(verifier, drafter, loader, accelerator, mcfg, layers, embed, lm_head, mask_token_id=None) -> dict:
    """Held-out loss, per unrolled step top-1 agreement with the verifier, simulated tau."""
    totals, loss = loop.held_out_totals(accelerator, drafter, loader, lambda batch: eagle_loss(
        drafter, verifier_inputs(verifier, batch, layers, embed, mask_token_id), lm_head, mcfg, mcfg.eval_steps))
    metrics = {"eval/loss": loss}
    top1 = []
    for s in range(mcfg.eval_steps):
        top1.append(totals.get(f"step{s}/top1_hits", 0.0) / max(totals.get(f"step{s}/count", 0.0), 1.0))
        metrics[f"eval/step{s}_top1"] = top1[-1]
    metrics["eval/simulated_tau"] = simulated_tau(top1)
    return metrics


def drafter_config(cfg, verifier, hf_config: dict, num_layers: int, stored_layers: list[int] | None) -> EagleConfig:
    """The drafter's config; EAGLE-3 fusion layers: method.fusion_layers, else the layers stored
    with offline features, else models.verifier.default_fusion_layers."""
    mcfg = cfg.method
    layers = []
    if mcfg.variant == "eagle3":
        given = mcfg.fusion_layers if mcfg.fusion_layers is not None else stored_layers
        layers = resolve_layers(given if given else default_fusion_layers(num_layers), num_layers)
        if stored_layers is not None and layers != list(stored_layers):
            raise DraftsmithError(f"method.fusion_layers={layers} but data.features holds layers {stored_layers}; "
                                  f"set method.fusion_layers=null or rerun scripts/prepare_features.py layers={layers}")
    return EagleConfig(hidden_size=verifier.config.hidden_size, vocab_size=verifier.config.vocab_size,
                       decoder_config=hf_config, variant=mcfg.variant, fusion_layers=layers,
                       draft_vocab_size=mcfg.draft_vocab_size, lm_head=mcfg.lm_head,
                       attn_implementation=mcfg.attn_implementation,
                       norm_before_residual=bool(mcfg.get("norm_before_residual", False)),
                       parallel_tokens=mcfg.get("parallel_tokens", 0), mask_token_id=mcfg.get("mask_token_id"))


def unrolled_steps(mcfg) -> int:
    """Training steps unrolled: EAGLE's method.ttt_steps, or P-EAGLE's method.parallel_tokens
    (the depths its one forward drafts); a key of the other method is refused, as are held-out
    steps beyond the depths a P-EAGLE drafter is trained for."""
    choose(TOKEN_LOSSES, mcfg.get("loss", "ce"), "method.loss")
    parallel = mcfg.get("parallel_tokens")
    if parallel is None:
        return int(mcfg.ttt_steps)
    if mcfg.get("ttt_steps") is not None:
        raise DraftsmithError(f"method.ttt_steps={mcfg.ttt_steps} is EAGLE's sequential unroll; a P-EAGLE run trains "
                              f"method.parallel_tokens={parallel} depths instead: drop one of them (method=peagle "
                              f"has no ttt_steps)")
    if int(mcfg.eval_steps) > int(parallel):
        raise DraftsmithError(f"method.eval_steps={mcfg.eval_steps} > method.parallel_tokens={parallel}: a P-EAGLE "
                              f"drafter drafts {parallel} tokens per forward, deeper slots are untrained; set "
                              f"method.eval_steps <= {parallel}")
    return int(parallel)


def run(cfg: DictConfig) -> dict:
    mcfg = cfg.method
    choose(dict.fromkeys(FC_INITS), mcfg.fc_init, "method.fc_init")  # before any work, as EagleConfig's keys
    if mcfg.fc_init == "passthrough" and cfg.trainer.init_from:
        raise DraftsmithError(f"method.fc_init=passthrough would be overwritten by trainer.init_from="
                              f"{cfg.trainer.init_from}; drop one of them")
    steps = unrolled_steps(mcfg)
    accelerator = loop.start(cfg)
    frozen = loop.frozen_verifier(cfg, accelerator, embedding=True)  # online, or only its lm_head and embedding
    verifier, lm_head, embed = frozen.verifier, frozen.lm_head, frozen.embed
    hf_config = json.loads((Path(resolve_path(cfg.model)) / "config.json").read_text()) if frozen.offline \
        else verifier.config.to_dict()
    data, eval_loader = loop.training_data(cfg, accelerator, getattr(verifier, "tokenizer", None))

    # The model: one decoder layer of the verifier's family over fc(embedding, feature).
    stored = read_manifest(cfg.data.features).get("layers", []) if frozen.offline else None
    config = drafter_config(cfg, verifier, hf_config, int(hf_config["num_hidden_layers"]), stored)
    layers = config.fusion_layers
    drafter = EagleDrafter(config)
    if config.draft_vocab_size is not None:  # the most frequent assistant tokens of the training split
        drafter.set_draft_vocab(draft_vocab(data.target_counts(config.vocab_size), config.draft_vocab_size), lm_head)
    if mcfg.fc_init == "passthrough":  # fc starts on the verifier's own state (models/eagle.py)
        drafter.passthrough_fc()
    warm = loop.warm_start(cfg.trainer.init_from, drafter, "eagle", cfg.trainer.keep_vocab)
    drafter.to(accelerator.device)

    mask_id = config.mask_token_id

    def loss_step(model, batch):
        """The loss step: frozen verifier states, then the unrolled drafter's feature + token loss."""
        inputs = verifier_inputs(verifier, batch, layers, embed, mask_id)
        with accelerator.autocast():
            loss, stats = eagle_loss(model, inputs, lm_head, mcfg, steps, mcfg.noise, global_counts(accelerator))
        return loss, loop.loss_logs(stats)

    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=drafter, param_groups=[{"params": [p for p in drafter.parameters() if p.requires_grad]}],
        loss_step=loss_step,
        evaluate=lambda model: evaluate(verifier, model, eval_loader, accelerator, mcfg, layers, embed, lm_head, mask_id),
        save=loop.drafter_saver(cfg, accelerator, "eagle", config, verifier, warm_start=warm),
        best_key="eval/simulated_tau", probe=loop.probe_on(cfg, accelerator, frozen),
        report=lambda m: loop.top1_report(m, "step{}_top1", "s", mcfg.eval_steps),
        describe=f"{'P-EAGLE' if config.parallel_tokens else config.variant} drafter (fusion layers {layers or '-'}; "
                 f"draft vocab {config.num_draft_tokens}"
                 f"{f'; {config.parallel_tokens} tokens a forward' if config.parallel_tokens else ''}; "
                 f"{mcfg.get('loss', 'ce')} loss), {frozen.describe()}"))


if __name__ == "__main__":
    launch("eagle", run)
