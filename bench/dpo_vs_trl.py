"""DPO training throughput and held-out loss: train/train_dpo.py vs TRL's DPOTrainer.

    python bench/dpo_vs_trl.py [--data hh|synthetic] [--peer-venv bench/.peer-trl]

Same run, same machine, same data and model (the tiny Llama, h128, 4 layers, byte-BPE trained on
the data's text, as bench/rm_vs_trl.py), sigmoid DPO with beta 0.1, AdamW betas (0.9, 0.999),
linear decay, 20% of the prompts held out. ``--data``:

- ``hh`` (default): the real HH-RLHF harmless pairs (../shared/data/hh-rlhf, sequences <= 512
  tokens so neither side truncates), one epoch, 8 pairs per step, lr 1e-4 (target: >= 2.5x TRL's
  pairs/s);
- ``synthetic``: 2,000 short pairs of the demo's synthetic task (~70 tokens per pair), two
  epochs, 32 pairs per step, lr 1e-3 (target: >= 1.5x).

TRL runs its defaults (a reference copy of the model scored each batch, padded batches) but in
fp32 without gradient checkpointing, as ours (its DPOConfig turns both on by default). Ours
computes the reference's log-probs once in a first pass (its time is counted) and packs each
step's pairs into micro-batches of <= 4,096 tokens, a pair's prompt once (ZeRO-2, one rank).
Prints pairs/s, the last logged train loss, held-out loss and reward accuracy for both and the
ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rm_vs_trl import HH, REPO, TRL_VERSION, ensure_peer_venv, prepare_pairs, run

# data set -> (epochs, pairs per step, lr)
SETTINGS = {"hh": (1, 8, 1e-4), "synthetic": (2, 32, 1e-3)}
BETA = 0.1


def run_ours(work: Path, model: Path, data: Path, epochs: int, per_step: int, lr: float) -> dict:
    config = {
        "model": {"path": str(model)},
        "data": {"train": str(data / "train.parquet"), "validation": str(data / "validation.parquet")},
        "deepspeed": "tiny_cpu_zero2.json",
        "dpo": {"loss": "dpo", "beta": BETA},
        "train": {"epochs": epochs, "pairs_per_step": per_step, "max_tokens_per_micro_batch": 4096},
        "optim": {"lr": lr, "betas": [0.9, 0.999], "warmup_ratio": 0.0, "lr_scheduler": "linear"},  # TRL's defaults
        "logging": {"output_dir": str(work / "ours"), "wandb": False, "tensorboard": False, "progress_bar": False},
    }
    (work / "ours.json").write_text(json.dumps(config))
    launcher = str(Path(sys.executable).parent / "deepspeed")
    run([launcher, "--num_gpus", "1", "train/train_dpo.py", "--config", str(work / "ours.json")])
    records = [json.loads(line) for line in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "dpo/loss" in r]
    last = steps[-max(1, len(steps) // 10) :]  # the last tenth of the run, as TRL's last logged losses
    return {
        "seconds": sum(r["timing/step_s"] for r in steps) + records[0]["timing/reference_s"],
        "reference_seconds": records[0]["timing/reference_s"],
        "last_loss": sum(r["dpo/loss"] for r in last) / len(last),
        "eval_loss": records[-1]["eval/loss"],
        "accuracy": records[-1]["eval/acc"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=sorted(SETTINGS), default="hh")
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl"))
    args = parser.parse_args()
    if args.data == "hh" and not HH.is_file():
        sys.exit(f"needs the HH-RLHF file at {HH}")
    epochs, per_step, lr = SETTINGS[args.data]
    peer_python = ensure_peer_venv(Path(args.peer_venv))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data, summary = prepare_pairs(work, args.data)
        ours = run_ours(work, model, data, epochs, per_step, lr)
        trl_out = run(
            [
                str(peer_python),
                "bench/peers/trl_dpo.py",
                *("--model", str(model), "--out", str(work / "trl")),
                *("--train", str(data / "train.parquet"), "--validation", str(data / "validation.parquet")),
                *("--batch", str(per_step), "--lr", str(lr), "--beta", str(BETA), "--epochs", str(epochs)),
            ],
            WANDB_MODE="disabled",
        )
        trl = json.loads([line for line in trl_out.splitlines() if line.startswith("{")][-1])

    pairs = summary["train"] * epochs
    ours_pps, trl_pps = pairs / ours["seconds"], trl["pairs"] / trl["train_seconds"]
    print(
        f"{summary['train']} {args.data} train pairs, {summary['validation']} held out; tiny Llama h128 L4; "
        f"{epochs} epoch(s), {per_step} pairs/step, beta {BETA}"
    )
    print(f"{'trainer':<30}{'train s':>9}{'pairs/s':>9}{'last loss':>11}{'eval loss':>11}{'eval acc':>10}")
    print(
        f"{'TRL ' + TRL_VERSION + ' DPOTrainer':<30}{trl['train_seconds']:>9.1f}{trl_pps:>9.1f}"
        f"{trl['last_loss']:>11.4f}{trl['eval_loss']:>11.4f}{trl['accuracy']:>10.3f}"
    )
    print(
        f"{'train_dpo.py (ZeRO-2, packed)':<30}{ours['seconds']:>9.1f}{ours_pps:>9.1f}"
        f"{ours['last_loss']:>11.4f}{ours['eval_loss']:>11.4f}{ours['accuracy']:>10.3f}"
    )
    print(f"(ours includes the reference pass: {ours['reference_seconds']:.1f} s)")
    print(f"speed-up: {ours_pps / trl_pps:.2f}x TRL pairs/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
