"""One optimizer step of the actor or the critic over a PPO mini-batch (this rank's share).

Losses are token-means over the whole mini-batch across ranks: each micro-batch's summed loss
is scaled by ``world_size / global_tokens`` (engine/batching.py), so the update does not depend
on how the mini-batch was cut into micro-batches or spread over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.batching import token_mean_scale
from engine.distributed import all_reduce
from engine.experience import Experience, packed_micro_batches, pad_right, response_logprobs, response_values
from engine.packing import PackedBatch, pack_sequences, packed_forward
from engine.ppo_losses import clipped_policy_loss, clipped_value_loss, dual_clip_policy_loss, kl_penalty
from engine.reward_model import dummy_forward_loss


@dataclass(frozen=True)
class PolicyLossSettings:
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None  # dual clip when set
    kl_loss_coef: float
    kl_estimator: str
    entropy_coef: float


def _micro_batches(engine, batch: Experience, max_tokens: int, pad_id: int) -> Iterator[tuple[Experience, PackedBatch]]:
    """This rank's packed micro-batches; a dummy one (no samples left here) runs its zero-loss
    forward/backward inside, so every rank makes the same number of ZeRO collectives."""
    for micro in packed_micro_batches([len(s) for s in batch.sequences], max_tokens):
        if not micro:
            engine.backward(dummy_forward_loss(engine, pad_id))
            continue
        mb = batch.select(micro)
        yield mb, pack_sequences(mb.sequences, pad_id)


def global_token_count(mask: torch.Tensor) -> int:
    count = mask.sum().reshape(1).long()
    all_reduce(count)
    return int(count.item())


def actor_step(
    engine, batch: Experience, settings: PolicyLossSettings, max_tokens: int, pad_id: int, poison: bool = False
) -> dict[str, float]:
    """Clipped (or dual-clip) PPO policy loss [+ KL loss - entropy bonus]; returns summed stats.
    ``poison`` multiplies the loss by NaN (fault injection, engine/faults.py)."""
    world = torch.distributed.get_world_size()
    scale = token_mean_scale(global_token_count(batch.mask), world)
    sums = torch.zeros(5, dtype=torch.float64)  # pg_loss, clipped tokens, approx_kl, entropy, tokens
    for mb, packed in _micro_batches(engine, batch, max_tokens, pad_id):
        T = mb.mask.shape[1]
        logprobs, entropy = response_logprobs(engine, packed, mb.prompt_lens, with_entropy=True, entropy_grad=settings.entropy_coef != 0)
        logprobs, entropy = pad_right(logprobs, T), pad_right(entropy, T)  # (b, T) each
        if settings.clip_ratio_c is None:
            pg = clipped_policy_loss(logprobs, mb.old_logprobs, mb.advantages, settings.clip_low, settings.clip_high)
        else:
            pg = dual_clip_policy_loss(
                logprobs, mb.old_logprobs, mb.advantages, settings.clip_low, settings.clip_high, settings.clip_ratio_c
            )
        mask = mb.mask.float()
        per_token = pg.loss - settings.entropy_coef * entropy if settings.entropy_coef else pg.loss
        if settings.kl_loss_coef:
            per_token = per_token + settings.kl_loss_coef * kl_penalty(logprobs, mb.ref_logprobs, settings.kl_estimator)
        engine.backward((per_token * mask).sum() * (float("nan") if poison else scale))
        with torch.no_grad():
            log_ratio = logprobs - mb.old_logprobs
            sums += torch.stack(
                [
                    (pg.loss * mask).sum(),
                    (pg.clipped.float() * mask).sum(),
                    (0.5 * log_ratio**2 * mask).sum(),  # approx KL(old || new) (Schulman's k2)
                    (entropy * mask).sum(),
                    mask.sum(),
                ]
            ).double()
    engine.step()
    return _means(sums, ["pg_loss", "clipfrac", "approx_kl", "entropy"])


def critic_step(
    engine, batch: Experience, value_weights: torch.Tensor, value_clip: float, max_tokens: int, pad_id: int
) -> dict[str, float]:
    """Clipped value loss around the rollout's values; returns summed stats."""
    world = torch.distributed.get_world_size()
    scale = token_mean_scale(global_token_count(batch.mask), world)
    sums = torch.zeros(4, dtype=torch.float64)  # vf_loss, clipped tokens, value, tokens
    for mb, packed in _micro_batches(engine, batch, max_tokens, pad_id):
        values = pad_right(response_values(packed_forward(engine, packed), packed, mb.prompt_lens, value_weights), mb.mask.shape[1])
        vf = clipped_value_loss(values, mb.old_values, mb.returns, value_clip)
        mask = mb.mask.float()
        engine.backward((vf.loss * mask).sum() * scale)
        with torch.no_grad():
            sums += torch.stack([(vf.loss * mask).sum(), (vf.clipped.float() * mask).sum(), (values * mask).sum(), mask.sum()]).double()
    engine.step()
    return _means(sums, ["vf_loss", "vf_clipfrac", "value_mean"])


def _means(sums: torch.Tensor, names: list[str]) -> dict[str, float]:
    """Token-means over all ranks: the last entry of ``sums`` is the token count."""
    all_reduce(sums)
    tokens = max(sums[-1].item(), 1.0)
    return {name: sums[i].item() / tokens for i, name in enumerate(names)}


def update_on_rollout(
    actor,
    critic,
    exp: Experience,
    settings: PolicyLossSettings,
    value_weights: torch.Tensor,
    ppo,  # the config's PPOSection
    pad_id: int,
    train_actor: bool,
    seed: int,
    poison: bool,
    after_step: Callable[[str, object], None],
) -> dict[str, float]:
    """``ppo.ppo_epochs`` passes over this rank's rollout in shuffled mini-batches (the same
    shuffle for a given ``seed``): a critic step, then an actor step unless ``train_actor`` is
    false (critic warm-up). ``after_step(name, engine)`` runs after each optimizer step (the
    non-finite guard). Returns each statistic's mean over the mini-batches."""
    actor.train(), critic.train()
    local_mb = ppo.mini_batch_size // torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(seed)
    stats: dict[str, list[float]] = {}
    for _ in range(ppo.ppo_epochs):
        perm = torch.randperm(len(exp.sequences), generator=generator).tolist()
        for k in range(0, len(perm), local_mb):
            mb = exp.select(perm[k : k + local_mb])
            step_stats = critic_step(critic, mb, value_weights, ppo.value_clip, ppo.max_tokens_per_micro_batch, pad_id)
            after_step("critic", critic)
            if train_actor:
                step_stats |= actor_step(actor, mb, settings, ppo.max_tokens_per_micro_batch, pad_id, poison)
                after_step("actor", actor)
            for key, value in step_stats.items():
                stats.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in stats.items()}
