"""Reward-hacking monitors on constructed cases, and the win-rate rule."""

from __future__ import annotations

import torch

from engine.ppo.evaluation import win_scores
from engine.ppo.monitors import HackingMonitor, repeated_ngrams

REFERENCE = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]]


def held_out(responses: list[list[int]], win_rate: float, kl_per_token: float = 0.01) -> dict[str, float]:
    """The monitored eval metrics of a set of responses (engine/ppo/evaluation.py computes the same)."""
    repeated, total = map(sum, zip(*(repeated_ngrams(r, 4) for r in responses)))
    length_ratio = sum(map(len, responses)) / sum(map(len, REFERENCE))
    return {
        "length_ratio": length_ratio,
        "repeated_ngram_frac": repeated / total,
        "win_rate": win_rate,
        "kl_per_token": kl_per_token,
    }


def test_repeated_ngrams():
    assert repeated_ngrams([1, 2, 3, 4, 5], 2) == (0, 4)
    assert repeated_ngrams([1, 2, 1, 2, 1, 2], 2) == (3, 5)  # (1,2) x3, (2,1) x2: three repeats
    assert repeated_ngrams([1, 2], 4) == (0, 0)


def test_a_policy_that_only_lengthens_its_answers_is_flagged():
    monitor = HackingMonitor(length_ratio_max=1.5, repeated_ngram_max=0.3, kl_ceiling=None)
    assert monitor.check(held_out(REFERENCE, win_rate=0.5), train_reward=None) == []
    padded = [r + r[-4:] * 4 for r in REFERENCE]  # same answer, then its tail over and over
    flags = dict(monitor.check(held_out(padded, win_rate=0.45), train_reward=1.3))
    assert set(flags) == {"monitor/length_drift", "monitor/repetition"}
    assert "3.29x the reference's length" in flags["monitor/length_drift"]
    # Next evaluation: the training reward keeps rising while the held-out win rate falls.
    flags = dict(monitor.check(held_out(padded, win_rate=0.40), train_reward=1.6))
    assert "monitor/reward_up_win_rate_down" in flags
    assert (
        "rose 1.300 -> 1.600 while the held-out win rate fell 0.450 -> 0.400"
        in flags["monitor/reward_up_win_rate_down"]
    )


def test_kl_ceiling_flag_and_state_round_trip():
    monitor = HackingMonitor(1.5, 0.3, kl_ceiling=0.1)
    assert [k for k, _ in monitor.check(held_out(REFERENCE, 0.6, kl_per_token=0.2), 0.5)] == [
        "monitor/kl_above_ceiling"
    ]
    restored = HackingMonitor(1.5, 0.3, 0.1)
    restored.load_state_dict(monitor.state_dict())
    assert restored == monitor and restored.last_win_rate == 0.6


def test_win_scores_count_ties_half():
    policy, reference = torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 2.0, 4.0])
    assert win_scores(policy, reference).tolist() == [1.0, 0.0, 0.5, 0.0]
    assert win_scores(reference, reference).mean().item() == 0.5
