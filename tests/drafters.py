"""Tiny drafters for the decode tests: each kind briefly fitted to a tiny verifier's own greedy
continuations (right often enough for multi-token acceptance, wrong often enough that the
rejection paths run), or random ones on the law model (tests/laws.py)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from draftsmith.decode.proposers import make_proposer
from draftsmith.models.eagle import EagleConfig, EagleDrafter
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.vocab import draft_vocab
from draftsmith.train.eagle import eagle_loss
from tests.laws import V

PEAGLE_MASK = 3  # the mask token of the P-EAGLE test drafters
PEAGLE_K = 4  # the depths a fitted P-EAGLE drafter is trained for


def greedy_corpus(model, n: int = 32, prompt_len: int = 8, new: int = 40, seed: int = 0) -> torch.Tensor:
    """(n, prompt_len + new): the model's greedy continuations of random prompts."""
    prompts = torch.randint(4, 100, (n, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=new, eos_token_id=None, pad_token_id=1)


def fitted_heads(model, num_heads: int = 4, steps: int = 100, seed: int = 0) -> MedusaHeads:
    """Medusa heads briefly fitted to the model's own greedy continuations of random prompts.

    Random (non-zero) ResBlocks, lm_heads copied from the verifier, 100 Adam steps: right often
    enough for multi-token acceptance (tau ~2), wrong often enough that rejection paths run.
    """
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 100, (32, 4), generator=g)  # same range as the test prompts
    with torch.no_grad():
        seqs = model.generate(prompts, do_sample=False, max_new_tokens=40, eos_token_id=None)  # (32, 44)
        hidden = model.model(input_ids=seqs).last_hidden_state  # (32, 44, H)
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, vocab, num_heads=num_heads),
                        verifier_lm_head=model.lm_head).to(model.dtype)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.05)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    span = seqs.shape[1] - num_heads - 2
    for _ in range(steps):
        logits = heads(hidden[:, :span])  # (K, 32, span, V)
        loss = sum(F.cross_entropy(logits[k].reshape(-1, vocab), seqs[:, k + 2 : k + 2 + span].reshape(-1))
                   for k in range(num_heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


def random_heads(model, seed: int = 0) -> MedusaHeads:
    """Untrained heads on the law model, random (non-zero) ResBlocks: proposals vary with the state."""
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, V, num_heads=4),
                        verifier_lm_head=model.lm_head).to(model.dtype)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    return heads.eval().requires_grad_(False)


def fit_eagle(drafter, inputs: dict, lm_head, steps: int, ttt: int, w_feat: float):
    """`steps` Adam steps of the EAGLE trainer's own loss (train/eagle.py: eagle_loss) -> the drafter, frozen."""
    mcfg = SimpleNamespace(decay=0.8, w_feat=w_feat, w_cls=1.0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = eagle_loss(drafter, inputs, lm_head, mcfg, ttt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


def fitted_drafter(model, variant: str, steps: int = 100, ttt: int = 1, draft_vocab_size: int | None = None):
    """An EAGLE drafter fitted for `steps` Adam steps to the model's greedy continuations, with the
    trainer's own loss: top-1 ~0.6, so trees accept several tokens and still get rejected."""
    seqs = greedy_corpus(model)
    layers = [0, 1, 1] if variant == "eagle3" else []
    extra = dict(draft_vocab_size=draft_vocab_size, lm_head="own") if draft_vocab_size else {}
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig(model.config.hidden_size, model.config.vocab_size, model.config.to_dict(),
                                       variant=variant, fusion_layers=layers, **extra)).to(model.dtype)
    with torch.no_grad():
        out = model.model(seqs, output_hidden_states=True)
        inputs = {"hidden": out.last_hidden_state, "labels": seqs.clone(), "attention_mask": torch.ones_like(seqs),
                  "embeds": model.get_input_embeddings()(seqs)}
        if layers:
            inputs["layer_hidden"] = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    if draft_vocab_size:
        drafter.set_draft_vocab(draft_vocab(torch.bincount(seqs.flatten(), minlength=128), draft_vocab_size),
                                model.lm_head)
    return fit_eagle(drafter, inputs, model.lm_head, steps, ttt, w_feat=1.0)


def random_eagle_proposer(model, tree_kwargs, seed: int = 0):
    """A random EAGLE-1 drafter on the law model (shared lm_head: its guesses are often right)."""
    torch.manual_seed(seed)
    drafter = EagleDrafter(EagleConfig(model.config.hidden_size, V, model.config.to_dict())).to(model.dtype)
    return make_proposer("eagle", drafter=drafter.eval().requires_grad_(False),
                         embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head, **tree_kwargs)


def peagle_drafter(model, layers=(0, 1, 1), k: int = PEAGLE_K, draft_vocab_size: int | None = None, seed: int = 0):
    """A random P-EAGLE drafter (EAGLE-3 layout, k parallel depths, mask token PEAGLE_MASK)."""
    extra = dict(draft_vocab_size=draft_vocab_size, lm_head="own") if draft_vocab_size else {}
    torch.manual_seed(seed)
    return EagleDrafter(EagleConfig(model.config.hidden_size, model.config.vocab_size, model.config.to_dict(),
                                    variant="eagle3", fusion_layers=list(layers), parallel_tokens=k,
                                    mask_token_id=PEAGLE_MASK, **extra)).to(model.dtype)


def fitted_peagle(model, steps: int = 150, draft_vocab_size: int | None = 64, layers=(0, 1, 1)):
    """A P-EAGLE drafter fitted for `steps` Adam steps to the model's greedy continuations with the
    trainer's loss (its K depths as placeholder steps): depth 1 ~0.6 top-1, deeper ones less."""
    seqs = greedy_corpus(model)
    drafter = peagle_drafter(model, layers=layers, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        out = model.model(seqs, output_hidden_states=True)
        embed = model.get_input_embeddings()
        inputs = {"hidden": out.last_hidden_state, "labels": seqs.clone(), "attention_mask": torch.ones_like(seqs),
                  "embeds": embed(seqs), "mask_embed": embed(torch.tensor([PEAGLE_MASK]))[0],
                  "layer_hidden": torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)}
    if draft_vocab_size:
        drafter.set_draft_vocab(draft_vocab(torch.bincount(seqs.flatten(), minlength=model.config.vocab_size),
                                            draft_vocab_size), model.lm_head)
    return fit_eagle(drafter, inputs, model.lm_head, steps, PEAGLE_K, w_feat=0.0)


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft model: the verifier with Gaussian noise on its lm_head (agrees often, not always)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(noise * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return draft
