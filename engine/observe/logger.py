"""Metrics sinks of a run (rank 0 only): metrics.jsonl, TensorBoard and wandb (and config.json).

wandb runs offline unless ``WANDB_MODE`` is set or an API key is present, so a run never
needs an account; the offline run can be synced later with ``wandb sync``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, cast

from engine.observe.records import truncate_after

WandbMode = Literal["online", "offline", "disabled", "shared"]  # wandb.init's mode


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
        self.output_dir = output_dir
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        with open(os.path.join(output_dir, "config.json"), "w") as f:  # the resolved config, for reports
            json.dump(config, f, indent=2)
        self.events_path = os.path.join(output_dir, "events.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        for path in (self.path, self.events_path, self.samples_path):
            if resume_step is None:  # a fresh run starts fresh files
                open(path, "w").close()
            else:  # a resumed run rewrites what came after its checkpoint
                truncate_after(path, resume_step)
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                os.path.join(output_dir, "tensorboard"), purge_step=None if resume_step is None else resume_step + 1
            )
        if use_wandb:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb_run = wandb.init(
                project=wandb_project,
                dir=output_dir,
                config=config,
                mode=cast(WandbMode, mode),  # WANDB_MODE passes through as set: wandb.init checks it
                name=os.path.basename(os.path.abspath(output_dir)),
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

    def rewind(self, step: int) -> None:
        """Forget the metrics and samples logged after ``step`` (a rollback to a checkpoint
        there); events stay, they tell what happened."""
        if not self.enabled:
            return
        for path in (self.path, self.samples_path):
            truncate_after(path, step)
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(self.tb.log_dir, purge_step=step + 1)

    def event(self, step: int, kind: str, message: str, **fields: Any) -> None:
        """A guard or monitor event: printed, and kept in events.jsonl for the report."""
        if not self.enabled:
            return
        print(f"[{kind}] step {step}: {message}")
        with open(self.events_path, "a") as f:
            f.write(json.dumps({"step": step, "event": kind, "message": message, **fields}) + "\n")

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Example rollouts (prompt, response, reward, kl, ...) kept in samples.jsonl for the report."""
        if not self.enabled:
            return
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

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
        except Exception as e:
            print(f"warning: wandb {method} failed ({type(e).__name__}: {e}); wandb logging is off for this run")
            self.wandb_run = None
