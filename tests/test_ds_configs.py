"""Every shipped DeepSpeed config holds what it is documented to be and builds a real engine, as the
train scripts build it, that trains the tiny model with its settings in effect (gloo, CPU); the demo
run configs chain SFT -> RM -> PPO."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_repeats, assert_same_weights, run_ranks

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "ds_config_steps.py"
# DeepSpeed configs (the folder also holds the demo run configs, which point at one of these).
CONFIGS = sorted(
    p.name for p in (REPO / "ds_configs").glob("*.json") if "zero_optimization" in json.loads(p.read_text())
)
# What the README's ds_configs/ row documents: name -> (ZeRO stage, weights dtype, what is offloaded to the CPU).
DOCUMENTED = {
    "zero2.json": (2, "bfloat16", ()),
    "zero3.json": (3, "bfloat16", ()),
    "zero3_offload.json": (3, "bfloat16", ("optimizer", "parameters")),
    "tiny_cpu_zero2.json": (2, "float32", ()),
    "tiny_cpu_zero3.json": (3, "float32", ()),
}
REFERENCE = "tiny_cpu_zero2.json"  # the fp32 run every config's loss curve is compared with
# Two ranks against one: AdamW divides each gradient by its own magnitude, so where a gradient is ~0 the
# order of the ranks' sum (float rounding) moves a weight by up to 3e-6 (over assert_same_weights' 1e-6),
# but each tensor stays within 1e-6 of its norm; without the gradient all-reduce it is off by 1e-3 to 0.1.
TWO_RANK_WEIGHTS_REL = 1e-4
BF16_LOSS_ABS = 0.01  # bf16 weights follow the fp32 curve to ~3e-3 here; one step moves the loss by 0.4-0.6


def in_effect(stage: int, dtype: str, offloads: tuple[str, ...]) -> str:
    """``describe_engine``'s line for these settings."""
    return f"ZeRO-{stage}, {dtype} weights, offload: {' + '.join(offloads) or 'none'}, gradient checkpointing off"


def reports(stdout: str) -> list[dict]:
    """The JSON lines the script printed."""
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def run_steps(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return reports(result.stdout)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory) -> dict[str, dict]:
    """Every config, one after another in one process (one start-up); ``weights``: the trained weights."""
    out = tmp_path_factory.mktemp("ds_configs_one_rank")
    results = run_steps([sys.executable, str(SCRIPT), str(tiny_model_dir), *CONFIGS, "--save-weights", str(out)])
    assert [r["config"] for r in results] == CONFIGS
    return {r["config"]: {**r, "weights": out / f"{r['config']}.pt"} for r in results}


def test_shipped_configs_cover_the_documented_set():
    """The README documents exactly the shipped DeepSpeed configs, and each holds the ZeRO stage, dtype
    and offloads it is documented with, in the keys the engine reads; the keys the scripts own (batch,
    optimizer, schedule, fp16) are left to them."""
    from engine.run_config import resolve_deepspeed_dtype

    rows = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith("| `ds_configs/`")]
    assert len(rows) == 1, "README: no row for ds_configs/ in the layout table"
    assert set(re.findall(r"`(\w+\.json)`", rows[0])) == set(DOCUMENTED) == set(CONFIGS), rows[0]
    for name, (stage, dtype, offloads) in DOCUMENTED.items():
        cfg = json.loads((REPO / "ds_configs" / name).read_text())
        zero = cfg["zero_optimization"]
        assert zero["stage"] == stage, name
        # (resolve_deepspeed_dtype refuses the keys the scripts own)
        assert resolve_deepspeed_dtype(cfg, None, "model.bf16") is (dtype == "bfloat16"), name
        assert (cfg.get("bf16") or {}).get("enabled", False) is (dtype == "bfloat16"), name
        assert not (cfg.get("fp16") or {}).get("enabled", False), name
        for key, what in (("offload_optimizer", "optimizer"), ("offload_param", "parameters")):
            assert (zero.get(key) or {}).get("device", "none") == ("cpu" if what in offloads else "none"), (name, key)
        if "optimizer" in offloads:  # else DeepSpeed refuses our torch AdamW next to an offloaded optimizer
            assert cfg.get("zero_force_ds_cpu_optimizer") is False, name
        if name.startswith("tiny_cpu") and stage == 3:  # partition the tiny model's parameters (< 1e5 elements) too
            assert zero["stage3_param_persistence_threshold"] == 0, name


@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains(one_rank, name):
    """What the config asks for is in effect in the engine (read from the engine), and the loss falls at
    every step along the fp32 reference's curve (to float rounding in fp32, to bf16 rounding in bf16)."""
    result, reference = one_rank[name], one_rank[REFERENCE]["losses"]
    cfg = json.loads((REPO / "ds_configs" / name).read_text())
    zero, bf16 = cfg["zero_optimization"], (cfg.get("bf16") or {}).get("enabled", False)
    offloads = tuple(
        what
        for key, what in (("offload_optimizer", "optimizer"), ("offload_param", "parameters"))
        if (zero.get(key) or {}).get("device", "none") != "none"
    )
    assert result["world"] == 1
    assert result["in_effect"] == in_effect(zero["stage"], "bfloat16" if bf16 else "float32", offloads)
    losses = result["losses"]
    assert len(losses) == 3 and all(later < earlier - 0.1 for earlier, later in itertools.pairwise(losses)), losses
    if bf16:
        assert losses == pytest.approx(reference, abs=BF16_LOSS_ABS)
    else:
        assert_repeats(dict(enumerate(losses)), dict(enumerate(reference)))


