"""The LK losses (train/core/losses.py: lk, nla; arXiv 2602.23881) against hand computations, and
their gradients pushing the expected acceptance alpha = sum_x min(p, q) up: on every random law
at first order, and, for a draft that cannot equal the verifier (a one-parameter family), to the
acceptance optimum where KL training stops short of it."""
import math

import pytest
import torch

from draftsmith.models.errors import DraftsmithError
from draftsmith.train.core import losses
from draftsmith.train.core.losses import LK_ETA, divergence, overlap, token_loss

P = [0.5, 0.3, 0.2]  # verifier
Q = [0.2, 0.2, 0.6]  # draft


def logits(probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64))  # (1, 3): softmax gives probs back


def test_values_match_a_hand_computation():
    alpha = 0.2 + 0.2 + 0.2  # sum min(p, q)
    kl = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.6)  # 0.36006
    lam = math.exp(-3.0 * alpha)  # 0.16530
    assert LK_ETA == 3.0
    lk = divergence(logits(Q), logits(P), "lk")
    nla = divergence(logits(Q), logits(P), "nla")
    assert lk.shape == nla.shape == (1,)
    assert lk.item() == pytest.approx(lam * kl + (1 - lam) * (1 - alpha), rel=1e-6)  # 0.39340
    assert lk.item() == pytest.approx(0.1653 * 0.36006 + 0.8347 * 0.4, abs=1e-4)  # 0.39340
    assert nla.item() == pytest.approx(-math.log(0.6), rel=1e-6)  # 0.51083
    # a one-hot verifier: nla is the cross-entropy of its token
    assert divergence(logits(Q), logits([1.0, 0.0, 0.0]), "nla").item() == pytest.approx(-math.log(0.2))
    # EAGLE's token loss sums over positions, over the law it is given
    p = torch.tensor([P, Q], dtype=torch.float64)
    z = torch.cat([logits(Q), logits(P)])  # two positions
    assert token_loss(z, p, "nla").item() == pytest.approx(2 * -math.log(0.6), rel=1e-6)
    assert token_loss(z, p, "ce").item() == pytest.approx(
        -sum(a * math.log(b) for a, b in zip(P + Q, Q + P)), rel=1e-6)


def test_lambda_is_a_weight_not_differentiated():
    """d lk / dz = lam * (q - p) + (1 - lam) * d(1 - alpha)/dz with lam held fixed."""
    z = logits(Q).clone().requires_grad_(True)
    divergence(z, logits(P), "lk").sum().backward()
    q, p = torch.tensor([Q], dtype=torch.float64), torch.tensor([P], dtype=torch.float64)
    lam = math.exp(-3.0 * 0.6)
    # d alpha / dz_j = sum_{x: q < p} q_x (1[x = j] - q_j): tokens 0 and 1 are under-covered
    under = (q < p).double()
    dalpha = q * under - q * (q * under).sum()
    torch.testing.assert_close(z.grad, lam * (q - p) - (1 - lam) * dalpha)


