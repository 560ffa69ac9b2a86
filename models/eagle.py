"""EAGLE drafters (Li et al. 2024/2025), in the layouts vLLM and SGLang load as they stand.

Conventions: H the verifier's hidden size, V its vocabulary, N the draft vocabulary (N = V
without a reduced one). The drafter is one Llama decoder layer with the verifier's dimensions
and rotary settings (the engines' EAGLE drafters are Llama layers whatever the verifier's
family), built from transformers' own LlamaAttention / LlamaMLP / LlamaRMSNorm /
LlamaRotaryEmbedding; the verifier's embedding and (EAGLE-1) lm_head are passed in at call
time and never stored.

EAGLE-1 (vLLM `llama_eagle.py`, architecture EagleLlamaForCausalLM). At position t the drafter
reads the verifier's final (normed) hidden state f_t and the embedding of x_{t+1}:

    x = fc(concat(embed(x_{t+1}), f_t))                   fc: 2H -> H, no bias
    h = x + attn(x)                                       layer 0 has NO input norm
    f_hat_{t+1} = h + mlp(post_attention_layernorm(h))    NO final norm

lm_head(f_hat_{t+1}) predicts x_{t+2}; f_hat is fed back as the next feature. Weights:
fc.weight, layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.
(The published EAGLE-1 checkpoints also carry fc.bias, which vLLM drops: `fc_bias=True`
imports them faithfully; such a drafter is refused by the vLLM export.)

EAGLE-3 (vLLM / SGLang `llama_eagle3.py`, SpecForge, architecture LlamaForCausalLMEagle3):

    g_t = fc(concat(s_t^low, s_t^mid, s_t^high))           fc: 3H -> H, no bias (verifier states only)
    a = concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))       (2H: q/k/v read 2H)
    h = g_t + attn(a)                                        (norm_before_residual: hidden_norm(g_t) + attn(a))
    p_{t+1} = h + mlp(post_attention_layernorm(h))          the pre-norm state, fed back as g_{t+1}
    logits = lm_head(norm(p_{t+1}))                          over the N draft tokens

Weights: fc.weight, midlayer.{input_layernorm, hidden_norm, self_attn.*, post_attention_layernorm,
mlp.*}, norm.weight, lm_head.weight (N, H), d2t (N,) int64 OFFSETS (draft id i is verifier id
i + d2t[i]) and t2d (V,) bool (verifier id is in the draft vocabulary). `fusion_layers` are
0-based verifier layers whose OUTPUTS are fused (HF hidden_states[i + 1]); vLLM's
`eagle_aux_hidden_state_layer_ids` count one higher (id j = hidden_states[j]), SGLang's are ours.

P-EAGLE (Hui et al. 2026, arXiv 2602.01469; vLLM `llama_eagle3.py` with speculative_config
`parallel_drafting`): an EAGLE-3 drafter (`parallel_tokens` = K > 0) that proposes K tokens in ONE
forward. The root's pair (x_{t+1}, g_t) predicts x_{t+2} as in EAGLE-3; K - 1 placeholder slots
follow it at positions t+1 .. t+K-1, each reading the embedding of `mask_token_id` (the
verifier's, shared) and the feature fc(mask_hidden), a learned (L*H,) vector in fc's input space
(vLLM: `mask_hidden`, projected by combine_hidden_states); slot d predicts x_{t+d+2}. The
placeholders attend causally (the prefix, the root, the earlier placeholders), never to drafted
tokens, so a slot's law does not depend on the tokens drafted before it.

The reduced draft vocabulary (any variant) projects onto N << V tokens through the drafter's own
N x H lm_head (`own`, initialised from the verifier's rows) or those verifier rows gathered at
call time (`gathered`); `shared` is the verifier's full lm_head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.vocab import check_draft_vocab_size

VARIANTS = ("eagle1", "eagle3")
LM_HEAD_MODES = ("shared", "own", "gathered")  # shared: the verifier's full lm_head
FC_INITS = ("random", "passthrough")  # method.fc_init (training only): EagleDrafter.passthrough_fc


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int  # the verifier's vocabulary
    decoder_config: dict  # the verifier's HF config (to_dict()): dimensions and rotary settings of the layer
    variant: str = "eagle1"  # eagle1 | eagle3
    fusion_layers: list[int] = field(default_factory=list)  # eagle3: verifier layers whose outputs are fused
    draft_vocab_size: int | None = None  # None = the full vocabulary
    lm_head: str = "shared"  # shared (full vocab) | own | gathered (reduced vocab)
    attn_implementation: str = "sdpa"
    fc_bias: bool = False  # True only for imported EAGLE-1 checkpoints of the original repository
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(g), not g (vLLM's config key)
    parallel_tokens: int = 0  # P-EAGLE (eagle3 only): K >= 2 tokens proposed by one forward (the depths trained); 0 = EAGLE
    mask_token_id: int | None = None  # P-EAGLE: the verifier id whose embedding the placeholder slots read

    def __post_init__(self):
        choose(dict.fromkeys(VARIANTS), self.variant, "method.variant")
        choose(dict.fromkeys(LM_HEAD_MODES), self.lm_head, "method.lm_head")
        self.fusion_layers = [int(i) for i in self.fusion_layers or []]
        self.decoder_config = json.loads(json.dumps(self.decoder_config, default=str))  # as config.json stores it
        if self.variant == "eagle3" and not self.fusion_layers:
            raise DraftsmithError("method.variant=eagle3 needs method.fusion_layers (e.g. [1, 14, 26]); "
                                  "null picks models.verifier.default_fusion_layers")
        if self.variant == "eagle1" and self.fusion_layers:
            raise DraftsmithError("method.fusion_layers is for eagle3; set it to null for eagle1")
        if self.variant == "eagle1" and self.norm_before_residual:
            raise DraftsmithError("method.norm_before_residual is for eagle3 (EAGLE-1's layer has no hidden_norm)")
        if self.variant == "eagle3" and self.fc_bias:
            raise DraftsmithError("fc_bias is for imported EAGLE-1 checkpoints; EAGLE-3's fc has no bias")
        self.check_parallel()
        if self.draft_vocab_size is None:
            if self.lm_head != "shared":
                raise DraftsmithError(f"method.lm_head={self.lm_head} needs method.draft_vocab_size (a reduced "
                                      f"draft vocabulary); use method.lm_head=shared for the full vocabulary")
        else:
            check_draft_vocab_size(self.draft_vocab_size, self.vocab_size)
            if self.lm_head == "shared":
                raise DraftsmithError("method.draft_vocab_size needs method.lm_head=own or gathered "
                                      "(shared is the full vocabulary)")

    def check_parallel(self) -> None:
        """P-EAGLE's keys: parallel_tokens >= 2 on EAGLE-3 with a mask token in the vocabulary."""
        k, mask = self.parallel_tokens, self.mask_token_id
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or k == 1:
            raise DraftsmithError(f"method.parallel_tokens={k}: P-EAGLE proposes K >= 2 tokens per drafter forward "
                                  f"(0 = sequential EAGLE; for one token use method=eagle3)")
        if k and self.variant != "eagle3":
            raise DraftsmithError(f"method.parallel_tokens={k} is P-EAGLE, which drafts with an EAGLE-3 drafter; "
                                  f"set method.variant=eagle3 (or use method=peagle)")
        if k and (isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < self.vocab_size):
            raise DraftsmithError(f"method.mask_token_id={mask}: P-EAGLE's placeholder slots read a verifier token's "
                                  f"embedding; give an id in 0..{self.vocab_size - 1}")
        if not k and mask is not None:
            raise DraftsmithError(f"method.mask_token_id={mask} is read by P-EAGLE only (method.parallel_tokens >= 2); "
                                  f"drop it")

    @property
    def num_draft_tokens(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size


def llama_layer_config(config: EagleConfig) -> LlamaConfig:
    """A one-layer LlamaConfig with the verifier's dimensions, norm epsilon and rotary settings."""
    cfg = dict(config.decoder_config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise DraftsmithError("the EAGLE checkpoint's decoder_config has no model_type; retrain the drafter")
    for key in ("dtype", "torch_dtype", "architectures", "quantization_config", "layer_types", "auto_map"):
        cfg.pop(key, None)
    v = AutoConfig.for_model(model_type, **cfg)  # the verifier's own config class reads its own keys
    heads = v.num_attention_heads
    head_dim = getattr(v, "head_dim", None) or v.hidden_size // heads
    rope = getattr(v, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(v, "rope_theta", 1e4)}
    lc = LlamaConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=1,
                     num_attention_heads=heads, num_key_value_heads=getattr(v, "num_key_value_heads", None) or heads,
                     head_dim=head_dim, hidden_act=getattr(v, "hidden_act", "silu"),
                     rms_norm_eps=getattr(v, "rms_norm_eps", 1e-6),
                     max_position_embeddings=getattr(v, "max_position_embeddings", 4096),
                     rope_parameters=dict(rope), vocab_size=config.vocab_size, attention_bias=False, mlp_bias=False,
                     tie_word_embeddings=False, initializer_range=getattr(v, "initializer_range", 0.02),
                     pad_token_id=None, bos_token_id=None, eos_token_id=None)
    lc._attn_implementation = config.attn_implementation
    return lc


class EagleLayer(nn.Module):
    """The drafter's decoder layer. fused_input (EAGLE-3): attention reads concat(input_layernorm(embed),
    hidden_norm(feature)), 2H wide; otherwise (EAGLE-1 layer 0) the fc output itself, without a norm."""

    def __init__(self, lc: LlamaConfig, fused_input: bool, norm_before_residual: bool = False):
        super().__init__()
        self.fused_input, self.norm_before_residual = fused_input, norm_before_residual
        h = lc.hidden_size
        self.self_attn = LlamaAttention(lc, layer_idx=0)
        if fused_input:
            self.input_layernorm = LlamaRMSNorm(h, eps=lc.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=lc.rms_norm_eps)
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.self_attn, name)
                setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=False))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=lc.rms_norm_eps)
        self.mlp = LlamaMLP(lc)

    def forward(self, x, embeds, position_embeddings, attention_mask, cache) -> torch.Tensor:
        """x (B, T, H) the layer input (EAGLE-1: fc output; EAGLE-3: the feature g), embeds (B, T, H)."""
        residual = x
        if self.fused_input:
            g = self.hidden_norm(x)
            residual = g if self.norm_before_residual else x
            a = torch.cat([self.input_layernorm(embeds), g], dim=-1)  # (B, T, 2H)
        else:
            a = x
        attn, _ = self.self_attn(hidden_states=a, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, cache=cache)
        h = residual + attn  # (B, T, H)
        return h + self.mlp(self.post_attention_layernorm(h))


