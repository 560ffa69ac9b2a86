"""Distill a draft model: a small causal LM that matches the verifier's token distributions.

    python train/draft.py                                        # SmolLM2-135M -> its first 6 layers, fkl
    python train/draft.py method=draft-tvd method.student.num_layers=4
    python train/draft.py method=draft-jsd method.onpolicy.ratio=0.5   # half the steps on student samples
    python train/draft.py data.features=<prepare_features dir with topk=...>   # offline teacher top-k
    accelerate launch --config_file conf/accelerate/zero3-8gpu.yaml train/draft.py model=llama3.1-8b-instruct

Loss at every supervised (assistant) position t: D(p_t || q_t) with p = softmax(verifier / T),
q = softmax(student / T), D = method.divergence in {fkl, rkl, jsd, tvd} (train/core/losses.py).
Data is fixed (the conversations, e.g. self-distilled) or, with probability
method.onpolicy.ratio per step, on-policy: the student samples the answers to the batch's
prompts and the verifier scores them (DistillSpec: on-policy data raises acceptance).
Held-out metrics: the divergence, the expected acceptance rate sum_x min(p, q) (the chance
one sampled draft token is accepted), greedy agreement (argmax p == argmax q) and the chain
tau they imply for method.gamma drafted tokens. The best checkpoint is chosen by acceptance.
"""
from __future__ import annotations

import random
import time

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from draftsmith.models.draft import build_student, save_draft_model
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.verifier import load_verifier
from draftsmith.train.core.accel import make_accelerator, make_optimizer, make_scheduler, place_frozen
from draftsmith.train.core.checkpoint import claim_output_dir
from draftsmith.models.entry import launch
from draftsmith.train.core.data import IGNORE_INDEX, check_data_verifier, collate_batch
from draftsmith.train.core.features import read_manifest
from draftsmith.train.core.logging import init_trackers, trackers
from draftsmith.train.core.loop import BatchStream, after_step, best_so_far, load_train_data, optimizer_step, resume
from draftsmith.train.core.losses import acceptance_rate, chain_tau, divergence


