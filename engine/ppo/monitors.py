"""Reward-hacking monitors: signs that the policy games its reward instead of getting better.

Two kinds of check, with the thresholds of the config's ``monitors`` section:

* every iteration, on the rollout: the policy's entropy, and the distinct n-grams among a prompt's
  samples, collapsing below a share of the first iteration's; the mean response length of the last
  iterations against the first iteration's (the starting policy's), in both directions; KL per token
  far above the run's KL level (:meth:`MonitorLimits.from_config`);
* at each held-out evaluation: response length against the reference's, in both directions;
  repeated n-grams; distinct n-grams across prompts against the reference's; the training reward
  rising while the held-out win rate against the reference falls; the judge (scores the policy is
  not trained on) disagreeing with the run's score about that win rate.

A flag is raised when its condition starts to hold, not again while it keeps holding. What a
flag does (``monitors.action``: warn, rollback, stop) is train/train_ppo.py's to apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.run_config import PPOConfig

if TYPE_CHECKING:
    from engine.run.lifecycle import RunLifecycle

KL_LEVEL_FACTOR = 4.0  # "far above" the KL ceiling or target
DEFAULT_KL_PER_TOKEN_MAX = 0.5  # without a ceiling, target or explicit limit
# Iterations whose rollout lengths are averaged for the length check: one rollout's mean is noisy (the
# demo's 64 samples moved it by up to 1.6x for a single iteration while the policy was not gaming length).
LENGTH_WINDOW = 5


def repeated_ngrams(ids: Sequence[int], n: int) -> tuple[int, int]:
    """``(repeated, total)`` n-grams of one response; an n-gram seen earlier in it is repeated."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


