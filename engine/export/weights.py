"""An engine's weights out of a checkpoint, into the model its run built, and out as an HF model
directory the way the trainers write their final model (engine/models/deepspeed_glue.write_hf_model).

The weights are DeepSpeed's fp32 master weights, gathered from every rank's ZeRO-2 or ZeRO-3
partition by DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``; a LoRA run's checkpoints
hold only what trained (the adapters, a critic's value head), the base comes from the model path.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.utils import zero_to_fp32
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.export.source import ExportedModel
from engine.models.deepspeed_glue import DEEPSPEED_STATE_TYPES, write_hf_model
from engine.models.hf_weights import merged_state_dict
from engine.models.loading import load_causal_lm, load_value_model
from engine.models.lora import add_adapters
from engine.run.launch import RunRefused


@contextlib.contextmanager
def tensors_only_loads() -> Iterator[None]:
    """Every ``torch.load`` unpickles tensors and DeepSpeed's state types only (``weights_only``), as a
    resume does (engine/models/deepspeed_glue.GuardedCheckpointEngine): DeepSpeed 0.19.8's zero_to_fp32
    loads with ``weights_only=False``, and a checkpoint must never run code."""
    load = torch.load

    def guarded(*args: Any, **kwargs: Any) -> Any:
        with torch.serialization.safe_globals(DEEPSPEED_STATE_TYPES):
            return load(*args, **{**kwargs, "weights_only": True})

    torch.load = guarded
    try:
        yield
    finally:
        torch.load = load


def checkpoint_state(path: str, engine: str, trained_only: bool) -> dict[str, torch.Tensor]:
    """The fp32 weights of ``engine`` in the checkpoint at ``path`` under the model's parameter names
    (``trained_only``: a LoRA run's, which hold nothing else); :class:`RunRefused` naming what is wrong."""
    where = os.path.join(path, engine)
    if not os.path.isdir(where):
        held = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise RunRefused("checkpoint", f"{path} has no engine '{engine}' (it holds {held})")
    try:
        with tensors_only_loads(), contextlib.redirect_stdout(io.StringIO()):  # its progress lines
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                path, tag=engine, exclude_frozen_parameters=trained_only
            )
    except pickle.UnpicklingError as e:
        raise RunRefused(
            "checkpoint", f"{where}: refused, its files hold an object that loading would run code for ({e})"
        ) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise RunRefused("checkpoint", f"{where}: not a readable ZeRO-2/3 checkpoint of DeepSpeed ({e})") from None


def model_with_weights(spec: ExportedModel, state: dict[str, torch.Tensor]) -> PreTrainedModel | PeftModel:
    """The model of ``spec`` (from its path, with LoRA adapters when its run had them) holding ``state``,
    in the run's dtype; :class:`RunRefused` when the weights do not fit it."""
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    kw: dict[str, Any] = dict(dtype=dtype, trust_remote_code=spec.trust_remote_code)
    model: PreTrainedModel | PeftModel = (
        load_value_model(spec.path, spec.components, **kw) if spec.value_head else load_causal_lm(spec.path, **kw)
    )
    if spec.lora.rank:
        model = add_adapters(model, spec.lora, causal_lm=not spec.value_head)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if spec.lora.rank == 0 or model.get_parameter(n).requires_grad]
    if missing or unexpected:
        raise RunRefused(
            "checkpoint",
            f"engine '{spec.engine}' does not fit the model at {spec.key} {spec.path}: "
            f"{len(missing)} weights missing (e.g. {missing[:1]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:1]})",
        )
    return model.eval()


def write_export(
    model: PreTrainedModel | PeftModel,
    state: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str,
    extra_json: dict[str, dict],
) -> None:
    """``model`` as an HF model directory (a LoRA model merged, with ``adapter/``: the trained ``state``
    in PEFT format), as the trainers save theirs. In a process group (the merge is written as on rank 0)."""
    if isinstance(model, PeftModel):
        merged = merged_state_dict(model)
        assert merged is not None  # this process is rank 0
        write_hf_model(model, merged, tokenizer, out_dir, extra_json, adapter=state)
    else:
        write_hf_model(model, model.state_dict(), tokenizer, out_dir, extra_json)
