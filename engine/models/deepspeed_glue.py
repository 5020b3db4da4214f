"""DeepSpeed glue: one free function per job (config, load, wrap, save), and the checkpoint engine every
training engine writes and loads its files with. No training logic."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable
from typing import Any, cast

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import set_z3_leaf_modules
from deepspeed.utils.tensor_fragment import fragment_address
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler
from transformers.integrations import HfDeepSpeedConfig

from engine.models.hf_weights import merged_state_dict
from engine.models.lora import ReferenceView

# The only non-tensor types in DeepSpeed 0.19's checkpoint files (ZeRO-1/2/3, fp32/bf16, offload),
# found with torch.serialization.get_unsafe_globals_in_checkpoint.
DEEPSPEED_STATE_TYPES = [LossScaler, ZeroStageEnum, fragment_address]


class GuardedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, with two changes (installed by
    :func:`initialize_training_engine`):

    * ``load`` unpickles with ``weights_only=True`` and only :data:`DEEPSPEED_STATE_TYPES`
      allowed, so a checkpoint cannot run code (DeepSpeed 0.19 loads with ``weights_only=False``);
    * a failed ``save`` (disk full, file-size limit: torch's zip writer raises RuntimeError such as
      "basic_ios::clear: iostream error", not OSError) is recorded in ``write_error`` and the
      remaining writes are skipped, so every rank still makes the collectives of DeepSpeed's save
      and :func:`engine.run.checkpoint.save_checkpoint` can agree on the failure instead of hanging.
    """

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.write_error: Exception | None = None

    def save(self, state_dict, path: str) -> None:
        if self.write_error is None:
            try:
                super().save(state_dict, path)
            except Exception as e:
                self.write_error = e

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(DEEPSPEED_STATE_TYPES):
            return torch.load(path, map_location=map_location, weights_only=True)


def training_ds_config(ds_config: dict[str, Any], bf16: bool) -> dict[str, Any]:
    """The user's DeepSpeed config adapted to token-budget batching.

    Micro-batches have varying sizes and counts, so DeepSpeed's own batch bookkeeping is
    neutralised (micro batch 1, no GAS) and ``managed_gradient_accumulation`` is turned off
    (deepspeed 0.19): every ``backward`` accumulates, ``step()`` is the boundary that reduces
    and updates, whatever the number of micro-steps before it.
    """
    cfg = copy.deepcopy(ds_config)
    for key in ("train_batch_size", "fp16"):
        cfg.pop(key, None)
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["gradient_accumulation_steps"] = 1
    cfg["managed_gradient_accumulation"] = False
    # bf16 ZeRO-1/2 check the gradient for NaN/Inf only when asked (fp32 and ZeRO-3 always do):
    # a non-finite step is then discarded, which engine/run/guards.py counts.
    cfg["bf16"] = {"enabled": True, "check_grad_overflow": True} if bf16 else {"enabled": False}
    cfg.setdefault("gradient_clipping", 1.0)
    if zero_stage(cfg) == 3:  # its default replaces torch.nn.functional.linear process-wide (slower on CPU)
        cfg["zero_optimization"].setdefault("memory_efficient_linear", False)
    return cfg


def inference_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """Config of a frozen model (reference, reward model): ZeRO-3 partitions its weights like the
    trained models'; under ZeRO-1/2 (which need an optimizer) it is replicated (stage 0)."""
    cfg = copy.deepcopy(ds_config)
    if zero_stage(cfg) < 3:
        cfg["zero_optimization"] = {"stage": 0}
    return cfg


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def load_partitioned(loader: Callable[[], PreTrainedModel], ds_config: dict[str, Any]) -> tuple[PreTrainedModel, Any]:
    """Run ``loader`` (a ``from_pretrained`` call) so that ZeRO-3 partitions weights as they load.

    Returns ``(model, keep_alive)``: hold ``keep_alive`` for the engine's lifetime. While it is
    alive transformers treats every ``from_pretrained`` as a collective (all ranks must call it).
    Raw ``deepspeed.zero.Init`` around a transformers 5 model breaks (field notes), hence
    ``HfDeepSpeedConfig``.
    """
    keep_alive = HfDeepSpeedConfig(ds_config) if zero_stage(ds_config) == 3 else None
    return loader(), keep_alive


