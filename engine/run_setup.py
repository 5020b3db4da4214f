"""What both launched scripts do first: arguments, config, process group, seeds."""

from __future__ import annotations

import argparse
import random
import sys
from typing import TypeVar

import numpy as np
import torch

from engine.config import ConfigError, load_config
from engine.distributed import init_distributed

T = TypeVar("T")


def start_run(config_cls: type[T], description: str) -> tuple[T, bool, int, int]:
    """Parse ``--config PATH [--resume] [--section.key value ...]``, load and check the config
    (exit 2 with the message on a bad one), join the process group and seed python, numpy and
    torch with ``config.train.seed``. Returns ``(config, resume, rank, world_size)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="run config JSON")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, overrides = parser.parse_known_args()
    try:
        cfg = load_config(config_cls, args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    rank, world = init_distributed()
    seed = cfg.train.seed  # type: ignore[attr-defined]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return cfg, args.resume, rank, world
