"""The config sections the launched scripts share (model, LoRA, optimizer, checkpoints, logging,
guards, the epoch schedule of SFT, RM and DPO) and the check of the DeepSpeed config keys the scripts own."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.config import Config, ConfigError, option, required, section
from engine.run_config.chat_template import BUILT_IN, TemplateError, resolve

MAX_SEED = 2**31 - 1  # numpy seeds stay below 2**32; derived per-rank and per-iteration seeds must fit too
# DeepSpeed config keys the scripts set themselves (engine/models/deepspeed_glue.training_ds_config):
# token-budget batching decides the batch, the run config the optimizer, schedule and dtype.
DEEPSPEED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_deepspeed_dtype(ds_config: dict[str, Any], bf16: bool | None, bf16_key: str) -> bool:
    """Check the keys of the DeepSpeed config that the scripts own; returns whether to train in
    bf16: ``bf16`` (the run config's ``bf16_key``) when given, else the DeepSpeed config's own
    ``bf16.enabled``. Conflicts are refused, never silently overridden."""
    for key in DEEPSPEED_BATCH_KEYS:
        if ds_config.get(key, 1) not in (1, "auto"):
            raise ConfigError(
                f"'deepspeed.{key}' ({ds_config[key]}) is set by the scripts: batches are packed to a token budget "
                "(train.pairs_per_step / ppo.mini_batch_size and max_tokens_per_micro_batch); remove it or set 1"
            )
    for key, instead in (("optimizer", "optim"), ("scheduler", "optim.lr_scheduler and optim.warmup_ratio")):
        if key in ds_config:
            raise ConfigError(
                f"'deepspeed.{key}' is set by the scripts (torch AdamW, transformers schedules): use {instead} instead"
            )
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError(
            f"'deepspeed.fp16' is not supported (no loss scaling here): use bf16 (set {bf16_key} true) or fp32"
        )
    ds_bf16 = (ds_config.get("bf16") or {}).get("enabled")
    if ds_bf16 is not None and bf16 is not None and bool(ds_bf16) != bf16:
        raise ConfigError(
            f"'deepspeed.bf16.enabled' ({str(bool(ds_bf16)).lower()}) and '{bf16_key}' ({str(bf16).lower()}) disagree: "
            f"set one of them to match, or leave {bf16_key} out to follow the DeepSpeed config"
        )
    return bool(bf16) if bf16 is not None else bool(ds_bf16)


class ModelSection(Config):
    path: str = required("HF checkpoint directory (or hub name) of the base model")
    attn_implementation: Literal["auto", "sdpa_varlen", "flash_attention_2", "sdpa", "eager"] = option(
        "auto",
        "attention: auto (sdpa_varlen: on a GPU in 16 bits one varlen flash call per packed row), sdpa_varlen, "
        "flash_attention_2, sdpa, eager",
    )
    bf16: bool | None = option(
        None, "train in bf16 (None: as the DeepSpeed config's bf16.enabled says; its bf16 section is set to match)"
    )
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    trust_remote_code: bool = option(False, "allow custom modelling code from the checkpoint")
    chat_template: str = option(
        "",
        f"chat template for a tokenizer without one (a base model): a built-in ({', '.join(BUILT_IN)}) or a Jinja "
        "file, as data_prep's --chat-template; saved with the trained model ('': the tokenizer's own)",
    )

    def check(self) -> None:
        if self.chat_template:
            try:
                resolve(self.chat_template, "'chat_template'")
            except TemplateError as e:
                raise ConfigError(str(e)) from None


class LoraSection(Config):
    rank: int = option(0, "LoRA rank r (0: off, every weight is trained)", ge=0)
    alpha: float = option(16.0, "LoRA alpha: the adapter's output is scaled by alpha / rank", gt=0)
    dropout: float = option(0.0, "dropout on the adapter's input in training", ge=0, lt=1)
    target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "names of the linear layers that get adapters "
        "(the last part of the module name; Llama/Qwen/Mistral names by default)",
    )

    def check(self) -> None:
        if self.rank and not self.target_modules:
            raise ConfigError("'target_modules' needs at least one layer name when rank > 0")


class PolicySection(ModelSection):
    lora: LoraSection = section(
        LoraSection, "LoRA adapters: only they are trained and checkpointed; the reference is the model with them off"
    )


class OptimSection(Config):
    lr: float = option(1e-5, "peak learning rate", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = option([0.9, 0.95], "AdamW betas")
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"] = option("cosine", "schedule after warm-up")
    warmup_ratio: float = option(0.03, "fraction of the optimizer steps spent warming up linearly", ge=0, lt=1)

    def check(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"'betas' must have 2 values, got {self.betas}")

    def schedule(self, total_steps: int) -> dict[str, Any]:
        """The optimizer and schedule keywords of engine/models/deepspeed_glue.initialize_training_engine
        for a run of ``total_steps`` optimizer steps."""
        return dict(
            lr=self.lr,
            betas=tuple(self.betas),
            weight_decay=self.weight_decay,
            lr_scheduler=self.lr_scheduler,
            warmup_steps=int(self.warmup_ratio * total_steps),
            total_steps=total_steps,
        )


class CheckpointSection(Config):
    every_steps: int = option(0, "save a resumable checkpoint every N optimizer steps (0: none by count)", ge=0)
    every_minutes: float = option(
        30.0,
        "also save one when this many minutes have passed since the last save (0: none by time); a stop "
        "signal always saves",
        ge=0,
    )
    keep_last: int = option(2, "how many checkpoints to keep", ge=1)


class LoggingSection(Config):
    output_dir: str = option("runs/rm", "run directory: metrics, checkpoints, final model")
    wandb_project: str = option("rlhf-toolkit", "wandb project (offline unless WANDB_MODE or WANDB_API_KEY is set)")
    wandb: bool = option(True, "log to wandb")
    tensorboard: bool = option(True, "log to TensorBoard")
    progress_bar: bool = option(True, "show a tqdm bar on rank 0")


class GuardsSection(Config):
    max_nonfinite_in_a_row: int = option(
        5, "abort after this many optimizer steps in a row discarded for a NaN/Inf loss or gradient", ge=1
    )


class EpochsSection(Config):
    """The schedule of a pass over a fixed data set (SFT, RM); subclasses add the step size."""

    epochs: int = option(1, "passes over the train data", ge=1)
    max_steps: int = option(0, "stop after this many optimizer steps (0: run all epochs)", ge=0)
    max_tokens_per_micro_batch: int = option(2048, "token budget of one packed forward on one rank", ge=2)
    eval_every_steps: int = option(0, "evaluate every N steps (0: only at the end)", ge=0)
    seed: int = option(0, "seed of the data order (and of a new head's initialisation)", ge=0, le=MAX_SEED)


class PairsTrainSection(EpochsSection):
    """The schedule of a pass over preference pairs (RM, DPO)."""

    pairs_per_step: int = option(32, "pairs per optimizer step, over all ranks", ge=1)
