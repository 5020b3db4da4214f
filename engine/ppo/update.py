"""One optimizer step of the actor or the critic over a PPO mini-batch (this rank's share).

Losses are aggregated over the whole mini-batch across ranks: the critic's as a token mean (each
micro-batch's summed loss scaled by ``world_size / global_tokens``, engine/data/batching.py), the
actor's as ``ppo.loss_aggregation`` says (per-token weights from the mini-batch's global sequence and
token counts), so the update does not depend on how the mini-batch was cut into micro-batches or
spread over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from engine.data.batching import token_mean_scale
from engine.data.packing import PackedBatch, dummy_forward_loss, packed_forward
from engine.data.response_tokens import kl_penalty, response_logprobs, response_logprobs_at
from engine.ppo.distill import with_distillation
from engine.ppo.distill_losses import top_k_jsd
from engine.ppo.experience import Experience
from engine.ppo.forwards import pad_right, response_values
from engine.ppo.losses import PolicyLoss, aggregation_weights, clipped_value_loss, estimate_advantages, gae
from engine.ppo.settings import GaeSettings, PolicyLossSettings, UpdateSettings
from engine.run import faults
from engine.run.distributed import all_reduce
from engine.run.micro_batches import micro_batches


class ActorLoss(NamedTuple):
    per_token: torch.Tensor  # (b, T) what is minimised, weighted by engine.ppo.losses.aggregation_weights
    pg: PolicyLoss  # the surrogate and where its clips were active
    kl: torch.Tensor | None  # (b, T) KL(new || ref) estimate of the KL loss (None without one)
    jsd: torch.Tensor | None = None  # (b, T) GKD's JSD(beta) to the teacher over its top-k (distill gkd only)


def actor_token_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    mb: Experience,
    settings: PolicyLossSettings,
    student_top: torch.Tensor | None = None,
) -> ActorLoss:
    """Per-token actor loss: is_weight * policy surrogate [+ kl_loss_coef * KL(new || ref)] [- entropy_coef * entropy]
    [+ distill.coef * JSD(beta) to the teacher] (``mb.is_weights``: the rollout correction's importance weights,
    ones without ppo.rollout_correction; ``student_top`` (b, T, k): the actor's log-probs of the teacher's
    top-k tokens, distill mode gkd)."""
    pg = settings.policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.mask)
    per_token = pg.loss * mb.is_weights
    per_token = per_token - settings.entropy_coef * entropy if settings.entropy_coef else per_token
    kl = kl_penalty(logprobs, mb.ref_logprobs, settings.kl_estimator) if settings.kl_loss_coef else None
    if kl is not None:
        per_token = per_token + settings.kl_loss_coef * kl
    jsd = None
    if student_top is not None and settings.distill is not None and mb.teacher is not None:
        assert mb.teacher.top_logprobs is not None  # gkd
        jsd = top_k_jsd(student_top, mb.teacher.top_logprobs, settings.distill.beta, mb.mask)
        per_token = per_token + settings.distill.coef * jsd
    return ActorLoss(per_token, pg, kl, jsd)


def actor_metric_names(settings: PolicyLossSettings) -> list[str]:
    """The token-mean statistics of an actor step: the surrogate, its clip fractions, approx KL to
    the rollout policy, entropy, and the dual-clip fraction and KL-loss term when those are on."""
    return (
        ["pg_loss", "clipfrac", "approx_kl", "entropy"]
        + ["dual_clipfrac"] * (settings.clip_ratio_c is not None)
        + ["kl_loss"] * bool(settings.kl_loss_coef)
        + ["distill/jsd"] * gkd(settings)
    )


def gkd(settings: PolicyLossSettings) -> bool:
    """Whether the actor loss has GKD's JSD term (distill mode gkd)."""
    return settings.distill is not None and settings.distill.mode == "gkd"


