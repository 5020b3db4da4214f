"""Token-budget micro-batch planning: hand cases and hypothesis properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.batching import (
    balanced_bins,
    check_fits,
    first_fit_decreasing,
    plan_global,
    plan_micro_batches,
    prompt_groups,
    split_across_ranks,
    token_mean_scale,
)

lengths_st = st.lists(st.integers(min_value=1, max_value=64), min_size=0, max_size=60)


def loads(bins, lengths):
    return [sum(lengths[i] for i in b) for b in bins]


def test_first_fit_decreasing_by_hand():
    assert first_fit_decreasing([5, 3, 8, 2, 2], 10) == [[2, 3], [0, 1, 4]]  # 8+2 | 5+3+2


def test_too_long_item_is_named():
    with pytest.raises(ValueError, match="item 2 has 70 tokens, more than max_tokens_per_micro_batch=64"):
        check_fits([1, 2, 70], 64)
    with pytest.raises(ValueError, match="item 0 has 9 tokens"):
        plan_micro_batches([9], 8)


def test_requested_count_below_what_is_needed_is_refused():
    with pytest.raises(ValueError, match="at least 2 are needed"):
        plan_micro_batches([6, 6], 10, num_micro_batches=1)


def test_more_micro_batches_than_items_leaves_empty_ones():
    assert sorted(plan_micro_batches([4, 4], 10, num_micro_batches=3), key=len) == [[], [0], [1]]


def test_balanced_bins_falls_back_when_lpt_would_overflow():
    # LPT: 10 | 5 | 4, then 4 -> 4+4, 3 -> 5+3, and the last 3 fits nowhere (8+3 > 10).
    # First-fit-decreasing into the same 3 bins: 10 | 5+4+1 | 4+3+3.
    lengths = [4, 5, 3, 4, 3, 1, 10]
    assert balanced_bins(lengths, 10, 3) == [[6], [0, 1, 5], [2, 3, 4]]


def test_token_mean_scale():
    assert token_mean_scale(10, 2) == 0.2
    with pytest.raises(ValueError):
        token_mean_scale(0, 1)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(min_value=64, max_value=256))
def test_ffd_partitions_within_budget_with_few_bins(lengths, budget):
    bins = first_fit_decreasing(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(load <= budget for load in loads(bins, lengths))
    assert all(b for b in bins)
    # FFD never leaves two bins that could be merged... so at most one bin is half-empty or less:
    assert len(bins) <= max(1, math.ceil(2 * sum(lengths) / budget)) if lengths else bins == []


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(min_value=64, max_value=256), extra=st.integers(0, 4))
def test_plan_with_agreed_count_is_exact(lengths, budget, extra):
    needed = len(plan_micro_batches(lengths, budget))
    plan = plan_micro_batches(lengths, budget, num_micro_batches=needed + extra)
    assert len(plan) == needed + extra
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(load <= budget for load in loads(plan, lengths))
    assert all(b == sorted(b) for b in plan)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 4), budget=st.integers(min_value=64, max_value=200))
def test_global_plan_every_item_once_and_equal_micro_steps(lengths, world, budget):
    plan = plan_global(lengths, budget, world)
    assert len(plan) == world
    assert len({len(rank_plan) for rank_plan in plan}) == 1  # same number of micro-steps on every rank
    seen = sorted(i for rank_plan in plan for b in rank_plan for i in b)
    assert seen == list(range(len(lengths)))
    assert all(load <= budget for rank_plan in plan for load in loads(rank_plan, lengths))
    assert plan == plan_global(lengths, budget, world)  # deterministic: ranks agree without talking


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60), world=st.integers(1, 4))
def test_rank_shares_are_balanced(lengths, world):
    shares = split_across_ranks(lengths, world)
    share_loads = loads(shares, lengths)
    # LPT: the spread between ranks is at most the longest item.
    assert max(share_loads) - min(share_loads) <= max(lengths)


def test_prompt_groups_share_equal_prompts_and_split_to_fit():
    a, b = [1, 2, 3], [7, 8]
    sequences = [a + [4, 5], b + [9], a + [6], a + [4], [1, 2] + [3, 3]]  # the last: another prompt, [1, 2]
    groups = prompt_groups(sequences, [3, 2, 3, 3, 2], max_tokens=100)
    assert groups == [(3, [0, 2, 3]), (2, [1]), (2, [4])]  # by first appearance, whatever the order
    # a group over the budget splits, each part holding the prompt: 3 + 2 + 1 = 6 fits, + 1 would not
    assert prompt_groups(sequences, [3, 2, 3, 3, 2], max_tokens=6) == [(3, [0, 2]), (3, [3]), (2, [1]), (2, [4])]
    # every member keeps a token of its own: an empty response cuts the shared prompt
    assert prompt_groups([a + [4], a], [3, 3], max_tokens=100) == [(2, [0, 1])]
