"""PPO formulas as pure tensor functions: advantage estimators (GAE and the critic-free GRPO, RLOO,
REINFORCE++), whitening, policy and value losses (the KL estimators: engine/data/response_tokens.py).

Shapes: B sequences, T response tokens (right-padded), ``mask`` (B, T) True where the token
counts. References beside each formula. No DeepSpeed here; whitening takes an optional
process group only to reduce its sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.data.response_tokens import LOG_RATIO_CLAMP
from engine.run.distributed import all_reduce
from engine.run_config import AdvantageEstimator, LossAggregation


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_rewards(score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """(B, T) reward per token: -kl_coef * KL at every token, plus the sequence score on the last.

    Ziegler et al. 2019, eq. 2; the score (B,) goes to each sequence's last real token (``mask`` may
    have holes: a multi-turn episode's observations).
    """
    rewards = -kl_coef * kl * mask
    last = mask.shape[1] - 1 - mask.long().flip(1).argmax(1)  # (B,) the last True of each row
    rewards[torch.arange(len(score)), last.clamp(min=0)] += score
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), per token.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last real token is 0: the episode ends);
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V. Returns ``(advantages, returns)``,
    both (B, T) and zero where ``mask`` is False. A False token passes A and V through unchanged:
    the right padding, and a multi-turn episode's observations, so the tokens the policy sampled
    are the steps (an observation between two turns is no step of its own).
    """
    real = mask.bool()
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(real[:, t], delta + gamma * lam * next_advantage, next_advantage)
        advantages[:, t] = next_advantage * mask[:, t]
        next_value = torch.where(real[:, t], values[:, t], next_value)
    return advantages, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over every masked token of the whole rollout batch (all ranks).

    ``group``: a torch.distributed group to sum over (None: this process only).
    """
    mask_f = mask.to(torch.float64)
    sums = torch.stack([(x.double() * mask_f).sum(), (x.double() ** 2 * mask_f).sum(), mask_f.sum()])
    if group is not None:
        all_reduce(sums, group=group)
    mean = sums[0] / sums[2]
    var = sums[1] / sums[2] - mean**2
    return ((x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps)) * mask


def grpo_advantages(
    returns: torch.Tensor, group_size: int, mask: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath sec. 4.1.2, outcome supervision): each sequence's
    return standardised within the ``group_size`` samples of its prompt,
    A_i = (R_i - mean_group R) / (std_group R + eps), at every token of the sequence.
    ``scale_by_std`` false: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    sec. 3.1), A_i = R_i - mean_group R, without the division that favours groups of similar rewards.

    ``returns`` (B,) with each prompt's samples contiguous (B = prompts x group_size)."""
    grouped = returns.view(-1, group_size)  # (G, k)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_by_std:
        advantages = advantages / (grouped.std(1, keepdim=True) + eps)  # unbiased std
    return advantages.reshape(-1, 1) * mask  # (B, T)


