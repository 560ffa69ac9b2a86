"""What the export tests share: the tiny verifier's shapes, the EAGLE-3 weight layout the engines
read (as data), and the export -> decode helpers."""
from __future__ import annotations

import torch

from draftsmith.decode.engine import generate
from scripts.export import run as export
from tests.conftest import tiny_model_overrides
from tests.hub import compose_config

H, V, HEADS, KV, HD, INTER = 32, 128, 4, 2, 8, 64  # tests/tiny.py's Llama
LAYERS = 4  # verifier layers: enough for 3 distinct EAGLE-3 capture layers
FUSION = [2, 0, 1]  # given out of order: the engines feed them ascending (fc's blocks permuted on export)

# ------------------------------------------------------------------ the engines' expectations (data)
# weight name -> shape
ATTN_2H = {"self_attn.q_proj.weight": (HEADS * HD, 2 * H), "self_attn.k_proj.weight": (KV * HD, 2 * H),
           "self_attn.v_proj.weight": (KV * HD, 2 * H), "self_attn.o_proj.weight": (H, HEADS * HD)}
ATTN_H = {"self_attn.q_proj.weight": (HEADS * HD, H), "self_attn.k_proj.weight": (KV * HD, H),
          "self_attn.v_proj.weight": (KV * HD, H), "self_attn.o_proj.weight": (H, HEADS * HD)}
MLP = {"mlp.gate_proj.weight": (INTER, H), "mlp.up_proj.weight": (INTER, H), "mlp.down_proj.weight": (H, INTER),
       "post_attention_layernorm.weight": (H,)}
N = 48  # the reduced draft vocabulary of the EAGLE-3 and Medusa cases
EAGLE3_LAYER = {**ATTN_2H, **MLP, "input_layernorm.weight": (H,), "hidden_norm.weight": (H,)}
EAGLE3_REST = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,), "t2d": (V,)}
EAGLE3_WEIGHTS = {**EAGLE3_REST, **{f"midlayer.{k}": v for k, v in EAGLE3_LAYER.items()}}


def export_drafter(verifier_dir, drafter, fmt, out, *extra):
    """scripts/export.py on a drafter folder trained against the tiny verifier folder -> its summary."""
    return export(compose_config("export", tiny_model_overrides(verifier_dir) + [
        f"drafter={drafter}", f"format={fmt}", f"output_dir={out}", "dtype=null", "verifier_name=tiny", *extra]))


def decode_lossless(verifier, proposer, seed: int, n: int = 30):
    """Decode a random prompt with the proposer, check it is the verifier's greedy output -> (tokens, accepted)."""
    ids = torch.randint(4, 100, (1, 10), generator=torch.Generator().manual_seed(seed))
    out = generate(verifier, ids, proposer=proposer, max_new_tokens=n, eos_token_id=())
    ref = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                            eos_token_id=None, pad_token_id=1)[0, ids.shape[1]:].tolist()
    assert out.tokens == ref  # lossless
    return out.tokens, [s.accepted for s in out.steps]


class VerifierView:
    """What Drafter.proposer reads of a verifier."""

    def __init__(self, model):
        self.model, self.lm_head, self.embed_tokens = model, model.lm_head, model.get_input_embeddings()
