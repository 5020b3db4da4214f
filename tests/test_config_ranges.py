"""Every config field at its boundaries: built, or refused naming the file and the dotted key;
the JSON Schema export agrees with the loader and ships with the project."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from engine.config import DS_CONFIGS_DIR, Config, ConfigError, build_config, config_to_dict
from engine.run_config import SCRIPT_CONFIGS, DPOConfig, PPOConfig, RewardModelConfig, SFTConfig, schemas

DS = {"zero_optimization": {"stage": 3}}
MINIMAL = {
    SFTConfig: {"model": {"path": "m"}, "data": {"train": "t.parquet"}, "deepspeed": DS},
    RewardModelConfig: {
        "model": {"path": "m"},
        "data": {"train": "t.parquet", "validation": "v.parquet"},
        "deepspeed": DS,
    },
    PPOConfig: {
        "actor": {"path": "a"},
        "reward_model": {"path": "r"},
        "data": {"prompts": "p.parquet"},
        "deepspeed": DS,
    },
    DPOConfig: {
        "model": {"path": "m"},
        "data": {"train": "t.parquet", "validation": "v.parquet"},
        "deepspeed": DS,
    },
}
BOUNDARY_VALUES = [
    0,
    1,
    -1,
    2,
    0.5,
    -0.5,
    1e-300,
    10**30,
    -(10**30),
    1e308,
    float("nan"),
    float("inf"),
    "x",
    "",
    None,
    True,
    [],
    {},
    [0.9, 0.95],
    {"a": 1.0},
]


def leaf_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every non-section field of a config class."""
    out = []
    for name, f in cls.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, Config):
            out += leaf_fields(f.annotation, f"{prefix}{name}.")
        elif name != "deepspeed":
            out.append(prefix + name)
    return out


def with_value(base: dict, dotted: str, value) -> dict:
    data = json.loads(json.dumps(base))
    *sections, name = dotted.split(".")
    node = data
    for s in sections:
        node = node.setdefault(s, {})
    node[name] = value
    return data


CASES = [(cls, key, value) for cls in MINIMAL for key in leaf_fields(cls) for value in BOUNDARY_VALUES]


@pytest.mark.parametrize("cls", list(MINIMAL), ids=lambda c: c.__name__)
def test_every_field_at_every_boundary_builds_or_is_refused_by_name(cls):
    schema = schemas()[next(f"{name}.schema.json" for name, c in SCRIPT_CONFIGS.items() if c is cls)]
    validator = jsonschema.Draft202012Validator(schema)
    build_config(cls, MINIMAL[cls], source="run.json")  # the minimal config itself is valid
    refused = 0
    for key in leaf_fields(cls):
        for value in BOUNDARY_VALUES:
            data = with_value(MINIMAL[cls], key, value)
            schema_ok = validator.is_valid(json.loads(json.dumps(data)))  # what an editor would say
            try:
                build_config(cls, data, source="run.json")
            except ConfigError as e:
                refused += 1
                assert str(e).startswith("run.json: ") and key.split(".")[-1] in str(e), (key, value, str(e))
            else:
                assert schema_ok, f"the loader accepts {key}={value!r}, the schema does not"
                assert not (isinstance(value, float) and not math.isfinite(value)), (key, value)
    assert refused > len(leaf_fields(cls)) * 5  # most boundary values are wrong somewhere


@pytest.mark.parametrize(
    "override, message",
    [
        (("ppo.mini_batch_size", 0), "'ppo.mini_batch_size' must be >= 1, got 0"),
        (("rollout.prompts_per_iteration", 0), "'rollout.prompts_per_iteration' must be >= 1, got 0"),
        (("ppo.kl_target", 0), "'ppo.kl_target' must be > 0, got 0"),
        (("optim.lr", -1e-5), "'optim.lr' must be > 0, got -1e-05"),
        (("rollout.temperature", -1.0), "'rollout.temperature' must be > 0, got -1.0"),
        (("ppo.clip_ratio", -0.2), "'ppo.clip_ratio' must be > 0 and < 1, got -0.2"),
        (("ppo.lam", 1.5), "'ppo.lam' must be >= 0 and <= 1, got 1.5"),
        (("optim.betas", [0.9, 1.0]), "'optim.betas' must be >= 0 and < 1, got 1.0"),
        (("actor.attn_implementation", "flash"), "'actor.attn_implementation' must be one of ['auto', 'sdpa_varlen'"),
        (("train.seed", 2**40), "'train.seed' must be >= 0 and <= 2.14748e+09, got 1099511627776"),
        (("optim.lr", float("nan")), "'optim.lr' must be a finite number, got NaN"),
        (("rollout.max_new_tokens", 2048), "'max_new_tokens' (2048) must be below vllm_max_model_len (1024)"),
    ],
)
def test_values_that_once_crashed_are_refused_by_key(override, message):
    with pytest.raises(ConfigError) as refused:
        build_config(PPOConfig, with_value(MINIMAL[PPOConfig], *override), source="run.json")
    assert message in str(refused.value)


