"""The JSON Schema of each launched script's config, and the files ``python -m engine.run_config`` writes."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from engine.config import DS_CONFIGS_DIR, Config, json_schema
from engine.run_config.dpo import DPOConfig
from engine.run_config.ppo import PPOConfig
from engine.run_config.rm import RewardModelConfig
from engine.run_config.sft import SFTConfig

SCRIPT_CONFIGS: dict[str, type[Config]] = {
    "train_sft": SFTConfig,
    "train_rm": RewardModelConfig,
    "train_ppo": PPOConfig,
    "train_dpo": DPOConfig,
}


def schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema of each launched script's config."""
    return {f"{name}.schema.json": json_schema(cls, f"train/{name}.py config") for name, cls in SCRIPT_CONFIGS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.run_config", description="write the JSON Schemas of the scripts' configs"
    )
    parser.add_argument(
        "--out", default=os.path.join(DS_CONFIGS_DIR, "schema"), help="folder for the .schema.json files"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, schema in schemas().items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(schema, f, indent=1)
            f.write("\n")
        print(os.path.join(args.out, name))
    return 0
