"""engine/dpo/losses.py against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engine.dpo.losses import dpo_loss, ipo_loss, simpo_loss

# One pair: the policy raised the chosen response's log-prob by 1 over the reference and lowered the
# rejected one's by 1, so h = 2.
POLICY_C, POLICY_R, REF_C, REF_R = (torch.tensor([v]) for v in (-5.0, -7.0, -6.0, -6.0))


def test_dpo_is_the_logistic_loss_of_beta_times_the_log_ratio_margin():
    out = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.2)))  # -log sigmoid(0.1 * 2)
    assert out.chosen_reward.item() == pytest.approx(0.1) and out.rejected_reward.item() == pytest.approx(-0.1)


def test_label_smoothing_mixes_in_the_flipped_label():
    out = dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1, label_smoothing=0.1)
    assert out.loss.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2)))


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected_log_prob():
    chosen, rejected = POLICY_C.clone().requires_grad_(), POLICY_R.clone().requires_grad_()
    dpo_loss(chosen, rejected, REF_C, REF_R, beta=0.1).loss.sum().backward()
    sigma = 1 / (1 + math.exp(0.2))  # sigmoid(-beta h)
    assert chosen.grad.item() == pytest.approx(-0.1 * sigma) and rejected.grad.item() == pytest.approx(0.1 * sigma)


def test_ipo_regresses_the_margin_to_one_over_two_beta():
    assert ipo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.1).loss.item() == pytest.approx((2 - 5) ** 2)
    assert ipo_loss(POLICY_C, POLICY_R, REF_C, REF_R, beta=0.25).loss.item() == pytest.approx(0.0)


def test_simpo_uses_mean_log_probs_and_a_target_margin_without_a_reference():
    out = simpo_loss(torch.tensor([-0.5]), torch.tensor([-0.8]), beta=2.0, gamma=0.5)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.1)))  # -log sigmoid(2 * 0.3 - 0.5)
    assert out.chosen_reward.item() == pytest.approx(-1.0) and out.rejected_reward.item() == pytest.approx(-1.6)
