"""Train the tiny model a few steps through a real DeepSpeed engine built from a shipped config.

    python tests/scripts/ds_config_steps.py MODEL_DIR DS_CONFIG [--bf16 false] [--steps 3]

Prints one JSON line on rank 0: the config name, ZeRO stage, world size and the losses.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from engine.config import DS_CONFIGS_DIR
from engine.runtime.distributed import init_distributed, shutdown_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("ds_config")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    rank, world = init_distributed(timeout_s=120)
    with open(f"{DS_CONFIGS_DIR}/{args.ds_config}") as f:
        ds_config = json.load(f)
    stage = ds_config["zero_optimization"]["stage"]
    # ZeRO-3: the config object must be alive during from_pretrained so weights partition as they load.
    keep_alive = HfDeepSpeedConfig(ds_config) if stage == 3 else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(5, 200, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        print(json.dumps({"config": args.ds_config, "stage": stage, "world": world, "losses": losses}))
    del keep_alive


if __name__ == "__main__":
    main()
    shutdown_distributed()
