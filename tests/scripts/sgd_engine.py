"""What the test scripts that take plain SGD steps through a real DeepSpeed engine share.

With SGD at lr 1 and no clipping, ``full_weights`` before minus after a step is the averaged
gradient of the step, whatever the ZeRO stage, the micro-batches and the ranks.
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
from transformers.integrations import HfDeepSpeedConfig

from engine.config import DS_CONFIGS_DIR
from engine.run.distributed import init_distributed


def launched_args(*positional: str) -> tuple[argparse.Namespace, int, int]:
    """Parse ``positional`` arguments (and the launcher's --local_rank), join the process group:
    ``(args, rank, world)``."""
    parser = argparse.ArgumentParser()
    for name in positional:
        parser.add_argument(name)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()
    rank, world = init_distributed(timeout_s=120)
    return args, rank, world


def sgd_engine(load_model, stage: int = 3):
    """``(engine, keep_alive)``: the model of ``load_model()`` under ZeRO ``stage`` with SGD at lr 1,
    no clipping, and ``step()`` as the boundary whatever the micro-step count."""
    with open(os.path.join(DS_CONFIGS_DIR, "tiny_cpu_zero3.json")) as f:
        ds_config = json.load(f)
    ds_config["zero_optimization"]["stage"] = stage
    ds_config["gradient_clipping"] = 0.0  # (deepspeed 0.19 clips at 1.0 when the key is absent)
    ds_config["managed_gradient_accumulation"] = False
    ds_config["zero_allow_untested_optimizer"] = True  # plain SGD: before - after == lr * gradient
    keep_alive = HfDeepSpeedConfig(ds_config) if stage == 3 else None  # ZeRO-3 partitions the weights as they load
    model = load_model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds_config
    )
    return engine, keep_alive


def full_weights(engine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone() for name, p in params.items()}
