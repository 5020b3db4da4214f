"""PPO on one hybrid ZeRO-3 engine with a colocated vLLM sampler.

    deepspeed --num_gpus N train/train_ppo.py --config ds_configs/demo_ppo.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> prompts -> output-directory checks -> four models as
DeepSpeed engines in one group (actor and critic trained, reference and reward model frozen; no
critic with a critic-free ``ppo.advantage_estimator``; with LoRA only adapters train and the
reference is the actor with its adapters off) -> sampler (vLLM, built after the engines) ->
start or resume the run -> held-out evaluation of the start -> loop: generate -> make experience
(log-probs, values, scores, KL, GAE) -> PPO epochs over mini-batches -> sync the actor into vLLM
-> log / evaluate (roll back on a drop) / checkpoint -> HF export -> report.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import os
import time
from functools import partial

import torch

from engine.config import config_to_dict
from engine.data.errors import DataFileError
from engine.models.deepspeed_glue import describe_engine, save_hf_model, training_ds_config
from engine.ppo.collect import RolloutCollector
from engine.ppo.engines import HybridEngine, build_hybrid_engine, build_sampler, build_scorers, critic_value_weights
from engine.ppo.evaluation import HeldOutEvaluator, held_out_eval, held_out_summary
from engine.ppo.experience import OldLogprobSource, make_experience
from engine.ppo.forwards import sequence_logprobs
from engine.ppo.inputs import check_models, load_fitting_prompts, reward_components, reward_model_inputs
from engine.ppo.losses import AdaptiveKLController, FixedKLController
from engine.ppo.monitors import HackingMonitor, MonitorLimits, act_on_flags
from engine.ppo.settings import ExperienceSettings, UpdateSettings
from engine.ppo.update import update_on_rollout
from engine.rewards.components import RewardsUnavailable
from engine.rollout.generation_rank import serve
from engine.rollout.remote import RemoteSampler, WeightSyncFailed
from engine.run.checkpoint import content_fingerprint
from engine.run.distributed import accelerator_memory_metrics, mean_over_ranks, split_world
from engine.run.dry_run import ppo_plan
from engine.run.guards import KLGuard, NonFiniteGuard, RollbackGuard
from engine.run.launch import run_main, start_run
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run_config import PPOConfig

SYNC_CHECK_SEQUENCES = 2  # per training rank, re-scored by an async rollout's vLLM (rollout.sync_check_every)


def ppo_iteration(
    iteration: int,
    collector: RolloutCollector,
    sampler,
    engines: HybridEngine,
    pad_token_id: int,
    experience: ExperienceSettings,
    update: UpdateSettings,
    *,
    kl_coef: float,
    old_from_sampler: bool,
    train_actor: bool,
    after_step,
) -> dict[str, float]:
    """One iteration on this rank's share: collect (generate and score, engine/ppo/collect.py) ->
    make experience -> PPO epochs -> sync the sampler (unless the actor is not trained: critic
    warm-up). Returns the ppo/* metrics (rollout statistics averaged over the ranks), reward/* (the
    score's parts) and timing/*."""
    t0 = time.perf_counter()
    rollout, collected = collector.collect()
    t1 = time.perf_counter()
    exp, rollout_stats = make_experience(
        rollout, engines, pad_token_id, experience, kl_coef=kl_coef, old_logprobs_from_sampler=old_from_sampler
    )
    if isinstance(sampler, RemoteSampler) and iteration % sampler.check_every == 0:
        k = min(SYNC_CHECK_SEQUENCES, len(exp.sequences))
        checked = exp.sequences[:k], exp.prompt_lens[:k]  # vLLM re-scores them untempered (prompt log-probs)
        forward = (experience.max_tokens, pad_token_id, experience.share_prompts)
        with torch.no_grad():
            sampler.ask_sync_check(*checked, sequence_logprobs(engines.actor, *checked, *forward))
    t2 = time.perf_counter()
    train_stats = update_on_rollout(
        engines.actor, engines.critic, exp, update, iteration=iteration, train_actor=train_actor, after_step=after_step
    )
    t3 = time.perf_counter()
    if train_actor:
        sampler.sync_weights(engines.actor)
    t4 = time.perf_counter()
    if isinstance(sampler, RemoteSampler) and sampler.checked_gap is not None:  # compared in this collect
        rollout_stats["sync_check_gap"], sampler.checked_gap = sampler.checked_gap, None
    rollout_stats = mean_over_ranks(rollout_stats)
    rollout_stats["kl_per_token"] = rollout_stats["kl"] / max(rollout_stats["response_length"], 1.0)
    generate_s, wait_s, score_s, tokens = (
        collected.pop(k) for k in ("generate_s", "wait_s", "score_s", "generated_tokens")
    )
    return (
        {k if k.startswith("reward/") else f"ppo/{k}": v for k, v in (rollout_stats | collected | train_stats).items()}
        | {
            "timing/generate_s": generate_s,
            "timing/rollout_wait_s": wait_s,
            "timing/score_s": score_s,
            "timing/make_experience_s": t2 - t1,
            "timing/train_s": t3 - t2,
            "timing/sync_s": t4 - t3,
            "timing/iteration_s": t4 - t0,
            "timing/generated_tokens_per_s": tokens / generate_s,
        }
        | accelerator_memory_metrics()
    )


def main() -> int:
    cfg, run_args, rank, world = start_run(PPOConfig, __doc__.split("\n")[0])
    out = cfg.logging.output_dir
    ds_config = training_ds_config(cfg.deepspeed, cfg.actor.bf16)
    tokenizers = check_models(cfg)
    tokenizer = tokenizers.actor
    if (split := split_world()) and split.generates():  # rollout.mode async: this rank only generates
        return serve(build_sampler(cfg, None, tokenizer, rank), split)
    prompts = load_fitting_prompts(cfg.data.prompts, tokenizer, cfg, rank)
    eval_prompts = (
        load_fitting_prompts(cfg.data.eval_prompts, tokenizer, cfg, rank, True) if cfg.data.eval_prompts else []
    )
    if len(prompts) < cfg.rollout.prompts_per_iteration:  # checked before the four models are loaded
        raise DataFileError(
            f"{cfg.data.prompts}: {len(prompts)} usable prompts, fewer than rollout.prompts_per_iteration="
            f"{cfg.rollout.prompts_per_iteration}"
        )
    components = reward_components(cfg)
    if run_args.dry_run:
        return (
            ppo_plan(
                cfg,
                prompts,
                eval_prompts,
                tokenizer,
                ds_config,
                world,
                run_args.device_memory_gib,
                reward_model_inputs(tokenizers, prompts[0].messages),
            )
            if rank == 0
            else 0
        )
    iterations = cfg.train.iterations
    run = RunLifecycle(
        output_dir=out,
        run_args=run_args,
        export_dir="actor",
        checkpoint=cfg.checkpoint,
        unit="iteration",
        identity={
            "actor": cfg.actor.path,
            "reward_model": cfg.reward_model.path if cfg.reward_model else None,
            "data.prompts": content_fingerprint(cfg.data.prompts),
            "prompts_per_iteration": cfg.rollout.prompts_per_iteration,
            "samples_per_prompt": cfg.rollout.samples_per_prompt,
            "mini_batch_size": cfg.ppo.mini_batch_size,
            "advantage_estimator": cfg.ppo.advantage_estimator,
            "seed": cfg.train.seed,
            "world_size": world,
        }
        | {
            f"{name}_lora": vars(part.lora)
            for name, part in (("actor", cfg.actor), ("critic", cfg.critic))
            if part.lora.rank
        },
    )

    engines = build_hybrid_engine(cfg, ds_config)
    scorers = build_scorers(cfg, engines, tokenizers, components)
    sampler = build_sampler(cfg, engines.actor, tokenizer, rank)
    value_weights = critic_value_weights(cfg, scorers.run.reward_model)
    kl_ctl = (
        AdaptiveKLController(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
        if cfg.ppo.kl_target is not None
        else FixedKLController(cfg.ppo.kl_coef)
    )
    nonfinite, kl_guard = NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row), KLGuard(cfg.guards.kl_ceiling)
    rollback = RollbackGuard(cfg.guards.rollback_drop, cfg.guards.rollback_min_drop, cfg.guards.max_rollbacks)
    monitor = HackingMonitor(MonitorLimits.from_config(cfg))
    run.track("kl_controller", kl_ctl, rolls_back=True)
    for name, guard in (("nonfinite", nonfinite), ("kl_guard", kl_guard), ("monitor", monitor)):
        run.track(name, guard, rolls_back=False)
    run.track_rollback(rollback, lr_factor=cfg.guards.rollback_lr_factor)
    old_logprobs = OldLogprobSource(
        cfg.ppo.old_logprobs_from, cfg.ppo.sampler_check_every, cfg.ppo.sampler_logprob_tolerance
    )
    run.track("old_logprobs", old_logprobs, rolls_back=False)
    collector = RolloutCollector.for_run(cfg, prompts, sampler, scorers.run, tokenizer)
    run.track("rollout", collector, rolls_back=True)  # the prompt position and the groups waiting
    run.after_restore(partial(sampler.sync_weights, engines.actor))
    run.at_finish(sampler.close)
    run.at_finish(scorers.close)
    run.start(
        engines={"actor": engines.actor} | ({"critic": engines.critic} if engines.critic is not None else {}),
        lr_engine=engines.actor,
        export_engine=engines.actor,
        config=config_to_dict(cfg),
        total_steps=iterations,
        logging=cfg.logging,
        desc="ppo",
    )
    update = UpdateSettings.from_config(cfg, value_weights, tokenizer.pad_token_id, engines.critic)
    experience = ExperienceSettings.from_config(cfg, value_weights, values_from_update=update.values_gae is not None)
    if rank == 0:
        print(
            f"train_ppo: {len(prompts)} prompts, {iterations} iterations, {world} rank(s), sampler "
            f"{cfg.rollout.sampler}"
            + (
                f" on {cfg.generation_ranks()} rank(s) of its own (async, max_staleness {cfg.rollout.max_staleness})"
                if cfg.rollout.mode == "async"
                else ""
            )
            + f", actor {describe_engine(engines.actor)}"
            + (
                f", critic values from {'the first critic step' if update.values_gae else 'an experience forward'}"
                if engines.critic
                else ""
            )
            + (f", resumed at iteration {run.step} from {run.resume_from}" if run.resume_from else "")
            + "".join(f"\n{line}" for line in reward_model_inputs(tokenizers, prompts[0].messages))
        )
    evaluator = (
        HeldOutEvaluator(
            eval_prompts,
            tokenizer,
            scorers,
            collector.sampling,
            cfg.ppo.max_tokens_per_micro_batch,
            (cfg.monitors.ngram, cfg.monitors.distinct_n),
            cfg.ppo.share_prompt,
        )
        if eval_prompts
        else None
    )
    evaluate = partial(held_out_eval, evaluator, sampler, engines, run, cfg.monitors.sample_rows)
    metrics: dict[str, float] = {}
    try:
        if evaluator:
            evaluator.sample_reference(sampler, engines)
        first_eval = evaluate() if evaluator and not run.resume_from else None
        if first_eval:
            run.logger.log(0, first_eval)
            act_on_flags(monitor.check_evaluation(0, first_eval), monitor, run, "warn")
            run.first_evaluation(first_eval["eval/reward"])
        while run.step < iterations:
            metrics = ppo_iteration(
                run.step,
                collector,
                sampler,
                engines,
                tokenizer.pad_token_id,
                experience,
                update,
                kl_coef=kl_ctl.value if cfg.ppo.use_kl_in_reward else 0.0,
                old_from_sampler=old_logprobs.use_sampler(run.step),
                train_actor=run.step >= cfg.critic.warmup_iterations,
                after_step=partial(run.check_step, nonfinite, run.step + 1),
            )
            if message := old_logprobs.observe(metrics.get("ppo/sampler_logprob_gap")):
                run.event("old_logprobs_from_actor", message, step=run.step + 1)
            kl_ctl.update(
                metrics["ppo/kl_per_token"], n_steps=cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt
            )
            run.step += 1
            if kl_guard.exceeded(metrics["ppo/kl_per_token"]):
                run.scale_lr(cfg.guards.kl_lr_factor)
                run.event(
                    "kl_guard",
                    f"KL {metrics['ppo/kl_per_token']:.4f} per token is above the ceiling "
                    f"{cfg.guards.kl_ceiling}: actor LR x{cfg.guards.kl_lr_factor}",
                )
            metrics |= {
                "ppo/kl_coef": kl_ctl.value,
                "ppo/actor_lr": engines.actor.get_lr()[0],
                "guard/nonfinite_skipped": nonfinite.skipped,
                "guard/kl_guard_hits": kl_guard.hits,
                "guard/rollbacks": rollback.rollbacks,
            }
            evaluated = evaluator and (
                (cfg.train.eval_every and run.step % cfg.train.eval_every == 0) or run.step == iterations
            )
            flags = monitor.check_iteration(run.step, metrics)
            if evaluated:
                metrics |= evaluate()
                flags += monitor.check_evaluation(run.step, metrics)
            run.log(
                metrics,
                score=f"{metrics['ppo/score']:.3f}",
                kl=f"{metrics['ppo/kl']:.4f}",
                it_s=f"{metrics['timing/iteration_s']:.2f}",
            )
            if act_on_flags(flags, monitor, run, cfg.monitors.action):
                continue
            if evaluated and run.rolled_back(metrics["eval/reward"]):
                continue
            run.end_of_step(good=bool(evaluated) and not monitor.active)  # a rollback target raises no flag
    except RunEnded as end:
        return run.finish(end.code, str(end))
    except RewardsUnavailable as e:  # raised before an update or after a whole iteration: a step boundary
        return run.finish_with_checkpoint(2, f"reward error: {e}", "; continue with the same command plus --resume")
    except WeightSyncFailed as e:  # read with a batch, before it is trained on: a step boundary
        return run.finish_with_checkpoint(2, f"weight sync error: {e}")
    save_hf_model(engines.actor, tokenizer, os.path.join(out, "actor"))
    summary = (
        f"ppo {f'finished with {monitor.summary()};' if monitor.raised else 'done:'} {iterations} iterations, "
        f"last KL {metrics['ppo/kl_per_token']:.4f} per token"
    )
    if first_eval and "eval/reward" in metrics:
        summary += f"; {held_out_summary(first_eval, metrics)}"
    return run.finish(0, f"{summary}; actor saved to {out}/actor")


if __name__ == "__main__":
    run_main(main)
