"""``--dry-run`` of the launched scripts: the plan of a run, without running it.

Loads the config, the data and the tokenizer (not the weights: parameter counts come from the
model configs, instantiated on the meta device), prints dataset statistics, the micro-batch
plan, parameter counts and DeepSpeed's estimate of model-state memory for the configured ZeRO
stage, and writes nothing. Needs no process group; the world size is the launcher's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.data.batching import (
    epoch_order,
    epoch_schedule,
    group_tokens,
    plan_global,
    plan_micro_batches,
    prompt_groups,
)
from engine.data.chat import prompt_ids
from engine.models.loading import attention_shares_prompts
from engine.run.memory_budget import (
    frozen_memory,
    parameter_counts,
    print_budget,
    print_models,
    size,
    trained_memory,
    vllm_bytes,
    vllm_memory,
    vllm_sleeps,
)
from engine.run_config.distill import DistillSection
from engine.run_config.rollout_correction import RolloutCorrectionSection


def length_stats(lengths: Sequence[int]) -> str:
    p50, p90 = np.percentile(lengths, [50, 90])
    return f"{len(lengths):,} items, tokens p50 {p50:.0f} / p90 {p90:.0f} / max {max(lengths)}"


def step_plan(lengths: list[int], per_step: int, budget: int, world: int) -> str:
    """Micro-batches per optimizer step over one epoch's order of item ``lengths``."""
    plans = [
        plan_global(lengths[start : start + per_step], budget, world) for start in range(0, len(lengths), per_step)
    ]
    counts = [len(plan[0]) for plan in plans]
    fill = [sum(lengths[i] for i in micro) for micro in plans[0][0] if micro]
    return (
        f"micro-batches (budget {budget} tokens, packed): {np.mean(counts):.1f} per step on average, max "
        f"{max(counts)}; step 1 on rank 0: {fill} tokens"
    )


def sft_plan(
    cfg, train: list, validation: list, ds_config: dict[str, Any], world: int, device_gib: float | None = None
) -> int:
    """The SFT run: data, per-step micro-batch plan, parameters, memory."""
    print(f"dry run of train_sft.py ({world} rank(s)); nothing is trained or written")
    print(
        f"train conversations:      {length_stats([c.num_tokens for c in train])}; "
        f"{sum(c.num_trained for c in train):,} trained (assistant) tokens"
    )
    if validation:
        print(f"validation conversations: {length_stats([c.num_tokens for c in validation])}")
    per_step = cfg.train.conversations_per_step
    per_epoch, total = epoch_schedule(len(train), per_step, cfg.train.epochs, cfg.train.max_steps)
    print(f"schedule: {per_step} conversations per step, {per_epoch} steps per epoch, {total} steps")
    epoch = [train[i].num_tokens for i in epoch_order(len(train), cfg.train.seed, 0)]  # the first epoch's steps
    print(step_plan(epoch, per_step, cfg.train.max_tokens_per_micro_batch, world))
    print("models:")
    states = print_models([("policy", cfg.model.path, False, None, True)], ds_config, world, cfg.model)
    print_budget(states, cfg.model, cfg.train.max_tokens_per_micro_batch, device_gib)
    return 0


def pairs_plan(cfg, train: list, validation: list, world: int) -> None:
    """The preference pairs of an RM or DPO run: lengths, schedule, per-step micro-batch plan."""
    shared = any(e.shared_prefix for e in train)
    print(
        f"train pairs:      {length_stats([e.num_tokens for e in train])} (chosen + rejected"
        + (
            f", the prompt once: {sum(e.shared_prefix for e in train) / sum(e.num_tokens for e in train):.0%} "
            "fewer tokens)"
            if shared
            else ")"
        )
    )
    print(f"validation pairs: {length_stats([e.num_tokens for e in validation])}")
    per_step = cfg.train.pairs_per_step
    per_epoch, total = epoch_schedule(len(train), per_step, cfg.train.epochs, cfg.train.max_steps)
    print(f"schedule: {per_step} pairs per step, {per_epoch} steps per epoch, {total} steps")
    epoch = [train[i].num_tokens for i in epoch_order(len(train), cfg.train.seed, 0)]  # the first epoch's steps
    print(step_plan(epoch, per_step, cfg.train.max_tokens_per_micro_batch, world))


