"""Turning sampled responses into PPO training data: log-probs, values, rewards, advantages
(:func:`make_experience`).

Everything here runs on one rank's samples; forwards go through packed, token-budget
micro-batches whose count every rank agrees on (ZeRO-3 forwards are collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.data.batching import group_tokens, plan_micro_batches, prompt_groups
from engine.data.packing import (
    PackedBatch,
    pack_groups,
    pack_sequences,
    packed_forward,
    runs_shared_prompts,
    sequence_rows,
    target_logprobs,
)
from engine.ppo.losses import (
    AdvantageEstimator,
    KLEstimator,
    entropy_from_logits,
    estimate_advantages,
    kl_penalty,
    masked_mean,
    token_rewards,
    truncated_is_weights,
)
from engine.run.distributed import agree_max

if TYPE_CHECKING:
    from engine.rollout.sampler import Sample


def packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches, as many as the busiest rank needs (empty ones are dummies)."""
    count = agree_max(len(plan_micro_batches(lengths, max_tokens)))
    return plan_micro_batches(lengths, max_tokens, num_micro_batches=count)


def micro_batches(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
) -> Iterator[tuple[list[int], PackedBatch]]:
    """This rank's packed micro-batches of ``sequences`` (prompt + response) for ``model``:
    ``(indices, packed)`` each, the indices in packing order; as many as the busiest rank needs (a
    dummy one packs a padding token and no indices). ``share_prompts``, where the model's attention
    runs shared-prompt rows: the sequences of a prompt pack it once
    (:func:`engine.data.batching.prompt_groups`), and the token budget counts it once."""
    share = share_prompts and runs_shared_prompts(model)
    groups = prompt_groups(sequences, prompt_lens, max_tokens) if share else [(0, [i]) for i in range(len(sequences))]
    for micro in packed_micro_batches(group_tokens(sequences, groups), max_tokens):
        chosen = [groups[j] for j in micro]
        indices = [i for _, members in chosen for i in members]
        yield (
            indices,
            (
                pack_groups(sequences, chosen, pad_token_id)
                if share
                else pack_sequences([sequences[i] for i in indices], pad_token_id)
            ),
        )


