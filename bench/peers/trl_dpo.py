"""TRL DPOTrainer on prepared preference parquet files; run in the peer venv by bench/dpo_vs_trl.py.

Prints one JSON line: train seconds, pairs trained, the last logged train loss, held-out loss and
reward accuracy.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl_reward import pair_trainer_arguments, to_trl


def main() -> None:
    parser = pair_trainer_arguments()
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    train, validation = to_trl(args.train), to_trl(args.validation)
    config = DPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        beta=args.beta,
        max_length=1024,  # no truncation: the data's pairs are at most 512 tokens each
        bf16=False,  # TRL 1.16's DPOConfig defaults to bf16 autocast and gradient checkpointing: off, as ours runs
        gradient_checkpointing=False,  # (fp32, no recomputation); on 2 CPU cores they made it ~20x slower
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        use_cpu=True,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model, args=config, train_dataset=train, eval_dataset=validation, processing_class=tokenizer
    )
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    print(
        json.dumps(
            {
                "train_seconds": result.metrics["train_runtime"],
                "pairs": len(train) * args.epochs,
                "last_loss": sum(losses[-3:]) / len(losses[-3:]),
                "eval_loss": metrics["eval_loss"],
                "accuracy": metrics["eval_rewards/accuracies"],
            }
        )
    )


if __name__ == "__main__":
    main()
