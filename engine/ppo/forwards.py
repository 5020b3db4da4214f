"""Forwards of packed sequences for PPO: each response token's log-prob (and entropy) under the
actor or the reference, the critic's value before it, in the micro-batches every rank agrees on
(engine/run/micro_batches.py). Results come back one tensor per sequence, in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.data.packing import packed_forward
from engine.data.response_tokens import response_logprobs, response_positions
from engine.run.micro_batches import map_micro_batches


def sequence_logprobs(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Each sequence's response-token log-probs under ``model`` sampling at ``temperature`` (one
    (R_i,) tensor each), computed in packed micro-batches of at most ``max_tokens``, prompts shared
    where ``share_prompts`` and the model's attention allows."""
    return map_micro_batches(
        model,
        sequences,
        prompt_lens,
        max_tokens,
        pad_token_id,
        share_prompts,
        lambda packed, idx: response_logprobs(model, packed, [prompt_lens[i] for i in idx], temperature=temperature)[0],
    )


def response_values(
    output: torch.Tensor, packed, prompt_lens: Sequence[int], weights: torch.Tensor
) -> list[torch.Tensor]:
    """Critic value of the state before each response token: (R,) per sequence.

    A critic initialised from a decomposed reward model keeps its C outputs; the value is their
    weighted sum, so it starts as the reward model's total.
    """
    positions, _, lengths = response_positions(packed, prompt_lens)
    values = output[0, positions.to(output.device)].float().cpu()  # (K, C)
    return list((values * weights).sum(-1).split(lengths))


def sequence_values(
    critic,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    weights: torch.Tensor,
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
) -> list[torch.Tensor]:
    """Each sequence's critic values (one (R_i,) tensor each), in packed micro-batches of at most
    ``max_tokens``, prompts shared as in :func:`sequence_logprobs`."""
    return map_micro_batches(
        critic,
        sequences,
        prompt_lens,
        max_tokens,
        pad_token_id,
        share_prompts,
        lambda packed, idx: response_values(
            packed_forward(critic, packed), packed, [prompt_lens[i] for i in idx], weights
        ),
    )


def pad_right(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Ragged tensors (R_i, ...) -> (B, width, ...), zero padded."""
    trailing = rows[0].shape[1:] if rows else ()
    out = torch.zeros(len(rows), width, *trailing, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
