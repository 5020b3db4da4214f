"""Supervised fine-tuning of a causal LM on chat conversations (the policy PPO starts from).

    deepspeed --num_gpus N train/train_sft.py --config ds_configs/demo_sft.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and conversations -> output-directory checks ->
causal LM in a DeepSpeed engine -> start or resume the run -> loop (token-budget packed
micro-batches, loss on the assistant tokens only, one optimizer step per
``conversations_per_step`` conversations, periodic evaluation and checkpoints) -> final
evaluation -> HF model -> report.
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
from engine.data.conversations import Conversation, conversations_that_fit, load_conversations
from engine.data.errors import DataFileError
from engine.models.deepspeed_glue import (
    describe_engine,
    initialize_training_engine,
    load_partitioned,
    save_hf_model,
    training_ds_config,
)
from engine.models.loading import load_causal_lm
from engine.run.checkpoint import content_fingerprint
from engine.run.dry_run import sft_plan
from engine.run.guards import NonFiniteGuard
from engine.run.launch import run_main, start_run
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run.preflight import check_weights, load_tokenizer
from engine.run.step_metrics import optimizer_step_metrics
from engine.run_config import SFTConfig
from engine.sft.causal_lm import evaluate_conversations, sft_step


def load_fitting_conversations(path: str, tokenizer, max_tokens: int, rank: int) -> list[Conversation]:
    """The conversations of ``path`` that fit one micro-batch (those that do not are dropped and counted)."""
    conversations, dropped = conversations_that_fit(load_conversations(path, tokenizer), max_tokens)
    if not conversations:
        raise DataFileError(f"{path}: no conversation fits train.max_tokens_per_micro_batch ({max_tokens} tokens)")
    if dropped and rank == 0:
        print(
            f"{path}: dropped {dropped} of {len(conversations) + dropped} conversations longer than "
            f"train.max_tokens_per_micro_batch ({max_tokens} tokens)"
        )
    return conversations


def main() -> int:
    cfg, run_args, rank, world, _ = start_run(SFTConfig, __doc__.split("\n")[0])
    out, budget = cfg.logging.output_dir, cfg.train.max_tokens_per_micro_batch
    ds_config = training_ds_config(cfg.deepspeed, cfg.model.bf16)

    tokenizer = load_tokenizer(cfg.model.path, "model.path", cfg.model.trust_remote_code)
    check_weights(cfg.model.path, "model.path", value_head=False, trust_remote_code=cfg.model.trust_remote_code)
    train = load_fitting_conversations(cfg.data.train, tokenizer, budget, rank)
    validation = load_fitting_conversations(cfg.data.validation, tokenizer, budget, rank) if cfg.data.validation else []
    per_step = cfg.train.conversations_per_step
    steps_per_epoch, total_steps = epoch_schedule(len(train), per_step, cfg.train.epochs, cfg.train.max_steps)
    if run_args.dry_run:
        return sft_plan(cfg, train, validation, ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    run = RunLifecycle(
        output_dir=out,
        run_args=run_args,
        export_dir="model",
        checkpoint=cfg.checkpoint,
        identity={
            "model": cfg.model.path,
            "data.train": content_fingerprint(cfg.data.train),
            "conversations_per_step": per_step,
            "seed": cfg.train.seed,
            "world_size": world,
        },
    )

    model, keep_alive = load_partitioned(
        lambda: load_causal_lm(
            cfg.model.path,
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
        desc="sft",
    )
    if rank == 0:
        print(
            f"train_sft: {len(train)} train / {len(validation)} validation conversations, {total_steps} steps, {world} "
            f"rank(s), {describe_engine(engine)}"
            + (f", resumed at step {run.step} from {run.resume_from}" if run.resume_from else "")
        )
    evaluate = partial(evaluate_conversations, engine, validation, budget, tokenizer.pad_token_id)
    metrics: dict[str, float] = {}
    try:
        while run.step < total_steps:
            indices, epochs = epoch_batch(run.step, len(train), per_step, steps_per_epoch, cfg.train.seed)
            batch = [train[i] for i in indices]
            start = time.perf_counter()
            engine.train()
            step_metrics = sft_step(engine, batch, budget, tokenizer.pad_token_id, step=run.step + 1)
            seconds = time.perf_counter() - start
            run.step += 1
            run.check_step(nonfinite, run.step, engine)
            metrics = {f"sft/{k}": v for k, v in step_metrics.items()} | optimizer_step_metrics(
                "sft", engine, epochs, seconds, step_metrics["tokens"], nonfinite.skipped
            )
            if (
                validation
                and cfg.train.eval_every_steps
                and run.step % cfg.train.eval_every_steps == 0
                and run.step < total_steps
            ):
                engine.eval()
                metrics |= {f"eval/{k}": v for k, v in evaluate().items()}
            run.log(metrics, loss=f"{metrics['sft/loss']:.3f}", tok_s=f"{metrics['timing/tokens_per_s']:.0f}")
            run.end_of_step()
    except RunEnded as end:
        return run.finish(end.code, str(end))

    summary = f"last train loss {metrics['sft/loss']:.3f}" if metrics else f"{run.step} steps"
    if validation:
        engine.eval()
        final = evaluate()
        run.logger.log(run.step, {f"eval/{k}": v for k, v in final.items()})
        summary = f"validation loss {final['loss']:.3f} (perplexity {final['perplexity']:.2f}), " + summary
    save_hf_model(engine, tokenizer, os.path.join(out, "model"), {"train_config.json": config_to_dict(cfg)})
    del keep_alive
    return run.finish(0, f"{summary}; model saved to {out}/model")


if __name__ == "__main__":
    run_main(main)
