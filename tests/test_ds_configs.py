"""Every shipped DeepSpeed config builds a real engine that trains the tiny model (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import launcher_cmd

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ds_config_steps.py"
# DeepSpeed configs (the folder also holds the demo run configs, which point at one of these).
CONFIGS = sorted(
    p.name for p in (REPO / "ds_configs").glob("*.json") if "zero_optimization" in json.loads(p.read_text())
)


def run_steps(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [l for l in result.stdout.splitlines() if l.startswith("{")]
    return json.loads(line)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir) -> dict[str, dict]:
    return {name: run_steps([sys.executable, str(SCRIPT), str(tiny_model_dir), name]) for name in CONFIGS}


def test_shipped_configs_cover_the_documented_set():
    assert {"zero2.json", "zero3.json", "zero3_offload.json", "tiny_cpu_zero2.json", "tiny_cpu_zero3.json"} <= set(
        CONFIGS
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains(one_rank, name):
    result = one_rank[name]
    expected_stage = json.loads((REPO / "ds_configs" / name).read_text())["zero_optimization"]["stage"]
    assert result["stage"] == expected_stage and result["world"] == 1
    assert result["losses"][-1] < result["losses"][0]


def test_fp32_zero2_and_zero3_agree(one_rank):
    a, b = one_rank["tiny_cpu_zero2.json"]["losses"], one_rank["tiny_cpu_zero3.json"]["losses"]
    assert a == pytest.approx(b, abs=1e-5)


def test_two_ranks_under_the_deepspeed_launcher(one_rank, tiny_model_dir):
    result = run_steps([*launcher_cmd(2), str(SCRIPT), str(tiny_model_dir), "tiny_cpu_zero3.json"])
    assert result["world"] == 2
    single = one_rank["tiny_cpu_zero3.json"]["losses"]
    # Same weights and rank 0's batch -> same first loss; then the averaged gradient differs.
    assert result["losses"][0] == pytest.approx(single[0], abs=1e-6)
    assert result["losses"][1] != pytest.approx(single[1], abs=1e-6)


@pytest.mark.parametrize(
    "name, schema",
    [("demo_sft.json", "SFTConfig"), ("demo_rm.json", "RewardModelConfig"), ("demo_ppo.json", "PPOConfig")],
)
def test_demo_run_configs_load(name, schema):
    from engine import run_config
    from engine.config import load_config

    cfg = load_config(getattr(run_config, schema), str(REPO / "ds_configs" / name))
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3


def test_ppo_gpu_options_are_checked(tmp_path):
    from engine import run_config
    from engine.config import ConfigError, load_config

    demo = json.loads((REPO / "ds_configs" / "demo_ppo.json").read_text())
    demo["rollout"]["vllm_gpu_memory_utilization"] = 1.5
    path = tmp_path / "ppo.json"
    path.write_text(json.dumps(demo))
    with pytest.raises(
        ConfigError, match=r"ppo.json: 'rollout.vllm_gpu_memory_utilization' must be > 0 and < 1, got 1.5"
    ):
        load_config(run_config.PPOConfig, str(path))
