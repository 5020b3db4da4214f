"""PPO formulas against hand-computed values and naive reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from engine.data.lm_head import head_logprobs
from engine.data.response_tokens import kl_penalty
from engine.ppo.losses import (
    AdaptiveKLController,
    FixedKLController,
    aggregation_weights,
    clipped_policy_loss,
    clipped_value_loss,
    dual_clip_policy_loss,
    estimate_advantages,
    gae,
    grpo_advantages,
    gspo_policy_loss,
    masked_mean,
    rloo_advantages,
    token_rewards,
    whiten,
)


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """CleanRL-style reverse loop over one sequence."""
    T = len(rewards)
    adv = [0.0] * T
    last = 0.0
    for t in reversed(range(T)):
        next_value = values[t + 1] if t + 1 < T else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_matches_a_naive_loop_on_ragged_batches():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 7]
    T = max(lengths)
    rewards, values = torch.randn(4, T, generator=g), torch.randn(4, T, generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    adv, ret = gae(rewards * mask, values, mask, gamma=0.99, lam=0.95)
    for i, n in enumerate(lengths):
        want_adv, want_ret = naive_gae(rewards[i, :n].tolist(), values[i, :n].tolist(), 0.99, 0.95)
        torch.testing.assert_close(adv[i, :n], torch.tensor(want_adv), atol=1e-5, rtol=0)
        torch.testing.assert_close(ret[i, :n], torch.tensor(want_ret), atol=1e-5, rtol=0)
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[6.0, 5.0, 3.0]]))
    torch.testing.assert_close(adv, torch.tensor([[5.5, 4.5, 2.5]]))


def test_token_rewards_put_the_score_on_the_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    r = token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([[-0.05, -0.1, 2.0 - 0.15], [-1.0 - 0.25, 0.0, 0.0]]))


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(2.0)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(log_r)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx((0.5 - 1) + log_r)
    same = kl_penalty(lp, lp, "k3")
    assert same.item() == 0.0
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_kl_estimators_are_unbiased_or_positive_on_samples():
    # Sampling from pi: E[k1] = E[k3] = KL(pi || ref); k3 >= 0 always.
    g = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.7, 0.2, 0.1])
    ref = torch.tensor([0.4, 0.4, 0.2])
    idx = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    lp, ref_lp = pi.log()[idx], ref.log()[idx]
    true_kl = (pi * (pi / ref).log()).sum().item()
    assert kl_penalty(lp, ref_lp, "k1").mean().item() == pytest.approx(true_kl, abs=5e-3)
    assert kl_penalty(lp, ref_lp, "k3").mean().item() == pytest.approx(true_kl, abs=5e-3)
    assert (kl_penalty(lp, ref_lp, "k3") >= 0).all()


def test_clipped_policy_loss_cases_by_hand():
    old = torch.zeros(4)
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1; clip 0.2
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    # A>0, r>1+eps: clipped to -1.2 ; A<0, r large: -A*r = 1.5 (unclipped is worse) ;
    # A>0, r small: -0.5 (unclipped) ; A<0, r<1-eps: clipped to 0.8
    torch.testing.assert_close(out.loss, torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    assert out.clipped.tolist() == [True, False, False, True]


def test_asymmetric_clip():
    out = clipped_policy_loss(
        torch.log(torch.tensor([1.5])), torch.zeros(1), torch.tensor([1.0]), clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(out.loss, torch.tensor([-1.28]))


def test_dual_clip_caps_negative_advantages_only():
    lp = torch.log(torch.tensor([10.0, 10.0, 2.0]))
    adv = torch.tensor([-1.0, 1.0, -1.0])
    out = dual_clip_policy_loss(lp, torch.zeros(3), adv, 0.2, 0.2, clip_ratio_c=3.0)
    # A<0, r=10: plain PPO gives 10, the dual clip caps it at 3; A>0: -1.2 as usual;
    # A<0, r=2: 2 < 3, untouched.
    torch.testing.assert_close(out.loss, torch.tensor([3.0, -1.2, 2.0]))
    plain = clipped_policy_loss(lp, torch.zeros(3), adv, 0.2, 0.2)
    assert plain.loss[0].item() == pytest.approx(10.0)


def test_value_clip_by_hand():
    old = torch.tensor([1.0, 1.0, 1.0])
    values = torch.tensor([2.0, 1.1, 0.0])
    returns = torch.tensor([3.0, 0.0, 0.0])
    out = clipped_value_loss(values, old, returns, clip=0.2)
    # v=2 clipped to 1.2: max((2-3)^2, (1.2-3)^2) = 3.24; v=1.1 within clip: 1.21;
    # v=0 clipped to 0.8: max(0, 0.64) = 0.64
    torch.testing.assert_close(out.loss, 0.5 * torch.tensor([3.24, 1.21, 0.64]))
    assert out.clipped.tolist() == [True, False, True]


def test_whiten_and_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    w = whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_mean(w**2, mask).item() == pytest.approx(1.0, abs=1e-5)
    assert w[1, 1:].abs().sum() == 0
    assert masked_mean(x, mask).item() == pytest.approx(2.5)


def test_entropy_and_logprob_of_the_head_output():
    logits = torch.tensor([[0.0] * 4, [100.0, 0.0, 0.0, 0.0]])
    logp, entropy = head_logprobs(torch.nn.Identity(), logits, torch.tensor([1, 0]), with_entropy=True)
    assert entropy is not None and entropy.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)
    assert logp.tolist() == pytest.approx([-math.log(4), 0.0], abs=1e-6)


def test_adaptive_kl_controller():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(current_kl=12.0, n_steps=1000)  # error clipped to +0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    c.update(current_kl=6.0 * 0.9, n_steps=1000)  # error -0.1
    assert c.value == pytest.approx(0.1 * 1.02 * (1 - 0.01))
    restored = AdaptiveKLController(0.5, 6.0, 10000)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_grpo_standardises_within_each_prompts_group_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    advantages = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, mask)
    half = 1 / math.sqrt(2)  # (1 - 2) / std([1, 3]) with the unbiased std sqrt(2)
    expected = torch.tensor(
        [[-half, -half, 0], [half, half, half], [0, 0, 0], [0, 0, 0]]
    )  # an all-equal group: no signal
    assert torch.allclose(advantages, expected, atol=1e-5)
    # Dr. GRPO: the mean subtracted, no division by the std ([1, 3] -> -1, +1)
    dr = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, mask, scale_by_std=False)
    assert torch.equal(dr, torch.tensor([[-1.0, -1.0, 0], [1.0, 1.0, 1.0], [0, 0, 0], [0, 0, 0]]))


def test_gspo_clips_one_ratio_per_sequence_by_hand():
    """Sequence 0: token log-ratios ln 2 and 0, s = sqrt(2) > 1.28: clipped at every token (no
    gradient); sequence 1: +0.1 and -0.1, s = 1: unclipped, each token's gradient -A * s."""
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[math.log(2), 0.0, 5.0], [0.1, -0.1, 5.0]], requires_grad=True)  # 5.0: padding
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([[1.0], [2.0]]).expand(2, 3) * mask
    out = gspo_policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(out.loss[0, :2], torch.tensor([-1.28, -1.28])) and out.clipped[0, :2].all()
    assert torch.allclose(out.loss[1, :2], torch.tensor([-2.0, -2.0])) and not out.clipped[1].any()
    (out.loss * mask).sum().backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [-2.0, -2.0, 0.0]]))
    # token ratios would have clipped only sequence 0's first token (2 > 1.28) and left 1.105 alone
    assert clipped_policy_loss(logprobs, old, advantages, 0.2, 0.28).clipped[0].tolist() == [True, False, False]


