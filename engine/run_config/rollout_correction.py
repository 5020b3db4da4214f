"""The ``ppo.rollout_correction`` section: importance weights of the policy loss for responses sampled by
a sampler whose log-probs differ from the trainer's (the formulas: engine/ppo/rollout_correction.py)."""

from __future__ import annotations

from typing import Literal

from engine.config import Config, ConfigError, option

CorrectionLevel = Literal["token", "sequence"]
CorrectionMode = Literal["truncate", "mask"]


class RolloutCorrectionSection(Config):
    level: CorrectionLevel = option(
        "token",
        "the ratio pi_actor / pi_sampler of each token, or of each sequence (the product of its token ratios, "
        "exp of the summed log-ratio), given to each of its tokens",
    )
    mode: CorrectionMode = option(
        "truncate",
        "truncate: weight the policy loss by min(ratio, high) (truncated importance sampling); mask: by the ratio "
        "inside [low, high] and 0 outside it (masked importance sampling)",
    )
    high: float = option(2.0, "truncate's cap, mask's upper bound", ge=1)
    low: float | None = option(None, "mode mask: the lower bound (None: 1 / high)", gt=0, le=1)

    def check(self) -> None:
        if self.mode == "truncate" and self.low is not None:
            raise ConfigError(f"'low' ({self.low:g}) bounds mode mask; mode truncate caps the ratio at 'high' only")

    def bounds(self) -> tuple[float, float]:
        """(low, high): the band of ratios that mode mask keeps (truncate reads ``high`` only)."""
        return (1.0 / self.high if self.low is None else self.low), self.high
