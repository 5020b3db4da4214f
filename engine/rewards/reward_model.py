"""A trained reward model's heads, read as in its training (engine/rm/reward_model.py): the value at
each conversation's last token. One reading for the trainer's reward model (engine/ppo/rewards.py)
and the reward server's (engine/rewards/server.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers import PreTrainedModel

from engine.data.packing import PackedBatch, last_token, packed_forward
from engine.run.micro_batches import map_micro_batches


def head_names(model: torch.nn.Module) -> list[str]:
    """The heads' names (``id2label``), in head order; ``model`` bare or in a DeepSpeed engine."""
    hf_model = cast(PreTrainedModel, getattr(model, "module", model))  # a DeepSpeedEngine's .config is DeepSpeed's
    labels = cast(dict[int, str], hf_model.config.id2label)
    return [labels[i] for i in sorted(labels)]


@torch.no_grad()
def reward_model_heads(
    model: torch.nn.Module,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    share_prompts: bool,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """(N, C) float32 head values at the last token of each of the N ``sequences`` (prompt + response,
    the prompt ``prompt_lens[i]`` tokens), on the CPU. ``model``: a value model, bare or in a DeepSpeed
    engine; packed forwards of at most ``max_tokens`` tokens (engine/run/micro_batches.py), the
    sequences of a prompt sharing it where ``share_prompts`` and the attention allow. In a process
    group a collective: every rank calls it (``pad_token_id``: a dummy forward's token)."""

    def read(packed: PackedBatch, _: list[int]) -> list[torch.Tensor]:
        return list(last_token(packed_forward(model, packed), packed).float())  # a (C,) tensor per sequence

    heads = map_micro_batches(model, sequences, prompt_lens, max_tokens, pad_token_id, share_prompts, read)
    return torch.stack(heads) if heads else torch.zeros(0, len(head_names(model)))
