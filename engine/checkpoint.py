"""Resumable checkpoints: DeepSpeed engine states plus the trainer's own state, per step.

Layout: ``CKPT_ROOT/step00000042/{<engine name>/..., trainer_state_rank{r}.pt, COMPLETE}``.
``COMPLETE`` is written by rank 0 after every rank has finished writing; a directory without
it (a crash mid-save) is ignored by :func:`latest_checkpoint`, so the previous one is used.
The trainer state holds the step, the data position and the RNG states of python, numpy and
torch, saved per rank and loaded with ``weights_only=True``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step(\d{8})$")


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as plain data (loadable with weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), None))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(ckpt_root: str, step: int, engines: dict[str, Any], trainer_state: dict[str, Any], keep_last: int) -> str:
    """All ranks call it; returns the checkpoint directory."""
    rank = torch.distributed.get_rank()
    path = os.path.join(ckpt_root, f"step{step:08d}")
    if rank == 0 and os.path.isdir(path):  # a half-written leftover of a crashed run
        shutil.rmtree(path)
    torch.distributed.barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(path, tag=name, save_latest=False)
    torch.save({**trainer_state, "rng": rng_state()}, os.path.join(path, f"trainer_state_rank{rank}.pt"))
    torch.distributed.barrier()  # every rank's shards are on disk before the directory counts
    if rank == 0:
        open(os.path.join(path, COMPLETE), "w").close()
        for old in complete_checkpoints(ckpt_root)[:-keep_last]:
            shutil.rmtree(old)
    torch.distributed.barrier()
    return path


def complete_checkpoints(ckpt_root: str) -> list[str]:
    """Complete checkpoint directories, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    found = sorted(d for d in os.listdir(ckpt_root) if _STEP_DIR.match(d))
    return [os.path.join(ckpt_root, d) for d in found if os.path.exists(os.path.join(ckpt_root, d, COMPLETE))]


def latest_checkpoint(ckpt_root: str) -> str | None:
    done = complete_checkpoints(ckpt_root)
    return done[-1] if done else None


def load_checkpoint(path: str, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore engines (weights, optimizer, scheduler) and RNGs; returns the trainer state."""
    for name, engine in engines.items():
        load_path, _ = engine.load_checkpoint(path, tag=name, load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"{path}: DeepSpeed could not load engine '{name}'")
    state = torch.load(os.path.join(path, f"trainer_state_rank{torch.distributed.get_rank()}.pt"), weights_only=True)
    set_rng_state(state.pop("rng"))
    return state
