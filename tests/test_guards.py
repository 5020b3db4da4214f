"""Training guards: the state machines, and train_rm.py skipping / aborting on injected NaN losses."""

from __future__ import annotations

import math

import pytest
from helpers import faults, launch, metric_series, read_events, write_rm_config

from engine.run.guards import KLGuard, NonFiniteGuard, RollbackGuard, TrainingAborted


def test_nonfinite_guard_counts_and_aborts_after_n_in_a_row():
    guard = NonFiniteGuard(max_in_a_row=3)
    assert [guard.update(ok, "x") for ok in (True, False, False, True, False)] == [False, True, True, False, True]
    assert (guard.skipped, guard.in_a_row) == (3, 1)
    guard.update(False, "x")
    with pytest.raises(TrainingAborted, match=r"3 optimizer steps in a row .* \(last: step 9\)"):
        guard.update(False, "step 9")
    restored = NonFiniteGuard(3)
    restored.load_state_dict(guard.state_dict())
    assert restored == guard


def test_kl_guard_fires_above_the_ceiling_only():
    assert not KLGuard(None).exceeded(10.0)
    guard = KLGuard(0.1)
    assert [guard.exceeded(kl) for kl in (0.05, 0.1, 0.2, float("nan"))] == [False, False, True, False]
    assert guard.hits == 1


def test_rollback_guard_tracks_the_best_and_gives_up():
    guard = RollbackGuard(max_drop=0.05, min_drop=0.0, max_rollbacks=1)
    assert [guard.is_drop(r) for r in (1.0, 1.2, 1.15)] == [False, False, False]  # 1.15 is within 5% of 1.2
    assert guard.best == 1.2
    assert guard.is_drop(1.0)
    guard.count_rollback(guard.drop_reason(1.0), "ckpt/step4")
    assert guard.rollbacks == 1 and guard.best == 1.2
    with pytest.raises(
        TrainingAborted,
        match=r"fell to 0.9000 from a best of 1.2000 and already rolled back 1 time.*restart from ckpt/step4",
    ):
        guard.count_rollback(guard.drop_reason(0.9), "ckpt/step4")
    with pytest.raises(TrainingAborted, match="no checkpoint"):
        RollbackGuard(0.05, 0.0, 3, best=1.0).count_rollback("a flag", None)
    # Near zero a fraction of |best| is noise: the absolute floor decides.
    floor = RollbackGuard(max_drop=0.05, min_drop=0.2, max_rollbacks=1)
    assert not floor.is_drop(0.01) and not floor.is_drop(-0.1) and floor.is_drop(-0.3)
    assert not RollbackGuard(None, 0.0, 1).is_drop(-100.0)


def test_rm_skips_injected_nan_steps_and_aborts_after_n_in_a_row(tiny_model_dir, rm_data, tmp_path):
    config = write_rm_config(tmp_path / "rm.json", tiny_model_dir, rm_data, tmp_path / "run", max_steps=6)
    launch("train_rm.py", config, "--checkpoint.every_steps", "0", env=faults(nan_loss_at_steps=[3, 4]))
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["event"]) for e in events] == [(3, "nonfinite_skip"), (4, "nonfinite_skip")]
    skipped = metric_series(tmp_path / "run", "guard/nonfinite_skipped")
    assert [skipped[s] for s in range(1, 7)] == [0, 0, 1, 2, 2, 2]
    lr = metric_series(tmp_path / "run", "rm/lr")  # a discarded step does not advance the schedule either
    assert lr[3] == lr[4] == lr[2] and lr[5] != lr[4]
    eval_loss = metric_series(tmp_path / "run", "eval/loss_total")
    assert eval_loss and all(math.isfinite(v) for v in eval_loss.values()), eval_loss  # the model stayed finite
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()

    aborted = launch(
        "train_rm.py",
        config,
        "--logging.output_dir",
        str(tmp_path / "aborted"),
        "--guards.max_nonfinite_in_a_row",
        "2",
        env=faults(nan_loss_at_steps=[2, 3, 4]),
        check=False,
    )
    assert aborted.returncode != 0
    assert (
        "training aborted: 2 optimizer steps in a row had a non-finite loss or gradient (last: step 3)"
        in aborted.stderr
    )
    assert [e["event"] for e in read_events(tmp_path / "aborted")] == ["nonfinite_skip", "nonfinite_abort"]
    assert not (tmp_path / "aborted" / "model").exists()
