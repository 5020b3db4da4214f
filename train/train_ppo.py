"""PPO on one hybrid ZeRO-3 engine with a colocated vLLM sampler.

    deepspeed --num_gpus N train/train_ppo.py --config ds_configs/demo_ppo.json [--resume] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> four models as DeepSpeed engines in one group (actor and
critic trained, reference and reward model frozen) -> sampler (vLLM, built after the engines)
-> loop: generate -> make experience (log-probs, values, scores, KL, GAE) -> PPO epochs over
mini-batches -> sync the actor into vLLM -> log / evaluate / checkpoint -> HF export.
"""

from __future__ import annotations

import engine.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import os
import sys
import time

import deepspeed
import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from engine.chat import prompt_ids
from engine.checkpoint import (
    CheckpointWriteError,
    OutputDirError,
    ResumeError,
    checkpoint_bytes,
    latest_checkpoint,
    load_checkpoint,
    preflight_output_dir,
    save_checkpoint,
)
from engine.config import config_to_dict
from engine.deepspeed_glue import (
    inference_ds_config,
    initialize_training_engine,
    load_partitioned,
    save_hf_model,
    training_ds_config,
)
from engine.distributed import all_reduce, shutdown_distributed
from engine.dry_run import ppo_plan
from engine.experience import Experience, map_micro_batches, pad_right, response_values, sequence_logprobs
from engine.faults import eval_reward_offset, nan_loss_at
from engine.guards import KLGuard, NonFiniteGuard, RollbackGuard, TrainingAborted, scale_learning_rate
from engine.models import load_causal_lm, load_value_model
from engine.monitors import HackingMonitor
from engine.packing import packed_forward
from engine.ppo_eval import HeldOutEvaluator
from engine.ppo_losses import AdaptiveKLController, FixedKLController, gae, kl_penalty, masked_mean, token_rewards, whiten
from engine.ppo_rewards import RewardScorer
from engine.ppo_update import PolicyLossSettings, update_on_rollout
from engine.preference_data import epoch_order
from engine.run_config import PPOConfig
from engine.run_logger import RunLogger
from engine.run_setup import GracefulStop, start_run
from engine.sampler import HFSampler, SamplingSettings, VLLMSampler


def load_prompts(path: str) -> list[list[dict[str, str]]]:
    table = pq.read_table(path)
    if "prompt" not in table.column_names:
        raise ValueError(f"{path}: no 'prompt' column; use prepare_preferences.py's prompts_*.parquet")
    return table.column("prompt").to_pylist()


def frozen_engine(model, ds_config):
    """A ZeRO inference engine: partitioned weights, no optimizer, no gradients."""
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


def make_experience(samples, prompt_msgs, actor, critic, ref, scorer, value_weights, tokenizer, cfg: PPOConfig, kl_coef: float):
    """Score and evaluate one rank's samples; advantages are whitened over all ranks."""
    budget, pad = cfg.ppo.max_tokens_per_micro_batch, tokenizer.pad_token_id
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    T = max(len(s.response_ids) for s in samples)
    mask = pad_right([torch.ones(len(s.response_ids), dtype=torch.bool) for s in samples], T)
    with torch.no_grad():
        logprobs_of = lambda model: pad_right(sequence_logprobs(model, sequences, prompt_lens, budget, pad), T)
        old_logprobs, ref_logprobs = logprobs_of(actor), logprobs_of(ref)
        values = pad_right(map_micro_batches(
            sequences, budget, pad,
            lambda p, idx: response_values(packed_forward(critic, p), p, [prompt_lens[i] for i in idx], value_weights),
        ), T)
        texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scores, parts = scorer.score(prompt_msgs, texts, [s.finished for s in samples])
        kl = kl_penalty(old_logprobs, ref_logprobs, cfg.ppo.kl_estimator) * mask
        rewards = token_rewards(scores, kl, mask, kl_coef if cfg.ppo.use_kl_in_reward else 0.0)
        advantages, returns = gae(rewards, values, mask, cfg.ppo.gamma, cfg.ppo.lam)
        if cfg.ppo.whiten_advantages:
            advantages = whiten(advantages, mask, group=torch.distributed.group.WORLD)
    sampler_logprobs = pad_right([torch.tensor(s.logprobs) for s in samples], T)
    exp = Experience(sequences, prompt_lens, mask, old_logprobs, ref_logprobs, values, advantages, returns, scores, kl)
    stats = {
        "score": scores.mean().item(),
        "kl": (kl.sum(1)).mean().item(),  # per sequence
        "response_length": mask.sum(1).float().mean().item(),
        "finished": sum(s.finished for s in samples) / len(samples),
        "sampler_logprob_gap": masked_mean((sampler_logprobs - old_logprobs).abs(), mask).item(),
        **{k: v.mean().item() for k, v in parts.items()},
    }
    return exp, stats


