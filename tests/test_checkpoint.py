"""Checkpoint bookkeeping on real files: manifests, skipping damaged checkpoints, preflight."""

from __future__ import annotations

import os

import pytest
import torch

from engine.run.checkpoint import (
    OutputDirError,
    _write_manifest,
    checkpoint_bytes,
    complete_checkpoints,
    describe_checkpoints,
    latest_checkpoint,
    preflight_output_dir,
    rewind_to,
)


def make_checkpoint(root, step: int, with_manifest: bool = True):
    path = root / f"step{step:08d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "weights.pt").write_bytes(b"x" * 100)
    (path / "trainer_state_rank0.pt").write_bytes(b"y" * 10)
    if with_manifest:
        _write_manifest(str(path))
    return path


def point_latest(root, step: int) -> None:
    (root / "latest").write_text(f"step{step:08d}\n")


def test_latest_is_the_pointer_or_the_newest_intact_checkpoint_before_it(tmp_path):
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 40, with_manifest=False)  # crashed before its manifest
    (tmp_path / "step00000050.tmp").mkdir()  # a save in progress
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == [
        "step00000010",
        "step00000020",
        "step00000030",
    ]
    assert latest_checkpoint(str(tmp_path)) is None  # no pointer: nothing is "the latest"
    assert "no 'latest' pointer" in describe_checkpoints(str(tmp_path)) and "step00000030" in describe_checkpoints(
        str(tmp_path)
    )
    point_latest(tmp_path, 30)
    assert latest_checkpoint(str(tmp_path)).endswith("step00000030")
    point_latest(tmp_path, 20)  # a complete checkpoint after the pointer (renamed, pointer not yet moved) is not taken
    assert latest_checkpoint(str(tmp_path)).endswith("step00000020")
    point_latest(tmp_path, 30)
    # Damage the named one: a truncated shard, then a missing one in the one before.
    (tmp_path / "step00000030" / "model" / "weights.pt").write_bytes(b"x" * 99)
    assert latest_checkpoint(str(tmp_path)).endswith("step00000020")
    os.remove(tmp_path / "step00000020" / "trainer_state_rank0.pt")
    assert latest_checkpoint(str(tmp_path)).endswith("step00000010")
    os.remove(tmp_path / "step00000010" / "trainer_state_rank0.pt")
    assert latest_checkpoint(str(tmp_path)) is None
    assert describe_checkpoints(str(tmp_path)).startswith(f"4 checkpoint(s) in {tmp_path}, all damaged")
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None
    assert describe_checkpoints(str(tmp_path / "nothing-here")) == f"no checkpoint in {tmp_path / 'nothing-here'}"


def test_rewind_to_removes_the_abandoned_branch_and_moves_the_pointer(tmp_path, process_group):
    for step in (4, 6, 8):
        make_checkpoint(tmp_path, step)
    (tmp_path / "step00000010.tmp").mkdir()  # a torn save after the target
    point_latest(tmp_path, 8)
    rewind_to(str(tmp_path), str(tmp_path / "step00000006"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000004", "step00000006"]
    assert latest_checkpoint(str(tmp_path)).endswith("step00000006")


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