def rm_plan(
    cfg, train: list, validation: list, ds_config: dict[str, Any], world: int, device_gib: float | None = None
) -> int:
    """The reward-model run: data, per-step micro-batch plan, parameters, memory."""
    print(f"dry run of train_rm.py ({world} rank(s)); nothing is trained or written")
    pairs_plan(cfg, train, validation, world)
    print("models:")
    states = print_models(
        [("reward model", cfg.model.path, True, list(cfg.rm.components), True)], ds_config, world, cfg.model
    )
    print_budget(states, cfg.model, cfg.train.max_tokens_per_micro_batch, device_gib)
    return 0


def dpo_plan(
    cfg, train: list, validation: list, ds_config: dict[str, Any], world: int, device_gib: float | None = None
) -> int:
    """The DPO run: data, per-step micro-batch plan, the loss, the reference pass, parameters, memory."""
    print(f"dry run of train_dpo.py ({world} rank(s)); nothing is trained or written")
    pairs_plan(cfg, train, validation, world)
    d = cfg.dpo
    extra = {"dpo": f", label smoothing {d.label_smoothing}", "ipo": "", "simpo": f", gamma {d.simpo_gamma}"}[d.loss]
    print(f"loss: {d.loss} (beta {d.beta}{extra})")
    scored = len(train) + len(validation) if d.uses_reference() else len(validation)
    print(
        f"reference: log-probs of {scored:,} pairs in one pass before the first step "
        f"({'train and ' if d.uses_reference() else ''}validation; no reference copy of the weights"
        + (", the adapters off)" if cfg.model.lora.rank else ")")
    )
    print("models:")
    states = print_models([("policy", cfg.model.path, False, None, True, cfg.model.lora)], ds_config, world, cfg.model)
    print_budget(states, cfg.model, cfg.train.max_tokens_per_micro_batch, device_gib)
    return 0


def experience_micro_batches(cfg, prompt_lengths: list[int], budget: int) -> str:
    """Micro-batches of one experience forward over these prompts' samples at max_new_tokens, with
    what sharing each prompt among its samples saves (ppo.share_prompt)."""
    r = cfg.rollout
    sequences = [
        [i] * n + [-1] * r.max_new_tokens for i, n in enumerate(prompt_lengths) for _ in range(r.samples_per_prompt)
    ]
    plain = [len(s) for s in sequences]
    if not (
        cfg.ppo.share_prompt
        and r.samples_per_prompt > 1
        and attention_shares_prompts(cfg.actor.attn_implementation, cfg.actor.bf16)
    ):
        return str(len(plan_micro_batches(plain, budget)))
    shared = group_tokens(
        sequences, prompt_groups(sequences, [n for n in prompt_lengths for _ in range(r.samples_per_prompt)], budget)
    )
    return (
        f"{len(plan_micro_batches(shared, budget))} (each prompt once for its {r.samples_per_prompt} samples: "
        f"{1 - sum(shared) / sum(plain):.0%} fewer tokens)"
    )


