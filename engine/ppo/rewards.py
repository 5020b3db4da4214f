"""The sequence score PPO maximises: reward-model components, rules, penalties, normalisation."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.data.chat import tokenize_pairs
from engine.data.packing import last_token, packed_forward
from engine.ppo.forwards import map_micro_batches

Rule = Callable[[list[dict[str, str]], str], float]


def load_rule(spec: str) -> Rule:
    """``"package.module:function"`` -> the function ``f(prompt_messages, response_text) -> float``."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"reward rule {spec!r} must look like 'module:function'")
    return getattr(importlib.import_module(module_name), function_name)


class RewardScorer:
    """Scores responses with the frozen reward model (plus rule components) on every rank."""

    def __init__(
        self,
        reward_model,
        tokenizer: PreTrainedTokenizerBase,
        model_dir: str,
        normalize: bool,
        clip: float,
        rules: dict[str, float],
        no_eos_penalty: float,
        max_tokens: int,
        share_prompts: bool = True,
    ):
        self.model, self.tokenizer = reward_model, tokenizer
        hf = getattr(reward_model, "module", reward_model)
        self.components = [hf.config.id2label[i] for i in sorted(hf.config.id2label)]
        stats_path = os.path.join(model_dir, "reward_stats.json")
        stats: dict[str, Any] = {}
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                stats = json.load(f)
        if normalize and not stats:
            raise ValueError(f"{stats_path} not found: train_rm.py writes it; set reward_model.normalize false to skip")
        weights = stats.get("weights", dict.fromkeys(self.components, 1.0))
        self.weights = torch.tensor([weights[c] for c in self.components])
        self.mean: float
        self.std: float
        self.mean, self.std = (stats["mean"], stats["std"]) if normalize else (0.0, 1.0)
        self.clip, self.no_eos_penalty, self.max_tokens = clip, no_eos_penalty, max_tokens
        self.share_prompts = share_prompts  # a prompt's responses read it once
        self.rules = {spec: (load_rule(spec), weight) for spec, weight in rules.items()}

    @torch.no_grad()
    def score(
        self, prompts: Sequence[list[dict[str, str]]], responses: Sequence[str], finished: Sequence[bool]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B,) scores and their parts (per RM component, per rule) for logging."""
        # The RM reads conversations rendered exactly as in its training (the response as a
        # closed assistant turn), whatever tokens the policy produced around it.
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
        components = torch.stack(per_seq)  # (B, C)
        total = ((components * self.weights).sum(-1) - self.mean) / self.std
        parts = {f"rm_{c}": components[:, i] for i, c in enumerate(self.components)}
        for spec, (rule, weight) in self.rules.items():
            values = torch.tensor([float(rule(p, r)) for p, r in zip(prompts, responses)])
            parts[f"rule_{spec}"] = values
            total = total + weight * values
        total = total + self.no_eos_penalty * (~torch.tensor(list(finished), dtype=torch.bool)).float()
        return total.clamp(-self.clip, self.clip), parts