def test_fp32_zero2_and_zero3_agree(one_rank):
    a, b = one_rank["tiny_cpu_zero2.json"], one_rank["tiny_cpu_zero3.json"]
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-5)
    assert_same_weights(torch.load(a["weights"]), torch.load(b["weights"]))


def test_two_ranks_take_the_steps_of_one(one_rank, tiny_model_dir, tmp_path):
    """Two ranks, each on its half of the global batch, take the steps one rank takes on all of it:
    the same mean loss at every step and the same weights at the end. Without the gradient's
    all-reduce each rank's partition would follow its own half's gradient."""
    cmd = [str(SCRIPT), str(tiny_model_dir), "tiny_cpu_zero3.json", "--save-weights", str(tmp_path)]
    (result,) = reports(run_ranks(cmd, ranks=2).stdout)
    single = one_rank["tiny_cpu_zero3.json"]
    assert result["world"] == 2 and result["in_effect"] == single["in_effect"]
    rank0, rank1 = result["rank_losses"]
    assert rank0[0] != pytest.approx(rank1[0], abs=1e-4)  # different data on each rank
    assert_repeats(dict(enumerate(result["losses"])), dict(enumerate(single["losses"])), what="mean loss over ranks")
    two, one = torch.load(tmp_path / "tiny_cpu_zero3.json.pt"), torch.load(single["weights"])
    assert two.keys() == one.keys()
    gaps = {k: ((two[k] - one[k]).norm() / one[k].norm()).item() for k in one}
    assert max(gaps.values()) < TWO_RANK_WEIGHTS_REL, gaps


def demo_commands() -> dict[str, list[str]]:
    """Script -> the arguments data_prep/run_demo.sh runs it with (its output folder ``runs/demo``)."""
    text = (REPO / "data_prep" / "run_demo.sh").read_text().replace("\\\n", " ").replace("$out", "runs/demo")
    commands = {}
    for line in text.splitlines():
        if m := re.match(r"deepspeed --num_gpus 1 train/(train_\w+)\.py (.*)", line.strip()):
            commands[m[1]] = shlex.split(m[2])
    return commands


def test_demo_run_configs_load():
    """The demo's run configs load into their classes and chain as `make demo` runs them: SFT from the
    tiny base model, the RM from SFT's exported model, PPO's actor and DPO's policy from SFT's, PPO's
    reward model from the RM's, DPO on the RM's pairs; data from the folder the data preparation writes,
    tokenized with the base model's tokenizer; fp32 ZeRO-3 for all four; the PPO settings the demo's
    README figures come from."""
    from engine.config import config_to_dict, load_config
    from engine.run_config import SCRIPT_CONFIGS

    demo = demo_commands()
    assert sorted(demo) == sorted(SCRIPT_CONFIGS)
    cfgs = {}
    for script, args in demo.items():
        assert args[:2] == ["--config", f"ds_configs/demo_{script.removeprefix('train_')}.json"], args
        overrides = [a for a in args[2:] if a not in ("--overwrite", "--resume")]
        cfgs[script] = load_config(SCRIPT_CONFIGS[script], str(REPO / args[1]))
        # run_demo.sh only repeats the configs' own paths (for out = runs/demo)
        with_overrides = load_config(SCRIPT_CONFIGS[script], str(REPO / args[1]), overrides)
        assert config_to_dict(with_overrides) == config_to_dict(cfgs[script]), script
    sft, rm, ppo, dpo = cfgs["train_sft"], cfgs["train_rm"], cfgs["train_ppo"], cfgs["train_dpo"]
    exported = lambda cfg: f"{cfg.logging.output_dir}/model"  # where the scripts save the HF model
    tokenizers = set(re.findall(r"--tokenizer \"\$out/([\w-]+)\"", (REPO / "data_prep" / "run_demo.sh").read_text()))
    assert {f"runs/demo/{t}" for t in tokenizers} == {sft.model.path} == {"runs/demo/tiny-base"}
    assert rm.model.path == exported(sft) and ppo.actor.path == exported(sft) and dpo.model.path == exported(sft)
    assert (dpo.data.train, dpo.data.validation) == (rm.data.train, rm.data.validation)
    assert ppo.reward_model.path == exported(rm) and ppo.critic.init_from == "reward_model"
    assert len({cfg.logging.output_dir for cfg in cfgs.values()}) == 4
    data = {
        "runs/demo/data/" + name
        for name in ("sft_train", "sft_validation", "train", "validation", "prompts_train", "prompts_validation")
    }
    paths = [sft.data.train, sft.data.validation, rm.data.train, rm.data.validation, ppo.data.prompts]
    assert {p.removesuffix(".parquet") for p in [*paths, ppo.data.eval_prompts]} == data
    for cfg, model in ((sft, sft.model), (rm, rm.model), (ppo, ppo.actor), (dpo, dpo.model)):
        assert cfg.deepspeed["zero_optimization"]["stage"] == 3 and model.bf16 is False
    assert sft.deepspeed == rm.deepspeed == ppo.deepspeed
    assert set(rm.rm.components) == {"helpful", "harmless"}  # the synthetic task's reward components
    rollout = ppo.rollout.prompts_per_iteration * ppo.rollout.samples_per_prompt
    assert (ppo.rollout.sampler, rollout // ppo.ppo.mini_batch_size) == ("vllm", 2)
    assert (ppo.train.iterations, ppo.train.eval_every) == (20, 10)


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
