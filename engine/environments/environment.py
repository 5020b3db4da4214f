"""Multi-turn environments: the interface a user's environment implements, and the functions the
reward workers (engine/rewards/worker.py) call to run its episodes, never in the trainer's process.

An environment is a class named ``"module:Class"`` (``rollout.environment.name``), constructed with
no arguments, one instance per episode::

    class Calculator(Environment):
        def reset(self, prompt, **fields): ...            # the episode's prompt messages and its row's fields
        def step(self, text): return observation, reward, done
        def metrics(self): return {"tool_calls": 2.0}      # optional: the episode's counts, logged

``step`` gets the policy's turn as text (special tokens skipped) and returns the observation to show
the policy next (a ``str``, rendered as a tool message; None: none), a reward (a finite number or
None; an episode's rewards are summed) and whether the episode is over. ``metrics`` is read when the
episode ends: numbers logged as ``environment/<name>``, averaged over the episodes. An episode's
instance lives in one worker, which the trainer routes all its calls to.
"""

from __future__ import annotations

import math
from typing import Any

from engine.rewards.worker import resolve

Message = dict[str, str]


class Environment:
    """Base class of an environment: override :meth:`reset` and :meth:`step`."""

    def reset(self, prompt: list[Message], **fields: Any) -> None:
        """Start an episode on ``prompt`` (the prompt data's messages) with its row's ``fields``."""

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        """The policy's turn -> (observation, reward, done)."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """The episode's own counts when it ends (e.g. tool calls and errors), logged averaged over episodes."""
        return {}


_episodes: dict[str, Environment] = {}  # this worker's live episodes by key


def reset(name: str, key: str, prompt: list[Message], fields: dict[str, Any]) -> float:
    """Start episode ``key`` of environment ``name`` ("module:Class") in this worker."""
    environment = resolve(name)()
    if not isinstance(environment, Environment):
        raise TypeError(f"{name} is not a subclass of engine.environments.environment.Environment")
    environment.reset(prompt, **fields)
    _episodes[key] = environment
    return 0.0


def step(key: str, text: str) -> list[Any]:
    """Episode ``key``'s reply to the policy's turn ``text``: [observation, reward, done, metrics],
    checked; metrics (see :func:`close`) when done, else None."""
    if key not in _episodes:
        raise RuntimeError(f"episode {key} is not in this worker (its worker was restarted)")
    result = _episodes[key].step(text)
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise TypeError(f"step returned {result!r}, not (observation, reward, done)")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step's observation {observation!r} is not a str or None")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
    ):
        raise TypeError(f"step's reward {reward!r} is not a finite number or None")
    if not isinstance(done, bool):
        raise TypeError(f"step's done {done!r} is not a bool")
    return [observation, None if reward is None else float(reward), done, close(key) if done else None]


def close(key: str) -> dict[str, float]:
    """Forget episode ``key``: its metrics, checked to be finite numbers by name."""
    environment = _episodes.pop(key, None)
    metrics = environment.metrics() if environment is not None else {}
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in metrics.items()
    ):
        raise TypeError(f"metrics returned {metrics!r}, not a dict of names to finite numbers")
    return {k: float(v) for k, v in metrics.items()}
