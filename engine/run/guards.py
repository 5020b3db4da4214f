"""Training guards: non-finite steps, a KL ceiling, and rollback on a held-out reward drop.

Each guard is a small state machine; its state goes into the checkpoint so a resumed run
guards exactly like an uninterrupted one. The training scripts act on what a guard says
(skip, lower the LR, reload a checkpoint) and log it as an event.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class TrainingAborted(RuntimeError):
    """A guard gave up on the run; the message says why and what to try."""


class Stateful:
    """Dataclass state that round-trips through a checkpoint (plain values only)."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class NonFiniteGuard(Stateful):
    """Counts optimizer steps discarded for a NaN/Inf loss or gradient; aborts after
    ``max_in_a_row`` in a row.

    DeepSpeed's ZeRO optimizers already discard such a step (no update, no LR-schedule step)
    when the global gradient norm is not finite (fp32; bf16 with ``check_grad_overflow``, which
    engine/models/deepspeed_glue.py turns on): the guard reads ``engine.was_step_applied()``.
    """

    max_in_a_row: int
    skipped: int = 0
    in_a_row: int = 0

    def update(self, step_applied: bool, where: str) -> bool:
        """Record one optimizer step; returns True when it was skipped."""
        if step_applied:
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise TrainingAborted(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient (last: {where}); "
                "lower the learning rate, check the data, or resume from an earlier checkpoint"
            )
        return True


@dataclass
class KLGuard(Stateful):
    """Says when the rollout's per-token KL to the reference is above ``ceiling`` (None: off)."""

    ceiling: float | None
    hits: int = 0

    def exceeded(self, kl_per_token: float) -> bool:
        if self.ceiling is None or not kl_per_token > self.ceiling:
            return False
        self.hits += 1
        return True


@dataclass
class RollbackGuard(Stateful):
    """Held-out reward watch: a drop of more than ``max(max_drop * |best|, min_drop)`` below the
    best held-out reward so far asks for a rollback; the ``max_rollbacks + 1``-th drop gives up.
    ``max_drop`` None turns it off."""

    max_drop: float | None
    min_drop: float
    max_rollbacks: int
    best: float | None = None
    rollbacks: int = 0

    def is_drop(self, reward: float) -> bool:
        if self.max_drop is None:
            return False
        if self.best is not None and self.best - reward > max(self.max_drop * abs(self.best), self.min_drop):
            return True
        self.best = reward if self.best is None else max(self.best, reward)
        return False

    def drop_reason(self, reward: float) -> str:
        return f"held-out reward fell to {reward:.4f} from a best of {self.best:.4f}"

    def count_rollback(self, reason: str, target: str | None) -> None:
        """Record a rollback for ``reason``; raises TrainingAborted when none is left (or there is no target)."""
        if target is None or self.rollbacks >= self.max_rollbacks:
            why = "no checkpoint to roll back to" if target is None else f"already rolled back {self.rollbacks} time(s)"
            raise TrainingAborted(
                f"{reason} and {why}; lower the learning rate or raise the KL coefficient"
                + (f" and restart from {target}" if target else "")
            )
        self.rollbacks += 1
