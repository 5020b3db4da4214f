"""Preference pairs the slow, obvious way, for the tests of engine/dpo: one right-padded batch of
whole sequences (no packing, no shared prompts) and the papers' losses written out."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_response_logprobs(model, examples: Sequence) -> list[torch.Tensor]:
    """2B rows (chosen, rejected of each pair): each response token's log-prob, from one padded
    forward with an attention mask. Differentiable."""
    sequences = [ids for e in examples for ids in (e.chosen_ids, e.rejected_ids)]
    T = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (T - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in sequences])
    logp = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().log_softmax(-1)
    rows = []
    for b, (s, e) in enumerate(zip(sequences, [e for e in examples for _ in range(2)])):
        p = e.prompt_len
        rows.append(logp[b, p - 1 : len(s) - 1].gather(-1, ids[b, p : len(s), None]).squeeze(-1))
    return rows


def naive_losses(
    rows: Sequence[torch.Tensor], reference: torch.Tensor, loss: str, beta: float, label_smoothing: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair (loss, chosen reward, rejected reward) of DPO (with label smoothing), IPO or SimPO
    from the 2B response rows and the reference's (B, 2) summed log-probs."""
    sums = torch.stack([r.sum() for r in rows]).view(-1, 2)
    means = torch.stack([r.mean() for r in rows]).view(-1, 2)
    if loss == "simpo":
        chosen, rejected = beta * means[:, 0], beta * means[:, 1]
        return -torch.log(torch.sigmoid(chosen - rejected - gamma)), chosen, rejected
    ratio_c, ratio_r = sums[:, 0] - reference[:, 0], sums[:, 1] - reference[:, 1]
    if loss == "ipo":
        return (ratio_c - ratio_r - 1 / (2 * beta)) ** 2, ratio_c, ratio_r
    h = beta * (ratio_c - ratio_r)
    smoothed = -(1 - label_smoothing) * torch.log(torch.sigmoid(h)) - label_smoothing * torch.log(torch.sigmoid(-h))
    return smoothed, beta * ratio_c, beta * ratio_r
