"""Checkpoint bookkeeping on real files: manifests, skipping damaged checkpoints, preflight."""

from __future__ import annotations

import os

import pytest
import torch

from engine.checkpoint import (
    OutputDirError,
    _write_manifest,
    checkpoint_bytes,
    complete_checkpoints,
    latest_checkpoint,
    preflight_output_dir,
)


def make_checkpoint(root, step: int, with_manifest: bool = True):
    path = root / f"step{step:08d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "weights.pt").write_bytes(b"x" * 100)
    (path / "trainer_state_rank0.pt").write_bytes(b"y" * 10)
    if with_manifest:
        _write_manifest(str(path))
    return path


def test_latest_is_the_newest_intact_checkpoint(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 40, with_manifest=False)  # crashed before its manifest
    (tmp_path / "step00000050.tmp").mkdir()  # a save in progress
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["step00000010", "step00000020", "step00000030"]
    # Damage the newest: a truncated shard, then a missing one.
    (tmp_path / "step00000030" / "model" / "weights.pt").write_bytes(b"x" * 99)
    assert latest_checkpoint(str(tmp_path)).endswith("step00000020")
    os.remove(tmp_path / "step00000020" / "trainer_state_rank0.pt")
    assert latest_checkpoint(str(tmp_path)).endswith("step00000010")
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None


def test_preflight_refuses_unwritable_and_full_directories(tmp_path):
    preflight_output_dir(str(tmp_path / "new" / "run"), needed_bytes=1)
    assert (tmp_path / "new" / "run").is_dir()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OutputDirError, match="not writable"):
        preflight_output_dir(str(tmp_path / "a_file" / "run"), needed_bytes=1)
    with pytest.raises(OutputDirError, match="GiB free, checkpoints need about"):
        preflight_output_dir(str(tmp_path), needed_bytes=1 << 60)


def test_checkpoint_size_estimate():
    model = torch.nn.Linear(10, 10)  # 110 parameters
    assert checkpoint_bytes([model, model]) == 16 * 220
