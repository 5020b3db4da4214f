"""Fault injection for the crash-safety tests (and for trying the guards by hand): the one test
hook. Production code calls these functions where the fault would strike; none of its
signatures carries a fault.

``RLHF_FAULTS`` holds a JSON object; unset, nothing is injected. Keys:

- ``nan_loss_at_steps``: RM and SFT optimizer steps, or PPO iterations (every actor step in them),
  1-based, whose loss is multiplied by NaN, e.g. ``[3, 4]`` (:func:`poisoned`);
- ``eval_reward_offset``: ``{"<iteration>": offset}`` added to PPO's held-out reward there, the
  first time that iteration is evaluated (a rollback re-runs it without the fault;
  :func:`offset_eval_reward`);
- ``kill_in_checkpoint_at``: the step whose checkpoint save is cut by SIGKILL after the engine
  states are written and before the directory is renamed into place;
- ``fail_checkpoint_write_at``: the step whose checkpoint save fails with "No space left on device";
- ``kill_in_iteration_at``: the PPO iteration (1-based) in which the trainer is killed (SIGKILL) once
  its rollout is collected, before its update (:func:`kill_in_iteration`);
- ``kill_generating_rank_at``: the generation request (1-based) at which an async rollout's generating
  rank is killed (SIGKILL) before it answers (:func:`kill_generating_rank`);
- ``no_namespaces``: ``true`` makes the code sandbox's probe find mode "none" only, as on a machine
  without user namespaces where the trainer is not root (:func:`no_namespaces`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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


def poisoned(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The ``loss`` to backpropagate at 1-based ``step``: times NaN at a step of ``nan_loss_at_steps``
    (its gradient is non-finite, so DeepSpeed discards the step), else ``loss`` itself."""
    return loss * float("nan") if step in _faults().get("nan_loss_at_steps", []) else loss


_spent: set[str] = set()


def offset_eval_reward(reward: float, iteration: int) -> float:
    """PPO's held-out ``reward`` at ``iteration``, plus its ``eval_reward_offset`` the first time
    that iteration is evaluated."""
    key = str(iteration)
    offset = 0.0 if key in _spent else float(_faults().get("eval_reward_offset", {}).get(key, 0.0))
    _spent.add(key)
    return reward + offset


def kill_in_checkpoint_at(step: int) -> bool:
    return _faults().get("kill_in_checkpoint_at") == step


def fail_checkpoint_write_at(step: int) -> bool:
    return _faults().get("fail_checkpoint_write_at") == step


def kill_in_iteration(iteration: int) -> None:
    """SIGKILL this process in iteration ``kill_in_iteration_at``."""
    if iteration == _faults().get("kill_in_iteration_at"):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_generating_rank(generation: int) -> None:
    """SIGKILL this process at its ``kill_generating_rank_at``-th generation request."""
    if generation == _faults().get("kill_generating_rank_at"):
        os.kill(os.getpid(), signal.SIGKILL)


def no_namespaces() -> bool:
    return _faults().get("no_namespaces") is True
