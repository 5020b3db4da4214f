"""The sequence score PPO maximises: the reward model's normalised total (if the run has one) plus
the weighted components of ``rewards`` (engine/rewards/components.py), a no-EOS penalty, clipped.

    score = rm.weight * (sum_c w_c * head_c - mean) / std + sum_k weight_k * component_k
            + no_eos_penalty * [cut at max_new_tokens],   clipped to [-clip, clip]
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from engine.data.chat import tokenize_pairs
from engine.data.packing import last_token, packed_forward
from engine.data.prompts import Prompt
from engine.ppo.forwards import map_micro_batches
from engine.rewards.components import ComponentScores, RewardComponents, RewardsUnavailable, ScoringBatch
from engine.rollout.sampler import Sample
from engine.run.distributed import all_reduce
from engine.run_config.rewards import RewardModelSection, RewardsSection


class RewardModelScorer:
    """The frozen reward model's heads and their normalised, weighted total."""

    def __init__(
        self,
        model,
        tokenizer: PreTrainedTokenizerBase,
        section: RewardModelSection,
        max_tokens: int,
        share_prompts: bool = True,
    ):
        self.model, self.tokenizer, self.section = model, tokenizer, section
        hf = getattr(model, "module", model)
        self.heads = [hf.config.id2label[i] for i in sorted(hf.config.id2label)]
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

    @torch.no_grad()
    def score(self, prompts: Sequence[list[dict[str, str]]], responses: Sequence[str]) -> torch.Tensor:
        """(B, C) head values. The RM reads conversations rendered exactly as in its training (the
        response as a closed assistant turn), whatever tokens the policy produced around it."""
        prompt_ids, full = tokenize_pairs(self.tokenizer, prompts, responses)
        per_seq = map_micro_batches(
            self.model,
            full,
            [len(p) for p in prompt_ids],
            self.max_tokens,
            self.tokenizer.pad_token_id,
            self.share_prompts,
            lambda packed, _: list(last_token(packed_forward(self.model, packed), packed).float()),
        )
        return torch.stack(per_seq)

    def total(self, heads: torch.Tensor) -> torch.Tensor:
        """(B,) the weighted heads, standardised, times reward_model.weight."""
        return self.section.weight * ((heads * self.weights).sum(-1) - self.mean) / self.std


class RewardScorer:
    """Scores responses on every rank: reward model (optional) + components + no-EOS penalty."""

    def __init__(
        self, reward_model: RewardModelScorer | None, components: RewardComponents | None, rewards: RewardsSection
    ):
        self.reward_model, self.components, self.rewards = reward_model, components, rewards

    def score(
        self,
        prompts: Sequence[list[dict[str, str]]],
        responses: Sequence[str],
        finished: Sequence[bool],
        response_tokens: Sequence[int],
        fields: Sequence[dict[str, Any]],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B,) scores and their parts for logging: ``reward/<name>`` per response, and per component
        of ``rewards`` the share of responses whose call failed (``reward/<name>/errors``,
        ``/timeouts``). A collective: every rank calls it. :class:`RewardsUnavailable` on every rank
        when a component fails on more than ``rewards.max_failure_share`` of the responses (all
        ranks counted) or the reward server stays down on any rank."""
        total = torch.zeros(len(responses))
        parts: dict[str, torch.Tensor] = {}
        if self.reward_model is not None:
            heads = self.reward_model.score(prompts, responses)  # (B, C)
            parts |= {f"reward/rm_{c}": heads[:, i] for i, c in enumerate(self.reward_model.heads)}
            total = total + self.reward_model.total(heads)
        scores = self._components(ScoringBatch(prompts, responses, response_tokens, fields))
        for name, s in scores.items():
            parts[f"reward/{name}"] = s.values
            total = total + self.components.weights[name] * s.values  # type: ignore[union-attr]
        for name, s in scores.items():
            if name != "length":
                parts[f"reward/{name}/errors"] = torch.full((len(responses),), s.errors / max(len(responses), 1))
                parts[f"reward/{name}/timeouts"] = torch.full((len(responses),), s.timeouts / max(len(responses), 1))
        total = total + self.rewards.no_eos_penalty * (~torch.tensor(list(finished), dtype=torch.bool)).float()
        return total.clamp(-self.rewards.clip, self.rewards.clip), parts

    def score_samples(
        self, samples: Sequence[Sample], prompts: Sequence[Prompt], tokenizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`score` of sampled responses (``prompts[i]``: sample i's prompt, with its fields)."""
        return self.score(
            [p.messages for p in prompts],
            [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples],
            [s.finished for s in samples],
            [len(s.response_ids) for s in samples],
            [p.fields for p in prompts],
        )

    def _components(self, batch: ScoringBatch) -> dict[str, ComponentScores]:
        """The components' scores, once every rank knows none of them is unavailable."""
        if self.components is None:
            return {}
        names = self.components.names
        server_down, scores = "", {}
        try:
            scores = self.components.score(batch)
        except RewardsUnavailable as e:
            server_down = str(e)
        failures = [float(bool(server_down))] + [
            float(scores[n].errors + scores[n].timeouts) if scores else 0.0 for n in names
        ]
        counts = all_reduce(torch.tensor([*failures, float(len(batch.responses))], dtype=torch.float64)).tolist()
        if counts[0]:
            raise RewardsUnavailable(server_down or "the reward server is unavailable on another rank")
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
