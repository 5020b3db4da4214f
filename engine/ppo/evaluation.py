"""Held-out evaluation during PPO with the run's rewards.

Every evaluation scores, on held-out prompts, one sampled response (fixed seed, so evaluations
compare like with like) and the greedy response of the current policy (the score and each of its
parts: ``eval/reward/<name>``, ``eval/reward_greedy/<name>``, e.g. the greedy exact-match
accuracy of a math verifier), and compares the
sampled one with the **reference policy's** sampled response to the same prompt: the win rate
under the run's score (ties count half; 0.5 when the policy is the reference). It also measures the
KL to the reference on the held-out responses (and, distilling, the reverse KL to the teacher) and what
the hacking monitors watch (length against the reference's, repeated n-grams, distinct n-grams across
prompts against the reference's).
The reference responses are sampled once per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.data.chat import prompt_ids
from engine.data.prompts import Prompt
from engine.models.lora import adapters_disabled
from engine.ppo.experience import sampled_token_mask
from engine.ppo.forwards import pad_right, sequence_logprobs
from engine.ppo.monitors import distinct_share, repeated_ngrams
from engine.ppo.rewards import RewardScorer, SampledResponses, Scorers
from engine.rollout.sampler import Sample, Sampler, SamplingSettings
from engine.run import faults
from engine.run.distributed import RankSums

if TYPE_CHECKING:
    from engine.environments.episodes import EpisodeRunner
    from engine.ppo.engines import HybridEngine
    from engine.run.lifecycle import RunLifecycle

POLICY_SEED, REFERENCE_SEED = 10**6, 2 * 10**6  # request seeds (+ rank): independent policy and reference draws
EVAL_SUMS = (  # over the held-out prompts; the sampled responses' n-grams: repeated ones and all
    "n",
    "reward",
    "reward_greedy",
    "ref_reward",
    "win_rate",
    "kl",
    "reward_length",
    "reward_greedy_length",
    "ref_length",
    "repeated",
    "ngrams",
)


def win_scores(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per prompt: 1 when the policy's response scores higher than the reference's, 0.5 on a tie."""
    return (policy > reference).float() + 0.5 * (policy == reference).float()


class Scored(NamedTuple):
    total: torch.Tensor  # (n,)
    parts: dict[str, torch.Tensor]  # reward/<name> -> (n,), failure shares left out


@dataclass(frozen=True)
class Responses:
    """One scored response per held-out prompt of this rank."""

    samples: list[Sample]
    texts: list[str]
    rewards: torch.Tensor  # (n,)
    components: dict[str, torch.Tensor]  # the score's parts (reward/<name>), (n,) each
    judged: Scored | None = None  # the judge's score, when asked for and the run has a judge

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([s.sampled_length for s in self.samples], dtype=torch.float64)


