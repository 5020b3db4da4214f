"""TRL 1.12's PPOTrainer (trl.experimental.ppo; removed in 1.13) on the demo models; run in the
peer venv by bench/ppo_vs_trl.py. Its batches take the prompts in file order. Prints one JSON
line with the seconds of each iteration."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from iteration_clock import IterationClock, train_and_print_step_seconds
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl.experimental.ppo import PPOConfig, PPOTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor", required=True)
    parser.add_argument("--reward", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts-per-iteration", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="each prompt this many times in a row (TRL samples one response per row)",
    )
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="rows per forward/backward (0: all rows of an iteration)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.actor)
    prompts = pq.read_table(args.prompts).column("prompt").to_pylist()[: args.iterations * args.prompts_per_iteration]
    rows = [
        tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)
        for p in prompts
        for _ in range(args.samples_per_prompt)
    ]
    dataset = Dataset.from_dict({"input_ids": rows})
    per_iteration = args.prompts_per_iteration * args.samples_per_prompt
    micro = args.micro_batch or per_iteration
    if per_iteration % micro:
        parser.error(f"--micro-batch {micro} must divide the {per_iteration} rows of an iteration")
    policy, ref = (AutoModelForCausalLM.from_pretrained(args.actor) for _ in range(2))
    # Single-output heads on the reward model's backbone (the head shapes differ, the cost does not).
    reward, value = (
        AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1, ignore_mismatched_sizes=True)
        for _ in range(2)
    )
    for m in (reward, value):
        m.config.pad_token_id = tok.pad_token_id
    config = PPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_iteration // micro,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=args.iterations * per_iteration,
        local_rollout_forward_batch_size=micro,
        response_length=args.new_tokens,
        stop_token="eos",
        temperature=1.0,
        learning_rate=5e-4,
        kl_coef=0.02,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    clock = IterationClock()
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        callbacks=[clock],
    )
    # The prompts in file order (the order train_ppo.py draws them in), not shuffled.
    trainer.dataloader = trainer.accelerator.prepare(
        DataLoader(
            trainer.train_dataset,
            batch_size=per_iteration,
            shuffle=False,
            collate_fn=trainer.data_collator,
            drop_last=True,
        )
    )
    train_and_print_step_seconds(trainer, clock)


if __name__ == "__main__":
    main()
