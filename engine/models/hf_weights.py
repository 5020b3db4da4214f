"""A model's full weights under its Hugging Face names, one decoder layer at a time.

Under ZeRO-3 each bucket is gathered while it is read, so memory stays bounded by one layer
(the vLLM weight sync, engine/rollout/weight_sync.py, and the export of a LoRA model use it).
A LoRA model (PEFT) yields its base model's names, each adapted projection merged:
W + scaling * B @ A (engine/models/lora.merged_weight), or W alone while its adapters are
disabled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import deepspeed
import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from transformers import PreTrainedModel

from engine.models.lora import merged_weight


def decoder_layers(module: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The (name, ModuleList) holding the transformer blocks: the list with num_hidden_layers entries."""
    n_layers = cast(PreTrainedModel, module).config.num_hidden_layers
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) == n_layers:
            return name, child
    raise ValueError(f"{type(module).__name__}: no ModuleList of {n_layers} decoder layers found")


def weight_buckets(module: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """One bucket per decoder layer, then one with everything else (embeddings, norm, head)."""
    prefix, layers = decoder_layers(module)
    in_layers: set[int] = set()  # ids of the layers' parameters
    for i, layer in enumerate(layers):
        bucket = [(f"{prefix}.{i}.{name}", p) for name, p in layer.named_parameters()]
        in_layers.update(id(p) for _, p in bucket)
        yield bucket
    yield [(name, p) for name, p in module.named_parameters() if id(p) not in in_layers]


def ties_embeddings(module: torch.nn.Module) -> bool:
    """Whether the model's LM head is its input embedding (one parameter, sent once)."""
    base = module.get_base_model() if isinstance(module, PeftModel) else module
    head = cast(PreTrainedModel, base).get_output_embeddings()
    return head is not None and head.weight is cast(PreTrainedModel, base).get_input_embeddings().weight


def hf_weight_buckets(module: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(HF name, full tensor) per bucket of :func:`weight_buckets`, valid until the next bucket
    (gathered from ZeRO-3 meanwhile). All ranks iterate it to the end (the gathers are collectives).
    A PEFT model's buckets carry its base model's names with the adapters merged in."""
    base = module.get_base_model() if isinstance(module, PeftModel) else module
    for bucket in weight_buckets(base):
        with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
            weights = []
            for name, p in bucket:
                if ".lora_" in name:  # folded into its base layer's weight
                    continue
                adapted = name.removesuffix(".base_layer.weight")
                if adapted != name:  # a LoRA layer's base weight
                    tensor = merged_weight(cast(LoraLinear, base.get_submodule(adapted)), p.data)
                else:
                    tensor = p.data
                weights.append((name.replace(".base_layer", ""), tensor))
            yield weights


def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A LoRA model's weights under its base model's names, adapters merged in, on rank 0 (None
    elsewhere). All ranks call it (ZeRO-3 gathers one layer at a time)."""
    rank0 = torch.distributed.get_rank() == 0
    state = {name: t.detach().cpu().clone() for bucket in hf_weight_buckets(module) for name, t in bucket if rank0}
    return state if rank0 else None