def map_micro_batches(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
    fn: Callable[[PackedBatch, list[int]], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """Apply ``fn(packed, indices)`` (a forward of ``model`` returning one tensor per packed
    sequence) over ``sequences`` in :func:`micro_batches`; dummy micro-batches run a one-token forward through
    ``fn`` too. Results come back in input order."""
    results: list[torch.Tensor | None] = [None] * len(sequences)
    for indices, packed in micro_batches(model, sequences, prompt_lens, max_tokens, pad_token_id, share_prompts):
        for i, value in zip(indices, fn(packed, indices)):
            results[i] = value
    return results  # type: ignore[return-value]


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


def sequence_logprobs(
    model,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
) -> list[torch.Tensor]:
    """Each sequence's response-token log-probs under ``model`` (one (R_i,) tensor each), computed
    in packed micro-batches of at most ``max_tokens``, prompts shared where ``share_prompts`` and
    the model's attention allows."""
    return map_micro_batches(
        model,
        sequences,
        prompt_lens,
        max_tokens,
        pad_token_id,
        share_prompts,
        lambda packed, idx: response_logprobs(model, packed, [prompt_lens[i] for i in idx])[0],
    )


def response_values(
    output: torch.Tensor, packed, prompt_lens: Sequence[int], weights: torch.Tensor
) -> list[torch.Tensor]:
    """Critic value of the state before each response token: (R,) per sequence.

    A critic initialised from a decomposed reward model keeps its C outputs; the value is their
    weighted sum, so it starts as the reward model's total.
    """
    positions, _, lengths = response_positions(packed, prompt_lens)
    values = output[0, positions.to(output.device)].float().cpu()  # (K, C)
    return list((values * weights).sum(-1).split(lengths))


def sequence_values(
    critic,
    sequences: Sequence[list[int]],
    prompt_lens: Sequence[int],
    weights: torch.Tensor,
    max_tokens: int,
    pad_token_id: int,
    share_prompts: bool,
) -> list[torch.Tensor]:
    """Each sequence's critic values (one (R_i,) tensor each), in packed micro-batches of at most
    ``max_tokens``, prompts shared as in :func:`sequence_logprobs`."""
    return map_micro_batches(
        critic,
        sequences,
        prompt_lens,
        max_tokens,
        pad_token_id,
        share_prompts,
        lambda packed, idx: response_values(
            packed_forward(critic, packed), packed, [prompt_lens[i] for i in idx], weights
        ),
    )


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
    old_values: torch.Tensor  # (B, T) critic values at sampling time (zeros without a critic)
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) final sequence score (reward model + rules + penalties)
    kl: torch.Tensor  # (B, T) per-token KL estimate vs the reference
    is_weights: (
        torch.Tensor
    )  # (B, T) truncated importance weight of each token's policy loss (ones without ppo.tis_cap)
    rewards: torch.Tensor  # (B, T) token rewards: the score on the last token, minus the KL penalty on every token

    def select(self, rows: Sequence[int]) -> Experience:
        idx = torch.tensor(list(rows), dtype=torch.long)
        return Experience(
            sequences=[self.sequences[i] for i in rows],
            prompt_lens=[self.prompt_lens[i] for i in rows],
            **{
                f: getattr(self, f)[idx]
                for f in (
                    "mask",
                    "old_logprobs",
                    "ref_logprobs",
                    "old_values",
                    "advantages",
                    "returns",
                    "scores",
                    "kl",
                    "is_weights",
                    "rewards",
                )
            },
        )


@torch.no_grad()
def make_experience(
    samples: Sequence[Sample],
    *,
    prompt_messages: Sequence[list[dict[str, str]]],
    actor,
    critic,
    ref,
    scorer,  # engine.ppo.rewards.RewardScorer (which imports this module)
    value_weights: torch.Tensor,
    tokenizer,
    max_tokens: int,
    kl_estimator: KLEstimator,
    kl_coef: float,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    advantage_estimator: AdvantageEstimator = "gae",
    group_size: int = 1,
    old_logprobs_from_sampler: bool = False,
    tis_cap: float | None = None,
    share_prompts: bool = True,
    values_from_update: bool = False,
) -> tuple[Experience, dict[str, float]]:
    """Score and evaluate one rank's samples (``prompt_messages[i]`` is sample i's prompt).

    Up to four forwards in packed micro-batches of at most ``max_tokens``: actor and reference
    log-probs, critic values (``critic`` None: a critic-free estimator, no forward), reward-model
    scores; then the per-token KL to the reference (``kl_coef`` 0: none in the reward) and the
    advantages (:func:`engine.ppo.losses.estimate_advantages`; whitening over all ranks; the
    samples of a prompt, ``group_size`` of them, are contiguous). ``old_logprobs_from_sampler``:
    the samples' own log-probs stand in for the actor's forward (:class:`OldLogprobSource`), and
    the sampler-actor gap is not measured. ``tis_cap``: weight each token's policy loss by
    :func:`engine.ppo.losses.truncated_is_weights` of the actor's over the sampler's log-probs.
    ``share_prompts``: the samples of a prompt compute it once in each forward (where the
    model's attention allows; the scorer decides for the reward model). ``values_from_update``: no
    critic forward here; the first critic step computes the values on the same weights and
    fills in values, advantages and returns (engine/ppo/update.update_on_rollout), zeros until then.
    Returns the experience and this rank's rollout statistics (means over its samples).
    """
    pad = tokenizer.pad_token_id
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    T = max(len(s.response_ids) for s in samples)
    mask = pad_right([torch.ones(len(s.response_ids), dtype=torch.bool) for s in samples], T)  # (B, T)
    sampler_logprobs = pad_right([torch.tensor(s.logprobs) for s in samples], T)  # (B, T)
    forward = dict(max_tokens=max_tokens, pad_token_id=pad, share_prompts=share_prompts)
    old_logprobs = (
        sampler_logprobs
        if old_logprobs_from_sampler
        else pad_right(sequence_logprobs(actor, sequences, prompt_lens, **forward), T)
    )  # (B, T)
    ref_logprobs = pad_right(sequence_logprobs(ref, sequences, prompt_lens, **forward), T)  # (B, T)
    values = (
        pad_right(sequence_values(critic, sequences, prompt_lens, value_weights, **forward), T)
        if critic is not None and not values_from_update
        else torch.zeros(len(samples), T)
    )  # (B, T)
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    scores, parts = scorer.score(prompt_messages, texts, [s.finished for s in samples])  # (B,)
    kl = kl_penalty(old_logprobs, ref_logprobs, kl_estimator) * mask
    rewards = token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = (
        (torch.zeros_like(rewards), torch.zeros_like(rewards))
        if values_from_update
        else estimate_advantages(
            advantage_estimator,
            rewards,
            values,
            mask,
            gamma,
            lam,
            group_size,
            whiten_advantages,
            group=torch.distributed.group.WORLD,
        )
    )
    is_weights = (
        truncated_is_weights(old_logprobs, sampler_logprobs, tis_cap) * mask if tis_cap else mask.float()
    )  # (B, T)
    exp = Experience(
        sequences,
        prompt_lens,
        mask,
        old_logprobs,
        ref_logprobs,
        values,
        advantages,
        returns,
        scores,
        kl,
        is_weights,
        rewards,
    )
    stats = {
        "score": scores.mean().item(),
        "kl": kl.sum(1).mean().item(),  # per sequence
        "response_length": mask.sum(1).float().mean().item(),
        "finished": sum(s.finished for s in samples) / len(samples),
        **{k: v.mean().item() for k, v in parts.items()},
    }
    if not old_logprobs_from_sampler:
        stats["sampler_logprob_gap"] = masked_mean((sampler_logprobs - old_logprobs).abs(), mask).item()
    if tis_cap:
        stats["tis_weight"] = masked_mean(is_weights, mask).item()
        stats["tis_truncated"] = masked_mean((is_weights >= tis_cap).float(), mask).item()
    return exp, stats


class OldLogprobSource:
    """Where PPO's old log-probs come from (``ppo.old_logprobs_from``): ``actor`` recomputes them
    in an experience forward; ``sampler`` takes the sampler's own, exact when its weights are the
    actor's in fp32 (the gap is ~1e-7), which saves that forward. The shortcut checks itself:
    every ``check_every`` iterations, the first included, both are computed, and a mean gap
    above ``tolerance`` turns it off for the rest of the run. Checkpointed, so a resume decides
    as the straight run did."""

    def __init__(self, source: str, check_every: int, tolerance: float):
        self.on, self.check_every, self.tolerance = source == "sampler", check_every, tolerance

    def use_sampler(self, iteration: int) -> bool:
        """Whether 0-based ``iteration`` takes the sampler's log-probs (else the actor's)."""
        return self.on and iteration % self.check_every != 0

    def observe(self, gap: float | None) -> str | None:
        """After an iteration that measured the gap: the message when it turns the shortcut off."""
        if not self.on or gap is None or gap <= self.tolerance:
            return None
        self.on = False
        return (
            f"sampler log-prob gap {gap:.2e} is above ppo.sampler_logprob_tolerance {self.tolerance:g}: "
            "old log-probs come from the actor's forward from now on"
        )

    def state_dict(self) -> dict:
        return {"on": self.on}

    def load_state_dict(self, state: dict) -> None:
        self.on = state["on"]
