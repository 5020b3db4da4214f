"""Turning sampled responses into PPO training data: log-probs, values, rewards, advantages.

Everything here runs on one rank's samples; forwards go through packed, token-budget
micro-batches whose count every rank agrees on (ZeRO-3 forwards are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.batching import plan_micro_batches
from engine.distributed import agree_max
from engine.packing import PackedBatch, next_token_logprobs, pack_sequences, packed_forward, unpack
from engine.ppo_losses import entropy_from_logits


def packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches, as many as the busiest rank needs (empty ones are dummies)."""
    count = agree_max(len(plan_micro_batches(lengths, max_tokens)))
    return plan_micro_batches(lengths, max_tokens, num_micro_batches=count)


def map_packed(
    model, sequences: Sequence[list[int]], max_tokens: int, pad_token_id: int,
    extract: Callable[[torch.Tensor, PackedBatch, list[int]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Run ``model`` over ``sequences`` in packed micro-batches; ``extract(output, packed, indices)``
    gives one tensor per sequence of the micro-batch (``indices`` into ``sequences``). Results
    come back in input order."""
    results: list[torch.Tensor | None] = [None] * len(sequences)
    for micro in packed_micro_batches([len(s) for s in sequences], max_tokens):
        packed = pack_sequences([sequences[i] for i in micro], pad_token_id)
        output = packed_forward(model, packed)
        for i, value in zip(micro, extract(output, packed, micro)):
            results[i] = value
    return results  # type: ignore[return-value]


def response_logprobs(output: torch.Tensor, packed, prompt_lens: Sequence[int]) -> list[torch.Tensor]:
    """Log-prob of each response token: positions P-1 .. P+R-2 of the next-token log-probs."""
    return [lp[p - 1 :] for lp, p in zip(next_token_logprobs(output, packed), prompt_lens)]


def response_entropy(output: torch.Tensor, packed, prompt_lens: Sequence[int]) -> list[torch.Tensor]:
    """Policy entropy at the positions that produced each response token."""
    return [entropy_from_logits(o[p - 1 : -1]) for o, p in zip(unpack(output, packed), prompt_lens)]


def response_values(output: torch.Tensor, packed, prompt_lens: Sequence[int], weights: torch.Tensor) -> list[torch.Tensor]:
    """Critic value of the state before each response token: (R,) per sequence.

    A critic initialised from a decomposed reward model keeps its C outputs; the value is their
    weighted sum, so it starts as the reward model's total.
    """
    return [(v[p - 1 : -1].float() * weights).sum(-1) for v, p in zip(unpack(output, packed), prompt_lens)]


def pad_right(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Ragged 1-D tensors -> (B, width), zero padded."""
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@dataclass
class Experience:
    """One rank's rollout batch, response tokens right-padded to T. mask True where a token counts."""

    sequences: list[list[int]]  # prompt + response ids (actor tokenizer)
    prompt_lens: list[int]
    mask: torch.Tensor  # (B, T) bool
    old_logprobs: torch.Tensor  # (B, T) actor log-probs at sampling time
    ref_logprobs: torch.Tensor  # (B, T)
    old_values: torch.Tensor  # (B, T) critic values at sampling time
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) final sequence score (reward model + rules + penalties)
    kl: torch.Tensor  # (B, T) per-token KL estimate vs the reference

    def select(self, rows: Sequence[int]) -> "Experience":
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Experience(
            sequences=[self.sequences[i] for i in rows],
            prompt_lens=[self.prompt_lens[i] for i in rows],
            **{f: getattr(self, f)[idx] for f in ("mask", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns", "scores", "kl")},
        )
