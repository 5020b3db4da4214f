"""rollout.mode async end to end: one training rank and two generating ranks (one vLLM engine, tensor
parallel over them) under the launcher."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
from helpers import assert_repeats, faults, free_port, launch, metric_series, read_events, write_ppo_config
from pydantic import ValidationError

from engine.config import ConfigError, load_config
from engine.models.deepspeed_glue import training_ds_config
from engine.ppo.inputs import load_fitting_prompts
from engine.rollout.remote import (
    RemoteGeneration,
    RemoteSampler,
    RolloutLink,
    WeightSyncFailed,
    as_bytes,
    meta,
    unpack,
)
from engine.rollout.sampler import Sample
from engine.run.distributed import SplitWorld
from engine.run.dry_run import ppo_plan
from engine.run.preflight import load_tokenizer
from engine.run_config import PPOConfig
from engine.run_config.rollout import RolloutSection

DETERMINISTIC = ("ppo/score", "ppo/kl", "ppo/pg_loss", "ppo/vf_loss", "ppo/response_length", "eval/reward")
ITERATIONS = 3


def async_config(root, tiny_model_dir, rm_run, rm_data, name: str, **overrides):
    return write_ppo_config(
        root / f"{name}.json",
        tiny_model_dir,
        rm_run[0] / "run" / "model",
        rm_data,
        root / name,
        train__iterations=ITERATIONS,
        train__eval_every=ITERATIONS,
        **overrides,
    )


@pytest.fixture(scope="module")
def stale_run(tiny_model_dir, rm_run, rm_data, tmp_path_factory):
    """Iteration t's batch generated with the weights after t - 1 (max_staleness 1) by a vLLM engine
    tensor parallel over 2 ranks, a sequence-level importance mask, a sync check and a checkpoint every iteration."""
    root = tmp_path_factory.mktemp("ppo_async")
    stale = {
        "rollout__mode": "async",
        "rollout__max_staleness": 1,
        "ppo__rollout_correction": {"level": "sequence", "mode": "mask"},
        "checkpoint__every_steps": 1,
        "rollout__sync_check_every": 1,
        "rollout__tensor_parallel_size": 2,
    }
    config = async_config(root, tiny_model_dir, rm_run, rm_data, "run", **stale)
    return root, config, launch("train_ppo.py", config, ranks=3)


def test_one_version_behind_trains_evaluates_and_exports(stale_run):
    root, _, result = stale_run
    run = root / "run"
    assert "1 rank(s), sampler vllm on 2 rank(s) of its own (async, max_staleness 1)" in result.stdout
    assert metric_series(run, "ppo/staleness") == {1: 0, 2: 1, 3: 1}  # the first batch: the starting weights
    gap = metric_series(run, "ppo/sampler_logprob_gap")
    assert gap[1] < 1e-5 < gap[2]  # the sampler is the actor before the first update, one update behind after
    masked = metric_series(run, "ppo/is_masked_share")  # no ratio is off before the first update
    assert sorted(masked) == [1, 2, 3] and masked[1] == 0 and all(0 <= v <= 1 for v in masked.values()), masked
    checked = metric_series(run, "ppo/sync_check_gap")  # vLLM re-scored iteration t's sequences, compared at t + 1
    assert list(checked) == [2, 3] and all(v < 1e-5 for v in checked.values()), checked
    waited, took = metric_series(run, "timing/rollout_wait_s"), metric_series(run, "timing/iteration_s")
    assert list(waited) == [1, 2, 3] and all(0 < waited[s] < took[s] for s in waited), (waited, took)
    assert set(metric_series(run, "eval/reward")) == {0, ITERATIONS}
    assert not read_events(run)
    assert (run / "actor" / "model.safetensors").exists()
    state = torch.load(run / "checkpoints" / "step00000002" / "trainer_state_rank0.pt", weights_only=False)
    asked = state["rollout"]["asked"]  # the batch generated ahead, kept for a resume
    assert [(a["draw"], a["asked_at"]) for a in asked] == [(2, 1)]


def test_a_resume_after_the_generating_rank_is_killed_repeats_the_run(stale_run, tmp_path):
    """SIGKILL of the generating ranks at their 7th generation (3 held-out ones, then the batches of
    iterations 1 and 2, then 3 asked at iteration 2): the launcher stops the trainer; --resume
    continues from the last checkpoint with the batch it carried, and every metric repeats."""
    root, config, _ = stale_run
    spec = json.loads(config.read_text())
    spec["logging"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "run.json").write_text(json.dumps(spec))
    killed = launch("train_ppo.py", tmp_path / "run.json", ranks=3, env=faults(kill_generating_rank_at=7), check=False)
    assert killed.returncode != 0
    assert not (tmp_path / "run" / "actor").exists()
    resumed = launch("train_ppo.py", tmp_path / "run.json", "--resume", ranks=3)
    assert "resumed at iteration" in resumed.stdout
    for key in DETERMINISTIC:
        assert_repeats(metric_series(tmp_path / "run", key), metric_series(root / "run", key), what=key)


def test_the_plan_and_the_rules_of_the_split(stale_run, capsys):
    _, config, _ = stale_run
    cfg = load_config(PPOConfig, str(config))
    tokenizer = load_tokenizer(cfg.actor.path, "actor.path")
    prompts = load_fitting_prompts(cfg.data.prompts, tokenizer, cfg, 0)
    assert ppo_plan(cfg, prompts, [], tokenizer, training_ds_config(cfg.deepspeed, False), 3) == 0
    plan = capsys.readouterr().out
    assert "(3 rank(s): 1 training, 2 generating (rollout.mode async))" in plan
    assert "actor                541,568 parameters (trained): ZeRO-3, 1 rank(s)" in plan
    assert "vLLM sampler: 1 engine of tensor parallel size 2 on the generating rank(s), none on the training" in plan
    assert "per generating rank: " in plan
    assert "; sequence importance weights pi_actor / pi_sampler masked outside [0.5, 2]; " in plan
    with pytest.raises(ConfigError, match=r"needs more than rollout.tensor_parallel_size \(2\) ranks"):
        cfg.check_world_size(2)
    for bad, match in (
        ({"dynamic_sampling": True}, "no dynamic_sampling"),
        ({"sampler": "hf"}, "needs sampler vllm"),
    ):
        with pytest.raises(ValidationError, match=match):
            RolloutSection(mode="async", **bad)


def test_a_corrupted_weight_transfer_is_named_before_vllm_loads_it():
    weights = [("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4)), ("model.norm.weight", torch.ones(4))]
    metas = [meta(name, t) for name, t in weights]
    flat = torch.cat([as_bytes(t) for _, t in weights])
    for (name, t), (got_name, got) in zip(weights, unpack(flat.clone(), metas)):
        assert got_name == name and torch.equal(got, t)
    flat[10] ^= 1  # one bit in the first tensor
    with pytest.raises(WeightSyncFailed, match=r"model.layers.0.mlp.up_proj.weight \[6, 4\]"):
        unpack(flat, metas)


def test_a_failed_load_is_raised_once_and_the_answers_behind_it_stay_readable():
    """The trainer's side of the channel on a real store (loopback): the generating rank's answers to a
    weight load that failed its CRC check and to the generation after it."""
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    link = RolloutLink(SplitWorld(store, rank=1, world=3, trainers=2))  # a training rank that sends no weights
    sampler = RemoteSampler(link, trainer_rank=1, check_every=1, tolerance=0.01)
    sampler.sent = 2
    samples = [[Sample([1, 2], [3], [-0.5], True)]]
    link.put("resp/1/0", {"kind": "weights", "error": "weight load 1, bucket 0: model.norm.weight [4]: ..."})
    link.put("resp/1/1", {"kind": "generate", "samples": samples, "generate_s": 0.1})
    generation = RemoteGeneration(sampler, 1)
    with pytest.raises(WeightSyncFailed, match=r"model\.norm\.weight"):
        generation.result()
    assert generation.result() == (samples, 0.1)  # the checkpoint after the failure still reads it


def test_each_generating_rank_reads_a_request_and_the_last_removes_it():
    """Tensor-parallel generating ranks each read every request from the store (no collective, so none
    times out while the trainers train); the last reader removes it. Two readers on a loopback store."""
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    link = RolloutLink(SplitWorld(store, rank=1, world=4, trainers=2))  # a training rank: no weights group
    assert link.generating == 2
    link.put("req/0/5", {"kind": "stop"})
    assert link.take_shared("req/0/5") == {"kind": "stop"}  # the first generating rank's read
    assert store.check(["req/0/5"])
    assert link.take_shared("req/0/5") == {"kind": "stop"}  # the second's, which removes it
    assert not store.check(["req/0/5"]) and not store.check(["req/0/5/read"])
