"""engine.invariant (rows, and float64 for bf16 / fp16): a token's logits are bit for bit those of
a plain step, whatever else the forward holds (a tree of any size, the token at any node, other rows
of a batch), in bf16, fp16 and fp32. Then speculative greedy output IS plain greedy output (no tie allowance), and
coupled sampling emits plain sampling's tokens. A deliberately shape-dependent forward (another
kernel from 16 rows on) fails the same checks.

The model is a random Llama with SmolLM2's widths (576 hidden, 1536 MLP, 9 / 3 heads, the
49,152-token vocabulary), so the matrix kernels are the ones the real verifier meets."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.decode.engine import Engine, batch_inputs, chain_tree, generate
from draftsmith.decode.forward import FastLlama, make_forward
from draftsmith.decode.proposers import DraftTree, make_proposer
from draftsmith.models.errors import DraftsmithError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def wide():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)  # a peaked law: greedy runs are not coin flips
    return {dtype: (model if dtype == torch.float32 else _cast(model, dtype)) for dtype in DTYPES}


def _cast(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def path_tree(path: list[int], width: int, g) -> tuple[DraftTree, list[int]]:
    """A tree of `width` nodes holding `path` (root first) as one root path among random
    siblings -> (tree, the node index of each path token)."""
    parents, tokens, where = [-1], [path[0]], [0]
    while len(tokens) < width:
        if len(where) < len(path) and torch.rand((), generator=g) < 0.5:
            parents.append(where[-1])
            tokens.append(path[len(where)])
            where.append(len(tokens) - 1)
        else:  # a sibling somewhere in the tree
            parents.append(int(torch.randint(0, len(tokens), (), generator=g)))
            tokens.append(int(torch.randint(0, 49152, (), generator=g)))
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents)), where


def plain_logits(fwd, prompt: list[int], path: list[int]) -> torch.Tensor:
    """Logits after each path token, decoded one token a step as plain decoding does -> (k, V)."""
    run(fwd, [chain_tree(prompt, "cpu")], [0])
    out = []
    for j, token in enumerate(path):
        out.append(run(fwd, [chain_tree([token], "cpu")], [len(prompt) + j])[0][0])
    return torch.stack(out)


def run(fwd, trees, lens):
    width = max(t.size for t in trees)
    inputs = batch_inputs(trees, lens, width, "cpu")
    length = max(lens) + width
    hidden, _ = fwd(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(length), len(trees), length)
    return [fwd.logits(hidden[b, : t.size]) for b, t in enumerate(trees)]


def mismatches(model, invariant: bool) -> int:  # (vocabulary 49,152: SmolLM2 too)
    """Path tokens whose logits in a tree / a batch differ from their plain step's."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49152, (37,), generator=g).tolist()
    path = torch.randint(0, 49152, (6,), generator=g).tolist()
    ref = plain_logits(make_forward(model, "fast", 1, 256, invariant), prompt, path)  # logits after path[j]
    bad = 0
    for width in (2, 5, 9, 16, 33):
        tree, where = path_tree(path, width, g)
        fwd = make_forward(model, "fast", 3, 256, invariant)
        others = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (12, 50)]
        run(fwd, [chain_tree(p, "cpu") for p in (prompt, *others)], [0, 0, 0])  # three rows' prompts, one forward
        side = [path_tree(path, width, g)[0], chain_tree([5] * width, "cpu")]
        alone = run(fwd, [tree], [len(prompt)])[0]
        fwd2 = make_forward(model, "fast", 3, 256, invariant)
        run(fwd2, [chain_tree(p, "cpu") for p in (prompt, *others)], [0, 0, 0])
        batched = run(fwd2, [tree, *side], [len(prompt), 12, 50])[0]
        for logits in (alone, batched):
            got = logits[where]  # (k, V) after each path token present in the tree
            bad += sum(not torch.equal(got[j], ref[j]) for j in range(len(where)))
    return bad


@pytest.mark.parametrize("mode, dtype", [("rows", d) for d in DTYPES] + [("float64", torch.bfloat16),
                                                                         ("float64", torch.float16)],
                         ids=lambda v: str(v).split(".")[-1])
def test_every_token_gets_its_plain_steps_logits_bit_for_bit(wide, mode, dtype):
    """Both ways: every linear layer on chunks of one row count (rows; `true` means rows), or in
    float64 rounded back (bf16 / fp16 only)."""
    assert mismatches(wide[dtype], invariant=mode) == 0


