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
from functools import partial

from engine.data.conversations import Conversation, conversations_that_fit, load_conversations
from engine.data.errors import DataFileError
from engine.run.dry_run import sft_plan
from engine.run.launch import run_main, start_run
from engine.run.supervised import SupervisedRun
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
    budget, per_step = cfg.train.max_tokens_per_micro_batch, cfg.train.conversations_per_step
    sup = SupervisedRun(cfg, run_args, rank, world)
    train = load_fitting_conversations(cfg.data.train, sup.tokenizer, budget, rank)
    validation = (
        load_fitting_conversations(cfg.data.validation, sup.tokenizer, budget, rank) if cfg.data.validation else []
    )
    if run_args.dry_run:
        return sft_plan(cfg, train, validation, sup.ds_config, world, run_args.device_memory_gib) if rank == 0 else 0
    run = sup.open(train, per_step, {"conversations_per_step": per_step})

    engine = sup.start(desc="sft")
    sup.announce(f"train_sft: {len(train)} train / {len(validation)} validation conversations")
    pad = sup.tokenizer.pad_token_id
    evaluate = partial(evaluate_conversations, engine, validation, budget, pad) if validation else None
    ended = sup.train("sft", lambda batch, _, step: sft_step(engine, batch, budget, pad, step), evaluate)
    if ended is not None:
        return ended

    last = sup.last_metrics
    summary = f"last train loss {last['sft/loss']:.3f}" if last else f"{run.step} steps"
    if evaluate is not None:
        final = sup.evaluate_final(evaluate)
        summary = f"validation loss {final['loss']:.3f} (perplexity {final['perplexity']:.2f}), " + summary
    return sup.export(summary)


if __name__ == "__main__":
    run_main(main)