def distinct_share(responses: Sequence[Sequence[int]], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct n-grams / all n-grams over ``responses`` together
    (0 when they have no n-gram: responses shorter than n are no diversity)."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def within_prompt_diversity(responses: Sequence[Sequence[int]], group_size: int, n: int) -> float:
    """Mean over prompts of :func:`distinct_share` among its ``group_size`` samples (contiguous)."""
    groups = [responses[i : i + group_size] for i in range(0, len(responses), group_size)]
    return sum(distinct_share(g, n) for g in groups) / max(len(groups), 1)


class Flag(NamedTuple):
    kind: str  # the event name: monitor/<kind>
    message: str
    since: int  # the previous check: the flag's band on the report's plots is [since, step]


@dataclass(frozen=True)
class MonitorLimits:
    """The thresholds of the config's ``monitors`` section; the KL limit resolved."""

    length_ratio_max: float
    length_ratio_min: float
    repeated_ngram_max: float
    entropy_min_share: float
    diversity_min_share: float
    kl_per_token_max: float
    win_rate_drop: float
    judge_disagreement: float

    @classmethod
    def from_config(cls, cfg: PPOConfig) -> MonitorLimits:
        """``monitors.kl_per_token_max``, or KL_LEVEL_FACTOR x the KL guard's ceiling, else x the
        adaptive controller's target, else DEFAULT_KL_PER_TOKEN_MAX."""
        m = cfg.monitors
        level = cfg.guards.kl_ceiling or cfg.ppo.kl_target
        kl_max = m.kl_per_token_max or (KL_LEVEL_FACTOR * level if level else DEFAULT_KL_PER_TOKEN_MAX)
        return cls(
            m.length_ratio_max,
            m.length_ratio_min,
            m.repeated_ngram_max,
            m.entropy_min_share,
            m.diversity_min_share,
            kl_max,
            m.win_rate_drop,
            m.judge_disagreement,
        )


@dataclass
class HackingMonitor:
    """The checks' state (checkpointed: a resumed run flags as the straight one would)."""

    limits: MonitorLimits
    first_entropy: float | None = None
    first_diversity: float | None = None
    first_length: float | None = None  # the first iteration's mean response length: the starting policy's
    recent_lengths: list[float] = field(default_factory=list)  # the last LENGTH_WINDOW iterations'
    last_train_reward: float | None = None
    last_win_rate: float | None = None
    last_eval_step: int = 0
    train_scores: list[float] = field(default_factory=list)  # rollout scores since the last evaluation
    active: list[str] = field(default_factory=list)  # kinds whose condition held at their last check
    raised: list[tuple[str, int]] = field(default_factory=list)  # (kind, step) of every flag raised

    def state_dict(self) -> dict[str, Any]:
        """Every field but ``limits`` (the config's)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "limits"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.raised = [tuple(r) for r in self.raised]  # type: ignore[misc]

    def _raise(self, step: int, since: int, conditions: dict[str, str | None]) -> list[Flag]:
        """Flags for the ``conditions`` (kind -> message while it holds, else None) that start to hold."""
        holding = {kind for kind, message in conditions.items() if message}
        flags = [Flag(f"monitor/{k}", m, since) for k, m in conditions.items() if m and k not in self.active]
        self.active = sorted((set(self.active) - set(conditions)) | holding)
        self.raised += [(f.kind.removeprefix("monitor/"), step) for f in flags]
        return flags

    def check_iteration(self, step: int, metrics: dict[str, float]) -> list[Flag]:
        """After iteration ``step``, on its ppo/* metrics (score, entropy, distinct_within_prompt,
        response_length, kl_per_token): entropy and sample diversity against the first iteration's, the
        mean response length of the last LENGTH_WINDOW iterations against it, KL per token."""
        self.train_scores.append(metrics["ppo/score"])
        limits, conditions = self.limits, {}
        entropy, diversity = metrics.get("ppo/entropy"), metrics["ppo/distinct_within_prompt"]
        if entropy is not None:  # none while the critic warms up
            self.first_entropy = entropy if self.first_entropy is None else self.first_entropy
            floor = limits.entropy_min_share * self.first_entropy
            conditions["entropy_collapse"] = (
                f"policy entropy {entropy:.3f} is below {limits.entropy_min_share:.0%} of the first iteration's "
                f"{self.first_entropy:.3f}"
                if entropy < floor
                else None
            )
        self.first_diversity = diversity if self.first_diversity is None else self.first_diversity
        conditions["sample_diversity_collapse"] = (
            f"distinct n-grams among a prompt's samples {diversity:.3f}, below {limits.diversity_min_share:.0%} of "
            f"the first iteration's {self.first_diversity:.3f}"
            if diversity < limits.diversity_min_share * self.first_diversity
            else None
        )
        self.recent_lengths = [*self.recent_lengths, metrics["ppo/response_length"]][-LENGTH_WINDOW:]
        self.first_length = self.recent_lengths[0] if self.first_length is None else self.first_length
        ratio = sum(self.recent_lengths) / len(self.recent_lengths) / max(self.first_length, 1e-9)
        conditions["rollout_length_growth"] = (
            f"sampled responses are {ratio:.2f}x the first iteration's length (limit {limits.length_ratio_max})"
            if ratio > limits.length_ratio_max
            else None
        )
        conditions["rollout_length_collapse"] = (
            f"sampled responses are {ratio:.2f}x the first iteration's length (limit {limits.length_ratio_min})"
            if ratio < limits.length_ratio_min
            else None
        )
        kl = metrics["ppo/kl_per_token"]
        conditions["kl_high"] = (
            f"rollout KL {kl:.4f} per token is above {limits.kl_per_token_max:g}"
            if kl > limits.kl_per_token_max
            else None
        )
        return self._raise(step, step - 1, conditions)

    def check_evaluation(self, step: int, metrics: dict[str, float]) -> list[Flag]:
        """:meth:`check` of the eval/* ``metrics`` of evaluation ``step``, against the mean rollout
        score since the previous one."""
        train_reward = sum(self.train_scores) / len(self.train_scores) if self.train_scores else None
        self.train_scores = []
        evaluation = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
        flags = self._raise(step, self.last_eval_step, self.check(evaluation, train_reward))
        self.last_eval_step = step
        return flags

    def check(self, evaluation: dict[str, float], train_reward: float | None) -> dict[str, str | None]:
        """The evaluation's conditions (kind -> message while it holds). ``evaluation``: the held-out
        metrics (engine/ppo/evaluation.py); ``train_reward``: the mean rollout score since the
        previous evaluation (None before the first iteration)."""
        limits, ratio = self.limits, evaluation["length_ratio"]
        repeated, distinct = evaluation["repeated_ngram_frac"], evaluation["distinct_ratio"]
        win_rate, last_win, last_reward = evaluation["win_rate"], self.last_win_rate, self.last_train_reward
        judge = evaluation.get("judge_win_rate")  # with a judge
        disagree = judge is not None and win_rate - judge > limits.judge_disagreement
        hacked = (
            train_reward is not None
            and last_reward is not None
            and last_win is not None
            and train_reward > last_reward
            and win_rate < last_win - limits.win_rate_drop
        )
        conditions = {
            "length_growth": f"responses are {ratio:.2f}x the reference's length (limit {limits.length_ratio_max})"
            if ratio > limits.length_ratio_max
            else None,
            "length_collapse": f"responses are {ratio:.2f}x the reference's length (limit {limits.length_ratio_min})"
            if ratio < limits.length_ratio_min
            else None,
            "repetition": f"{repeated:.1%} of response n-grams repeat (limit {limits.repeated_ngram_max:.0%})"
            if repeated > limits.repeated_ngram_max
            else None,
            "diversity_collapse": f"distinct n-grams across held-out responses are {distinct:.2f}x the reference's "
            f"(limit {limits.diversity_min_share})"
            if distinct < limits.diversity_min_share
            else None,
            "reward_up_win_rate_down": f"training reward rose {last_reward:.3f} -> {train_reward:.3f} while the "
            f"held-out win rate fell {last_win:.3f} -> {win_rate:.3f}"
            if hacked
            else None,
            "judge_disagrees": f"held-out win rate vs the reference {win_rate:.3f} under the run's score, {judge:.3f} "
            f"under the judge (limit {limits.judge_disagreement} apart)"
            if disagree
            else None,
        }
        if train_reward is not None:
            self.last_train_reward = train_reward
        self.last_win_rate = win_rate
        return conditions

    def summary(self) -> str | None:
        """``N reward-hacking flag(s): kind (iteration s), ...``, or None when none was raised."""
        if not self.raised:
            return None
        listed = ", ".join(f"{kind} (iteration {step})" for kind, step in self.raised)
        return f"{len(self.raised)} reward-hacking flag{'s' * (len(self.raised) > 1)}: {listed}"


def act_on_flags(flags: list[Flag], monitor: HackingMonitor, run: RunLifecycle, action: str) -> bool:
    """Log each flag as an event (``monitor/<kind>``; ``since``: where its band on the report's plots
    starts), then apply ``action`` (``monitors.action``): warn: nothing more; stop: a checkpoint and
    exit 3; rollback: back to the last good evaluation, the monitor re-armed. True after a rollback."""
    for flag in flags:
        run.event(flag.kind, flag.message, since=flag.since)
    if not flags or action == "warn":
        return False
    reason = "reward-hacking " + "; ".join(f"{f.kind}: {f.message}" for f in flags)
    if action == "stop":
        run.stop_with_checkpoint(reason)
    monitor.active = []
    run.roll_back(reason)
    return True