def causal_mask(batch: int, new: int, past: int, pad: torch.Tensor | None, dtype, device) -> torch.Tensor | None:
    """4D additive mask (B, 1, new, past + new): query i sees keys j <= past + i (and, with a
    (B, past + new) or (B, new) padding mask `pad`, only real keys besides itself). None when one
    query needs no mask."""
    if new == 1 and pad is None:
        return None
    q = torch.arange(new, device=device)[:, None] + past  # (new, 1)
    allowed = (torch.arange(past + new, device=device)[None] <= q)[None].expand(batch, -1, -1)  # (B, new, kv)
    if pad is not None:
        pad = pad.bool().to(device)
        if pad.shape[1] == new and past:
            pad = torch.cat([pad.new_ones(batch, past), pad], dim=1)
        allowed = (allowed & pad[:, None, :]) | (torch.arange(past + new, device=device)[None] == q)[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


class EagleDrafter(nn.Module):
    """fc -> one Llama decoder layer (-> norm for EAGLE-3) -> the predicted feature."""

    def __init__(self, config: EagleConfig, verifier_lm_head: nn.Linear | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        lc = self.layer_config = llama_layer_config(config)
        if lc.hidden_size != h:
            raise DraftsmithError(f"the EAGLE config's hidden_size {h} differs from its decoder_config's "
                                  f"{lc.hidden_size}")
        if config.variant == "eagle3":
            self.fc = nn.Linear(len(config.fusion_layers) * h, h, bias=False)
            self.midlayer = EagleLayer(lc, fused_input=True, norm_before_residual=config.norm_before_residual)
            self.norm = LlamaRMSNorm(h, eps=lc.rms_norm_eps)
        else:
            self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
            self.layers = nn.ModuleList([EagleLayer(lc, fused_input=False)])
        self.rotary_emb = LlamaRotaryEmbedding(lc)  # its inv_freq buffer is not persistent: not in the weights
        if config.draft_vocab_size is not None:
            n = config.draft_vocab_size
            # offsets 0: the first N verifier ids until set_draft_vocab
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))  # (N,) offsets: target = i + d2t[i]
            self.register_buffer("t2d", torch.arange(config.vocab_size) < n)  # (V,) bool
        if config.lm_head == "own":
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if config.parallel_tokens:  # P-EAGLE's placeholder, in fc's input space (vLLM's mask_hidden)
            self.mask_hidden = nn.Parameter(torch.empty(len(config.fusion_layers) * h))  # (L*H,)
        self.reset_parameters(lc.initializer_range)
        if config.lm_head == "own" and verifier_lm_head is not None:
            self.init_lm_head(verifier_lm_head)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """HF's initialisation: Linear weights N(0, std), biases 0, norms 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, LlamaRMSNorm):
                m.weight.fill_(1.0)
        if self.config.parallel_tokens:  # after the rest: the other weights are an EAGLE-3's of the same seed
            self.mask_hidden.normal_(0.0, 1.0)

    @property
    def layer(self) -> EagleLayer:
        return self.midlayer if self.config.variant == "eagle3" else self.layers[0]

    @property
    def target_ids(self) -> torch.Tensor:
        """(N,) verifier ids of the draft vocabulary (absolute), from the stored offsets."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, ids: torch.Tensor, verifier_lm_head: nn.Linear | None = None) -> None:
        """ids (N,): verifier ids of the draft vocabulary; re-initialises an own lm_head from them."""
        if ids.shape != self.d2t.shape:
            raise DraftsmithError(f"draft vocabulary has {ids.numel()} ids, method.draft_vocab_size is "
                                  f"{self.d2t.numel()}")
        ids = ids.to(self.d2t.device).long()
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        if self.config.lm_head == "own" and verifier_lm_head is not None:
            self.init_lm_head(verifier_lm_head)

    @torch.no_grad()
    def passthrough_fc(self) -> None:
        """method.fc_init=passthrough: fc starts by passing the verifier's state through, not as
        N(0, 0.02): EAGLE-3's g = the last fused layer's output (the high state; low and mid
        start at zero weight), EAGLE-1's fc(e, f) = f. The drafter's layer then starts on the
        verifier's own state instead of a random projection of it."""
        h = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        if self.fc.bias is not None:
            self.fc.bias.zero_()

    @torch.no_grad()
    def init_lm_head(self, verifier_lm_head: nn.Linear) -> None:
        self.lm_head.weight.copy_(verifier_lm_head.weight[self.target_ids.to(verifier_lm_head.weight.device)])

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the drafter computes in: its norm's (not fc's weight, which an int8 copy of
        the drafter, decode/quant.py, keeps as int8 rows)."""
        return self.layer.post_attention_layernorm.weight.dtype

    def input_features(self, hidden: torch.Tensor | None, layer_hidden: torch.Tensor | None) -> torch.Tensor:
        """The verifier's state the drafter reads: hidden (..., H) for EAGLE-1, fc(layer_hidden
        (..., L*H)) for EAGLE-3. The drafter's own outputs are fed back as they are."""
        if self.config.variant == "eagle3":
            if layer_hidden is None:
                raise DraftsmithError("the EAGLE-3 drafter needs the verifier's fusion-layer states "
                                      f"(layers {self.config.fusion_layers}); none were given")
            return self.fc(layer_hidden.to(self.compute_dtype))
        return hidden.to(self.compute_dtype)

    def placeholder_features(self) -> torch.Tensor:
        """P-EAGLE: (H,) the feature every placeholder slot reads, fc(mask_hidden)."""
        return self.fc(self.mask_hidden.to(self.compute_dtype)[None])[0]

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, attention_mask=None, position_ids=None,
                cache=None) -> torch.Tensor:
        """embeds (B, T, H) of x_{t+1}, features (B, T, H) at t -> predicted features (B, T, H) at t+1
        (EAGLE-3: the pre-norm state; `logits` applies the norm).

        attention_mask: None (causal over the cache), a (B, T) padding mask, or a 4D additive mask
        (B, 1, T, past + T) for trees and unrolled steps; position_ids (B, T), default past + arange(T);
        cache: a Cache of this one layer (`new_cache`)."""
        B, T, _ = embeds.shape
        dtype = self.compute_dtype
        embeds, features = embeds.to(dtype), features.to(dtype)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(T, device=embeds.device) + past)[None].expand(B, T)
        if attention_mask is None or attention_mask.dim() == 2:
            attention_mask = causal_mask(B, T, past, attention_mask, dtype, embeds.device)
        x = features if self.config.variant == "eagle3" else self.fc(torch.cat([embeds, features], dim=-1))
        position_embeddings = self.rotary_emb(x, position_ids)
        return self.layer(x, embeds, position_embeddings, attention_mask, cache)  # (B, T, H)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def logits(self, features: torch.Tensor, verifier_lm_head: nn.Module) -> torch.Tensor:
        """(..., H) -> (..., N) logits over the draft vocabulary (N = V without a reduced vocab)."""
        if self.config.variant == "eagle3":
            features = self.norm(features)
        mode = self.config.lm_head
        if mode == "own":
            return self.lm_head(features)
        if verifier_lm_head is None:
            raise DraftsmithError(f"this EAGLE drafter (lm_head={mode}) needs the verifier's lm_head at call time")
        weight = verifier_lm_head.weight
        if mode == "gathered":
            weight = weight[self.target_ids]  # (N, H)
        return features.to(weight.dtype) @ weight.T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> verifier ids (identity for the full vocabulary)."""
        return draft_ids if self.config.draft_vocab_size is None else draft_ids + self.d2t[draft_ids]
