"""The PPO config's reward-hacking checks: the monitors' thresholds and what a flag does
(``monitors``), and the judge, held-out scores the policy is not trained on (``judge``)."""

from __future__ import annotations

from typing import Literal

from engine.config import Config, option
from engine.run_config.rewards import RewardModelSection, RewardsSection


class MonitorSection(Config):
    action: Literal["warn", "rollback", "stop"] = option(
        "warn",
        "what a reward-hacking flag does: an event and the run's last line (warn), a rollback to the last good "
        "evaluation (rollback; needs guards.rollback_drop), or a checkpoint and exit 3 (stop)",
    )
    length_ratio_max: float = option(
        1.5,
        "flag when the mean response length exceeds this times the reference's (held out) or the first "
        "iteration's (rollout)",
        gt=0,
    )
    length_ratio_min: float = option(
        0.5,
        "flag when the mean response length is below this times the reference's (held out) or the first "
        "iteration's (rollout)",
        gt=0,
    )
    repeated_ngram_max: float = option(
        0.3, "flag when the fraction of repeated n-grams in held-out responses exceeds this", ge=0, le=1
    )
    ngram: int = option(4, "n of the repeated n-gram monitor (in tokens)", ge=1)
    entropy_min_share: float = option(
        0.3, "flag when the rollout's policy entropy falls below this share of the first iteration's", ge=0, le=1
    )
    distinct_n: int = option(2, "n of the diversity monitors' distinct n-grams (in tokens)", ge=1)
    diversity_min_share: float = option(
        0.5,
        "flag when distinct n-grams among a prompt's samples fall below this share of the first iteration's, or "
        "across held-out responses below this share of the reference's",
        ge=0,
        le=1,
    )
    kl_per_token_max: float | None = option(
        None,
        "flag when the rollout's KL per token exceeds this (None: 4 x guards.kl_ceiling, else 4 x ppo.kl_target, "
        "else 0.5)",
        gt=0,
    )
    win_rate_drop: float = option(
        0.05,
        "flag when the training reward rose since the last evaluation while the held-out win rate fell by more "
        "than this",
        ge=0,
        le=1,
    )
    judge_disagreement: float = option(
        0.3, "flag when the held-out win rate under the run's score exceeds the judge's by more than this", ge=0, le=1
    )
    sample_rows: int = option(4, "held-out prompts whose responses go to samples.jsonl at each evaluation", ge=0)


class JudgeSection(Config):
    reward_model: RewardModelSection | None = option(
        None, "a second reward model the policy is not trained on (e.g. train_rm.py on a disjoint split)"
    )
    rewards: RewardsSection | None = option(None, "rule or verifier components, as in the rewards section")

    def active(self) -> bool:
        return self.reward_model is not None or bool(self.rewards and self.rewards.weights())
