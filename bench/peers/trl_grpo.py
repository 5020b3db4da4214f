"""TRL's GRPOTrainer on the arithmetic task's SFT model, with the same math check as ours
(engine.rewards.verifiers.math_reward, called in-process as TRL calls reward functions); run in
the peer venv by bench/grpo_vs_trl.py. Prints one JSON line with the seconds of each iteration
(one generation of prompts x samples and one optimizer step over it)."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from iteration_clock import IterationClock, train_and_print_step_seconds
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from engine.rewards.verifiers import math_reward


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion's final answer equals the row's ``answer``."""
    return [math_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts-per-iteration", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per forward/backward")
    parser.add_argument("--use-vllm", action="store_true", help="TRL's colocated vLLM generation")
    args = parser.parse_args()
    torch.manual_seed(0)
    table = pq.read_table(args.prompts).slice(0, args.iterations * args.prompts_per_iteration)
    dataset = Dataset.from_dict(
        {"prompt": table.column("prompt").to_pylist(), "answer": table.column("answer").to_pylist()}
    )
    rows = args.prompts_per_iteration * args.samples_per_prompt
    if rows % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide the {rows} rows of an iteration")
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,  # one optimizer step per generation
        num_generations=args.samples_per_prompt,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=5e-4,
        beta=args.kl_coef,
        num_iterations=1,
        shuffle_dataset=False,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        seed=0,
    )
    clock = IterationClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.actor),
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.actor),
        callbacks=[clock],
    )
    train_and_print_step_seconds(trainer, clock)


if __name__ == "__main__":
    main()
