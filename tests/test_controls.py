"""engine/ppo/controls.py: the sampler's log-prob gap stops a colocated run (an async run's own sync check:
tests/test_async_rollout.py)."""

from __future__ import annotations

from unittest.mock import Mock

import pytest

from engine.config import build_config
from engine.ppo.controls import IterationControls, SamplerGapLimit
from engine.ppo.iteration import IterationResult
from engine.rollout.remote import WeightSyncFailed
from engine.run_config import PPOConfig

MINIMAL = {"actor": {"path": "a"}, "reward_model": {"path": "r"}, "data": {"prompts": "p.parquet"}, "deepspeed": {}}


def config(ppo: dict | None = None, **rollout) -> PPOConfig:
    return build_config(
        PPOConfig, MINIMAL | {"rollout": {"samples_per_prompt": 2} | rollout, "ppo": ppo or {}}, source="run.json"
    )


def test_the_gap_limit_holds_where_the_measured_samples_come_from_the_last_sync():
    assert SamplerGapLimit.from_config(config()) == SamplerGapLimit(0.01)  # rollout.sync_check_tolerance
    assert SamplerGapLimit.from_config(config(sync_check_tolerance=0.05)) == SamplerGapLimit(0.05)
    assert SamplerGapLimit.from_config(config(mode="async")) == SamplerGapLimit(None)  # its own sync check
    grpo = {"advantage_estimator": "grpo"}
    assert SamplerGapLimit.from_config(config(grpo, dynamic_sampling=True)) == SamplerGapLimit(0.01)  # fresh ones
    limit = SamplerGapLimit(0.01)
    for gap in (None, 2e-7, 1e-3, 0.01):  # not measured (the sampler's log-probs were the old ones), or within
        limit.check(gap, 3)
    message = r"iteration 3's responses differ from the actor's by 0.12 per token \(rollout.sync_check_tolerance 0.01\)"
    with pytest.raises(WeightSyncFailed, match=message):
        limit.check(0.12, 3)
    with pytest.raises(WeightSyncFailed, match="by nan per token"):
        limit.check(float("nan"), 3)
    SamplerGapLimit(None).check(0.12, 3)


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_a_colocated_run_stops_after_logging_an_iteration_whose_gap_is_above_the_limit(mode):
    """The iteration is logged, then the stop (train_ppo.py: a checkpoint, exit 2) comes before any save
    decision; an async run goes on (its samples are behind the actor by design)."""
    run = Mock(step=4, resume_from=None)
    controls = IterationControls(config(mode=mode), run, Mock(get_lr=lambda: [1e-5]), evaluate=None)
    metrics = {
        "ppo/score": 0.5,
        "ppo/kl": 0.2,
        "ppo/kl_per_token": 0.01,
        "ppo/response_length": 12.0,
        "ppo/distinct_within_prompt": 0.9,
        "timing/iteration_s": 1.0,
    }
    result = IterationResult(kl_per_token=0.01, sampler_logprob_gap=0.12, metrics=metrics)
    if mode == "async":
        controls.end_iteration(result)
        run.end_of_step.assert_called_once()
        return
    with pytest.raises(WeightSyncFailed, match="the sampler's log-probs of iteration 5's responses differ"):
        controls.end_iteration(result)
    run.log.assert_called_once()
    assert run.log.call_args.args[0]["ppo/score"] == 0.5 and run.step == 5
    run.end_of_step.assert_not_called()
