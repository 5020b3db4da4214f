"""Reward-hacking monitors on held-out evaluations: signs that the policy is gaming the reward
model rather than getting better. They flag (log an event); they do not act."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.run.guards import Stateful


def repeated_ngrams(ids: Sequence[int], n: int) -> tuple[int, int]:
    """``(repeated, total)`` n-grams of one response; an n-gram seen earlier in it is repeated."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


@dataclass
class HackingMonitor(Stateful):
    """Checks each held-out evaluation against thresholds and against the previous evaluation.

    Flags: ``length_drift`` (mean length / the reference's above ``length_ratio_max``),
    ``repetition`` (repeated n-gram fraction above ``repeated_ngram_max``),
    ``reward_up_win_rate_down`` (the training reward rose since the last evaluation while the
    held-out win rate against the reference fell), ``kl_above_ceiling`` (held-out KL per token
    above ``kl_ceiling``, when one is set).
    """

    length_ratio_max: float
    repeated_ngram_max: float
    kl_ceiling: float | None
    last_train_reward: float | None = None
    last_win_rate: float | None = None
    train_scores: list[float] = field(
        default_factory=list
    )  # mean rollout score of each iteration since the last evaluation

    def record_train_score(self, score: float) -> None:
        self.train_scores.append(score)

    def check_evaluation(self, evaluation: dict[str, float]) -> list[tuple[str, str]]:
        """:meth:`check` against the mean rollout score recorded since the previous evaluation."""
        train_reward = sum(self.train_scores) / len(self.train_scores) if self.train_scores else None
        self.train_scores = []
        return self.check(evaluation, train_reward)

    def check(self, evaluation: dict[str, float], train_reward: float | None) -> list[tuple[str, str]]:
        """``evaluation``: the held-out metrics (engine/ppo/evaluation.py); ``train_reward``: the mean
        rollout score since the previous evaluation (None before the first iteration)."""
        flags = []
        if evaluation["length_ratio"] > self.length_ratio_max:
            flags.append(
                (
                    "length_drift",
                    f"responses are {evaluation['length_ratio']:.2f}x the reference's length "
                    f"(limit {self.length_ratio_max})",
                )
            )
        if evaluation["repeated_ngram_frac"] > self.repeated_ngram_max:
            flags.append(
                (
                    "repetition",
                    f"{evaluation['repeated_ngram_frac']:.1%} of response n-grams repeat "
                    f"(limit {self.repeated_ngram_max:.0%})",
                )
            )
        win_rate = evaluation["win_rate"]
        if (
            train_reward is not None
            and self.last_train_reward is not None
            and self.last_win_rate is not None
            and train_reward > self.last_train_reward
            and win_rate < self.last_win_rate
        ):
            flags.append(
                (
                    "reward_up_win_rate_down",
                    f"training reward rose {self.last_train_reward:.3f} -> {train_reward:.3f} "
                    f"while the held-out win rate fell {self.last_win_rate:.3f} -> {win_rate:.3f}",
                )
            )
        if self.kl_ceiling is not None and evaluation["kl_per_token"] > self.kl_ceiling:
            flags.append(
                (
                    "kl_above_ceiling",
                    f"held-out KL {evaluation['kl_per_token']:.4f} per token is above the ceiling {self.kl_ceiling}",
                )
            )
        if train_reward is not None:
            self.last_train_reward = train_reward
        self.last_win_rate = win_rate
        return [(f"monitor/{kind}", message) for kind, message in flags]
