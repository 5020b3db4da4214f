"""docs/configuration.md is the reference generated from the config schema, and is current."""

from __future__ import annotations

from pathlib import Path

from pydantic.fields import FieldInfo

from engine.config import Config
from engine.config_reference import REGENERATE, reference
from engine.run_config import SCRIPT_CONFIGS

REPO = Path(__file__).resolve().parent.parent


def dotted_keys(cls: type[Config], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """(dotted key, field) of every leaf field of a config class, read from the models themselves."""
    keys = []
    for name, f in cls.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, Config):
            keys += dotted_keys(f.annotation, f"{prefix}{name}.")
        else:
            keys.append((prefix + name, f))
    return keys


def test_the_shipped_reference_is_current():
    shipped = REPO / "docs" / "configuration.md"
    assert shipped.is_file(), f"docs/configuration.md is missing: generate it with {REGENERATE}"
    assert shipped.read_text() == reference(), f"docs/configuration.md is stale: regenerate it with {REGENERATE}"


def test_every_key_of_every_script_has_a_row_with_its_description():
    text = reference()
    for script, cls in SCRIPT_CONFIGS.items():
        part = text.split(f"## train/{script}.py\n", 1)[1].split("\n## ", 1)[0]
        for key, f in dotted_keys(cls):
            row = next((line for line in part.splitlines() if line.startswith(f"| `{key}` |")), None)
            assert row is not None, f"{script}: no row for {key}"
            assert f.description and f.description.replace("|", "\\|") in row, (
                f"{script}: {key} without its description"
            )


def test_rows_state_type_default_and_range():
    part = reference().split("## train/train_ppo.py\n", 1)[1]
    rows = {
        line.split(" | ")[0].strip("| `"): line.split(" | ")[1:4] for line in part.splitlines() if line[:3] == "| `"
    }
    assert rows["ppo.clip_ratio"] == ["number", "`0.2`", "> 0, < 1"]
    assert rows["ppo.clip_ratio_c"] == ["number or null", "`null`", "> 1"]
    assert rows["actor.path"] == ["string", "required", ""]
    assert rows["ppo.advantage_estimator"][0] == 'one of `"gae"`, `"grpo"`, `"rloo"`, `"reinforce_pp"`'
    assert rows["optim.betas"] == ["list of number", "`[0.9, 0.95]`", ">= 0, < 1"]
    assert rows["train.seed"][2] == ">= 0, <= 2147483647"
