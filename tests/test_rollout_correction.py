"""engine/ppo/rollout_correction.py: the importance weights of the policy loss against hand-computed values
and naive loops; masked tokens and sequences add nothing to the actor's loss and leave the others as they were."""

from __future__ import annotations

import math

import pytest
import torch
from test_ppo_update import random_experience

from engine.ppo.forwards import pad_right
from engine.ppo.losses import aggregation_weights
from engine.ppo.rollout_correction import (
    RolloutCorrection,
    policy_loss_weights,
    sequence_log_ratios,
    token_log_ratios,
    truncated_is_weights,
)
from engine.ppo.settings import PolicyLossSettings
from engine.ppo.update import actor_token_loss
from engine.run_config.rollout_correction import RolloutCorrectionSection

PLAIN = PolicyLossSettings(
    clip_low=0.2, clip_high=0.28, clip_ratio_c=None, kl_loss_coef=0.0, kl_estimator="k3", entropy_coef=0.0
)


def test_truncated_importance_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-1.0, -1.0, -2.0]])  # ratios 1, e^-1, e^1.5 ~ 4.48
    log_ratio = token_log_ratios(trainer, sampler, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(truncated_is_weights(log_ratio, cap=2.0), torch.tensor([[1.0, math.exp(-1.0), 2.0]]))


def test_the_sequence_ratio_is_the_product_of_its_token_ratios():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.2, -2.1, -0.9], [-0.5, -1.0, 0.0]])  # token log-ratios 0.2, 0.1, 0.4 | -0.5, 0
    mask = torch.tensor([[True, True, True], [True, True, False]])
    log_ratio = sequence_log_ratios(old, sampler, mask)
    torch.testing.assert_close(log_ratio, torch.tensor([[0.7, 0.7, 0.7], [-0.5, -0.5, 0.0]]))
    weights = RolloutCorrection("sequence", "truncate", 0.5, 2.0).weights(old, sampler, mask)
    # e^0.7 ~ 2.01 is truncated at 2 on every token of the first sequence; e^-0.5 ~ 0.61 stays; padding 0
    torch.testing.assert_close(weights.weights, torch.tensor([[2.0, 2.0, 2.0], [math.exp(-0.5)] * 2 + [0.0]]))
    assert weights.limited.tolist() == [[True, True, True], [False, False, False]]


def test_token_mask_masks_exactly_the_tokens_outside_the_band():
    g = torch.Generator().manual_seed(0)
    mask = pad_right([torch.ones(n, dtype=torch.bool) for n in (5, 1, 9, 3)], 9)  # (4, 9)
    old = -torch.rand(4, 9, generator=g) * 3 * mask
    sampler = (old - torch.randn(4, 9, generator=g)) * mask  # log-ratios ~ N(0, 1): many outside [0.5, 2]
    correction = RolloutCorrection.from_config(RolloutCorrectionSection(mode="mask", low=0.5, high=2.0))
    assert correction == RolloutCorrection("token", "mask", 0.5, 2.0)
    weights, stats = policy_loss_weights(correction, old, sampler, mask)
    masked = 0
    for b in range(4):
        for t in range(9):
            ratio = math.exp(old[b, t] - sampler[b, t])
            want = ratio if mask[b, t] and 0.5 <= ratio <= 2.0 else 0.0
            masked += bool(mask[b, t]) and not 0.5 <= ratio <= 2.0
            assert weights[b, t].item() == pytest.approx(want, rel=1e-6)
    assert 0 < masked < mask.sum()
    assert stats == pytest.approx({"is_weight": weights.sum().item() / 18, "is_masked_share": masked / 18})
    # the lower bound defaults to 1 / high
    assert RolloutCorrection.from_config(RolloutCorrectionSection(mode="mask", high=4.0)).low == 0.25


def test_a_sequence_mask_drops_the_shifted_sequences_and_leaves_the_others_alone():
    """Sampler log-probs of sequences 2 and 5 shifted by a constant (the sampler is off on them): at
    sequence level their ratio e^(0.4 x length) leaves the band; they weigh 0 and add nothing to the
    loss or its gradient, while every other token's loss and gradient are exactly those of an update
    without correction (the aggregation keeps the masked tokens' places), whatever the aggregation."""
    exp = random_experience(vocab=50)
    shifted = torch.tensor([False, False, True, False, False, True, False, False])  # lengths 9 and 2
    sampler = exp.old_logprobs - 0.4 * shifted[:, None] * exp.mask  # 0.4 per token: e^0.8 > 2 over 2 tokens
    correction = RolloutCorrection("sequence", "mask", 0.5, 2.0)
    weights, stats = policy_loss_weights(correction, exp.old_logprobs, sampler, exp.mask)
    others = exp.mask & ~shifted[:, None]
    assert weights[shifted].eq(0).all() and weights[others].eq(1).all()  # the others' sampler is the actor
    assert stats == pytest.approx({"is_weight": 26 / 37, "is_masked_share": 11 / 37})  # 9 + 2 of 37 tokens

    g = torch.Generator().manual_seed(1)
    logprobs = (exp.old_logprobs + 0.3 * torch.randn(exp.mask.shape, generator=g) * exp.mask).requires_grad_()
    entropy = torch.zeros(exp.mask.shape)
    S, N = exp.mask.shape[0], int(exp.mask.sum())
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        agg = aggregation_weights(exp.mask, aggregation, sequences=S, tokens=N, norm_tokens=12)
        grads, losses = [], []
        for is_weights in (weights, exp.mask.float()):
            logprobs.grad = None
            exp.is_weights = is_weights
            per_token = actor_token_loss(logprobs, entropy, exp, PLAIN).per_token * agg
            per_token.sum().backward()
            grads.append(logprobs.grad.clone())
            losses.append(per_token.detach())
        (corrected, plain), (corrected_loss, plain_loss) = grads, losses
        assert corrected[shifted].eq(0).all() and corrected_loss[shifted].eq(0).all()
        assert plain[shifted].abs().sum() > 0  # without the correction they count
        assert torch.equal(corrected[others], plain[others]) and torch.equal(corrected_loss[others], plain_loss[others])


def test_without_a_correction_the_loss_is_the_plain_clipped_surrogate():
    """No ppo.rollout_correction: every response token weighs 1, nothing is logged, and the actor's loss
    is PPO's clipped surrogate computed naively, token by token."""
    exp = random_experience(vocab=50)
    g = torch.Generator().manual_seed(2)
    sampler = exp.old_logprobs + torch.randn(exp.mask.shape, generator=g) * exp.mask  # far from the actor: no matter
    weights, stats = policy_loss_weights(None, exp.old_logprobs, sampler, exp.mask)
    assert torch.equal(weights, exp.mask.float()) and stats == {}
    exp.is_weights = weights
    logprobs = exp.old_logprobs + 0.3 * torch.randn(exp.mask.shape, generator=g)
    per_token = actor_token_loss(logprobs, torch.zeros(exp.mask.shape), exp, PLAIN).per_token
    for b, t in exp.mask.nonzero().tolist():
        ratio, advantage = math.exp(logprobs[b, t] - exp.old_logprobs[b, t]), exp.advantages[b, t].item()
        want = max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.28))
        assert per_token[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-7)
