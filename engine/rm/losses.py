"""Reward-model losses: Bradley-Terry, margin, centering, decomposition into components.

Pure tensor functions; every loss returns per-pair values so the caller chooses the
aggregation (sum over a micro-batch, scaled to the global mean: engine/data/batching.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """-log sigmoid(r_c - r_r - margin), per pair (B,).

    Bradley & Terry (1952); margin as in Llama 2 (Touvron et al. 2023, eq. 2): a pair rated
    "much better" must be separated by at least ``margin``.
    """
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def centering_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """(r_c + r_r)^2 per pair (B,): keeps rewards centred on zero (Eisenstein et al. 2023)."""
    return (r_chosen + r_rejected) ** 2


class PairLosses(NamedTuple):
    """Per-pair loss terms of one micro-batch; ``component`` entries are 0 where unlabelled."""

    total: torch.Tensor  # (B,) BT loss of the weighted total reward against the overall preference
    center: torch.Tensor  # (B,) centering term of the total reward
    component: torch.Tensor  # (B, C) BT loss of each component head, 0 where the label is 0


def weighted_total(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(..., C) component rewards -> (...) total reward = sum_c w_c r_c."""
    return (rewards * weights).sum(-1)


def pair_losses(
    r_chosen: torch.Tensor,  # (B, C)
    r_rejected: torch.Tensor,  # (B, C)
    weights: torch.Tensor,  # (C,)
    margin: torch.Tensor,  # (B,), 0 where the data has none
    labels: torch.Tensor,  # (B, C) in {-1, 0, 1}: +1 chosen better on c, -1 rejected better, 0 unlabelled
) -> PairLosses:
    """All loss terms of a reward model with C components (C = 1: a plain BT reward model).

    A component head is trained only on the pairs that carry its label, oriented by it: with
    label -1 the "rejected" response is the better one for that component.
    """
    total_c, total_r = weighted_total(r_chosen, weights), weighted_total(r_rejected, weights)
    sign = labels.to(r_chosen.dtype)  # (B, C)
    component = bradley_terry_loss(sign * r_chosen, sign * r_rejected) * (labels != 0)
    return PairLosses(
        total=bradley_terry_loss(total_c, total_r, margin),
        center=centering_loss(total_c, total_r),
        component=component,
    )
