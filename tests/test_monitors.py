"""Reward-hacking monitors on constructed cases: the measures, each flag, raising once while a
condition holds, the KL limit's defaults, the checkpointed state, and the win-rate rule; the held-out
evaluation's measures on scripted responses, counted by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import build_config
from engine.data.prompts import Prompt
from engine.ppo.evaluation import HeldOutEvaluator, win_scores
from engine.ppo.monitors import HackingMonitor, MonitorLimits, distinct_share, repeated_ngrams, within_prompt_diversity
from engine.ppo.rewards import RewardScorer, Scorers
from engine.rewards.components import RewardComponents
from engine.rollout.sampler import Sample, Sampler, SamplingSettings
from engine.run_config import PPOConfig
from engine.run_config.rewards import LengthPenalty, RewardsSection

REFERENCE = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]
LIMITS = MonitorLimits(
    length_ratio_max=1.5,
    length_ratio_min=0.5,
    repeated_ngram_max=0.3,
    entropy_min_share=0.3,
    diversity_min_share=0.5,
    kl_per_token_max=0.2,
    win_rate_drop=0.05,
    judge_disagreement=0.3,
)
MINIMAL = {"actor": {"path": "a"}, "reward_model": {"path": "r"}, "data": {"prompts": "p"}, "deepspeed": {}}


def held_out(responses: list[list[int]], win_rate: float) -> dict[str, float]:
    """The monitored eval/* metrics of a set of responses (engine/ppo/evaluation.py computes the same)."""
    repeated, total = map(sum, zip(*(repeated_ngrams(r, 4) for r in responses)))
    return {
        "eval/length_ratio": sum(map(len, responses)) / sum(map(len, REFERENCE)),
        "eval/repeated_ngram_frac": repeated / max(total, 1),
        "eval/distinct_ratio": distinct_share(responses, 2) / distinct_share(REFERENCE, 2),
        "eval/win_rate": win_rate,
    }


def rollout(score: float, entropy: float, diversity: float, kl: float, length: float = 10.0) -> dict[str, float]:
    return {
        "ppo/score": score,
        "ppo/entropy": entropy,
        "ppo/distinct_within_prompt": diversity,
        "ppo/kl_per_token": kl,
        "ppo/response_length": length,
    }


def test_ngram_measures():
    assert repeated_ngrams([1, 2, 3, 4, 5], 2) == (0, 4)
    assert repeated_ngrams([1, 2, 1, 2, 1, 2], 2) == (3, 5)  # (1,2) x3, (2,1) x2: three repeats
    assert repeated_ngrams([1, 2], 4) == (0, 0)
    # distinct-2 over responses together: (1,2) (2,3) | (1,2) (2,4) -> 3 distinct of 4
    assert distinct_share([[1, 2, 3], [1, 2, 4]], 2) == 0.75
    assert distinct_share([[7], [7]], 2) == 0.0  # no bigram at all: no diversity
    # two prompts x two samples: 3/4 for the first, 1/2 for the second (the same response twice)
    assert within_prompt_diversity([[1, 2, 3], [1, 2, 4], [5, 6], [5, 6]], 2, 2) == pytest.approx(0.625)


def test_a_policy_that_only_lengthens_its_answers_is_flagged():
    monitor = HackingMonitor(LIMITS)
    assert monitor.check_evaluation(0, held_out(REFERENCE, win_rate=0.5)) == []
    padded = [r + r[-4:] * 4 for r in REFERENCE]  # same answer, then its tail over and over
    monitor.check_iteration(1, rollout(1.3, 2.0, 0.8, 0.01))
    flags = {f.kind: f for f in monitor.check_evaluation(2, held_out(padded, win_rate=0.45))}
    assert set(flags) == {"monitor/length_growth", "monitor/repetition", "monitor/diversity_collapse"}
    assert "3.29x the reference's length" in flags["monitor/length_growth"].message
    assert flags["monitor/repetition"].since == 0  # the band starts at the previous evaluation
    # Next evaluation: the training reward keeps rising while the held-out win rate falls by more
    # than win_rate_drop; the conditions still holding raise no second flag.
    monitor.check_iteration(3, rollout(1.6, 2.0, 0.8, 0.01))
    flags = {f.kind: f for f in monitor.check_evaluation(4, held_out(padded, win_rate=0.35))}
    assert list(flags) == ["monitor/reward_up_win_rate_down"]
    assert (
        "rose 1.300 -> 1.600 while the held-out win rate fell 0.450 -> 0.350"
        in flags["monitor/reward_up_win_rate_down"].message
    )
    monitor.check_iteration(5, rollout(1.7, 2.0, 0.8, 0.01))  # a fall within win_rate_drop is noise
    assert monitor.check_evaluation(6, held_out(padded, win_rate=0.32)) == []
    assert monitor.summary() == (
        "4 reward-hacking flags: length_growth (iteration 2), repetition (iteration 2), "
        "diversity_collapse (iteration 2), reward_up_win_rate_down (iteration 4)"
    )


def test_a_collapsed_policy_is_flagged_at_its_iterations_and_evaluations():
    """The collapse of the issue that asked for these monitors: fragments like '.' and ' harbor.'."""
    monitor = HackingMonitor(LIMITS)
    assert monitor.check_iteration(1, rollout(0.4, 2.95, 0.8, 0.01)) == []  # the start
    assert monitor.check_iteration(2, rollout(0.8, 1.5, 0.6, 0.1)) == []
    flags = monitor.check_iteration(3, rollout(1.2, 0.4, 0.3, 3.8))
    assert [f.kind for f in flags] == [
        "monitor/entropy_collapse",
        "monitor/sample_diversity_collapse",
        "monitor/kl_high",
    ]
    assert "0.400 is below 30% of the first iteration's 2.950" in flags[0].message and flags[0].since == 2
    assert "3.8000 per token is above 0.2" in flags[2].message
    assert monitor.check_iteration(4, rollout(1.3, 0.4, 0.3, 3.8)) == []  # still holding: raised once
    assert monitor.check_iteration(5, rollout(1.3, 2.9, 0.8, 0.01)) == []  # cleared ...
    assert [f.kind for f in monitor.check_iteration(6, rollout(1.3, 0.5, 0.8, 0.01))] == ["monitor/entropy_collapse"]
    fragments = [[14, 13]] * 3  # the same fragment for every prompt
    flags = monitor.check_evaluation(6, held_out(fragments, win_rate=1.0))
    assert [f.kind for f in flags] == ["monitor/length_collapse", "monitor/diversity_collapse"]
    assert "0.43x the reference's length (limit 0.5)" in flags[0].message
    restored = HackingMonitor(LIMITS)
    restored.load_state_dict(monitor.state_dict())
    assert restored == monitor and restored.raised[-1] == ("diversity_collapse", 6)


def test_the_rollout_s_length_is_checked_against_the_first_iteration_s_in_both_directions():
    """A policy lengthening its samples is flagged while it runs, before any held-out evaluation; the
    last LENGTH_WINDOW (5) iterations' lengths are averaged."""
    monitor = HackingMonitor(LIMITS)
    kinds = lambda step, length: [f.kind for f in monitor.check_iteration(step, rollout(0.4, 2.9, 0.8, 0.01, length))]
    assert kinds(1, 8.0) == [] and monitor.first_length == 8.0  # the starting policy's length
    assert kinds(2, 16.0) == []  # (8 + 16) / 2 = 1.5x: at the limit, not above it
    [flag] = monitor.check_iteration(3, rollout(0.9, 2.9, 0.8, 0.01, 16.0))
    assert (
        flag.kind == "monitor/rollout_length_growth"
        and "1.67x the first iteration's length (limit 1.5)" in flag.message
    )
    assert kinds(4, 16.0) == []  # still holding
    # The window [8, 16, 16, 16, 1] ... [1, 1, 1, 1, 1]: 1.43x, 1.25x, 0.88x, 0.5x (at the limit), 0.12x.
    assert [kinds(step, 1.0) for step in range(5, 10)] == [[], [], [], [], ["monitor/rollout_length_collapse"]]
    restored = HackingMonitor(LIMITS)
    restored.load_state_dict(monitor.state_dict())
    assert restored == monitor and restored.first_length == 8.0


def test_a_judge_disagreeing_with_the_run_s_score_is_flagged():
    monitor = HackingMonitor(LIMITS)
    agree = held_out(REFERENCE, win_rate=0.8) | {"eval/judge_win_rate": 0.7}
    assert monitor.check_evaluation(2, agree) == []
    [flag] = monitor.check_evaluation(4, held_out(REFERENCE, win_rate=0.9) | {"eval/judge_win_rate": 0.2})
    assert (
        flag.kind == "monitor/judge_disagrees" and "0.900 under the run's score, 0.200 under the judge" in flag.message
    )


def test_the_kl_limit_follows_the_guard_or_the_controller():
    limit = lambda **sections: (
        MonitorLimits.from_config(build_config(PPOConfig, MINIMAL | sections, "run.json")).kl_per_token_max
    )
    assert limit() == 0.5
    assert limit(ppo={"kl_target": 0.05}) == pytest.approx(0.2)
    assert limit(ppo={"kl_target": 0.05}, guards={"kl_ceiling": 0.1}) == pytest.approx(0.4)
    assert limit(guards={"kl_ceiling": 0.1}, monitors={"kl_per_token_max": 1.0}) == 1.0


def test_win_scores_count_ties_half():
    policy, reference = torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 2.0, 4.0])
    assert win_scores(policy, reference).tolist() == [1.0, 0.0, 0.5, 0.0]
    assert win_scores(reference, reference).mean().item() == 0.5


class ScriptedSampler(Sampler):
    """Fixed responses: the reference's while loaded with the reference's weights, else the policy's."""

    def __init__(self, policy: list[list[int]], reference: list[list[int]]):
        self.policy, self.reference, self.current = policy, reference, policy

    def generate(self, prompts, settings, request_seed):
        return [[Sample(p, r, [0.0] * len(r), True)] for p, r in zip(prompts, self.current)]

    def sync_weights(self, engine) -> None:
        self.current = self.policy

    def loaded_with(self, engine) -> Sampler:
        self.current = self.reference
        return self


def test_the_held_out_evaluation_measures_what_the_monitors_read(process_group, tiny_model_dir):
    """HeldOutEvaluator's length ratio, repeated and distinct bigrams, win rate and KL on scripted
    responses, against values counted by hand."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [Prompt([{"role": "user", "content": f"Question {i}?"}], {}) for i in range(4)]
    reference = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [12, 13]]
    policy = [[5, 6, 5, 6, 5, 6], [9, 9, 9, 9, 9, 9], [14, 15, 16, 17, 18], [12, 13, 12, 13]]
    section = RewardsSection(length=LengthPenalty(target_tokens=4))  # 0 up to 4 tokens, -1 at 8
    scorer = RewardScorer(None, RewardComponents(section, max_new_tokens=8), section)
    evaluator = HeldOutEvaluator(
        prompts, tokenizer, Scorers(scorer, None), SamplingSettings(max_new_tokens=8), 256, (2, 2)
    )
    sampler = ScriptedSampler(policy, reference)
    evaluator.sample_reference(sampler, SimpleNamespace(actor=model, ref=SimpleNamespace(module=model)))
    metrics, rows = evaluator.evaluate(sampler, model, model, sample_rows=2)
    expected = {
        "length_ratio": 21 / 13,  # 6 + 6 + 5 + 4 tokens against 4 + 3 + 4 + 2
        "repeated_ngram_frac": 8 / 17,  # 3 + 4 + 0 + 1 bigrams seen before in their response, of 5 + 5 + 4 + 3
        "distinct_ratio": (9 / 17) / (6 / 9),  # distinct bigrams over all responses: 9 of 17 against 6 of 9
        "reward": -1.25 / 4,  # length penalties -0.5, -0.5, -0.25, 0; the reference's all 0
        "ref_reward": 0.0,
        "win_rate": 0.5 / 4,  # three losses and a tie
        "kl": 0.0,  # the policy is the reference
        "reward_length": 21 / 4,
    }
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert [row["ref_response"] for row in rows] == tokenizer.batch_decode(reference[:2], skip_special_tokens=True)
