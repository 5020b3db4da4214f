"""Each response token's log-prob (and the policy's entropy before it) from a packed forward, and the
KL estimators on them: what PPO's experience and update and DPO's pairs read of a causal LM."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.data.lm_head import head_inputs, head_logprobs, head_logprobs_at, head_top_k, token_logprobs
from engine.data.packing import PackedBatch, packed_forward, sequence_rows
from engine.run_config import KLEstimator

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps exp() finite when policies drift apart


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r' - 1) - log r' with r' = pi_ref / pi;
    log r = log pi - log pi_ref, clamped before exp.
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def top_k_kl(policy_logp: torch.Tensor, ref_top_logp: torch.Tensor, ref_top_ids: torch.Tensor) -> torch.Tensor:
    """(K, V) policy log-distributions, (K, k) the reference's k likeliest tokens' log-probs and ids ->
    (K,) KL(pi || pi_ref) over those k tokens and one bucket for the rest of the vocabulary.

    Merging tokens never raises a KL (the log-sum inequality), so this is a lower bound of the exact
    KL, equal to it when the rest carries no mass under either; it needs k numbers per position of
    the reference instead of its whole distribution."""
    top = policy_logp.gather(-1, ref_top_ids)  # (K, k)
    rest = (1 - top.exp().sum(-1)).clamp_min(1e-30), (1 - ref_top_logp.exp().sum(-1)).clamp_min(1e-30)
    return (top.exp() * (top - ref_top_logp)).sum(-1) + rest[0] * (rest[0].log() - rest[1].log())


def response_positions(packed: PackedBatch, prompt_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Where each packed sequence's response is predicted: row positions (K,) whose next-token
    prediction is a response token (the state before it; prompt length P: sequence positions
    P-1 .. L-2), the rows of those tokens (K,), and each sequence's response length. With shared
    prompts the prompt's last position predicts the first token of every branch."""
    rows = sequence_rows(packed)
    if not rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), []
    return (
        torch.cat([r[p - 1 : -1] for r, p in zip(rows, prompt_lens)]),
        torch.cat([r[p:] for r, p in zip(rows, prompt_lens)]),
        [len(r) - p for r, p in zip(rows, prompt_lens)],
    )


def response_log_softmax(model, packed: PackedBatch, prompt_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) float32 next-token log-distribution at every response-predicting position (in
    :func:`response_positions` order) and (K,) the response tokens, for metrics over the vocabulary."""
    positions, targets, _ = response_positions(packed, prompt_lens)
    logits = packed_forward(model, packed, logits_positions=positions)[0]  # (K, V)
    return torch.log_softmax(logits.float(), dim=-1).cpu(), packed.input_ids[0, targets]


def response_logprobs(
    model,
    packed: PackedBatch,
    prompt_lens: Sequence[int],
    with_entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-prob (and policy entropy) of each response token: one (R_i,) tensor per sequence, under
    the distribution sampled at ``temperature`` (the rollout's: the one the responses came from).

    The LM head runs on the response-predicting positions only, in chunks
    (:func:`engine.data.lm_head.token_logprobs`: no (K, V) logits of the whole micro-batch). The
    results come back on the CPU (differentiably: a loss built from them backpropagates into the
    model, through the shared prompt positions once per branch). The entropy is detached unless
    ``entropy_grad`` (an entropy bonus): as a metric only, its backward would cost ~10% of the
    actor's forward + backward.
    """
    positions, targets, lengths = response_positions(packed, prompt_lens)
    logprobs, entropy = token_logprobs(
        model, packed, positions, packed.input_ids[0, targets], with_entropy, entropy_grad, temperature
    )  # (K,) each
    return list(logprobs.cpu().split(lengths)), None if entropy is None else list(entropy.cpu().split(lengths))


def response_logprobs_at(
    model,
    packed: PackedBatch,
    prompt_lens: Sequence[int],
    ids: Sequence[torch.Tensor],
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`response_logprobs` with the entropy, and in the same forward the log-probs of other
    tokens at each response position: ``ids`` one (R_i, k) tensor per sequence, one at least (a teacher's top-k)
    -> (R_i,) log-probs of the response tokens, (R_i,) entropies and (R_i, k) log-probs of ``ids``,
    differentiably, the head in chunks (no (K, V) tensor)."""
    positions, targets, lengths = response_positions(packed, prompt_lens)
    head, hidden = head_inputs(model, packed, positions)
    logprobs, entropy = head_logprobs(
        head, hidden, packed.input_ids[0, targets], True, entropy_grad, temperature=temperature
    )  # (K,) each
    assert entropy is not None  # with_entropy
    at = head_logprobs_at(head, hidden, torch.cat(list(ids)), temperature=temperature)  # (K, k)
    return list(logprobs.cpu().split(lengths)), list(entropy.cpu().split(lengths)), list(at.cpu().split(lengths))


@torch.no_grad()
def response_top_logprobs(
    model, packed: PackedBatch, prompt_lens: Sequence[int], k: int, vocab: int, temperature: float = 1.0
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A frozen model's (a teacher's) view of each response: (R_i,) log-probs of its tokens and the
    (R_i, k) log-probs and ids of the k likeliest tokens among the first ``vocab`` at each of its
    positions (:func:`engine.data.lm_head.head_top_k`), one tensor per sequence, on the CPU."""
    positions, targets, lengths = response_positions(packed, prompt_lens)
    head, hidden = head_inputs(model, packed, positions)
    logprobs, top, ids = head_top_k(head, hidden, packed.input_ids[0, targets], k, vocab, temperature=temperature)
    return list(logprobs.cpu().split(lengths)), list(top.cpu().split(lengths)), list(ids.cpu().split(lengths))
