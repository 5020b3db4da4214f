"""Train a Bradley-Terry reward model on preference pairs.

    deepspeed --num_gpus N train/train_rm.py --config ds_configs/demo_rm.json [--resume] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and data -> value model in a DeepSpeed engine ->
loop (token-budget packed micro-batches, one optimizer step per ``pairs_per_step`` pairs,
periodic evaluation and checkpoints) -> final evaluation -> HF model with reward statistics.
"""

from __future__ import annotations

import engine.cpu_threads  # noqa: F401 -- first: OpenMP's wait policy, before torch loads libgomp

# isort: split
import math
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from engine.batching import plan_global, token_mean_scale
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
from engine.deepspeed_glue import initialize_training_engine, load_partitioned, save_hf_model, training_ds_config
from engine.distributed import shutdown_distributed
from engine.dry_run import rm_plan
from engine.faults import nan_loss_at
from engine.guards import NonFiniteGuard, TrainingAborted
from engine.models import load_value_model
from engine.preference_data import PreferenceExample, collate_pairs, epoch_order, load_preferences
from engine.reward_model import PairStats, dummy_forward_loss, evaluate_pairs, score_pairs
from engine.rm_losses import pair_losses
from engine.run_config import RewardModelConfig
from engine.run_logger import RunLogger
from engine.run_setup import GracefulStop, start_run


