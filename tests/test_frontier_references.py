"""The frontier benchmark's references (bench/frontier_references.py): best-of-n's order-statistic
weights and KL, and the KL-regularised optimum's importance weights, on small known cases."""

from __future__ import annotations

import math
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from frontier_references import best_of_n_kl, best_of_n_point, best_of_n_weights, tilted_point


@pytest.mark.parametrize("m,n", [(8, 1), (8, 3), (8, 8), (128, 16)])
def test_best_of_n_weights_are_the_max_of_a_random_subset(m, n):
    w = best_of_n_weights(m, n)
    assert w.sum().item() == pytest.approx(1.0)
    if n == 1:
        assert torch.allclose(w, torch.full((m,), 1 / m, dtype=torch.float64))  # best of one: any sample
    if n == m:
        assert w[-1].item() == pytest.approx(1.0)  # best of all: the top one
    # by enumeration for a small case: the i-th lowest is the max of C(i, n-1) subsets
    if m == 8 and n == 3:
        counts = torch.zeros(m, dtype=torch.float64)
        for subset in combinations(range(m), n):
            counts[max(subset)] += 1
        assert torch.allclose(w, counts / counts.sum())


def test_best_of_n_point_ranks_by_the_reward_model_and_scores_by_the_rule():
    rm = torch.tensor([[0.1, 0.9, 0.5, 0.3]])  # the reward model likes sample 1 best
    true = torch.tensor([[1.0, -2.0, 3.0, 0.0]])  # the rule disagrees
    length = torch.tensor([[4, 8, 6, 2]])
    top = best_of_n_point(rm, true, length, 4)
    assert top["score"] == pytest.approx(-2.0) and top["response_tokens"] == pytest.approx(8.0)
    assert top["kl_per_token"] == pytest.approx((math.log(4) - 3 / 4) / 8)
    assert best_of_n_point(rm, true, length, 1)["score"] == pytest.approx(0.5)  # the mean: no selection, KL 0
    assert best_of_n_kl(1) == 0.0


def test_the_kl_regularised_optimum_moves_from_the_samples_mean_to_the_reward_models_favourite():
    rm = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    true = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    length = torch.ones(1, 4, dtype=torch.long)
    far = tilted_point(rm, true, length, 1e4)  # a large coefficient keeps the SFT model
    assert far["score"] == pytest.approx(1.5, abs=1e-3) and far["kl_per_token"] == pytest.approx(0.0, abs=1e-6)
    near = tilted_point(rm, true, length, 1e-3)  # a tiny one takes the top sample: KL log M
    assert near["score"] == pytest.approx(3.0) and near["kl_per_token"] == pytest.approx(math.log(4))
    mid = tilted_point(rm, true, length, 1.0)  # between, with weights ~ exp(r)
    w = torch.softmax(rm[0].double(), 0)
    assert mid["score"] == pytest.approx(float((w * true[0]).sum()))
    assert mid["kl_per_token"] == pytest.approx(float((w * (4 * w).log()).sum()))
    assert 1 < mid["effective_samples"] < 4
