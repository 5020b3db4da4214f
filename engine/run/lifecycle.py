"""A run's life in its output directory, the same for every launched script.

    run = RunLifecycle(output_dir=..., run_args=..., identity={...}, ...)   # before any model loads
    run.track("kl_controller", kl_ctl, rolls_back=True)                     # state a checkpoint carries
    run.start(engines={"actor": ..., "critic": ...}, lr_engine=..., logging=cfg.logging, ...)
    while run.step < total:
        ...one step...; run.step += 1
        run.log(metrics); run.end_of_step(total, good=evaluated)           # saves; RunEnded on a stop
    return run.finish(0, summary)                                         # the report too

What it guarantees:

* Nothing a user made is destroyed. A fresh run into a directory that holds a run (metrics,
  checkpoints, an exported model) is refused unless ``--overwrite``; ``--resume`` without a
  usable checkpoint is refused, saying what was found. Both are decided before any model
  loads, and leave the directory as it was (engine/run/output_dir.py).
* One source of truth for "the checkpoint to resume": ``checkpoints/latest``
  (engine/run/checkpoint.py).
* Everything that must survive a resume is registered (:meth:`track`): guards, the KL
  controller, monitors, counters. The lifecycle's own state (the step, the learning-rate scale
  the guards applied, the rollback target) and the RNG states are always saved.
* Metrics logged after the resumed (or rolled-back-to) checkpoint are rewound; those before it
  stay byte for byte (engine/observe/records.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from tqdm import tqdm

from engine.models.deepspeed_glue import scale_learning_rate
from engine.observe.logger import RunLogger
from engine.observe.report import write_report
from engine.run.checkpoint import (
    CheckpointWriteError,
    OutputDirError,
    ResumeError,
    check_run_identity,
    checkpoint_bytes,
    load_checkpoint,
    parameter_count,
    preflight_output_dir,
    rewind_to,
    save_checkpoint,
)
from engine.run.distributed import agree_max
from engine.run.guards import NonFiniteGuard, RollbackGuard, TrainingAborted
from engine.run.launch import GracefulStop, RunArgs, RunRefused
from engine.run.output_dir import check_output_dir, remove_run
from engine.run_config.common import CheckpointSection, LoggingSection


class Checkpointable(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunEnded(Exception):
    """The run ends before its last step: a stop signal (exit code 0), a checkpoint that could not
    be written (2), a guard that gave up (3). The message is the run's last line."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class RunLifecycle:
    """Output-directory checks, the resume registry, resume, saves, rollback and the end of a run.

    ``identity`` is what a checkpoint must share with this run to be resumed by it (model, data,
    batch shape, seed, world size). ``unit`` names a step in messages ("step", "iteration").
    """

    def __init__(
        self,
        *,
        output_dir: str,
        run_args: RunArgs,
        identity: dict[str, Any],
        export_dir: str,
        checkpoint: CheckpointSection,
        unit: str = "step",
    ):
        self.output_dir, self.run_args, self.identity = output_dir, run_args, identity
        self.export_dir, self.unit = export_dir, unit
        self.keep_last, self.every_steps, self.every_minutes = (
            checkpoint.keep_last,
            checkpoint.every_steps,
            checkpoint.every_minutes,
        )
        self.saved_at = time.monotonic()  # of the last save (or the start): every_minutes counts from it
        self.ckpt_root = os.path.join(output_dir, "checkpoints")
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # The lifecycle's own state, saved in every checkpoint under "run".
        self.step = 0
        self.lr_scale = 1.0  # product of the factors the guards applied to ``lr_engine``'s learning rate
        self.last_good: str | None = None  # the checkpoint a rollback returns to
        self._registry: dict[str, tuple[Checkpointable, bool]] = {}
        self._after_restore: list[Callable[[], None]] = []
        self._at_finish: list[Callable[[], None]] = []
        self.rollback: RollbackGuard | None = None
        self.rollback_lr_factor = 1.0
        # Before any model loads: the checkpoint to resume, written by this run, or RunRefused.
        self.resume_from = check_output_dir(output_dir, export_dir, self.ckpt_root, run_args)
        self.identity_changes = ""  # what --allow-config-change let differ from the checkpoint's run
        if self.resume_from:
            try:
                self.identity_changes = check_run_identity(self.resume_from, identity, run_args.allow_config_change)
            except ResumeError as e:
                raise RunRefused("resume", str(e)) from None

    # --- the registry -------------------------------------------------------------------------
    def track(self, name: str, obj: Checkpointable, *, rolls_back: bool) -> None:
        """Save ``obj`` in every checkpoint and restore it on resume; ``rolls_back``: also restore it
        on a rollback (a guard's counts do not: they say what happened)."""
        self._registry[name] = (obj, rolls_back)

    def track_rollback(self, guard: RollbackGuard, lr_factor: float) -> None:
        """Roll back to the last good evaluation on a held-out reward drop (:meth:`rolled_back`),
        multiplying the learning rate by ``lr_factor`` each time."""
        self.track("rollback", guard, rolls_back=False)
        self.rollback, self.rollback_lr_factor = guard, lr_factor

    def after_restore(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after every resume or rollback (e.g. sync the restored actor into the sampler)."""
        self._after_restore.append(fn)

    def at_finish(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the run ends, however it ends (e.g. shut the sampler down)."""
        self._at_finish.append(fn)

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the engines (the RNG states are added by the checkpoint)."""
        return {
            "run": {"step": self.step, "lr_scale": self.lr_scale, "last_good": self.last_good},
            "run_identity": self.identity,
            **{name: obj.state_dict() for name, (obj, _) in self._registry.items()},
        }

    # --- start: preflight, resume, logger ----------------------------------------------------
    def start(
        self,
        *,
        engines: dict[str, Any],
        lr_engine,
        export_engine,
        config: dict[str, Any],
        total_steps: int,
        logging: LoggingSection,
        desc: str,
    ) -> None:
        """After the engines (and the sampler) exist: make room (--overwrite), check the disk, resume,
        open the logger and the progress bar (``logging``: the sinks, the bar; ``desc`` labels it).
        ``engines`` are checkpointed; the guards scale ``lr_engine``'s LR. Register with :meth:`track`
        and :meth:`after_restore` before."""
        self.engines, self.lr_engine = engines, lr_engine
        if self.run_args.overwrite and self.rank == 0:
            remove_run(self.output_dir, self.export_dir)
        trained = checkpoint_bytes([e.module for e in engines.values()])
        try:  # room for keep_last + 1 checkpoints (a new one is written before the oldest goes) and the export
            preflight_output_dir(
                self.output_dir, (self.keep_last + 1) * trained + 4 * parameter_count([export_engine.module])
            )
        except OutputDirError as e:
            raise RunRefused("output", str(e)) from None
        torch.distributed.barrier()  # rank 0 made room before anyone writes
        if self.resume_from:
            self._restore(self.resume_from, rollback=False)
            for fn in self._after_restore:
                fn()
        self.logger = RunLogger(
            self.output_dir,
            config,
            enabled=self.rank == 0,
            use_tensorboard=logging.tensorboard,
            use_wandb=logging.wandb,
            wandb_project=logging.wandb_project,
            resume_step=self.step if self.resume_from else None,
        )
        if self.identity_changes:
            self.event("config_changed", f"resumed with --allow-config-change: {self.identity_changes}")
        self.total_steps = total_steps
        self.saved_at = time.monotonic()
        self.bar = tqdm(
            total=total_steps, initial=self.step, disable=self.rank != 0 or not logging.progress_bar, desc=desc
        )
        self.stop = GracefulStop()  # after vLLM started: its engine installs handlers of its own

    def _restore(self, path: str, rollback: bool) -> dict[str, Any]:
        try:
            state = load_checkpoint(path, self.engines)
            for name, (obj, rolls_back) in self._registry.items():
                if rolls_back or not rollback:
                    obj.load_state_dict(state[name])
            saved = state["run"]
        except ResumeError as e:
            raise RunRefused("resume", str(e)) from None
        except KeyError as e:
            raise RunRefused(
                "resume",
                f"{path} has no saved state {e} (written by another version of the scripts?); "
                "start afresh with --overwrite or in another logging.output_dir",
            ) from None
        self.step = saved["step"]
        if not rollback:
            self.lr_scale, self.last_good = saved["lr_scale"], saved["last_good"]
        return saved

    # --- during the run -------------------------------------------------------------------------
    def log(self, metrics: dict[str, float], **postfix: str) -> None:
        """Log ``metrics`` at the current step and move the progress bar."""
        self.logger.log(self.step, metrics)
        self.bar.update(self.step - self.bar.n)
        if postfix:
            self.bar.set_postfix(**postfix)

    def event(self, kind: str, message: str, step: int | None = None, **fields: Any) -> None:
        self.logger.event(self.step if step is None else step, kind, message, **fields)

    def check_step(self, guard: NonFiniteGuard, step: int, engine, name: str | None = None) -> None:
        """After an optimizer step of ``engine`` (``name``: which model, when there are several): a
        step DeepSpeed discarded (NaN/Inf) is an event; too many in a row end the run (exit 3)."""
        try:
            skipped = guard.update(
                engine.was_step_applied(), f"{name}, {self.unit} {step}" if name else f"{self.unit} {step}"
            )
        except TrainingAborted as e:
            self.event("nonfinite_abort", str(e), step=step)
            raise RunEnded(3, f"training aborted: {e}") from None
        if skipped:
            self.event(
                "nonfinite_skip",
                f"{name or 'optimizer'} step skipped: non-finite loss or gradient ({guard.in_a_row} in a row)",
                step=step,
            )

    def scale_lr(self, factor: float) -> None:
        """Multiply ``lr_engine``'s learning rate by ``factor`` for the rest of the run (kept on resume)."""
        scale_learning_rate(self.lr_engine, factor)
        self.lr_scale *= factor

    def save(self, good: bool = False) -> str:
        """A checkpoint of the current step (``good``: the new rollback target); exit 2 when it cannot be written."""
        if good:
            self.last_good = os.path.join(self.ckpt_root, f"step{self.step:08d}")
        try:
            path = save_checkpoint(
                self.ckpt_root, self.step, self.engines, self.trainer_state(), self.keep_last, keep=self.last_good
            )
            self.saved_at = time.monotonic()
            return path
        except CheckpointWriteError as e:
            raise RunEnded(2, f"checkpoint error: {e}") from None

    def end_of_step(self, good: bool = False) -> None:
        """The save decisions after a step: periodic (``every_steps``, or ``every_minutes`` since the
        last save), on a stop signal, and after a good evaluation when rollback is on; none after the
        last step (the export follows). A stop signal ends the run here (:class:`RunEnded`, exit 0)."""
        last = self.step >= self.total_steps
        periodic = (bool(self.every_steps) and self.step % self.every_steps == 0) or self._minutes_passed()
        stopping = not last and self.stop.requested()  # a collective: every rank stops at the same step
        good = good and self.rollback is not None and self.rollback.max_drop is not None
        if (periodic or stopping or good) and not last:
            path = self.save(good)
        if stopping:
            raise RunEnded(
                0,
                f"stopped by {self.stop.signal_name or 'a signal on another rank'} after {self.unit} {self.step}: "
                f"checkpoint {path}; continue with the same command plus --resume",
            )

    def _minutes_passed(self) -> bool:
        """Whether ``every_minutes`` have passed since the last save by any rank's clock (a
        collective: every rank saves at the same step)."""
        if not self.every_minutes:
            return False
        return bool(agree_max(int(time.monotonic() - self.saved_at >= 60 * self.every_minutes)))

    def first_evaluation(self, reward: float) -> None:
        """The starting point's held-out reward: the first best, and with rollback on, the first
        checkpoint to come back to."""
        if self.rollback is not None and self.rollback.max_drop is not None:
            self.rollback.is_drop(reward)
            self.save(good=True)

    def rolled_back(self, reward: float) -> bool:
        """After a held-out evaluation: on a drop below the best, :meth:`roll_back` and return True
        (the loop continues from there)."""
        if self.rollback is None or not self.rollback.is_drop(reward):
            return False
        self.roll_back(self.rollback.drop_reason(reward))
        return True

    def roll_back(self, reason: str) -> None:
        """Restore the last good checkpoint (engines, registered state that rolls back, RNGs) with the
        learning rate scaled by the rollback factor and rewind the metrics to it; exit 3
        (:class:`RunEnded`) when the rollback guard has none left."""
        assert self.rollback is not None, "track_rollback first"
        at_step = self.step
        try:
            self.rollback.count_rollback(reason, self.last_good)
        except TrainingAborted as e:
            self.event("rollback_give_up", str(e))
            raise RunEnded(3, f"training aborted: {e}") from None
        assert self.last_good is not None  # count_rollback refuses a rollback without one
        saved = self._restore(self.last_good, rollback=True)
        new_scale = self.lr_scale * self.rollback_lr_factor
        scale_learning_rate(
            self.lr_engine, new_scale / saved["lr_scale"]
        )  # the checkpoint's schedule had its own scale
        self.lr_scale = new_scale
        rewind_to(self.ckpt_root, self.last_good)
        for fn in self._after_restore:
            fn()
        self.logger.rewind(self.step)
        self.event(
            "rollback",
            f"{reason}: rolled back to {self.last_good}, LR scale {new_scale:g} "
            f"(rollback {self.rollback.rollbacks} of {self.rollback.max_rollbacks})",
            step=at_step,
            to_step=self.step,
        )
        self.bar.reset(total=self.total_steps)
        self.bar.update(self.step)

    def stop_with_checkpoint(self, reason: str) -> None:
        """Save a checkpoint of this step and end the run with exit 3 (:class:`RunEnded`)."""
        path = self.save()
        raise RunEnded(
            3, f"stopped after {self.unit} {self.step}: {reason}; checkpoint {path} (--resume continues from it)"
        )

    # --- the end -------------------------------------------------------------------------------
    def finish_with_checkpoint(self, code: int, reason: str, resume_hint: str = "") -> int:
        """End the run on an error at a step boundary after saving a checkpoint: ``reason``, then the
        checkpoint (and ``resume_hint``). A save that fails too ends it the same way, naming both
        failures; either way :meth:`finish` closes everything."""
        try:
            path = self.save()
        except RunEnded as failed:
            return self.finish(failed.code, f"{reason}\nno checkpoint of this step: {failed}")
        return self.finish(code, f"{reason}\ncheckpoint {path}{resume_hint}")

    def finish(self, code: int, message: str) -> int:
        """End the run (done, stopped or aborted): close the bar, the sinks and what :meth:`at_finish`
        registered; rank 0 prints ``message`` (to stderr when ``code`` is an error) and writes the
        HTML report. Returns ``code``."""
        self.bar.close()
        for fn in self._at_finish:
            fn()
        self.logger.close()
        if self.rank == 0:
            print(message, file=sys.stderr if code else sys.stdout)
            print(f"report: {write_report(self.output_dir)}")
        return code
