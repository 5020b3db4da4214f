"""Train a Bradley-Terry reward model on preference pairs.

    deepspeed --num_gpus N train/train_rm.py --config ds_configs/demo_rm.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and data -> output-directory checks -> value model
in a DeepSpeed engine -> start or resume the run -> loop (token-budget packed micro-batches, one
optimizer step per ``pairs_per_step`` pairs, periodic evaluation and checkpoints) -> final
evaluation -> HF model with reward statistics -> report.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import os
import time
from functools import partial

import torch

from engine.config import config_to_dict
from engine.data.batching import epoch_batch, epoch_schedule
from engine.data.preferences import PreferenceExample, load_fitting_pairs
from engine.models.deepspeed_glue import (
    describe_engine,
    initialize_training_engine,
    load_partitioned,
    save_hf_model,
    training_ds_config,
)
from engine.models.loading import attention_shares_prompts, load_value_model
from engine.rm.reward_model import RMLossSettings, evaluate_pairs, rm_step
from engine.run.checkpoint import content_fingerprint
from engine.run.dry_run import rm_plan
from engine.run.guards import NonFiniteGuard
from engine.run.launch import run_main, start_run
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run.preflight import check_weights, load_tokenizer
from engine.run.step_metrics import optimizer_step_metrics
from engine.run_config import RewardModelConfig


def shares_prompts(cfg: RewardModelConfig) -> bool:
    """rm.share_prompt, where the attention implementation in effect runs shared-prompt rows (sdpa_varlen)."""
    return cfg.rm.share_prompt and attention_shares_prompts(cfg.model.attn_implementation, cfg.model.bf16)


def load_pairs(path: str, tokenizer, cfg: RewardModelConfig, rank: int) -> list[PreferenceExample]:
    """The pairs of ``path`` that fit one micro-batch, their prompts marked to pack once where the
    attention implementation can (rm.share_prompt)."""
    return load_fitting_pairs(
        path,
        tokenizer,
        list(cfg.rm.components),
        cfg.data.use_margin,
        shares_prompts(cfg),
        cfg.train.max_tokens_per_micro_batch,
        rank,
    )


def main() -> int:
    cfg, run_args, rank, world, _ = start_run(RewardModelConfig, __doc__.split("\n")[0])
    out = cfg.logging.output_dir
    ds_config = training_ds_config(cfg.deepspeed, cfg.model.bf16)

    tokenizer = load_tokenizer(cfg.model.path, "model.path", cfg.model.trust_remote_code)
    check_weights(cfg.model.path, "model.path", value_head=True, trust_remote_code=cfg.model.trust_remote_code)
    loss_settings = RMLossSettings.from_config(cfg.rm)
    components, weights = list(loss_settings.components), loss_settings.weights
    train, validation = (load_pairs(path, tokenizer, cfg, rank) for path in (cfg.data.train, cfg.data.validation))
    steps_per_epoch, total_steps = epoch_schedule(
        len(train), cfg.train.pairs_per_step, cfg.train.epochs, cfg.train.max_steps
    )
    if run_args.dry_run:
        return rm_plan(cfg, train, validation, ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    run = RunLifecycle(
        output_dir=out,
        run_args=run_args,
        export_dir="model",
        checkpoint=cfg.checkpoint,
        identity={
            "model": cfg.model.path,
            "data.train": content_fingerprint(cfg.data.train),
            "components": cfg.rm.components,
            "pairs_per_step": cfg.train.pairs_per_step,
            "seed": cfg.train.seed,
            "world_size": world,
        },
    )

    model, keep_alive = load_partitioned(
        lambda: load_value_model(
            cfg.model.path,
            components,
            dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        ),
        ds_config,
    )
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = initialize_training_engine(model, ds_config, **cfg.optim.schedule(total_steps))

    nonfinite = NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row)
    run.track("nonfinite", nonfinite, rolls_back=False)
    run.start(
        engines={"model": engine},
        lr_engine=engine,
        export_engine=engine,
        config=config_to_dict(cfg),
        total_steps=total_steps,
        use_tensorboard=cfg.logging.tensorboard,
        use_wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        progress_bar=cfg.logging.progress_bar,
        desc="rm",
    )
    if rank == 0:
        print(
            f"train_rm: {len(train)} train / {len(validation)} validation pairs, {total_steps} steps, {world} rank(s), "
            f"{describe_engine(engine)}"
            + (f", resumed at step {run.step} from {run.resume_from}" if run.resume_from else "")
        )
    evaluate = partial(
        evaluate_pairs,
        engine,
        validation,
        components,
        weights,
        cfg.train.max_tokens_per_micro_batch,
        tokenizer.pad_token_id,
    )
    try:
        while run.step < total_steps:
            indices, epochs = epoch_batch(
                run.step, len(train), cfg.train.pairs_per_step, steps_per_epoch, cfg.train.seed
            )
            batch = [train[i] for i in indices]
            start = time.perf_counter()
            engine.train()
            step_metrics = rm_step(
                engine,
                batch,
                loss_settings,
                cfg.train.max_tokens_per_micro_batch,
                tokenizer.pad_token_id,
                step=run.step + 1,
            )
            seconds = time.perf_counter() - start
            run.step += 1
            run.check_step(nonfinite, run.step, engine)
            metrics = {f"rm/{k}": v for k, v in step_metrics.items()} | optimizer_step_metrics(
                "rm", engine, epochs, seconds, sum(e.num_tokens for e in batch), nonfinite.skipped
            )
            if cfg.train.eval_every_steps and run.step % cfg.train.eval_every_steps == 0 and run.step < total_steps:
                engine.eval()
                metrics |= {f"eval/{k}": v for k, v in evaluate().items()}
            run.log(
                metrics,
                loss=f"{metrics['rm/loss']:.3f}",
                acc=f"{metrics['rm/acc']:.2f}",
                tok_s=f"{metrics['timing/tokens_per_s']:.0f}",
            )
            run.end_of_step()
    except RunEnded as end:
        return run.finish(end.code, str(end))

    engine.eval()
    final = evaluate()
    run.logger.log(run.step, {f"eval/{k}": v for k, v in final.items()})
    reward_stats = {
        "mean": final["reward_mean"],
        "std": final["reward_std"],
        "components": {c: {"mean": final[f"reward_mean_{c}"], "std": final[f"reward_std_{c}"]} for c in components},
        "weights": cfg.rm.components,
        "validation_pairs": len(validation),
    }
    save_hf_model(
        engine,
        tokenizer,
        os.path.join(out, "model"),
        {"reward_stats.json": reward_stats, "train_config.json": config_to_dict(cfg)},
    )
    per_component = ", ".join(f"{c} {final[f'acc_{c}']:.3f}" for c in components if f"acc_{c}" in final)
    del keep_alive
    return run.finish(
        0,
        f"validation accuracy {final['acc']:.3f}"
        + (f" ({per_component})" if per_component else "")
        + f", margin {final['margin']:.3f}, loss {final['loss_total']:.4f}; model saved to {out}/model",
    )


if __name__ == "__main__":
    run_main(main)
