"""Seconds per optimizer step of a transformers Trainer (TRL's trainers), printed as one JSON line
for the bench scripts to read."""

from __future__ import annotations

import json
import time

from transformers import Trainer, TrainerCallback


class IterationClock(TrainerCallback):
    """A time stamp at each optimizer step's end."""

    def __init__(self):
        self.stamps = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def train_and_print_step_seconds(trainer: Trainer, clock: IterationClock, **extra: list[float]) -> None:
    """``trainer.train()``, then ``{"iteration_seconds": [...], **extra}``: the seconds of each step
    and ``extra``'s figures (filled during training)."""
    clock.stamps = [time.perf_counter()]
    trainer.train()
    print(json.dumps({"iteration_seconds": [b - a for a, b in zip(clock.stamps, clock.stamps[1:])], **extra}))