def actor_forward(
    engine, packed: PackedBatch, mb: Experience, settings: UpdateSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The actor's (b, T) log-probs of the response tokens and (b, T) entropies, and with GKD its
    (b, T, k) log-probs of the teacher's top-k tokens, from one forward of the micro-batch ``packed``."""
    T, grad = mb.mask.shape[1], settings.policy.entropy_coef != 0
    if not gkd(settings.policy):
        logprob_rows, entropy_rows = response_logprobs(
            engine, packed, mb.prompt_lens, with_entropy=True, entropy_grad=grad, temperature=settings.temperature
        )
        assert entropy_rows is not None  # with_entropy
        return pad_right(logprob_rows, T), pad_right(entropy_rows, T), None
    assert mb.teacher is not None and mb.teacher.top_ids is not None  # gkd: the experience has the teacher's top-k
    ids = [mb.teacher.top_ids[i, : len(s) - p] for i, (s, p) in enumerate(zip(mb.sequences, mb.prompt_lens))]
    rows = response_logprobs_at(engine, packed, mb.prompt_lens, ids, grad, settings.temperature)
    return pad_right(rows[0], T), pad_right(rows[1], T), pad_right(rows[2], T)


def _micro_batches(
    engine, batch: Experience, settings: UpdateSettings
) -> Iterator[tuple[list[int], Experience, PackedBatch]]:
    """This rank's packed micro-batches ``(rows of batch, their experience, packed)`` (the samples
    of a prompt sharing it where ``settings.share_prompts`` and the attention allows); a dummy one
    (no samples left here) runs its zero-loss forward/backward inside, so every rank makes the same
    number of ZeRO collectives."""
    pad_id = settings.pad_token_id
    for indices, packed in micro_batches(
        engine, batch.sequences, batch.prompt_lens, settings.max_tokens, pad_id, settings.share_prompts
    ):
        if not indices:
            engine.backward(dummy_forward_loss(engine, pad_id))
            continue
        yield indices, batch.select(indices), packed


def global_token_count(mask: torch.Tensor) -> int:
    count = mask.sum().reshape(1).long()
    all_reduce(count)
    return int(count.item())


def global_counts(mask: torch.Tensor) -> tuple[int, int]:
    """(sequences, response tokens) of a mini-batch that count in its loss, over all ranks (at least 1
    each); ``mask`` (b, T) is this rank's share (a row masked out entirely: ppo.mask_truncated)."""
    counts = torch.tensor([int(mask.any(1).sum()), int(mask.sum())], dtype=torch.long)
    all_reduce(counts)
    return max(int(counts[0]), 1), max(int(counts[1]), 1)


def actor_step(engine, batch: Experience, settings: UpdateSettings, iteration: int) -> dict[str, float]:
    """Clipped (or dual-clip) PPO policy loss [+ KL loss - entropy bonus + GKD's JSD] over ``batch``, a
    mini-batch of 0-based ``iteration``, aggregated over its tokens as ``settings.policy.aggregation``
    says (:func:`engine.ppo.losses.aggregation_weights`); returns token-mean stats."""
    world = torch.distributed.get_world_size()
    sequences, tokens = global_counts(batch.mask)
    policy = settings.policy
    names = actor_metric_names(policy)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)  # token sums of each statistic, then the token count
    for _, mb, packed in _micro_batches(engine, batch, settings):
        logprobs, entropy, student_top = actor_forward(engine, packed, mb, settings)  # (b, T), (b, T), (b, T, k)
        loss = actor_token_loss(logprobs, entropy, mb, policy, student_top)
        mask = mb.mask.float()
        weights = aggregation_weights(mb.mask, policy.aggregation, sequences, tokens, policy.norm_tokens)  # (b, T)
        # times world: DeepSpeed averages the ranks' gradients (engine/data/batching.token_mean_scale)
        engine.backward(faults.poisoned((loss.per_token * weights).sum() * world, iteration + 1))
        with torch.no_grad():
            approx_kl = 0.5 * (logprobs - mb.old_logprobs) ** 2  # Schulman's k2 of KL(old || new)
            per_token = [loss.pg.loss, loss.pg.clipped.float(), approx_kl, entropy]
            per_token += [t for t in (loss.pg.capped, loss.kl, loss.jsd) if t is not None]
            sums += torch.stack([(t.float() * mask).sum() for t in per_token] + [mask.sum()]).double()
    engine.step()
    return _means(sums, names)


