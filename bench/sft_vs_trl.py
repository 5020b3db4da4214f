"""SFT throughput: train/train_sft.py vs TRL's SFTTrainer, its packing off and on.

    python bench/sft_vs_trl.py [--peer-venv bench/.peer-trl]

Same run, same machine, same data and model: the chosen dialogues of the real HH-RLHF harmless
file (../shared/data/hh-rlhf, every assistant turn, conversations <= 1,024 tokens so nothing is
truncated), the tiny Llama (h128, 4 layers, byte-BPE 4k trained on that text), one epoch,
~16 conversations per optimizer step, lr 1e-4 with linear decay. TRL 1.16 (its peer venv, as for
bench/rm_vs_trl.py) runs padded batches of 16 conversations, and packed rows of 3,072 tokens (its
best-fit-decreasing packing, padding-free, about 16 conversations each). Ours packs 16
conversations per step into micro-batches of <= 4,096 tokens (ZeRO-2, one rank). Prints
conversation tokens per second of training for each and our ratio to TRL's best setting (target
>= 1.5x). TRL's loss covers every token (its "messages" format; assistant-only needs generation
tags in the chat template), ours the assistant's tokens only: the forward and backward cover every
token on both sides; only our LM head is cut to the trained positions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rm_vs_trl import HH, REPO, TRL_VERSION, ensure_peer_venv, run

PER_STEP = 16


def run_ours(work: Path, model: Path, data: Path) -> dict:
    config = {
        "model": {"path": str(model)},
        "data": {"train": str(data / "sft_train.parquet")},
        "deepspeed": "tiny_cpu_zero2.json",
        "train": {"epochs": 1, "conversations_per_step": PER_STEP, "max_tokens_per_micro_batch": 4096},
        "optim": {"lr": 1e-4, "betas": [0.9, 0.999], "warmup_ratio": 0.0, "lr_scheduler": "linear"},  # TRL's defaults
        "logging": {"output_dir": str(work / "ours"), "wandb": False, "tensorboard": False, "progress_bar": False},
    }
    (work / "ours.json").write_text(json.dumps(config))
    run(
        [
            str(Path(sys.executable).parent / "deepspeed"),
            "--num_gpus",
            "1",
            "train/train_sft.py",
            "--config",
            str(work / "ours.json"),
        ]
    )
    steps = [r for r in map(json.loads, (work / "ours" / "metrics.jsonl").read_text().splitlines()) if "sft/loss" in r]
    return {
        "train_seconds": sum(r["timing/step_s"] for r in steps),
        "tokens": sum(r["sft/tokens"] for r in steps),
        "loss": steps[-1]["sft/loss"],
    }


def run_trl(peer_python: Path, work: Path, model: Path, data: Path, packing: bool) -> dict:
    extra = ["--packing", "--batch", "1", "--max-length", "3072"] if packing else ["--batch", str(PER_STEP)]
    out = run(
        [
            str(peer_python),
            "bench/peers/trl_sft.py",
            "--model",
            str(model),
            "--train",
            str(data / "sft_train.parquet"),
            "--out",
            str(work / f"trl_{packing}"),
            *extra,
        ],
        WANDB_MODE="disabled",
    )
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl"))
    args = parser.parse_args()
    if not HH.is_file():
        sys.exit(f"needs the HH-RLHF file at {HH}")
    peer_python = ensure_peer_venv(Path(args.peer_venv))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = work / "tiny", work / "data"
        py = sys.executable
        run(
            [
                py,
                "-m",
                "data_prep.make_tiny_model",
                "--text",
                str(HH),
                "--out",
                str(model),
                "--vocab-size",
                "4096",
                "--num-layers",
                "4",
            ]
        )
        run(
            [
                py,
                "-m",
                "data_prep.prepare_sft",
                "--input",
                str(HH),
                "--tokenizer",
                str(model),
                "--out",
                str(data),
                "--max-length",
                "1024",
                "--validation-fraction",
                "0",
            ]
        )
        results = {
            f"TRL {TRL_VERSION} SFTTrainer, padded": run_trl(peer_python, work, model, data, packing=False),
            f"TRL {TRL_VERSION} SFTTrainer, packed": run_trl(peer_python, work, model, data, packing=True),
            "train_sft.py (ZeRO-2, packed)": run_ours(work, model, data),
        }
    tok_s = {name: r["tokens"] / r["train_seconds"] for name, r in results.items()}
    print(f"HH harmless chosen dialogues, 1 epoch, ~{PER_STEP} conversations per step; tiny Llama h128 L4")
    print(f"{'trainer':<36}{'train s':>9}{'tokens/s':>10}{'last loss':>11}")
    for name, r in results.items():
        print(f"{name:<36}{r['train_seconds']:>9.1f}{tok_s[name]:>10.0f}{r['loss']:>11.3f}")
    best_trl = max(v for k, v in tok_s.items() if k.startswith("TRL"))
    print(f"speed-up: {tok_s['train_sft.py (ZeRO-2, packed)'] / best_trl:.2f}x TRL's best tokens/s (target 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
