"""LoRA adapters (PEFT) on the PPO actor and critic.

Only the adapters (and a critic's value head) are trained, so only they have optimizer states
and only they are checkpointed (``exclude_frozen_parameters``; the base weights are reloaded
from the model path on resume). The reference policy is the actor with its adapters disabled:
PEFT's disabled LoRA layer returns its base layer's output untouched, so this is the base
model exactly, without a second copy of its weights.

Adapters are added after ``from_pretrained``: under ZeRO-3 DeepSpeed partitions the new
parameters when it wraps the model. Every rank draws the same initial adapters (same seed).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear

VALUE_HEADS = ("score", "classifier")  # AutoModelForTokenClassification's head, by architecture


def lora_config(section, causal_lm: bool) -> LoraConfig:
    """PEFT's config from a run config's ``lora`` section (engine/run_config.LoraSection)."""
    return LoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
        task_type="CAUSAL_LM" if causal_lm else None,
    )


def add_adapters(model: torch.nn.Module, section, causal_lm: bool) -> PeftModel:
    """``model`` with LoRA adapters on ``section.target_modules``; only the adapters train, and for
    a value model (``causal_lm`` False) its head too, which starts untrained or as the reward model's."""
    peft_model = get_peft_model(model, lora_config(section, causal_lm))
    if not causal_lm:
        for name in VALUE_HEADS:
            if hasattr(peft_model.get_base_model(), name):
                getattr(peft_model.get_base_model(), name).requires_grad_(True)
    return peft_model


def adapters_disabled(module: torch.nn.Module):
    """Context in which a PEFT model computes with its base weights only (a no-op for other models)."""
    return module.disable_adapter() if isinstance(module, PeftModel) else contextlib.nullcontext()


def merged_weight(layer: LoraLinear, base_weight: torch.Tensor) -> torch.Tensor:
    """W + scaling * B @ A of ``layer``'s active adapter (``base_weight`` is W, gathered), or W
    while the adapters are disabled."""
    if layer.disable_adapters:
        return base_weight
    return base_weight + layer.get_delta_weight(layer.active_adapters[0]).to(base_weight.dtype)


class ReferenceView:
    """The frozen reference of a LoRA run: the actor engine with its adapters disabled, called
    like an engine (``model(**inputs)``, ``.module``)."""

    def __init__(self, actor_engine: Any):
        self.actor_engine = actor_engine
        self.module = actor_engine.module

    def __call__(self, **inputs):
        with adapters_disabled(self.module):
            return self.actor_engine(**inputs)
