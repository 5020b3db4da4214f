"""Reward-model training throughput and held-out accuracy: train/train_rm.py vs TRL's RewardTrainer.

    python bench/rm_vs_trl.py [--data hh|synthetic] [--peer-venv bench/.peer-trl]

Same run, same machine, same data and model (the tiny Llama, h128, 4 layers, byte-BPE trained
on the data's text), AdamW betas (0.9, 0.999), linear decay, 20% of the prompts held out for
accuracy. ``--data``:

- ``hh`` (default): the real HH-RLHF harmless pairs (../shared/data/hh-rlhf, sequences <= 512
  tokens so neither side truncates; p50 ~230 tokens per pair), one epoch, 8 pairs per step,
  lr 1e-4 (targets: >= 3x TRL's pairs/s; TRL reached 0.58 accuracy here);
- ``synthetic``: 2,000 short pairs of the demo's synthetic task (~70 tokens per pair), two
  epochs, 32 pairs per step, lr 1e-3 (target: >= 1.5x).

The peer runs in its own venv (TRL 1.16 installed with --no-deps on top of this project's
packages, made on first use). Prints pairs/s, real tokens/s and held-out accuracy for both and
the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
TRL_VERSION = "1.16.0"


def speed_arguments(description: str, work: str | None = None) -> argparse.ArgumentParser:
    """The options of an iteration-speed bench against a TRL trainer: --iterations, --repeats, the peer's
    venv and (where the bench keeps models) --work; the bench adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every trainer; figures are medians")
    parser.add_argument("--peer-venv", default=str(REPO / "bench" / ".peer-trl116"))
    if work is not None:
        parser.add_argument("--work", default=work)
    return parser


def ensure_peer_venv(path: Path, trl_version: str = TRL_VERSION) -> Path:
    """A venv that sees this project's packages (a .pth file) plus TRL, installed once."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        site = next((path / "lib").glob("python3*/site-packages"))
        (site / "project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"trl=={trl_version}"], check=True)
    return python


def run_process(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in the repository root with ``env`` added; its output captured, its exit status not checked."""
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env})


def run(cmd: list[str], **env: str) -> str:
    result = run_process(cmd, **env)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


# data set -> (epochs, pairs per step, lr)
SETTINGS = {"hh": (1, 8, 1e-4), "synthetic": (2, 32, 1e-3)}


def prepare_pairs(work: Path, data_set: str) -> tuple[Path, Path, dict]:
    """The tiny model (byte-BPE on the data's text) and the prepared pairs (20% of the prompts held
    out, sequences <= 512 tokens) of ``data_set`` (hh or synthetic) under ``work``: (model, data,
    prepare_preferences' summary)."""
    model, data, source = work / "tiny", work / "data", HH
    py = sys.executable
    if data_set == "synthetic":
        source = work / "pairs.jsonl"
        run([py, "-m", "data_prep.synthetic_task", "--out", str(source), "--num-pairs", "2500", "--seed", "0"])
    run(
        [
            *(py, "-m", "data_prep.make_tiny_model", "--text", str(source), "--out", str(model)),
            *("--vocab-size", "4096", "--num-layers", "4"),
        ]
    )
    run(
        [
            *(py, "-m", "data_prep.prepare_preferences", "--input", str(source), "--tokenizer", str(model)),
            *("--out", str(data), "--max-length", "512", "--max-prompt-length", "512"),
            *("--validation-fraction", "0.2"),
        ]
    )
    return model, data, json.loads((data / "summary.json").read_text())


def run_ours(work: Path, model: Path, data: Path, epochs: int, per_step: int, lr: float) -> dict:
    config = {
        "model": {"path": str(model)},
        "data": {"train": str(data / "train.parquet"), "validation": str(data / "validation.parquet")},
        "deepspeed": "tiny_cpu_zero2.json",
        "train": {"epochs": epochs, "pairs_per_step": per_step, "max_tokens_per_micro_batch": 4096},
        "optim": {"lr": lr, "betas": [0.9, 0.999], "warmup_ratio": 0.0, "lr_scheduler": "linear"},  # TRL's defaults
        "logging": {"output_dir": str(work / "ours"), "wandb": False, "tensorboard": False, "progress_bar": False},
    }
    (work / "ours.json").write_text(json.dumps(config))
    launcher = str(Path(sys.executable).parent / "deepspeed")
    run([launcher, "--num_gpus", "1", "train/train_rm.py", "--config", str(work / "ours.json")])
    records = [json.loads(line) for line in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rm/loss" in r]
    seconds = sum(r["timing/step_s"] for r in steps)
    tokens = sum(r["timing/tokens_per_s"] * r["timing/step_s"] for r in steps)
    return {"seconds": seconds, "tokens": tokens, "accuracy": records[-1]["eval/acc"]}


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
                "bench/peers/trl_reward.py",
                "--model",
                str(model),
                "--train",
                str(data / "train.parquet"),
                "--validation",
                str(data / "validation.parquet"),
                "--out",
                str(work / "trl"),
                "--batch",
                str(per_step),
                "--lr",
                str(lr),
                "--epochs",
                str(epochs),
            ],
            WANDB_MODE="disabled",
        )
        trl = json.loads([line for line in trl_out.splitlines() if line.startswith("{")][-1])

    pairs = summary["train"] * epochs
    ours_pps, trl_pps = pairs / ours["seconds"], trl["pairs"] / trl["train_seconds"]
    print(
        f"{summary['train']} {args.data} train pairs, {summary['validation']} held out; tiny Llama h128 L4; "
        f"{epochs} epoch(s), {per_step} pairs/step"
    )
    print(f"{'trainer':<28}{'train s':>9}{'pairs/s':>9}{'real tok/s':>12}{'held-out acc':>14}")
    print(
        f"{'TRL ' + TRL_VERSION + ' RewardTrainer':<28}{trl['train_seconds']:>9.1f}{trl_pps:>9.1f}{'':>12}"
        f"{trl['accuracy']:>14.3f}"
    )
    print(
        f"{'train_rm.py (ZeRO-2, packed)':<28}{ours['seconds']:>9.1f}{ours_pps:>9.1f}"
        f"{ours['tokens'] / ours['seconds']:>12.0f}{ours['accuracy']:>14.3f}"
    )
    print(f"speed-up: {ours_pps / trl_pps:.2f}x TRL pairs/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
