"""Reward-model loss terms against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engine.rm.losses import bradley_terry_loss, centering_loss, pair_losses, weighted_total


def test_bradley_terry_by_hand():
    r_c, r_r = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    want = [math.log(1 + math.exp(-2.0)), math.log(2.0), math.log(1 + math.exp(2.0))]
    torch.testing.assert_close(bradley_terry_loss(r_c, r_r), torch.tensor(want), atol=1e-6, rtol=0)


def test_margin_is_subtracted_inside_the_sigmoid():
    # diff 2, margin 2 -> -log sigmoid(0) = log 2; margin 0 leaves the plain loss
    loss = bradley_terry_loss(torch.tensor([3.0, 3.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([math.log(2.0), math.log(1 + math.exp(-2.0))]), atol=1e-6, rtol=0)


def test_centering():
    torch.testing.assert_close(
        centering_loss(torch.tensor([1.0, -2.0]), torch.tensor([2.0, 2.0])), torch.tensor([9.0, 0.0])
    )


def test_weighted_total():
    assert weighted_total(torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([0.6, 0.3, 0.1])).item() == pytest.approx(
        1.6, abs=1e-6
    )


def test_decomposition_with_partial_labels_by_hand():
    # Two components (helpful, harmless), weights 0.6 / 0.4, three pairs:
    #   pair 0 labelled helpful +1, harmless -1 (rejected is more harmless)
    #   pair 1 labelled helpful only
    #   pair 2 unlabelled (trains only the total)
    r_c = torch.tensor([[1.0, 0.5], [0.0, 2.0], [3.0, -1.0]])
    r_r = torch.tensor([[0.0, 1.5], [1.0, 0.0], [0.0, 0.0]])
    labels = torch.tensor([[1, -1], [1, 0], [0, 0]])
    margin = torch.tensor([0.0, 0.5, 0.0])
    out = pair_losses(r_c, r_r, torch.tensor([0.6, 0.4]), margin, labels)

    softplus = lambda x: math.log(1 + math.exp(x))  # -log sigmoid(d) = softplus(-d)
    totals_c = [0.6 * 1.0 + 0.4 * 0.5, 0.6 * 0.0 + 0.4 * 2.0, 0.6 * 3.0 - 0.4]
    totals_r = [0.6 * 0.0 + 0.4 * 1.5, 0.6 * 1.0, 0.0]
    want_total = [softplus(-(c - r - m)) for c, r, m in zip(totals_c, totals_r, [0.0, 0.5, 0.0])]
    torch.testing.assert_close(out.total, torch.tensor(want_total), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        out.center, torch.tensor([(c + r) ** 2 for c, r in zip(totals_c, totals_r)]), atol=1e-6, rtol=0
    )
    want_component = [
        [softplus(-(1.0 - 0.0)), softplus(-(1.5 - 0.5))],  # harmless: oriented towards the rejected response
        [softplus(-(0.0 - 1.0)), 0.0],
        [0.0, 0.0],
    ]
    torch.testing.assert_close(out.component, torch.tensor(want_component), atol=1e-6, rtol=0)