def train_step(
    engine, examples: list[PreferenceExample], cfg: RewardModelConfig, weights: torch.Tensor, pad_id: int, poison: bool = False
) -> dict[str, float]:
    """One optimizer step over a global mini-batch of pairs (every rank holds the whole list).
    ``poison`` multiplies the loss by NaN (fault injection, engine/faults.py)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = plan_global([e.num_tokens for e in examples], cfg.train.max_tokens_per_micro_batch, world)[rank]
    # Global counts: each loss term is a mean over the whole mini-batch (engine/batching.py).
    n_pairs = len(examples)
    n_labelled = torch.tensor([e.labels for e in examples]).ne(0).sum(0).tolist()  # per component
    stats = PairStats(list(cfg.rm.components))
    for micro in plan:
        if not micro:
            engine.backward(dummy_forward_loss(engine, pad_id))
            continue
        batch = [examples[i] for i in micro]
        r_chosen, r_rejected = score_pairs(engine, batch, pad_id)
        _, margins, labels = collate_pairs(batch)
        losses = pair_losses(r_chosen, r_rejected, weights, margins, labels)
        loss = (cfg.rm.total_loss_coef * losses.total.sum() + cfg.rm.center_coef * losses.center.sum()) * token_mean_scale(
            n_pairs, world
        )
        for c, n in enumerate(n_labelled):
            if n:
                loss = loss + losses.component[:, c].sum() * token_mean_scale(n, world)
        engine.backward(loss * float("nan") if poison else loss)
        stats.add(r_chosen, r_rejected, weights, labels, losses)
    engine.step()
    metrics = stats.reduce()
    metrics["loss"] = (
        cfg.rm.total_loss_coef * metrics["loss_total"]
        + cfg.rm.center_coef * metrics["center"]
        + sum(metrics.get(f"loss_{name}", 0.0) for name in cfg.rm.components)
    )
    return metrics


def main() -> int:
    cfg, run_args, rank, world = start_run(RewardModelConfig, __doc__.split("\n")[0])
    out = cfg.logging.output_dir
    ds_config = training_ds_config(cfg.deepspeed, cfg.model.bf16)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    components = list(cfg.rm.components)
    weights = torch.tensor([cfg.rm.components[c] for c in components])
    train = load_preferences(cfg.data.train, tokenizer, components, cfg.data.use_margin)
    validation = load_preferences(cfg.data.validation, tokenizer, components, cfg.data.use_margin)
    steps_per_epoch = math.ceil(len(train) / cfg.train.pairs_per_step)
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    if run_args.dry_run:
        return rm_plan(cfg, train, validation, ds_config, world) if rank == 0 else 0

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
    engine = initialize_training_engine(
        model,
        ds_config,
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        lr_scheduler=cfg.optim.lr_scheduler,
        warmup_steps=int(cfg.optim.warmup_ratio * total_steps),
        total_steps=total_steps,
    )

    ckpt_root = os.path.join(out, "checkpoints")
    try:  # room for keep_last + 1 checkpoints (a new one is written before the oldest goes) and the final model
        preflight_output_dir(out, (cfg.checkpoint.keep_last + 1) * checkpoint_bytes([model]) + checkpoint_bytes([model]) // 4)
    except OutputDirError as e:
        print(f"output error: {e}", file=sys.stderr)
        return 2
    # What a checkpoint must share with this run to be resumed by it.
    identity = {"model": cfg.model.path, "train_data": cfg.data.train, "components": cfg.rm.components,
                "pairs_per_step": cfg.train.pairs_per_step, "seed": cfg.train.seed, "world_size": world}
    step, resume_step = 0, None
    nonfinite = NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row)
    resume_from = latest_checkpoint(ckpt_root) if run_args.resume else None
    if resume_from:
        try:
            state = load_checkpoint(resume_from, {"model": engine}, identity, run_args.allow_config_change)
        except ResumeError as e:
            print(f"resume error: {e}", file=sys.stderr)
            return 2
        step = resume_step = state["step"]
        nonfinite.load_state_dict(state["nonfinite"])
    logger = RunLogger(
        out,
        config_to_dict(cfg),
        enabled=rank == 0,
        use_tensorboard=cfg.logging.tensorboard,
        use_wandb=cfg.logging.wandb,
        wandb_project=cfg.logging.wandb_project,
        resume_step=resume_step,
    )
    if rank == 0:
        print(f"train_rm: {len(train)} train / {len(validation)} validation pairs, {total_steps} steps, {world} rank(s)"
              + (f", resumed at step {step} from {resume_from}" if resume_from else ""))
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0 or not cfg.logging.progress_bar, desc="rm")
    evaluate = lambda: evaluate_pairs(
        engine, validation, components, weights, cfg.train.max_tokens_per_micro_batch, tokenizer.pad_token_id
    )

    def finish(code: int, message: str) -> int:
        bar.close()
        return logger.finish(code, message)

    stop = GracefulStop()
    while step < total_steps:
        # Data position is a function of the step: epoch, then the batch inside its shuffled order.
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = epoch_order(len(train), cfg.train.seed, epoch)
        batch = [train[i] for i in order[in_epoch * cfg.train.pairs_per_step : (in_epoch + 1) * cfg.train.pairs_per_step]]
        start = time.perf_counter()
        engine.train()
        metrics = {f"rm/{k}": v for k, v in train_step(engine, batch, cfg, weights, tokenizer.pad_token_id, nan_loss_at(step + 1)).items()}
        seconds = time.perf_counter() - start
        step += 1
        try:
            if nonfinite.update(engine.was_step_applied(), f"step {step}"):
                logger.event(step, "nonfinite_skip", f"optimizer step skipped: non-finite loss or gradient ({nonfinite.in_a_row} in a row)")
        except TrainingAborted as e:
            logger.event(step, "nonfinite_abort", str(e))
            return finish(3, f"training aborted: {e}")
        tokens = sum(e.num_tokens for e in batch)
        metrics |= {
            "rm/lr": engine.get_lr()[0],
            "rm/grad_norm": float(engine.get_global_grad_norm() or 0.0),
            "rm/epoch": epoch + (in_epoch + 1) / steps_per_epoch,
            "timing/step_s": seconds,
            "timing/tokens_per_s": tokens / seconds,
            "guard/nonfinite_skipped": nonfinite.skipped,
        }
        if cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0 and step < total_steps:
            engine.eval()
            metrics |= {f"eval/{k}": v for k, v in evaluate().items()}
        logger.log(step, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['rm/loss']:.3f}", acc=f"{metrics['rm/acc']:.2f}", tok_s=f"{metrics['timing/tokens_per_s']:.0f}")
        periodic = cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0
        stopping = step < total_steps and stop.requested()
        if (periodic or stopping) and step < total_steps:
            try:
                path = save_checkpoint(ckpt_root, step, {"model": engine}, {"step": step, "nonfinite": nonfinite.state_dict(),
                                       "run_identity": identity}, cfg.checkpoint.keep_last)
            except CheckpointWriteError as e:
                return finish(2, f"checkpoint error: {e}")
        if stopping:
            return finish(0, f"stopped by {stop.signal_name or 'a signal on another rank'} after step {step}: checkpoint {path}; "
                             "continue with the same command plus --resume")
    bar.close()

    engine.eval()
    final = evaluate()
    logger.log(step, {f"eval/{k}": v for k, v in final.items()})
    reward_stats = {
        "mean": final["reward_mean"],
        "std": final["reward_std"],
        "components": {c: {"mean": final[f"reward_mean_{c}"], "std": final[f"reward_std_{c}"]} for c in components},
        "weights": cfg.rm.components,
        "validation_pairs": len(validation),
    }
    save_hf_model(engine, tokenizer, os.path.join(out, "model"), {"reward_stats.json": reward_stats, "train_config.json": config_to_dict(cfg)})
    per_component = ", ".join(f"{c} {final[f'acc_{c}']:.3f}" for c in components if f"acc_{c}" in final)
    del keep_alive
    return finish(0, f"validation accuracy {final['acc']:.3f}" + (f" ({per_component})" if per_component else "")
                  + f", margin {final['margin']:.3f}, loss {final['loss_total']:.4f}; model saved to {out}/model")


if __name__ == "__main__":
    code = main()
    shutdown_distributed()
    sys.exit(code)
