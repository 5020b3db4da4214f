"""The config of train/train_rm.py."""

from __future__ import annotations

from engine.config import Config, ConfigError, DeepSpeedDict, option, required, section
from engine.run_config.common import (
    CheckpointSection,
    GuardsSection,
    LoggingSection,
    ModelSection,
    OptimSection,
    PairsTrainSection,
    resolve_deepspeed_dtype,
)


class RMDataSection(Config):
    train: str = required("train pairs parquet (data_prep/prepare_preferences.py)")
    validation: str = required("validation pairs parquet")
    use_margin: bool = option(True, "subtract the data's margin inside the BT loss when present")


class RMSection(Config):
    components: dict[str, float] = option({"reward": 1.0}, "reward components and their weights in the total")
    total_loss_coef: float = option(1.0, "weight of the BT loss of the weighted total on the overall preference", ge=0)
    center_coef: float = option(0.0, "weight of the centering term mean((r_c + r_r)^2)", ge=0)
    share_prompt: bool = option(
        True,
        "compute each pair's prompt once for chosen and rejected (exact; used with attention sdpa_varlen, the default "
        "on CPUs and on GPUs without flash-attn)",
    )

    def check(self) -> None:
        if not self.components:
            raise ConfigError("'components' needs at least one name")


class RewardModelConfig(Config):
    """Config of train/train_rm.py."""

    model: ModelSection = required("base model")
    data: RMDataSection = required("preference data")
    deepspeed: DeepSpeedDict = required("DeepSpeed config: inline, or a file next to this config or in ds_configs/")
    rm: RMSection = section(RMSection, "reward head and loss")
    train: PairsTrainSection = section(PairsTrainSection, "batching and schedule")
    optim: OptimSection = section(OptimSection, "optimizer and learning-rate schedule")
    checkpoint: CheckpointSection = section(CheckpointSection, "resumable checkpoints")
    guards: GuardsSection = section(GuardsSection, "training guards")
    logging: LoggingSection = section(LoggingSection, "where and how to log")

    def check(self) -> None:
        self.model.bf16 = resolve_deepspeed_dtype(self.deepspeed, self.model.bf16, "model.bf16")
