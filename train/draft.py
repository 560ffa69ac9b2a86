"""Distill a draft model: a small causal LM that matches the verifier's token distributions.

    python train/draft.py                                        # SmolLM2-135M -> its first 6 layers, fkl
    python train/draft.py method=draft-tvd method.student.num_layers=4
    python train/draft.py method=draft-jsd method.onpolicy.ratio=0.5   # half the steps on student samples
    python train/draft.py data.features=<prepare_features dir with topk=...>   # offline teacher top-k
    accelerate launch --config_file conf/accelerate/zero3-8gpu.yaml train/draft.py model=llama3.1-8b-instruct

Loss at every supervised (assistant) position t: D(p_t || q_t) with p = softmax(verifier / T),
q = softmax(student / T), D = method.divergence in {fkl, rkl, jsd, tvd, lk, nla} (train/core/losses.py).
Data is fixed (the conversations, e.g. self-distilled) or, with probability
method.onpolicy.ratio per step, on-policy: the student samples the answers to the batch's
prompts and the verifier scores them (DistillSpec: on-policy data raises acceptance).
Held-out metrics: the divergence, the expected acceptance rate sum_x min(p, q) (the chance
one sampled draft token is accepted), greedy agreement (argmax p == argmax q) and the chain
tau they imply for method.gamma drafted tokens. The best checkpoint is chosen by acceptance.
method.draft_vocab_size=N saves the N most frequent target tokens of the training split with
the draft (models/draft.py); the loss stays over the whole vocabulary (the folder stays a plain
HF model), and the held-out metrics score q restricted to those N tokens, as our decoder drafts.
"""
from __future__ import annotations

import random

import torch
from omegaconf import DictConfig

from draftsmith.models.draft import build_student, check_student_keys
from draftsmith.models.entry import launch
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import load_verifier
from draftsmith.models.vocab import IGNORE_INDEX, check_draft_vocab_size, draft_vocab, target_to_draft
from draftsmith.train.core import loop
from draftsmith.train.core.accel import global_counts
from draftsmith.train.core.data import collate_batch, next_token_positions
from draftsmith.train.core.features import read_manifest
from draftsmith.train.core.losses import acceptance_rate, chain_tau, divergence


@torch.no_grad()
def teacher_at(verifier, batch: dict, mask: torch.Tensor):
    """The verifier's next-token logits at the masked positions: dense (N, V) computed now,
    or the stored top-k (values, indices) (N, k) of offline features."""
    if "topk_values" in batch:
        return batch["topk_values"][mask], batch["topk_indices"][mask]
    hidden = verifier.hidden_states(batch["input_ids"], batch["attention_mask"])  # (B, T, H)
    return verifier.lm_head(hidden[mask])  # (N, V)


def distill_loss(student, verifier, batch: dict, mcfg, reduce_counts=None, rows: torch.Tensor | None = None):
    """The loss step: sum over supervised positions of D(p || q), divided by the global
    position count (times the processes that DDP averages over) -> (loss, stats). `rows` (V,)
    bool: the reduced draft vocabulary, which the acceptance and agreement stats restrict q to."""
    mask = next_token_positions(batch["labels"])  # (B, T)
    teacher = teacher_at(verifier, batch, mask)
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    q_logits = logits[mask]  # (N, V)
    per_pos = divergence(q_logits, teacher, mcfg.divergence, float(mcfg.temperature), float(mcfg.beta))  # (N,)
    count, world = torch.tensor([float(per_pos.numel())], dtype=torch.float64), 1  # (1,)
    if reduce_counts is not None:
        count, world = reduce_counts(count)
    loss = per_pos.sum() * (world / max(float(count[0]), 1.0))
    with torch.no_grad():
        if rows is not None:  # q as the decoder drafts it: zero outside the reduced vocabulary
            q_logits = q_logits.masked_fill(~rows, float("-inf"))
        accept = acceptance_rate(q_logits, teacher, 1.0)  # at T=1: the sampling acceptance rate
        top_t = teacher.argmax(-1) if isinstance(teacher, torch.Tensor) else teacher[1][:, 0].long()
        agree = (q_logits.argmax(-1) == top_t)
    stats = {"div_sum": per_pos.detach().sum().item(), "accept_sum": accept.sum().item(),
             "agree_sum": agree.sum().item(), "count": per_pos.numel()}
    return loss, stats


