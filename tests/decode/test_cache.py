"""decode/cache.py: after a tree forward + compaction, the cache is what a plain forward over
prompt + accepted path would have built (checked through the next forward's logits)."""

import pytest
import torch
from transformers import DynamicCache, MistralConfig

from draftsmith.decode.cache import check_compactable, compact_cache
from draftsmith.decode.tree import verify_inputs
from tests.tiny import tiny_llama

# root 0; 1,2 children of 0; 3,4 children of 1; 5 child of 2; 6 child of 3; 7 child of 5
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def fresh_last_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """(V,) next-token logits after ``seq`` with no cache at all."""
    return model(input_ids=seq[None]).logits[0, -1]


def tree_step(model, cache, cache_len: int, tokens: torch.Tensor, kv_length=None) -> torch.Tensor:
    mask, position_ids, _ = verify_inputs(PARENTS, cache_len, model.dtype, kv_length=kv_length)
    return model(input_ids=tokens[None], attention_mask=mask, position_ids=position_ids,
                 cache=cache, use_cache=True).logits[0]  # (n, V)


@pytest.mark.parametrize("keep", [[0], [0, 1], [0, 1, 3, 6], [0, 2], [0, 2, 5, 7], [0, 1, 4]])
def test_compaction_matches_fresh_forward(keep):
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, 128, (6,), generator=g)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[None], cache=cache, use_cache=True)
        seq = prompt
        for _ in range(2):  # two tree steps: the second runs on an already compacted cache
            cache_len = cache.get_seq_length()
            tokens = torch.randint(4, 128, (len(PARENTS),), generator=g)
            tree_logits = tree_step(model, cache, cache_len, tokens)
            assert cache.get_seq_length() == cache_len + len(PARENTS)
            compact_cache(cache, cache_len, torch.tensor(keep))
            assert cache.get_seq_length() == cache_len + len(keep)
            assert all(layer.keys.shape[-2] == cache_len + len(keep) for layer in cache.layers)
            seq = torch.cat([seq, tokens[keep]])
            # the tree forward's row for the last kept node is already that prefix's logits
            torch.testing.assert_close(tree_logits[keep[-1]], fresh_last_logits(model, seq), atol=1e-10, rtol=0)
        nxt = torch.tensor([17])
        cached = model(input_ids=nxt[None], cache=cache, use_cache=True).logits[0, -1]
        torch.testing.assert_close(cached, fresh_last_logits(model, torch.cat([seq, nxt])), atol=1e-10, rtol=0)


def test_unsupported_caches_raise_with_the_fix():
    sliding = DynamicCache(config=MistralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8))
    with pytest.raises(TypeError, match="sliding_window=None"):
        check_compactable(sliding)
    with pytest.raises(TypeError, match="DynamicCache"):
        compact_cache(((torch.zeros(1), torch.zeros(1)),), 0, [0])


def test_bad_keep_raises():
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="increasing"):
        compact_cache(cache, 1, [0, 2, 1])
    with pytest.raises(ValueError, match="slot"):
        compact_cache(cache, 1, [0, 5])
