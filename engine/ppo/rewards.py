"""The sequence score PPO maximises: the reward model's normalised total (if the run has one) plus
the weighted components of ``rewards`` (engine/rewards/components.py), a no-EOS penalty, clipped.

    score = rm.weight * (sum_c w_c * head_c - mean) / std + sum_k weight_k * component_k
            + no_eos_penalty * [cut at max_new_tokens],   clipped to [-clip, clip]

With ``reward_model.length_debias`` the reward model's term loses its linear trend on length first
(:func:`length_debiased`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from engine.data.chat import (
    Message,
    closing_ids,
    content_ids,
    sampled_conversation,
    shares_template,
    tokenize_pairs,
)
from engine.data.prompts import Prompt
from engine.environments.episodes import episode_scores
from engine.ppo.forwards import ValueReadout
from engine.rewards.components import ComponentScores, RewardComponents, RewardsUnavailable, ScoringBatch
from engine.rewards.reward_model import head_names, reward_model_heads
from engine.rollout.sampler import Sample
from engine.run.distributed import all_reduce, first_reason
from engine.run_config.environment import EnvironmentSection
from engine.run_config.rewards import RewardModelSection, RewardsSection


class SampledResponses(NamedTuple):
    """Responses to score: the ids the policy sampled and their text, decoded once (what the
    components, the reward server and a reward model with another tokenizer read)."""

    prompts: Sequence[list[Message]]  # each response's prompt messages
    samples: Sequence[Sample]  # prompt ids, response ids, whether it ended with EOS
    texts: Sequence[str]
    fields: Sequence[dict[str, Any]]  # each response's prompt-data row (the columns the rewards read)

    @classmethod
    def decode(
        cls, prompts: Sequence[Prompt], samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase
    ) -> SampledResponses:
        """``samples[i]`` sampled from ``prompts[i]``, decoded with the policy's ``tokenizer``."""
        texts = [str(tokenizer.decode(s.response_ids, skip_special_tokens=True)) for s in samples]
        return cls([p.messages for p in prompts], samples, texts, [p.fields for p in prompts])