def test_loss_aggregations_by_hand():
    """Two sequences of 1 and 3 response tokens (4 tokens, 2 sequences in the whole mini-batch)."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    weights = lambda how: aggregation_weights(mask, how, sequences=2, tokens=4, norm_tokens=8)
    assert torch.equal(weights("token_mean"), torch.tensor([[0.25, 0, 0], [0.25, 0.25, 0.25]]))
    # each sequence counts half, spread over its own tokens: the short one's token weighs 3x
    assert torch.allclose(weights("seq_mean_token_mean"), torch.tensor([[0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))
    assert torch.equal(weights("seq_mean_token_sum_norm"), torch.full((2, 3), 1 / 16) * mask)
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 2.0, 3.0]])  # the padding's 9s never count
    assert [(loss * weights(how)).sum().item() for how in ("token_mean", "seq_mean_token_mean")] == [2.5, 3.0]
    assert (loss * weights("seq_mean_token_sum_norm")).sum().item() == pytest.approx(10 / 16)


def test_rloo_subtracts_the_mean_of_the_other_samples_by_hand():
    mask = torch.ones(3, 2, dtype=torch.bool)
    advantages = rloo_advantages(torch.tensor([1.0, 3.0, 5.0]), 3, mask)
    assert torch.equal(
        advantages, torch.tensor([[-3.0, -3.0], [0.0, 0.0], [3.0, 3.0]])
    )  # 1 - (3+5)/2, 3 - (1+5)/2, 5 - (1+3)/2


def test_estimators_from_token_rewards_by_hand():
    mask = torch.ones(2, 2, dtype=torch.bool)
    kl = torch.tensor([[0.5, 0.5], [0.0, 1.0]])
    rewards = token_rewards(torch.tensor([1.0, 4.0]), kl, mask, kl_coef=1.0)  # [[-0.5, 0.5], [0.0, 3.0]]
    common = dict(values=torch.full((2, 2), 9.0), mask=mask, gamma=1.0, lam=0.95, group_size=2, whiten_advantages=True)
    # REINFORCE++: return to go [[0, 0.5], [3, 3]], whitened over the batch (mean 1.625, variance 1.921875);
    # the critic's values unused.
    advantages, returns = estimate_advantages("reinforce_pp", rewards, **common)
    to_go = torch.tensor([[0.0, 0.5], [3.0, 3.0]])
    assert torch.equal(returns, to_go)
    assert torch.allclose(advantages, (to_go - 1.625) / math.sqrt(1.921875), atol=1e-5)
    # GRPO and RLOO on the sequence totals (score minus KL penalty): 0.0 and 3.0, one group of two.
    assert torch.allclose(
        estimate_advantages("grpo", rewards, **common)[0],
        torch.tensor([[-1.0, -1.0], [1.0, 1.0]]) / math.sqrt(2),
        atol=1e-5,
    )
    assert torch.allclose(estimate_advantages("rloo", rewards, **common)[0], torch.tensor([[-3.0, -3.0], [3.0, 3.0]]))
    # GAE uses the critic and whitens when asked.
    gae_adv, gae_ret = estimate_advantages("gae", rewards, **common)
    assert torch.allclose(gae_ret, gae(rewards, common["values"], mask, 1.0, 0.95)[1])
    assert abs(gae_adv[mask].mean().item()) < 1e-6
