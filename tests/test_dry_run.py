"""--dry-run of train_rm.py and train_ppo.py (train_sft.py's is in test_train_sft.py; all three scripts have one):
the plan is printed, nothing is trained or written."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import REPO, launch, write_ppo_config, write_rm_config


def test_rm_dry_run_under_the_launcher_prints_the_plan_once(tiny_model_dir, rm_data, tmp_path):
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "run")
    out = launch("train_rm.py", config, "--dry-run", ranks=2).stdout
    assert out.count("dry run of train_rm.py (2 rank(s))") == 1  # rank 0 only
    assert "train pairs:      1,9" in out and "validation pairs:" in out
    assert "schedule: 32 pairs per step, 60 steps per epoch, 60 steps" in out
    assert "micro-batches (budget 1024 tokens, packed):" in out
    assert "reward model" in out and "parameters (trained): ZeRO-3, 2 rank(s):" in out and "per device" in out
    assert not (tmp_path / "run").exists()


def test_ppo_dry_run_counts_four_models_and_writes_nothing(tiny_model_dir, rm_run, rm_data, tmp_path):
    rm_root, _ = rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json", tiny_model_dir, rm_root / "run" / "model", rm_data, tmp_path / "run"
    )
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "train" / "train_ppo.py"),
            "--config",
            str(config),
            "--dry-run",
            "--deepspeed",
            "tiny_cpu_zero2.json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "rollout: 16 prompts x 4 samples = 64 sequences per iteration" in out
    assert "2 optimizer steps per iteration per trained model" in out
    assert re.search(r"1 \(each prompt once for its 4 samples: \d\d% fewer tokens\) per experience forward", out), (
        out
    )  # ppo.share_prompt
    for name, kind in (
        ("actor", "trained): ZeRO-2"),
        ("critic", "trained): ZeRO-2"),
        ("reference", "frozen"),
        ("reward model", "frozen"),
    ):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert kind in line, line
    assert "vLLM sampler" in out
    assert not (tmp_path / "run").exists()


def test_ppo_dry_run_shows_the_tensor_parallel_layout(tiny_model_dir, rm_run, rm_data, tmp_path):
    """The plan's vLLM line on 2 ranks: an engine each, or one engine split over both (the launched
    dry run itself: test_ppo_dry_run_counts_four_models_and_writes_nothing)."""
    from engine.config import load_config
    from engine.run.dry_run import vllm_memory
    from engine.run_config import PPOConfig

    rm_root, _ = rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json", tiny_model_dir, rm_root / "run" / "model", rm_data, tmp_path / "run"
    )
    lines = {
        tp: vllm_memory(load_config(PPOConfig, str(config), ["--rollout.tensor_parallel_size", str(tp)]), 2)
        for tp in (1, 2)
    }
    assert lines[1].startswith("2 engine(s), one per rank: ") and lines[2].startswith(
        "1 engine(s) of tensor parallel size 2: "
    )
    weights = {tp: float(line.split(": ")[-1].split(" MiB weights per rank")[0]) for tp, line in lines.items()}
    assert weights[2] == pytest.approx(weights[1] / 2, abs=0.1)
