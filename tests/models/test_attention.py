"""models/attention.py: the `grouped` implementation is attention without repeating the
key/value heads: the same logits on a tree forward, the same greedy decoding."""
import torch

from draftsmith.decode.cache import new_cache
from draftsmith.decode.engine import generate
from draftsmith.decode.proposers import make_proposer
from draftsmith.decode.tree import TreeBuffers
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from tests.tiny import tiny_llama

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def tree_logits(model, prompt, tokens):
    cache = new_cache(model.config)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
        mask, pos, _ = TreeBuffers.from_paths(TREE).verify_inputs(prompt.shape[1], model.dtype)
        return model(input_ids=tokens[None], attention_mask=mask, position_ids=pos, cache=cache,
                     use_cache=True).logits[0]


def test_grouped_attention_matches_eager_and_sdpa():
    model = tiny_llama(num_attention_heads=4, num_key_value_heads=2)  # 2 query heads per key head
    g = torch.Generator().manual_seed(0)
    prompt, tokens = torch.randint(4, 128, (1, 9), generator=g), torch.randint(4, 128, (7,), generator=g)
    out = {}
    for impl in ("eager", "sdpa", "grouped"):
        model.config._attn_implementation = impl
        out[impl] = tree_logits(model, prompt, tokens)
        out[impl + "-plain"] = model(input_ids=prompt).logits
    # float64 throughout, as sdpa; eager takes its softmax in float32 even for a float64 model
    torch.testing.assert_close(out["grouped"], out["sdpa"], atol=1e-12, rtol=0)
    torch.testing.assert_close(out["grouped-plain"], out["sdpa-plain"], atol=1e-12, rtol=0)
    torch.testing.assert_close(out["grouped"], out["eager"], atol=1e-6, rtol=0)


def test_grouped_attention_decodes_like_generate():
    model = tiny_llama(num_attention_heads=4, num_key_value_heads=1, attn_implementation="grouped")
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(32, 128, num_heads=3), verifier_lm_head=model.lm_head).to(model.dtype)
    proposer = make_proposer("medusa", heads=heads, paths=TREE)
    ids = torch.randint(4, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)[0, 6:].tolist()
    assert generate(model, ids, proposer=proposer, max_new_tokens=30, eos_token_id=()).tokens[: len(ref)] == ref


def test_grouped_attention_runs_over_the_cache_buffer_and_masks_its_unused_slots(monkeypatch):
    """The BufferedLayer views carry their buffer; attention over the whole buffer (past slots
    masked, zero-initialised) gives the logits of attention over the filled part alone."""
    from draftsmith.models import attention

    model = tiny_llama(num_attention_heads=4, num_key_value_heads=2, attn_implementation="grouped")
    g = torch.Generator().manual_seed(0)
    prompt, tokens = torch.randint(4, 128, (1, 9), generator=g), torch.randint(4, 128, (7,), generator=g)
    widths = []
    real = attention.buffer_of
    monkeypatch.setattr(attention, "buffer_of", lambda t: widths.append((t.shape[-2], real(t).shape[-2])) or real(t))
    buffered = tree_logits(model, prompt, tokens)
    assert widths and all(full > filled for filled, full in widths)  # the buffer path ran
    monkeypatch.setattr(attention, "buffer_of", lambda t: t)  # attention over the views only
    torch.testing.assert_close(buffered, tree_logits(model, prompt, tokens), atol=1e-12, rtol=0)
