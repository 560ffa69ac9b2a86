"""Distillation divergences against values computed by hand on 3-token distributions."""
import math

import pytest
import torch

from draftsmith.models.errors import DraftsmithError
from draftsmith.train.core.losses import acceptance_rate, chain_tau, divergence

P = [0.5, 0.3, 0.2]  # teacher
Q = [0.2, 0.2, 0.6]  # student


def logits(probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64))  # (1, 3): softmax gives probs back


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def test_each_divergence_matches_its_definition():
    fkl = kl(P, Q)  # 0.5 ln 2.5 + 0.3 ln 1.5 + 0.2 ln(1/3) = 0.36041...
    assert fkl == pytest.approx(0.5 * math.log(2.5) + 0.3 * math.log(1.5) + 0.2 * math.log(1 / 3))
    rkl = kl(Q, P)
    m = [0.5 * p + 0.5 * q for p, q in zip(P, Q)]
    jsd = 0.5 * kl(P, m) + 0.5 * kl(Q, m)
    tvd = 0.5 * (0.3 + 0.1 + 0.4)  # = 0.4
    expected = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd}
    for kind, value in expected.items():
        got = divergence(logits(Q), logits(P), kind, temperature=1.0, beta=0.5)
        assert got.shape == (1,) and got.item() == pytest.approx(value, rel=1e-6), kind
    # beta weights the two KLs and the mixture
    m = [0.2 * p + 0.8 * q for p, q in zip(P, Q)]
    assert divergence(logits(Q), logits(P), "jsd", beta=0.2).item() == pytest.approx(
        0.2 * kl(P, m) + 0.8 * kl(Q, m), rel=1e-6)


def test_temperature_scales_both_laws():
    T = 2.0
    p = torch.softmax(logits(P) / T, -1)[0].tolist()
    q = torch.softmax(logits(Q) / T, -1)[0].tolist()
    assert divergence(logits(Q), logits(P), "fkl", temperature=T).item() == pytest.approx(kl(p, q), rel=1e-6)


def test_gradient_flows_to_the_student_only():
    student = logits(Q).clone().requires_grad_(True)
    teacher = logits(P).clone().requires_grad_(True)
    divergence(student, teacher, "fkl").sum().backward()
    assert student.grad.abs().sum() > 0
    # d/dz KL(p || softmax(z)) = q - p
    torch.testing.assert_close(student.grad, torch.tensor([Q]) - torch.tensor([P], dtype=torch.float64))


def test_top_k_teacher_is_renormalised_over_its_tokens():
    values = torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64))  # the top-2 of P
    indices = torch.tensor([[0, 1]])
    p2 = [0.5 / 0.8, 0.3 / 0.8, 0.0]
    assert divergence(logits(Q), (values, indices), "fkl").item() == pytest.approx(kl(p2, Q), rel=1e-6)
    assert divergence(logits(Q), (values, indices), "tvd").item() == pytest.approx(
        0.5 * sum(abs(a - b) for a, b in zip(p2, Q)), rel=1e-6)
    with pytest.raises(DraftsmithError, match="rkl needs the teacher's full distribution"):
        divergence(logits(Q), (values, indices), "rkl")


def test_acceptance_rate_is_one_minus_tvd_and_chain_tau():
    alpha = acceptance_rate(logits(Q), logits(P)).item()
    assert alpha == pytest.approx(0.2 + 0.2 + 0.2)  # sum min(p, q)
    assert alpha == pytest.approx(1 - divergence(logits(Q), logits(P), "tvd").item())
    assert chain_tau(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert chain_tau(1.0, 4) == 5.0


def test_unknown_divergence_lists_the_valid_ones():
    with pytest.raises(DraftsmithError, match="method.divergence=.kl. is not known; valid: fkl, jsd, lk, nla, rkl, tvd"):
        divergence(logits(Q), logits(P), "kl")