def test_shipped_schemas_are_current_and_accept_the_shipped_configs():
    folder = Path(DS_CONFIGS_DIR) / "schema"
    for name, schema in schemas().items():
        assert json.loads((folder / name).read_text()) == schema, (
            f"regenerate with: python -m engine.run_config ({name})"
        )
    run_configs = [c for c in Path(DS_CONFIGS_DIR).glob("*.json") if "$schema" in json.loads(c.read_text())]
    assert {"demo_ppo.json", "arithmetic_grpo.json"} <= {c.name for c in run_configs}
    for config in run_configs:
        data = json.loads(config.read_text())
        schema = json.loads((config.parent / data["$schema"]).read_text())
        jsonschema.Draft202012Validator(schema).validate(data)


@pytest.mark.parametrize(
    "deepspeed, model, message",
    [
        (
            {"fp16": {"enabled": True}},
            {},
            "'deepspeed.fp16' is not supported (no loss scaling here): use bf16 (set model.bf16 true)",
        ),
        (
            {"train_batch_size": 256},
            {},
            "'deepspeed.train_batch_size' (256) is set by the scripts: batches are packed to a token budget",
        ),
        ({"gradient_accumulation_steps": 8}, {}, "'deepspeed.gradient_accumulation_steps' (8) is set by the scripts"),
        (
            {"optimizer": {"type": "Adam"}},
            {},
            "'deepspeed.optimizer' is set by the scripts (torch AdamW, transformers schedules): use optim",
        ),
        (
            {"bf16": {"enabled": True}},
            {"bf16": False},
            "'deepspeed.bf16.enabled' (true) and 'model.bf16' (false) disagree",
        ),
    ],
)
def test_deepspeed_keys_the_scripts_own_are_refused_not_dropped(deepspeed, model, message):
    data = MINIMAL[RewardModelConfig] | {"deepspeed": DS | deepspeed, "model": {"path": "m", **model}}
    with pytest.raises(ConfigError) as refused:
        build_config(RewardModelConfig, data, source="run.json")
    assert message in str(refused.value)


