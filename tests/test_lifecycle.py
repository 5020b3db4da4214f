"""engine/run/lifecycle.py: refusals that protect a run, the resume registry, rollback restore.

Unit tests run a real DeepSpeed engine (a tiny linear model, ZeRO-2) in this process; the
refusals are also checked through the real launcher on a finished train_rm.py run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import launch, metric_series, read_events, run_script

from engine.config import DS_CONFIGS_DIR
from engine.run import lifecycle
from engine.run.guards import RollbackGuard, Stateful
from engine.run.launch import RunArgs, RunRefused
from engine.run.lifecycle import RunLifecycle
from engine.run.output_dir import existing_run
from engine.run_config.common import CheckpointSection, LoggingSection


@dataclass
class Counter(Stateful):
    value: int = 0


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` with its size and content hash."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, hashlib.sha1(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_engine(seed: int):
    from engine.models.deepspeed_glue import initialize_training_engine, training_ds_config

    torch.manual_seed(seed)
    with open(os.path.join(DS_CONFIGS_DIR, "tiny_cpu_zero2.json")) as f:
        ds_config = training_ds_config(json.load(f), bf16=False)
    return initialize_training_engine(
        torch.nn.Linear(4, 3),
        ds_config,
        lr=0.1,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        lr_scheduler="constant",
        warmup_steps=0,
        total_steps=100,
    )


def make_run(
    out: Path, resume: bool = False, overwrite: bool = False, every_steps: int = 2, every_minutes: float = 0.0
) -> RunLifecycle:
    return RunLifecycle(
        output_dir=str(out),
        run_args=RunArgs(resume, overwrite, allow_config_change=False, dry_run=False),
        identity={"model": "linear"},
        export_dir="model",
        checkpoint=CheckpointSection(keep_last=5, every_steps=every_steps, every_minutes=every_minutes),
    )


def start(run: RunLifecycle, engine) -> None:
    run.start(
        engines={"model": engine},
        lr_engine=engine,
        export_engine=engine,
        config={"test": True},
        total_steps=10,
        logging=LoggingSection(tensorboard=False, wandb=False, wandb_project="test", progress_bar=False),
        desc="test",
    )


def train_step(run: RunLifecycle, engine) -> None:
    engine.backward(engine(torch.randn(8, 4)).pow(2).sum())  # random inputs: the RNG state matters
    engine.step()
    run.step += 1
    run.log({"loss": float(run.step)})


def weights(engine) -> torch.Tensor:
    return engine.module.weight.detach().clone()


def test_registry_round_trip_resumes_engine_state_rngs_lr_scale_and_metrics(deepspeed_ready, tmp_path):
    engine, counter, kl = make_engine(0), Counter(), Counter()
    run = make_run(tmp_path / "run")
    run.track("counter", counter, rolls_back=False)
    run.track("kl", kl, rolls_back=True)
    start(run, engine)
    for step in range(1, 5):
        train_step(run, engine)
        counter.value, kl.value = 10 * step, 100 * step
        if step == 3:
            run.scale_lr(0.5)
        run.end_of_step()  # checkpoints at 2 and 4
    expected_weights, expected_draw = weights(engine), torch.rand(3)
    lines_before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    train_step(run, engine)  # step 5, logged after the last checkpoint
    run.finish(0, "stopped")

    engine2, counter2, kl2 = make_engine(1), Counter(), Counter()
    assert not torch.equal(weights(engine2), expected_weights)
    resumed = make_run(tmp_path / "run", resume=True)
    assert resumed.resume_from == str(tmp_path / "run" / "checkpoints" / "step00000004")
    resumed.track("counter", counter2, rolls_back=False)
    resumed.track("kl", kl2, rolls_back=True)
    start(resumed, engine2)
    assert resumed.step == 4 and counter2.value == 40 and kl2.value == 400 and resumed.lr_scale == 0.5
    assert torch.equal(weights(engine2), expected_weights)
    assert engine2.get_lr() == [0.05]
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the checkpoint left it
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == lines_before  # step 5 rewound, 1-4 byte for byte
    resumed.finish(0, "done")


def test_a_checkpoint_every_so_many_minutes_counts_from_the_last_save(deepspeed_ready, tmp_path, monkeypatch):
    """checkpoint.every_minutes (30 by default: a crash loses at most half an hour) beside every_steps;
    a save of any kind restarts the clock. The clock here: 7 minutes a step."""
    assert CheckpointSection().every_minutes == 30
    now = [0.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    engine = make_engine(0)
    run = make_run(tmp_path / "run", every_steps=5, every_minutes=20)
    start(run, engine)
    for _ in range(9):
        now[0] += 7 * 60
        train_step(run, engine)
        run.end_of_step()
    # 21 min at step 3; every_steps at 5 (14 min after it); 21 min after that at step 8
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name != "latest")
    assert steps == ["step00000003", "step00000005", "step00000008"]
    run.finish(0, "done")


def test_rollback_restores_what_rolls_back_scales_the_lr_and_drops_the_abandoned_branch(deepspeed_ready, tmp_path):
    engine, guard_count, kl = make_engine(0), Counter(), Counter()
    run = make_run(tmp_path / "run", every_steps=3)
    run.track("guard_count", guard_count, rolls_back=False)
    run.track("kl", kl, rolls_back=True)
    rollback = RollbackGuard(max_drop=0.1, min_drop=0.0, max_rollbacks=1)
    run.track_rollback(rollback, lr_factor=0.5)
    synced = []
    run.after_restore(lambda: synced.append(run.step))
    start(run, engine)
    run.first_evaluation(1.0)
    assert run.last_good.endswith("step00000000")
    rewards = {2: 1.2, 4: 0.5}  # a good evaluation at 2; a drop at 4
    for step in range(1, 5):
        train_step(run, engine)
        guard_count.value, kl.value = step, 100 * step
        if step == 2:
            at_two = weights(engine)
        evaluated = step in rewards
        if evaluated and run.rolled_back(rewards[step]):
            break
        run.end_of_step(good=evaluated)  # good checkpoint at 2, periodic one at 3
    assert run.step == 2 and synced == [2]
    assert kl.value == 200 and guard_count.value == 4  # the KL controller rolls back, a guard's counts do not
    assert torch.equal(weights(engine), at_two) and engine.get_lr() == [0.05] and run.lr_scale == 0.5
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest",
        "step00000000",
        "step00000002",
    ]  # step 3 abandoned
    assert (checkpoints / "latest").read_text().strip() == "step00000002"
    assert sorted(metric_series(tmp_path / "run", "loss")) == [1, 2]
    [event] = read_events(tmp_path / "run")
    assert event["event"] == "rollback" and event["step"] == 4 and event["to_step"] == 2
    assert "rolled back to" in event["message"] and "LR scale 0.5 (rollback 1 of 1)" in event["message"]
    run.finish(0, "done")


def test_refusals_leave_the_directory_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    assert existing_run(str(run_dir), "model") == []
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    assert existing_run(str(run_dir), "model") == []  # empty files and folders are not a run
    make_run(run_dir)  # so a fresh run may start there
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "model").mkdir()
    (run_dir / "model" / "model.safetensors").write_bytes(b"w")
    before = snapshot(run_dir)
    with pytest.raises(
        RunRefused, match=r"already holds a run \(metrics.jsonl, model\).*--resume.*--overwrite"
    ) as refused:
        make_run(run_dir)
    assert refused.value.kind == "output"
    with pytest.raises(
        RunRefused, match=f"nothing to resume: no checkpoint in {run_dir}/checkpoints.*with --overwrite"
    ):
        make_run(run_dir, resume=True)
    assert snapshot(run_dir) == before
    assert make_run(run_dir, overwrite=True).resume_from is None  # allowed; nothing removed before start()
    assert snapshot(run_dir) == before


# --- through the launcher, on a finished train_rm.py run ----------------------------------------


@pytest.fixture
def finished_run(rm_run, tmp_path) -> tuple[Path, Path]:
    """A copy of the finished one-rank RM run and its config pointing at the copy."""
    root, _ = rm_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    config = json.loads((root / "rm.json").read_text())
    config["logging"]["output_dir"] = str(run)
    (tmp_path / "rm.json").write_text(json.dumps(config))
    return run, tmp_path / "rm.json"


def test_a_fresh_run_into_a_finished_run_is_refused_and_changes_nothing(finished_run):
    run, config = finished_run
    before = snapshot(run)
    refused = run_script("train_rm.py", config)
    assert refused.returncode != 0
    assert f"output error: {run} already holds a run (metrics.jsonl" in refused.stderr
    assert "Continue it with --resume, replace it with --overwrite" in refused.stderr
    assert snapshot(run) == before
    both = run_script("train_rm.py", config, "--resume", "--overwrite")
    assert both.returncode != 0 and "not allowed with argument" in both.stderr


def test_resume_without_a_usable_checkpoint_is_refused_and_changes_nothing(finished_run):
    run, config = finished_run
    for shard in (run / "checkpoints").rglob("*.pt"):  # every checkpoint damaged
        shard.write_bytes(shard.read_bytes()[:-10])
    before = snapshot(run)
    refused = run_script("train_rm.py", config, "--resume")
    assert refused.returncode != 0
    assert f"resume error: nothing to resume: 2 checkpoint(s) in {run}/checkpoints, all damaged" in refused.stderr
    assert snapshot(run) == before
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    refused = run_script("train_rm.py", config, "--resume")
    assert f"resume error: nothing to resume: no checkpoint in {run}/checkpoints" in refused.stderr
    assert "with --overwrite (this replaces the run there)" in refused.stderr
    assert snapshot(run) == before


def test_overwrite_replaces_the_run(finished_run, tiny_model_dir, rm_data):
    run, config = finished_run
    old_model = (run / "model" / "model.safetensors").read_bytes()
    (run / "notes.txt").write_text("the user's own file")
    launch("train_rm.py", config, "--overwrite", "--train.max_steps", "3", "--checkpoint.every_steps", "0")
    assert sorted(metric_series(run, "rm/loss")) == [1, 2, 3]
    assert not (run / "checkpoints").exists()  # the old run's checkpoints went with it
    assert (run / "model" / "model.safetensors").read_bytes() != old_model
    assert (run / "notes.txt").read_text() == "the user's own file"  # only what a run writes is replaced


class RunsCode:
    """What a planted checkpoint file would do when unpickled without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused(deepspeed_ready, tmp_path):
    from engine.run.checkpoint import _write_manifest

    engine = make_engine(0)
    run = make_run(tmp_path / "run")
    start(run, engine)
    train_step(run, engine)
    checkpoint = Path(run.save())
    run.finish(0, "saved")
    marker = tmp_path / "code-ran"
    shard = next((checkpoint / "model").glob("*model_states.pt"))
    torch.save(
        {"module": RunsCode(marker)}, shard
    )  # a planted file; the manifest is updated to match, as an attacker would
    (checkpoint / "MANIFEST.json").unlink()
    _write_manifest(str(checkpoint))
    resumed = make_run(tmp_path / "run", resume=True)
    assert resumed.resume_from == str(checkpoint)  # it looks complete
    with pytest.raises(
        RunRefused, match=r"refused to load engine 'model'.*GLOBAL posix.system.*Resume from a checkpoint you trust"
    ):
        start(resumed, make_engine(1))
    assert not marker.exists()


