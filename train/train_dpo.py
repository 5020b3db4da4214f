"""Direct preference optimisation (DPO, IPO, SimPO) of a causal LM on preference pairs.

    deepspeed --num_gpus N train/train_dpo.py --config ds_configs/demo_dpo.json
        [--resume | --overwrite] [--dry-run] [--section.key value ...]

Recipe: config -> process group -> tokenizer and pairs -> output-directory checks -> policy in a
DeepSpeed engine (LoRA: adapters on it) -> start or resume the run -> the reference's log-probs of
every pair in one pass (a new run; a resumed one reads them from its checkpoint) -> loop
(token-budget packed micro-batches, a pair's prompt once, one optimizer step per
``pairs_per_step`` pairs, periodic evaluation and checkpoints) -> final evaluation -> HF model ->
report.
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
from engine.dpo.reference import ReferenceLogprobs
from engine.dpo.training import PreferenceLossSettings, dpo_step, evaluate_preferences
from engine.models.deepspeed_glue import (
    describe_engine,
    initialize_training_engine,
    load_partitioned,
    save_hf_model,
    training_ds_config,
)
from engine.models.loading import attention_shares_prompts, load_causal_lm
from engine.models.lora import add_adapters
from engine.run.checkpoint import content_fingerprint
from engine.run.dry_run import dpo_plan
from engine.run.guards import NonFiniteGuard
from engine.run.launch import run_main, start_run
from engine.run.lifecycle import RunEnded, RunLifecycle
from engine.run.preflight import check_weights, load_tokenizer
from engine.run.step_metrics import optimizer_step_metrics
from engine.run_config import DPOConfig


def load_pairs(path: str, tokenizer, cfg: DPOConfig, rank: int) -> list[PreferenceExample]:
    """The pairs of ``path`` that fit one micro-batch, their prompts marked to pack once where the
    attention implementation can (dpo.share_prompt)."""
    share = cfg.dpo.share_prompt and attention_shares_prompts(cfg.model.attn_implementation, cfg.model.bf16)
    return load_fitting_pairs(path, tokenizer, [], False, share, cfg.train.max_tokens_per_micro_batch, rank)


def main() -> int:
    cfg, run_args, rank, world, _ = start_run(DPOConfig, __doc__.split("\n")[0])
    out, budget = cfg.logging.output_dir, cfg.train.max_tokens_per_micro_batch
    ds_config = training_ds_config(cfg.deepspeed, cfg.model.bf16)

    tokenizer = load_tokenizer(cfg.model.path, "model.path", cfg.model.trust_remote_code)
    check_weights(cfg.model.path, "model.path", value_head=False, trust_remote_code=cfg.model.trust_remote_code)
    settings = PreferenceLossSettings.from_config(cfg.dpo)
    train, validation = (load_pairs(path, tokenizer, cfg, rank) for path in (cfg.data.train, cfg.data.validation))
    per_step = cfg.train.pairs_per_step
    steps_per_epoch, total_steps = epoch_schedule(len(train), per_step, cfg.train.epochs, cfg.train.max_steps)
    if run_args.dry_run:
        return dpo_plan(cfg, train, validation, ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    run = RunLifecycle(
        output_dir=out,
        run_args=run_args,
        export_dir="model",
        checkpoint=cfg.checkpoint,
        identity={
            "model": cfg.model.path,
            "data.train": content_fingerprint(cfg.data.train),
            "data.validation": content_fingerprint(cfg.data.validation),
            "loss": cfg.dpo.loss,
            "pairs_per_step": per_step,
            "seed": cfg.train.seed,
            "world_size": world,
        }
        | ({"lora": vars(cfg.model.lora)} if cfg.model.lora.rank else {}),
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
    if cfg.model.lora.rank:
        model = add_adapters(model, cfg.model.lora, causal_lm=True)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = initialize_training_engine(model, ds_config, **cfg.optim.schedule(total_steps))

    nonfinite = NonFiniteGuard(cfg.guards.max_nonfinite_in_a_row)
    reference = ReferenceLogprobs()
    run.track("nonfinite", nonfinite, rolls_back=False)
    run.track("reference", reference, rolls_back=False)
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
        desc=cfg.dpo.loss,
    )
    if not run.resume_from:
        start = time.perf_counter()
        engine.eval()
        reference.compute(engine, train, validation, budget, tokenizer.pad_token_id, cfg.dpo.uses_reference())
        run.logger.log(0, {"timing/reference_s": time.perf_counter() - start})
    if rank == 0:
        print(
            f"train_dpo: {cfg.dpo.loss} (beta {settings.beta}), {len(train)} train / {len(validation)} validation "
            f"pairs, {total_steps} steps, {world} rank(s), {describe_engine(engine)}"
            + (f", resumed at step {run.step} from {run.resume_from}" if run.resume_from else "")
        )
    evaluate = partial(evaluate_preferences, engine, validation, reference, settings, budget, tokenizer.pad_token_id)
    try:
        while run.step < total_steps:
            indices, epochs = epoch_batch(run.step, len(train), per_step, steps_per_epoch, cfg.train.seed)
            batch = [train[i] for i in indices]
            start = time.perf_counter()
            engine.train()
            step_metrics = dpo_step(
                engine,
                batch,
                reference.train[indices],
                settings,
                budget,
                tokenizer.pad_token_id,
                step=run.step + 1,
            )
            seconds = time.perf_counter() - start
            run.step += 1
            run.check_step(nonfinite, run.step, engine)
            metrics = {f"dpo/{k}": v for k, v in step_metrics.items()} | optimizer_step_metrics(
                "dpo", engine, epochs, seconds, sum(e.num_tokens for e in batch), nonfinite.skipped
            )
            if cfg.train.eval_every_steps and run.step % cfg.train.eval_every_steps == 0 and run.step < total_steps:
                engine.eval()
                metrics |= {f"eval/{k}": v for k, v in evaluate().items()}
            run.log(
                metrics,
                loss=f"{metrics['dpo/loss']:.3f}",
                acc=f"{metrics['dpo/acc']:.2f}",
                tok_s=f"{metrics['timing/tokens_per_s']:.0f}",
            )
            run.end_of_step()
    except RunEnded as end:
        return run.finish(end.code, str(end))

    engine.eval()
    final = evaluate()
    run.logger.log(run.step, {f"eval/{k}": v for k, v in final.items()})
    save_hf_model(engine, tokenizer, os.path.join(out, "model"), {"train_config.json": config_to_dict(cfg)})
    del keep_alive
    return run.finish(
        0,
        f"validation accuracy {final['acc']:.3f}, margin {final['margin']:.3f}, loss {final['loss']:.4f}, "
        f"KL to the reference {final['kl']:.4f} nats/token; model saved to {out}/model",
    )


if __name__ == "__main__":
    run_main(main)
