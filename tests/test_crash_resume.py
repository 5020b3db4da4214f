"""Crash safety of train_rm.py: SIGTERM under the real launcher, SIGKILL, damaged checkpoints,
resuming with another config. Every resumed run must reproduce the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
from helpers import (
    REPO,
    RM_COMPONENTS,
    RM_STEPS,
    assert_repeats,
    assert_same_weights,
    faults,
    launch,
    launcher_cmd,
    metric_series,
    run_script,
    start_launched,
    wait_for_step,
    workers,
    write_rm_config,
)

from engine.models.loading import load_value_model


def straight_losses(rm_run) -> dict[int, float]:
    root, _ = rm_run
    return metric_series(root / "run", "rm/loss")


def assert_resume_matches(rm_run, config: Path, run_dir: Path, expect_from: int | None = None) -> int:
    result = launch("train_rm.py", config, "--resume")
    resumed_at = int(result.stdout.split("resumed at step ")[1].split()[0].rstrip(","))
    if expect_from is not None:
        assert resumed_at == expect_from
    straight, resumed = straight_losses(rm_run), metric_series(run_dir, "rm/loss")
    assert sorted(resumed) == list(range(1, RM_STEPS + 1))
    assert_repeats(resumed, straight, range(resumed_at + 1, RM_STEPS + 1))
    return resumed_at


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(rm_run, tmp_path):
    """The uninterrupted run's copy, resumed from its step-40 checkpoint under the launcher with
    another batch size (--allow-config-change; refused without it: the test below), gets a
    preemption notice after step 45: a checkpoint of the step it stopped after, exit 0."""
    root, _ = rm_run
    config = copied_run(root, tmp_path)
    changed = json.loads(config.read_text())
    changed["train"]["pairs_per_step"] = 16
    config.write_text(json.dumps(changed))
    shutil.rmtree(tmp_path / "run" / "model")
    metrics = tmp_path / "run" / "metrics.jsonl"  # as the resume leaves it, so no later step is seen early
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if json.loads(line)["step"] <= 40))
    proc = start_launched("train_rm.py", config, "--resume", "--allow-config-change")
    wait_for_step(tmp_path / "run", 45, proc)
    for worker in workers(proc):  # what a scheduler's preemption notice does
        worker.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "resumed at step 40" in output and "stopped by SIGTERM after step" in output and "--resume" in output
    stopped_at = int(output.split("stopped by SIGTERM after step ")[1].split(":")[0])
    assert 45 <= stopped_at < RM_STEPS
    assert (tmp_path / "run" / "checkpoints" / f"step{stopped_at:08d}" / "MANIFEST.json").exists()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == f"step{stopped_at:08d}"
    # (a resume from a checkpoint repeats the run: the SIGKILL test below and tests/test_train_*.py)


def test_sigkill_inside_a_checkpoint_write_resumes_from_the_last_complete_one(rm_run, tmp_path):
    """A copy of the uninterrupted run as a SIGKILL after step 20 leaves it (the step-20 checkpoint,
    no model) is resumed with time-based checkpoints only (checkpoint.every_minutes, here a few ms:
    one after every step) and killed inside its step-40 save, after the engine states are written and
    before the directory is renamed into place; the next resume starts at 39 and reproduces the
    uninterrupted run."""
    root, _ = rm_run
    config = copied_run(root, tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step00000040")
    shutil.rmtree(tmp_path / "run" / "model")
    (checkpoints / "latest").write_text("step00000020")
    by_time = ("--checkpoint.every_steps", "0", "--checkpoint.every_minutes", "1e-5")
    killed = launch("train_rm.py", config, "--resume", *by_time, env=faults(kill_in_checkpoint_at=40), check=False)
    assert killed.returncode != 0 and "resumed at step 20" in killed.stdout
    assert (checkpoints / "step00000040.tmp").is_dir() and not (checkpoints / "step00000040").exists()  # the torn save
    assert (checkpoints / "latest").read_text().strip() == "step00000039"
    assert not (tmp_path / "run" / "model").exists()
    assert_resume_matches(rm_run, config, tmp_path / "run", expect_from=39)
    assert not (checkpoints / "step00000040.tmp").exists()  # the resumed run saved step 40 over it


def test_disk_full_at_save_time_is_a_clear_error_and_loses_nothing(tiny_model_dir, rm_data, tmp_path):
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "run", max_steps=5)
    result = launch(
        "train_rm.py", config, "--checkpoint.every_steps", "2", env=faults(fail_checkpoint_write_at=4), check=False
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    assert result.returncode != 0
    assert (
        f"checkpoint error: could not write checkpoint {checkpoints}/step00000004 ([Errno 28] No space left on device"
        in result.stderr
    ), result.stderr[-2000:]
    assert f"the previous checkpoint {checkpoints}/step00000002 is intact" in result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step00000002"]  # no torn directory left
    assert (tmp_path / "run" / "report.html").exists()


def test_a_real_write_failure_stops_every_rank_at_once_and_keeps_the_previous_checkpoint(rm_two_ranks, tmp_path):
    """The file system refuses for real: the two-rank run's copy resumes from its step-40 checkpoint
    under a 1 MiB file-size limit (RLIMIT_FSIZE), which the optimizer shards of the step-42 save hit;
    torch's writer raises RuntimeError inside DeepSpeed's save on both ranks, and neither waits for
    a collective timeout."""
    config = copied_run(rm_two_ranks, tmp_path)
    shutil.rmtree(tmp_path / "run" / "model")
    (tmp_path / "run" / "report.html").unlink()  # the failing run writes its own
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {p: p.stat().st_size for p in checkpoints.rglob("*")}
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    start = time.monotonic()
    failed = subprocess.run(
        [
            *launcher_cmd(2),
            str(REPO / "train" / "train_rm.py"),
            "--config",
            str(config),
            "--resume",
            "--checkpoint.every_steps",
            "2",
            "--logging.wandb",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=limit,
    )
    assert failed.returncode != 0 and time.monotonic() - start < 120
    output = failed.stdout + failed.stderr
    assert f"checkpoint error: could not write checkpoint {checkpoints}/step00000042 (" in output, output[-3000:]
    assert f"the previous checkpoint {checkpoints}/step00000040 is intact" in output
    # Both ranks leave together (rank 0 after its report); the launcher then logs the first exit code.
    assert "exits with return code = 2" in output and "Traceback" not in output
    assert (tmp_path / "run" / "report.html").exists()
    assert {p: p.stat().st_size for p in checkpoints.rglob("*")} == before  # no torn directory, nothing changed


def copied_run(root: Path, tmp_path: Path) -> Path:
    """A copy of the uninterrupted run (its checkpoints at steps 20 and 40) in tmp_path/run, and its
    config writing there (tmp_path/rm.json)."""
    shutil.copytree(root / "run", tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*")) == ["step00000020", "step00000040"]
    config = json.loads((root / "rm.json").read_text())
    config["logging"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "rm.json").write_text(json.dumps(config))
    return tmp_path / "rm.json"


def test_damaged_newest_checkpoint_is_skipped_and_the_resume_repeats_the_run(rm_run, tmp_path):
    """The newest checkpoint (step 40) has a torn shard: the resume starts from step 20 and repeats
    the uninterrupted run's losses and its exported model."""
    root, _ = rm_run
    run = tmp_path / "run"
    config = copied_run(root, tmp_path)
    shard = next((run / "checkpoints" / "step00000040").rglob("*.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])  # torn write
    shutil.rmtree(run / "model")
    assert_resume_matches(rm_run, config, run, expect_from=20)
    components = list(RM_COMPONENTS)
    assert_same_weights(
        load_value_model(str(root / "run" / "model"), components).state_dict(),
        load_value_model(str(run / "model"), components).state_dict(),
    )


def test_resume_with_another_config_is_refused(rm_run, tmp_path):
    root, _ = rm_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    config = json.loads((root / "rm.json").read_text())
    config["logging"]["output_dir"] = str(run)
    config["train"]["pairs_per_step"] = 16
    regenerated = pq.read_table(config["data"]["train"])  # the same pairs less one, as another prepare run writes them
    config["data"]["train"] = str(tmp_path / "train.parquet")
    pq.write_table(regenerated.slice(1), config["data"]["train"])
    (tmp_path / "rm.json").write_text(json.dumps(config))
    refused = run_script("train_rm.py", tmp_path / "rm.json", "--resume")
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "resume error: " in said and "belongs to a different run (data.train: checkpoint 'blake2b:" in said
    assert "; pairs_per_step: checkpoint 32, now 16)" in said
    assert "LOAD REPORT" not in said  # refused before any model loads
    # (with --allow-config-change it resumes: test_sigterm_writes_a_checkpoint_and_exits_cleanly)


def test_unwritable_output_dir_fails_before_training(tiny_model_dir, rm_data, tmp_path):
    (tmp_path / "blocker").write_text("a file where the run directory should go")
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "blocker" / "run")
    result = run_script("train_rm.py", config)
    assert result.returncode != 0
    assert "is not writable" in result.stdout + result.stderr
