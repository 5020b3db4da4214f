"""TRL's GKDTrainer (trl.experimental.gkd), fully on-policy (lmbda 1), on the demo's student and
teacher; run in the peer venv by bench/distill_vs_trl.py. Prints one JSON line with the seconds of
each iteration (one generation of the step's prompts and one optimizer step over it)."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from iteration_clock import IterationClock, train_and_print_step_seconds
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.gkd import GKDConfig, GKDTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--prompts", required=True, help="parquet with a 'prompt' column of messages, in run order")
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts-per-iteration", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="each prompt repeated, as ours samples it")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per generation and forward/backward")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = args.prompts_per_iteration * args.samples_per_prompt
    if rows % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide the {rows} sequences of an iteration")
    table = pq.read_table(args.prompts).slice(0, args.iterations * args.prompts_per_iteration)
    prompts = [p for p in table.column("prompt").to_pylist() for _ in range(args.samples_per_prompt)]
    # The collator reads the prompt as every message but the last; on-policy, the last is replaced by a sample.
    dataset = Dataset.from_dict({"messages": [p + [{"role": "assistant", "content": "."}] for p in prompts]})
    config = GKDConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch,  # one optimizer step per iteration
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        lmbda=1.0,  # every sequence sampled by the student
        beta=args.beta,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        num_train_epochs=1,
        max_steps=args.iterations,
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        use_cpu=True,
        seed=0,
    )
    clock = IterationClock()
    trainer = GKDTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.student),
        teacher_model=AutoModelForCausalLM.from_pretrained(args.teacher),
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.student),
        callbacks=[clock],
    )
    train_and_print_step_seconds(trainer, clock)


if __name__ == "__main__":
    main()
