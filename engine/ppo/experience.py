"""Turning sampled responses into PPO training data: log-probs, values, rewards, advantages
(:func:`make_experience`), and where the old log-probs come from (:class:`OldLogprobSource`).

Everything here runs on one rank's samples; forwards go through packed, token-budget
micro-batches whose count every rank agrees on (engine/ppo/forwards.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.data.response_tokens import kl_penalty
from engine.ppo.distill import TeacherLogprobs, distill_stats, teacher_logprobs, with_distillation
from engine.ppo.forwards import pad_right, sequence_logprobs, sequence_values
from engine.ppo.losses import estimate_advantages, token_rewards
from engine.ppo.monitors import within_prompt_diversity
from engine.ppo.rollout_correction import policy_loss_weights
from engine.ppo.settings import ExperienceSettings

if TYPE_CHECKING:
    from engine.ppo.collect import Rollout
    from engine.ppo.engines import HybridEngine
    from engine.rollout.sampler import Sample


@dataclass
class Experience:
    """One rank's rollout batch, response tokens right-padded to T. mask True where a token counts."""

    sequences: list[list[int]]  # prompt + response ids (actor tokenizer)
    prompt_lens: list[int]
    mask: torch.Tensor  # (B, T) bool
    old_logprobs: torch.Tensor  # (B, T) actor log-probs at sampling time
    ref_logprobs: torch.Tensor  # (B, T)
    old_values: torch.Tensor  # (B, T) critic values at sampling time (zeros without a critic)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) final sequence score (reward model + reward components + penalties)
    kl: torch.Tensor  # (B, T) per-token KL estimate vs the reference
    is_weights: torch.Tensor  # (B, T) weight of each token's policy loss (the mask without ppo.rollout_correction)
    rewards: torch.Tensor  # (B, T) token rewards: the score on the last token, minus the KL penalty on every token
    teacher: TeacherLogprobs | None = None  # the distill section's teacher (None without one)

    def select(self, rows: Sequence[int]) -> Experience:
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Experience(
            sequences=[self.sequences[i] for i in rows],
            prompt_lens=[self.prompt_lens[i] for i in rows],
            teacher=None if self.teacher is None else self.teacher.select(idx),
            **{
                f: getattr(self, f)[idx]
                for f in (
                    "mask",
                    "old_logprobs",
                    "ref_logprobs",
                    "old_values",
                    "advantages",
                    "returns",
                    "scores",
                    "kl",
                    "is_weights",
                    "rewards",
                )
            },
        )


def sampled_token_mask(samples: Sequence[Sample], T: int) -> torch.Tensor:
    """(B, T) True at the response tokens the policy sampled: not at a multi-turn episode's
    observations (engine/environments/episodes.py), nor at the right padding."""
    rows = []
    for s in samples:
        row = torch.ones(len(s.response_ids), dtype=torch.bool)
        for start, end in s.observations:
            row[start:end] = False
        rows.append(row)
    return pad_right(rows, T)