def test_an_error_exit_whose_checkpoint_fails_too_names_both_and_closes(deepspeed_ready, tmp_path, monkeypatch, capsys):
    """finish_with_checkpoint (a reward outage, a weight-sync failure): one message, no traceback,
    everything registered with at_finish closed, whether the save works or not."""
    from engine.run.checkpoint import CheckpointWriteError

    engine, closed = make_engine(0), []
    run = make_run(tmp_path / "run")
    run.at_finish(lambda: closed.append("sampler"))
    start(run, engine)
    train_step(run, engine)

    def disk_full(*args, **kwargs):
        raise CheckpointWriteError("no space left on device")

    monkeypatch.setattr(lifecycle, "save_checkpoint", disk_full)
    assert run.finish_with_checkpoint(2, "reward error: the server is down", "; resume") == 2
    said = capsys.readouterr().err
    assert said.startswith("reward error: the server is down\nno checkpoint of this step: checkpoint error: ")
    assert "no space left on device" in said and closed == ["sampler"]
    monkeypatch.undo()
    run = make_run(tmp_path / "run", resume=False, overwrite=True)
    start(run, engine)
    train_step(run, engine)
    assert run.finish_with_checkpoint(2, "weight sync error: CRC", "; resume") == 2
    assert (
        capsys.readouterr().err
        == f"weight sync error: CRC\ncheckpoint {tmp_path / 'run' / 'checkpoints' / 'step00000001'}; resume\n"
    )
