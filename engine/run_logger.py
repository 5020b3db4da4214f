"""Metrics sinks of a run (rank 0 only): metrics.jsonl, TensorBoard and wandb.

wandb runs offline unless ``WANDB_MODE`` is set or an API key is present, so a run never
needs an account; the offline run can be synced later with ``wandb sync``.
"""

from __future__ import annotations

import json
import os
from typing import Any


class RunLogger:
    """Writes one record per step to every enabled sink; a no-op on ranks other than 0."""

    def __init__(
        self,
        output_dir: str,
        config: dict[str, Any],
        enabled: bool,
        use_tensorboard: bool,
        use_wandb: bool,
        wandb_project: str,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.tb = self.wandb_run = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is None:  # a fresh run starts a fresh file
            open(self.path, "w").close()
        else:  # a resumed run rewrites what came after its checkpoint
            _truncate_after(self.path, resume_step)
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=None if resume_step is None else resume_step + 1)
        if use_wandb:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb_run = wandb.init(
                project=wandb_project, dir=output_dir, config=config, mode=mode, name=os.path.basename(os.path.abspath(output_dir))
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self._wandb("log", metrics, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self._wandb("finish")

    def _wandb(self, method: str, *args, **kwargs) -> None:
        # wandb talks to a service process; a preemption signal can kill it first. Losing the
        # wandb copy must not lose the run (metrics.jsonl and TensorBoard still have it).
        try:
            getattr(self.wandb_run, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- any wandb failure is reported the same way
            print(f"warning: wandb {method} failed ({type(e).__name__}: {e}); wandb logging is off for this run")
            self.wandb_run = None


def _truncate_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
