"""The reference policy's log-probs of every pair, computed once before the first update: DPO's
reference is a table, not a second engine.

A frozen reference engine would run one forward per pair per epoch and hold a copy of the weights;
the table costs one forward per pair in all, 8 bytes per train pair and, for the KL to the
reference on held-out pairs, the reference's ``TOP_K`` likeliest tokens at each held-out response
position (docs/dpo.md has the measurements). With LoRA the pass runs with the adapters off, so the
reference is the base model in any case. The table is checkpointed with the run: a resumed run
never recomputes it from moved weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.data.batching import plan_global
from engine.data.packing import dummy_forward_loss
from engine.data.preferences import PreferenceExample
from engine.dpo.pairs import pair_distributions, pair_logprobs, response_lengths, response_starts
from engine.models.lora import adapters_disabled
from engine.run.distributed import all_reduce

TOP_K = 32  # reference tokens kept per held-out response position (engine/data/response_tokens.top_k_kl)


@torch.no_grad()
def reference_pass(
    model, examples: Sequence[PreferenceExample], max_tokens: int, pad_token_id: int, top_k: int = 0
) -> list[torch.Tensor]:
    """Every response token's log-prob under ``model`` (T,) in :func:`response_lengths` order and,
    with ``top_k``, the log-probs (T, k) and ids (T, k) of the k likeliest tokens at its position;
    on every rank: each rank computes its share of the pairs (token-budget micro-batches, as in
    training) and an all-reduce assembles them (every position is written by exactly one rank)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    starts = response_starts(examples)
    out = [torch.zeros(starts[-1])] + (
        [torch.zeros(starts[-1], top_k), torch.zeros(starts[-1], top_k)] if top_k else []
    )
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            dummy_forward_loss(model, pad_token_id)
            continue
        batch = [examples[i] for i in micro]
        if top_k:
            policy, log_softmax = pair_distributions(model, batch)
            top = log_softmax.topk(top_k, dim=-1)
            parts = [torch.cat(policy.per_token), top.values, top.indices.float()]  # ids < 2**24: exact in float32
        else:
            parts = [torch.cat(pair_logprobs(model, batch).per_token)]
        at = 0
        for i in micro:
            n = starts[2 * i + 2] - starts[2 * i]  # the pair's two responses, adjacent in both orders
            for whole, part in zip(out, parts):
                whole[starts[2 * i] : starts[2 * i + 2]] = part[at : at + n]
            at += n
    return [all_reduce(t) for t in out]


class ReferenceLogprobs:
    """The reference's summed response log-probs of each train pair, ``train`` (N, 2) [chosen,
    rejected], and of the held-out pairs each response token's log-prob and the reference's
    ``TOP_K`` likeliest tokens at its position (flat over the 2M responses in turn)."""

    def __init__(self) -> None:
        self.train = torch.zeros(0, 2)
        self.validation: list[torch.Tensor] = [torch.zeros(0), torch.zeros(0, TOP_K), torch.zeros(0, TOP_K)]
        self.validation_starts: list[int] = [0]  # where each held-out response's tokens start (2M + 1)

    def compute(
        self,
        engine,
        train: Sequence[PreferenceExample],
        validation: Sequence[PreferenceExample],
        max_tokens: int,
        pad_token_id: int,
        with_train: bool = True,
    ) -> None:
        """One pass of ``engine`` (before any update; a LoRA model with its adapters off) over the
        pairs; ``with_train`` False: the held-out pairs only (a reference-free loss)."""
        with adapters_disabled(engine.module):
            self.train = torch.zeros(len(train), 2)  # a reference-free loss reads none
            if with_train:
                (flat,) = reference_pass(engine, train, max_tokens, pad_token_id)
                self.train = torch.stack([r.sum() for r in flat.split(response_lengths(train))]).view(len(train), 2)
            self.validation = reference_pass(engine, validation, max_tokens, pad_token_id, TOP_K)
            self.validation_starts = response_starts(validation)

    def held_out(self, pairs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of the held-out ``pairs`` (indices), in order: the reference's (B, 2) summed response
        log-probs and, at each response position, its top-k log-probs (K, k) and ids (K, k)."""
        starts = self.validation_starts
        spans = [slice(starts[2 * i], starts[2 * i + 2]) for i in pairs]
        tokens, top_logp, top_ids = self.validation
        sums = [tokens[starts[2 * i + k] : starts[2 * i + k + 1]].sum() for i in pairs for k in (0, 1)]
        return (
            torch.stack(sums).view(len(pairs), 2),
            torch.cat([top_logp[s] for s in spans]),
            torch.cat([top_ids[s] for s in spans]).long(),
        )

    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "validation": self.validation, "validation_starts": self.validation_starts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train, self.validation = state["train"], state["validation"]
        self.validation_starts = state["validation_starts"]