def test_bf16_follows_the_deepspeed_config_unless_the_run_config_says():
    build = lambda ds, **model: build_config(
        RewardModelConfig,
        MINIMAL[RewardModelConfig] | {"deepspeed": ds, "model": {"path": "m", **model}},
        source="run.json",
    )
    assert build("zero3.json").model.bf16 is True  # labelled bf16, trains bf16
    assert build("tiny_cpu_zero3.json").model.bf16 is False
    assert build("tiny_cpu_zero3.json", bf16=True).model.bf16 is True
    assert build({**DS, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": "auto"}).model.bf16 is False


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"ppo": {"advantage_estimator": "grpo"}},
            "ppo.advantage_estimator grpo compares the samples of a prompt: set rollout.samples_per_prompt >= 2",
        ),
        (
            {"ppo": {"advantage_estimator": "rloo"}, "rollout": {"samples_per_prompt": 1}},
            "rloo compares the samples of a prompt",
        ),
        (
            {"ppo": {"advantage_estimator": "reinforce_pp"}, "critic": {"warmup_iterations": 2}},
            "critic.warmup_iterations needs a critic, and ppo.advantage_estimator reinforce_pp has none",
        ),
        (
            {"actor": {"path": "m", "lora": {"rank": 8, "target_modules": []}}},
            "actor.lora: 'target_modules' needs at least one layer name",
        ),
        ({"critic": {"lora": {"rank": -1}}}, "critic.lora.rank"),
        ({"critic": {"lora": {"dropout": 1.0}}}, "critic.lora.dropout"),
        (
            {"ppo": {"rollout_correction": {}, "old_logprobs_from": "sampler"}},
            "ppo.rollout_correction corrects the gap between the sampler's and the actor's",
        ),
        (
            {"ppo": {"tis_cap": 2.0}},
            "unknown key 'ppo.tis_cap' in 'ppo': replaced by ppo.rollout_correction: tis_cap C is "
            '{"level": "token", "mode": "truncate", "high": C}',
        ),
        ({"ppo": {"rollout_correction": {"high": 0.5}}}, "'ppo.rollout_correction.high' must be >= 1, got 0.5"),
        (
            {"ppo": {"rollout_correction": {"low": 0.5}}},
            "ppo.rollout_correction: 'low' (0.5) bounds mode mask; mode truncate caps the ratio at 'high' only",
        ),
        ({"ppo": {"rollout_correction": {"level": "geometric"}}}, "'ppo.rollout_correction.level' must be one of"),
        ({"monitors": {"action": "rollback"}}, "monitors.action rollback returns to the last good evaluation"),
        ({"monitors": {"action": "pause"}}, "monitors.action"),
        (
            {"judge": {"rewards": {"format": {"pattern": "x"}}}},
            "judge scores held-out responses: set data.eval_prompts",
        ),
        ({"ppo": {"importance_ratio": "sequence", "clip_ratio_c": 3.0}}, "ppo.importance_ratio sequence (GSPO)"),
        ({"ppo": {"loss_aggregation": "seq_mean"}}, "ppo.loss_aggregation"),
        (
            {"rollout": {"dynamic_sampling": True}},
            "rollout.dynamic_sampling drops the prompts whose samples score alike, which carry no signal under a group "
            "estimator; ppo.advantage_estimator gae still learns from them",
        ),
        ({"rollout": {"max_generation_rounds": 0}}, "rollout.max_generation_rounds"),
    ],
)
def test_critic_free_estimators_and_lora_refuse_what_they_cannot_do(overrides, message):
    with pytest.raises(ConfigError) as refused:
        build_config(PPOConfig, MINIMAL[PPOConfig] | overrides, source="run.json")
    assert message in str(refused.value)
    fine = MINIMAL[PPOConfig] | {"ppo": {"advantage_estimator": "grpo"}, "rollout": {"samples_per_prompt": 4}}
    assert build_config(PPOConfig, fine, source="run.json").ppo.advantage_estimator == "grpo"


def test_preference_loss_options_follow_the_loss():
    """Each loss's default beta (and SimPO's gamma); an option of another loss is refused by name."""
    build = lambda dpo: build_config(DPOConfig, MINIMAL[DPOConfig] | {"dpo": dpo}, source="run.json").dpo
    assert build({}).beta == 0.1 and build({"loss": "ipo"}).beta == 0.1
    simpo = build({"loss": "simpo"})
    assert (simpo.beta, simpo.simpo_gamma, simpo.uses_reference()) == (2.0, 1.0, False)
    for dpo, message in (
        ({"loss": "ipo", "label_smoothing": 0.1}, "dpo: 'label_smoothing' applies to loss dpo, not ipo"),
        ({"simpo_gamma": 0.5}, "dpo: 'simpo_gamma' applies to loss simpo, not dpo"),
        ({"label_smoothing": 0.5}, "'dpo.label_smoothing' must be >= 0 and < 0.5, got 0.5"),
    ):
        with pytest.raises(ConfigError) as refused:
            build(dpo)
        assert message in str(refused.value)


def test_tensor_parallel_rollout_refuses_what_it_cannot_do(monkeypatch):
    tp = lambda n, **rollout: MINIMAL[PPOConfig] | {"rollout": {"tensor_parallel_size": n, **rollout}}
    with pytest.raises(ConfigError, match="'tensor_parallel_size' 2 needs sampler vllm"):
        build_config(PPOConfig, tp(2, sampler="hf"), source="run.json")
    monkeypatch.setenv("WORLD_SIZE", "2")  # loading reads no environment: the started run checks its world size
    cfg = build_config(PPOConfig, tp(4), source="run.json")
    with pytest.raises(
        ConfigError, match=r"^run.json: config: rollout.tensor_parallel_size \(4\) must divide the 2 ranks"
    ):
        cfg.check_world_size(2)
    build_config(PPOConfig, tp(2), source="run.json").check_world_size(2)


