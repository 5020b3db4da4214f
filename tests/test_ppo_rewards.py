"""The PPO score: reward-model components, normalisation, rules, no-EOS penalty, clipping."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from engine.models.loading import load_value_model
from engine.ppo.rewards import RewardScorer, load_rule


def shouting_rule(prompt: list[dict[str, str]], response: str) -> float:
    """A rule for the test: 1 when the response ends with '!'."""
    return float(response.endswith("!"))


def test_load_rule():
    assert load_rule("test_ppo_rewards:shouting_rule")([], "yes!") == 1.0
    with pytest.raises(ValueError, match="module:function"):
        load_rule("no_colon")


def test_scorer_combines_rm_rules_and_penalties(process_group, rm_run):
    root, _ = rm_run
    model_dir = str(root / "run" / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rm = load_value_model(model_dir).eval()
    stats = json.loads((root / "run" / "model" / "reward_stats.json").read_text())
    prompts = [[{"role": "user", "content": "Tell me about the garden in Alder."}]] * 3
    responses = ["The garden is lovely and calm!", "Awful rude garden.", "The garden is lovely and calm!"]
    finished = [True, True, False]

    plain = RewardScorer(rm, tok, model_dir, normalize=False, clip=100.0, rules={}, no_eos_penalty=0.0, max_tokens=512)
    raw, parts = plain.score(prompts, responses, finished)
    # The total is the weighted sum of the component heads, with the weights saved by train_rm.py.
    weights = torch.tensor([stats["weights"]["helpful"], stats["weights"]["harmless"]])
    torch.testing.assert_close(raw, torch.stack([parts["rm_helpful"], parts["rm_harmless"]], -1) @ weights)
    assert raw[0] > raw[1]  # the trained RM prefers the kind answer
    torch.testing.assert_close(
        raw[0], raw[2], atol=1e-5, rtol=0
    )  # finishing does not matter without a penalty (shared prompt: float order)

    full = RewardScorer(
        rm,
        tok,
        model_dir,
        normalize=True,
        clip=100.0,
        rules={"test_ppo_rewards:shouting_rule": 0.5},
        no_eos_penalty=-1.0,
        max_tokens=512,
    )
    score, parts = full.score(prompts, responses, finished)
    expected = (
        (raw - stats["mean"]) / stats["std"] + 0.5 * torch.tensor([1.0, 0.0, 1.0]) + torch.tensor([0.0, 0.0, -1.0])
    )
    torch.testing.assert_close(score, expected, atol=1e-5, rtol=0)
    assert parts["rule_test_ppo_rewards:shouting_rule"].tolist() == [1.0, 0.0, 1.0]

    clipped = RewardScorer(rm, tok, model_dir, normalize=True, clip=0.1, rules={}, no_eos_penalty=0.0, max_tokens=512)
    assert clipped.score(prompts, responses, finished)[0].abs().max() <= 0.1 + 1e-6
