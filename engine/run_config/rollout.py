"""The ``rollout`` section of train/train_ppo.py's config: how responses are sampled (the sampler,
its batch and limits, dynamic sampling, the async split, multi-turn episodes)."""

from __future__ import annotations

from typing import Literal

from engine.config import Config, ConfigError, option
from engine.run_config.environment import EnvironmentSection


class RolloutSection(Config):
    sampler: Literal["vllm", "hf"] = option("vllm", "colocated vLLM engine, or HF generate on the actor")
    prompts_per_iteration: int = option(16, "prompts per iteration, over all ranks", ge=1)
    samples_per_prompt: int = option(1, "responses sampled per prompt", ge=1)
    temperature: float = option(1.0, "sampling temperature", gt=0)
    top_p: float = option(
        1.0, "nucleus sampling threshold: 1 only (PPO's log-probs are the whole tempered distribution's)", gt=0, le=1
    )
    max_new_tokens: int = option(64, "response length limit", ge=1)
    dynamic_sampling: bool = option(
        False,
        "drop the prompts whose samples all score the same (no signal under grpo and rloo) and sample more prompts "
        "until the batch is full; groups found beyond it wait for the next iteration (DAPO's dynamic sampling)",
    )
    max_generation_rounds: int = option(
        4,
        "with dynamic_sampling: generation rounds per iteration at most; a batch still short is filled with dropped "
        "groups (ppo/filled_groups)",
        ge=1,
    )
    environment: EnvironmentSection | None = option(
        None, "multi-turn episodes: the policy's turns and an environment's observations (tool results)"
    )
    vllm_kv_cache_mb: int = option(128, "CPU: vLLM KV-cache size per rank", ge=1)
    vllm_max_model_len: int = option(1024, "vLLM context length (prompt + response)", ge=2)
    vllm_gpu_memory_utilization: float = option(
        0.4,
        "GPU: share of the GPU's memory vLLM takes (weights + KV cache); "
        "it must be free when vLLM starts, after the engines",
        gt=0,
        lt=1,
    )
    vllm_compile: bool = option(
        False,
        "compile vLLM's model (torch.compile; CUDA graphs on a GPU) instead of running it eagerly: faster "
        "generation steps after a compile when the engine starts (seconds; repeated starts read a cache)",
    )
    vllm_sleep: bool = option(
        True, "GPU: vLLM sleeps (weights to CPU, KV cache freed) from each rollout until the next sync"
    )
    tensor_parallel_size: int = option(
        1,
        "ranks that share one vLLM engine, each holding a shard (colocated: groups of consecutive ranks, "
        "dividing the world size; mode async: the generating ranks)",
        ge=1,
    )
    mode: Literal["colocated", "async"] = option(
        "colocated",
        "colocated: every rank generates, then every rank trains; async: the last tensor_parallel_size ranks only "
        "generate (one vLLM engine) while the others only train, each batch generated up to max_staleness policy "
        "versions ahead",
    )
    max_staleness: int = option(
        1,
        "with mode async: the batch of iteration t is generated with the weights after iteration t - max_staleness "
        "(0: after the last update, no overlap)",
        ge=0,
    )
    sync_check_every: int = option(
        5,
        "with mode async: every N iterations (the first included) vLLM re-scores 2 of each training rank's sequences "
        "with the weights it holds, which the actor had when it scored them",
        ge=1,
    )
    sync_check_tolerance: float = option(
        0.01,
        "the largest mean per-token |sampler - actor| log-prob gap: of that check with mode async; colocated, of each "
        "iteration's ppo/sampler_logprob_gap (over the samples drawn in that iteration, not dynamic sampling's groups "
        "that waited from an earlier one). "
        "Above it the run stops (checkpoint, exit 2). fp32 gaps are ~1e-7, bf16 with HF generate on a GPU 2e-5 (vLLM "
        "on CUDA not yet measured); a head left stale by a broken sync measured 0.12",
        gt=0,
    )

    def check(self) -> None:
        if self.top_p < 1:
            raise ConfigError(
                f"'top_p' {self.top_p:g}: PPO's log-probs, KL and importance weights are those of the tempered "
                "distribution over the whole vocabulary, which nucleus sampling does not sample from; set 1 and "
                "sharpen with 'temperature'"
            )
        if self.mode == "async" and (self.sampler != "vllm" or self.dynamic_sampling):
            raise ConfigError(
                "'mode' async runs one vLLM engine on ranks of its own: it needs sampler vllm and no dynamic_sampling"
            )
        if self.tensor_parallel_size > 1 and self.sampler != "vllm":
            raise ConfigError(
                f"'tensor_parallel_size' {self.tensor_parallel_size} needs sampler vllm "
                "(HF generate runs on the actor engine)"
            )
        if self.sampler == "vllm" and self.max_new_tokens >= self.vllm_max_model_len:
            raise ConfigError(
                f"'max_new_tokens' ({self.max_new_tokens}) must be below vllm_max_model_len "
                f"({self.vllm_max_model_len}), which also holds the prompt"
            )
