"""Supervised fine-tuning math: next-token loss on the assistant tokens of packed conversations,
the training step and held-out evaluation.

Loss of a mini-batch: the mean over every trained token of every conversation in it,

    loss = sum_{t trained} -log p(x_t | x_<t) / N_trained,

whatever the packing, the micro-batching and the number of ranks (each micro-batch's summed
loss is scaled by ``world / N_trained``, engine/data/batching.py ``token_mean_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.data.batching import plan_global, token_mean_scale
from engine.data.conversations import Conversation
from engine.data.lm_head import token_logprobs
from engine.data.packing import PackedBatch, dummy_forward_loss, pack_sequences
from engine.run import faults
from engine.run.distributed import RankSums


def trained_positions(packed: PackedBatch, conversations: Sequence[Conversation]) -> torch.Tensor:
    """(K,) row positions whose next token is trained: position s + t - 1 predicts token t of the
    conversation starting at row offset s."""
    positions = [
        s + t - 1 for s, c in zip(packed.starts, conversations) for t, on in enumerate(c.trained) if on and t > 0
    ]
    return torch.tensor(positions, dtype=torch.long)


def token_nll(model, packed: PackedBatch, conversations: Sequence[Conversation]) -> torch.Tensor:
    """-log p(token) of every trained token, (K,) float32 on the CPU (differentiable). The LM
    head runs on those K positions only, in chunks (engine/data/lm_head.py)."""
    positions = trained_positions(packed, conversations)
    return -token_logprobs(model, packed, positions, packed.input_ids[0, positions + 1])[0].cpu()


class TokenStats:
    """Summed loss and token counts of this rank, reduced over ranks on demand."""

    def __init__(self):
        self.sums = RankSums(["nll", "trained_tokens", "tokens"])

    def add(self, nll: torch.Tensor, num_tokens: int) -> None:
        self.sums.add(nll=nll.detach().double().sum(), trained_tokens=nll.numel(), tokens=num_tokens)

    def reduce(self) -> dict[str, float]:
        all_ranks = self.sums.reduced()
        loss = all_ranks.mean("nll", over="trained_tokens")
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)),
            "trained_tokens": all_ranks["trained_tokens"],
            "tokens": all_ranks["tokens"],
        }


def sft_step(
    engine, conversations: Sequence[Conversation], max_tokens: int, pad_token_id: int, step: int
) -> dict[str, float]:
    """Optimizer step ``step`` (1-based) over a global mini-batch (every rank holds the whole list;
    each packs its share into token-budget micro-batches)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    scale = token_mean_scale(sum(c.num_trained for c in conversations), world)
    stats = TokenStats()
    for micro in plan_global([c.num_tokens for c in conversations], max_tokens, world)[rank]:
        if not micro:
            engine.backward(dummy_forward_loss(engine, pad_token_id))
            continue
        batch = [conversations[i] for i in micro]
        packed = pack_sequences([c.input_ids for c in batch], pad_token_id)
        nll = token_nll(engine, packed, batch)
        loss = nll.sum() * scale
        engine.backward(faults.poisoned(loss, step))
        stats.add(nll, packed.num_tokens)
    engine.step()
    return stats.reduce()


@torch.no_grad()
def evaluate_conversations(
    model, conversations: Sequence[Conversation], max_tokens: int, pad_token_id: int
) -> dict[str, float]:
    """Token-mean loss and perplexity over ``conversations``, sharded over all ranks (every rank
    runs the same number of forwards: ZeRO-3 forwards are collectives)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    stats = TokenStats()
    for micro in plan_global([c.num_tokens for c in conversations], max_tokens, world)[rank]:
        if not micro:
            dummy_forward_loss(model, pad_token_id)
            continue
        batch = [conversations[i] for i in micro]
        packed = pack_sequences([c.input_ids for c in batch], pad_token_id)
        stats.add(token_nll(model, packed, batch), packed.num_tokens)
    return stats.reduce()