def test_a_shape_dependent_forward_is_caught(wide, monkeypatch):
    """Teeth: from 16 rows on, the linear layers round through float32 (another kernel, as a
    library might pick): tokens verified in a wide step no longer get their plain logits."""
    real, real_many = FastLlama.linear, FastLlama.linears  # (one calls the other: packed or not)

    def many_rows(x):
        return x.reshape(-1, x.shape[-1]).shape[0] >= 16

    def fp32(module, x):
        return torch.nn.functional.linear(x.float(), module.weight.float()).to(x.dtype)

    monkeypatch.setattr(FastLlama, "linear", lambda self, m, x: fp32(m, x) if many_rows(x) else real(self, m, x))
    def linears(self, ms, x, joined=False):
        if not many_rows(x):
            return real_many(self, ms, x, joined)
        outs = [fp32(m, x) for m in ms]
        return torch.cat(outs, dim=-1) if joined else outs

    monkeypatch.setattr(FastLlama, "linears", linears)
    monkeypatch.setattr(FastLlama, "logits", lambda self, h: self.linear(self.model.get_output_embeddings(), h))
    assert mismatches(wide[torch.bfloat16], invariant=False) > 0


@pytest.mark.parametrize("mode, dtype", [("rows", torch.bfloat16), ("rows", torch.float16),
                                         ("float64", torch.bfloat16)], ids=lambda v: str(v).split(".")[-1])
def test_speculative_output_is_plain_output_in_low_precision(wide, mode, dtype):
    """Greedy: identical, no tie allowance; sampling (coupled, T=1): plain sampling's tokens."""
    model = wide[dtype]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 49152, (1, 25), generator=g)
    repeat = torch.cat([prompt, prompt[:, :12]], dim=1)  # prompt lookup finds matches: drafts get accepted
    lookup = lambda: make_proposer("prompt_lookup", num_tokens=6, max_ngram=3, min_ngram=1)  # noqa: E731
    for ids in (prompt, repeat):
        plain = generate(model, ids, max_new_tokens=24, eos_token_id=(), invariant=mode)
        spec = generate(model, ids, proposer=lookup(), max_new_tokens=24, eos_token_id=(), invariant=mode)
        assert spec.tokens == plain.tokens
        kw = dict(max_new_tokens=24, eos_token_id=(), invariant=mode, temperature=1.0, acceptance="coupled")
        plain = generate(model, ids, generator=torch.Generator().manual_seed(9), **kw)
        spec = generate(model, ids, proposer=lookup(), generator=torch.Generator().manual_seed(9), **kw)
        assert spec.tokens == plain.tokens
    engine = Engine(model, max_num_seqs=3, invariant=mode)  # beside other rows of a batch, too
    rows = [engine.add(p[0].tolist(), proposer=lookup() if i else None, max_new_tokens=24, eos_token_id=())
            for i, p in enumerate((repeat, repeat, prompt))]
    while engine.busy:
        engine.step()
    assert rows[0].out == rows[1].out == generate(model, repeat, max_new_tokens=24, eos_token_id=(),
                                                  invariant=mode).tokens


def test_invariant_needs_the_fast_forward_and_a_known_mode(wide):
    with pytest.raises(DraftsmithError, match="engine.invariant=rows needs the fast forward"):
        make_forward(wide[torch.float32], "hf", 1, 16, invariant=True)
    with pytest.raises(DraftsmithError,
                       match="engine.invariant='exact' is not known; valid: false, float64, rows, true"):
        make_forward(wide[torch.float32], "fast", 1, 16, invariant="exact")
    with pytest.raises(DraftsmithError, match="engine.invariant=float64 is for bf16 / fp16 verifiers.*use "
                                              "engine.invariant=rows"):
        make_forward(wide[torch.float32], "fast", 1, 16, invariant="float64")
    assert make_forward(wide[torch.bfloat16], "fast", 1, 16, invariant="float64").invariant == "float64"
    assert make_forward(wide[torch.bfloat16], "fast", 1, 16, invariant=False).invariant is None


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_real_smollm2_in_low_precision(dtype):
    """SmolLM2-135M-Instruct itself: every path token's logits in trees of 2-33 nodes and beside
    other rows equal its plain step's, bit for bit; speculative greedy output is plain output on
    chat prompts (prompt lookup drafts, accepted several deep), no tie allowance."""
    from draftsmith.decode.harness import prompt_ids
    from draftsmith.models.verifier import load_verifier
    from tests.hub import compose_config

    v = load_verifier(compose_config("evaluate", [f"model.dtype={dtype}"]).model)
    assert mismatches(v.model, invariant=True) == 0
    for text in ("Write a short poem about the sea, then repeat its first line.", "List the days of the week."):
        ids = prompt_ids(v.tokenizer, [{"role": "user", "content": text}])
        plain = generate(v.model, ids, max_new_tokens=40, invariant=True)
        spec = generate(v.model, ids, proposer=make_proposer("prompt_lookup", num_tokens=6, max_ngram=3),
                        max_new_tokens=40, invariant=True)
        assert spec.tokens == plain.tokens, (dtype, text)
