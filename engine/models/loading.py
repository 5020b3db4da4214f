"""Loading the models the scripts train: a causal LM (actor, reference) and a value model.

The value model (reward model, critic) is the causal LM's backbone with a linear head giving
one score per reward component at every token: transformers' ``AutoModelForTokenClassification``
(``Linear(hidden, n_components)``, dropout off). It saves and loads in plain HF format with the
component names as ``id2label``, so the PPO script, transformers and users load it without
custom code. The reward is the score at a sequence's last token; critic values are the scores
at every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

from engine.data.packing import VARLEN_SDPA  # importing it registers that attention implementation

AUTO_ATTENTION = "auto"


def resolve_attention(name: str, dtype: torch.dtype) -> str:
    """``auto``: ``sdpa_varlen``, which on a GPU in 16 bits runs a varlen flash kernel (flash-attn's
    where installed, else PyTorch's) with shared prompts, and elsewhere per-sequence SDPA. Other
    names pass through (``flash_attention_2``: transformers' own flash-attn path, no shared prompts)."""
    return VARLEN_SDPA if name == AUTO_ATTENTION else name


def attention_shares_prompts(attn_implementation: str, bf16: bool) -> bool:
    """Whether the attention a model loads with (these settings) runs shared-prompt rows: ``sdpa_varlen``."""
    return resolve_attention(attn_implementation, torch.bfloat16 if bf16 else torch.float32) == VARLEN_SDPA


def load_causal_lm(
    path: str,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = AUTO_ATTENTION,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A causal LM from an HF checkpoint directory (or hub name); safetensors weights only."""
    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=resolve_attention(attn_implementation, dtype),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
    )


def load_value_model(
    path: str,
    components: Sequence[str] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = AUTO_ATTENTION,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Backbone + per-token ``Linear(hidden, len(components))`` from a causal-LM or value checkpoint.

    From a causal LM the head is freshly initialised (``components`` default: ``["reward"]``);
    from a saved value model ``components`` defaults to, and must match, its ``id2label``.
    """
    return AutoModelForTokenClassification.from_pretrained(
        path,
        config=value_model_config(path, components, trust_remote_code),
        dtype=dtype,
        attn_implementation=resolve_attention(attn_implementation, dtype),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
    )


def trains_as_it_evaluates(model: torch.nn.Module) -> bool:
    """No dropout anywhere (modules, LoRA adapters, the config's attention dropout): a forward in
    train mode computes what one in eval mode does."""
    config = getattr(model, "config", None)
    dropouts = [
        v
        for k, v in (config.to_dict() if config is not None else {}).items()
        if "dropout" in k and isinstance(v, (int, float))
    ]
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) and not any(
        v > 0 for v in dropouts
    )


def meta_model(
    path: str, value_head: bool, components: Sequence[str] | None = None, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The model a script would load from ``path`` (causal LM, or value model with ``value_head``),
    built on the meta device: its shapes without its weights."""
    auto: type[AutoModelForCausalLM | AutoModelForTokenClassification]
    if value_head:
        config, auto = value_model_config(path, components, trust_remote_code), AutoModelForTokenClassification
    else:
        config, auto = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def value_model_config(path: str, components: Sequence[str] | None = None, trust_remote_code: bool = False):
    """The checkpoint's config with a ``len(components)``-way per-token head (see load_value_model)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if any(a.endswith("ForTokenClassification") for a in config.architectures or []):
        saved = [config.id2label[i] for i in sorted(config.id2label)]
        if components is not None and saved != list(components):
            raise ValueError(f"{path} is a value model with components {saved}, not {list(components)}")
        components = saved
    components = list(components or ["reward"])
    config.num_labels = len(components)
    config.id2label = dict(enumerate(components))
    config.label2id = {name: i for i, name in enumerate(components)}
    config.classifier_dropout = 0.0  # a dropout before the head would make rewards random in training
    return config
