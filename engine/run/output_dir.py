"""The output directory before a run starts (for engine/run/lifecycle.py): the refusals that keep an
earlier run from being destroyed, decided before any model loads and changing nothing, and what
``--overwrite`` removes."""

from __future__ import annotations

import os
import shutil

import torch

from engine.run.checkpoint import describe_checkpoints, latest_checkpoint
from engine.run.distributed import ranks_not_sharing
from engine.run.launch import RunArgs, RunRefused

# What a run writes into its output directory (besides the exported model). --overwrite removes
# these and nothing else: a user's own files there stay.
RUN_FILES = (
    "metrics.jsonl",
    "events.jsonl",
    "samples.jsonl",
    "config.json",
    "report.html",
    "report",
    "tensorboard",
    "wandb",
    "checkpoints",
)


def existing_run(output_dir: str, export_dir: str) -> list[str]:
    """The parts of an earlier run found in ``output_dir`` (empty files and folders do not count)."""
    found = []
    for name in (*RUN_FILES, export_dir):
        path = os.path.join(output_dir, name)
        if (os.path.isfile(path) and os.path.getsize(path) > 0) or (os.path.isdir(path) and os.listdir(path)):
            found.append(name)
    return found


def check_output_dir(output_dir: str, export_dir: str, ckpt_root: str, run_args: RunArgs) -> str | None:
    """The checkpoint to resume (None for a fresh run); :class:`RunRefused` when the run must not start."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        blind = ranks_not_sharing(output_dir)
        if blind:
            raise RunRefused(
                "output",
                f"logging.output_dir {output_dir} is not one directory for all ranks: {', '.join(blind)} "
                "cannot see the files rank 0 writes there. Every rank writes its share of each checkpoint there "
                "and reads them all on --resume: put it on a filesystem every node mounts (NFS, Lustre, ...); "
                "nothing was changed.",
            )
    found = existing_run(output_dir, export_dir)
    if run_args.resume:
        path = latest_checkpoint(ckpt_root)
        if path is None:
            raise RunRefused(
                "resume",
                f"nothing to resume: {describe_checkpoints(ckpt_root)}. To start afresh, run without "
                + ("--resume and with --overwrite (this replaces the run there)" if found else "--resume")
                + " or choose another logging.output_dir; nothing was changed.",
            )
        return path
    if found and not run_args.overwrite:
        raise RunRefused(
            "output",
            f"{output_dir} already holds a run ({', '.join(found)}). Continue it with --resume, replace "
            "it with --overwrite, or choose another logging.output_dir; nothing was changed.",
        )
    return None


def remove_run(output_dir: str, export_dir: str) -> None:
    """``--overwrite``: remove what an earlier run wrote there (:data:`RUN_FILES` and the export), nothing else."""
    for name in (*RUN_FILES, export_dir):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
