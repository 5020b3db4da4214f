"""Fault injection for the crash-safety tests (and for trying the guards by hand).

``RLHF_FAULTS`` holds a JSON object; unset, nothing is injected. Keys:

- ``nan_loss_at_steps``: RM optimizer steps, or PPO iterations (every actor step in them), 1-based,
  whose loss is multiplied by NaN, e.g. ``[3, 4]``;
- ``eval_reward_offset``: ``{"<iteration>": offset}`` added to PPO's held-out reward there, the
  first time that iteration is evaluated (a rollback re-runs it without the fault);
- ``kill_in_checkpoint_at``: the step whose checkpoint save is cut by SIGKILL after the engine
  states are written and before the directory is renamed into place;
- ``fail_checkpoint_write_at``: the step whose checkpoint save fails with "No space left on device".
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

ENV = "RLHF_FAULTS"


@functools.cache
def _faults() -> dict[str, Any]:
    raw = os.environ.get(ENV, "")
    if not raw:
        return {}
    try:
        faults = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV} is not valid JSON ({e}): {raw!r}") from None
    if not isinstance(faults, dict):
        raise ValueError(f"{ENV} must be a JSON object, got {raw!r}")
    return faults


def nan_loss_at(step: int) -> bool:
    return step in _faults().get("nan_loss_at_steps", [])


_spent: set[str] = set()


def eval_reward_offset(iteration: int) -> float:
    key = str(iteration)
    if key in _spent:
        return 0.0
    _spent.add(key)
    return float(_faults().get("eval_reward_offset", {}).get(key, 0.0))


def kill_in_checkpoint_at(step: int) -> bool:
    return _faults().get("kill_in_checkpoint_at") == step


def fail_checkpoint_write_at(step: int) -> bool:
    return _faults().get("fail_checkpoint_write_at") == step
