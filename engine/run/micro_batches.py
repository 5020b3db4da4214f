"""Packed micro-batches of token sequences (prompt + response) for a model's forwards.

Their count is the one every rank agrees on (ZeRO-3 forwards are collectives; a rank with nothing
left runs a dummy one); outside a process group (the reward server) it is the fewest that fit. The
sequences of a prompt can share it (computed once) where the model's attention allows. Results come
back one tensor per sequence, in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from engine.data.batching import group_tokens, plan_micro_batches, prompt_groups
from engine.data.packing import PackedBatch, pack_groups, pack_sequences, runs_shared_prompts
from engine.run.distributed import agree_max


def packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches, as many as the busiest rank needs (empty ones are dummies)."""
    count = len(plan_micro_batches(lengths, max_tokens))
    if torch.distributed.is_initialized():
        count = agree_max(count)
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
