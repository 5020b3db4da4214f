"""A run directory read back for its report: the metrics, config, events and samples, and the run kind.

The run kind is "sft", "rm", "ppo" or "dpo" when a metric key starts with ``sft/``, ``rm/``, ``ppo/`` or ``dpo/``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, TypeGuard

from engine.observe.records import read_records

Records = list[dict[str, Any]]


@dataclass
class Run:
    metrics: Records
    config: dict[str, Any] | None
    events: Records
    samples: Records
    kind: str


def finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and math.isfinite(value)


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key, finite values only."""
    points = [(r["step"], r[key]) for r in records if finite(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def keys_with_prefix(records: Records, prefix: str) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith(prefix)})


def run_kind(records: Records) -> str:
    """The run kind: sft, rm, ppo, dpo, or unknown (e.g. a PPO run that has only logged its step-0 eval)."""
    keys = {k for r in records for k in r}
    kinds = ("sft", "rm", "ppo", "dpo")
    return next((kind for kind in kinds if any(k.startswith(kind + "/") for k in keys)), "unknown")


def load_run(run_dir: str) -> Run:
    def optional(name: str) -> Records:
        path = os.path.join(run_dir, name)
        return read_records(path) if os.path.exists(path) else []

    metrics = read_records(os.path.join(run_dir, "metrics.jsonl"))
    config_path = os.path.join(run_dir, "config.json")
    config = None
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return Run(metrics, config, optional("events.jsonl"), optional("samples.jsonl"), run_kind(metrics))
