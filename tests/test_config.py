"""Config loading: types, unknown keys, dotted overrides, DeepSpeed section, cross-field checks."""

from __future__ import annotations

import json
import re
from typing import ClassVar, Literal

import pytest

from engine.config import (
    Config,
    ConfigError,
    DeepSpeedDict,
    config_to_dict,
    load_config,
    option,
    parse_overrides,
    required,
    section,
)


class PPOSection(Config):
    retired_keys: ClassVar[dict[str, str]] = {"clip": "replaced by clip_ratio"}
    clip_ratio: float = option(0.2, "PPO clip range")
    ppo_epochs: int = option(1, "epochs over each rollout batch")
    kl_estimator: Literal["k1", "k2", "k3"] = option("k1", "KL estimator")
    rollout_batch_size: int = option(8, "prompts per rollout")
    mini_batch_size: int = option(4, "prompts per optimizer step")

    def check(self) -> None:
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError(
                f"rollout_batch_size ({self.rollout_batch_size}) "
                f"must be a multiple of mini_batch_size ({self.mini_batch_size})"
            )


class RunConfig(Config):
    model: str = option("", "model path")
    seed: int = option(0, "seed")
    use_kl: bool = option(False, "KL in reward")
    weights: dict[str, float] = option({}, "component weights")
    tags: list[str] = option([], "run tags")
    eval_every: int | None = option(None, "eval period")
    ppo: PPOSection = section(PPOSection, "PPO hyper-parameters")
    deepspeed: DeepSpeedDict = option({}, "DeepSpeed config, inline or a path")


