"""Scoring preference pairs with a (packed) value model, the training step, its metrics and
evaluation.

Loss of a step: the mean over its pairs of ``total_loss_coef`` x the BT loss of the weighted total
plus ``center_coef`` x the centering term, plus each component's BT loss averaged over the pairs
that carry its label, whatever the packing, the micro-batching and the number of ranks (each
micro-batch's sums are scaled by ``world / count``, engine/data/batching.py ``token_mean_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.data.batching import plan_global, token_mean_scale
from engine.data.packing import dummy_forward_loss, last_token, packed_forward
from engine.data.preferences import PreferenceExample, collate_pairs
from engine.rm.losses import PairLosses, pair_losses, weighted_total
from engine.run import faults
from engine.run.distributed import RankSums
from engine.run_config import RMSection


def score_pairs(model, examples: Sequence[PreferenceExample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards at the last token of each chosen and rejected sequence: two (B, C) tensors.

    Chosen and rejected of a pair are adjacent in one packed row (sharing their prompt's tokens
    when the examples mark it) and re-paired by position.
    """
    packed, _, _ = collate_pairs(examples)
    rewards = last_token(packed_forward(model, packed), packed).float()  # (2B, C)
    rewards = rewards.view(len(examples), 2, -1)  # (B, [chosen, rejected], C)
    return rewards[:, 0], rewards[:, 1]


class PairStats:
    """Sums over pairs (this rank), reduced over ranks on demand: accuracy, margin, loss terms."""

    TOTAL = ("pairs", "correct", "margin", "loss_total", "center", "reward_sum", "reward_sq")  # the weighted total's
    PER_COMPONENT = ("labelled", "correct", "loss", "reward_sum", "reward_sq")  # "<field>/<component>"

    def __init__(self, components: Sequence[str]):
        self.components = list(components)
        self.sums = RankSums([*self.TOTAL, *(f"{f}/{c}" for c in self.components for f in self.PER_COMPONENT)])

    def add(
        self,
        r_chosen: torch.Tensor,
        r_rejected: torch.Tensor,
        weights: torch.Tensor,
        labels: torch.Tensor,
        losses: PairLosses,
    ) -> None:
        """Accumulate a micro-batch: rewards (B, C), labels (B, C) in {-1, 0, 1}."""
        r_c, r_r = r_chosen.detach().double(), r_rejected.detach().double()
        total_c, total_r = weighted_total(r_c, weights.double()), weighted_total(r_r, weights.double())
        both = torch.cat([total_c, total_r])
        self.sums.add(
            pairs=len(total_c),
            correct=(total_c > total_r).double().sum(),
            margin=(total_c - total_r).sum(),
            loss_total=losses.total.detach().double().sum(),
            center=losses.center.detach().double().sum(),
            reward_sum=both.sum(),
            reward_sq=(both**2).sum(),
        )
        oriented = (r_c - r_r) * labels.double()  # (B, C) > 0 where the labelled-better response scores higher
        comp_both = torch.cat([r_c, r_r])  # (2B, C)
        per_c = {  # each (C,)
            "labelled": (labels != 0).double().sum(0),
            "correct": (oriented > 0).double().sum(0),
            "loss": losses.component.detach().double().sum(0),
            "reward_sum": comp_both.sum(0),
            "reward_sq": (comp_both**2).sum(0),
        }
        self.sums.add(**{f"{f}/{c}": v[i] for f, v in per_c.items() for i, c in enumerate(self.components)})

    def reduce(self) -> dict[str, float]:
        all_ranks = self.sums.reduced()
        pairs = max(all_ranks["pairs"], 1.0)
        mean = all_ranks["reward_sum"] / (2 * pairs)
        metrics = {
            "acc": all_ranks.mean("correct", over="pairs"),
            "margin": all_ranks.mean("margin", over="pairs"),
            "loss_total": all_ranks.mean("loss_total", over="pairs"),
            "center": all_ranks.mean("center", over="pairs"),
            "reward_mean": mean,
            "reward_std": max(all_ranks["reward_sq"] / (2 * pairs) - mean**2, 0.0) ** 0.5,
        }
        for name in self.components:
            c_mean = all_ranks[f"reward_sum/{name}"] / (2 * pairs)
            metrics[f"reward_mean_{name}"] = c_mean
            metrics[f"reward_std_{name}"] = max(all_ranks[f"reward_sq/{name}"] / (2 * pairs) - c_mean**2, 0.0) ** 0.5
            if all_ranks[f"labelled/{name}"]:
                metrics[f"acc_{name}"] = all_ranks.mean(f"correct/{name}", over=f"labelled/{name}")
                metrics[f"loss_{name}"] = all_ranks.mean(f"loss/{name}", over=f"labelled/{name}")
        return metrics


