"""One rank's rollout of a PPO iteration: its prompts drawn in order, sampled and scored
(:class:`RolloutCollector`), with DAPO's dynamic sampling (Yu et al. 2025, "DAPO: an open-source
LLM reinforcement learning system at scale", section 3.2).

Under a group estimator (grpo, rloo) a prompt whose samples all score the same has zero advantage
and gives no gradient. Dynamic sampling drops such groups and draws more prompts, up to
``max_rounds`` generation rounds, until every rank holds its share of groups with signal; groups
found beyond a rank's share wait for the next iteration (checkpointed, so a resume repeats the
run), and a batch still short after the last round is filled with dropped groups (counted).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.data.batching import epoch_order
from engine.data.chat import prompt_ids
from engine.ppo.rewards import SampledResponses
from engine.rollout.sampler import Generated, PendingSamples, Sample, Sampler, SamplingSettings
from engine.run.distributed import RankSums, all_reduce

if TYPE_CHECKING:
    from engine.data.prompts import Prompt
    from engine.environments.episodes import EpisodeRunner
    from engine.ppo.dataset_responses import DatasetResponses
    from engine.ppo.rewards import RewardScorer
    from engine.run_config import PPOConfig


@dataclass
class Group:
    """The samples of one prompt, scored."""

    prompt: int  # index of the prompt in the run's prompt list
    samples: list[Sample]
    scores: torch.Tensor  # (n,)
    parts: dict[str, torch.Tensor]  # the score's parts, each (n,)


@dataclass
class Rollout:
    """One rank's scored samples; the samples of a prompt are contiguous."""

    samples: list[Sample]
    prompts: list[Prompt]  # prompts[i]: sample i's prompt
    scores: torch.Tensor  # (B,)
    parts: dict[str, torch.Tensor]  # each (B,): reward/<name> for the logs
    earlier: int = 0  # the first ``earlier`` samples were drawn in an earlier iteration (dynamic sampling's waiting)
    on_policy: bool = True  # False: the dataset's responses (distill.lmbda < 1), not sampled


class Collected(NamedTuple):
    """An iteration's rollout on this rank (:meth:`RolloutCollector.collect`) and how it was made."""

    rollout: Rollout
    generate_s: float  # spent generating (on the generating ranks, for an async rollout)
    wait_s: float  # waited for the samples (the generation itself when it is colocated)
    score_s: float
    generated_tokens: float  # all ranks
    stats: dict[str, float]  # logged as ppo/<name>: staleness; with dynamic sampling the counts of collect()


def has_signal(scores: torch.Tensor) -> bool:
    """Whether a group's (n,) scores differ anywhere: a group scored alike has zero group-relative
    advantage (DAPO keeps groups with 0 < accuracy < 1; for real-valued scores, std > 0)."""
    return bool((scores != scores[0]).any())


def fill_batch(kept: list[Group], dropped: list[Group], share: int) -> tuple[list[Group], list[Group], int]:
    """(the batch, the groups left waiting, how many dropped groups filled it): the first ``share``
    groups with signal, the next ``share`` at most wait; a batch still short takes dropped groups."""
    batch, waiting = kept[:share], kept[share : 2 * share]
    filler = dropped[: share - len(batch)]
    return batch + filler, waiting, len(filler)


