"""decode/tree.py: tree structure, and one-pass tree verification through an HF Llama."""

import re

import pytest
import torch
from transformers import DynamicCache

from draftsmith.decode.tree import (
    TreeBuffers,
    ancestor_mask,
    chain_parents,
    path_to,
    paths_to_parents,
    verify_inputs,
)
from tests.tiny import tiny_llama

# A small Medusa tree, two paths listed before their prefix (0,) on purpose. The nodes keep the
# listed order, each of those two moved just after (0,):
# 1:(1,) 2:(0,) 3:(0,0) 4:(0,0,0) 5:(1,0) 6:(0,1).
MEDUSA_PATHS = [(0, 0), (1,), (0, 0, 0), (0,), (1, 0), (0, 1)]
MEDUSA_PARENTS = [-1, 0, 0, 2, 3, 1, 2]
MEDUSA_CHOICES = [-1, 1, 0, 0, 0, 0, 1]
MEDUSA_DEPTHS = [0, 1, 1, 2, 3, 2, 2]


def random_parents(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def test_paths_to_parents_medusa_tree():
    parents, choices, depths = paths_to_parents(MEDUSA_PATHS)
    assert parents == MEDUSA_PARENTS
    assert choices == MEDUSA_CHOICES
    assert depths == MEDUSA_DEPTHS
    # Medusa's own format is a list of lists.
    assert paths_to_parents([list(p) for p in MEDUSA_PATHS]) == (parents, choices, depths)


def test_paths_keep_their_listed_order_so_every_cut_is_the_best_listed_subtree():
    # Medusa's mc_sim lists (conf/decode/medusa-default.yaml) name nodes best-first; a cut to the
    # first w nodes (the load-aware budget's) must keep the first w - 1 listed paths, and a listing
    # in any order must still give a tree whose every cut is a tree.
    best_first = [(0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (3,)]
    parents, choices, depths = paths_to_parents(best_first)
    back = {}  # node -> its path, rebuilt from parents and choices
    for node in range(1, len(parents)):
        back[node] = back.get(parents[node], ()) + (choices[node],)
    assert [back[n] for n in range(1, len(parents))] == best_first
    assert depths == [0, 1, 2, 1, 2, 1, 3, 2, 1]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        shuffled = [best_first[i] for i in torch.randperm(len(best_first), generator=g).tolist()]
        parents, choices, _ = paths_to_parents(shuffled)
        assert all(0 <= parents[n] < n for n in range(1, len(parents)))  # every prefix cut is a tree
        back = {}
        for node in range(1, len(parents)):
            back[node] = back.get(parents[node], ()) + (choices[node],)
        order = [back[n] for n in range(1, len(parents))]
        # the listed order, a path listed before one of its prefixes moved to just after it
        anchor = {p: max(shuffled.index(p[:d]) for d in range(1, len(p) + 1)) for p in shuffled}
        assert order == sorted(shuffled, key=lambda p: (anchor[p], len(p)))


@pytest.mark.parametrize(
    "paths, bad",
    [
        ([(0,), (0, 1, 0)], "(0, 1, 0)"),  # prefix (0, 1) missing
        ([(1, 0)], "(1, 0)"),  # prefix (1,) missing
        ([(0,), (1,), (0,)], "(0,)"),  # duplicate
        ([(0,), (0, -1)], "(0, -1)"),  # negative index
        ([(0,), ()], "()"),  # the root is implicit
    ],
)
def test_paths_to_parents_rejects_bad_paths(paths, bad):
    with pytest.raises(ValueError, match=re.escape(f"path {bad}")):
        paths_to_parents(paths)


def test_chain_parents_and_depths():
    assert chain_parents(0) == [-1]
    assert chain_parents(3) == [-1, 0, 1, 2]
    assert TreeBuffers.from_parents(chain_parents(3)).depths.tolist() == [0, 1, 2, 3]
    assert TreeBuffers.from_parents(MEDUSA_PARENTS).depths.tolist() == MEDUSA_DEPTHS


@pytest.mark.parametrize("bad", [[0, 0], [-1, 1], [-1, 0, 2], [-1, -1]])
def test_invalid_parents_raise(bad):
    with pytest.raises(ValueError):
        ancestor_mask(torch.tensor(bad))


@pytest.mark.parametrize(
    "parents",
    [MEDUSA_PARENTS, chain_parents(4), [-1], random_parents(12, 0), random_parents(20, 1)],
)
def test_ancestor_mask_matches_path_to(parents):
    parents_t = torch.tensor(parents)
    anc = ancestor_mask(parents_t)
    assert anc.shape == (len(parents), len(parents)) and anc.dtype == torch.bool
    depths = TreeBuffers.from_parents(parents).depths
    for i in range(len(parents)):
        path = path_to(parents_t, i)
        assert path[0] == 0 and path[-1] == i
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
        assert anc[i].nonzero().flatten().tolist() == path
        assert int(depths[i]) == len(path) - 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_verify_inputs_values(dtype):
    parents = torch.tensor(MEDUSA_PARENTS)
    n, cache_len = len(MEDUSA_PARENTS), 4
    mask, position_ids, cache_position = verify_inputs(parents, cache_len, dtype, "cpu")
    assert mask.shape == (1, 1, n, cache_len + n) and mask.dtype == dtype
    assert position_ids.shape == (1, n) and position_ids.dtype == torch.long
    assert position_ids[0].tolist() == [cache_len + d for d in MEDUSA_DEPTHS]
    assert cache_position.tolist() == list(range(cache_len, cache_len + n))
    lowest = torch.finfo(dtype).min
    assert set(mask.unique().tolist()) == {0.0, lowest}
    assert (mask[0, 0, :, :cache_len] == 0).all()  # the cached prefix is always visible
    tree_part = mask[0, 0, :, cache_len:]  # (n, n)
    assert torch.equal(tree_part == 0, ancestor_mask(parents))
    # Node 6 = (0, 1) sees root, node 2 = (0,) and itself only.
    assert (tree_part[6] == 0).nonzero().flatten().tolist() == [0, 2, 6]


def test_verify_inputs_static_kv_length_and_buffers():
    buffers = TreeBuffers.from_paths(MEDUSA_PATHS)
    assert buffers.size == 7
    assert buffers.parents.tolist() == MEDUSA_PARENTS
    assert buffers.choices.tolist() == MEDUSA_CHOICES
    assert buffers.depths.tolist() == MEDUSA_DEPTHS
    assert torch.equal(buffers.ancestors, ancestor_mask(torch.tensor(MEDUSA_PARENTS)))
    for got, want in zip(
        buffers.verify_inputs(3, torch.float32), verify_inputs(buffers.parents, 3, torch.float32)
    ):
        assert torch.equal(got, want)
    mask, _, _ = buffers.verify_inputs(3, torch.float32, kv_length=16)
    assert mask.shape == (1, 1, 7, 16)
    assert (mask[0, 0, :, 10:] == torch.finfo(torch.float32).min).all()  # columns after the tree
    with pytest.raises(ValueError):
        buffers.verify_inputs(3, torch.float32, kv_length=9)
    anon = TreeBuffers.from_parents(TREE_PARENTS)
    assert anon.choices.tolist() == [-1] * 7 and anon.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]


# --- the key test: one forward over the tree == each root-to-node path run alone ----------

TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4]  # 7 nodes, depth 3, two branches


