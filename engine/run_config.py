"""The JSON config schema of the launched scripts (see engine/config.py for the loader)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.config import ConfigError, option, required, section


@dataclass
class ModelSection:
    path: str = required("HF checkpoint directory (or hub name) of the base model")
    attn_implementation: str = option("sdpa_varlen", "attention: sdpa_varlen (CPU packing), flash_attention_2 (GPU), sdpa, eager")
    bf16: bool = option(False, "train in bf16 (DeepSpeed bf16 section is set to match)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    trust_remote_code: bool = option(False, "allow custom modelling code from the checkpoint")


@dataclass
class OptimSection:
    lr: float = option(1e-5, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    betas: list[float] = option([0.9, 0.95], "AdamW betas")
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"] = option("cosine", "schedule after warm-up")
    warmup_ratio: float = option(0.03, "fraction of the optimizer steps spent warming up linearly")

    def __post_init__(self):
        if len(self.betas) != 2:
            raise ConfigError(f"'betas' must have 2 values, got {self.betas}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"'warmup_ratio' must be in [0, 1), got {self.warmup_ratio}")


@dataclass
class CheckpointSection:
    every_steps: int = option(0, "save a resumable checkpoint every N optimizer steps (0: only at the end)")
    keep_last: int = option(2, "how many checkpoints to keep")

    def __post_init__(self):
        if self.every_steps < 0 or self.keep_last < 1:
            raise ConfigError(f"need every_steps >= 0 and keep_last >= 1, got {self.every_steps}, {self.keep_last}")


@dataclass
class LoggingSection:
    output_dir: str = option("runs/rm", "run directory: metrics, checkpoints, final model")
    wandb_project: str = option("rlhf-toolkit", "wandb project (offline unless WANDB_MODE or WANDB_API_KEY is set)")
    wandb: bool = option(True, "log to wandb")
    tensorboard: bool = option(True, "log to TensorBoard")
    progress_bar: bool = option(True, "show a tqdm bar on rank 0")


@dataclass
class RMDataSection:
    train: str = required("train pairs parquet (data_prep/prepare_preferences.py)")
    validation: str = required("validation pairs parquet")
    use_margin: bool = option(True, "subtract the data's margin inside the BT loss when present")


@dataclass
class RMSection:
    components: dict[str, float] = option({"reward": 1.0}, "reward components and their weights in the total")
    total_loss_coef: float = option(1.0, "weight of the BT loss of the weighted total on the overall preference")
    center_coef: float = option(0.0, "weight of the centering term mean((r_c + r_r)^2)")

    def __post_init__(self):
        if not self.components:
            raise ConfigError("'components' needs at least one name")


@dataclass
class RMTrainSection:
    epochs: int = option(1, "passes over the train pairs")
    max_steps: int = option(0, "stop after this many optimizer steps (0: run all epochs)")
    pairs_per_step: int = option(32, "pairs per optimizer step, over all ranks")
    max_tokens_per_micro_batch: int = option(2048, "token budget of one packed forward on one rank")
    eval_every_steps: int = option(0, "evaluate every N steps (0: only at the end)")
    seed: int = option(0, "seed of data order and initialisation")

    def __post_init__(self):
        if self.epochs < 1 or self.pairs_per_step < 1 or self.max_tokens_per_micro_batch < 2:
            raise ConfigError(
                f"need epochs >= 1, pairs_per_step >= 1, max_tokens_per_micro_batch >= 2; got {self.epochs}, "
                f"{self.pairs_per_step}, {self.max_tokens_per_micro_batch}"
            )


@dataclass
class RewardModelConfig:
    """Config of train/train_rm.py."""

    model: ModelSection = required("base model")
    data: RMDataSection = required("preference data")
    deepspeed: dict[str, Any] = required("DeepSpeed config: inline, or a file next to this config or in ds_configs/")
    rm: RMSection = section(RMSection, "reward head and loss")
    train: RMTrainSection = section(RMTrainSection, "batching and schedule")
    optim: OptimSection = section(OptimSection, "optimizer and learning-rate schedule")
    checkpoint: CheckpointSection = section(CheckpointSection, "resumable checkpoints")
    logging: LoggingSection = section(LoggingSection, "where and how to log")