@dataclass(frozen=True)
class RMLossSettings:
    """The reward head's components and what a training step minimises (the ``rm`` section)."""

    components: tuple[str, ...]  # one output of the head each
    weights: torch.Tensor  # (C,) each component's weight in the total reward
    total_loss_coef: float  # weight of the BT loss of the total on the overall preference
    center_coef: float  # weight of the centering term

    @classmethod
    def from_config(cls, rm: RMSection) -> RMLossSettings:
        components = tuple(rm.components)
        return cls(components, torch.tensor([rm.components[c] for c in components]), rm.total_loss_coef, rm.center_coef)


def rm_step(
    engine,
    examples: Sequence[PreferenceExample],
    settings: RMLossSettings,
    max_tokens: int,
    pad_token_id: int,
    step: int,
) -> dict[str, float]:
    """Optimizer step ``step`` (1-based) over a global mini-batch of pairs (every rank holds the
    whole list; each packs its share into token-budget micro-batches). Returns the
    :class:`PairStats` metrics and ``loss``, the minimised total."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]
    # Global counts: each loss term is a mean over the whole mini-batch (engine/data/batching.py).
    n_pairs = len(examples)
    n_labelled = torch.tensor([e.labels for e in examples]).ne(0).sum(0).tolist()  # per component
    stats = PairStats(settings.components)
    for micro in plan:
        if not micro:
            engine.backward(dummy_forward_loss(engine, pad_token_id))
            continue
        batch = [examples[i] for i in micro]
        r_chosen, r_rejected = score_pairs(engine, batch)
        _, margins, labels = collate_pairs(batch)
        losses = pair_losses(r_chosen, r_rejected, settings.weights, margins, labels)
        loss = (
            settings.total_loss_coef * losses.total.sum() + settings.center_coef * losses.center.sum()
        ) * token_mean_scale(n_pairs, world)
        for c, n in enumerate(n_labelled):
            if n:
                loss = loss + losses.component[:, c].sum() * token_mean_scale(n, world)
        engine.backward(faults.poisoned(loss, step))
        stats.add(r_chosen, r_rejected, settings.weights, labels, losses)
    engine.step()
    metrics = stats.reduce()
    metrics["loss"] = (
        settings.total_loss_coef * metrics["loss_total"]
        + settings.center_coef * metrics["center"]
        + sum(metrics.get(f"loss_{name}", 0.0) for name in settings.components)
    )
    return metrics


@torch.no_grad()
def evaluate_pairs(
    model,
    examples: Sequence[PreferenceExample],
    components: Sequence[str],
    weights: torch.Tensor,
    max_tokens: int,
    pad_token_id: int,
) -> dict[str, float]:
    """Accuracy, margin, loss and reward statistics over ``examples``, sharded over all ranks.

    Every rank runs the same number of (possibly dummy) forwards: ZeRO-3 forwards are collectives.
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    stats = PairStats(components)
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            dummy_forward_loss(model, pad_token_id)
            continue
        batch = [examples[i] for i in micro]
        r_chosen, r_rejected = score_pairs(model, batch)
        _, margins, labels = collate_pairs(batch)
        stats.add(r_chosen, r_rejected, weights, labels, pair_losses(r_chosen, r_rejected, weights, margins, labels))
    return stats.reduce()
