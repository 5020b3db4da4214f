"""On-policy distillation formulas as pure tensor functions: the reverse-KL advantage and the
generalised JSD of GKD over the teacher's top-k tokens.

Shapes: B sequences, T response tokens (right-padded), k of the teacher's tokens per position;
``mask`` (B, T) True where the token counts. Log-probs are those of the distribution the responses
were sampled from (softmax of the logits / the rollout's temperature).
"""

from __future__ import annotations

import math

import torch

REST_FLOOR = 1e-30  # the mass outside the top-k, floored: log(0) would make 0 * log 0 a NaN


def reverse_kl_advantages(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """(B, T) per-token advantage of on-policy distillation: -coef * (log pi(y_t) - log pi_teacher(y_t))
    at each sampled token y_t, 0 where ``mask`` is False.

    Its expectation over the student's samples is -coef x the reverse KL(pi || pi_teacher) per
    token, so a policy gradient on it minimises the reverse KL (Agarwal et al. 2024, "On-Policy
    Distillation of Language Models", sec. 3; Thinking Machines' "On-Policy Distillation", 2025, and
    slime / verl add it to the task's advantages the same way). ``logprobs``, ``teacher_logprobs``: (B, T)."""
    return -coef * (logprobs - teacher_logprobs) * mask


def with_rest_bucket(top_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., k) log-probs of k tokens -> (..., k + 1) log-distribution over those k tokens and one bucket
    for the rest of the vocabulary, log(1 - sum_j p_j) (floored at :data:`REST_FLOOR`).

    A divergence over merged buckets never exceeds the one over the whole vocabulary (the log-sum
    inequality / data processing), and equals it when the rest carries the same mass shape under both;
    it needs k numbers per position of the teacher instead of its whole distribution."""
    rest = (1 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(REST_FLOOR)
    return torch.cat([top_logprobs, rest.log()], dim=-1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """(..., V) log-distributions of the student S and the teacher P -> (...) the generalised
    Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 2 / sec. 3.1, TRL's ``generalized_jsd_loss``):

        JSD(beta) = beta * KL(P || M) + (1 - beta) * KL(S || M),   M = beta * P + (1 - beta) * S.

    At the ends it is TRL's limit: beta = 0 the forward KL(P || S), beta = 1 the reverse KL(S || P)
    (the formula itself goes to 0 there, as beta x forward KL and (1 - beta) x reverse KL)."""
    p, s = teacher_logp.exp(), student_logp.exp()
    if beta == 0:
        return (p * (teacher_logp - student_logp)).sum(-1)
    if beta == 1:
        return (s * (student_logp - teacher_logp)).sum(-1)
    mixture = torch.logsumexp(
        torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1 - beta)]), dim=0
    )  # (..., V) log M
    kl_teacher = (p * (teacher_logp - mixture)).sum(-1)
    kl_student = (s * (student_logp - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def top_k_jsd(
    student_top_logp: torch.Tensor, teacher_top_logp: torch.Tensor, beta: float, mask: torch.Tensor
) -> torch.Tensor:
    """(B, T, k) the student's and the teacher's log-probs of the teacher's k likeliest tokens at each
    response position -> (B, T) :func:`generalized_jsd` over those tokens and the rest
    (:func:`with_rest_bucket`), 0 where ``mask`` is False."""
    jsd = generalized_jsd(with_rest_bucket(student_top_logp), with_rest_bucket(teacher_top_logp), beta)
    return jsd * mask
