"""The on-policy distillation formulas (engine/ppo/distill_losses.py) against hand computations and
naive references: GKD's generalised JSD and its ends, the top-k buckets, the reverse-KL advantage."""

from __future__ import annotations

import math

import pytest
import torch

from engine.ppo.distill_losses import (
    generalized_jsd,
    reverse_kl_advantages,
    top_k_jsd,
    with_rest_bucket,
)


def kl(p: list[float], q: list[float]) -> float:
    """KL(p || q) of two distributions, by hand."""
    return sum(a * math.log(a / b) for a, b in zip(p, q))


P, S = [0.8, 0.15, 0.05], [0.3, 0.3, 0.4]  # teacher, student
LOG_P, LOG_S = torch.tensor(P, dtype=torch.float64).log(), torch.tensor(S, dtype=torch.float64).log()


def test_generalized_jsd_equals_the_hand_computation():
    for beta in (0.1, 0.5, 0.9):
        m = [beta * p + (1 - beta) * s for p, s in zip(P, S)]
        expected = beta * kl(P, m) + (1 - beta) * kl(S, m)
        assert generalized_jsd(LOG_S, LOG_P, beta).item() == pytest.approx(expected, rel=1e-12)
    m = [0.55, 0.225, 0.225]  # beta 0.5 written out: the symmetric Jensen-Shannon divergence
    assert generalized_jsd(LOG_S, LOG_P, 0.5).item() == pytest.approx(0.5 * kl(P, m) + 0.5 * kl(S, m), rel=1e-12)
    assert generalized_jsd(LOG_S, LOG_P, 0.5).item() == pytest.approx(generalized_jsd(LOG_P, LOG_S, 0.5).item())


def test_beta_ends_are_the_forward_and_reverse_kl_and_the_formula_tends_to_them():
    forward, reverse = kl(P, S), kl(S, P)  # KL(teacher || student), KL(student || teacher)
    assert forward != pytest.approx(reverse, rel=0.2)  # the two ends differ on this pair
    assert generalized_jsd(LOG_S, LOG_P, 0.0).item() == pytest.approx(forward, rel=1e-12)
    assert generalized_jsd(LOG_S, LOG_P, 1.0).item() == pytest.approx(reverse, rel=1e-12)
    eps = 1e-5  # near the ends the formula is beta x forward KL and (1 - beta) x reverse KL
    assert generalized_jsd(LOG_S, LOG_P, eps).item() / eps == pytest.approx(forward, rel=1e-4)
    assert generalized_jsd(LOG_S, LOG_P, 1 - eps).item() / eps == pytest.approx(reverse, rel=1e-4)


def test_jsd_is_zero_with_zero_gradient_when_the_student_is_the_teacher():
    """At the teacher the divergence is at its minimum: zero, and so is its gradient in the student's
    logits (over the top-k buckets too), so a GKD step there leaves the weights as they are."""
    logits = torch.tensor([1.5, 0.2, -0.7, -2.0], dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(logits.detach(), -1)
    for beta in (0.0, 0.5, 1.0):
        for divergence in (generalized_jsd, lambda s, t, b: top_k_jsd(s[:2], t[:2], b, torch.tensor(True))):
            value = divergence(torch.log_softmax(logits, -1), teacher, beta)
            (grad,) = torch.autograd.grad(value, logits)
            assert value.item() == pytest.approx(0.0, abs=1e-15) and grad.abs().max().item() < 1e-12, beta


def test_top_k_buckets_are_exact_with_the_whole_vocabulary_and_a_lower_bound_with_fewer():
    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(2, 3, 12, generator=g, dtype=torch.float64), -1)  # (B, T, V)
    student = torch.log_softmax(torch.randn(2, 3, 12, generator=g, dtype=torch.float64), -1)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    full = generalized_jsd(student, teacher, 0.5)  # (B, T)
    for k, exact in ((12, True), (11, True), (4, False)):  # k = V - 1: the rest bucket is the last token
        top = teacher.topk(k, dim=-1)
        bucketed = top_k_jsd(student.gather(-1, top.indices), top.values, 0.5, mask)
        assert torch.equal(bucketed[~mask], torch.zeros(1, dtype=torch.float64))
        if exact:
            torch.testing.assert_close(bucketed[mask], full[mask], rtol=1e-9, atol=1e-12)
        else:
            assert (bucketed[mask] <= full[mask] + 1e-12).all() and (bucketed[mask] > 0).all()
    rest = with_rest_bucket(torch.tensor([0.5, 0.25]).log())  # the rest of the mass: 0.25
    torch.testing.assert_close(rest.exp(), torch.tensor([0.5, 0.25, 0.25]))


def test_reverse_kl_advantage_per_token():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])  # (B, T)
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -4.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = reverse_kl_advantages(logprobs, teacher, mask, coef=2.0)
    expected = torch.tensor([[-1.0, 2.0, 0.0], [4.0, -6.0, 0.0]])  # -2 x (log pi - log pi_teacher), masked
    assert torch.equal(advantages, expected)
