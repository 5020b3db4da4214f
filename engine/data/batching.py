"""Dynamic (token-budget) micro-batching: which sequences go together into one packed forward.

A mini-batch of items (a sequence, or a chosen+rejected pair that must stay together) is cut
into micro-batches whose token count stays within ``max_tokens`` (verl's
``ppo_max_token_len_per_gpu``, OpenRLHF's ``max_tokens_per_gpu``). Every data-parallel rank
must run the same number of forward/backward passes, or ZeRO's collectives hang; so the count
is agreed first (the largest any rank needs) and each rank then spreads its items over exactly
that many micro-batches, as evenly as the budget allows. A rank with fewer items than
micro-batches gets empty ones (the trainer runs a zero-weight dummy forward for them).

Loss aggregation across micro-batches: see :func:`token_mean_scale`.

The planning functions are pure Python on lists of lengths; indices refer to the input order.
:func:`epoch_order` is the data order of an epoch, shared by the RM and PPO loops.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np


def check_fits(lengths: Sequence[int], max_tokens: int, what: str = "item") -> None:
    """Raise ValueError naming the first item longer than the budget."""
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"{what} {i} has {n} tokens, more than max_tokens_per_micro_batch={max_tokens}; "
                "raise the budget or enable truncation"
            )


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack indices into few bins of at most ``max_tokens`` (FFD: <= 11/9 OPT + 6/9 bins).

    Longest items first, each into the first bin with room. Bins come back in creation order,
    indices inside a bin ascending.
    """
    check_fits(lengths, max_tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def balanced_bins(lengths: Sequence[int], max_tokens: int, num_bins: int) -> list[list[int]]:
    """Exactly ``num_bins`` bins within the budget, token loads as even as possible.

    Longest item first into the least-loaded bin (LPT). If the least-loaded bin cannot take an
    item no bin can, and the plan falls back to first-fit-decreasing into ``num_bins`` bins,
    which always succeeds when ``num_bins >= len(first_fit_decreasing(...))``. Empty bins are
    possible when there are fewer items than bins.
    """
    check_fits(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(0, b) for b in range(num_bins)]  # (load, bin)
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lengths[i] > max_tokens:
            return _first_fit_into(lengths, max_tokens, num_bins, order)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins]


def _first_fit_into(lengths: Sequence[int], max_tokens: int, num_bins: int, order: list[int]) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in order:
        b = next((b for b in range(num_bins) if loads[b] + lengths[i] <= max_tokens), None)
        if b is None:
            raise ValueError(
                f"{len(lengths)} items of {sum(lengths)} tokens do not fit {num_bins} bins of {max_tokens}"
            )
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def split_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal items to ranks with near-equal token loads (LPT, no budget); indices ascending."""
    return balanced_bins(lengths, max_tokens=max(1, sum(lengths)), num_bins=world_size)


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> list[list[int]]:
    """One rank's micro-batches: the fewest that fit, or exactly ``num_micro_batches``.

    Pass the count agreed across ranks (the max of each rank's ``len(plan_micro_batches(...))``)
    so that every rank runs the same number of forward/backward passes.
    """
    needed = len(first_fit_decreasing(lengths, max_tokens))
    if num_micro_batches is None:
        return balanced_bins(lengths, max_tokens, needed)
    if num_micro_batches < needed:
        raise ValueError(f"{num_micro_batches} micro-batches cannot hold these items; at least {needed} are needed")
    return balanced_bins(lengths, max_tokens, num_micro_batches)


def plan_global(lengths: Sequence[int], max_tokens: int, world_size: int) -> list[list[list[int]]]:
    """``plan[rank][micro_batch] -> item indices`` for a mini-batch every rank knows whole.

    Items are dealt to ranks with balanced token loads, then each rank's share is spread over
    the same number of micro-batches (the most any rank needs). Deterministic: every rank
    computes the same plan without communicating.
    """
    shares = split_across_ranks(lengths, world_size)
    needed = max(len(first_fit_decreasing([lengths[i] for i in share], max_tokens)) for share in shares)
    plan = []
    for share in shares:
        bins = balanced_bins([lengths[i] for i in share], max_tokens, needed)
        plan.append([[share[j] for j in b] for b in bins])
    return plan


def prompt_groups(
    sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], max_tokens: int
) -> list[tuple[int, list[int]]]:
    """Sequences that start with the same prompt, to pack it once (engine/data/packing.pack_shared):
    ``(shared length, indices)`` per group, in order of first appearance.

    The shared length is the prompt's, cut so that every member keeps a token of its own; a
    group whose prompt plus continuations exceed ``max_tokens`` is split into several that fit
    (each holding the prompt); :func:`group_tokens` counts what a group packs.
    """
    check_fits([len(s) for s in sequences], max_tokens, "sequence")
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        by_prompt.setdefault(tuple(seq[:p]), []).append(i)
    groups = []
    for members in by_prompt.values():
        shared = min(prompt_lens[members[0]], *(len(sequences[i]) - 1 for i in members))
        part: list[int] = []
        load = shared
        for i in members:
            if part and load + len(sequences[i]) - shared > max_tokens:
                groups.append((shared, part))
                part, load = [], shared
            part.append(i)
            load += len(sequences[i]) - shared
        groups.append((shared, part))
    return groups


def group_tokens(sequences: Sequence[Sequence[int]], groups: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
    """Tokens each :func:`prompt_groups` group takes in a packed row: its prompt once, then every member's rest."""
    return [shared + sum(len(sequences[i]) - shared for i in members) for shared, members in groups]


def token_mean_scale(global_count: int, world_size: int) -> float:
    """Factor that turns a micro-batch's *summed* loss into its share of the global mean.

    With ``loss_mb = sum(per-token losses in the micro-batch) * world_size / global_count``,
    summing the gradients of every micro-batch on a rank (no DeepSpeed GAS scaling) and
    averaging over ranks (DeepSpeed's data-parallel mean) gives exactly the gradient of
    ``sum(all per-token losses) / global_count``: the token-mean of the whole mini-batch,
    independent of how it was cut into micro-batches or spread over ranks. The same holds per
    sequence (``global_count`` = sequences) for sequence-level losses.
    """
    if global_count <= 0:
        raise ValueError(f"global_count must be positive, got {global_count}")
    return world_size / global_count


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled example order of an epoch: a function of (seed, epoch) only, so a resumed
    run finds its place from the epoch and the step within it."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def epoch_batch(
    step: int, num_examples: int, per_step: int, steps_per_epoch: int, seed: int
) -> tuple[list[int], float]:
    """The examples of optimizer step ``step`` (0-based) of an :func:`epoch_schedule` and the epochs
    done at its end: the data position is a function of the step (the epoch, then the batch inside
    its shuffled order)."""
    epoch, in_epoch = divmod(step, steps_per_epoch)
    order = epoch_order(num_examples, seed, epoch)[in_epoch * per_step : (in_epoch + 1) * per_step]
    return order.tolist(), epoch + (in_epoch + 1) / steps_per_epoch


def epoch_schedule(num_examples: int, per_step: int, epochs: int, max_steps: int = 0) -> tuple[int, int]:
    """(optimizer steps per epoch, steps of the run): ``epochs`` passes of ``per_step`` examples
    per step (the last step of an epoch takes what is left), capped at ``max_steps`` when set."""
    per_epoch = math.ceil(num_examples / per_step)
    total = epochs * per_epoch
    return per_epoch, min(total, max_steps) if max_steps else total