def next_token_positions(labels: torch.Tensor) -> torch.Tensor:
    """labels (B, T) -> mask (B, T) of positions t whose next token t+1 is supervised."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


@torch.no_grad()
def teacher_at(verifier, batch: dict, mask: torch.Tensor):
    """The verifier's next-token logits at the masked positions: dense (N, V) computed now,
    or the stored top-k (values, indices) (N, k) of offline features."""
    if "topk_values" in batch:
        return batch["topk_values"][mask], batch["topk_indices"][mask]
    hidden = verifier.hidden_states(batch["input_ids"], batch["attention_mask"])  # (B, T, H)
    return verifier.lm_head(hidden[mask])  # (N, V)


def distill_loss(student, verifier, batch: dict, mcfg, reduce_count=None):
    """The loss step: sum over supervised positions of D(p || q), divided by the global
    position count (times the processes that DDP averages over) -> (loss, stats)."""
    mask = next_token_positions(batch["labels"])  # (B, T)
    teacher = teacher_at(verifier, batch, mask)
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    q_logits = logits[mask]  # (N, V)
    per_pos = divergence(q_logits, teacher, mcfg.divergence, float(mcfg.temperature), float(mcfg.beta))  # (N,)
    count, world = float(per_pos.numel()), 1
    if reduce_count is not None:
        count, world = reduce_count(count)
    loss = per_pos.sum() * (world / max(count, 1.0))
    with torch.no_grad():
        accept = acceptance_rate(q_logits, teacher, 1.0)  # at T=1: the sampling acceptance rate
        top_t = teacher.argmax(-1) if isinstance(teacher, torch.Tensor) else teacher[1][:, 0].long()
        agree = (q_logits.argmax(-1) == top_t)
    stats = {"div_sum": per_pos.detach().sum().item(), "accept_sum": accept.sum().item(),
             "agree_sum": agree.sum().item(), "count": per_pos.numel()}
    return loss, stats


def global_count(accelerator):
    def reduce(count: float):
        if accelerator.num_processes == 1:
            return count, 1
        total = accelerator.reduce(torch.tensor([count], dtype=torch.float64, device=accelerator.device), "sum")
        return float(total.item()), accelerator.num_processes
    return reduce


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


@torch.no_grad()
def evaluate(student, verifier, loader, accelerator, mcfg) -> dict:
    student.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    for batch in loader:
        with accelerator.autocast():
            _, stats = distill_loss(student, verifier, batch, mcfg)
        totals += torch.tensor([stats["div_sum"], stats["accept_sum"], stats["agree_sum"], stats["count"]],
                               dtype=torch.float64, device=accelerator.device)
    student.train()
    div, accept, agree, count = accelerator.reduce(totals, "sum").tolist()
    count = max(count, 1.0)
    alpha, greedy = accept / count, agree / count
    return {"eval/divergence": div / count, "eval/acceptance_rate": alpha, "eval/greedy_agreement": greedy,
            "eval/chain_tau_sampled": chain_tau(alpha, int(mcfg.gamma)),
            "eval/chain_tau_greedy": chain_tau(greedy, int(mcfg.gamma))}


def run(cfg: DictConfig) -> dict:
    tcfg, mcfg = cfg.trainer, cfg.method
    accelerator = make_accelerator(tcfg, log_with=trackers(cfg.logger, cfg.output_dir), seed=cfg.seed)
    offline = bool(cfg.data.get("features"))
    if offline and not read_manifest(cfg.data.features).get("topk"):
        raise DraftsmithError(f"data.features={cfg.data.features} holds no teacher logits; write them with "
                              f"python scripts/prepare_features.py topk=64 (or train online)")
    if offline and float(mcfg.onpolicy.ratio) > 0:
        raise DraftsmithError("method.onpolicy.ratio > 0 needs the verifier online to score student samples; "
                              "drop data.features or set method.onpolicy.ratio=0")
    verifier = load_verifier(cfg.model)
    check_data_verifier(cfg.data, verifier.fingerprint)
    student = build_student(verifier.model, verifier.tokenizer, mcfg.student).to(accelerator.device)
    placement = "not used (offline teacher logits)" if offline else place_frozen(accelerator, verifier.model)
    data = load_train_data(cfg, verifier.tokenizer)
    claim_output_dir(cfg.output_dir, cfg, accelerator.is_main_process)
    eval_loader = accelerator.prepare(data.loader(data.eval, tcfg.eval_batch_size, shuffle=False, seed=0))

    params = sum(p.numel() for p in student.parameters())
    optimizer = make_optimizer([{"params": [p for p in student.parameters() if p.requires_grad]}], tcfg)
    scheduler = make_scheduler(optimizer, tcfg)
    student, optimizer, scheduler = accelerator.prepare(student, optimizer, scheduler)
    init_trackers(accelerator, cfg.logger, f"draft-{cfg.model.name}", OmegaConf.to_container(cfg, resolve=True),
                  cfg.output_dir)
    step = resume(accelerator, cfg)
    batches = BatchStream(accelerator, data, tcfg, cfg.seed, step)
    accelerator.print(f"draft: {mcfg.student.init} student, {params:,} params vs verifier "
                      f"{sum(getattr(p, 'ds_numel', p.numel()) for p in verifier.model.parameters()):,}; "
                      f"{mcfg.divergence} at "
                      f"T={mcfg.temperature}, on-policy ratio {mcfg.onpolicy.ratio}; {len(data.train)} train / "
                      f"{len(data.eval)} held-out conversations, {batches.per_epoch} batches/epoch; verifier "
                      f"{verifier.name} [{verifier.fingerprint}] {placement}")
    metrics: dict = {}
    best = best_so_far(cfg.output_dir, step, "eval/acceptance_rate")
    generator = torch.Generator().manual_seed(cfg.seed + 7919 * step)  # on-policy sampling seeds, resumable
    coin = random.Random(cfg.seed)
    coins = [coin.random() for _ in range(tcfg.max_steps)]  # the same fixed/on-policy choice on every process
    tokens, t0 = 0, time.time()
    bar = tqdm(total=tcfg.max_steps, initial=step, desc="draft", disable=not accelerator.is_main_process)
    student.train()
    while step < tcfg.max_steps:
        on_policy = coins[step] < float(mcfg.onpolicy.ratio)
        for _ in range(tcfg.grad_accum):
            batch = next(batches)
            if on_policy:
                batch = on_policy_batch(student, batch, mcfg, data.pad_id, verifier.tokenizer.eos_token_id, generator)
            with accelerator.accumulate(student):
                with accelerator.autocast():
                    loss, stats = distill_loss(student, verifier, batch, mcfg, global_count(accelerator))
                optimizer_step(accelerator, student, loss, optimizer, tcfg)
            tokens += int(batch["attention_mask"].sum())
        scheduler.step()  # once per optimizer step, whatever the process count
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % tcfg.log_every == 0 or step == tcfg.max_steps:
            accelerator.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                             "train/acceptance_rate": stats["accept_sum"] / max(stats["count"], 1),
                             "train/on_policy": float(on_policy),
                             "train/tokens_per_s": tokens * accelerator.num_processes / (time.time() - t0)},
                            step=step)
        new_metrics, best = after_step(
            accelerator, cfg, step, batches, best=best, key="eval/acceptance_rate", t0=t0,
            evaluate=lambda: evaluate(student, verifier, eval_loader, accelerator, mcfg),
            save=lambda m, name: save_student(cfg, accelerator, student, verifier, m, name))
        metrics = new_metrics or metrics
    bar.close()
    if not metrics:  # max_steps=0 (the undistilled baseline) or a finished run resumed: evaluate what is saved
        metrics = evaluate(student, verifier, eval_loader, accelerator, mcfg)
        accelerator.log(metrics, step=step)

    final = save_student(cfg, accelerator, student, verifier, {**metrics, "step": step}, "final")
    elapsed = time.time() - t0
    accelerator.end_training()
    accelerator.print(f"draft done: {step} steps in {elapsed:.0f}s, held-out acceptance rate "
                      f"{metrics.get('eval/acceptance_rate', float('nan')):.3f}, greedy agreement "
                      f"{metrics.get('eval/greedy_agreement', float('nan')):.3f}, drafter -> {final}")
    return {"drafter_dir": str(final), "steps": step, **metrics, "best_step": best.get("step"),
            "train_tokens_per_s": tokens * accelerator.num_processes / max(elapsed, 1e-9)}


def save_student(cfg, accelerator, student, verifier, metrics: dict, name: str):
    out = f"{cfg.output_dir}/{name}"
    state = accelerator.get_state_dict(student)  # every process: ZeRO-3 gathers the shards here
    if accelerator.is_main_process:
        save_draft_model(out, accelerator.unwrap_model(student), verifier.tokenizer, state_dict=state,
                         verifier_fingerprint=verifier.fingerprint, verifier_name=verifier.name,
                         meta={"method": cfg.method.name, "divergence": cfg.method.divergence, "metrics": metrics},
                         resolved_config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    return out


if __name__ == "__main__":
    launch("draft", run)
