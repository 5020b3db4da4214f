"""DAPO's dynamic sampling (rollout.dynamic_sampling, engine/ppo/collect.py) on a task where half the
prompts' samples all score the same: those groups are dropped and more prompts drawn until every
optimizer step sees a full batch of groups with signal; the kept share is logged; groups found beyond
the batch wait in the checkpoint, and a resume from it repeats the run. Two ranks, each filling its
own share (a round runs while any rank is short). The rollouts come from HF generate on the actor
(vLLM's own tests are elsewhere)."""

from __future__ import annotations

import json
import shutil
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import assert_repeats, launch, metric_series, ppo_plan_text

from engine.observe.records import read_records
from engine.ppo.collect import Group, fill_batch, has_signal
from engine.rollout.sampler import Sample

REWARD_FUNCTIONS = """
import zlib

def spread(prompt, response, kind):
    # the same for every response of a "same" prompt; a response's own value otherwise
    return 1.0 if kind == "same" else zlib.crc32(response.encode()) % 1000 / 1000

def is_same(prompt, response, kind):
    return float(kind == "same")
"""
ITERATIONS, PROMPTS, SAMPLES = 4, 8, 4


def group(*scores: float) -> Group:
    return Group(0, [Sample([1], [2], [0.0], True)] * len(scores), torch.tensor(scores), {})


def test_a_group_has_signal_when_any_score_differs():
    assert has_signal(torch.tensor([0.0, 1.0, 0.0])) and has_signal(torch.tensor([0.5, 0.5, 0.5 + 1e-6]))
    assert not has_signal(torch.tensor([1.0, 1.0, 1.0])) and not has_signal(torch.tensor([0.0, 0.0]))


def test_the_batch_takes_groups_with_signal_first_then_waits_or_fills():
    kept, dropped = [group(0, 1), group(1, 0), group(0.5, 0)], [group(1, 1), group(0, 0)]
    batch, waiting, filled = fill_batch(kept, dropped, 2)
    assert batch == kept[:2] and waiting == kept[2:] and filled == 0
    batch, waiting, filled = fill_batch(kept[:1], dropped, 2)  # the rounds ran out: a dropped group fills in
    assert batch == [kept[0], dropped[0]] and waiting == [] and filled == 1
    assert fill_batch(kept * 3, [], 2)[1] == (kept * 3)[2:4]  # at most one batch waits


@pytest.fixture(scope="module")
def task(tmp_path_factory, rm_data, tiny_model_dir):
    root = tmp_path_factory.mktemp("dynamic_sampling")
    messages = pq.read_table(rm_data / "prompts_train.parquet").column("prompt").to_pylist()[:64]
    kinds = ["same" if i % 2 else "varied" for i in range(len(messages))]
    pq.write_table(pa.table({"prompt": messages, "kind": kinds}), root / "prompts.parquet")
    (root / "half_uniform.py").write_text(textwrap.dedent(REWARD_FUNCTIONS))
    config = {
        "actor": {"path": str(tiny_model_dir)},
        "data": {"prompts": str(root / "prompts.parquet")},
        "deepspeed": "tiny_cpu_zero3.json",
        "rewards": {
            "functions": {
                "spread": {"function": "half_uniform:spread", "fields": ["kind"]},
                "is_same": {"function": "half_uniform:is_same", "weight": 0.0, "fields": ["kind"]},
            },
            "workers": 1,
        },
        "rollout": {
            "sampler": "hf",
            "prompts_per_iteration": PROMPTS,
            "samples_per_prompt": SAMPLES,
            "max_new_tokens": 12,
            "dynamic_sampling": True,
        },
        "ppo": {"advantage_estimator": "rloo", "mini_batch_size": 16, "kl_coef": 0.05, "rollout_correction": {}},
        "train": {"iterations": ITERATIONS, "seed": 1},
        "optim": {"lr": 5e-4, "warmup_ratio": 0.0, "lr_scheduler": "constant_with_warmup"},
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "logging": {"output_dir": str(root / "run"), "progress_bar": False, "wandb": False},
    }
    (root / "ppo.json").write_text(json.dumps(config))
    return root


def test_the_plan_names_dynamic_sampling(task, capsys):
    assert "; dynamic sampling (up to 4 generation rounds)" in ppo_plan_text(task / "ppo.json", 1, capsys)


def test_every_step_trains_a_full_batch_of_groups_with_signal_and_a_resume_repeats_the_run(task, tmp_path):
    env = {"PYTHONPATH": str(task)}
    launch("train_ppo.py", task / "ppo.json", env=env, ranks=2)
    run = task / "run"
    steps = list(range(1, ITERATIONS + 1))
    # No "same" prompt is trained on (is_same is 0 over the batch); no batch was filled with one.
    assert metric_series(run, "reward/is_same") == dict.fromkeys(steps, 0.0)
    assert metric_series(run, "ppo/filled_groups") == dict.fromkeys(steps, 0.0)
    kept = metric_series(run, "ppo/kept_share")
    assert sorted(kept) == steps and 0.3 < sum(kept.values()) / ITERATIONS < 0.7, kept
    rounds = metric_series(run, "ppo/generation_rounds")
    assert sorted(rounds) == steps and max(rounds.values()) >= 2, rounds  # groups without signal drawn again
    # Every sample drawn scores higher than the batch trained on: the dropped "same" groups score 1.
    score, sampled = metric_series(run, "ppo/score"), metric_series(run, "ppo/sampled_score")
    assert all(sampled[s] > score[s] for s in steps), (sampled, score)
    # RLOO with truncated importance weights (ppo.rollout_correction): the HF sampler is the fp32 actor, so
    # the weights are 1 but for the groups that waited an update (sampled by the previous actor): none wait
    # at step 1.
    tis = metric_series(run, "ppo/is_weight")
    assert abs(tis[1] - 1.0) < 1e-3 and all(0 < w <= 2.0 for w in tis.values()), tis
    assert not any(k.startswith("ppo/vf_") for m in read_records(str(run / "metrics.jsonl")) for k in m)
    # What the step-2 checkpoint holds: the prompt position and the groups found beyond the batch.
    waiting = metric_series(run, "ppo/waiting_groups")
    saved = [
        torch.load(run / "checkpoints" / "step00000002" / f"trainer_state_rank{r}.pt", weights_only=False)["rollout"]
        for r in (0, 1)
    ]
    assert sum(len(rank["waiting"]) for rank in saved) == waiting[2] > 0, waiting
    assert saved[0]["draws"] == saved[1]["draws"] == sum(rounds[s] for s in (1, 2))  # every rank draws in every round

    # A copy resumed from the step-2 checkpoint (the last: the run ends with its export) repeats steps 3 and 4.
    shutil.copytree(run, tmp_path / "run")
    config = json.loads((task / "ppo.json").read_text())
    config["logging"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "ppo.json").write_text(json.dumps(config))
    shutil.rmtree(tmp_path / "run" / "actor")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if json.loads(line)["step"] <= 2))
    resumed = launch("train_ppo.py", tmp_path / "ppo.json", "--resume", env=env, ranks=2)
    assert "resumed at iteration 2" in resumed.stdout
    for key in ("ppo/pg_loss", "ppo/score", "ppo/kept_share", "ppo/sampled_score", "ppo/waiting_groups"):
        assert_repeats(metric_series(tmp_path / "run", key), metric_series(run, key), range(3, ITERATIONS + 1))
