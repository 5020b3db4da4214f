"""Resumable checkpoints: DeepSpeed engine states plus the trainer's own state, per step.

Layout: ``CKPT_ROOT/step00000042/{<engine name>/..., trainer_state_rank{r}.pt, MANIFEST.json}``
and ``CKPT_ROOT/latest`` (the name of the newest complete checkpoint).

Crash safety: every rank writes into ``step00000042.tmp``; after a barrier rank 0 lists the
files with their sizes in ``MANIFEST.json``, renames the directory into place (atomic on one
file system) and only then moves ``latest`` (itself written to a temporary file and renamed).
A crash during a save leaves the previous checkpoint and pointer untouched.

``latest`` is the one source of truth for "the checkpoint to resume": a resume takes the
checkpoint it names, or, when that one no longer matches its manifest (a damaged disk, a
partial copy), the newest complete checkpoint before it. A rollback points it back at the
checkpoint it restored and removes the abandoned ones after it (:func:`rewind_to`).
The trainer state holds the step, the data position, a summary of the run's config (checked
on resume) and the RNG states of python, numpy and torch, per rank, loaded with
``weights_only=True``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
from typing import Any

import numpy as np
import torch

from engine.run import faults
from engine.run.distributed import all_reduce

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step(\d{8})$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full...); nothing was renamed into place."""


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed by this run (message says why and what to do)."""


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and, with a GPU, CUDA) RNG states as plain data (loadable
    with weights_only=True)."""
    np_state = np.random.get_state(legacy=True)  # the default, spelled out: numpy's stubs type a bare call as a dict
    assert isinstance(np_state, tuple)
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    return {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), None))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():  # absent in checkpoints written on a CPU
        torch.cuda.set_rng_state_all(state["cuda"])


def has_frozen_parameters(engine) -> bool:
    """Whether a trained engine has parameters it does not train (LoRA's base weights), which its
    checkpoints leave out: they are reloaded from the model path."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_checkpoint(
    ckpt_root: str,
    step: int,
    engines: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int,
    keep: str | None = None,
) -> str:
    """All ranks call it; returns the checkpoint directory. Older checkpoints beyond the last
    ``keep_last`` are deleted, except ``keep`` (e.g. the rollback target)."""
    rank = torch.distributed.get_rank()
    path = os.path.join(ckpt_root, f"step{step:08d}")
    tmp = f"{path}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that crashed
    torch.distributed.barrier()
    error: Exception | None = None
    try:
        for name, engine in engines.items():
            engine.checkpoint_engine.write_error = None
            engine.save_checkpoint(
                tmp, tag=name, save_latest=False, exclude_frozen_parameters=True
            )  # LoRA: the adapters only
            error = error or engine.checkpoint_engine.write_error
        if faults.fail_checkpoint_write_at(step):
            raise OSError(errno.ENOSPC, "No space left on device (injected by RLHF_FAULTS)")
        if error is None:
            torch.save({**trainer_state, "rng": rng_state()}, os.path.join(tmp, f"trainer_state_rank{rank}.pt"))
    except Exception as e:
        error = e
    if faults.kill_in_checkpoint_at(step):
        os.kill(os.getpid(), signal.SIGKILL)
    failed = torch.tensor([int(error is not None)])
    all_reduce(failed)  # also the barrier: every rank's shards are on disk
    if failed.item():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = latest_checkpoint(ckpt_root)
        raise CheckpointWriteError(
            f"could not write checkpoint {path} ({error or 'failed on another rank'}); "
            + (f"the previous checkpoint {latest} is intact" if latest else "no earlier checkpoint exists")
        )
    if rank == 0:
        _write_manifest(tmp)
        if os.path.isdir(path):  # the same step saved by an earlier, interrupted run
            shutil.rmtree(path)
        os.replace(tmp, path)
        _write_atomically(os.path.join(ckpt_root, LATEST), os.path.basename(path))
        for old in complete_checkpoints(ckpt_root)[:-keep_last]:
            if old != keep:
                shutil.rmtree(old)
    torch.distributed.barrier()
    return path


def complete_checkpoints(ckpt_root: str) -> list[str]:
    """Checkpoint directories whose files match their manifest, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    found = sorted(d for d in os.listdir(ckpt_root) if _STEP_DIR.match(d))
    return [os.path.join(ckpt_root, d) for d in found if _matches_manifest(os.path.join(ckpt_root, d))]


def latest_checkpoint(ckpt_root: str) -> str | None:
    """The checkpoint ``latest`` names, or the newest complete one before it when it is damaged;
    None without a pointer or without a complete checkpoint up to it."""
    named = _read_latest(ckpt_root)
    if named is None:
        return None
    usable = [c for c in complete_checkpoints(ckpt_root) if os.path.basename(c) <= named]
    return usable[-1] if usable else None