def write(tmp_path, data, name="run.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_defaults_and_types(tmp_path):
    cfg = load_config(RunConfig, write(tmp_path, {"model": "m", "ppo": {"clip_ratio": 1}, "weights": {"h": 1}}))
    assert cfg.model == "m" and cfg.seed == 0 and cfg.tags == [] and cfg.eval_every is None
    assert cfg.ppo.clip_ratio == 1.0 and isinstance(cfg.ppo.clip_ratio, float)
    assert cfg.weights == {"h": 1.0} and isinstance(cfg.weights["h"], float)
    assert config_to_dict(cfg)["ppo"]["kl_estimator"] == "k1"


def test_mutable_defaults_are_not_shared():
    a, b = RunConfig(), RunConfig()
    a.tags.append("x")
    assert b.tags == []


@pytest.mark.parametrize(
    "data, message",
    [
        ({"modle": "m"}, "unknown key 'modle' (did you mean 'model'?)"),
        ({"ppo": {"clip_rato": 0.1}}, "unknown key 'ppo.clip_rato' in 'ppo' (did you mean 'clip_ratio'?)"),
        ({"seed": "1"}, "'seed' must be an integer, got \"1\" (str)"),
        ({"seed": 1.5}, "'seed' must be an integer"),
        ({"seed": True}, "'seed' must be an integer"),
        ({"use_kl": 1}, "'use_kl' must be true or false"),
        ({"ppo": {"clip_ratio": "0.2"}}, "'ppo.clip_ratio' must be a number"),
        ({"ppo": {"kl_estimator": "k4"}}, "'ppo.kl_estimator' must be one of ['k1', 'k2', 'k3'], got 'k4'"),
        ({"ppo": 3}, "'ppo' must be an object"),
        ({"tags": "a"}, "'tags' must be a list"),
        ({"tags": ["a", 2]}, "'tags[1]' must be a string"),
        ({"weights": {"h": "x"}}, "'weights.h' must be a number"),
        ({"eval_every": "often"}, "'eval_every' must be an integer"),
        (
            {"ppo": {"rollout_batch_size": 6, "mini_batch_size": 4}},
            "ppo: rollout_batch_size (6) must be a multiple of mini_batch_size (4)",
        ),
    ],
)
def test_bad_configs_name_file_and_key(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(RunConfig, path)
    assert str(e.value).startswith(path + ": ")
    assert message in str(e.value)


def test_invalid_json_names_the_line(tmp_path):
    path = write(tmp_path, '{\n  "seed": 1,\n  "model": }\n')
    with pytest.raises(ConfigError, match=r"run.json:3: not valid JSON"):
        load_config(RunConfig, path)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(RunConfig, write(tmp_path, "[1]"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(RunConfig, str(tmp_path / "missing.json"))


def test_dotted_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, {"seed": 3, "ppo": {"clip_ratio": 0.1}})
    cfg = load_config(
        RunConfig,
        path,
        ["--ppo.clip_ratio", "0.3", "--seed=7", "--model", "some/path", "--tags", '["a","b"]', "--ppo.ppo_epochs", "2"],
    )
    assert (cfg.ppo.clip_ratio, cfg.seed, cfg.model, cfg.tags, cfg.ppo.ppo_epochs) == (
        0.3,
        7,
        "some/path",
        ["a", "b"],
        2,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--ppo.clip_rato", "0.1"],
            "command line: unknown key '--ppo.clip_rato' in 'ppo' (did you mean 'clip_ratio'?)",
        ),
        (["--sed", "1"], "unknown key '--sed' (did you mean 'seed'?)"),
        (["--ppo.clip", "0.1"], "command line: unknown key '--ppo.clip' in 'ppo': replaced by clip_ratio"),
        (["--seed.x", "1"], "'seed' is not a section"),
        (["--seed"], "--seed has no value"),
        (["seed", "1"], "expected --dotted.key VALUE"),
        (["--seed", "one"], "'seed' must be an integer, got \"one\""),
    ],
)
def test_bad_overrides(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RunConfig, write(tmp_path, {}), argv)


def test_a_retired_key_names_what_replaced_it(tmp_path):
    message = "run.json: unknown key 'ppo.clip' in 'ppo': replaced by clip_ratio"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(RunConfig, write(tmp_path, {"ppo": {"clip": 0.1}}))


def test_parse_overrides_values_are_json_or_strings():
    assert parse_overrides(["--a", "1", "--b", "x/y", "--c", "null", "--d=true"]) == {
        "a": 1,
        "b": "x/y",
        "c": None,
        "d": True,
    }


def test_deepspeed_inline_or_path(tmp_path):
    inline = load_config(RunConfig, write(tmp_path, {"deepspeed": {"zero_optimization": {"stage": 2}}}))
    assert inline.deepspeed["zero_optimization"]["stage"] == 2
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    local = load_config(RunConfig, write(tmp_path, {"deepspeed": "ds.json"}))
    assert local.deepspeed == {"zero_optimization": {"stage": 1}}
    shipped = load_config(RunConfig, write(tmp_path, {"deepspeed": "zero3.json"}))  # from ds_configs/
    assert shipped.deepspeed["zero_optimization"]["stage"] == 3
    with pytest.raises(ConfigError, match=re.escape("'deepspeed': no file 'nope.json'")):
        load_config(RunConfig, write(tmp_path, {"deepspeed": "nope.json"}))
    via_cli = load_config(RunConfig, write(tmp_path, {}), ["--deepspeed", "zero2.json"])
    assert via_cli.deepspeed["zero_optimization"]["stage"] == 2


class WithRequired(Config):
    path: str = required("model path")
    seed: int = option(0, "seed")


class Outer(Config):
    model: WithRequired = required("model section")
    extra: int = option(1, "extra")


def test_required_keys_are_named(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("missing required key 'model' (model section)")):
        load_config(Outer, write(tmp_path, {}))
    with pytest.raises(ConfigError, match=re.escape("missing required key 'model.path' (model path)")):
        load_config(Outer, write(tmp_path, {"model": {"seed": 1}}))
    assert load_config(Outer, write(tmp_path, {}), ["--model.path", "m"]).model.path == "m"