def critic_step(
    engine, batch: Experience, settings: UpdateSettings, values_gae: GaeSettings | None = None
) -> dict[str, float]:
    """Clipped value loss around the rollout's values; returns summed stats. ``values_gae``: the
    rollout's values are this step's own (its weights sampled the rollout): each micro-batch's
    forward sets ``batch.old_values`` of its rows and computes GAE's returns for them (GAE runs
    within a sequence) before its loss; the caller derives advantages and returns for the batch."""
    world = torch.distributed.get_world_size()
    scale = token_mean_scale(global_counts(batch.mask)[1], world)
    sums = torch.zeros(4, dtype=torch.float64)  # vf_loss, clipped tokens, value, tokens
    for rows, mb, packed in _micro_batches(engine, batch, settings):
        values = pad_right(
            response_values(packed_forward(engine, packed), packed, mb.prompt_lens, settings.value_readout),
            mb.mask.shape[1],
        )
        if values_gae is not None:
            mb.old_values = values.detach()
            mb.returns = gae(mb.rewards, mb.old_values, mb.mask, values_gae.gamma, values_gae.lam)[1]
            batch.old_values[rows] = mb.old_values
        vf = clipped_value_loss(values, mb.old_values, mb.returns, settings.value_clip)
        mask = mb.mask.float()
        engine.backward((vf.loss * mask).sum() * scale)
        with torch.no_grad():
            sums += torch.stack(
                [(vf.loss * mask).sum(), (vf.clipped.float() * mask).sum(), (values * mask).sum(), mask.sum()]
            ).double()
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
    settings: UpdateSettings,
    *,
    iteration: int,
    train_actor: bool,
    after_step: Callable[[object, str], None],
) -> dict[str, float]:
    """``settings.ppo_epochs`` passes over this rank's rollout in shuffled mini-batches of
    ``settings.mini_batch_size`` sequences over all ranks (the shuffle drawn from ``settings.seed``
    and 0-based ``iteration``): a critic step (none when ``critic`` is None: a critic-free
    estimator), then an actor step unless ``train_actor`` is false (critic warm-up). The samples of
    a prompt that fall in one mini-batch compute it once (``settings.share_prompts``).
    ``after_step(engine, name)`` runs after each optimizer step (the non-finite guard).
    ``settings.values_gae`` (the rollout is one mini-batch, made by
    :func:`engine.ppo.experience.make_experience` with ``values_from_update``): the first critic
    step's forward, on the weights that were the rollout's, gives the old values; GAE's advantages
    and returns follow, before any actor step.
    Returns each statistic's mean over the mini-batches."""
    for engine in (actor, critic):
        if engine is not None:
            engine.train()
    local_mb = settings.mini_batch_size // torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(settings.seed * 100_003 + iteration)
    stats: dict[str, list[float]] = {}
    values_gae = settings.values_gae
    if values_gae is not None and (critic is None or local_mb < len(exp.sequences)):
        raise ValueError("values from the update need a critic and the rollout as one mini-batch")
    for _ in range(settings.ppo_epochs):
        perm = torch.randperm(len(exp.sequences), generator=generator).tolist()
        for k in range(0, len(perm), local_mb):
            rows = perm[k : k + local_mb]
            mb = exp.select(rows)
            step_stats = {}
            if critic is not None:
                step_stats = critic_step(critic, mb, settings, values_gae)
                after_step(critic, "critic")
            if values_gae is not None:
                exp.old_values[torch.tensor(rows)] = mb.old_values
                exp.advantages, exp.returns = estimate_advantages(
                    "gae",
                    exp.rewards,
                    exp.old_values,
                    exp.mask,
                    values_gae.gamma,
                    values_gae.lam,
                    1,
                    values_gae.whiten,
                    group=torch.distributed.group.WORLD,
                )
                exp.advantages = with_distillation(
                    exp.advantages, exp.old_logprobs, exp.teacher, exp.mask, settings.policy.distill
                )
                mb, values_gae = exp.select(rows), None
            if train_actor:
                step_stats |= actor_step(actor, mb, settings, iteration)
                after_step(actor, "actor")
            for key, value in step_stats.items():
                stats.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in stats.items()}
