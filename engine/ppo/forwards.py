"""Forwards of packed sequences for PPO: each response token's log-prob (and entropy) under the
actor or the reference, the critic's value before it.

Sequences (prompt + response) go through token-budget micro-batches whose count every rank agrees
on (ZeRO-3 forwards are collectives; a rank with nothing left runs a dummy one); the samples of a
prompt can share it (computed once) where the model's attention allows. Results come back one
tensor per sequence, in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from engine.data.batching import group_tokens, plan_micro_batches, prompt_groups
from engine.data.packing import (
    PackedBatch,
    pack_groups,
    pack_sequences,
    packed_forward,
    runs_shared_prompts,
)
from engine.data.response_tokens import response_logprobs, response_positions
from engine.run.distributed import agree_max


def packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches, as many as the busiest rank needs (empty ones are dummies)."""
    count = agree_max(len(plan_micro_batches(lengths, max_tokens)))
    return plan_micro_batches(lengths, max_tokens, num_micro_batches=count)


def micro_batches(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
) -> Iterator[tuple[list[int], PackedBatch]]:
    """This rank's packed micro-batches of ``sequences`` (prompt + response) for ``model``:
    ``(indices, packed)`` each, the indices in packing order; as many as the busiest rank needs (a
    dummy one packs a padding token and no indices). ``share_prompts``, where the model's attention
    runs shared-prompt rows: the sequences of a prompt pack it once
    (:func:`engine.data.batching.prompt_groups`), and the token budget counts it once."""
    share = share_prompts and runs_shared_prompts(model)
    groups = prompt_groups(sequences, prompt_lens, max_tokens) if share else [(0, [i]) for i in range(len(sequences))]
    for micro in packed_micro_batches(group_tokens(sequences, groups), max_tokens):
        chosen = [groups[j] for j in micro]
        indices = [i for _, members in chosen for i in members]
        yield (
            indices,
            (
                pack_groups(sequences, chosen, pad_token_id)
                if share
                else pack_sequences([sequences[i] for i in indices], pad_token_id)
            ),
        )


def map_micro_batches(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
    fn: Callable[[PackedBatch, list[int]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Apply ``fn(packed, indices)`` (a forward of ``model`` returning one tensor per packed
    sequence) over ``sequences`` in :func:`micro_batches`; dummy micro-batches run a one-token forward through
    ``fn`` too. Results come back in input order."""
    results: list[torch.Tensor | None] = [None] * len(sequences)
    for indices, packed in micro_batches(model, sequences, prompt_lens, max_tokens, pad_token_id, share_prompts):
        for i, value in zip(indices, fn(packed, indices)):
            results[i] = value
    return results  # type: ignore[return-value]


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
    """Ragged 1-D tensors -> (B, width), zero padded."""
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
