"""Distillation divergences between a teacher law p (the verifier) and a student law q (a draft).

All take logits at the same positions and a temperature T: p = softmax(teacher / T),
q = softmax(student / T), and return one value per position (N,). The teacher is either
dense logits (N, V) or its top-k (values (N, k), indices (N, k)), as stored by
scripts/prepare_features.py topk=k; a top-k teacher is renormalised over its k tokens.

- fkl: KL(p || q) = sum p log(p / q)            (mode-covering; standard KD)
- rkl: KL(q || p) = sum q log(q / p)            (mode-seeking; needs the dense teacher)
- jsd: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q   (GKD / DistillSpec)
- tvd: 1/2 sum |p - q|                          (1 - acceptance rate of speculative sampling)

`acceptance_rate` is sum_x min(p, q) = 1 - TVD: the probability that one drafted token is
accepted by the lossless rule, which is what a draft should maximise (DistillSpec).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.models.errors import DraftsmithError, choose


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, without a copy at T = 1 (the (N, V) tensors here are the step's largest)."""
    return logits if temperature == 1.0 else logits / temperature


def teacher_probs(teacher, vocab_size: int, temperature: float) -> torch.Tensor:
    """Dense logits (N, V), or (values, indices) of a top-k teacher -> p (N, V) in fp32."""
    if isinstance(teacher, torch.Tensor):
        return F.softmax(scaled(teacher, temperature), dim=-1, dtype=torch.float32)
    values, indices = teacher
    top = F.softmax(scaled(values, temperature), dim=-1, dtype=torch.float32)  # (N, k) renormalised over the top-k
    return torch.zeros(values.shape[0], vocab_size, device=values.device).scatter_(-1, indices.long(), top)


def _kl(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_x p (log p - log q), with 0 log 0 = 0. (N, V) x3 -> (N,)"""
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def fkl(p, log_q, beta):
    """KL(p || q) = sum p log p - sum p log q: the teacher's entropy term is a constant (no
    graph), so the backward is one (N, V) product, not the where/log chain of _kl."""
    with torch.no_grad():
        neg_entropy = torch.special.xlogy(p, p).sum(-1)  # (N,), 0 log 0 = 0
    return neg_entropy - (p * log_q).sum(-1)


def rkl(p, log_q, beta):
    if bool((p == 0).any()):
        raise DraftsmithError("method.divergence=rkl needs the teacher's full distribution (KL(q||p) is "
                              "infinite where a top-k teacher has 0); train online or use fkl / jsd / tvd")
    return _kl(log_q.exp(), log_q, torch.log(p))


def jsd(p, log_q, beta):
    q = log_q.exp()
    m = beta * p + (1 - beta) * q
    log_m = torch.log(m.clamp_min(1e-38))
    return beta * _kl(p, torch.log(p.clamp_min(1e-38)), log_m) + (1 - beta) * _kl(q, log_q, log_m)


def tvd(p, log_q, beta):
    return 0.5 * (p - log_q.exp()).abs().sum(-1)


DIVERGENCES = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd}


def divergence(student_logits: torch.Tensor, teacher, kind: str, temperature: float = 1.0,
               beta: float = 0.5) -> torch.Tensor:
    """student_logits (N, V) (with grad), teacher dense (N, V) or top-k -> (N,) per position."""
    fn = choose(DIVERGENCES, kind, "method.divergence")
    if not 0.0 < beta < 1.0 and kind == "jsd":
        raise DraftsmithError(f"method.beta={beta}: the JSD mixing weight must be in (0, 1)")
    log_q = F.log_softmax(scaled(student_logits, temperature), dim=-1, dtype=torch.float32)  # (N, V)
    p = teacher_probs(teacher, student_logits.shape[-1], temperature)  # (N, V)
    return fn(p, log_q, beta)


@torch.no_grad()
def acceptance_rate(student_logits: torch.Tensor, teacher, temperature: float = 1.0) -> torch.Tensor:
    """(N,) sum_x min(p(x), q(x)): the chance a token drafted from q is accepted against p."""
    q = F.softmax(scaled(student_logits, temperature), dim=-1, dtype=torch.float32)
    p = teacher_probs(teacher, student_logits.shape[-1], temperature)
    return torch.minimum(p, q).sum(-1)


def chain_tau(alpha: float, gamma: int) -> float:
    """Expected tokens per verifier pass for gamma drafted tokens, each accepted with prob
    alpha independently (Leviathan et al. 2023): (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def simulated_tau(top1: list[float]) -> float:
    """Expected tokens per verifier pass for greedy chain verification by drafts whose k-th
    token agrees with the verifier with probability top1[k] (given the earlier ones agreed):
    1 (the verifier's own token) + sum_k prod_{j<=k} top1_j (SpecForge / ModelOpt style)."""
    tau, run = 1.0, 1.0
    for acc in top1:
        run *= acc
        tau += run
    return tau
