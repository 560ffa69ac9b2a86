"""Distillation divergences between a teacher law p (the verifier) and a student law q (a draft).

All take logits at the same positions and a temperature T: p = softmax(teacher / T),
q = softmax(student / T), and return one value per position (N,). The teacher is either
dense logits (N, V) or its top-k (values (N, k), indices (N, k)), as stored by
scripts/prepare_features.py topk=k; a top-k teacher is renormalised over its k tokens.

- fkl: KL(p || q) = sum p log(p / q)            (mode-covering; standard KD)
- rkl: KL(q || p) = sum q log(q / p)            (mode-seeking; needs the dense teacher)
- jsd: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q   (GKD / DistillSpec)
- tvd: 1/2 sum |p - q|                          (1 - acceptance rate of speculative sampling)
- lk:  LK hybrid, lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-3 sg(alpha))   (`lk`)
- nla: -log alpha, the negative log of the expected acceptance          (`nla`)

`acceptance_rate` is alpha = sum_x min(p, q) = 1 - TVD: the probability that one drafted token
is accepted by the lossless rule, which is what a draft should maximise (DistillSpec). `lk` and
`nla` are the LK losses (Samarin et al. 2026, "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding", arXiv 2602.23881), which train toward alpha itself.
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


LK_ETA = 3.0  # the LK hybrid's blend temperature: lambda = exp(-LK_ETA * alpha) (the paper's choice)
NLA_FLOOR = 1e-6  # alpha is clamped here before the log (a draft with no overlap still gets a finite loss)


def overlap(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) (N,): the chance that a token drafted from q is accepted
    against p by the lossless rule (Leviathan et al. 2023). Its gradient flows through q where
    q(x) < p(x): raising q on tokens it under-covers raises alpha."""
    return torch.minimum(p, log_q.exp()).sum(-1)


def lk(p, log_q, beta):
    """The LK hybrid loss (Samarin et al. 2026, arXiv 2602.23881), per position:

        L = lambda * KL(p || q) + (1 - lambda) * (1 - alpha),   lambda = exp(-eta * sg(alpha)),

    with alpha = sum_x min(p(x), q(x)) the expected acceptance of one drafted token, sg a stop
    gradient and eta = LK_ETA = 3. Far from p (alpha small) it is KL, whose gradient is strong; as
    the overlap grows it becomes the total variation 1 - alpha, whose minimum is the acceptance
    rate's maximum (KL's is the same only for a draft that can equal p). lambda is a weight, not
    differentiated. The KL term is fkl's (the teacher's entropy, a constant, included)."""
    alpha = overlap(p, log_q)  # (N,)
    lam = torch.exp(-LK_ETA * alpha.detach())  # (N,)
    return lam * fkl(p, log_q, beta) + (1.0 - lam) * (1.0 - alpha)


def nla(p, log_q, beta):
    """Negative log acceptance (the LK paper's likelihood-style LK loss, arXiv 2602.23881):

        L = -log alpha,   alpha = sum_x min(p(x), q(x)),

    i.e. the total variation's gradient scaled by 1 / alpha, so it still trains when the overlap
    is small (plain 1 - alpha has weak gradients there); for a one-hot p it is cross-entropy.
    alpha is clamped at NLA_FLOOR before the log."""
    return -torch.log(overlap(p, log_q).clamp_min(NLA_FLOOR))


DIVERGENCES = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd, "lk": lk, "nla": nla}


def divergence(student_logits: torch.Tensor, teacher, kind: str, temperature: float = 1.0,
               beta: float = 0.5, field: str = "method.divergence") -> torch.Tensor:
    """student_logits (N, V) (with grad), teacher dense (N, V) or top-k -> (N,) per position."""
    fn = choose(DIVERGENCES, kind, field)
    if not 0.0 < beta < 1.0 and kind == "jsd":
        raise DraftsmithError(f"method.beta={beta}: the JSD mixing weight must be in (0, 1)")
    log_q = F.log_softmax(scaled(student_logits, temperature), dim=-1, dtype=torch.float32)  # (N, V)
    p = teacher_probs(teacher, student_logits.shape[-1], temperature)  # (N, V)
    return fn(p, log_q, beta)


def soft_ce_sum(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """-sum p log q over every position and token: KL(p || q) plus the teacher's entropy, EAGLE's
    token loss (one reduction over the whole (N, V') product, as the EAGLE recipes trained)."""
    return -(p * log_q).sum()


# method.loss of EAGLE drafters: the token loss against the verifier's law p, summed over positions
TOKEN_LOSSES = {"ce": soft_ce_sum, "lk": lambda p, log_q: lk(p, log_q, None).sum(),
                "nla": lambda p, log_q: nla(p, log_q, None).sum()}


def token_loss(logits: torch.Tensor, p: torch.Tensor, kind: str) -> torch.Tensor:
    """EAGLE's token loss: logits (N, V') of the draft, p (N, V') the verifier's law over the
    same tokens -> () summed over positions, for method.loss = ce | lk | nla."""
    fn = choose(TOKEN_LOSSES, kind, "method.loss")
    return fn(p, torch.log_softmax(logits, dim=-1))


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
