"""TRL SFTTrainer on a prepared conversations parquet; run in the peer venv by bench/sft_vs_trl.py.

Prints one JSON line: train seconds, conversations and tokens trained.
"""

from __future__ import annotations

import argparse
import json

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--packing", action="store_true", help="TRL's best-fit-decreasing packing (padding-free rows)")
    parser.add_argument(
        "--batch", type=int, default=16, help="conversations per step (unpacked) or packed rows per step"
    )
    parser.add_argument("--max-length", type=int, default=1024, help="longest row (a packed row's token budget)")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    table = pq.read_table(args.train, columns=["messages", "num_tokens"])
    train = Dataset.from_list([{"messages": m} for m in table.column("messages").to_pylist()])
    config = SFTConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        num_train_epochs=1,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        max_length=args.max_length,
        packing=args.packing,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        use_cpu=True,
        seed=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    result = trainer.train()
    print(
        json.dumps(
            {
                "train_seconds": result.metrics["train_runtime"],
                "conversations": len(train),
                "tokens": sum(table.column("num_tokens").to_pylist()),
                "loss": result.metrics["train_loss"],
            }
        )
    )


if __name__ == "__main__":
    main()