@torch.no_grad()
def on_policy_batch(student, batch: dict, mcfg, pad_id: int, eos_id: int, generator: torch.Generator) -> dict:
    """The batch's prompts (tokens before the first supervised one), answered by the student
    (sampled at method.onpolicy.temperature); labels on the sampled answer only."""
    model = getattr(student, "module", student)
    prompts = []
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        supervised = (labels != IGNORE_INDEX).nonzero()
        start = int(supervised[0]) if supervised.numel() else int((ids != pad_id).sum())
        prompts.append(ids[:start])
    width = max(p.numel() for p in prompts)
    left = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=batch["input_ids"].device)
    attn = torch.zeros_like(left)
    for b, p in enumerate(prompts):
        left[b, width - p.numel():], attn[b, width - p.numel():] = p, 1
    was_training = model.training
    model.eval()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    out = model.generate(input_ids=left, attention_mask=attn, do_sample=True, top_k=0,
                         temperature=float(mcfg.onpolicy.temperature), max_new_tokens=int(mcfg.onpolicy.max_new_tokens),
                         pad_token_id=pad_id, eos_token_id=eos_id)
    model.train(was_training)
    examples = []
    for b, p in enumerate(prompts):
        answer = out[b, width:].tolist()
        if eos_id in answer:
            answer = answer[:answer.index(eos_id) + 1]
        examples.append({"input_ids": p.tolist() + answer, "labels": [IGNORE_INDEX] * p.numel() + answer})
    return {k: v.to(batch["input_ids"].device) for k, v in collate_batch(examples, pad_id).items()}


def evaluate(student, verifier, loader, accelerator, mcfg, rows=None) -> dict:
    """Held-out divergence, acceptance rate sum_x min(p, q), greedy agreement, chain tau."""
    totals, _ = loop.held_out_totals(accelerator, student, loader,
                                lambda batch: distill_loss(student, verifier, batch, mcfg, rows=rows))
    count = max(totals.get("count", 0.0), 1.0)
    alpha, greedy = totals.get("accept_sum", 0.0) / count, totals.get("agree_sum", 0.0) / count
    return {"eval/divergence": totals.get("div_sum", 0.0) / count, "eval/acceptance_rate": alpha,
            "eval/greedy_agreement": greedy, "eval/chain_tau_sampled": chain_tau(alpha, int(mcfg.gamma)),
            "eval/chain_tau_greedy": chain_tau(greedy, int(mcfg.gamma))}


JSD_BETA = 0.5  # method.beta of every conf/method/draft-*.yaml (tests/train/test_draft_train.py checks it)


def check_method_keys(mcfg) -> None:
    """Refuse a method key this run would ignore: beta outside divergence=jsd, or a student key
    its init does not read (before any model loads)."""
    if mcfg.divergence != "jsd" and float(mcfg.beta) != JSD_BETA:
        raise DraftsmithError(f"method.beta={mcfg.beta} would be ignored: it is the JSD mixing weight, read by "
                              f"method.divergence=jsd only (divergence={mcfg.divergence}); pass method=draft-jsd, "
                              f"or drop method.beta")
    check_student_keys(mcfg.student)


