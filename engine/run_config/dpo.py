"""The config of train/train_dpo.py."""

from __future__ import annotations

from typing import Literal

from engine.config import Config, ConfigError, DeepSpeedDict, option, required, section
from engine.run_config.common import (
    CheckpointSection,
    GuardsSection,
    LoggingSection,
    OptimSection,
    PairsTrainSection,
    PolicySection,
    resolve_deepspeed_dtype,
)

PreferenceLossName = Literal["dpo", "ipo", "simpo"]
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}  # the papers' (SimPO: Meng et al. 2024, table 7)
DEFAULT_SIMPO_GAMMA = 1.0  # gamma / beta = 0.5, SimPO's recommended ratio


class DPODataSection(Config):
    train: str = required("train pairs parquet (data_prep/prepare_preferences.py)")
    validation: str = required(
        "held-out pairs parquet: loss, accuracy, margins and KL to the reference every eval_every_steps and at the end"
    )


class DPOSection(Config):
    loss: PreferenceLossName = option(
        "dpo",
        "dpo: sigmoid of the log-ratio margin (Rafailov et al. 2023); ipo: its squared distance to 1/(2 beta) (Azar "
        "et al. 2023); simpo: reference-free, length-normalised log-probs with a target margin (Meng et al. 2024)",
    )
    beta: float | None = option(None, "inverse temperature (None: 0.1 for dpo and ipo, 2.0 for simpo)", gt=0)
    label_smoothing: float = option(
        0.0, "dpo only: probability that a pair's labels are flipped (conservative DPO)", ge=0, lt=0.5
    )
    simpo_gamma: float | None = option(None, "simpo only: target reward margin gamma (None: 1.0)", ge=0)
    share_prompt: bool = option(
        True,
        "compute each pair's prompt once for chosen and rejected (exact; used with attention sdpa_varlen, the default "
        "on CPUs and on GPUs without flash-attn)",
    )

    def check(self) -> None:
        if self.label_smoothing and self.loss != "dpo":
            raise ConfigError(f"'label_smoothing' applies to loss dpo, not {self.loss}: remove it or set loss dpo")
        if self.simpo_gamma is not None and self.loss != "simpo":
            raise ConfigError(f"'simpo_gamma' applies to loss simpo, not {self.loss}: remove it or set loss simpo")
        if self.beta is None:
            self.beta = DEFAULT_BETA[self.loss]
        if self.loss == "simpo" and self.simpo_gamma is None:
            self.simpo_gamma = DEFAULT_SIMPO_GAMMA

    def uses_reference(self) -> bool:
        """Whether the loss compares with the reference policy (SimPO does not)."""
        return self.loss != "simpo"


class DPOConfig(Config):
    """Config of train/train_dpo.py."""

    model: PolicySection = required("policy to train (the SFT model; also the reference)")
    data: DPODataSection = required("preference pairs")
    deepspeed: DeepSpeedDict = required("DeepSpeed config: inline, or a file next to this config or in ds_configs/")
    dpo: DPOSection = section(DPOSection, "the preference loss")
    train: PairsTrainSection = section(PairsTrainSection, "batching and schedule")
    optim: OptimSection = section(OptimSection, "optimizer and learning-rate schedule")
    checkpoint: CheckpointSection = section(CheckpointSection, "resumable checkpoints")
    guards: GuardsSection = section(GuardsSection, "training guards")
    logging: LoggingSection = section(LoggingSection, "where and how to log")

    def check(self) -> None:
        self.model.bf16 = resolve_deepspeed_dtype(self.deepspeed, self.model.bf16, "model.bf16")
