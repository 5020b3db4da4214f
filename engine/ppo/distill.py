"""The teacher's part of an on-policy distillation run (the ``distill`` section): its log-probs of the
actor's samples (:func:`teacher_logprobs`), what they add to the advantages (:func:`with_distillation`)
and the rollout's distillation metrics. The formulas: engine/ppo/distill_losses.py; the GKD loss term
of the actor step: engine/ppo/update.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.data.response_tokens import response_top_logprobs
from engine.ppo.distill_losses import reverse_kl_advantages
from engine.ppo.forwards import pad_right
from engine.ppo.losses import masked_mean
from engine.run.micro_batches import micro_batches
from engine.run_config.distill import DistillMode, DistillSection


@dataclass(frozen=True)
class DistillSettings:
    """What the ``distill`` section fixes for the experience and the update."""

    mode: DistillMode
    coef: float  # of the reverse-KL advantage, or of the JSD in the loss
    beta: float  # gkd: the JSD's interpolation
    top_k: int  # gkd: the teacher's tokens per position the JSD is taken over
    vocab: int  # the actor's vocabulary size: the teacher's top-k are ranked among these tokens

    @classmethod
    def from_config(cls, section: DistillSection | None, vocab: int) -> DistillSettings | None:
        if section is None:
            return None
        return cls(section.mode, section.coef, section.beta, section.top_k, vocab)


@dataclass(frozen=True)
class TeacherLogprobs:
    """The teacher's log-probs of one rank's rollout, response tokens right-padded to T."""

    logprobs: torch.Tensor  # (B, T) of each sampled token
    top_logprobs: torch.Tensor | None  # (B, T, k) of its k likeliest tokens at each position (gkd only)
    top_ids: torch.Tensor | None  # (B, T, k) those tokens (gkd only)

    def select(self, idx: torch.Tensor) -> TeacherLogprobs:
        return TeacherLogprobs(
            self.logprobs[idx],
            None if self.top_logprobs is None else self.top_logprobs[idx],
            None if self.top_ids is None else self.top_ids[idx],
        )


@torch.no_grad()
def teacher_logprobs(
    teacher,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    settings: DistillSettings,
    T: int,
    *,
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
    temperature: float,
) -> TeacherLogprobs:
    """The teacher's log-probs of each sequence's response tokens (and with gkd its top-k at every
    response position) under softmax(logits / ``temperature``), the rollout's distribution, in packed
    micro-batches of at most ``max_tokens``, the LM head in chunks (no tokens x vocabulary tensor)."""
    n, k = len(sequences), settings.top_k if settings.mode == "gkd" else 0
    rows: list[list[torch.Tensor]] = [[torch.zeros(0)] * n for _ in range(3)]  # logprobs, top log-probs, top ids
    for indices, packed in micro_batches(teacher, sequences, prompt_lens, max_tokens, pad_token_id, share_prompts):
        results = response_top_logprobs(
            teacher, packed, [prompt_lens[i] for i in indices], k, settings.vocab, temperature
        )
        for j, i in enumerate(indices):
            for part, result in zip(rows, results):
                part[i] = result[j]
    logprobs, top, ids = (pad_right(part, T) for part in rows)  # (B, T), (B, T, k), (B, T, k)
    return TeacherLogprobs(logprobs, *((top, ids) if settings.mode == "gkd" else (None, None)))


def with_distillation(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    teacher: TeacherLogprobs | None,
    mask: torch.Tensor,
    settings: DistillSettings | None,
) -> torch.Tensor:
    """(B, T) ``advantages`` plus, in reverse_kl mode, each sampled token's reverse-KL advantage
    (:func:`engine.ppo.distill_losses.reverse_kl_advantages` of the rollout's ``logprobs``);
    unchanged otherwise (gkd distils through the loss)."""
    if settings is None or teacher is None or settings.mode != "reverse_kl":
        return advantages
    return advantages + reverse_kl_advantages(logprobs, teacher.logprobs, mask, settings.coef)


def distill_stats(logprobs: torch.Tensor, teacher: TeacherLogprobs, mask: torch.Tensor) -> dict[str, float]:
    """This rank's per-token means over the sampled tokens: the reverse KL(pi || pi_teacher) (its k1
    estimate, log pi - log pi_teacher) and the teacher's log-prob."""
    return {
        "distill/reverse_kl": masked_mean(logprobs - teacher.logprobs, mask).item(),
        "distill/teacher_logprob": masked_mean(teacher.logprobs, mask).item(),
    }
