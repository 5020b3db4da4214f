"""The models of a PPO run: its DeepSpeed engines in one process group
(:func:`build_hybrid_engine`), and the sampler built after them (:func:`build_sampler`).

Which models a run has, and where the critic starts, is the config's to say
(:meth:`engine.run_config.PPOConfig.has_critic`, :meth:`~engine.run_config.PPOConfig.critic_source`);
the dry run (engine/run/dry_run.py) prices the same models.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from engine.models.deepspeed_glue import (
    frozen_engine,
    inference_ds_config,
    initialize_training_engine,
    load_partitioned,
)
from engine.models.loading import load_causal_lm, load_value_model
from engine.models.lora import ReferenceView, add_adapters
from engine.ppo.forwards import ValueReadout
from engine.ppo.inputs import Tokenizers
from engine.ppo.rewards import RewardModelScorer, RewardScorer, Scorers
from engine.rewards.components import RewardComponents
from engine.rollout.remote import RemoteSampler, RolloutLink
from engine.rollout.sampler import HFSampler, Sampler
from engine.rollout.vllm_sampler import VLLMSampler
from engine.run.distributed import SplitWorld
from engine.run_config import PPOConfig
from engine.run_config.rewards import RewardsSection


class HybridEngine(NamedTuple):
    """The models of a PPO run as DeepSpeed engines in one process group."""

    actor: Any  # trained
    critic: Any  # trained; None with a critic-free advantage estimator
    ref: Any  # frozen: the actor's starting weights (LoRA: the actor with its adapters disabled)
    reward_model: Any  # frozen; None without a reward model (the score is the rewards section's)
    judge: Any  # frozen: the judge's reward model (held-out evaluation only); None without one
    keep_alive: Any  # hold while the engines live (engine/models/deepspeed_glue.load_partitioned)
    teacher: Any = None  # frozen: the distill section's teacher; None without one


def build_hybrid_engine(cfg: PPOConfig, ds_config: dict) -> HybridEngine:
    """The run's models, partitioned as they load (ZeRO-3): the actor and the critic (a critic-free
    estimator: none) as training engines on the run's schedule, ``ppo_epochs x rollout batch /
    mini_batch_size`` optimizer steps per iteration; the reference (a LoRA actor: none, the actor
    with its adapters off), the reward model, the judge's and the distillation teacher (when the run has
    them) frozen."""
    model_kw: dict[str, Any] = dict(
        dtype=torch.bfloat16 if cfg.actor.bf16 else torch.float32,
        attn_implementation=cfg.actor.attn_implementation,
        trust_remote_code=cfg.actor.trust_remote_code,
    )
    actor: PreTrainedModel | PeftModel  # with LoRA, the adapters around the model
    actor, keep_alive = load_partitioned(lambda: load_causal_lm(cfg.actor.path, **model_kw), ds_config)
    if cfg.actor.lora.rank:
        actor = add_adapters(actor, cfg.actor.lora, causal_lm=True)
    ref = (
        None
        if cfg.actor.lora.rank
        else load_partitioned(lambda: load_causal_lm(cfg.actor.path, **model_kw), ds_config)[0]
    )
    reward_model, judge = (
        load_partitioned(partial(load_value_model, rm.path, **model_kw), ds_config)[0] if rm else None
        for rm in (cfg.reward_model, cfg.judge.reward_model)
    )
    teacher = (
        load_partitioned(partial(load_causal_lm, cfg.distill.teacher, **model_kw), ds_config)[0]
        if cfg.distill is not None
        else None
    )  # a model of its own, with a LoRA actor too (whose reference is the actor with its adapters off)
    critic: PreTrainedModel | PeftModel | None = None
    if cfg.has_critic():
        source = cfg.critic_source()
        critic, _ = load_partitioned(lambda: load_value_model(source.path, source.components, **model_kw), ds_config)
        if cfg.critic.lora.rank:
            critic = add_adapters(critic, cfg.critic.lora, causal_lm=False)
    if cfg.actor.gradient_checkpointing:
        for m in (actor, critic):
            if m is not None:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    iterations = cfg.train.iterations
    steps_per_iteration = (
        cfg.ppo.ppo_epochs
        * cfg.rollout.prompts_per_iteration
        * cfg.rollout.samples_per_prompt
        // cfg.ppo.mini_batch_size
    )
    optim = cfg.optim.schedule(iterations * steps_per_iteration)
    frozen_config = inference_ds_config(ds_config)
    actor_engine = initialize_training_engine(actor, ds_config, **optim)
    return HybridEngine(
        actor=actor_engine,
        critic=initialize_training_engine(critic, ds_config, **(optim | {"lr": cfg.critic.lr}))
        if critic is not None
        else None,
        ref=frozen_engine(ref, frozen_config) if ref is not None else ReferenceView(actor_engine),  # LoRA: adapters off
        reward_model=frozen_engine(reward_model, frozen_config) if reward_model is not None else None,
        judge=frozen_engine(judge, frozen_config) if judge is not None else None,
        keep_alive=keep_alive,
        teacher=frozen_engine(teacher, frozen_config) if teacher is not None else None,
    )


def critic_readout(cfg: PPOConfig, reward_model: RewardModelScorer | None) -> ValueReadout:
    """How the critic's outputs make its value: a critic that kept the reward model's head reads it
    as the reward model's term of the reward (:meth:`RewardModelScorer.readout`); a new head's one
    output is the value."""
    if reward_model is None or cfg.critic_source().components is not None:
        return ValueReadout(torch.ones(1))
    return reward_model.readout()


def build_sampler(cfg: PPOConfig, actor_engine, tokenizer, rank: int, split: SplitWorld | None) -> Sampler:
    """vLLM in this process (after the engines: its external_launcher reuses their group), HF generate, or
    (rollout.mode async, on a training rank of ``split``) requests to the generating ranks."""
    if split is not None and not split.generates():
        return RemoteSampler(RolloutLink(split), rank, cfg.rollout.sync_check_every, cfg.rollout.sync_check_tolerance)
    if cfg.rollout.sampler == "hf":
        return HFSampler(actor_engine, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return build_vllm_sampler(cfg, tokenizer, rank)


def build_vllm_sampler(cfg: PPOConfig, tokenizer, rank: int) -> VLLMSampler:
    """The run's vLLM engine on this rank (a training rank's, or an async rollout's generating rank's)."""
    tp = cfg.rollout.tensor_parallel_size  # the ranks of a TP group run one engine: the same seed
    return VLLMSampler(
        cfg.actor.path,
        seed=cfg.train.seed * 1000 + rank // tp,
        dtype="bfloat16" if cfg.actor.bf16 else "float32",
        max_model_len=cfg.rollout.vllm_max_model_len,
        eos_token_id=tokenizer.eos_token_id,
        kv_cache_bytes=cfg.rollout.vllm_kv_cache_mb << 20,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        sleep_between_rollouts=cfg.rollout.vllm_sleep,
        tensor_parallel_size=tp,
        shared_requests=cfg.rollout.mode == "async",  # the generating ranks all run each trainer's request
        compile_model=cfg.rollout.vllm_compile,
    )


def build_scorers(
    cfg: PPOConfig,
    engines: HybridEngine,
    tokenizers: Tokenizers,
    components: tuple[RewardComponents | None, RewardComponents | None],
) -> Scorers:
    """The run's :class:`RewardScorer` (its reward model, rewards section and environment's rewards) and
    the judge's (its reward model and rewards components; None without a judge), on the run's engines."""
    scorers = []
    for section, rm, rm_engine, tokenizer, parts, environment in (
        (
            cfg.rewards,
            cfg.reward_model,
            engines.reward_model,
            tokenizers.reward_model,
            components[0],
            cfg.rollout.environment,
        ),
        (cfg.judge.rewards, cfg.judge.reward_model, engines.judge, tokenizers.judge, components[1], None),
    ):
        rm_scorer = (
            RewardModelScorer(
                rm_engine, tokenizer, rm, cfg.ppo.max_tokens_per_micro_batch, cfg.ppo.share_prompt, tokenizers.actor
            )
            if rm is not None and tokenizer is not None
            else None
        )
        scorers.append(RewardScorer(rm_scorer, parts, section or RewardsSection(), environment))
    return Scorers(scorers[0], scorers[1] if cfg.judge.active() else None)
