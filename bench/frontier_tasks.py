"""The frontier bench's tasks: how each builds its data, SFT model and reward model (their true rules
are in bench/frontier_eval.py).

- ``demo``: the demo's synthetic task (data_prep/synthetic_task.py), ``make demo``'s stages;
  reward model 0.96 accurate on held-out pairs.
- ``lists``: data_prep/list_task.py, lists of words of a category, a reward model trained on few,
  carelessly labelled pairs (some by "the longer list wins"), and a chat template whose generation
  prompt ends ``assistant:`` while a closed turn renders ``assistant: `` + content.

A task's stages run once into its work directory (``runs/frontier/<task>``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rm_vs_trl import run

TASKS = ("demo", "lists")
LIST_PAIRS, LIST_VALIDATION_FRACTION = 3400, 0.4  # ~2,000 pairs to train on, ~1,400 held out
LIST_RM_EPOCHS = 4  # held-out label accuracy 0.667, 0.716 on the true rule (bench/frontier_rm_check.py)


def task_models(task: str, work: Path) -> Path:
    """``work`` holding the task's data/, sft/model and rm/model (built once)."""
    if not (work / "rm" / "model" / "reward_stats.json").exists():
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        if task == "demo":
            run(["bash", "data_prep/run_demo.sh", str(work)], **env)
        else:
            build_lists(work, env)
    return work


def text_reading_reward_model(work: Path) -> Path:
    """A copy of ``work``'s reward model whose chat template differs from the policy's by a Jinja
    comment alone: it renders the same text, but PPO no longer takes it for the policy's template,
    so it reads each response as decoded text rendered again (engine/ppo/rewards.py), not as the
    sampled ids. Made once, beside the reward model."""
    copy = work / "rm-text" / "model"
    if not (copy / "reward_stats.json").exists():
        from transformers import AutoTokenizer

        shutil.copytree(work / "rm" / "model", copy, dirs_exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(copy)
        tokenizer.chat_template += "{# read as text #}"
        tokenizer.save_pretrained(copy)
    return copy


def build_lists(out: Path, env: dict[str, str]) -> None:
    """The list task's stages: pairs and demonstrations, the tiny model (spaced template), parquet
    splits, SFT (ds_configs/demo_sft.json) and the reward model (ds_configs/demo_rm.json, one head, 4 epochs)."""
    py, launcher = sys.executable, str(Path(sys.executable).parent / "deepspeed")
    raw, data, base = out / "raw", out / "data", out / "tiny-base"
    env |= {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    run(
        [
            *(py, "-m", "data_prep.list_task", "--out", str(raw / "pairs.jsonl"), "--num-pairs", str(LIST_PAIRS)),
            *("--demonstrations-out", str(raw / "demonstrations.jsonl"), "--seed", "0"),
        ]
    )
    run(
        [
            *(py, "-m", "data_prep.make_tiny_model", "--text", str(raw / "pairs.jsonl")),
            *("--text", str(raw / "demonstrations.jsonl"), "--out", str(base), "--chat-template", "spaced"),
        ]
    )
    prepare = ("--tokenizer", str(base), "--out", str(data), "--seed", "0")
    run([py, "-m", "data_prep.prepare_sft", "--input", str(raw / "demonstrations.jsonl"), *prepare])
    run(
        [
            *(py, "-m", "data_prep.prepare_preferences", "--input", str(raw / "pairs.jsonl"), *prepare),
            *("--validation-fraction", str(LIST_VALIDATION_FRACTION)),
        ]
    )
    common = ("--logging.wandb", "false", "--logging.progress_bar", "false", "--overwrite")
    run(
        [
            *(launcher, "--num_gpus", "1", "train/train_sft.py", "--config", "ds_configs/demo_sft.json"),
            *("--model.path", str(base), "--data.train", str(data / "sft_train.parquet")),
            *("--data.validation", str(data / "sft_validation.parquet"), "--logging.output_dir", str(out / "sft")),
            *common,
        ],
        **env,
    )
    run(
        [
            *(launcher, "--num_gpus", "1", "train/train_rm.py", "--config", "ds_configs/demo_rm.json"),
            *("--model.path", str(out / "sft" / "model"), "--rm.components", '{"reward": 1.0}'),
            *("--data.train", str(data / "train.parquet"), "--data.validation", str(data / "validation.parquet")),
            *("--train.epochs", str(LIST_RM_EPOCHS), "--logging.output_dir", str(out / "rm"), *common),
        ],
        **env,
    )
