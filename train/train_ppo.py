"""PPO on one hybrid ZeRO-3 engine with a colocated vLLM sampler.

    deepspeed --num_gpus N train/train_ppo.py --config ds_configs/demo_ppo.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> prompts -> output-directory checks -> the models as DeepSpeed
engines in one group (actor and critic trained, reference, reward model and a distillation teacher
frozen; no critic with a critic-free ``ppo.advantage_estimator``; with LoRA only adapters train and
the reference is the actor with its adapters off) -> sampler (vLLM, built after the engines) ->
start or resume the run (the code sandbox's isolation logged) -> held-out evaluation of the start
-> loop: generate -> make experience (log-probs, values, scores, KL, GAE; the teacher's log-probs)
-> PPO epochs over mini-batches -> sync the actor into vLLM -> log / evaluate (roll back on a drop)
/ checkpoint -> HF export -> report.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import os
from functools import partial

from engine.config import config_to_dict
from engine.data.errors import DataFileError
from engine.models.deepspeed_glue import describe_engine, save_hf_model, training_ds_config
from engine.ppo.collect import RolloutCollector
from engine.ppo.controls import IterationControls
from engine.ppo.distill import DistillSettings
from engine.ppo.engines import (
    build_hybrid_engine,
    build_sampler,
    build_scorers,
    build_vllm_sampler,
    critic_readout,
)
from engine.ppo.evaluation import HeldOutEvaluator, held_out_eval
from engine.ppo.inputs import (
    check_models,
    code_sandbox,
    dataset_responses,
    episode_runner,
    load_fitting_prompts,
    reward_components,
    reward_model_inputs,
)
from engine.ppo.iteration import PPOIteration
from engine.ppo.settings import ExperienceSettings, UpdateSettings
from engine.rewards.components import RewardsUnavailable
from engine.rollout.generation_rank import serve
from engine.rollout.remote import WeightSyncFailed
from engine.run.checkpoint import content_fingerprint
from engine.run.dry_run import ppo_plan
from engine.run.launch import run_main, start_run
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run_config import PPOConfig


def main() -> int:
    cfg, run_args, rank, world, split = start_run(PPOConfig, __doc__.split("\n")[0])
    out = cfg.logging.output_dir
    ds_config = training_ds_config(cfg.deepspeed, cfg.actor.bf16)
    tokenizers = check_models(cfg)
    tokenizer = tokenizers.actor
    if split and split.generates():  # rollout.mode async: this rank only generates
        return serve(build_vllm_sampler(cfg, tokenizer, rank), split)
    prompts = load_fitting_prompts(cfg.data.prompts, tokenizer, cfg, rank)
    eval_prompts = (
        load_fitting_prompts(cfg.data.eval_prompts, tokenizer, cfg, rank, True) if cfg.data.eval_prompts else []
    )
    if len(prompts) < cfg.rollout.prompts_per_iteration:  # checked before the four models are loaded
        raise DataFileError(
            f"{cfg.data.prompts}: {len(prompts)} usable prompts, fewer than rollout.prompts_per_iteration="
            f"{cfg.rollout.prompts_per_iteration}"
        )
    responses = dataset_responses(cfg, prompts, tokenizer)  # distill.lmbda < 1: the dataset's, tokenised
    components = reward_components(cfg)
    episodes = episode_runner(cfg, tokenizer)
    sandbox = code_sandbox(components)  # its isolation, probed (and "none" refused unless allowed) by the check
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
                reward_model_inputs(tokenizers, prompts[0].messages) + sandbox,
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
        }
        | ({"distill_teacher": cfg.distill.teacher, "distill_mode": cfg.distill.mode} if cfg.distill else {}),
    )

    engines = build_hybrid_engine(cfg, ds_config)
    scorers = build_scorers(cfg, engines, tokenizers, components)
    sampler = build_sampler(cfg, engines.actor, tokenizer, rank, split)
    value_readout = critic_readout(cfg, scorers.run.reward_model)
    collector = RolloutCollector.for_run(cfg, prompts, sampler, scorers.run, tokenizer, episodes, responses)
    run.track("rollout", collector, rolls_back=True)  # the prompt position and the groups waiting
    evaluator = (
        HeldOutEvaluator(
            eval_prompts,
            tokenizer,
            scorers,
            collector.sampling,
            cfg.ppo.max_tokens_per_micro_batch,
            (cfg.monitors.ngram, cfg.monitors.distinct_n),
            cfg.ppo.share_prompt,
            episodes,
        )
        if eval_prompts
        else None
    )
    evaluate = partial(held_out_eval, evaluator, sampler, engines, run, cfg.monitors.sample_rows) if evaluator else None
    controls = IterationControls(cfg, run, engines.actor, evaluate)
    run.after_restore(partial(sampler.sync_weights, engines.actor))
    run.at_finish(sampler.close)
    run.at_finish(scorers.close)
    if episodes:
        run.at_finish(episodes.close)
    run.start(
        engines={"actor": engines.actor} | ({"critic": engines.critic} if engines.critic is not None else {}),
        lr_engine=engines.actor,
        export_engine=engines.actor,
        config=config_to_dict(cfg),
        total_steps=iterations,
        logging=cfg.logging,
        desc="ppo",
    )
    for line in sandbox:  # printed, and kept in events.jsonl
        run.event("code_sandbox", line)
    distill = DistillSettings.from_config(cfg.distill, vocab=engines.actor.module.config.vocab_size)
    update = UpdateSettings.from_config(cfg, value_readout, tokenizer.pad_token_id, engines.critic, distill)
    experience = ExperienceSettings.from_config(
        cfg, value_readout, values_from_update=update.values_gae is not None, distill=distill
    )
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
    iteration = PPOIteration(collector, sampler, engines, tokenizer.pad_token_id, experience, update)
    try:
        if evaluator:
            evaluator.sample_reference(sampler, engines)
        controls.evaluate_start()
        while run.step < iterations:
            controls.end_iteration(iteration.run(run.step, controls.settings()))
    except RunEnded as end:
        return run.finish(end.code, str(end))
    except RewardsUnavailable as e:  # raised before an update or after a whole iteration: a step boundary
        return run.finish_with_checkpoint(2, f"reward error: {e}", "; continue with the same command plus --resume")
    except WeightSyncFailed as e:  # async: read with a batch, before it is trained on; colocated: after the log
        return run.finish_with_checkpoint(2, f"weight sync error: {e}")
    save_hf_model(engines.actor, tokenizer, os.path.join(out, "actor"))
    return run.finish(0, f"{controls.summary()}; actor saved to {out}/actor")


if __name__ == "__main__":
    run_main(main)
