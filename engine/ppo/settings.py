"""What a PPO run fixes once, read from its config in one place: how a rollout becomes experience
(:class:`ExperienceSettings`) and how the update trains on it (:class:`UpdateSettings`, with the
surrogate's :class:`PolicyLossSettings` and GAE's :class:`GaeSettings`).

The pieces (engine/ppo/experience.py, engine/ppo/update.py) take these, never the config; each
``from_config`` is where a config key reaches them. What changes from one iteration to the next
(the KL coefficient, where the old log-probs come from, the iteration) is passed on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.loading import trains_as_it_evaluates
from engine.ppo.distill import DistillSettings
from engine.ppo.forwards import ValueReadout
from engine.ppo.losses import PolicyLoss, clipped_policy_loss, dual_clip_policy_loss, gspo_policy_loss
from engine.ppo.rollout_correction import RolloutCorrection
from engine.run_config import AdvantageEstimator, KLEstimator, LossAggregation, PPOConfig


@dataclass(frozen=True)
class GaeSettings:
    """GAE's parameters (Schulman et al. 2016); ``gamma`` also discounts the critic-free
    estimators' returns to go."""

    gamma: float
    lam: float
    whiten: bool  # standardise the advantages over the rollout batch (all ranks)

    @classmethod
    def from_config(cls, cfg: PPOConfig) -> GaeSettings:
        return cls(cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.whiten_advantages)