def test_world_size_checks_happen_when_the_run_starts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    data = MINIMAL[PPOConfig] | {"rollout": {"prompts_per_iteration": 4}, "ppo": {"mini_batch_size": 2}}
    cfg = build_config(PPOConfig, data, source="run.json")
    before = config_to_dict(cfg)
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_iteration \(4\) must divide over 3 ranks"):
        cfg.check_world_size(3)
    cfg.check_world_size(2)
    with pytest.raises(
        ConfigError, match=r"must divide the rollout batch, .* \(4 x 1 = 4\), and be divisible by 4 ranks"
    ):
        build_config(PPOConfig, data | {"ppo": {"mini_batch_size": 1}}, source="run.json").check_world_size(4)
    assert config_to_dict(cfg) == before  # checking changes nothing
    with pytest.raises(
        ConfigError, match=r"^run.json: config: ppo.mini_batch_size \(3\) must divide the rollout batch"
    ):
        build_config(PPOConfig, data | {"ppo": {"mini_batch_size": 3}}, source="run.json")  # on any number of ranks


def test_old_logprobs_from_the_sampler_need_fp32():
    fine = MINIMAL[PPOConfig] | {"ppo": {"old_logprobs_from": "sampler"}}
    assert build_config(PPOConfig, fine, source="run.json").ppo.old_logprobs_from == "sampler"
    with pytest.raises(ConfigError, match=r"ppo.old_logprobs_from sampler needs fp32 weights \(actor.bf16 false\)"):
        build_config(PPOConfig, fine | {"actor": {**MINIMAL[PPOConfig]["actor"], "bf16": True}}, source="run.json")


def test_the_launched_script_checks_the_world_size_when_it_starts():
    """engine/run/launch.start_run calls check_world_size with the run's world size (here a dry run's WORLD_SIZE)."""
    result = subprocess.run(
        [sys.executable, "train/train_ppo.py", "--config", "ds_configs/demo_ppo.json", "--dry-run"],
        cwd=Path(DS_CONFIGS_DIR).parent,
        env={**os.environ, "WORLD_SIZE": "3"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = (
        "config error: ds_configs/demo_ppo.json: config: rollout.prompts_per_iteration (16) must divide over 3 ranks"
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_nucleus_sampling_is_refused_by_name():
    """PPO's log-probs are the tempered distribution's over the whole vocabulary (docs/ppo.md)."""
    with pytest.raises(ConfigError, match=r"rollout: 'top_p' 0.9: PPO's log-probs.*set 1"):
        build_config(PPOConfig, MINIMAL[PPOConfig] | {"rollout": {"top_p": 0.9}}, source="run.json")
    assert (
        build_config(
            PPOConfig, MINIMAL[PPOConfig] | {"rollout": {"temperature": 0.7}}, source="run.json"
        ).rollout.temperature
        == 0.7
    )


GKD_DATASET = MINIMAL[PPOConfig] | {
    "distill": {"teacher": "t", "mode": "gkd", "lmbda": 0.5},
    "ppo": {"advantage_estimator": "grpo"},
    "rollout": {"samples_per_prompt": 4},
}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("ppo.advantage_estimator", "gae", "with ppo.advantage_estimator gae the critic would learn their returns"),
        ("rollout.dynamic_sampling", True, "rollout.dynamic_sampling would drop their groups"),
        ("rollout.environment", {"name": "m:E"}, "rollout.environment's episodes have none"),
        ("ppo.old_logprobs_from", "sampler", "ppo.old_logprobs_from sampler has no sampler log-probs for them"),
        ("distill.mode", "reverse_kl", "distill: 'lmbda': mode gkd's; mode reverse_kl reads none of them"),
        (
            "distill",
            {"teacher": "t", "mode": "gkd", "response_field": "answer"},
            "distill: 'response_field' (answer): read only with lmbda < 1",
        ),
    ],
)
def test_dataset_responses_refuse_what_cannot_train_on_them(key, value, message):
    """distill.lmbda < 1 (GKD's dataset responses on some iterations) with what needs sampled ones."""
    assert build_config(PPOConfig, GKD_DATASET, source="run.json").distill.lmbda == 0.5
    with pytest.raises(ConfigError) as refused:
        build_config(PPOConfig, with_value(GKD_DATASET, key, value), source="run.json")
    assert message in str(refused.value)
    assert "distill.lmbda (0.5) < 1" in str(refused.value) or key.startswith("distill")