def fetch_whole_decoder_layers(model: torch.nn.Module, ds_config: dict[str, Any]) -> None:
    """ZeRO-3: gather a decoder layer's parameters once as the layer starts rather than per
    linear layer (DeepSpeed "leaf" modules), so ZeRO-3's fetch and release hooks run per layer.
    On 2 cores an h128 actor's and critic's forward + backward took 0.43-0.49 s against 0.50-0.63 s.
    The layer classes are the model's ``_no_split_modules`` (transformers' repeated blocks).

    Not for a model that trains with frozen input embeddings (LoRA): DeepSpeed releases a leaf's
    parameters when the leaf's full backward hook fires, and with no input that needs a gradient
    that is before the first layer's own backward has read them."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    classes = list(getattr(base, "_no_split_modules", None) or [])
    if zero_stage(ds_config) != 3 or not classes:  # ZeRO-2, or no transformers blocks (a plain torch module)
        return
    trains_on_frozen_inputs = (
        any(p.requires_grad for p in model.parameters())
        and not cast(PreTrainedModel, base).get_input_embeddings().weight.requires_grad
    )
    if not trains_on_frozen_inputs:
        set_z3_leaf_modules(model, classes, raise_if_not_found=False)


def initialize_training_engine(
    model: PreTrainedModel | PeftModel,
    ds_config: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    lr_scheduler: str,
    warmup_steps: int,
    total_steps: int,
):
    """Wrap ``model`` with torch AdamW and a warm-up schedule in a DeepSpeed engine.

    torch's fused AdamW rather than DeepSpeed's: FusedAdam / DeepSpeedCPUAdam are JIT-compiled on
    first use (~100 s each on CPU); ZeRO partitions any torch optimizer. Fused, the update makes
    one pass over the flat partition with no full-size temporaries (an h512 actor + critic step
    0.28 -> 0.18 s on 2 cores). Checkpoints go through :class:`GuardedCheckpointEngine`.
    """
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay, fused=True
    )
    scheduler = get_scheduler(lr_scheduler, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    fetch_whole_decoder_layers(model, ds_config)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    engine.checkpoint_engine = GuardedCheckpointEngine(engine._config)  # no code runs on load; write failures agreed on
    return engine


def frozen_engine(model, ds_config):
    """A ZeRO inference engine: partitioned weights, no optimizer, no gradients."""
    model.requires_grad_(False)
    fetch_whole_decoder_layers(model, ds_config)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


def describe_engine(engine) -> str:
    """What is in effect in a training engine, read from the engine and its optimizer (not from the
    config): ZeRO stage, weight dtype, offloads, gradient checkpointing."""
    param = next(engine.module.parameters())
    dtype = getattr(param, "ds_tensor", param).dtype  # ZeRO-3: this rank's partition
    optimizer = engine.optimizer
    offloads = [
        what
        for what, on in (
            (
                "optimizer",
                getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "cpu_offload", False),
            ),  # ZeRO-3, ZeRO-1/2
            ("parameters", getattr(optimizer, "offload_param", False)),
        )
        if on
    ]
    return (
        f"ZeRO-{engine.zero_optimization_stage()}, {str(dtype).removeprefix('torch.')} weights, offload: "
        f"{' + '.join(offloads) or 'none'}, "
        f"gradient checkpointing {'on' if getattr(engine.module, 'is_gradient_checkpointing', False) else 'off'}"
    )


def full_state_dict(engine, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The unpartitioned weights (or only the trained ones) on rank 0, None elsewhere. A collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trained_only)
    if torch.distributed.get_rank() != 0:
        return None
    trained = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    return {name: t for name, t in engine.module.state_dict().items() if name in trained or not trained_only}


def save_hf_model(
    engine, tokenizer: PreTrainedTokenizerBase, out_dir: str, extra_json: dict[str, dict] | None = None
) -> None:
    """Save the engine's model in HF format (safetensors + config + tokenizer) to ``out_dir``; a
    LoRA model (PEFT) as the merged model, with the adapter alone in PEFT format in ``out_dir/adapter``.

    All ranks call it. Rank 0 writes into a temporary sibling and renames it into place, so
    ``out_dir`` holds a complete model at every moment but one rename.
    """
    lora = isinstance(engine.module, PeftModel)
    release_gathered_parameters(engine)
    state = merged_state_dict(engine.module) if lora else full_state_dict(engine)
    adapter = full_state_dict(engine, trained_only=True) if lora else None
    if torch.distributed.get_rank() == 0:
        assert state is not None
        write_hf_model(engine.module, state, tokenizer, out_dir, extra_json, adapter)
    torch.distributed.barrier()


def write_hf_model(
    module: PreTrainedModel | PeftModel,
    state: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str,
    extra_json: dict[str, dict] | None = None,
    adapter: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``state`` (the full weights; a PEFT ``module``'s merged, under its base model's names) as
    ``module``'s HF model with ``tokenizer`` and ``extra_json`` files to ``out_dir``, and a PEFT module's
    ``adapter`` weights in PEFT format to ``out_dir/adapter``: into a temporary sibling, renamed into
    place (an earlier ``out_dir`` is replaced). One process (:func:`save_hf_model`'s rank 0, the export)."""
    tmp = f"{out_dir}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model = cast(PreTrainedModel, module.get_base_model() if isinstance(module, PeftModel) else module)
    hf_model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if isinstance(module, PeftModel):
        module.save_pretrained(os.path.join(tmp, "adapter"), state_dict=adapter)
    tokenizer.save_pretrained(tmp)
    for name, payload in (extra_json or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(payload, f, indent=2)
    old = f"{out_dir}.old"
    if os.path.isdir(out_dir):
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def scale_learning_rate(engine, factor: float) -> None:
    """Multiply a DeepSpeed engine's learning rate by ``factor``, now and for the rest of its
    schedule (the HF schedulers scale ``base_lrs``, which the scheduler checkpoint keeps)."""
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] *= factor


def release_gathered_parameters(engine) -> None:
    """ZeRO-3: partition again every parameter a forward left gathered or in flight, so that a
    gather (the weight sync, a save) starts from none. DeepSpeed's ``engine.empty_partition_cache()``
    does this and then runs ``gc.collect()``, a walk of every Python object of a process holding vLLM
    that frees nothing here: without it a tiny model's weight sync took 0.34 s instead of 0.58 s (medians)."""
    if isinstance(engine, ReferenceView):  # a LoRA run's reference: the actor's parameters
        engine = engine.actor_engine
    if hasattr(engine.optimizer, "empty_partition_cache"):  # ZeRO-3's optimizer, or its offload for a frozen engine
        engine.optimizer.empty_partition_cache()
