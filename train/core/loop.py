"""The training skeleton every recipe runs on, and its plumbing.

A recipe (train/medusa.py, train/eagle.py, train/draft.py) keeps in plain view what makes it
that method: how the trained module is built, its loss step and its held-out metrics. It
hands them to `fit` as a `Recipe`; `fit` owns everything the methods share:

    optimizer + LR schedule + accelerator.prepare      (one code path for 1 process, DDP, FSDP, ZeRO)
    trackers, resume from output_dir/checkpoints        (exact: data position, RNG, optimizer)
    while step < max_steps:
        grad_accum x [batch -> recipe.loss_step -> backward / clip / step]
        schedule step, logs, every eval_every: recipe.evaluate (+ best), every save_every: state
    final save, summary line

Below it: the frozen verifier (online, or only the tensors offline features need), the data
(online conversations or stored features), the resumable batch stream.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import PreTrainedConfig

from draftsmith.models.checkpoint import save_drafter
from draftsmith.models.draft import save_draft_model
from draftsmith.models.errors import DraftsmithError
from draftsmith.models.sources import load_conversations
from draftsmith.models.verifier import load_verifier
from draftsmith.models.vocab import label_counts
from draftsmith.train.core.accel import (
    emulated_precision,
    full_copy,
    make_accelerator,
    make_optimizer,
    make_scheduler,
    place_frozen,
    zero_stage,
)
from draftsmith.train.core.checkpoint import (
    claim_output_dir,
    latest_checkpoint,
    load_training_state,
    save_training_state,
)
from draftsmith.train.core.data import (
    check_data_verifier,
    make_dataloader,
    padding_fraction,
    split_heldout,
    tokenize_conversations,
)
from draftsmith.train.core.features import FeatureDataset, make_feature_dataloader, offline_verifier, read_manifest
from draftsmith.train.core.logging import init_trackers, trackers


@dataclass
class TrainData:
    """The two splits and how to batch them (token ids, or stored features)."""

    train: object  # datasets.Dataset or FeatureDataset
    eval: object
    offline: bool
    pad_id: int

    def target_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) how often each verifier id is a supervised target of the training split: the
        ranking a reduced draft vocabulary takes its most frequent ids from (models/vocab.py)."""
        return label_counts(self.train.labels() if self.offline else self.train["labels"], vocab_size)

    def loader(self, ds, batch_size: int, shuffle: bool, seed: int, drop_last: bool = False):
        if self.offline:
            return make_feature_dataloader(ds, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return make_dataloader(ds, batch_size, self.pad_id, shuffle=shuffle, seed=seed, drop_last=drop_last)


def vocab_note(counts: torch.Tensor, d2t: torch.Tensor) -> str:
    """The start line's account of a reduced draft vocabulary d2t (N,) under target counts (V,)."""
    share = counts[d2t].sum() / max(counts.sum(), 1)
    return (f"draft vocabulary of {d2t.numel():,} of {counts.numel():,} tokens covers {share:.1%} "
            f"of the training targets")


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


def resume(accelerator, cfg) -> dict:
    """Load the latest training state of cfg.output_dir (when trainer.resume); -> its
    trainer_state ({"step", "epoch", "tokens", "seconds"}), or step 0."""
    ckpt = latest_checkpoint(cfg.output_dir) if cfg.trainer.resume else None
    if ckpt is None:
        return {"step": 0}
    state = load_training_state(accelerator, ckpt)
    accelerator.print(f"resuming from {ckpt} at step {state['step']}")
    return state


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
               progress: dict) -> tuple[dict | None, dict]:
    """Every trainer.eval_every steps: evaluate(), log, keep the best by `key` (save(metrics,
    "best")); every trainer.snapshot_every steps: the drafter as snapshots/step-N (learning
    curves); every trainer.save_every steps: the training state. `progress` is the run's
    {"tokens", "seconds"} so far (across resumes). -> (metrics or None, best)."""
    tcfg, metrics = cfg.trainer, None
    if step % tcfg.eval_every == 0 or step == tcfg.max_steps:
        metrics = evaluate()
        accelerator.log({**metrics, "time/elapsed_s": progress["seconds"], "train/tokens": progress["tokens"]},
                        step=step)
        accelerator.print(f"step {step}: " + " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in metrics.items()))
        best = keep_best(metrics, best, key, step, save)
        if tcfg.snapshot_every and step % tcfg.snapshot_every == 0:
            save({**metrics, "step": step, **progress}, f"snapshots/step-{step:08d}")
    if step % tcfg.save_every == 0 or step == tcfg.max_steps:
        save_training_state(accelerator, cfg.output_dir, step, {"epoch": batches.epoch, **progress}, tcfg.keep_last)
    return metrics, best


def keep_best(metrics: dict, best: dict, key: str, step: int, save) -> dict:
    """The best metrics so far by `key`; a new best is saved as best/."""
    if metrics[key] > best[key]:
        best = {**metrics, "step": step}
        save(best, "best")
    return best


def out_of_time(accelerator, tcfg, seconds: float) -> bool:
    """trainer.max_minutes (null = no limit): the run's wall time across resumes is spent, on any
    process (a max over processes: every process stops after the same step)."""
    if tcfg.get("max_minutes") is None:
        return False
    flag = torch.tensor([float(seconds >= 60 * float(tcfg.max_minutes))], device=accelerator.device)
    return bool(accelerator.reduce(flag, "max").item())


def loss_logs(stats: dict) -> dict:
    """The per-part losses of a loss step's stats, as train/ logs."""
    return {f"train/{k}": v for k, v in stats.items() if k.endswith("/loss")}


def top1_report(metrics: dict, key: str, tag: str, n: int) -> str:
    """'held-out top-1 h0=.. h1=.., simulated tau ..' from eval/<key.format(i)> for i < n."""
    nan = float("nan")
    top1 = " ".join(f"{tag}{i}={metrics.get('eval/' + key.format(i), nan):.3f}" for i in range(n))
    return f"held-out top-1 {top1}, simulated tau {metrics.get('eval/simulated_tau', nan):.2f}"


def drafter_saver(cfg, accelerator, kind: str, config, verifier, draft_vocab=None, **meta):
    """The Recipe.save of every trainer: drafter folders of `kind` (see save_drafter_dir)."""
    return lambda model, metrics, name: save_drafter_dir(cfg, accelerator, model, kind, config, verifier, metrics,
                                                         name, meta, draft_vocab)


def save_drafter_dir(cfg, accelerator, model, kind: str, config, verifier, metrics: dict, name: str,
                     meta: dict | None = None, draft_vocab=None) -> str:
    """output_dir/<name> (final, best, snapshots/step-N) as a drafter folder of `kind`, with the
    verifier's fingerprint, the metrics and the resolved config, from every process: ZeRO-3
    gathers the shards in get_state_dict; no module is built here (under ZeRO-3 that would be a
    collective on one rank). Draft models are HF folders (models/draft.py, with `draft_vocab`
    (N,) their reduced vocabulary, if any), the rest models/checkpoint.py folders: both in the
    engines' layouts."""
    out = f"{cfg.output_dir}/{name}"
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        common = dict(state_dict=state, verifier_fingerprint=verifier.fingerprint, verifier_name=verifier.name,
                      meta={"method": cfg.method.name, **(meta or {}), "metrics": metrics},
                      resolved_config_yaml=OmegaConf.to_yaml(cfg, resolve=True))
        if kind == "draft":
            save_draft_model(out, accelerator.unwrap_model(model), verifier.tokenizer, draft_vocab=draft_vocab, **common)
        else:
            save_drafter(out, kind, None, config, **common)
    accelerator.wait_for_everyone()
    return out


def warm_start(path, module: torch.nn.Module, kind: str, keep_vocab: bool = True, verifier_fingerprint=None,
               field: str = "trainer.init_from") -> dict | None:
    """trainer.init_from: start `module` from a trained drafter's weights, not its optimizer state
    (fit builds a fresh optimizer; nothing of checkpoints/ is read). The drafter may come from
    another verifier: that is the point of a refresh after a fine-tune. Kinds and shapes must
    match. The draft vocabulary map travels with the weights; trainer.keep_vocab=false keeps the
    map this run computed from its own data and carries the vocabulary projections' rows over
    by token id (rows of new tokens keep their fresh initialisation). `verifier_fingerprint`
    set: the drafter must have been trained on that verifier. -> the meta.json record."""
    from draftsmith.models.checkpoint import load_drafter, medusa2_parts

    if not path:
        if not keep_vocab:
            raise DraftsmithError("trainer.keep_vocab=false recomputes the draft vocabulary map of a warm start and "
                                  "applies only with trainer.init_from=<drafter>; drop it")
        return None
    if not keep_vocab and vocab_ids(kind, module) is None:
        raise DraftsmithError(f"trainer.keep_vocab=false: this run's {kind} drafter predicts the full vocabulary, "
                              f"there is no draft vocabulary map to recompute; drop it")
    path = Path(str(path))
    path = (medusa2_parts(path) or (path,))[0]  # a Medusa-2 output: its heads
    init = load_drafter(path, verifier_fingerprint=verifier_fingerprint)  # None: a changed verifier, on purpose
    if init.kind != kind:
        raise DraftsmithError(f"{field}={path} is a {init.kind!r} drafter; this run trains {kind!r} "
                              f"(warm-start from a drafter of the same method)")
    # draftsmith's own drafter configs (medusa / eagle): name the setting that differs. An HF
    # config (a draft's) is a dataclass too in transformers 5, but holds bookkeeping
    # (architectures, _name_or_path) that differs between a saved and a fresh model of the same
    # shape: for it the shapes below are what must match.
    if (dataclasses.is_dataclass(init.config) and not isinstance(init.config, PreTrainedConfig)
            and hasattr(module, "config")):
        there, here = dataclasses.asdict(init.config), dataclasses.asdict(module.config)
        differ = [f"{k}: {there[k]} there, {here[k]} here" for k in here
                  if k != "decoder_config" and there.get(k) != here[k]]
        if differ:
            raise DraftsmithError(f"{field}={path} does not fit this run's drafter ({'; '.join(differ)}); train "
                                  f"with its settings (method.*, as in {path}/config.yaml)")
    old, new = init.module.state_dict(), module.state_dict()
    wrong = [k for k in new if k not in old or old[k].shape != new[k].shape] + [k for k in old if k not in new]
    if wrong:
        k = wrong[0]
        raise DraftsmithError(f"{field}={path} does not fit this run's drafter: {k} is "
                              f"{tuple(old[k].shape) if k in old else 'missing'} there, "
                              f"{tuple(new[k].shape) if k in new else 'missing'} here; train with its settings "
                              f"(method.*, as in {path}/config.yaml)")
    keep = bool(keep_vocab)
    state = old if keep else carry_vocab_rows(kind, init.module, module, old)
    module.load_state_dict(state)
    return {"path": str(path), "kind": kind, "verifier_fingerprint": init.meta.get("verifier_fingerprint"),
            "verifier_name": init.meta.get("verifier_name"), "keep_vocab": keep}


# kind -> (the buffers of the draft vocabulary map, the (N, H) projections whose rows are draft tokens)
VOCAB_STATE = {"medusa": (("token_map",), "lm_heads."), "eagle": (("d2t", "t2d"), "lm_head.")}


def vocab_ids(kind: str, module) -> torch.Tensor | None:
    """(N,) verifier ids of a drafter's reduced draft vocabulary, or None (full vocabulary)."""
    if kind not in VOCAB_STATE or not module.config.draft_vocab_size:
        return None
    return (module.token_map if kind == "medusa" else module.target_ids).cpu()


def carry_vocab_rows(kind: str, old_module, new_module, old: dict) -> dict:
    """The old weights under the NEW draft vocabulary map: the new map buffers, and each
    projection row of a token both maps hold copied from the old row of that token."""
    old_ids, new_ids = vocab_ids(kind, old_module), vocab_ids(kind, new_module)
    state = dict(old)
    if old_ids is None or new_ids is None:
        return state
    buffers, prefix = VOCAB_STATE[kind]
    fresh = new_module.state_dict()
    where = {int(t): i for i, t in enumerate(old_ids.tolist())}  # verifier id -> old draft row
    pairs = [(j, where[int(t)]) for j, t in enumerate(new_ids.tolist()) if int(t) in where]
    new_rows, old_rows = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs)) if pairs else (None, None)
    for key in buffers:
        state[key] = fresh[key]
    for key in state:
        if key.startswith(prefix) and key.endswith("weight"):
            rows = fresh[key].clone()  # (N, H): fresh rows (the verifier's) for the new tokens
            if new_rows is not None:
                rows[new_rows.to(rows.device)] = old[key][old_rows].to(rows.device, rows.dtype)
            state[key] = rows
    return state