@dataclass(frozen=True)
class PolicyLossSettings:
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None  # dual clip when set
    kl_loss_coef: float
    kl_estimator: KLEstimator
    entropy_coef: float
    sequence_ratio: bool = False  # GSPO: one importance ratio per sequence
    aggregation: LossAggregation = "token_mean"  # how the per-token losses of a mini-batch add up
    norm_tokens: int = 1  # seq_mean_token_sum_norm's constant
    distill: DistillSettings | None = None  # gkd: coef x JSD(beta) to the teacher in the loss

    @classmethod
    def from_config(cls, cfg: PPOConfig, distill: DistillSettings | None = None) -> PolicyLossSettings:
        return cls(
            clip_low=cfg.ppo.clip_ratio,
            clip_high=cfg.ppo.clip_ratio_high or cfg.ppo.clip_ratio,
            clip_ratio_c=cfg.ppo.clip_ratio_c,
            kl_loss_coef=cfg.ppo.kl_loss_coef,
            kl_estimator=cfg.ppo.kl_loss_estimator,
            entropy_coef=cfg.ppo.entropy_coef,
            sequence_ratio=cfg.ppo.importance_ratio == "sequence",
            aggregation=cfg.ppo.loss_aggregation,
            norm_tokens=cfg.ppo.loss_norm_tokens or cfg.rollout.max_new_tokens,
            distill=distill,
        )

    def policy_loss(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> PolicyLoss:
        """The configured surrogate: GSPO's sequence-ratio one, clipped, or dual-clip when ``clip_ratio_c`` is set."""
        if self.sequence_ratio:
            return gspo_policy_loss(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)
        if self.clip_ratio_c is None:
            return clipped_policy_loss(logprobs, old_logprobs, advantages, self.clip_low, self.clip_high)
        return dual_clip_policy_loss(
            logprobs, old_logprobs, advantages, self.clip_low, self.clip_high, self.clip_ratio_c
        )


@dataclass(frozen=True)
class ExperienceSettings:
    """How :func:`engine.ppo.experience.make_experience` turns a rollout into experience."""

    max_tokens: int  # token budget of one packed forward
    value_readout: ValueReadout  # the critic's value from its C outputs
    kl_estimator: KLEstimator  # of the KL in the reward
    gae: GaeSettings
    advantage_estimator: AdvantageEstimator = "gae"
    group_size: int = 1  # samples per prompt, contiguous in the rollout
    rollout_correction: RolloutCorrection | None = None  # importance weights of the policy loss (None: off)
    share_prompts: bool = True  # the samples of a prompt compute it once in each forward
    values_from_update: bool = False  # no critic forward: the first critic step computes the values
    distinct_n: int = 2  # n of the rollout's distinct n-grams among a prompt's samples (a monitor)
    grpo_std_scaling: bool = True  # grpo divides by the group's reward std (false: Dr. GRPO)
    mask_truncated: bool = False  # responses cut at max_new_tokens count in no loss (DAPO's overlong filtering)
    temperature: float = 1.0  # the rollout's: log-probs are those of softmax(logits / temperature)
    distill: DistillSettings | None = None  # the teacher's forward (and reverse_kl's advantages); None: no teacher

    @classmethod
    def from_config(
        cls,
        cfg: PPOConfig,
        value_readout: ValueReadout,
        values_from_update: bool,
        distill: DistillSettings | None = None,
    ) -> ExperienceSettings:
        return cls(
            max_tokens=cfg.ppo.max_tokens_per_micro_batch,
            value_readout=value_readout,
            kl_estimator=cfg.ppo.kl_estimator,
            gae=GaeSettings.from_config(cfg),
            advantage_estimator=cfg.ppo.advantage_estimator,
            group_size=cfg.rollout.samples_per_prompt,
            rollout_correction=RolloutCorrection.from_config(cfg.ppo.rollout_correction),
            share_prompts=cfg.ppo.share_prompt,
            values_from_update=values_from_update,
            distinct_n=cfg.monitors.distinct_n,
            grpo_std_scaling=cfg.ppo.grpo_std_scaling,
            mask_truncated=cfg.ppo.mask_truncated,
            temperature=cfg.rollout.temperature,
            distill=distill,
        )


@dataclass(frozen=True)
class UpdateSettings:
    """How :func:`engine.ppo.update.update_on_rollout` trains the actor and the critic on a rollout."""

    policy: PolicyLossSettings
    value_readout: ValueReadout  # as in ExperienceSettings
    value_clip: float
    ppo_epochs: int
    mini_batch_size: int  # sequences per optimizer step, over all ranks
    max_tokens: int  # token budget of one packed forward
    pad_token_id: int
    seed: int  # iteration i shuffles its mini-batches with seed * 100_003 + i
    share_prompts: bool = True  # the samples of a prompt in one mini-batch compute it once
    values_gae: GaeSettings | None = None  # set: the first critic step gives the rollout's values, then GAE runs
    temperature: float = 1.0  # the rollout's: log-probs and entropy are those of softmax(logits / temperature)

    @classmethod
    def from_config(
        cls,
        cfg: PPOConfig,
        value_readout: ValueReadout,
        pad_token_id: int,
        critic,
        distill: DistillSettings | None = None,
    ) -> UpdateSettings:
        return cls(
            policy=PolicyLossSettings.from_config(cfg, distill),
            value_readout=value_readout,
            value_clip=cfg.ppo.value_clip,
            ppo_epochs=cfg.ppo.ppo_epochs,
            mini_batch_size=cfg.ppo.mini_batch_size,
            max_tokens=cfg.ppo.max_tokens_per_micro_batch,
            pad_token_id=pad_token_id,
            seed=cfg.train.seed,
            share_prompts=cfg.ppo.share_prompt,
            values_gae=values_from_update(cfg, critic),
            temperature=cfg.rollout.temperature,
        )


def values_from_update(cfg: PPOConfig, critic) -> GaeSettings | None:
    """GAE's settings when the first critic step's forward gives the rollout's values exactly
    (ppo.old_values_from update; the rollout is one mini-batch; the critic has no dropout), else None."""
    one_mini_batch = cfg.ppo.mini_batch_size == cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt
    if (
        cfg.ppo.old_values_from != "update"
        or critic is None
        or not one_mini_batch
        or not trains_as_it_evaluates(critic.module)
    ):
        return None
    return GaeSettings.from_config(cfg)
