"""TRL RewardTrainer on prepared preference parquet files; run in the peer venv by bench/rm_vs_trl.py.

Prints one JSON line: train seconds, pairs trained, held-out accuracy.
"""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer


def to_trl(path: str) -> Dataset:
    """Our columns -> TRL's conversational preference format."""
    rows = pq.read_table(path, columns=["prompt", "chosen", "rejected"]).to_pylist()
    return Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    )


def pair_trainer_arguments() -> argparse.ArgumentParser:
    """The arguments the preference-pair peers (this one, trl_dpo.py) take from their bench script."""
    parser = argparse.ArgumentParser()
    for name in ("--model", "--train", "--validation", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=1)
    return parser


def main() -> None:
    args = pair_trainer_arguments().parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    train, validation = to_trl(args.train), to_trl(args.validation)
    config = RewardConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        max_length=512,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        use_cpu=True,
        seed=0,
    )
    trainer = RewardTrainer(
        model=model, args=config, train_dataset=train, eval_dataset=validation, processing_class=tokenizer
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    print(
        json.dumps(
            {
                "train_seconds": result.metrics["train_runtime"],
                "pairs": len(train) * args.epochs,
                "accuracy": metrics["eval_accuracy"],
            }
        )
    )


if __name__ == "__main__":
    main()