def tiny_llama_fp64(attn_implementation: str):
    return tiny_llama(vocab_size=64, dtype=torch.float64, attn_implementation=attn_implementation)


def tree_forward(model, tokens, mask, position_ids, cache) -> torch.Tensor:
    """(n, V) logits of one forward over the tree tokens on top of `cache`."""
    return model(input_ids=tokens[None], attention_mask=mask, position_ids=position_ids, cache=cache,
                 use_cache=True).logits[0]


def path_logits_alone(model, prefix: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(n, V): for each node, the last logits of prefix + root..node run with no cache."""
    rows = []
    for i in range(tokens.numel()):
        seq = torch.cat([prefix, tokens[path_to(torch.tensor(TREE_PARENTS), i)]])
        rows.append(model(input_ids=seq[None]).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@torch.no_grad()
def test_tree_forward_matches_paths_alone_dynamic_cache(attn_implementation):
    model = tiny_llama_fp64(attn_implementation)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 64, (5,), generator=g)
    tokens = torch.randint(0, 64, (len(TREE_PARENTS),), generator=g)

    cache = DynamicCache(config=model.config)
    model(input_ids=prefix[None], cache=cache, use_cache=True)  # transformers 5: `cache=`
    assert cache.get_seq_length() == 5
    mask, position_ids, _ = verify_inputs(torch.tensor(TREE_PARENTS), 5, torch.float64)
    tree_logits = tree_forward(model, tokens, mask, position_ids, cache)  # (n, V)
    assert cache.get_seq_length() == 5 + len(TREE_PARENTS)  # the whole tree was appended

    want = path_logits_alone(model, prefix, tokens)
    # HF's eager attention takes its softmax in float32 even for a float64 model: a float32 sum over a
    # row whose length differs (tree vs path) rounds differently on some CPUs (AVX2: 1.8e-8 here)
    atol = 1e-6 if attn_implementation == "eager" else 1e-10
    torch.testing.assert_close(tree_logits, want, atol=atol, rtol=0)