def ppo_plan(
    cfg,
    prompts: list,
    eval_prompts: list,
    tokenizer,
    ds_config: dict[str, Any],
    world: int,
    device_gib: float | None = None,
    scoring: Sequence[str] = (),
) -> int:
    """The PPO run: prompts, rollout and update batch plan (worst-case lengths), parameters, memory,
    what the reward models read and the code sandbox's isolation (``scoring``, a line each:
    engine/ppo/inputs.py). With rollout.mode async the batches and models are the training ranks',
    the sampler the generating ranks'."""
    trainers = world - cfg.generation_ranks()
    split = f": {trainers} training, {world - trainers} generating (rollout.mode async)" if trainers < world else ""
    print(f"dry run of train_ppo.py ({world} rank(s){split}); nothing is trained or written")
    lengths = [len(prompt_ids(tokenizer, p.messages)) for p in prompts]
    print(f"prompts:      {length_stats(lengths)}")
    if eval_prompts:
        print(f"eval prompts: {len(eval_prompts):,}")
    for line in scoring:
        print(line)
    r = cfg.rollout
    longest = max(lengths) + r.max_new_tokens
    too_long = sum(n + r.max_new_tokens > r.vllm_max_model_len for n in lengths)
    per_iteration = r.prompts_per_iteration * r.samples_per_prompt
    print(
        f"rollout: {r.prompts_per_iteration} prompts x {r.samples_per_prompt} samples = {per_iteration} sequences per "
        f"iteration, {len(prompts) // r.prompts_per_iteration} iterations per pass over the prompts, "
        f"{cfg.train.iterations} iterations"
    )
    if too_long:
        print(
            f"warning: {too_long} prompt(s) + max_new_tokens exceed rollout.vllm_max_model_len={r.vllm_max_model_len}"
        )
    budget = cfg.ppo.max_tokens_per_micro_batch
    worst = [
        n + r.max_new_tokens for n in sorted(lengths)[-per_iteration // trainers :]
    ]  # this rank's longest possible share
    mini = cfg.ppo.mini_batch_size // trainers
    print(
        f"micro-batches (budget {budget} tokens, worst case: longest prompts + max_new_tokens, longest {longest}): "
        f"{experience_micro_batches(cfg, sorted(lengths)[-r.prompts_per_iteration // trainers :], budget)} per "
        f"experience forward, {len(plan_micro_batches(worst[-mini:], budget))} per mini-batch update; "
        f"{cfg.ppo.ppo_epochs * per_iteration // cfg.ppo.mini_batch_size} "
        "optimizer steps per iteration per trained model"
    )
    source = cfg.critic_source()
    critic = [("critic", source.path, True, source.components, True, cfg.critic.lora)] if cfg.has_critic() else []
    reference = [] if cfg.actor.lora.rank else [("reference", cfg.actor.path, False, None, False)]
    print("models:")
    states = print_models(
        [
            ("actor", cfg.actor.path, False, None, True, cfg.actor.lora),
            *critic,
            *reference,
            *([("reward model", cfg.reward_model.path, True, None, False)] if cfg.reward_model else []),
            *([("judge", cfg.judge.reward_model.path, True, None, False)] if cfg.judge.reward_model else []),
            *([("teacher", cfg.distill.teacher, False, None, False)] if cfg.distill else []),
        ],
        ds_config,
        trainers,
        cfg.actor,
    )
    if not critic:
        total, largest = parameter_counts(source.path, True, source.components, cfg.actor.trust_remote_code)
        print(
            f"  critic       none: ppo.advantage_estimator {cfg.ppo.advantage_estimator} needs no value model "
            f"(saves {trained_memory(total, largest, ds_config, trainers)})"
        )
    if not reference:
        total, _ = parameter_counts(cfg.actor.path, False, None, cfg.actor.trust_remote_code)
        print(
            f"  reference    none: the actor with its LoRA adapters disabled (no copy: "
            f"{frozen_memory(total, ds_config, trainers, cfg.actor.bf16)} saved)"
        )
    if cfg.reward_model is None:
        scored = cfg.rewards.weights() or r.environment
        print("  reward model none: " + ("the score is the rewards section's components" if scored else "no reward"))
    if r.sampler == "vllm":
        print(f"  vLLM sampler: {vllm_memory(cfg, world)}" + ("; the model compiled" if r.vllm_compile else ""))
    sampler = vllm_bytes(cfg, device_gib) if r.sampler == "vllm" else 0.0
    if split:
        print_budget(states, cfg.actor, cfg.ppo.max_tokens_per_micro_batch, device_gib)
        fits = f" of {device_gib:g} GiB" if device_gib is not None else ""
        print(f"per generating rank: {size(sampler)}{fits} (vLLM alone)")
    else:
        sleeps = vllm_sleeps(cfg, device_gib)
        print_budget(states, cfg.actor, cfg.ppo.max_tokens_per_micro_batch, device_gib, sampler, sleeps)
    if env := r.environment:
        print(
            f"episodes: up to {env.max_turns} turns with {env.name} ({env.workers} worker(s) per rank, "
            f"{env.timeout_s:g} s per call); observations as '{env.observation_role}' messages of at most "
            f"{env.max_observation_tokens} tokens, in no loss; rollout.max_new_tokens bounds the whole episode"
        )
    print(f"score: {score_terms(cfg)}")
    print(f"objective: {objective_terms(cfg)}")
    if cfg.distill:
        print(f"distillation: {distill_terms(cfg.distill)}")
    if cfg.judge.active():
        judged = ["reward model"] * bool(cfg.judge.reward_model) + list(
            cfg.judge.rewards.weights() if cfg.judge.rewards else {}
        )
        print(f"judge: {', '.join(judged)} (held-out responses only)")
    return 0


def objective_terms(cfg) -> str:
    """The policy objective, in words: advantages, ratio and clip, rollout correction, aggregation, KL,
    dynamic sampling."""
    p = cfg.ppo
    dr_grpo = p.advantage_estimator == "grpo" and not p.grpo_std_scaling
    advantages = p.advantage_estimator + (" without std scaling (Dr. GRPO)" if dr_grpo else "")
    clip = f"{p.clip_ratio:g}" + (f"/{p.clip_ratio_high:g}" if p.clip_ratio_high is not None else "")
    kl = [f"{p.kl_estimator} x {p.kl_coef:g} in the reward"] if p.use_kl_in_reward else []
    kl += [f"{p.kl_loss_estimator} x {p.kl_loss_coef:g} in the loss"] if p.kl_loss_coef else []
    return (
        f"{advantages} advantages; {p.importance_ratio} ratios clipped at {clip}"
        + (f", dual clip {p.clip_ratio_c:g}" if p.clip_ratio_c else "")
        + correction_terms(p.rollout_correction)
        + f"; {p.loss_aggregation}"
        + (", truncated responses masked" if p.mask_truncated else "")
        + f"; KL {' and '.join(kl) or 'none'}"
        + (
            f"; dynamic sampling (up to {cfg.rollout.max_generation_rounds} generation rounds)"
            if cfg.rollout.dynamic_sampling
            else ""
        )
    )


def distill_terms(distill: DistillSection) -> str:
    """The ``distill`` section in words."""
    if distill.mode == "reverse_kl":
        how = f"each sampled token's advantage gets -{distill.coef:g} x (log pi_actor - log pi_teacher)"
    else:
        how = (
            f"the actor loss gets {distill.coef:g} x JSD(beta {distill.beta:g}) to the teacher over its top "
            f"{distill.top_k} tokens per position (GKD, on-policy)"
        )
    return f"{distill.mode} from {distill.teacher}: {how}"


def correction_terms(correction: RolloutCorrectionSection | None) -> str:
    """``ppo.rollout_correction`` in words, after a '; ' ('' without one)."""
    if correction is None:
        return ""
    low, high = correction.bounds()
    band = f"truncated at {high:g}" if correction.mode == "truncate" else f"masked outside [{low:g}, {high:g}]"
    return f"; {correction.level} importance weights pi_actor / pi_sampler {band}"


def score_terms(cfg) -> str:
    """The score PPO maximises, in words: its weighted terms, penalties and clip."""
    rewards = cfg.rewards
    terms = []
    if cfg.reward_model:
        scale = "normalised" if cfg.reward_model.normalize else "raw"
        debias = ", its slope on length taken out per batch" if cfg.reward_model.length_debias else ""
        terms.append(f"{cfg.reward_model.weight:g} x reward model ({scale}{debias})")
    terms += [f"{weight:g} x {name}" for name, weight in rewards.weights().items()]
    if not terms and not cfg.rollout.environment:
        terms.append("0 (no reward: the teacher alone)")
    if cfg.rollout.environment:
        terms.append(f"{cfg.rollout.environment.weight:g} x environment (the episode's rewards)")
    if rewards.no_eos_penalty:
        terms.append(f"{rewards.no_eos_penalty:g} if cut at max_new_tokens")
    where = f"; {rewards.workers} reward worker(s) per rank" if set(rewards.weights()) - {"length"} else ""
    return " + ".join(terms) + f", clipped to +-{rewards.clip:g}{where}"