def run(cfg: DictConfig) -> dict:
    mcfg = cfg.method
    check_method_keys(mcfg)
    offline = bool(cfg.data.get("features"))
    if offline and not read_manifest(cfg.data.features).get("topk"):
        raise DraftsmithError(f"data.features={cfg.data.features} holds no teacher logits; write them with "
                              f"python scripts/prepare_features.py topk=64 (or train online)")
    if offline and float(mcfg.onpolicy.ratio) > 0:
        raise DraftsmithError("method.onpolicy.ratio > 0 needs the verifier online to score student samples; "
                              "drop data.features or set method.onpolicy.ratio=0")
    accelerator = loop.start(cfg)
    if offline:  # the student is cut from (or sized after) the whole verifier: loaded, never run
        verifier, placement = load_verifier(cfg.model), "not used (offline teacher logits)"
    else:
        frozen = loop.frozen_verifier(cfg, accelerator, lm_head=False)
        verifier, placement = frozen.verifier, frozen.placement
    student = build_student(verifier.model, verifier.tokenizer, mcfg.student)
    warm = loop.warm_start(cfg.trainer.init_from, student, "draft", cfg.trainer.keep_vocab)
    student.to(accelerator.device)
    data, eval_loader = loop.training_data(cfg, accelerator, verifier.tokenizer)
    d2t, rows, vocab_note = None, None, ""
    if mcfg.get("draft_vocab_size") is not None:  # the most frequent targets of the training split
        vocab = student.config.vocab_size
        counts = data.target_counts(vocab)
        d2t = draft_vocab(counts, check_draft_vocab_size(mcfg.draft_vocab_size, vocab))
        rows = (target_to_draft(d2t, vocab) >= 0).to(accelerator.device)  # (V,) bool: in the draft vocabulary
        vocab_note = "; " + loop.vocab_note(counts, d2t)

    # Fixed data, or with probability onpolicy.ratio per step the student's own sampled answers.
    generator = torch.Generator().manual_seed(cfg.seed)  # on-policy sampling seeds, advanced per step
    coin = random.Random(cfg.seed)
    coins = [coin.random() for _ in range(cfg.trainer.max_steps)]  # the same choice on every process
    on_policy = {"step": -1, "now": False}

    def prepare_batch(model, batch, step):
        on_policy["now"] = coins[step] < float(mcfg.onpolicy.ratio)
        if on_policy["step"] != step:  # resumable: the seed of step s does not depend on earlier steps
            generator.manual_seed(cfg.seed + 7919 * step)
            on_policy["step"] = step
        if not on_policy["now"]:
            return batch
        return on_policy_batch(model, batch, mcfg, data.pad_id, verifier.tokenizer.eos_token_id, generator)

    def loss_step(model, batch):
        """The loss step: D(p || q) of the student against the frozen verifier."""
        with accelerator.autocast():
            loss, stats = distill_loss(model, verifier, batch, mcfg, global_counts(accelerator), rows)
        return loss, {"train/acceptance_rate": stats["accept_sum"] / max(stats["count"], 1),
                      "train/on_policy": float(on_policy["now"])}

    def report(m: dict) -> str:
        return (f"held-out acceptance rate {m.get('eval/acceptance_rate', float('nan')):.3f}, greedy agreement "
                f"{m.get('eval/greedy_agreement', float('nan')):.3f}")

    verifier_params = sum(getattr(p, "ds_numel", p.numel()) for p in verifier.model.parameters())
    return loop.fit(cfg, accelerator, data, loop.Recipe(
        name=mcfg.name, model=student, param_groups=[{"params": [p for p in student.parameters() if p.requires_grad]}],
        loss_step=loss_step, prepare_batch=prepare_batch,
        evaluate=lambda model: evaluate(model, verifier, eval_loader, accelerator, mcfg, rows),
        save=loop.drafter_saver(cfg, accelerator, "draft", None, verifier, draft_vocab=d2t,
                                divergence=mcfg.divergence, warm_start=warm),
        best_key="eval/acceptance_rate", report=report,
        probe=loop.probe_on(cfg, accelerator, None if offline else frozen, verifier if offline else None),
        describe=f"{mcfg.student.init} student of a {verifier_params:,}-param verifier, {mcfg.divergence} at "
                 f"T={mcfg.temperature}, on-policy ratio {mcfg.onpolicy.ratio}; verifier {verifier.name} "
                 f"[{verifier.fingerprint}] {placement}{vocab_note}"))


if __name__ == "__main__":
    launch("draft", run)