def describe_checkpoints(ckpt_root: str) -> str:
    """What ``ckpt_root`` holds, for a refusal to resume (no usable checkpoint there)."""
    found = sorted(d for d in os.listdir(ckpt_root) if _STEP_DIR.match(d)) if os.path.isdir(ckpt_root) else []
    if not found:
        return f"no checkpoint in {ckpt_root}"
    complete = [os.path.basename(c) for c in complete_checkpoints(ckpt_root)]
    named = _read_latest(ckpt_root)
    if not complete:
        return (
            f"{len(found)} checkpoint(s) in {ckpt_root}, all damaged (files differ from their {MANIFEST}): "
            f"{', '.join(found)}"
        )
    if named is None:
        return (
            f"no '{LATEST}' pointer in {ckpt_root} (complete checkpoints: {', '.join(complete)}); to resume from one, "
            f"write its name into {os.path.join(ckpt_root, LATEST)}"
        )
    return f"'{LATEST}' names {named}, and no complete checkpoint up to it (complete: {', '.join(complete)})"


def rewind_to(ckpt_root: str, path: str) -> None:
    """After a rollback to ``path``: remove the checkpoints after it (the abandoned branch) and
    point ``latest`` at it, so a later resume continues from what the run now is. All ranks call it."""
    if torch.distributed.get_rank() == 0:
        keep = os.path.basename(path)
        for name in os.listdir(ckpt_root):
            step_name = name.removesuffix(".tmp")
            if _STEP_DIR.match(step_name) and step_name > keep:
                shutil.rmtree(os.path.join(ckpt_root, name))
        _write_atomically(os.path.join(ckpt_root, LATEST), keep)
    torch.distributed.barrier()


def _read_latest(ckpt_root: str) -> str | None:
    try:
        with open(os.path.join(ckpt_root, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return None
    return name if _STEP_DIR.match(name) else None


def content_fingerprint(path: str) -> str:
    """A digest of the file's bytes (BLAKE2b, 128 bits): the run identity's record of a data file, so
    that a file regenerated at the same path is another run's data. '' for no file."""
    if not path:
        return ""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"blake2b:{digest.hexdigest()}"


def check_run_identity(path: str, run_identity: dict[str, Any], allow_config_change: bool) -> str:
    """Refuse (ResumeError) the checkpoint at ``path`` when the run that wrote it had another
    ``run_identity`` (model, data content, batch shape...), unless ``allow_config_change``; returns
    what differs ('' for nothing). Reads rank 0's trainer state only: before any model loads."""
    try:
        state = torch.load(os.path.join(path, "trainer_state_rank0.pt"), weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError) as e:
        raise ResumeError(f"{path}: its trainer state cannot be read ({e})") from None
    saved = state.get("run_identity", {})
    changed = sorted(k for k in set(saved) | set(run_identity) if saved.get(k) != run_identity.get(k))
    details = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {run_identity.get(k)!r}" for k in changed)
    if changed and not allow_config_change:
        raise ResumeError(
            f"{path} belongs to a different run ({details}). Use another logging.output_dir, or pass "
            "--allow-config-change to resume anyway."
        )
    return details


def load_checkpoint(path: str, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore engines (weights, optimizer, scheduler) and RNGs; returns the trainer state
    (:func:`check_run_identity` first)."""
    state = torch.load(os.path.join(path, f"trainer_state_rank{torch.distributed.get_rank()}.pt"), weights_only=True)
    for name, engine in engines.items():
        try:
            load_path, _ = engine.load_checkpoint(
                path,
                tag=name,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=not has_frozen_parameters(engine),
            )
        # GuardedCheckpointEngine (engine/models/deepspeed_glue.py): an object that is not a tensor or DeepSpeed state
        except pickle.UnpicklingError as e:
            unsafe = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
            raise ResumeError(
                f"{path}: refused to load engine '{name}': its files hold an object that loading would run code for "
                f"({unsafe}); a checkpoint holds tensors and DeepSpeed's state only. Resume from a checkpoint you "
                "trust."
            ) from None
        if load_path is None:
            raise ResumeError(f"{path}: DeepSpeed could not load engine '{name}'")
    set_rng_state(state.pop("rng"))
    return state


def _write_manifest(path: str) -> None:
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = os.path.getsize(full)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(files, f, indent=0, sort_keys=True)


def _matches_manifest(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full) or os.path.getsize(full) != size:
            return False
    return True


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


class OutputDirError(RuntimeError):
    """The output directory cannot take this run's checkpoints."""


def parameter_count(models: list[torch.nn.Module], trained_only: bool = False) -> int:
    """Parameters of ``models`` at their full size (ZeRO-3: ``ds_numel``), or only the trained ones."""
    return sum(
        getattr(p, "ds_numel", p.numel()) for m in models for p in m.parameters() if p.requires_grad or not trained_only
    )


def checkpoint_bytes(models: list[torch.nn.Module]) -> int:
    """Upper estimate of one checkpoint of trained models: 16 bytes a trained parameter (weights,
    fp32 master and two Adam moments); frozen ones (LoRA's base) are not saved."""
    return 16 * parameter_count(models, trained_only=True)


def preflight_output_dir(output_dir: str, needed_bytes: int) -> None:
    """Fail before training, not at the first save: the directory must be creatable, writable
    and have room for ``needed_bytes``."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OutputDirError(f"output directory {output_dir!r} is not writable: {e.strerror}") from None
    free = shutil.disk_usage(output_dir).free
    if free < needed_bytes:
        raise OutputDirError(
            f"output directory {output_dir!r} has {free / 2**30:.2f} GiB free, checkpoints need about "
            f"{needed_bytes / 2**30:.2f} GiB (checkpoint.keep_last + 1 copies); free space or lower keep_last"
        )