@torch.no_grad()
def make_experience(
    rollout: Rollout,
    engines: HybridEngine,
    pad_token_id: int,
    settings: ExperienceSettings,
    *,
    kl_coef: float,
    old_logprobs_from_sampler: bool,
) -> tuple[Experience, dict[str, float]]:
    """One rank's scored samples (engine/ppo/collect.py) as experience.

    Up to three forwards in packed micro-batches of at most ``settings.max_tokens``: actor and
    reference log-probs (both of softmax(logits / ``settings.temperature``), the distribution the
    rollout sampled from), critic values (``engines.critic`` None: a critic-free estimator, no
    forward); then the per-token KL to the reference (``kl_coef`` 0: none in the reward) and the
    advantages (:func:`engine.ppo.losses.estimate_advantages`; whitening over all ranks; the
    samples of a prompt, ``settings.group_size`` of them, are contiguous). ``old_logprobs_from_sampler``:
    the samples' own log-probs stand in for the actor's forward (:class:`OldLogprobSource`), and the
    sampler-actor gap is not measured. ``settings.rollout_correction``: weight each token's policy loss by
    the importance ratio of the actor's over the sampler's log-probs, truncated or masked
    (engine/ppo/rollout_correction.py).
    ``settings.distill``: a fourth forward, the teacher's log-probs (engine/ppo/distill.py), and in
    reverse_kl mode each token's reverse-KL advantage added to the estimator's. ``rollout.on_policy``
    False (the dataset's responses, engine/ppo/dataset_responses.py): every advantage 0 (GKD's term
    alone trains), no sampler log-probs (the rollout correction's weights 1, no gap measured).
    ``settings.share_prompts``: the samples of a prompt compute it once in each forward (where the
    model's attention allows).
    ``settings.values_from_update``: no critic forward here; the first critic step computes the
    values on the same weights and fills in values, advantages and returns
    (engine/ppo/update.update_on_rollout), zeros until then.
    Returns the experience and this rank's rollout statistics (means over its samples).
    """
    samples, scores = rollout.samples, rollout.scores  # (B,) scores
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    T = max(len(s.response_ids) for s in samples)
    mask = sampled_token_mask(samples, T)  # (B, T)
    sampler_logprobs = pad_right([torch.tensor(s.logprobs) for s in samples], T)  # (B, T)
    forward: dict[str, Any] = dict(
        max_tokens=settings.max_tokens, pad_token_id=pad_token_id, share_prompts=settings.share_prompts
    )
    tempered = forward | {"temperature": settings.temperature}  # the distributions the samples were drawn from
    old_logprobs = (
        sampler_logprobs
        if old_logprobs_from_sampler
        else pad_right(sequence_logprobs(engines.actor, sequences, prompt_lens, **tempered), T)
    )  # (B, T)
    ref_logprobs = pad_right(sequence_logprobs(engines.ref, sequences, prompt_lens, **tempered), T)  # (B, T)
    values = (
        pad_right(sequence_values(engines.critic, sequences, prompt_lens, settings.value_readout, **forward), T)
        if engines.critic is not None and not settings.values_from_update
        else torch.zeros(len(samples), T)
    )  # (B, T)
    teacher = (
        teacher_logprobs(engines.teacher, sequences, prompt_lens, settings.distill, T, **tempered)
        if settings.distill is not None
        else None
    )
    kl = kl_penalty(old_logprobs, ref_logprobs, settings.kl_estimator) * mask
    rewards = token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = (
        (torch.zeros_like(rewards), torch.zeros_like(rewards))
        if settings.values_from_update
        else estimate_advantages(
            settings.advantage_estimator,
            rewards,
            values,
            mask,
            settings.gae.gamma,
            settings.gae.lam,
            settings.group_size,
            settings.gae.whiten,
            group=torch.distributed.group.WORLD,
            grpo_std_scaling=settings.grpo_std_scaling,
        )
    )
    advantages = with_distillation(advantages, old_logprobs, teacher, mask, settings.distill)
    if not rollout.on_policy:  # the dataset's responses (distill.lmbda < 1): no sampler, no policy gradient
        sampler_logprobs, advantages = old_logprobs, torch.zeros_like(advantages)
    is_weights, correction_stats = policy_loss_weights(
        settings.rollout_correction, old_logprobs, sampler_logprobs, mask
    )  # (B, T)
    exp = Experience(
        sequences,
        prompt_lens,
        mask & torch.tensor([s.finished for s in samples])[:, None] if settings.mask_truncated else mask,
        old_logprobs,
        ref_logprobs,
        values,
        advantages,
        returns,
        scores,
        kl,
        is_weights,
        rewards,
        teacher,
    )
    stats = {
        "score": scores.mean().item(),
        "kl": kl.sum(1).mean().item(),  # per sequence
        "response_length": mask.sum(1).float().mean().item(),
        "finished": sum(s.finished for s in samples) / len(samples),
        "distinct_within_prompt": within_prompt_diversity(
            [s.response_ids for s in samples], settings.group_size, settings.distinct_n
        ),
        **{k: v.mean().item() for k, v in rollout.parts.items()},
        **correction_stats,
        **(distill_stats(old_logprobs, teacher, mask) if teacher is not None else {}),
    }
    episodes = [s.episode for s in samples if s.episode is not None]
    if episodes:  # multi-turn: the policy's turns and the share of response tokens that are observations
        stats["turns"] = sum(e.turns for e in episodes) / len(episodes)
        stats["observation_share"] = 1 - mask.sum().item() / max(sum(len(s.response_ids) for s in samples), 1)
    if not old_logprobs_from_sampler and rollout.on_policy:  # over the samples of the last sync's weights
        now = slice(rollout.earlier, None)
        stats["sampler_gap_sum"] = ((sampler_logprobs - old_logprobs)[now].abs() * mask[now]).sum().item()
        stats["sampler_gap_tokens"] = mask[now].sum().item()
    return exp, stats


class OldLogprobSource:
    """Where PPO's old log-probs come from (``ppo.old_logprobs_from``): ``actor`` recomputes them
    in an experience forward; ``sampler`` takes the sampler's own, exact when its weights are the
    actor's in fp32 (the gap is ~1e-7), which saves that forward. The shortcut checks itself:
    every ``check_every`` iterations, the first included, both are computed, and a mean gap
    above ``tolerance`` turns it off for the rest of the run. Checkpointed, so a resume decides
    as the straight run did."""

    def __init__(self, source: str, check_every: int, tolerance: float):
        self.on, self.check_every, self.tolerance = source == "sampler", check_every, tolerance

    def use_sampler(self, iteration: int) -> bool:
        """Whether 0-based ``iteration`` takes the sampler's log-probs (else the actor's)."""
        return self.on and iteration % self.check_every != 0

    def observe(self, gap: float | None) -> str | None:
        """After an iteration that measured the gap: the message when it turns the shortcut off."""
        if not self.on or gap is None or gap <= self.tolerance:
            return None
        self.on = False
        return (
            f"sampler log-prob gap {gap:.2e} is above ppo.sampler_logprob_tolerance {self.tolerance:g}: "
            "old log-probs come from the actor's forward from now on"
        )

    def state_dict(self) -> dict:
        return {"on": self.on}

    def load_state_dict(self, state: dict) -> None:
        self.on = state["on"]
