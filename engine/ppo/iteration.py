"""One PPO iteration on this rank's share (:class:`PPOIteration`): collect (generate and score,
engine/ppo/collect.py) -> make experience -> PPO epochs -> sync the sampler."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from engine.environments.episodes import episode_metrics
from engine.ppo.collect import RolloutCollector
from engine.ppo.engines import HybridEngine
from engine.ppo.experience import make_experience
from engine.ppo.forwards import sequence_logprobs
from engine.ppo.settings import ExperienceSettings, UpdateSettings
from engine.ppo.update import update_on_rollout
from engine.rollout.sampler import Sampler
from engine.run import faults
from engine.run.distributed import accelerator_memory_metrics, mean_over_ranks


class IterationSettings(NamedTuple):
    """How the next iteration runs (:meth:`PPOIteration.run`; engine/ppo/controls.py decides it)."""

    kl_coef: float  # of the KL penalty in the reward (0 without it)
    old_from_sampler: bool  # the old log-probs are the sampler's
    train_actor: bool  # False during the critic's warm-up
    after_step: Callable[[object, str], None]  # after each optimizer step: the non-finite guard


class IterationResult(NamedTuple):
    """What an iteration measured: the figures the run steers by, and every metric to log."""

    kl_per_token: float  # mean over the ranks' responses
    sampler_logprob_gap: float | None  # per token, when the old log-probs were the actor's (a sync check)
    # ppo/* (rollout statistics averaged over the ranks), reward/*, distill/*, timing/*, memory/*
    metrics: dict[str, float]


@dataclass(frozen=True)
class PPOIteration:
    """The parts an iteration runs: the collector (with the sampler it draws from), the engines and
    the experience and update settings."""

    collector: RolloutCollector
    sampler: Sampler
    engines: HybridEngine
    pad_token_id: int
    experience: ExperienceSettings
    update: UpdateSettings

    def run(self, iteration: int, settings: IterationSettings) -> IterationResult:
        """Collect -> make experience -> PPO epochs -> sync the sampler (unless the actor is not trained:
        the critic's warm-up), as ``settings`` say."""
        engines, experience = self.engines, self.experience
        t0 = time.perf_counter()
        collected = self.collector.collect()
        faults.kill_in_iteration(iteration + 1)  # 1-based, as logged
        t1 = time.perf_counter()
        exp, rollout_stats = make_experience(
            collected.rollout,
            engines,
            self.pad_token_id,
            experience,
            kl_coef=settings.kl_coef,
            old_logprobs_from_sampler=settings.old_from_sampler,
        )
        actor_logprobs = partial(
            sequence_logprobs,
            engines.actor,
            max_tokens=experience.max_tokens,
            pad_token_id=self.pad_token_id,
            share_prompts=experience.share_prompts,
        )  # untempered: what a sync check compares with vLLM's prompt log-probs
        self.sampler.after_experience(iteration, exp.sequences, exp.prompt_lens, actor_logprobs)
        t2 = time.perf_counter()
        train_stats = update_on_rollout(
            engines.actor,
            engines.critic,
            exp,
            self.update,
            iteration=iteration,
            train_actor=settings.train_actor,
            after_step=settings.after_step,
        )
        t3 = time.perf_counter()
        if settings.train_actor:
            self.sampler.sync_weights(engines.actor)
        t4 = time.perf_counter()
        rollout_stats = mean_over_ranks(rollout_stats | self.sampler.take_metrics())
        rollout_stats["kl_per_token"] = rollout_stats["kl"] / max(rollout_stats["response_length"], 1.0)
        gap_sum, gap_tokens = rollout_stats.pop("sampler_gap_sum", 0.0), rollout_stats.pop("sampler_gap_tokens", 0.0)
        if gap_tokens > 0:  # per token over every rank's samples of the last sync's weights
            rollout_stats["sampler_logprob_gap"] = gap_sum / gap_tokens
        ppo = rollout_stats | collected.stats | train_stats
        samples = collected.rollout.samples
        if samples[0].episode is not None:  # every rank's samples are episodes, or none are (the config's)
            ppo |= episode_metrics(samples)
        metrics = (
            {k if k.startswith(("reward/", "distill/", "environment/")) else f"ppo/{k}": v for k, v in ppo.items()}
            | {
                "timing/generate_s": collected.generate_s,
                "timing/rollout_wait_s": collected.wait_s,
                "timing/score_s": collected.score_s,
                "timing/make_experience_s": t2 - t1,
                "timing/train_s": t3 - t2,
                "timing/sync_s": t4 - t3,
                "timing/iteration_s": t4 - t0,
                "timing/generated_tokens_per_s": collected.generated_tokens / collected.generate_s
                if collected.generate_s
                else 0.0,  # an iteration of the dataset's responses (distill.lmbda < 1) generates none
            }
            | accelerator_memory_metrics()
        )
        return IterationResult(rollout_stats["kl_per_token"], rollout_stats.get("sampler_logprob_gap"), metrics)