def rloo_advantages(returns: torch.Tensor, group_size: int, mask: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, eq. 4): each sequence's return minus the mean return of the
    other k - 1 samples of its prompt, A_i = R_i - sum_{j != i} R_j / (k - 1), at every token."""
    grouped = returns.view(-1, group_size)  # (G, k)
    others = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1, 1) * mask  # (B, T)


def estimate_advantages(
    estimator: AdvantageEstimator,
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    group_size: int,
    whiten_advantages: bool,
    group=None,
    grpo_std_scaling: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, T), from token ``rewards`` (score on the last token, KL
    penalty on every token):

    * ``gae``: :func:`gae` on the critic's ``values``, optionally whitened over the batch (``group``);
    * ``reinforce_pp`` (REINFORCE++, Hu 2025): the discounted return to go (GAE with V = 0 and
      lambda = 1), whitened over the whole batch: a global baseline, no critic;
    * ``grpo`` / ``rloo``: the sequence's total reward against its prompt's group (the functions above;
      ``grpo_std_scaling`` false: Dr. GRPO).

    ``returns`` are the critic's targets with ``gae``; for the others, the return to go (logged only).
    """
    if estimator == "gae":
        advantages, returns = gae(rewards, values, mask, gamma, lam)
        return (whiten(advantages, mask, group) if whiten_advantages else advantages), returns
    to_go, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)  # (B, T) sum_{t' >= t} gamma^(t' - t) r_t'
    if estimator == "reinforce_pp":
        return whiten(to_go, mask, group), to_go
    total = (rewards * mask).sum(1)  # (B,) the sequence's reward: score minus its KL penalty
    if estimator == "grpo":
        return grpo_advantages(total, group_size, mask, grpo_std_scaling), to_go
    if estimator == "rloo":
        return rloo_advantages(total, group_size, mask), to_go
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def aggregation_weights(
    mask: torch.Tensor, aggregation: LossAggregation, sequences: int, tokens: int, norm_tokens: int
) -> torch.Tensor:
    """(b, T) weight of each token's loss such that sum(loss * weight) over the whole mini-batch
    (every micro-batch of every rank; ``sequences`` and ``tokens`` its totals) is the aggregated loss:

    * ``token_mean``: 1 / tokens, every response token alike (DAPO, Yu et al. 2025, sec. 3.3, "token-level policy
      gradient loss");
    * ``seq_mean_token_mean``: 1 / (|o_i| * sequences), each sequence's token mean, then the mean
      over sequences (GRPO, Shao et al. 2024, eq. 3): a long response's tokens weigh less;
    * ``seq_mean_token_sum_norm``: 1 / (norm_tokens * sequences), each sequence's token sum over a
      constant (Dr. GRPO, Liu et al. 2025, sec. 3.1): no length bias either way.

    ``mask`` (b, T) marks the response tokens of this micro-batch's b sequences (whole sequences:
    packing never splits one), so the weights depend on neither the split nor the number of ranks."""
    m = mask.float()
    if aggregation == "token_mean":
        return m / tokens
    if aggregation == "seq_mean_token_mean":
        return m / (m.sum(1, keepdim=True).clamp(min=1) * sequences)
    if aggregation == "seq_mean_token_sum_norm":
        return m / (norm_tokens * sequences)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # (B, T) per-token loss (aggregate with the mask)
    clipped: torch.Tensor  # (B, T) bool, True where the clip was active
    capped: torch.Tensor | None = None  # (B, T) bool, True where dual clip's cap -c * A was active (dual clip only)


def clipped_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> PolicyLoss:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to a loss.

    max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)); asymmetric bounds as in DAPO.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return PolicyLoss(torch.maximum(unclipped, clipped), clipped > unclipped)


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> PolicyLoss:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 and GSPO-token, eq. 13):
    one importance ratio per sequence, the length-normalised product of its token ratios,
    s_i = exp(mean_t log(pi_t / pi_old_t)), clipped per sequence. Per token (b, T) it is
    s_i,t = sg[s_i] * pi_t / sg[pi_t]: s_i in value, and with the sequence-mean aggregation the
    gradient of GSPO; loss max(-A * s, -A * clip(s, 1 - clip_low, 1 + clip_high)). ``mask`` (b, T)."""
    m = mask.to(logprobs.dtype)
    seq_log_ratio = ((logprobs - old_logprobs) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()  # (b, T)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return PolicyLoss(torch.maximum(unclipped, clipped), clipped > unclipped)


def dual_clip_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
) -> PolicyLoss:
    """Dual-clip PPO (Ye et al. 2020, eq. 5): for A < 0 the loss is also capped at -c * A.

    Stops a very large ratio on a negative-advantage token from dominating the update.
    """
    base = clipped_policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high)
    cap = -clip_ratio_c * advantages
    capped = (advantages < 0) & (base.loss > cap)
    return PolicyLoss(torch.where(capped, cap, base.loss), base.clipped | capped, capped)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> PolicyLoss:
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2) per token (PPO2 baselines / CleanRL)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return PolicyLoss(0.5 * torch.maximum(unclipped, clipped), clipped > unclipped)


class FixedKLController:
    """kl_coef stays constant."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019, eq. 8: beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon)."""

    def __init__(self, kl_coef: float, target: float, horizon: int):
        super().__init__(kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
