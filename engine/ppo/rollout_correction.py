"""Rollout correction: importance weights on the policy loss for responses drawn by a sampler whose
log-probs differ from the trainer's (bf16 and other kernels, or an async rollout's weights some updates
behind). PPO's ratio pi / pi_old takes pi_old for the policy that sampled; the correction weighs each
token's surrogate by the ratio between the two, rho = pi_old / pi_sampler (``ppo.rollout_correction``):

* level ``token``: rho_t of each token; ``sequence``: the response's own importance ratio, the product of
  its token ratios, rho = prod_t rho_t = exp(sum_t log rho_t), at each of its tokens. Not the geometric
  mean exp(mean_t log rho_t) (verl's "geometric" rejection), which is no importance ratio: it does not
  reweigh a sequence-level reward to the trainer's distribution, and its bounds would hug 1;
* mode ``truncate``: min(rho, high), truncated importance sampling (TIS; Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training"); ``mask``: rho inside [low, high] and 0 outside,
  masked importance sampling (MIS; Liu, Li et al. 2025, "When speed kills stability: demystifying RL
  collapse from the training-inference mismatch").

A masked token keeps its place in the loss's aggregation (the token and sequence counts of
engine/ppo/losses.aggregation_weights): only its surrogate goes, so the other tokens weigh what they weigh
in an update without it, and the KL loss and the entropy bonus still apply to it.

Shapes: B sequences, T response tokens (right-padded), ``mask`` (B, T) True where a token counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.data.response_tokens import LOG_RATIO_CLAMP
from engine.ppo.losses import masked_mean
from engine.run_config.rollout_correction import CorrectionLevel, CorrectionMode, RolloutCorrectionSection


def token_log_ratios(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log rho_t = log pi_old - log pi_sampler of each response token, 0 on padding."""
    return (old_logprobs - sampler_logprobs) * mask.to(old_logprobs.dtype)


def sequence_log_ratios(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) log rho of each token's sequence, sum_t log rho_t over its response tokens (the log of the
    product of its token ratios), at each of its tokens; 0 on padding."""
    log_ratios = token_log_ratios(old_logprobs, sampler_logprobs, mask)
    return log_ratios.sum(1, keepdim=True) * mask.to(log_ratios.dtype)  # (B, 1) -> (B, T)


def truncated_is_weights(log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS (Yao et al. 2025): min(rho, cap) of each ``log_ratio`` = log rho, clamped before exp, (B, T)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)


def outside_band(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """(B, T) bool, True where rho = exp(``log_ratio``) is below ``low`` or above ``high`` (compared as logs:
    no overflow however far the sampler is)."""
    return (log_ratio < math.log(low)) | (log_ratio > math.log(high))


def masked_is_weights(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """MIS (Liu, Li et al. 2025): rho where low <= rho <= high, else 0, (B, T)."""
    inside = torch.exp(log_ratio.clamp(math.log(low), math.log(high)))
    return inside.masked_fill(outside_band(log_ratio, low, high), 0.0)


class CorrectionWeights(NamedTuple):
    weights: torch.Tensor  # (B, T) weight of each token's policy surrogate, 0 on padding
    limited: torch.Tensor  # (B, T) bool: response tokens at the cap (truncate) or masked out (mask)


@dataclass(frozen=True)
class RolloutCorrection:
    """``ppo.rollout_correction``: which ratio, and what the mode does with it."""

    level: CorrectionLevel
    mode: CorrectionMode
    low: float  # mask's lower bound
    high: float  # truncate's cap, mask's upper bound

    @classmethod
    def from_config(cls, section: RolloutCorrectionSection | None) -> RolloutCorrection | None:
        """The correction of the config's section (None: off)."""
        return None if section is None else cls(section.level, section.mode, *section.bounds())

    def weights(
        self, old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> CorrectionWeights:
        """The weights of the rollout's policy losses, all (B, T): the old (trainer's) and the sampler's
        log-probs of its response tokens, ``mask`` True on them."""
        ratio = sequence_log_ratios if self.level == "sequence" else token_log_ratios
        log_ratio = ratio(old_logprobs, sampler_logprobs, mask)  # (B, T)
        m = mask.to(old_logprobs.dtype)
        if self.mode == "truncate":
            truncated = truncated_is_weights(log_ratio, self.high) * m
            return CorrectionWeights(truncated, (truncated >= self.high) & mask)
        return CorrectionWeights(
            masked_is_weights(log_ratio, self.low, self.high) * m, outside_band(log_ratio, self.low, self.high) & mask
        )

    def stats(self, corrected: CorrectionWeights, mask: torch.Tensor) -> dict[str, float]:
        """Over the response tokens (``mask``): ``is_weight``, the mean weight, and the share the mode
        limited, ``is_truncated_share`` (at the cap) or ``is_masked_share`` (weight 0)."""
        share = "is_truncated_share" if self.mode == "truncate" else "is_masked_share"
        return {
            "is_weight": masked_mean(corrected.weights, mask).item(),
            share: masked_mean(corrected.limited.float(), mask).item(),
        }


def policy_loss_weights(
    correction: RolloutCorrection | None, old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The (B, T) weights of the rollout's policy losses and their statistics (:meth:`RolloutCorrection.stats`):
    without a correction, 1 on every response token and none."""
    if correction is None:
        return mask.float(), {}
    corrected = correction.weights(old_logprobs, sampler_logprobs, mask)
    return corrected.weights, correction.stats(corrected, mask)
