"""engine.compile: the fast forward's step is one graph (fullgraph: a graph break, e.g. a host
sync, fails), so a GPU can capture it whole (CUDA graphs); the number of graphs compiled over a
run with rows joining and leaving stays bounded (dynamic shapes across the width and length
buckets); compiled decoding is the verifier's greedy output."""
from __future__ import annotations

import pytest
import torch

from draftsmith.decode import forward as forwards
from draftsmith.decode.engine import batch_inputs, chain_tree, generate
from draftsmith.decode.forward import make_forward
from draftsmith.models.errors import DraftsmithError
from tests.decode.rows import SCHEDULE, row_prompt, run_schedule
from tests.laws import reference
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow


def test_the_step_compiles_as_one_graph_and_decodes_the_verifiers_greedy_output():
    torch._dynamo.reset()
    model = tiny_llama(dtype=torch.float32, eos_token_id=None)
    eager = make_forward(model, "fast", 1, 128)
    whole = make_forward(model, "fast", 1, 128, compile="inductor")  # fullgraph=True inside
    tree = chain_tree(list(range(5, 25)), "cpu")
    inputs = batch_inputs([tree], [0], tree.size, "cpu")
    args = (inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(64), 1, 64)
    torch.testing.assert_close(whole(*args)[0], eager(*args)[0], rtol=1e-5, atol=1e-5)
    ids = torch.tensor([row_prompt(3, 9)])
    out = generate(model, ids, max_new_tokens=12, eos_token_id=(), forward="fast")
    assert out.tokens == reference(model, ids, max_new_tokens=12, eos_token_id=None)


def test_a_graph_break_fails_the_fullgraph_compile(monkeypatch):
    """Teeth: a host sync inside the step (reading a tensor's value in Python) breaks the graph."""
    torch._dynamo.reset()
    model = tiny_llama(dtype=torch.float32, eos_token_id=None)
    real = forwards.FastLlama.rope

    def syncing(self, positions, dtype):
        if int(positions.max()) > 1000:  # .item(): a host sync, a graph break
            raise AssertionError
        return real(self, positions, dtype)

    monkeypatch.setattr(forwards.FastLlama, "rope", syncing)
    fwd = make_forward(model, "fast", 1, 64, compile="count")
    inputs = batch_inputs([chain_tree([5, 6, 7], "cpu")], [0], 3, "cpu")
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|Unsupported"):
        fwd(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(64), 1, 64)


def test_recompilations_stay_bounded_while_rows_join_and_leave(batch_setup, monkeypatch):
    """Every row kind joins and leaves (widths 1..16, lengths across buckets, prefill chunks with
    their own rows): a handful of graphs, and each row still its own greedy output."""
    torch._dynamo.reset()
    forwards.compiled.graphs = 0
    model, factories = batch_setup
    real = make_forward
    monkeypatch.setattr("draftsmith.decode.engine.make_forward",
                        lambda *a, **k: real(*a[:4], a[4] if len(a) > 4 else False, compile="count"))
    requests, _ = run_schedule(model, factories, SCHEDULE)
    for (kind, seed, length, new, _), request in zip(SCHEDULE, requests):
        ids = torch.tensor([row_prompt(seed, length)])
        assert request.out == reference(model, ids, max_new_tokens=new, eos_token_id=None), kind
    steps = sum(len(r.steps) for r in requests)
    # a handful, not one per step: one query or several (the attention's two paths) x the capture
    # sets x the shapes dynamo specialises (sizes 1)
    assert 1 <= forwards.compiled.graphs <= 8, (forwards.compiled.graphs, steps)


def test_compile_is_an_explicit_key():
    model = tiny_llama(dtype=torch.float32)
    with pytest.raises(DraftsmithError, match="engine.compile='fast' is not known; valid: count, inductor, none"):
        make_forward(model, "fast", 1, 16, compile="fast")
    with pytest.raises(DraftsmithError, match="engine.compile=inductor compiles the fast forward"):
        make_forward(model, "hf", 1, 16, compile="inductor")
