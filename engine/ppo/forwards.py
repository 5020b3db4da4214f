"""Forwards of packed sequences for PPO: each response token's log-prob (and entropy) under the
actor or the reference, the critic's value before it, in the micro-batches every rank agrees on
(engine/run/micro_batches.py). Results come back one tensor per sequence, in input order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ValueReadout:
    """The critic's value from its C outputs: ``outputs @ weights + bias``.

    A new head's one output is the value (weights ``[1]``, bias 0). A critic that kept the reward
    model's head reads it as the reward model's term of the reward (its components weighted,
    standardised with reward_stats.json, times reward_model.weight), so it starts as that term, on
    the reward's scale (OpenRLHF's critic applies the reward model's normalisation likewise).
    """

    weights: torch.Tensor  # (C,)
    bias: float = 0.0

    def __call__(self, outputs: torch.Tensor) -> torch.Tensor:
        """(..., C) outputs -> (...) values."""
        return (outputs * self.weights).sum(-1) + self.bias


def response_values(
    output: torch.Tensor, packed, prompt_lens: Sequence[int], readout: ValueReadout
) -> list[torch.Tensor]:
    """Critic value of the state before each response token: (R,) per sequence."""
    positions, _, lengths = response_positions(packed, prompt_lens)
    return list(readout(output[0, positions.to(output.device)].float().cpu()).split(lengths))  # (K, C) -> (K,)


def sequence_values(
    critic,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    readout: ValueReadout,
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
            packed_forward(critic, packed), packed, [prompt_lens[i] for i in idx], readout
        ),
    )


def pad_right(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Ragged tensors (R_i, ...) -> (B, width, ...), zero padded."""
    trailing = rows[0].shape[1:] if rows else ()
    out = torch.zeros(len(rows), width, *trailing, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
