"""decode/quant.py: int8 rows + scales for a drafter's linear layers.

- quantize_rows: |w - q * scale| <= scale / 2 entrywise, q in [-127, 127], zero rows kept;
- int8_linear equals the dequantized product in float64 up to the activation dtype's rounding,
  through ATen's packed kernel (bf16 / fp16 on the CPU, K a multiple of 32: checked that it
  runs) and through the dequantized fallback (fp32, fp64, narrow K, which crashes the kernel);
- int8_copy swaps every nn.Linear, shares the other parameters and leaves the original alone.
"""

import pytest
import torch
from torch import nn

from draftsmith.decode import quant
from draftsmith.decode.quant import Int8Linear, int8_copy, int8_linear, quantize_rows
from tests.tiny import tiny_llama


def test_quantize_rows_bounds_the_error_per_entry():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, 48, dtype=torch.float64)[:, None]
    w[5] = 0.0  # a row of zeros
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float64 and scale.shape == (48,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all()) and float(scale[5]) == 1.0
    err = (w - q.double() * scale[:, None]).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-9)).all())
    assert bool((q.abs().amax(dim=1)[torch.arange(48) != 5] == 127).all())  # each row uses the full range


@pytest.mark.parametrize("dtype, K, packed", [
    (torch.bfloat16, 64, True), (torch.float16, 96, True), (torch.bfloat16, 12, False),
    (torch.float32, 64, False), (torch.float64, 64, False),
])
def test_int8_linear_is_the_dequantized_product(monkeypatch, dtype, K, packed):
    calls = []
    kernel = torch._weight_int8pack_mm

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counted)
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_rows(torch.randn(40, K, generator=g, dtype=torch.float64).to(dtype))
    bias = torch.randn(40, generator=g, dtype=torch.float64).to(dtype)
    x = torch.randn(2, 3, K, generator=g, dtype=torch.float64).to(dtype)  # (B, T, K)
    y = int8_linear(x, q, scale, bias)  # (B, T, N)
    assert y.shape == (2, 3, 40) and y.dtype == dtype and bool(calls) == packed
    want = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    tol = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert float((y.double() - want).abs().max() / want.abs().max()) < tol
    lin = nn.Linear(K, 40, dtype=dtype)
    assert torch.equal(Int8Linear(lin)(x), int8_linear(x, *quantize_rows(lin.weight), lin.bias))


def test_int8_copy_swaps_linears_and_leaves_the_original():
    model = tiny_llama(dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = int8_copy(model.get_decoder())
    linears = [m for m in copy.modules() if isinstance(m, nn.Linear)]
    swapped = [m for m in copy.modules() if isinstance(m, Int8Linear)]
    assert not linears and len(swapped) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert copy.embed_tokens.weight is model.get_decoder().embed_tokens.weight  # shared, not copied
    assert sum(isinstance(m, nn.Linear) for m in model.get_decoder().modules()) == 14  # the original keeps its own
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    ids = torch.tensor([[5, 9, 33, 2, 71]])
    with torch.no_grad():
        h = copy(input_ids=ids).last_hidden_state
        ref = model.get_decoder()(input_ids=ids).last_hidden_state
    assert h.shape == ref.shape and not torch.equal(h, ref)  # the int8 weights really run
    assert float((h.float() - ref.float()).abs().max() / ref.float().abs().max()) < 0.05
    assert quant.PACKED_K == 32


def test_drafting_copy_packs_where_the_verifier_would_and_refuses_what_it_cannot():
    """decode.draft_weights: packed = a copy on oneDNN-prepacked weights (the same products to fp32
    rounding, the original left alone, embeddings shared); auto = packed where engine.weights=auto
    packs the verifier's dtype; plain = the module itself; an fp64 drafter cannot pack; int8 and
    packed together are refused, as is an unknown value."""
    from draftsmith.decode.forward import packs
    from draftsmith.decode.quant import PackedLinear, drafting_copy
    from draftsmith.models.errors import DraftsmithError
    from draftsmith.models.verifier import cpu_prepacks

    decoder = tiny_llama(dtype=torch.float32).get_decoder()
    assert drafting_copy(decoder, "none", "plain") is decoder
    ids = torch.tensor([[5, 9, 33, 2, 71]])
    if cpu_prepacks(torch.float32):
        before = {k: v.clone() for k, v in decoder.state_dict().items()}
        packed = drafting_copy(decoder, "none", "packed")
        assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 14
        assert not any(isinstance(m, nn.Linear) for m in packed.modules())
        assert packed.embed_tokens.weight is decoder.embed_tokens.weight
        with torch.no_grad():
            h, ref = packed(input_ids=ids).last_hidden_state, decoder(input_ids=ids).last_hidden_state
        assert float((h - ref).abs().max() / ref.abs().max()) < 1e-5
        assert all(torch.equal(v, decoder.state_dict()[k]) for k, v in before.items())
        auto = drafting_copy(decoder, "none", "auto")
        assert (auto is not decoder) == packs(decoder, "auto")
    fp64 = tiny_llama().get_decoder()
    assert drafting_copy(fp64, "none", "auto") is fp64
    with pytest.raises(DraftsmithError, match="decode.draft_weights=packed: .*float64.*auto or plain"):
        drafting_copy(fp64, "none", "packed")
    with pytest.raises(DraftsmithError, match="draft_quant=int8 and decode.draft_weights=packed"):
        drafting_copy(decoder, "int8", "packed")
    assert any(isinstance(m, Int8Linear) for m in drafting_copy(decoder, "int8", "auto").modules())
    with pytest.raises(ValueError, match="decode.draft_weights='fast'.*valid: auto, packed, plain"):
        drafting_copy(decoder, "none", "fast")


def test_a_medusa_drafter_refuses_int8_rather_than_ignoring_it(tmp_path):
    """Medusa heads draft through the verifier's lm_head: decode.draft_quant=int8 (a key the
    eagle-* presets carry, which Medusa can also use) is refused in one line, not ignored."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from draftsmith.decode.build import proposer_for
    from draftsmith.models.checkpoint import load_drafter
    from draftsmith.models.errors import DraftsmithError
    from tests.tiny import save_tiny_medusa

    drafter = load_drafter(save_tiny_medusa(tmp_path / "medusa", num_heads=2))
    verifier = tiny_llama(dtype=torch.float32)
    target = SimpleNamespace(model=verifier, lm_head=verifier.lm_head)
    preset = {"name": "eagle-chain", "paths": [[0], [0, 0]]}
    assert proposer_for(drafter, target, OmegaConf.create({**preset, "draft_quant": "none"})).name == "medusa"
    with pytest.raises(DraftsmithError, match="decode.draft_quant=int8: .*set decode.draft_quant=none") as info:
        proposer_for(drafter, target, OmegaConf.create({**preset, "draft_quant": "int8"}))
    assert "\n" not in str(info.value)
    assert proposer_for(drafter, target, OmegaConf.create({**preset, "draft_weights": "auto"})).name == "medusa"
    with pytest.raises(DraftsmithError, match="decode.draft_weights=packed: .*set decode.draft_weights=auto"):
        proposer_for(drafter, target, OmegaConf.create({**preset, "draft_weights": "packed"}))
