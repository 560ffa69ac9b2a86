"""Medusa heads (Cai et al. 2024): K extra decoding heads on the verifier's last hidden state.

Head k (0-based) reads the final hidden state at position t and predicts token t+k+2 (the
verifier's own lm_head predicts t+1). Each head is `num_layers` residual layers (x + SiLU(W x + b),
W zero-initialised, so a fresh head starts as the verifier's lm_head) followed by a projection
to the vocabulary: its own Linear initialised from the verifier's lm_head (`lm_head="own"`,
as in Medusa), or the verifier's frozen lm_head itself (`lm_head="shared"`: ~K*V*h fewer
trainable parameters, a checkpoint of a few MB; the projection is still paid at run time).

The weights are named as vLLM's `MedusaModel` (vllm/model_executor/models/medusa.py) loads them:
`blocks.{k}.layers.{l}.{weight,bias}` (config `medusa_fc_bias: true`), `lm_heads.{k}.weight`;
a shared head is vLLM's `original_lm_head` (the export writes the verifier's rows as
`lm_head.weight`).

Reduced draft vocabulary (`draft_vocab_size=N`, EAGLE-3's trick, for every drafter here): the
heads project onto the N most frequent target tokens of the training data only, cutting the
V x h projection that dominates a small verifier's training step and each proposal.
`token_map` (N,) holds the verifier ids of the draft tokens (vLLM's name, with
`truncated_vocab_size` = N). Decoding calls return logits over the full vocabulary with -inf
outside the draft vocabulary, so proposers need not know.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.vocab import check_draft_vocab_size

LM_HEAD_MODES = ("own", "shared")


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    lm_head: str = "own"  # own | shared
    draft_vocab_size: int | None = None  # None = the verifier's whole vocabulary

    def __post_init__(self):
        choose(dict.fromkeys(LM_HEAD_MODES), self.lm_head, "method.lm_head")
        if self.num_heads < 1 or self.num_layers < 0:
            raise DraftsmithError(f"method.num_heads must be >= 1 and method.num_layers >= 0, "
                                  f"got {self.num_heads}, {self.num_layers}")
        check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)

    @property
    def out_size(self) -> int:
        """Logits per head in training: the draft vocabulary if reduced, else the verifier's."""
        return self.draft_vocab_size or self.vocab_size


class ResidualBlock(nn.Module):
    """`num_layers` times x <- x + SiLU(W x + b), W and b zero-initialised: the identity at first."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, verifier_lm_head: nn.Linear | None = None,
                 token_map: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        h, n = config.hidden_size, config.out_size
        self.blocks = nn.ModuleList(ResidualBlock(h, config.num_layers) for _ in range(config.num_heads))
        if config.draft_vocab_size:
            # draft id -> verifier id; set from token counts by the trainer, loaded from the checkpoint later
            self.register_buffer("token_map", torch.arange(n) if token_map is None else token_map.clone().long())
        if config.lm_head == "own":
            self.lm_heads = nn.ModuleList(nn.Linear(h, n, bias=False) for _ in range(config.num_heads))
            if verifier_lm_head is not None:
                rows = self._rows(verifier_lm_head.weight.data)
                for head in self.lm_heads:
                    head.weight.data.copy_(rows)
        self._shared_cache: tuple | None = None  # (source weight, its draft rows) for lm_head="shared"

    def _rows(self, weight: torch.Tensor) -> torch.Tensor:
        """(V, H) verifier lm_head weight -> (N, H) rows of the draft vocabulary."""
        return weight[self.token_map] if self.config.draft_vocab_size else weight

    def head_features(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """(..., H) -> (..., H): head k's residual layers."""
        return self.blocks[k](hidden)

    def project(self, features: torch.Tensor, k: int, lm_head: nn.Module | None) -> torch.Tensor:
        """(..., H) -> (..., N) logits of head k over the draft vocabulary (N = V when not reduced).
        `lm_head` is the verifier's, used when shared."""
        if self.config.lm_head == "own":
            return self.lm_heads[k](features)
        if lm_head is None:
            raise ValueError("MedusaHeads(lm_head='shared') needs the verifier's lm_head at call time")
        if not self.config.draft_vocab_size:
            return lm_head(features.to(lm_head.weight.dtype))  # the verifier may run in bf16
        weight = lm_head.weight
        if self._shared_cache is None or self._shared_cache[0] is not weight:
            self._shared_cache = (weight, self._rows(weight.detach()))  # gathered once, not per call
        rows = self._shared_cache[1]
        return F.linear(features.to(rows.dtype), rows)

    def to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., N) draft-vocabulary logits -> (..., V), -inf outside the draft vocabulary."""
        if not self.config.draft_vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_map, logits)

    def forward(self, hidden: torch.Tensor | list[torch.Tensor], lm_head: nn.Module | None = None,
                num_heads: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Logits of the first `num_heads` heads (default all).

        hidden (..., H), read by every head (decoding) -> logits (K, ..., V) over the verifier's
        vocabulary; or a list of K tensors (N_k, H), head k reading its own rows (training: each
        head only where its target is supervised) -> a list of K logits (N_k, N) over the draft
        vocabulary. Training calls go through forward so DDP / DeepSpeed see them (they sync
        gradients only for forward calls)."""
        if isinstance(hidden, (list, tuple)):
            return [self.project(self.head_features(h, k), k, lm_head) for k, h in enumerate(hidden)]
        k_max = self.config.num_heads if num_heads is None else num_heads
        feats = torch.stack([self.head_features(hidden, k) for k in range(k_max)])  # (K, ..., H)
        if self.config.lm_head == "shared":  # one projection call for all heads
            return self.to_full_vocab(self.project(feats, 0, lm_head))
        return self.to_full_vocab(torch.stack([self.project(feats[k], k, lm_head) for k in range(k_max)]))



class MedusaJoint(nn.Module):
    """Medusa-2: the verifier's backbone (LoRA-wrapped by peft, or fully trainable) and the heads,
    trained as ONE module so DDP / DeepSpeed see every parameter in one forward.

    forward(input_ids, attention_mask, positions, head_masks) -> (logits (N, V) of the tuned
    verifier at `positions` (B, T) bool, head logits: a list of K (N_k, N') at head_masks[k]).
    Only the needed rows go through the V x H projection. detach_heads: the heads read the
    backbone's states without sending gradients into it (the heads-only warm-up stage)."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads):
        super().__init__()
        self.backbone, self.heads = backbone, heads

    def lm_head(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H): the final normed states (through LoRA layers when enabled)."""
        return self.backbone.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def forward(self, input_ids, attention_mask, positions, head_masks, detach_heads: bool = False):
        hidden = self.hidden(input_ids, attention_mask)  # (B, T, H)
        lm_head = self.lm_head()
        logits = lm_head(hidden[positions])  # (N, V)
        source = (hidden.detach() if detach_heads else hidden).to(next(self.heads.parameters()).dtype)
        return logits, self.heads([source[m] for m in head_masks], lm_head)