class RolloutCollector:
    """Draws this rank's prompts in order and samples and scores them.

    The prompt order is epoch by epoch (``epoch_order`` of the seed), ``prompts_per_iteration`` per
    draw over all ranks, this rank's consecutive slice of each; the draw count is the position, and
    draw d samples with seed ``d * world + rank``. Without dynamic sampling there is one draw per
    iteration. Checkpointed (the position and the waiting groups)."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        prompts_per_iteration: int,
        seed: int,
        sampler: Sampler,
        sampling: SamplingSettings,
        scorer: RewardScorer,
        tokenizer,
        max_rounds: int | None,
        ahead: int = 0,
        last_draw: int | None = None,
        episodes: EpisodeRunner | None = None,
        responses: DatasetResponses | None = None,
    ):
        """``episodes``: multi-turn rollouts with an environment (else one response per sample);
        ``responses``: the dataset's, taken instead of samples on the draws they say (distill.lmbda < 1;
        one draw per iteration then, no dynamic sampling)."""
        self.prompts, self.per_draw, self.seed, self.episodes = prompts, prompts_per_iteration, seed, episodes
        self.responses = responses
        self.sampler, self.sampling, self.scorer, self.tokenizer = sampler, sampling, scorer, tokenizer
        self.max_rounds = max_rounds  # None: no dynamic sampling
        self.ahead = ahead  # draws asked for beyond the one collected (an async rollout's max_staleness)...
        self.last_draw = last_draw  # ...up to this one (the run's last iteration)
        # draw -> (its generation, the draw collected when it was asked)
        self.asked: dict[int, tuple[PendingSamples, int]] = {}
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.share = prompts_per_iteration // self.world
        self.draws_per_epoch = len(prompts) // prompts_per_iteration
        self.draws = 0
        self.waiting: list[Group] = []

    @classmethod
    def for_run(
        cls,
        cfg: PPOConfig,
        prompts: Sequence[Prompt],
        sampler: Sampler,
        scorer: RewardScorer,
        tokenizer,
        episodes: EpisodeRunner | None = None,
        responses: DatasetResponses | None = None,
    ):
        """The collector of ``cfg``: its sampling settings, dynamic sampling's rounds, the async rollout's
        draws asked for ahead (up to the run's last), its episodes' runner, the dataset's responses."""
        rollout = cfg.rollout
        ahead = rollout.max_staleness if rollout.mode == "async" else 0
        return cls(
            prompts,
            rollout.prompts_per_iteration,
            cfg.train.seed,
            sampler,
            SamplingSettings(rollout.samples_per_prompt, rollout.temperature, rollout.top_p, rollout.max_new_tokens),
            scorer,
            tokenizer,
            rollout.max_generation_rounds if rollout.dynamic_sampling else None,
            ahead,
            cfg.train.iterations - 1 if ahead else None,
            episodes,
            responses,
        )

    def collect(self) -> Collected:
        """This iteration's rollout, its timing and statistics: ``staleness`` (policy versions between the
        samples' and the actor's); with dynamic sampling also ``kept_share``
        (groups with signal / groups drawn, all
        ranks), ``generation_rounds``, ``filled_groups`` (dropped groups trained for want of others),
        ``waiting_groups`` and ``sampled_score`` (mean over every sample drawn, kept or not); with the
        dataset's responses ``distill/on_policy`` (1: sampled, 0: the dataset's). A collective. Nothing
        changes when scoring raises (the iteration repeats on resume)."""
        on_policy = self.responses is None or self.responses.on_policy(self.draws)  # one draw per iteration then
        draws, rounds, timing = self.draws, 0, {"generate_s": 0.0, "wait_s": 0.0, "score_s": 0.0, "staleness": 0.0}
        if self.max_rounds is None:
            batch, draws, rounds = self._draw(draws, timing), draws + 1, 1
            drawn, waiting, filled = batch, list[Group](), 0
        else:
            kept, dropped, drawn = list(self.waiting), list[Group](), list[Group]()
            while rounds < self.max_rounds and self._short_anywhere(len(kept)):
                new = self._draw(draws, timing)
                draws, rounds, drawn = draws + 1, rounds + 1, drawn + new
                for g in new:
                    (kept if has_signal(g.scores) else dropped).append(g)
            batch, waiting, filled = fill_batch(kept, dropped, self.share)
        earlier = sum(len(g.samples) for g in batch if any(g is w for w in self.waiting))
        self.draws, self.waiting = draws, waiting
        counts = self._counts(drawn, rounds, waiting, filled)
        rollout = Rollout(
            [s for g in batch for s in g.samples],
            [self.prompts[g.prompt] for g in batch for _ in g.samples],
            torch.cat([g.scores for g in batch]),
            {k: torch.cat([g.parts[k] for g in batch]) for k in batch[0].parts},
            earlier,
            on_policy,
        )
        tokens = counts.pop("generated_tokens") if on_policy else 0.0  # the dataset's: none generated
        stats = {"staleness": timing["staleness"]} | counts
        if self.responses is not None:
            stats["distill/on_policy"] = float(on_policy)
        return Collected(rollout, timing["generate_s"], timing["wait_s"], timing["score_s"], tokens, stats)

    def _short_anywhere(self, kept: int) -> bool:
        """Whether some rank holds fewer than its share of groups with signal (a collective)."""
        return bool(all_reduce(torch.tensor([max(self.share - kept, 0)])).item())

    def _indices(self, draw: int) -> list[int]:
        """This rank's slice of draw ``draw``: indices into the prompt list."""
        epoch, in_epoch = divmod(draw, self.draws_per_epoch)
        start = in_epoch * self.per_draw + self.rank * self.share
        return [int(i) for i in epoch_order(len(self.prompts), self.seed, epoch)[start : start + self.share]]

    def _draw(self, draw: int, timing: dict[str, float]) -> list[Group]:
        """Sample and score this rank's slice of draw ``draw`` (a collective: the scorer's). The draws up to
        ``ahead`` beyond it are asked for first: an async rollout generates them while this one trains."""
        t0 = time.perf_counter()
        last = draw + self.ahead if self.last_draw is None else min(draw + self.ahead, self.last_draw)
        for d in range(draw, last + 1):
            if d not in self.asked:
                self.asked[d] = (self._submit(self._indices(d), d), draw)
        generation, asked_at = self.asked.pop(draw)
        groups, generate_s = generation.result()
        self.sampler.sleep()  # GPU: its memory goes to the scoring, experience forwards and training
        t1 = time.perf_counter()
        indices = self._indices(draw)
        samples = [s for group in groups for s in group]
        prompts = [self.prompts[i] for i, group in zip(indices, groups) for _ in group]
        scores, parts = self.scorer.score(SampledResponses.decode(prompts, samples, self.tokenizer))
        timing["generate_s"] += generate_s
        timing["wait_s"] += t1 - t0
        timing["score_s"] += time.perf_counter() - t1
        timing["staleness"] = max(timing["staleness"], draw - asked_at)  # policy versions behind the actor
        n = self.sampling.n
        return [
            Group(
                i, groups[k], scores[k * n : (k + 1) * n], {name: v[k * n : (k + 1) * n] for name, v in parts.items()}
            )
            for k, i in enumerate(indices)
        ]

    def _submit(self, indices: list[int], draw: int) -> PendingSamples:
        """Ask for draw ``draw``'s samples of prompts ``indices`` (episodes, or the dataset's responses:
        made now)."""
        ids = [prompt_ids(self.tokenizer, self.prompts[i].messages) for i in indices]
        if self.responses is not None and not self.responses.on_policy(draw):
            return Generated(self.responses.samples(ids, indices, self.sampling.n), 0.0)
        seed = draw * self.world + self.rank
        if self.episodes is None:
            return self.sampler.submit(ids, self.sampling, seed)
        t0 = time.perf_counter()
        groups = self.episodes.run(self.sampler, [self.prompts[i] for i in indices], ids, self.sampling, seed)
        return Generated(groups, time.perf_counter() - t0)

    def _counts(self, drawn: list[Group], rounds: int, waiting: list[Group], filled: int) -> dict[str, float]:
        """The statistics summed over the ranks (see :meth:`collect`). Every iteration draws at least
        once: the ranks that needed the last round keep fewer than their share waiting."""
        scores = torch.cat([g.scores for g in drawn])
        sums = RankSums(["tokens", "groups", "signal", "filled", "waiting", "score", "samples"])
        sums.add(
            tokens=sum(s.sampled_length for g in drawn for s in g.samples),
            groups=len(drawn),
            signal=sum(has_signal(g.scores) for g in drawn),
            filled=filled,
            waiting=len(waiting),
            score=float(scores.sum()),
            samples=len(scores),
        )
        all_ranks = sums.reduced()
        if self.max_rounds is None:
            return {"generated_tokens": all_ranks["tokens"]}
        return {
            "generated_tokens": all_ranks["tokens"],
            "kept_share": all_ranks.mean("signal", over="groups"),
            "generation_rounds": float(rounds),
            "filled_groups": all_ranks["filled"],
            "waiting_groups": all_ranks["waiting"],
            "sampled_score": all_ranks.mean("score", over="samples"),
        }

    def state_dict(self) -> dict[str, Any]:
        """The position, the waiting groups and the draws generated ahead (waited for: a resume trains on
        the same samples)."""
        asked = []
        for draw, (generation, asked_at) in sorted(self.asked.items()):
            samples, generate_s = generation.result()
            self.asked[draw] = (Generated(samples, generate_s), asked_at)
            samples_dicts = [[s.state() for s in group] for group in samples]
            asked.append({"draw": draw, "asked_at": asked_at, "samples": samples_dicts, "generate_s": generate_s})
        return {
            "draws": self.draws,
            "asked": asked,
            "waiting": [
                {"prompt": g.prompt, "samples": [s.state() for s in g.samples], "scores": g.scores, "parts": g.parts}
                for g in self.waiting
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = state["draws"]
        self.asked = {  # what was asked for after the checkpoint is dropped (a rollback)
            a["draw"]: (
                Generated([[Sample.from_state(s) for s in g] for g in a["samples"]], a["generate_s"]),
                a["asked_at"],
            )
            for a in state.get("asked", [])
        }
        self.waiting = [
            Group(g["prompt"], [Sample.from_state(s) for s in g["samples"]], g["scores"], g["parts"])
            for g in state["waiting"]
        ]
