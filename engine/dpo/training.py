"""The preference loss of a step, its metrics, the training step and held-out evaluation.

Loss of a step: the mean over its pairs of the per-pair loss (engine/dpo/losses.py), whatever the
packing, the micro-batching and the number of ranks (each micro-batch's sum is scaled by
``world / pairs``, engine/data/batching.py ``token_mean_scale``). The implicit rewards are the
loss's: ``beta * log pi/pi_ref`` of each response (DPO), the log-ratio (IPO), ``beta`` times the
mean log-prob (SimPO).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.data.batching import plan_global, token_mean_scale
from engine.data.packing import dummy_forward_loss
from engine.data.preferences import PreferenceExample
from engine.data.response_tokens import top_k_kl
from engine.dpo.losses import PreferenceLoss, dpo_loss, ipo_loss, simpo_loss
from engine.dpo.pairs import PairLogprobs, pair_distributions, pair_logprobs
from engine.dpo.reference import ReferenceLogprobs
from engine.run import faults
from engine.run.distributed import RankSums
from engine.run_config import DPOSection, PreferenceLossName


@dataclass(frozen=True)
class PreferenceLossSettings:
    """What a step minimises (the ``dpo`` section, its defaults resolved)."""

    loss: PreferenceLossName
    beta: float
    label_smoothing: float
    simpo_gamma: float

    @classmethod
    def from_config(cls, dpo: DPOSection) -> PreferenceLossSettings:
        assert dpo.beta is not None  # DPOSection.check fills it in
        return cls(dpo.loss, dpo.beta, dpo.label_smoothing, dpo.simpo_gamma or 0.0)

    def __call__(self, policy: PairLogprobs, reference: torch.Tensor) -> PreferenceLoss:
        """Per-pair losses and implicit rewards; ``reference`` (B, 2): the reference's summed
        log-probs of each chosen and rejected response (unused by SimPO)."""
        if self.loss == "simpo":
            return simpo_loss(
                policy.chosen / policy.chosen_tokens,
                policy.rejected / policy.rejected_tokens,
                self.beta,
                self.simpo_gamma,
            )
        if self.loss == "ipo":
            return ipo_loss(policy.chosen, policy.rejected, reference[:, 0], reference[:, 1], self.beta)
        return dpo_loss(
            policy.chosen, policy.rejected, reference[:, 0], reference[:, 1], self.beta, self.label_smoothing
        )


class PreferenceStats:
    """Sums over pairs (this rank), reduced over ranks on demand: loss, accuracy, implicit rewards,
    log-probs and, on held-out pairs, the KL to the reference."""

    FIELDS = ("pairs", "loss", "correct", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp")

    def __init__(self) -> None:
        self.sums = RankSums([*self.FIELDS, "kl", "kl_tokens"])  # + the k3 sum over the KL's tokens

    def add(self, policy: PairLogprobs, out: PreferenceLoss) -> None:
        self.sums.add(
            pairs=len(out.loss),
            loss=out.loss.detach().sum(),
            correct=(out.chosen_reward > out.rejected_reward).sum(),
            chosen_reward=out.chosen_reward.sum(),
            rejected_reward=out.rejected_reward.sum(),
            chosen_logp=policy.chosen.detach().sum(),
            rejected_logp=policy.rejected.detach().sum(),
        )

    def add_kl(self, kl: torch.Tensor) -> None:
        """(K,) KL(pi || pi_ref) of the next-token distributions at K response positions."""
        self.sums.add(kl=kl.double().sum(), kl_tokens=kl.numel())

    def reduce(self) -> dict[str, float]:
        all_ranks = self.sums.reduced()
        metrics = {name: all_ranks.mean(name, over="pairs") for name in self.FIELDS if name != "pairs"}
        metrics["acc"] = metrics.pop("correct")
        metrics["margin"] = metrics["chosen_reward"] - metrics["rejected_reward"]
        if all_ranks["kl_tokens"] > 0:
            metrics["kl"] = all_ranks.mean("kl", over="kl_tokens")
        return metrics


def dpo_step(
    engine,
    examples: Sequence[PreferenceExample],
    reference: torch.Tensor,
    settings: PreferenceLossSettings,
    max_tokens: int,
    pad_token_id: int,
    step: int,
) -> dict[str, float]:
    """Optimizer step ``step`` (1-based) over a global mini-batch of pairs (every rank holds the
    whole list and its reference log-probs ``reference`` (B, 2); each packs its share into
    token-budget micro-batches). Returns the :class:`PreferenceStats` metrics."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    scale = token_mean_scale(len(examples), world)
    stats = PreferenceStats()
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            engine.backward(dummy_forward_loss(engine, pad_token_id))
            continue
        policy = pair_logprobs(engine, [examples[i] for i in micro])
        out = settings(policy, reference[micro])
        engine.backward(faults.poisoned(out.loss.sum() * scale, step))
        stats.add(policy, out)
    engine.step()
    return stats.reduce()


@torch.no_grad()
def evaluate_preferences(
    model,
    examples: Sequence[PreferenceExample],
    reference: ReferenceLogprobs,
    settings: PreferenceLossSettings,
    max_tokens: int,
    pad_token_id: int,
) -> dict[str, float]:
    """The :class:`PreferenceStats` metrics over held-out ``examples`` and ``kl``, the token-mean
    KL(pi || pi_ref) of the next-token distributions at their response positions (over the
    reference's top tokens and the rest: :func:`top_k_kl`), sharded over all ranks (every rank runs
    the same number of forwards: ZeRO-3 forwards are collectives)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    stats = PreferenceStats()
    for micro in plan_global([e.num_tokens for e in examples], max_tokens, world)[rank]:
        if not micro:
            dummy_forward_loss(model, pad_token_id)
            continue
        policy, log_softmax = pair_distributions(model, [examples[i] for i in micro])
        ref_sums, ref_top_logp, ref_top_ids = reference.held_out(micro)
        stats.add(policy, settings(policy, ref_sums))
        stats.add_kl(top_k_kl(log_softmax, ref_top_logp, ref_top_ids))
    return stats.reduce()
