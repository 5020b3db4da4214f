"""--dry-run of train_rm.py and train_ppo.py (train_sft.py's is in test_train_sft.py; all three scripts have one):
the plan is printed, nothing is trained or written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO, faults, launch, run_script, write_ppo_config, write_rm_config


def test_rm_dry_run_on_two_ranks_prints_the_plan_once(tiny_model_dir, rm_data, tmp_path):
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
            "--device-memory-gib",
            "0.5",
            "--reward_model.length_debias",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "rollout: 16 prompts x 4 samples = 64 sequences per iteration" in out
    assert "score: 1 x reward model (normalised, its slope on length taken out per batch)" in out, out
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
    # trained from the actor's model: its tokenizer and template, so it reads the sampled ids (demo ChatML: no change)
    assert "reward_model reads the sampled token ids (it shares the actor's tokenizer and chat template)\n" in out
    # the total per device (vLLM: 40% of the given 0.5 GiB, asleep while training) and the verdict
    assert re.search(r"per device: .* \+ activations 0\.\d\d \+ vLLM 0\.20 GiB; peak 0\.\d\d GiB \(vLLM sleeps", out), (
        out
    )
    assert "fits 0.5 GiB: yes, 0." in out
    assert not (tmp_path / "run").exists()


def test_ppo_dry_run_refuses_a_code_sandbox_without_namespaces_unless_allowed(tiny_model_dir, rm_data, tmp_path):
    """Where the code sandbox cannot create namespaces (RLHF_FAULTS no_namespaces: the probe finds mode
    "none" only), a run with rewards.code stops before any model loads, exit 2 naming
    rewards.code.allow_unisolated; with that key true the plan says what the code runs with."""
    prompts = pq.read_table(rm_data / "prompts_train.parquet")
    tests = pa.array([["assert f(1) == 1"]] * prompts.num_rows)
    pq.write_table(prompts.append_column("tests", tests), tmp_path / "prompts.parquet")
    config = tmp_path / "ppo.json"
    config.write_text(
        json.dumps(
            {
                "actor": {"path": str(tiny_model_dir)},
                "rewards": {"code": {}, "workers": 1},
                "data": {"prompts": str(tmp_path / "prompts.parquet")},
                "deepspeed": "tiny_cpu_zero2.json",
                "rollout": {"sampler": "hf", "prompts_per_iteration": 4, "samples_per_prompt": 2},
                "ppo": {"advantage_estimator": "grpo", "mini_batch_size": 8},
                "logging": {"output_dir": str(tmp_path / "run")},
            }
        )
    )
    refused = run_script("train_ppo.py", config, "--dry-run", env=faults(no_namespaces=True))
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = next(line for line in refused.stderr.splitlines() if line.startswith("config error: "))
    assert said.startswith(f"config error: {config}: 'rewards.code.allow_unisolated' is false and the code sandbox "), (
        said
    )
    assert "model-written code would run with the uid of the trainer or reward server" in said
    assert "Traceback" not in refused.stderr
    allowed = run_script(
        "train_ppo.py", config, "--dry-run", "--rewards.code.allow_unisolated", "true", env=faults(no_namespaces=True)
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    warning = "warning: the code sandbox runs without isolation here: model-written code runs with"
    assert warning in allowed.stdout
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


def test_the_memory_total_of_a_llama_3_8b_run_and_whether_it_fits(tmp_path):
    """Llama-3-8B's shape (a config, no weights), PPO on 8 ranks under ZeRO-3 in bf16: each model's
    states per device as DeepSpeed estimates them, activations of a 4,096-token micro-batch, vLLM's
    share of the device, the peak (vLLM asleep while the trainers train) and the verdict."""
    from types import SimpleNamespace

    from real_shape import LLAMA_3_8B
    from transformers import LlamaConfig

    from engine.models.deepspeed_glue import training_ds_config
    from engine.run.memory_budget import DeviceBudget, activation_bytes, print_models

    LLAMA_3_8B.save_pretrained(tmp_path)
    model = SimpleNamespace(path=str(tmp_path), trust_remote_code=False, bf16=True, gradient_checkpointing=False)
    ds_config = training_ds_config(json.loads((REPO / "ds_configs" / "zero3.json").read_text()), True)
    path = str(tmp_path)
    states = print_models(
        [
            ("actor", path, False, None, True),
            ("critic", path, True, ["value"], True),
            ("reference", path, False, None, False),
            ("reward model", path, True, ["reward"], False),
        ],
        ds_config,
        8,
        model,
    )
    assert {k: round(v / 2**30, 2) for k, v in states.items()} == {
        "actor": 18.78,
        "critic": 17.68,
        "reference": 1.87,
        "reward model": 1.75,
    }
    config = LlamaConfig.from_pretrained(tmp_path)
    # 4,096 tokens x 32 layers x (7 x 4096 + 2 x 1024 + 4 x 14336) x 2 bytes, + one head chunk in fp32
    assert activation_bytes(config, 4096, True, False) == 4096 * 32 * 88064 * 2 + 3 * 1024 * 128256 * 4
    assert activation_bytes(config, 4096, True, True) < activation_bytes(config, 4096, True, False) / 6
    fits = DeviceBudget(states, activation_bytes(config, 4096, True, False), 0.4 * 80 * 2**30, sampler_sleeps=True)
    lines = fits.lines(80.0)
    assert lines[0].endswith(
        "activations 22.97 + vLLM 32.00 GiB; peak 72.08 GiB (vLLM sleeps while the trainers train)"
    )
    assert lines[1] == "fits 80 GiB: yes, 7.92 GiB to spare"
    awake = DeviceBudget(states, activation_bytes(config, 4096, True, False), 0.4 * 80 * 2**30)
    assert awake.lines(80.0)[1] == "fits 80 GiB: NO, 15.05 GiB over; the largest item is vLLM (32.00 GiB)"
