"""What a PPO run checks and loads before any model does: the prompts that fit (with the columns
the rewards read), the actor's and reward model's tokenizers once their directories are found
usable, and the rewards section's components with their workers started and checked."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from engine.data.prompts import Prompt, load_prompts, prompts_that_fit
from engine.rewards.code_tests import check_column
from engine.rewards.components import RewardComponents, RewardsConfigError
from engine.run.launch import RunRefused
from engine.run.preflight import check_lora_targets, check_reward_model, check_vllm_can_run, load_tokenizer
from engine.run_config import PPOConfig


def load_fitting_prompts(path: str, tokenizer, cfg: PPOConfig, rank: int) -> list[Prompt]:
    """The prompts of ``path``, with the columns the rewards read (the code reward's tests must parse),
    that leave room for a response of rollout.max_new_tokens within a micro-batch and, with vLLM, its
    context (the others are dropped and counted)."""
    room = min(
        cfg.ppo.max_tokens_per_micro_batch, cfg.rollout.vllm_max_model_len if cfg.rollout.sampler == "vllm" else 1 << 62
    )
    prompts = load_prompts(path, cfg.rewards.fields())
    if cfg.rewards.code:
        check_column(path, cfg.rewards.code.field, [p.fields[cfg.rewards.code.field] for p in prompts])
    prompts, dropped = prompts_that_fit(prompts, tokenizer, room - cfg.rollout.max_new_tokens)
    if dropped and rank == 0:
        print(
            f"{path}: dropped {dropped} of {len(prompts) + dropped} prompts longer than "
            f"{room - cfg.rollout.max_new_tokens} tokens (the smaller of ppo.max_tokens_per_micro_batch and "
            "rollout.vllm_max_model_len, less rollout.max_new_tokens)"
        )
    return prompts


def check_models(cfg: PPOConfig) -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase | None]:
    """The actor's and the reward model's tokenizers, once the model directories are found usable
    (a trained reward model, LoRA targets that exist, a model vLLM can run), before any model loads."""
    tokenizer = load_tokenizer(cfg.actor.path, "actor.path", cfg.actor.trust_remote_code)
    rm_tokenizer = None
    if cfg.reward_model:
        rm_tokenizer = load_tokenizer(cfg.reward_model.path, "reward_model.path")
        check_reward_model(cfg.reward_model.path, "reward_model.path", cfg.reward_model.normalize)
    check_lora_targets(cfg.actor.path, "actor.lora", cfg.actor.lora, False, cfg.actor.trust_remote_code)
    check_lora_targets(cfg.critic_source().path, "critic.lora", cfg.critic.lora, True)
    if cfg.rollout.sampler == "vllm":
        check_vllm_can_run(cfg.actor.path, "actor.path", cfg.actor.trust_remote_code, cfg.rollout.tensor_parallel_size)
    return tokenizer, rm_tokenizer


def reward_components(cfg: PPOConfig) -> RewardComponents | None:
    """The rewards section's components, their worker pool started and checked (functions import and
    take their arguments, the server serves the components named), before any model loads."""
    if not cfg.rewards.weights():
        return None
    components = RewardComponents(cfg.rewards, cfg.rollout.max_new_tokens)
    try:
        components.check()
    except RewardsConfigError as e:
        components.close()
        raise RunRefused("config", f"{cfg._source}: {e}") from None
    return components
