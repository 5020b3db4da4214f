"""The config of train/train_sft.py."""

from __future__ import annotations

from engine.config import Config, DeepSpeedDict, option, required, section
from engine.run_config.common import (
    CheckpointSection,
    EpochsSection,
    GuardsSection,
    LoggingSection,
    ModelSection,
    OptimSection,
    resolve_deepspeed_dtype,
)


class SFTDataSection(Config):
    train: str = required("train conversations parquet (data_prep/prepare_sft.py)")
    validation: str = option(
        "", "held-out conversations parquet, evaluated every eval_every_steps and at the end ('': none)"
    )


class SFTTrainSection(EpochsSection):
    conversations_per_step: int = option(32, "conversations per optimizer step, over all ranks", ge=1)


class SFTConfig(Config):
    """Config of train/train_sft.py."""

    model: ModelSection = required("base model to fine-tune")
    data: SFTDataSection = required("conversations")
    deepspeed: DeepSpeedDict = required("DeepSpeed config: inline, or a file next to this config or in ds_configs/")
    train: SFTTrainSection = section(SFTTrainSection, "batching and schedule")
    optim: OptimSection = section(OptimSection, "optimizer and learning-rate schedule")
    checkpoint: CheckpointSection = section(CheckpointSection, "resumable checkpoints")
    guards: GuardsSection = section(GuardsSection, "training guards")
    logging: LoggingSection = section(LoggingSection, "where and how to log")

    def check(self) -> None:
        self.model.bf16 = resolve_deepspeed_dtype(self.deepspeed, self.model.bf16, "model.bf16")