def probe_on(cfg, accelerator, frozen: Frozen | None = None, verifier=None):
    """Recipe.probe: (the saved drafter, a verifier to decode with on the main process): the
    training verifier when this process holds it whole, else cfg.model loaded afresh (offline
    features, ZeRO-3 or FSDP shards)."""
    sharded = zero_stage(accelerator) == 3 or accelerator.distributed_type == DistributedType.FSDP
    whole = verifier if verifier is not None else (None if frozen is None or frozen.offline else frozen.verifier)

    def target(final: str):
        return final, whole if whole is not None and not sharded else load_verifier(cfg.model, accelerator.device)
    return target


@contextlib.contextmanager
def whole_models():
    """HF loads whole models inside. A ZeRO-3 launch sets transformers' global DeepSpeed config,
    which partitions every from_pretrained (a collective): the one process that probes after
    training must not start one."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = ref


def record_probe(cfg, data: TrainData, drafter_dir: str, verifier) -> dict | None:
    """The drafter's tau on probe.num_prompts held-out prompts (greedy, probe.max_new_tokens,
    probe.decode), written to drafter_dir/probe.json: the baseline scripts/refresh.py compares a
    changed verifier against (decode/probe.py)."""
    from draftsmith.decode import probe as probes
    from draftsmith.models.checkpoint import load_drafter

    prompts = probes.probe_prompts(data.eval, probes.probe_size(cfg.probe.num_prompts, cfg.trainer.max_steps))
    if not prompts:
        print("probe: the held-out split has no prompt with an answer; no probe recorded")
        return None
    print(f"probe: decoding {len(prompts)} held-out prompts x {cfg.probe.max_new_tokens} tokens with the drafter, the "
          f"baseline of scripts/refresh.py (probe.num_prompts=0: no probe; =N: N prompts)", flush=True)
    drafter = load_drafter(drafter_dir, verifier_fingerprint=verifier.fingerprint, dtype=verifier.model.dtype)
    probe = probes.record(verifier, drafter, cfg.probe.decode, prompts, int(cfg.probe.max_new_tokens),
                          hw=cfg.probe.get("hw", "auto"))  # (a run from before probe.hw: auto)
    probes.write_probe(drafter_dir, probe)
    print(f"probe: tau {probe['tau']:.2f} on {len(prompts)} held-out prompts x {probe['max_new_tokens']} tokens "
          f"({probe['decode'].get('name')}, {probe['dtype']}) in {probe['seconds']:.0f}s -> {drafter_dir}/probe.json")
    return probe


# ----------------------------------------------------------------------------------------
# Setup shared by the recipes


def start(cfg):
    """The accelerator for this launch (trackers from the `logger` group). A warm start from a
    folder that is not there is refused first, before the verifier and the data load."""
    for field in ("trainer.init_from", "method.init_heads"):
        path = OmegaConf.select(cfg, field)
        if path and not Path(str(path)).is_dir():
            raise DraftsmithError(f"{field}={path}: no such folder; pass a trained drafter's folder (its final/, "
                                  f"best/ or a snapshot) or drop {field}")
    return make_accelerator(cfg.trainer, log_with=trackers(cfg.logger, cfg.output_dir), seed=cfg.seed)


@dataclass
class Frozen:
    """The frozen verifier as a trainer sees it. `model` is None with offline features: only
    the tensors the drafter multiplies by (lm_head, embedding) are read from the checkpoint."""

    verifier: object  # models.verifier.Verifier, or features.OfflineVerifier
    lm_head: torch.nn.Module | None
    embed: torch.nn.Module | None
    placement: str  # for the start line: replicated / sharded / not loaded

    @property
    def offline(self) -> bool:
        return not hasattr(self.verifier, "model")

    def describe(self) -> str:
        return f"verifier {self.verifier.name} [{self.verifier.fingerprint}] {self.placement}"


def frozen_verifier(cfg, accelerator, lm_head: bool = True, embedding: bool = False) -> Frozen:
    """The verifier for a drafter trained on its states: online (placed by the launch:
    replicated, ZeRO-3 partitioned or FSDP sharded, with whole frozen copies of the lm_head and
    embedding the drafter multiplies by) or, with data.features, only those two tensors."""
    if cfg.data.get("features"):
        verifier = offline_verifier(cfg.model, read_manifest(cfg.data.features), embedding=embedding)
        embed = verifier.embed_tokens.to(accelerator.device) if embedding else None
        return Frozen(verifier, verifier.lm_head.to(accelerator.device), embed, "not loaded (offline features)")
    verifier = load_verifier(cfg.model)
    check_data_verifier(cfg.data, verifier.fingerprint)  # warns if another verifier wrote the data
    sharded = zero_stage(accelerator) == 3 or accelerator.distributed_type == DistributedType.FSDP
    whole = full_copy if sharded else (lambda module: module)  # never sharded: used as whole matrices
    head = whole(verifier.lm_head).to(accelerator.device) if lm_head else None
    embed = whole(verifier.embed_tokens).to(accelerator.device) if embedding else None
    return Frozen(verifier, head, embed, place_frozen(accelerator, verifier.model))


def training_data(cfg, accelerator, tokenizer) -> tuple[TrainData, object]:
    """The train / held-out splits (claiming output_dir for this config) and the prepared
    held-out loader."""
    data = load_train_data(cfg, tokenizer)
    claim_output_dir(cfg.output_dir, cfg, accelerator.is_main_process)
    eval_loader = accelerator.prepare(data.loader(data.eval, cfg.trainer.eval_batch_size, shuffle=False, seed=0))
    return data, eval_loader


@torch.no_grad()
def held_out_totals(accelerator, model, loader, step) -> tuple[dict[str, float], float]:
    """Run `step(batch) -> (loss, stats)` over the held-out loader in eval mode and sum each
    stat over batches and processes -> (totals, mean loss)."""
    model.eval()
    totals: dict[str, float] = {}
    loss_sum, batches = 0.0, 0
    for batch in loader:
        with accelerator.autocast():
            loss, stats = step(batch)
        loss_sum, batches = loss_sum + loss.item(), batches + 1
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
    model.train()
    keys = sorted(totals)
    summed = accelerator.reduce(torch.tensor([totals[k] for k in keys], dtype=torch.float64,
                                             device=accelerator.device), "sum").tolist() if keys else []
    return dict(zip(keys, summed)), loss_sum / max(batches, 1)


# ----------------------------------------------------------------------------------------
# The skeleton


@dataclass
class Recipe:
    """What makes a method, built by its recipe's run() and driven by `fit`. Every callable gets
    the PREPARED module (wrapped by DDP / DeepSpeed / FSDP)."""

    name: str  # method name: progress bar, tracker run name, start and end lines
    model: torch.nn.Module  # the trained module, not yet prepared
    param_groups: list[dict]  # for the optimizer (lr multipliers go here)
    loss_step: Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]  # (model, batch) -> (loss, train logs)
    evaluate: Callable[[torch.nn.Module], dict]  # held-out metrics {"eval/...": float}
    save: Callable[[torch.nn.Module, dict, str], str]  # (model, metrics, "best" | "final") -> folder
    best_key: str  # the eval metric (higher is better) that picks output_dir/best
    describe: str  # what is trained on what: the start line
    report: Callable[[dict], str]  # the end line's metrics
    prepare_batch: Callable[[torch.nn.Module, dict, int], dict] | None = None  # (model, batch, step) -> batch
    probe: Callable[[str], tuple[str, object]] | None = None  # final dir -> (drafter dir, verifier): see record_probe


def fit(cfg, accelerator, data: TrainData, recipe: Recipe) -> dict:
    """Train `recipe` for trainer.max_steps optimizer steps (resuming from output_dir) and save
    output_dir/final (and /best by recipe.best_key). -> the summary dict."""
    tcfg = cfg.trainer
    if recipe.probe is not None:
        from draftsmith.decode import probe as probes

        probes.check_config(cfg.probe)  # before any step: the probe runs after the last one
    trainable = sum(p.numel() for g in recipe.param_groups for p in g["params"])  # before ZeRO-3 partitions them
    optimizer = make_optimizer(recipe.param_groups, tcfg)
    scheduler = make_scheduler(optimizer, tcfg)
    model, optimizer, scheduler = accelerator.prepare(recipe.model, optimizer, scheduler)
    init_trackers(accelerator, cfg.logger, f"{recipe.name}-{cfg.model.name}", OmegaConf.to_container(cfg, resolve=True),
                  cfg.output_dir)
    state = resume(accelerator, cfg)
    step = state["step"]
    if tcfg.snapshot_every and tcfg.snapshot_every % tcfg.eval_every:
        raise DraftsmithError(f"trainer.snapshot_every={tcfg.snapshot_every} is not a multiple of trainer.eval_every="
                              f"{tcfg.eval_every}; snapshots are taken at evaluations (set it to a multiple, or 0)")
    batches = BatchStream(accelerator, data, tcfg, cfg.seed, step)
    padding = padding_fraction(data.loader(data.train, tcfg.batch_size, shuffle=True, seed=cfg.seed))  # from lengths
    accelerator.print(f"{recipe.name}: {recipe.describe}; {trainable:,} trainable params, {len(data.train)} train / "
                      f"{len(data.eval)} held-out conversations, {batches.per_epoch} batches/epoch "
                      f"({padding:.0%} padding)")
    slow = emulated_precision(tcfg.precision, accelerator.device)
    if slow:
        accelerator.print(slow)
    metrics: dict = {}
    best = best_so_far(cfg.output_dir, step, recipe.best_key)
    tokens, t0 = 0, time.time()  # this launch's tokens (this process) and start
    before = {"tokens": int(state.get("tokens", 0)), "seconds": float(state.get("seconds", 0.0))}  # earlier launches

    def progress() -> dict:  # the run's training tokens (all processes) and seconds, across resumes
        return {"tokens": before["tokens"] + tokens * accelerator.num_processes,
                "seconds": round(before["seconds"] + time.time() - t0, 3)}

    bar = tqdm(total=tcfg.max_steps, initial=step, desc=recipe.name, disable=not accelerator.is_main_process)
    model.train()
    timed_out = out_of_time(accelerator, tcfg, before["seconds"])  # a time-limited run resumed after its limit
    while step < tcfg.max_steps and not timed_out:
        for _ in range(tcfg.grad_accum):
            batch = next(batches)
            if recipe.prepare_batch is not None:
                batch = recipe.prepare_batch(model, batch, step)
            with accelerator.accumulate(model):
                loss, logs = recipe.loss_step(model, batch)  # the method's own loss, in its recipe
                optimizer_step(accelerator, model, loss, optimizer, tcfg)
            tokens += int(batch["attention_mask"].sum())
        scheduler.step()  # once per optimizer step, whatever the process count
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % tcfg.log_every == 0 or step == tcfg.max_steps:
            accelerator.log({"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0],
                             "train/tokens_per_s": tokens * accelerator.num_processes / (time.time() - t0), **logs},
                            step=step)
        new_metrics, best = after_step(accelerator, cfg, step, batches, best=best, key=recipe.best_key,
                                       progress=progress(),
                                       evaluate=lambda: recipe.evaluate(model),
                                       save=lambda m, name: recipe.save(model, m, name))
        metrics = new_metrics or metrics
        timed_out = out_of_time(accelerator, tcfg, progress()["seconds"])
        if timed_out and step < tcfg.max_steps:  # stop here: evaluate this step, keep its state for a rerun
            accelerator.print(f"trainer.max_minutes={tcfg.max_minutes} reached at step {step} of {tcfg.max_steps}")
            if new_metrics is None:
                metrics = recipe.evaluate(model)
                accelerator.log(metrics, step=step)
                best = keep_best(metrics, best, recipe.best_key, step, lambda m, name: recipe.save(model, m, name))
            if step % tcfg.save_every:  # (after_step saved this step's state already otherwise)
                save_training_state(accelerator, cfg.output_dir, step, {"epoch": batches.epoch, **progress()},
                                    tcfg.keep_last)
    bar.close()
    if not metrics:  # max_steps=0 (an untrained baseline) or a finished run resumed: evaluate what is saved
        metrics = recipe.evaluate(model)
        accelerator.log(metrics, step=step)

    final = recipe.save(model, {**metrics, "step": step, **progress()}, "final")
    elapsed = time.time() - t0
    probe = None
    if recipe.probe is not None and cfg.probe.num_prompts and accelerator.is_main_process:
        with whole_models():
            probe = record_probe(cfg, data, *recipe.probe(final))
    accelerator.wait_for_everyone()  # the other ranks wait for the probe: no rank tears the group down early
    for tracker in accelerator.trackers:  # not end_training(): it destroys the process group, which the entry
        tracker.finish()                  # script's launch() does at exit (scripts/refresh.py trains twice)
    probed = "" if probe is None else f"; probe tau {probe['tau']:.2f} in {probe['seconds']:.0f}s"
    accelerator.print(f"{recipe.name} done: {step} steps in {elapsed:.0f}s, {recipe.report(metrics)}, drafter -> "
                      f"{final}{probed}")
    return {"drafter_dir": str(final), "steps": step, **metrics, "best_step": best.get("step"), **progress(),
            "train_tokens_per_s": tokens * accelerator.num_processes / max(elapsed, 1e-9),
            "probe_tau": None if probe is None else probe["tau"],
            "probe_s": None if probe is None else probe["seconds"]}
