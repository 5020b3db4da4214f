"""What the launched scripts (SFT, RM, PPO, DPO) do first and last: arguments, config, process group,
seeds; the exit."""

from __future__ import annotations

import argparse
import atexit
import os
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, NoReturn, TypeVar

import numpy as np
import torch

from engine.config import ConfigError, load_config
from engine.data.errors import DataFileError
from engine.run.distributed import SplitWorld, all_reduce, join_world, shutdown_distributed

T = TypeVar("T")


class RunRefused(Exception):
    """A run that must not start (exit 2, nothing changed): the message says why and what to do.
    ``kind`` prefixes it: ``config error: ...``, ``output error: ...``, ``resume error: ...``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class RunArgs:
    resume: bool  # continue from the latest checkpoint
    overwrite: bool  # a fresh run may replace the run already in the output directory
    allow_config_change: bool  # resume even if the checkpoint's run identity differs
    dry_run: bool  # print the plan (data, batches, parameters, memory) and exit: engine/run/dry_run.py
    device_memory_gib: float | None = None  # with dry_run: say whether the run fits devices of this size


class Started(NamedTuple, Generic[T]):
    """A launched script's start (:func:`start_run`)."""

    config: T
    args: RunArgs
    rank: int
    world: int  # ranks in this process's group (an async rollout's trainers, or its generating ranks)
    split: SplitWorld | None  # rollout.mode async: the launched world split in two; None otherwise


def start_run(config_cls: type[T], description: str) -> Started[T]:
    """Parse ``--config PATH [--resume | --overwrite] [--dry-run] [--section.key value ...]``, load and check the
    config (:class:`RunRefused` on a bad one), join the process group (not for a dry run) and seed python, numpy and
    torch with ``config.train.seed``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="run config JSON")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint of logging.output_dir"
    )
    start.add_argument(
        "--overwrite", action="store_true", help="start afresh in an output directory that holds a run, replacing it"
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even if model, data or batch shape changed since the checkpoint",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the run's plan (data, batches, parameters, memory) and exit"
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        help="with --dry-run: whether the run fits devices of this many GiB (vLLM takes its utilization share)",
    )
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, overrides = parser.parse_known_args()
    try:
        cfg = load_config(config_cls, args.config, overrides)
    except ConfigError as e:
        raise RunRefused("config", str(e)) from None
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cfg.check_world_size(world)  # type: ignore[attr-defined]  # rules on the number of ranks (engine/config.py)
    split = None
    if not args.dry_run:  # a dry run makes no process group: nothing collective happens
        rank, world, split = join_world(generation_ranks=cfg.generation_ranks())  # type: ignore[attr-defined]
    seed = cfg.train.seed  # type: ignore[attr-defined]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if args.device_memory_gib is not None and not (args.dry_run and args.device_memory_gib > 0):
        raise RunRefused("config", "--device-memory-gib takes a positive size and goes with --dry-run")
    run_args = RunArgs(args.resume, args.overwrite, args.allow_config_change, args.dry_run, args.device_memory_gib)
    return Started(cfg, run_args, rank, world, split)


def run_main(main: Callable[[], int]) -> NoReturn:
    """A launched script's entry point: run ``main``; a refusal (or a config or data file found
    unusable) exits 2 with its message; the ranks
    leave the process group together (engine/run/distributed.py)."""
    try:
        code = main()
    except (RunRefused, ConfigError, DataFileError) as e:
        kind = e.kind if isinstance(e, RunRefused) else "config" if isinstance(e, ConfigError) else "data"
        print(f"{kind} error: {e}", file=sys.stderr)
        code = 2
    shutdown_distributed()
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit as ``sys.exit`` would, less the interpreter's teardown of every module (1.5-2 s a process
    with torch, DeepSpeed, transformers and vLLM imported, which frees nothing a run needs): the
    atexit handlers run (logging, wandb, multiprocessing's children, vLLM), the streams are flushed,
    then the process ends."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
