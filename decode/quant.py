"""A drafter's weights as it drafts: int8 rows (decode.draft_quant), or oneDNN-prepacked
(decode.draft_weights, as engine.weights lays out the verifier's): ``drafting_copy``.

Int8 weights: half the bytes a one-token draft forward reads.

A draft forward at one token is memory-bound: it reads every weight once for a handful of
multiply-adds. On the 2-core dev box int8 weights cut the trained 4-layer draft's drafting time
per step by 38% at the same tau (README "The draft in int8, one draft forward a step"). So a
drafter's ``nn.Linear`` layers may keep their weights as int8, one symmetric scale per output row:

    q, scale = quantize_rows(w)          # w (N, K) float -> q (N, K) int8, scale (N,) float
    w ~= q * scale[:, None]              # |w - q * scale| <= scale / 2 per entry
    y = int8_linear(x, q, scale, bias)   # x (..., K) -> (..., N) = x @ (q * scale).T + bias

Lossless all the same: the draft is any proposer with its own law q. Greedy drafting takes
the int8 draft's argmax, sampling draws from and reports the int8 draft's own q, and the
verifier, never quantized, checks every token. Only how often the draft is right can move.

``int8_linear`` runs ATen's packed int8 kernel (``torch._weight_int8pack_mm``, the one
torchao's int8 weight-only path uses on CPU) for bf16 / fp16 activations on the CPU when K is
a multiple of 32 (narrower K crashes it: measured in torch 2.13); everywhere else (fp32, fp64,
CUDA) it multiplies by the dequantized weight, the same product in exact arithmetic.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.decode.forward import PACK_ROWS, WEIGHTS, packs
from draftsmith.models.errors import DraftsmithError, choose
from draftsmith.models.verifier import cpu_prepacks

QUANTS = {"none": "none", "int8": "int8"}  # decode.draft_quant: the drafter's weights as given, or int8 rows
PACKED_DTYPES = (torch.bfloat16, torch.float16)
PACKED_K = 32  # the packed kernel's K must be a multiple of this


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> q (N, K) int8 in [-127, 127], scale (N,) in the weight's dtype:
    symmetric per output row, scale = max |w| / 127 over the row (rows of zeros: scale 1)."""
    w = weight.detach().to(torch.promote_types(weight.dtype, torch.float32))  # (N, K), fp64 stays fp64
    amax = w.abs().amax(dim=1)  # (N,)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale.to(weight.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ (q * scale[:, None]).T + bias -> (..., N); q (N, K) int8, scale (N,)."""
    K = q.shape[1]
    if x.device.type == "cpu" and x.dtype in PACKED_DTYPES and K % PACKED_K == 0:
        y = torch._weight_int8pack_mm(x.reshape(-1, K).contiguous(), q, scale.to(x.dtype))  # (M, N)
        y = y.reshape(*x.shape[:-1], q.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, q.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is kept as int8 rows and scales (``quantize_rows``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("q", q)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.q, self.scale, self.bias)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` on a oneDNN-prepacked weight (laid out for PACK_ROWS rows, as the verifier's
    fast forward packs its own: decode/forward.py). On the 2-core AVX2 box in fp32 an EAGLE-3
    drafter's step (two drafter forwards, two 8k-vocabulary heads) took 9.2 ms instead of 15.6."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS.get(weight.dtype, 1))
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                                 "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def int8_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every ``nn.Linear`` inside it made an ``Int8Linear``. Other
    parameters (embeddings, norms) are shared with the original, not copied; the original is
    left as it was, so another proposer built from the same drafter still sees its weights."""
    return _copy_with(module, Int8Linear)


def drafting_copy(module: nn.Module, quant: str, weights: str) -> nn.Module:
    """What a proposer drafts with: an int8 copy (quant=int8); a copy on prepacked weights
    (weights=packed, or auto where the verifier's fast forward would pack this dtype on this CPU:
    fp32 on an AVX2 one, bf16 on AVX-512: decode.forward.packs); else ``module`` itself. Either
    way the original is left as it was. Lossless whatever it drafts with: the verifier checks."""
    choose(QUANTS, quant, "decode.draft_quant")
    choose(WEIGHTS, weights, "decode.draft_weights")
    if quant == "int8":
        if weights == "packed":
            raise DraftsmithError("decode.draft_quant=int8 and decode.draft_weights=packed both choose how the "
                                  "drafter's linear layers run: drop one (draft_weights=auto packs only without int8)")
        return int8_copy(module)
    param = next(module.parameters())
    if weights == "packed" and not (param.device.type == "cpu" and cpu_prepacks(param.dtype)):
        raise DraftsmithError(f"decode.draft_weights=packed: this CPU's oneDNN has no prepacked {param.dtype} linear "
                              f"for a drafter on {param.device.type}: use decode.draft_weights=auto or plain")
    if weights == "packed" or (weights == "auto" and packs(module, "auto")):
        return _copy_with(module, PackedLinear)
    return module


def _copy_with(module: nn.Module, make) -> nn.Module:
    """A copy of ``module`` with every ``nn.Linear`` inside it made ``make(linear)``, the other
    parameters and buffers shared with the original."""
    memo = {id(p): p for p in module.parameters()}  # deepcopy shares these
    memo.update({id(b): b for b in module.buffers()})
    out = copy.deepcopy(module, memo)
    _swap(out, make)
    return out


def _swap(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _swap(child, make)