class RewardModelScorer:
    """The frozen reward model's heads and their normalised, weighted total.

    A reward model that shares the policy's tokenizer and chat template reads the prompt's sampled
    ids, the response's content ids and the template's closing (:func:`engine.data.chat.sampled_conversation`:
    the layout of its training pairs, no re-rendering); one with another tokenizer or template reads
    the decoded text rendered through its own template."""

    def __init__(
        self,
        model,
        tokenizer: PreTrainedTokenizerBase,
        section: RewardModelSection,
        max_tokens: int,
        share_prompts: bool = True,
        policy_tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        self.model, self.tokenizer, self.section = model, tokenizer, section
        reads_ids = policy_tokenizer is not None and shares_template(policy_tokenizer, tokenizer)
        self.closing = closing_ids(tokenizer) if reads_ids else None  # None: it reads re-rendered text
        self.heads = head_names(model)
        stats_path = os.path.join(section.path, "reward_stats.json")
        stats: dict[str, Any] = {}
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                stats = json.load(f)
        if section.normalize and not stats:
            raise ValueError(f"{stats_path} not found: train_rm.py writes it; set reward_model.normalize false to skip")
        weights = stats.get("weights", dict.fromkeys(self.heads, 1.0))
        self.weights = torch.tensor([weights[c] for c in self.heads])  # (C,)
        self.mean, self.std = (float(stats["mean"]), float(stats["std"])) if section.normalize else (0.0, 1.0)
        self.max_tokens, self.share_prompts = max_tokens, share_prompts  # a prompt's responses read it once

    def inputs(self, responses: SampledResponses) -> tuple[list[list[int]], list[int]]:
        """The ids the reward model reads of each response, and its prompt's length."""
        if self.closing is not None:
            contents = content_ids(self.tokenizer, responses.texts)
            full = [sampled_conversation(s.prompt_ids, c, self.closing) for s, c in zip(responses.samples, contents)]
            return full, [len(s.prompt_ids) for s in responses.samples]
        prompt_ids, full = tokenize_pairs(self.tokenizer, responses.prompts, responses.texts)
        return full, [len(p) for p in prompt_ids]

    def score(self, responses: SampledResponses) -> torch.Tensor:
        """(B, C) head values, read at the last token of :meth:`inputs` as in the reward model's training."""
        full, prompt_lens = self.inputs(responses)
        pad_id = self.tokenizer.pad_token_id
        return reward_model_heads(self.model, full, prompt_lens, self.max_tokens, self.share_prompts, pad_id)

    def total(self, heads: torch.Tensor) -> torch.Tensor:
        """(B,) the weighted heads, standardised, times reward_model.weight."""
        return self.readout()(heads)

    def readout(self) -> ValueReadout:
        """The reward model's term of the reward as a linear readout of its heads (weighted,
        standardised, times reward_model.weight): :meth:`total`, and the value of a critic that
        starts from the reward model, so that it starts on the reward's scale."""
        scale = self.section.weight / self.std
        return ValueReadout(self.weights * scale, -self.mean * scale)


def length_debiased(scores: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``scores - b * (lengths - mean length)`` and ``b``, the least-squares slope of the scores on
    the lengths over the batch of every rank (a collective).

    The length-controlled correction of Dubois et al. 2024 ("Length-Controlled AlpacaEval"), applied
    to the rollout's reward as ODIN (Chen et al. 2024) removes the length component from a reward
    model: what the reward model prefers beyond a longer answer stays, its average preference for
    length within the batch goes. ``scores``, ``lengths``: (B,) on this rank. Returns (B,), slope.
    """
    x, y = lengths.double(), scores.double()
    sums = all_reduce(torch.stack([torch.ones_like(x).sum(), x.sum(), y.sum(), (x * x).sum(), (x * y).sum()]))
    mean_x, mean_y, mean_xx, mean_xy = (sums[1:] / sums[0].clamp(min=1.0)).tolist()
    var_x = mean_xx - mean_x**2
    slope = (mean_xy - mean_x * mean_y) / var_x if var_x > 1e-12 else 0.0  # one length throughout: no slope
    return (y - slope * (x - mean_x)).to(scores.dtype), slope


class RewardScorer:
    """Scores responses on every rank: reward model (optional) + components + no-EOS penalty."""

    def __init__(
        self,
        reward_model: RewardModelScorer | None,
        components: RewardComponents | None,
        rewards: RewardsSection,
        environment: EnvironmentSection | None = None,
    ):
        """``environment``: a multi-turn run's, whose episodes' summed rewards are the component
        ``environment`` (engine/environments/episodes.episode_scores)."""
        self.reward_model, self.components, self.rewards, self.environment = (
            reward_model,
            components,
            rewards,
            environment,
        )
        self.weights = (components.weights if components else {}) | (
            {"environment": environment.weight} if environment else {}
        )

    def score(self, responses: SampledResponses) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B,) scores and their parts for logging: ``reward/<name>`` per response, and per component
        of ``rewards`` the share of responses whose call failed (``reward/<name>/errors``,
        ``/timeouts``). A collective: every rank calls it. :class:`RewardsUnavailable` on every rank
        when a component fails on more than ``rewards.max_failure_share`` of the responses (all
        ranks counted) or the reward server stays down on any rank."""
        samples = responses.samples
        total = torch.zeros(len(samples))
        parts: dict[str, torch.Tensor] = {}
        lengths = [s.sampled_length for s in samples]  # the policy's tokens: observations out
        if self.reward_model is not None:
            heads = self.reward_model.score(responses)  # (B, C)
            parts |= {f"reward/rm_{c}": heads[:, i] for i, c in enumerate(self.reward_model.heads)}
            rm_total = self.reward_model.total(heads)
            if self.reward_model.section.length_debias:
                rm_total, slope = length_debiased(rm_total, torch.tensor(lengths, dtype=torch.float64))
                parts["reward/rm_length_slope"] = torch.full((len(samples),), slope)
            total = total + rm_total
        scores = self._components(ScoringBatch(responses.prompts, responses.texts, lengths, responses.fields), samples)
        for name, s in scores.items():
            parts[f"reward/{name}"] = s.values
            total = total + self.weights[name] * s.values
        for name, s in scores.items():
            if name != "length":
                parts[f"reward/{name}/errors"] = torch.full((len(samples),), s.errors / max(len(samples), 1))
                parts[f"reward/{name}/timeouts"] = torch.full((len(samples),), s.timeouts / max(len(samples), 1))
        unfinished = (~torch.tensor([s.finished for s in samples], dtype=torch.bool)).float()
        total = total + self.rewards.no_eos_penalty * unfinished
        return total.clamp(-self.rewards.clip, self.rewards.clip), parts

    def _components(self, batch: ScoringBatch, samples: Sequence[Sample]) -> dict[str, ComponentScores]:
        """The components' scores (the environment's too), once every rank knows none of them is unavailable."""
        names = list(self.weights)
        server_down, scores = "", {}
        if self.components is not None:
            try:
                scores = self.components.score(batch)
            except RewardsUnavailable as e:
                server_down = str(e)
        if self.environment is not None:
            scores["environment"] = episode_scores(samples, self.environment.fallback)
        failures = [float(bool(server_down))] + [
            float(scores[n].errors + scores[n].timeouts) if n in scores else 0.0 for n in names
        ]
        counts = all_reduce(torch.tensor([*failures, float(len(batch.responses))], dtype=torch.float64)).tolist()
        if counts[0]:  # every rank stops with the same reason, whichever rank's server call failed
            raise RewardsUnavailable(first_reason(server_down))
        for name, failed in zip(names, counts[1:-1]):
            share = failed / max(counts[-1], 1.0)
            if share > self.rewards.max_failure_share:
                first = scores[name].first_error or "(on another rank)\n"
                raise RewardsUnavailable(
                    f"reward component '{name}' failed on {share:.0%} of the responses, more than "
                    f"rewards.max_failure_share {self.rewards.max_failure_share:g}; its first error:\n{first.rstrip()}"
                )
        return scores

    def close(self) -> None:
        if self.components is not None:
            self.components.close()


class Scorers(NamedTuple):
    """The run's score, and the judge's: held-out scores the policy is not trained on."""

    run: RewardScorer
    judge: RewardScorer | None

    def close(self) -> None:
        for scorer in self:
            if scorer is not None:
                scorer.close()