def mean_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    all_reduce(t)
    return {k: v / torch.distributed.get_world_size() for k, v in zip(keys, t.tolist())}


def main() -> int:
    cfg, run_args, rank, world = start_run(PPOConfig, __doc__.split("\n")[0])
    out = cfg.logging.output_dir
    ds_config = training_ds_config(cfg.deepspeed, cfg.actor.bf16)
    dtype = torch.bfloat16 if cfg.actor.bf16 else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.path, trust_remote_code=cfg.actor.trust_remote_code)
    rm_tokenizer = AutoTokenizer.from_pretrained(cfg.reward_model.path)
    prompts = load_prompts(cfg.data.prompts)
    eval_prompts = load_prompts(cfg.data.eval_prompts) if cfg.data.eval_prompts else []
    per_epoch = len(prompts) // cfg.rollout.prompts_per_iteration  # iterations per pass over the prompts
    if per_epoch < 1:  # checked before the four models are loaded
        print(f"data error: {cfg.data.prompts}: {len(prompts)} prompts, fewer than rollout.prompts_per_iteration="
              f"{cfg.rollout.prompts_per_iteration}", file=sys.stderr)
        return 2
    if run_args.dry_run:
        return ppo_plan(cfg, prompts, eval_prompts, tokenizer, ds_config, world) if rank == 0 else 0

    # --- the hybrid engine: four models, one process group -------------------------------
    model_kw = dict(dtype=dtype, attn_implementation=cfg.actor.attn_implementation, trust_remote_code=cfg.actor.trust_remote_code)
    actor, keep_alive = load_partitioned(lambda: load_causal_lm(cfg.actor.path, **model_kw), ds_config)
    ref, _ = load_partitioned(lambda: load_causal_lm(cfg.actor.path, **model_kw), ds_config)
    reward_model, _ = load_partitioned(lambda: load_value_model(cfg.reward_model.path, **model_kw), ds_config)
    if cfg.critic.init_from == "reward_model":
        critic, _ = load_partitioned(lambda: load_value_model(cfg.reward_model.path, **model_kw), ds_config)
    else:
        critic, _ = load_partitioned(lambda: load_value_model(cfg.actor.path, ["value"], **model_kw), ds_config)
    if cfg.actor.gradient_checkpointing:
        for m in (actor, critic):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    iterations = cfg.train.iterations
    steps_per_iteration = cfg.ppo.ppo_epochs * cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt // cfg.ppo.mini_batch_size
    optim = dict(betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, lr_scheduler=cfg.optim.lr_scheduler,
                 warmup_steps=int(cfg.optim.warmup_ratio * iterations * steps_per_iteration), total_steps=iterations * steps_per_iteration)
    actor_engine = initialize_training_engine(actor, ds_config, lr=cfg.optim.lr, **optim)
    critic_engine = initialize_training_engine(critic, ds_config, lr=cfg.critic.lr, **optim)
    frozen_config = inference_ds_config(ds_config)
    ref_engine, rm_engine = frozen_engine(ref, frozen_config), frozen_engine(reward_model, frozen_config)
    scorer = RewardScorer(rm_engine, rm_tokenizer, cfg.reward_model.path, cfg.reward_model.normalize, cfg.reward_model.clip,
                          cfg.reward_model.rules, cfg.reward_model.no_eos_penalty, cfg.ppo.max_tokens_per_micro_batch)
    if cfg.rollout.sampler == "vllm":  # after the engines: vLLM's external_launcher reuses their group
        sampler = VLLMSampler(cfg.actor.path, seed=cfg.train.seed * 1000 + rank, dtype="bfloat16" if cfg.actor.bf16 else "float32",
                              max_model_len=cfg.rollout.vllm_max_model_len, eos_token_id=tokenizer.eos_token_id,
                              kv_cache_bytes=cfg.rollout.vllm_kv_cache_mb << 20,
                              gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                              sleep_between_rollouts=cfg.rollout.vllm_sleep)
    else:
        sampler = HFSampler(actor_engine, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    value_weights = scorer.weights if cfg.critic.init_from == "reward_model" else torch.ones(1)
    kl_ctl = (AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
              if cfg.ppo.kl_target is not None else FixedKLController(cfg.ppo.kl_coef))

    # --- resume --------------------------------------------------------------------------
    engines = {"actor": actor_engine, "critic": critic_engine}
    ckpt_root = os.path.join(out, "checkpoints")
    try:  # room for keep_last + 1 checkpoints of actor and critic, and the exported actor
        trained = checkpoint_bytes([actor, critic])
        preflight_output_dir(out, (cfg.checkpoint.keep_last + 1) * trained + checkpoint_bytes([actor]) // 4)
    except OutputDirError as e:
        print(f"output error: {e}", file=sys.stderr)
        return 2
    # What a checkpoint must share with this run to be resumed by it.
    identity = {"actor": cfg.actor.path, "reward_model": cfg.reward_model.path, "prompts": cfg.data.prompts,
                "prompts_per_iteration": cfg.rollout.prompts_per_iteration, "samples_per_prompt": cfg.rollout.samples_per_prompt,
                "mini_batch_size": cfg.ppo.mini_batch_size, "seed": cfg.train.seed, "world_size": world}
    guards = {
        "nonfinite": NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row),
        "kl_guard": KLGuard(cfg.guards.kl_ceiling),
        "rollback": RollbackGuard(cfg.guards.rollback_drop, cfg.guards.rollback_min_drop, cfg.guards.max_rollbacks),
        "monitor": HackingMonitor(cfg.monitors.length_ratio_max, cfg.monitors.repeated_ngram_max, cfg.guards.kl_ceiling),
    }
    nonfinite, kl_guard, rollback, monitor = guards.values()
    # Trainer state beyond the engines: what a checkpoint holds and a resume or rollback restores.
    run = {"iteration": 0, "lr_scale": 1.0, "last_good": None, "scores_since_eval": []}

    def trainer_state() -> dict:
        return {**run, "kl_controller": kl_ctl.state_dict(), "run_identity": identity,
                **{name: guard.state_dict() for name, guard in guards.items()}}

    def restore(path: str, allow_config_change: bool) -> dict:
        state = load_checkpoint(path, engines, identity, allow_config_change)
        kl_ctl.load_state_dict(state["kl_controller"])
        run["iteration"], run["scores_since_eval"] = state["iteration"], state["scores_since_eval"]
        return state

    resume_step = None
    resume_from = latest_checkpoint(ckpt_root) if run_args.resume else None
    if resume_from:
        try:
            state = restore(resume_from, run_args.allow_config_change)
        except ResumeError as e:
            print(f"resume error: {e}", file=sys.stderr)
            return 2
        resume_step = state["iteration"]
        run.update(lr_scale=state["lr_scale"], last_good=state["last_good"])
        for name, guard in guards.items():
            guard.load_state_dict(state[name])
        sampler.sync_weights(actor_engine.module)
    logger = RunLogger(out, config_to_dict(cfg), enabled=rank == 0, use_tensorboard=cfg.logging.tensorboard,
                       use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, resume_step=resume_step)
    if rank == 0:
        print(f"train_ppo: {len(prompts)} prompts, {iterations} iterations, {world} rank(s), sampler {cfg.rollout.sampler}"
              + (f", resumed at iteration {resume_step} from {resume_from}" if resume_from else ""))
    sampling = SamplingSettings(cfg.rollout.samples_per_prompt, cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens)
    evaluator = None
    if eval_prompts:
        evaluator = HeldOutEvaluator(eval_prompts, tokenizer, scorer, sampling, cfg.ppo.max_tokens_per_micro_batch, cfg.monitors.ngram)
        if cfg.rollout.sampler == "vllm":  # the reference's responses from vLLM loaded with the reference weights
            sampler.sync_weights(ref_engine.module)
            evaluator.sample_reference(sampler)
            sampler.sync_weights(actor_engine.module)
        else:
            evaluator.sample_reference(HFSampler(ref_engine, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))

    def held_out_eval(iteration: int) -> dict[str, float]:
        """Evaluate, log sample rows and monitor flags; returns the eval/* metrics."""
        result, rows = evaluator.evaluate(sampler, actor_engine, ref_engine, cfg.monitors.sample_rows)
        result["reward"] += eval_reward_offset(iteration)
        scores = run["scores_since_eval"]
        for kind, message in monitor.check(result, float(np.mean(scores)) if scores else None):
            logger.event(iteration, kind, message)
        run["scores_since_eval"] = []
        logger.samples(iteration, rows)
        return {f"eval/{k}": v for k, v in result.items()}

    def finish(code: int, message: str) -> int:
        bar.close()
        sampler.close()
        return logger.finish(code, message)

    first_eval = held_out_eval(0) if evaluator and not resume_from else None
    if first_eval:
        logger.log(0, first_eval)
        rollback.is_drop(first_eval["eval/reward"])  # the starting point is the first best
        if rollback.max_drop is not None:  # ... and the first checkpoint to come back to
            run["last_good"] = save_checkpoint(ckpt_root, 0, engines, trainer_state(), cfg.checkpoint.keep_last)

    settings = PolicyLossSettings(
        clip_low=cfg.ppo.clip_ratio, clip_high=cfg.ppo.clip_ratio_high or cfg.ppo.clip_ratio, clip_ratio_c=cfg.ppo.clip_ratio_c,
        kl_loss_coef=cfg.ppo.kl_loss_coef, kl_estimator=cfg.ppo.kl_estimator, entropy_coef=cfg.ppo.entropy_coef,
    )
    per_rank = cfg.rollout.prompts_per_iteration // world
    bar = tqdm(total=iterations, initial=run["iteration"], disable=rank != 0 or not cfg.logging.progress_bar, desc="ppo")
    stop = GracefulStop()  # after vLLM started: its engine installs handlers of its own
    while run["iteration"] < iterations:
        iteration = run["iteration"]
        t0 = time.perf_counter()
        # Data position is a function of the iteration: epoch, then the slice of its prompt order.
        epoch, in_epoch = divmod(iteration, per_epoch)
        order = epoch_order(len(prompts), cfg.train.seed, epoch)
        start = in_epoch * cfg.rollout.prompts_per_iteration + rank * per_rank
        batch_msgs = [prompts[i] for i in order[start : start + per_rank]]
        samples_nested = sampler.generate([prompt_ids(tokenizer, m) for m in batch_msgs], sampling, request_seed=iteration * world + rank)
        sampler.sleep()  # GPU: its memory goes to the experience forwards and training until the sync
        samples = [s for group in samples_nested for s in group]
        sample_msgs = [m for m, group in zip(batch_msgs, samples_nested) for _ in group]
        t1 = time.perf_counter()
        exp, rollout_stats = make_experience(
            samples, sample_msgs, actor_engine, critic_engine, ref_engine, scorer, value_weights, tokenizer, cfg, kl_ctl.value
        )
        t2 = time.perf_counter()
        def guard_step(name: str, engine) -> None:
            if nonfinite.update(engine.was_step_applied(), f"{name}, iteration {iteration + 1}"):
                logger.event(iteration + 1, "nonfinite_skip", f"{name} step skipped: non-finite loss or gradient")

        try:
            train_stats = update_on_rollout(
                actor_engine, critic_engine, exp, settings, value_weights, cfg.ppo, tokenizer.pad_token_id,
                train_actor=iteration >= cfg.critic.warmup_iterations, seed=cfg.train.seed * 100_003 + iteration,
                poison=nan_loss_at(iteration + 1), after_step=guard_step,
            )
        except TrainingAborted as e:
            logger.event(iteration + 1, "nonfinite_abort", str(e))
            return finish(3, f"training aborted: {e}")
        t3 = time.perf_counter()
        if iteration >= cfg.critic.warmup_iterations:
            sampler.sync_weights(actor_engine.module)
        t4 = time.perf_counter()
        rollout_stats = mean_over_ranks(rollout_stats)
        rollout_stats["kl_per_token"] = rollout_stats["kl"] / max(rollout_stats["response_length"], 1.0)
        kl_ctl.update(rollout_stats["kl"], n_steps=cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt)
        iteration = run["iteration"] = iteration + 1
        run["scores_since_eval"].append(rollout_stats["score"])
        if kl_guard.exceeded(rollout_stats["kl_per_token"]):
            scale_learning_rate(actor_engine, cfg.guards.kl_lr_factor)
            run["lr_scale"] *= cfg.guards.kl_lr_factor
            logger.event(iteration, "kl_guard", f"KL {rollout_stats['kl_per_token']:.4f} per token is above the ceiling "
                                                f"{cfg.guards.kl_ceiling}: actor LR x{cfg.guards.kl_lr_factor}")
        generated = torch.tensor([float(exp.mask.sum())])
        all_reduce(generated)
        metrics = {f"ppo/{k}": v for k, v in rollout_stats.items()}
        metrics |= {f"ppo/{k}": v for k, v in train_stats.items()}
        metrics |= {
            "ppo/kl_coef": kl_ctl.value, "ppo/actor_lr": actor_engine.get_lr()[0],
            "timing/generate_s": t1 - t0, "timing/make_experience_s": t2 - t1, "timing/train_s": t3 - t2,
            "timing/sync_s": t4 - t3, "timing/iteration_s": t4 - t0, "timing/generated_tokens_per_s": generated.item() / (t1 - t0),
            "guard/nonfinite_skipped": nonfinite.skipped, "guard/kl_guard_hits": kl_guard.hits, "guard/rollbacks": rollback.rollbacks,
        }
        evaluated = evaluator and ((cfg.train.eval_every and iteration % cfg.train.eval_every == 0) or iteration == iterations)
        if evaluated:
            metrics |= held_out_eval(iteration)
        logger.log(iteration, metrics)
        bar.update(1)
        bar.set_postfix(score=f"{metrics['ppo/score']:.3f}", kl=f"{metrics['ppo/kl']:.4f}", it_s=f"{t4 - t0:.2f}")
        if evaluated and rollback.is_drop(metrics["eval/reward"]):
            try:
                rollback.count_rollback(metrics["eval/reward"], run["last_good"])
            except TrainingAborted as e:
                logger.event(iteration, "rollback_give_up", str(e))
                return finish(3, f"training aborted: {e}")
            state = restore(run["last_good"], allow_config_change=False)
            new_scale = run["lr_scale"] * cfg.guards.rollback_lr_factor
            scale_learning_rate(actor_engine, new_scale / state["lr_scale"])  # the checkpoint's schedule had its own scale
            run["lr_scale"] = new_scale
            sampler.sync_weights(actor_engine.module)
            logger.rewind(run["iteration"])
            logger.event(iteration, "rollback", f"held-out reward {metrics['eval/reward']:.4f} fell below the best "
                         f"{rollback.best:.4f}: rolled back to {run['last_good']}, actor LR scale {new_scale:g} "
                         f"(rollback {rollback.rollbacks} of {rollback.max_rollbacks})", to_step=run["iteration"])
            bar.reset(total=iterations)
            bar.update(run["iteration"])
            continue
        good = evaluated and rollback.max_drop is not None  # a checkpoint to come back to
        periodic = cfg.checkpoint.every_steps and iteration % cfg.checkpoint.every_steps == 0
        stopping = iteration < iterations and stop.requested()
        if (periodic or stopping or good) and iteration < iterations:
            if good:
                run["last_good"] = os.path.join(ckpt_root, f"step{iteration:08d}")
            try:
                path = save_checkpoint(ckpt_root, iteration, engines, trainer_state(), cfg.checkpoint.keep_last, keep=run["last_good"])
            except CheckpointWriteError as e:
                return finish(2, f"checkpoint error: {e}")
        if stopping:
            return finish(0, f"stopped by {stop.signal_name or 'a signal on another rank'} after iteration {iteration}: checkpoint "
                             f"{path}; continue with the same command plus --resume")
    save_hf_model(actor_engine, tokenizer, os.path.join(out, "actor"))
    summary = f"ppo done: {iterations} iterations, last KL {metrics['ppo/kl']:.4f} (per sequence)" if iterations else "ppo done"
    if first_eval and "eval/reward" in metrics:
        summary += (f"; held-out reward {first_eval['eval/reward']:.3f} -> {metrics['eval/reward']:.3f}, "
                    f"win rate vs reference {metrics['eval/win_rate']:.3f}")
    del keep_alive
    return finish(0, f"{summary}; actor saved to {out}/actor")


if __name__ == "__main__":
    code = main()
    shutdown_distributed()
    sys.exit(code)