@pytest.mark.parametrize("kind", ["lk", "nla"])
def test_every_gradient_step_raises_the_expected_acceptance(kind):
    """On 300 random laws over 16 tokens: the loss's descent direction raises alpha at first order,
    and a small step does raise it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        p = torch.softmax(torch.randn(1, 16, generator=g, dtype=torch.float64) * 2, -1)
        z = (torch.randn(1, 16, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
        (grad,) = torch.autograd.grad(divergence(z, p.log(), kind).sum(), z)
        a = z.detach().clone().requires_grad_(True)
        alpha = overlap(p, torch.log_softmax(a, -1)).sum()
        (dalpha,) = torch.autograd.grad(alpha, a)
        assert float((-grad * dalpha).sum()) > 0
        stepped = overlap(p, torch.log_softmax(z.detach() - 1e-3 * grad, -1)).item()
        assert stepped > alpha.item()


def fit_one_parameter(kind: str, steps: int = 400) -> float:
    """A draft that cannot equal the verifier: q = softmax(theta * s), s ranking token 2 above
    token 1 where p ranks 1 above 2. Adam on theta from 1 (a draft peaked on its own ranking; at
    theta = 0, q uniform, alpha is flat by symmetry, and it has a second, lower peak at theta < 0)
    -> the alpha reached."""
    p = torch.tensor([[0.40, 0.35, 0.15, 0.10]], dtype=torch.float64)
    s = torch.tensor([3.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    theta = torch.ones((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.02)
    for _ in range(steps):
        loss = divergence((theta * s)[None], p.log(), kind).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return overlap(p, torch.log_softmax((theta.detach() * s)[None], -1)).item()


def test_with_limited_capacity_lk_reaches_the_acceptance_optimum_and_kl_does_not():
    """KL's optimum in this family is theta = 0.08 (alpha 0.752); the acceptance optimum is
    theta = 0.369 (alpha 0.782, found by a grid over theta). LK and nla train to it."""
    grid = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    p = torch.tensor([[0.40, 0.35, 0.15, 0.10]], dtype=torch.float64)
    s = torch.tensor([3.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    best = max(overlap(p, torch.log_softmax((t * s)[None], -1)).item() for t in grid)
    kl = fit_one_parameter("fkl")
    assert kl == pytest.approx(0.7516, abs=1e-3) and best == pytest.approx(0.7822, abs=1e-3)
    for kind in ("lk", "nla"):
        assert fit_one_parameter(kind) == pytest.approx(best, abs=2e-3), kind
        assert fit_one_parameter(kind) > kl + 0.025, kind


def test_unknown_token_loss_lists_the_valid_ones():
    with pytest.raises(DraftsmithError, match="method.loss='kl' is not known; valid: ce, lk, nla"):
        token_loss(logits(Q), torch.tensor([P]), "kl")


def test_a_broken_overlap_fails_these_tests(monkeypatch):
    """Teeth: alpha computed with max instead of min (1 + TV: it rewards moving away from p)."""
    monkeypatch.setattr(losses, "overlap", lambda p, log_q: torch.maximum(p, log_q.exp()).sum(-1))
    with pytest.raises(AssertionError):
        test_values_match_a_hand_computation()
    with pytest.raises(AssertionError):
        test_with_limited_capacity_lk_reaches_the_acceptance_optimum_and_kl_does_not()
    for kind in ("lk", "nla"):  # the test measures alpha with the true overlap: the broken loss lowers it
        with pytest.raises(AssertionError):
            test_every_gradient_step_raises_the_expected_acceptance(kind)


def test_a_differentiated_lambda_fails_the_gradient_test(monkeypatch):
    """Teeth: lambda = exp(-eta alpha) without the stop gradient adds -eta lam KL d alpha to it."""
    def lk_no_sg(p, log_q, beta):
        alpha = losses.overlap(p, log_q)
        lam = torch.exp(-LK_ETA * alpha)
        return lam * losses.fkl(p, log_q, beta) + (1.0 - lam) * (1.0 - alpha)

    monkeypatch.setitem(losses.DIVERGENCES, "lk", lk_no_sg)
    with pytest.raises(AssertionError):
        test_lambda_is_a_weight_not_differentiated()


@pytest.mark.parametrize("kind", ["lk", "nla"])
def test_a_draft_model_trains_with_an_lk_loss(tiny_model_dir, tmp_path, kind):
    """Draft models select the loss with method.divergence (their loss key): the LK losses train
    the student toward a higher acceptance rate (tests/train/test_draft_train.py's settings)."""
    from draftsmith.models.draft import load_draft_model
    from draftsmith.train.draft import run
    from tests.conftest import tiny_model_overrides
    from tests.hub import compose_config, logged

    out = tmp_path / "run"
    summary = run(compose_config("draft", tiny_model_overrides(tiny_model_dir) + [
        "data=tiny", "trainer=debug", "trainer.batch_size=16", "trainer.max_steps=4", "trainer.eval_every=2",
        "logger=csv", f"output_dir={out}", "method.student.num_layers=1", "method=draft-fkl",
        f"method.divergence={kind}", f"method.name=draft-{kind}"]))
    losses, accept = logged(out, "train/loss"), logged(out, "train/acceptance_rate")
    assert len(losses) == 4 and losses[-1] < losses[0] and accept[-1] > accept[0], (losses, accept)
    _, meta = load_draft_model(summary["drafter_dir"], vocab_size=128)
    assert meta["divergence"] == kind and 0 < summary["eval/acceptance_rate"] <= 1
