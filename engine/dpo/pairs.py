"""The policy's log-probs of the responses of preference pairs, from one packed forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.data.preferences import PreferenceExample, collate_pairs
from engine.data.response_tokens import response_log_softmax, response_logprobs


class PairLogprobs(NamedTuple):
    chosen: torch.Tensor  # (B,) summed log-probs of each chosen response's tokens
    rejected: torch.Tensor  # (B,) ... of each rejected response's
    chosen_tokens: torch.Tensor  # (B,) response lengths (SimPO's length normalisation)
    rejected_tokens: torch.Tensor  # (B,)
    per_token: list[torch.Tensor]  # 2B rows (chosen, rejected of pair 0, then of pair 1, ...): each token's log-prob

    @classmethod
    def from_rows(cls, rows: list[torch.Tensor]) -> PairLogprobs:
        """From the 2B per-token rows (chosen, rejected of each pair in turn)."""
        sums = torch.stack([r.sum() for r in rows]).view(-1, 2)  # (B, [chosen, rejected])
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.float32).view(-1, 2)
        return cls(sums[:, 0], sums[:, 1], lengths[:, 0], lengths[:, 1], rows)


def response_lengths(examples: Sequence[PreferenceExample]) -> list[int]:
    """2B response lengths: the chosen, then the rejected response of each pair."""
    return [len(ids) - e.prompt_len for e in examples for ids in (e.chosen_ids, e.rejected_ids)]


def response_starts(examples: Sequence[PreferenceExample]) -> list[int]:
    """2B + 1 offsets of the responses' tokens laid end to end in :func:`response_lengths` order."""
    return [0, *torch.tensor(response_lengths(examples)).cumsum(0).tolist()]


def prompt_lens(examples: Sequence[PreferenceExample]) -> list[int]:
    """Each packed sequence's prompt length (chosen and rejected of each pair in turn)."""
    return [e.prompt_len for e in examples for _ in range(2)]


def pair_logprobs(model, examples: Sequence[PreferenceExample]) -> PairLogprobs:
    """Summed response-token log-probs of each pair's chosen and rejected response under ``model``:
    the pairs packed in one row as the reward model packs them (:func:`collate_pairs`; a pair's
    shared prefix computed once where the examples mark it), the LM head run on the response
    positions only. Differentiable."""
    packed, _, _ = collate_pairs(examples)
    rows, _ = response_logprobs(model, packed, prompt_lens(examples))
    return PairLogprobs.from_rows(rows)


@torch.no_grad()
def pair_distributions(model, examples: Sequence[PreferenceExample]) -> tuple[PairLogprobs, torch.Tensor]:
    """:func:`pair_logprobs` and the (K, V) next-token log-distributions at the K response positions
    (rows in the same order), for the KL to the reference."""
    packed, _, _ = collate_pairs(examples)
    log_softmax, targets = response_log_softmax(model, packed, prompt_lens(examples))
    per_token = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    return PairLogprobs.from_rows(list(per_token.split(response_lengths(examples)))), log_softmax
