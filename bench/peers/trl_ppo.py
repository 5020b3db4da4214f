"""TRL 1.12's PPOTrainer (trl.experimental.ppo; removed in 1.13) on our models; run in the peer venv
by bench/ppo_vs_trl.py (speed) and bench/frontier_vs_trl.py (reward against KL). Its batches take
the prompts in file order. The reward is train_ppo.py's reward model scorer as one head: the reward
model's heads weighted as reward_stats.json says and standardised with its mean and std (when it
has them); the value model starts from the same backbone and head (TRL's recipe: the value model
is the reward model). Prints one JSON line with the seconds of each iteration; --save writes the
trained policy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from iteration_clock import IterationClock, train_and_print_step_seconds
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
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
    parser.add_argument("--num-mini-batches", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--kl-coef", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the trained policy (HF model and tokenizer) here")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.actor)
    prompts = pq.read_table(args.prompts).column("prompt").to_pylist()[: args.iterations * args.prompts_per_iteration]
    rows = [
        tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False)
        for p in prompts
        for _ in range(args.samples_per_prompt)
    ]
    dataset = Dataset.from_dict({"input_ids": rows})
    per_iteration = args.prompts_per_iteration * args.samples_per_prompt
    per_mini_batch = per_iteration // args.num_mini_batches
    micro = args.micro_batch or per_mini_batch
    if per_iteration % args.num_mini_batches or per_mini_batch % micro:
        parser.error(f"--micro-batch {micro} must divide each of --num-mini-batches of the {per_iteration} rows")
    policy, ref = (AutoModelForCausalLM.from_pretrained(args.actor) for _ in range(2))
    reward, value = (scorer_as_one_head(args.reward, tok.pad_token_id) for _ in range(2))
    config = PPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_mini_batch // micro,
        num_mini_batches=args.num_mini_batches,
        num_ppo_epochs=1,
        total_episodes=args.iterations * per_iteration,
        local_rollout_forward_batch_size=micro,
        response_length=args.new_tokens,
        stop_token="eos",
        temperature=1.0,
        learning_rate=args.learning_rate,
        kl_coef=args.kl_coef,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=args.seed,
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
    if args.save:  # (PPOTrainer.save_model fails under transformers 5.19: an attribute its __init__ never sets)
        trainer.accelerator.unwrap_model(trainer.model).policy.save_pretrained(args.save)
        tok.save_pretrained(args.save)


def scorer_as_one_head(path: str, pad_token_id: int) -> AutoModelForSequenceClassification:
    """The reward model at ``path`` (backbone + ``Linear(hidden, C)``, one output per component) as a
    one-output sequence classifier whose output is train_ppo.py's reward: ``(sum_c w_c head_c - mean) / std``."""
    head = load_file(str(Path(path) / "model.safetensors"))  # the backbone's keys load below
    config = AutoConfig.from_pretrained(path)
    labels = [config.id2label[i] for i in sorted(config.id2label)]
    stats_path = Path(path) / "reward_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    weights = torch.tensor([stats.get("weights", {}).get(c, 1.0) for c in labels])  # (C,)
    mean, std = stats.get("mean", 0.0), stats.get("std", 1.0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, ignore_mismatched_sizes=True)
    score = torch.nn.Linear(model.config.hidden_size, 1, bias=True)
    with torch.no_grad():
        score.weight.copy_((weights @ head["score.weight"])[None] / std)
        score.bias.fill_(((weights @ head["score.bias"]).item() - mean) / std)
    model.score, model.config.pad_token_id = score, pad_token_id
    return model


if __name__ == "__main__":
    main()
