"""Two ranks, real ZeRO-3: equal micro-step counts, every item once, padded-batch gradients; and
shared-prompt packing (reward-model pairs, PPO groups) against whole sequences under ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from engine.models.loading import load_causal_lm

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed_zero3")
    cmd = [str(REPO / "tests" / "scripts" / "packed_zero3_step.py"), str(tiny_model_dir), str(out)]
    result = run_ranks(cmd, ranks=2)
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line), out


def test_ranks_take_equal_micro_steps_and_every_item_once(two_rank_run):
    report, _ = two_rank_run
    assert report["world"] == 2
    for case, n_items in zip(report["cases"], (7, 3)):
        ranks = case["ranks"]
        assert ranks[0]["micro_steps"] == ranks[1]["micro_steps"]
        items = ranks[0]["items"] + ranks[1]["items"]
        assert sorted(items) == list(range(n_items))
    # The second case (3 x 30 tokens, budget 32) leaves rank 1 a dummy micro-batch.
    second = report["cases"][1]["ranks"]
    assert second[1]["micro_steps"] > len(second[1]["items"])


@pytest.mark.parametrize("case", [0, 1])
def test_zero3_packed_step_equals_padded_full_batch_gradient(two_rank_run, tiny_model_dir, case):
    _, out = two_rank_run
    saved = torch.load(out / f"case{case}.pt", weights_only=True)
    model = load_causal_lm(str(tiny_model_dir))
    model.load_state_dict(saved["before"])
    seqs = saved["sequences"]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
    target_mask = mask[:, 1:].bool()
    (-(lp * target_mask).sum() / target_mask.sum()).backward()
    for name, p in model.named_parameters():
        sgd_delta = saved["before"][name] - saved["after"][name]  # lr 1: the averaged gradient
        torch.testing.assert_close(sgd_delta, p.grad, atol=1e-5, rtol=0, msg=name)


def test_shared_prompts_give_the_whole_sequence_gradient_on_two_ranks_under_zero2_and_zero3(tiny_model_dir, rm_data):
    """Reward-model pairs and PPO groups (actor and critic steps, experience log-probs); the actor
    step under each loss aggregation and DPO's step under each preference loss on two ranks against one
    process's whole-batch gradient."""
    cmd = [
        str(REPO / "tests" / "scripts" / "shared_prompt_steps.py"),
        str(tiny_model_dir),
        str(rm_data / "validation.parquet"),
    ]
    (line,) = [ln for ln in run_ranks(cmd, ranks=2).stdout.splitlines() if ln.startswith("{")]
    report = json.loads(line)
    assert report["world"] == 2 and report["tokens"]["shared"] < 0.7 * report["tokens"]["plain"]
    for stage in ("zero2", "zero3"):
        assert report[stage]["update"] > 1e-2, report  # the step moved the weights
        assert report[stage]["weight_diff"] < 1e-5, report  # by the same gradient
        ppo = report[f"ppo_{stage}"]
        assert ppo["tokens"]["shared"] < 0.8 * ppo["tokens"]["plain"] and ppo["logprob_gap"] < 1e-5, report
        for model in ("actor", "critic"):
            assert ppo[model]["update"] > 1e-3 and ppo[model]["weight_diff"] < 1e-6, report
    # Each loss aggregation: two ranks' packed, micro-batched step = one process's whole-batch gradient.
    for aggregation, step in report["aggregation"].items():
        assert step["grad"] > 1e-3 and step["gap"] < 1e-6, (aggregation, step)
    # Each preference loss (DPO with and without shared prompts, IPO, SimPO): two ranks' packed step =
    # one process's gradient of a padded batch, and its metrics (loss, implicit rewards, accuracy) the naive ones.
    for loss, step in report["dpo"].items():
        assert step["grad"] > 1e-3 and step["gap"] < 1e-5 * step["grad"] and step["metric_gap"] < 1e-5, (loss, step)
        assert loss == "simpo" or 0.2 < step["acc"] < 0.8, (loss, step)  # the noisy reference: some won, some lost
