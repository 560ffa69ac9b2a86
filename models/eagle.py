"""EAGLE drafters (Li et al. 2024/2025): one decoder layer that extrapolates the verifier's features.

EAGLE-1: at position t the drafter reads the verifier's final hidden state f_t and the embedding
of the next token x_{t+1}, and predicts f_{t+1}:

    f_hat_{t+1} = norm(layer(fc(concat(embed(x_{t+1}), f_t))))     fc: 2H -> H

`layer` is ONE decoder layer of the verifier's own family (with its rotary embedding and final
norm): the verifier's HF config cut to one layer and built by `AutoModel.from_config`, so the
attention, masks, positions and KV cache are transformers' own code. lm_head(f_hat_{t+1})
predicts x_{t+2}. The verifier's embedding and lm_head are frozen and shared: they are passed
in at call time and never stored in the drafter.

EAGLE-3: the input feature is fused from several verifier layers (low / middle / high) by
fuse: L*H -> H instead of being the final hidden state; unrolled drafting feeds the drafter
its own output f_hat as the feature of the next position (training-time test, see
train/eagle.py). A reduced draft vocabulary (the `draft_vocab_size` most frequent target
tokens of the training data) projects onto N << V tokens: `d2t` (N,) maps draft ids to
verifier ids and is stored in the checkpoint; the projection is the drafter's own (N x H,
initialised from the verifier's lm_head rows) or those verifier rows gathered at call time.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers import MODEL_MAPPING, AutoConfig

from draftsmith.models.errors import DraftsmithError, choose

VARIANTS = ("eagle1", "eagle3")
LM_HEAD_MODES = ("shared", "own", "gathered")  # shared: the verifier's full lm_head


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int  # the verifier's vocabulary
    decoder_config: dict  # the verifier's HF config (to_dict()); the drafter layer is built from it
    variant: str = "eagle1"  # eagle1 | eagle3
    fusion_layers: list[int] = field(default_factory=list)  # eagle3: verifier layers fused (0-based)
    draft_vocab_size: int | None = None  # None = the full vocabulary
    lm_head: str = "shared"  # shared (full vocab) | own | gathered (reduced vocab)
    attn_implementation: str = "sdpa"

    def __post_init__(self):
        choose(dict.fromkeys(VARIANTS), self.variant, "method.variant")
        choose(dict.fromkeys(LM_HEAD_MODES), self.lm_head, "method.lm_head")
        self.fusion_layers = [int(i) for i in self.fusion_layers or []]
        self.decoder_config = json.loads(json.dumps(self.decoder_config, default=str))  # as config.json stores it
        if self.variant == "eagle3" and not self.fusion_layers:
            raise DraftsmithError("method.variant=eagle3 needs method.fusion_layers (e.g. [2, 15, 27]); "
                                  "null picks models.verifier.default_fusion_layers")
        if self.variant == "eagle1" and self.fusion_layers:
            raise DraftsmithError("method.fusion_layers is for eagle3; set it to null for eagle1")
        if self.draft_vocab_size is None:
            if self.lm_head != "shared":
                raise DraftsmithError(f"method.lm_head={self.lm_head} needs method.draft_vocab_size (a reduced "
                                      f"draft vocabulary); use method.lm_head=shared for the full vocabulary")
        else:
            self.draft_vocab_size = int(self.draft_vocab_size)
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise DraftsmithError(f"method.draft_vocab_size={self.draft_vocab_size} must be in "
                                      f"[1, {self.vocab_size}] (the verifier's vocabulary)")
            if self.lm_head == "shared":
                raise DraftsmithError("method.draft_vocab_size needs method.lm_head=own or gathered "
                                      "(shared is the full vocabulary)")

    @property
    def num_draft_tokens(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size


def layer_config(config: EagleConfig):
    """The verifier's HF config cut to one full-attention layer, without a usable embedding."""
    cfg = copy.deepcopy(config.decoder_config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise DraftsmithError("the EAGLE checkpoint's decoder_config has no model_type; retrain the drafter")
    cfg.update(num_hidden_layers=1, vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
               use_cache=True, tie_word_embeddings=False)
    for key in ("layer_types", "dtype", "torch_dtype", "architectures", "quantization_config"):
        cfg.pop(key, None)
    if cfg.get("use_sliding_window") is not None:
        cfg["use_sliding_window"] = False  # one short-context layer: full attention (compactable cache)
    if "sliding_window" in cfg:
        cfg["sliding_window"] = None
    hf = AutoConfig.for_model(model_type, **cfg)
    hf._attn_implementation = config.attn_implementation
    return hf


class EagleDrafter(nn.Module):
    """fc (+ fuse) -> one verifier-family decoder layer (+ its final norm) -> predicted feature."""

    def __init__(self, config: EagleConfig, verifier_lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.variant == "eagle3":
            self.fuse = nn.Linear(len(config.fusion_layers) * h, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer_config = layer_config(config)
        # The family's model class built directly, not through from_config: under DeepSpeed ZeRO-3
        # from_config would partition it at birth (with other random draws than a 1-process run).
        self.decoder = MODEL_MAPPING[type(self.layer_config)](self.layer_config).float()
        self.decoder.embed_tokens = None  # inputs come as embeddings: the verifier's, not stored here
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))  # (N,)
        if config.lm_head == "own":
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            if verifier_lm_head is not None:
                self.init_lm_head(verifier_lm_head)

    def set_draft_vocab(self, d2t: torch.Tensor, verifier_lm_head: nn.Linear | None = None) -> None:
        """d2t (N,): verifier ids of the draft vocabulary; re-initialises an own lm_head from them."""
        if d2t.shape != self.d2t.shape:
            raise DraftsmithError(f"draft vocabulary has {d2t.numel()} ids, method.draft_vocab_size is "
                                  f"{self.d2t.numel()}")
        self.d2t.copy_(d2t)
        if self.config.lm_head == "own" and verifier_lm_head is not None:
            self.init_lm_head(verifier_lm_head)

    @torch.no_grad()
    def init_lm_head(self, verifier_lm_head: nn.Linear) -> None:
        self.lm_head.weight.copy_(verifier_lm_head.weight[self.d2t.to(verifier_lm_head.weight.device)])

    def input_features(self, hidden: torch.Tensor | None, layer_hidden: torch.Tensor | None) -> torch.Tensor:
        """The verifier's state the drafter reads: hidden (..., H) for EAGLE-1, fuse(layer_hidden
        (..., L*H)) for EAGLE-3."""
        if self.config.variant == "eagle3":
            if layer_hidden is None:
                raise DraftsmithError("the EAGLE-3 drafter needs the verifier's fusion-layer states "
                                      f"(layers {self.config.fusion_layers}); none were given")
            return self.fuse(layer_hidden.to(self.fuse.weight.dtype))
        return hidden.to(self.fc.weight.dtype)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, attention_mask=None, position_ids=None,
                cache=None) -> torch.Tensor:
        """embeds (B, T, H) of x_{t+1}, features (B, T, H) at t -> predicted features (B, T, H) at t+1.

        attention_mask: (B, T) padding mask or a 4D additive mask (B, 1, T, past + T) for trees and
        unrolled steps; position_ids (B, T); cache: a DynamicCache of this one layer (`new_cache`).
        """
        x = self.fc(torch.cat([embeds.to(self.fc.weight.dtype), features], dim=-1))  # (B, T, H)
        out = self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                           cache=cache, use_cache=cache is not None)
        return out.last_hidden_state  # (B, T, H), after the layer family's final norm

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def logits(self, features: torch.Tensor, verifier_lm_head: nn.Module) -> torch.Tensor:
        """(..., H) -> (..., N) logits over the draft vocabulary (N = V without a reduced vocab)."""
        mode = self.config.lm_head
        if mode == "own":
            return self.lm_head(features)
        if verifier_lm_head is None:
            raise DraftsmithError(f"this EAGLE drafter (lm_head={mode}) needs the verifier's lm_head at call time")
        weight = verifier_lm_head.weight
        if mode == "gathered":
            weight = weight[self.d2t]  # (N, H)
        return features.to(weight.dtype) @ weight.T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> verifier ids (identity for the full vocabulary)."""
        return draft_ids if self.config.draft_vocab_size is None else self.d2t[draft_ids]