class HeldOutEvaluator:
    """This rank's share of the held-out prompts, and the reference's responses to them."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        tokenizer,
        scorers: Scorers,
        settings: SamplingSettings,
        max_tokens: int,
        ngrams: tuple[int, int],
        share_prompts: bool = True,
        episodes: EpisodeRunner | None = None,
    ):
        """``ngrams``: the n of the repeated n-gram and of the distinct n-gram measures; ``episodes``:
        multi-turn responses, as the rollout's."""
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        mine = prompts[rank::world]
        self.rank, self.messages, self.fields = rank, [p.messages for p in mine], [p.fields for p in mine]
        self.ids = [prompt_ids(tokenizer, m) for m in self.messages]
        self.tokenizer, self.scorer, self.judge, self.settings = tokenizer, scorers.run, scorers.judge, settings
        self.max_tokens, (self.ngram, self.distinct_n), self.share_prompts = max_tokens, ngrams, share_prompts
        self.episodes, self.prompts = episodes, mine
        self.reference: Responses | None = None
        self.reference_distinct = 0.0  # distinct_over_ranks of the reference's responses

    def score(self, scorer: RewardScorer, samples: list[Sample], texts: list[str]) -> Scored:
        total, parts = scorer.score(SampledResponses(self.messages, samples, texts, self.fields))
        return Scored(total, {k: v for k, v in parts.items() if not k.endswith(("/errors", "/timeouts"))})

    def respond(self, sampler: Sampler, temperature: float, seed: int, judged: bool = False) -> Responses:
        """This rank's responses, scored by the run (and by the judge when ``judged``)."""
        settings = SamplingSettings(1, temperature, self.settings.top_p, self.settings.max_new_tokens)
        groups = (
            self.episodes.run(sampler, self.prompts, self.ids, settings, seed + self.rank)
            if self.episodes
            else sampler.generate(self.ids, settings, request_seed=seed + self.rank)
        )
        samples = [group[0] for group in groups]
        texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scored = self.score(self.scorer, samples, texts)
        judge = self.score(self.judge, samples, texts) if judged and self.judge is not None else None
        return Responses(samples, texts, scored.total, scored.parts, judge)

    def sample_reference(self, sampler: Sampler, engines: HybridEngine) -> None:
        """Sample the reference policy's responses with ``sampler`` loaded with the reference's weights,
        then loaded with the actor's again."""
        with adapters_disabled(engines.ref.module):  # LoRA: the reference is the actor's base
            reference = sampler.loaded_with(engines.ref)
            self.reference = self.respond(reference, self.settings.temperature, REFERENCE_SEED, judged=True)
        sampler.sync_weights(engines.actor)
        self.reference_distinct = self.distinct_over_ranks(self.reference)

    def distinct_over_ranks(self, responses: Responses) -> float:
        """:func:`engine.ppo.monitors.distinct_share` of the responses of every rank together."""
        gathered: list[list[list[int]]] = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(gathered, [s.response_ids for s in responses.samples])
        return distinct_share([ids for part in gathered for ids in part], self.distinct_n)

    @torch.no_grad()
    def sampled_logprobs(self, samples: list[Sample], model) -> torch.Tensor:
        """(n, T) each response's token log-probs under ``model`` sampling at the rollout's temperature
        (the responses' distribution), 0 at a multi-turn episode's observations and the padding."""
        logprobs = sequence_logprobs(
            model,
            [s.prompt_ids + s.response_ids for s in samples],
            [len(s.prompt_ids) for s in samples],
            self.max_tokens,
            self.tokenizer.pad_token_id,
            self.share_prompts,
            self.settings.temperature,
        )
        T = max(len(lp) for lp in logprobs)
        return pad_right(logprobs, T) * sampled_token_mask(samples, T)

    def evaluate(
        self, sampler: Sampler, actor, ref, sample_rows: int, teacher=None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out metrics averaged over all ranks, and example rows (rank 0's first prompts);
        ``teacher`` (a distillation run's): also the reverse KL to it per token, ``distill/reverse_kl``."""
        assert self.reference is not None, "sample_reference first"
        sampled = self.respond(sampler, self.settings.temperature, POLICY_SEED, judged=True)
        greedy = self.respond(sampler, 0.0, POLICY_SEED)
        # KL(policy || reference), and distilling KL(policy || teacher), of each response: k1, summed over its tokens
        policy = self.sampled_logprobs(sampled.samples, actor)
        kl = (policy - self.sampled_logprobs(sampled.samples, ref)).sum(1).double()
        teacher_kl = (
            [("distill_kl", (policy - self.sampled_logprobs(sampled.samples, teacher)).sum())]
            if teacher is not None
            else []
        )
        repeated, total = map(sum, zip(*(repeated_ngrams(s.response_ids, self.ngram) for s in sampled.samples)))
        ref = self.reference
        parts = [  # eval/reward/<name>, eval/reward_greedy/<name>: each part's sum
            (name.replace("reward/", f"reward{kind}/", 1), r.components[name].sum())
            for kind, r in (("", sampled), ("_greedy", greedy))
            for name in sorted(sampled.components)
        ]
        sums = RankSums([*EVAL_SUMS, *(name for name, _ in parts + teacher_kl)])
        sums.add(
            n=len(sampled.samples),
            reward=sampled.rewards.sum(),
            reward_greedy=greedy.rewards.sum(),
            ref_reward=ref.rewards.sum(),
            win_rate=win_scores(sampled.rewards, ref.rewards).sum(),
            kl=kl.sum(),
            reward_length=sampled.lengths.sum(),
            reward_greedy_length=greedy.lengths.sum(),
            ref_length=ref.lengths.sum(),
            repeated=repeated,
            ngrams=total,
        )
        sums.add(**dict(parts + teacher_kl))
        all_ranks = sums.reduced()
        metrics = {
            "reward": all_ranks.mean("reward", over="n"),
            "reward_greedy": all_ranks.mean("reward_greedy", over="n"),
            "ref_reward": all_ranks.mean("ref_reward", over="n"),
            "win_rate": all_ranks.mean("win_rate", over="n"),
            "kl": all_ranks.mean("kl", over="n"),
            "kl_per_token": all_ranks.mean("kl", over="reward_length"),
            "reward_length": all_ranks.mean("reward_length", over="n"),
            "reward_greedy_length": all_ranks.mean("reward_greedy_length", over="n"),
            "ref_length": all_ranks.mean("ref_length", over="n"),
            "length_ratio": all_ranks.mean("reward_length", over="ref_length"),
            "repeated_ngram_frac": all_ranks.mean("repeated", over="ngrams"),
            "distinct_ratio": self.distinct_over_ranks(sampled) / max(self.reference_distinct, 1e-9),
        } | judge_metrics(sampled.judged, ref.judged)
        metrics |= {name: all_ranks.mean(name, over="n") for name, _ in parts}
        if teacher_kl:
            metrics["distill/reverse_kl"] = all_ranks.mean("distill_kl", over="reward_length")
        rows = (
            [
                {
                    "prompt": self.messages[i][-1]["content"],
                    "response": sampled.texts[i],
                    "reward": sampled.rewards[i].item(),
                    "kl": kl[i].item(),
                    "ref_response": ref.texts[i],
                    "ref_reward": ref.rewards[i].item(),
                }
                for i in range(min(sample_rows, len(self.messages)))
            ]
            if self.rank == 0
            else []
        )
        return metrics, rows


def judge_metrics(policy: Scored | None, reference: Scored | None) -> dict[str, float]:
    """The judge's mean score of the policy's held-out responses and its win rates against the
    reference's, in total and per part (``judge_win_rate/<name>``), over all ranks; {} without a judge."""
    if policy is None or reference is None:
        return {}
    wins = {
        f"judge_win_rate/{k.removeprefix('reward/')}": win_scores(policy.parts[k], reference.parts[k]).sum()
        for k in sorted(policy.parts)
    }
    sums = RankSums(["n", "judge_reward", "judge_win_rate", *wins])
    sums.add(
        n=len(policy.total),
        judge_reward=policy.total.sum(),
        judge_win_rate=win_scores(policy.total, reference.total).sum(),
        **wins,
    )
    all_ranks = sums.reduced()
    return {name: all_ranks.mean(name, over="n") for name in ["judge_reward", "judge_win_rate", *wins]}


def held_out_summary(first: dict[str, float], last: dict[str, float]) -> str:
    """The run's last line on its held-out evaluations: the reward before and after, the win rate,
    and each component of the score on the greedy responses (a verifier's exact-match accuracy)."""
    greedy = sorted(k for k in first if k.startswith("eval/reward_greedy/") and k in last)
    parts = "".join(
        f", {k.removeprefix('eval/reward_greedy/')} (greedy) {first[k]:.3f} -> {last[k]:.3f}" for k in greedy
    )
    return (
        f"held-out reward {first['eval/reward']:.3f} -> {last['eval/reward']:.3f}, "
        f"win rate vs reference {last['eval/win_rate']:.3f}{parts}"
    )


def held_out_eval(
    evaluator: HeldOutEvaluator,
    sampler: Sampler,
    engines: HybridEngine,
    run: RunLifecycle,
    sample_rows: int,
) -> dict[str, float]:
    """Evaluate the current policy on the held-out prompts at iteration ``run.step``; log sample rows.
    Returns the eval/* metrics."""
    result, rows = evaluator.evaluate(sampler, engines.actor, engines.ref, sample_rows, engines.teacher)
    result["reward"] = faults.offset_eval_reward(result["reward"], run.step)
    run.logger.samples(run.step, rows)
    return {f"eval/{k}": v for k, v in result.items()}
