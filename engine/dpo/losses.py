"""Direct preference losses on the policy's sequence log-probs of a chosen and a rejected response:
DPO (with label smoothing), IPO and the reference-free SimPO.

Pure tensor functions of (B,) per-pair inputs; each returns per-pair losses and the implicit
rewards, so the caller chooses the aggregation (the mean over the global batch, as the reward
model's pairs: engine/data/batching.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PreferenceLoss(NamedTuple):
    loss: torch.Tensor  # (B,)
    chosen_reward: torch.Tensor  # (B,) the loss's implicit reward of the chosen response (detached)
    rejected_reward: torch.Tensor  # (B,) ... of the rejected one


def log_ratio_margin(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
) -> torch.Tensor:
    """(B,) h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), from summed sequence log-probs."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), per pair (B,).

    DPO (Rafailov et al. 2023, eq. 7); ``label_smoothing`` eps > 0 is conservative DPO (Mitchell
    2023): the labels are taken to be flipped with probability eps. Implicit rewards
    beta * log pi/pi_ref (eq. 5)."""
    h = log_ratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return PreferenceLoss(
        loss, (beta * (policy_chosen - ref_chosen)).detach(), (beta * (policy_rejected - ref_rejected)).detach()
    )


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> PreferenceLoss:
    """(h - 1 / (2 beta))^2 per pair (B,): IPO (Azar et al. 2023, eq. 17, with tau = beta), which
    regresses the log-ratio margin to a finite target instead of pushing it to infinity. Summed
    sequence log-probs, as the paper (TRL's "ipo" averages them over tokens)."""
    h = log_ratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return PreferenceLoss(
        (h - 1 / (2 * beta)) ** 2, (policy_chosen - ref_chosen).detach(), (policy_rejected - ref_rejected).detach()
    )


def simpo_loss(
    policy_chosen_mean: torch.Tensor, policy_rejected_mean: torch.Tensor, beta: float, gamma: float
) -> PreferenceLoss:
    """-log sigmoid(beta * mean log pi(y_w) - beta * mean log pi(y_l) - gamma) per pair (B,).

    SimPO (Meng et al. 2024, eq. 6): no reference model; the reward is the length-normalised
    log-likelihood (token-mean log-probs in) times beta, with a target margin ``gamma``."""
    chosen, rejected = beta * policy_chosen_mean, beta * policy_rejected_mean
    return PreferenceLoss(-F.logsigmoid(chosen - rejected - gamma), chosen.detach(), rejected.detach())
