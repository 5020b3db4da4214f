"""Each response token's log-prob (and the policy's entropy before it) from a packed forward: what
PPO's experience and update and DPO's pairs read of a causal LM."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.data.packing import PackedBatch, packed_forward, sequence_rows, target_logprobs


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) entropy of the softmax, in float32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


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


def response_logprobs(
    model, packed: PackedBatch, prompt_lens: Sequence[int], with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-prob (and policy entropy) of each response token: one (R_i,) tensor per sequence.

    The LM head runs on the response-predicting positions only; log p is computed in float32
    on the model's device (:func:`engine.data.packing.target_logprobs`). The results come back on
    the CPU (differentiably: a loss built from them backpropagates into the model, through the
    shared prompt positions once per branch). The entropy is detached unless ``entropy_grad``
    (an entropy bonus): as a metric only, its backward would cost ~10% of the actor's forward +
    backward.
    """
    positions, targets, lengths = response_positions(packed, prompt_lens)
    logits = packed_forward(model, packed, logits_positions=positions)[0]  # (K, V), model's device
    logprobs = target_logprobs(logits, packed.input_ids[0, targets])  # (K,)
    entropy = None
    if with_entropy:
        entropy = list(entropy_from_logits(logits if entropy_grad else logits.detach()).cpu().split(lengths))
    return list(logprobs.cpu().split(lengths)), entropy
