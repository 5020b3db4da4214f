"""What both launched scripts do first: arguments, config, process group, seeds."""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from engine.config import ConfigError, load_config
from engine.distributed import all_reduce, init_distributed

T = TypeVar("T")


@dataclass(frozen=True)
class RunArgs:
    resume: bool  # continue from the latest complete checkpoint
    allow_config_change: bool  # resume even if the checkpoint's run identity differs
    dry_run: bool  # print the plan (data, batches, parameters, memory) and exit: engine/dry_run.py


def start_run(config_cls: type[T], description: str) -> tuple[T, RunArgs, int, int]:
    """Parse ``--config PATH [--resume] [--dry-run] [--section.key value ...]``, load and check the config
    (exit 2 with the message on a bad one), join the process group (not for a dry run) and seed python, numpy and
    torch with ``config.train.seed``. Returns ``(config, run_args, rank, world_size)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="run config JSON")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument(
        "--allow-config-change", action="store_true", help="resume even if model, data or batch shape changed since the checkpoint"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the run's plan (data, batches, parameters, memory) and exit")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, overrides = parser.parse_known_args()
    try:
        cfg = load_config(config_cls, args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.dry_run:  # no process group: nothing collective happens
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    else:
        rank, world = init_distributed()
    seed = cfg.train.seed  # type: ignore[attr-defined]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return cfg, RunArgs(args.resume, args.allow_config_change, args.dry_run), rank, world


class GracefulStop:
    """SIGTERM / SIGINT (preemption notice, Ctrl-C) ask the run to stop after the current step.

    The deepspeed launcher (0.19) forwards SIGTERM to the ranks and waits 30 s before killing
    them, so there is time to write a checkpoint. The ranks must stop at the same step (saving
    is collective): :meth:`requested` agrees over all ranks.
    """

    def __init__(self):
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self) -> bool:
        flag = torch.tensor([int(self.signal_name is not None)])
        all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
