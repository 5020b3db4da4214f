"""The policy's log-probs of the responses of preference pairs, from one packed forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.data.preferences import PreferenceExample, collate_pairs
from engine.data.response_tokens import response_logprobs


class PairLogprobs(NamedTuple):
    chosen: torch.Tensor  # (B,) summed log-probs of each chosen response's tokens
    rejected: torch.Tensor  # (B,) ... of each rejected response's
    chosen_tokens: torch.Tensor  # (B,) response lengths (SimPO's length normalisation)
    rejected_tokens: torch.Tensor  # (B,)


def pair_logprobs(model, examples: Sequence[PreferenceExample]) -> PairLogprobs:
    """Summed response-token log-probs of each pair's chosen and rejected response under ``model``:
    the pairs packed in one row as the reward model packs them (:func:`collate_pairs`; a pair's
    shared prefix computed once where the examples mark it), the LM head run on the response
    positions only. Differentiable."""
    packed, _, _ = collate_pairs(examples)
    rows, _ = response_logprobs(model, packed, [e.prompt_len for e in examples for _ in range(2)])
    sums = torch.stack([r.sum() for r in rows]).view(len(examples), 2)  # (B, [chosen, rejected])
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.float32).view(len(examples), 2)
    return PairLogprobs(sums[:, 0], sums[:, 1], lengths[:, 0], lengths[:, 1])
