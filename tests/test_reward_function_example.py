"""docs/rewards.md's reward-function example works as written: its module and its config, in a run
config as the trainer loads it, through the trainer's own start (every function imported and its
signature checked in a reward worker before any model loads) and the reward worker pool scoring
responses with their rows' ground truth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_readme import fenced_blocks

from engine.config import load_config
from engine.ppo.inputs import started_components
from engine.ppo.rewards import RewardScorer, SampledResponses
from engine.rollout.sampler import Sample
from engine.run.launch import RunRefused
from engine.run_config import PPOConfig

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "rewards.md"
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 7 + 5?"}]


@pytest.fixture
def documented(tmp_path, monkeypatch) -> dict:
    """The page's my_rewards.py in the working directory (where the reward workers find it); its
    documented ``rewards`` section."""
    module = [b for b in fenced_blocks(PAGE, "python") if b.startswith("# my_rewards.py\n")]
    config = [b for b in fenced_blocks(PAGE, "text") if '"my_rewards:' in b]
    assert len(module) == 1 and len(config) == 1, "docs/rewards.md: one my_rewards.py block and one config"
    (tmp_path / "my_rewards.py").write_text(module[0])
    monkeypatch.chdir(tmp_path)
    return json.loads("{" + config[0] + "}")["rewards"]


def run_config(rewards: dict) -> PPOConfig:
    """ds_configs/arithmetic_grpo.json with ``rewards`` as its section, loaded from run.json."""
    data = json.loads((REPO / "ds_configs" / "arithmetic_grpo.json").read_text())
    Path("run.json").write_text(json.dumps(data | {"rewards": rewards}))
    return load_config(PPOConfig, "run.json")


def test_the_documented_functions_score_responses_in_the_worker_pool(documented, process_group):
    cfg = run_config(documented)
    components = started_components(cfg, cfg.rewards)  # the trainer's check before any model loads
    assert components is not None
    scorer = RewardScorer(None, components, cfg.rewards)
    try:
        responses = {
            "7 + 5 = 12\n#### 12": (1.0, 0.0),
            "7 + 5 = 13\n#### 13": (0.0, 0.0),
            "It is twelve.": (0.0, 0.0),  # no number
            "1,000 - 988 = 12": (1.0, 0.0),
            "7 + 5 = 12 " + "so " * 24 + "#### 12": (1.0, -0.55),  # 31 words, 20 allowed
            "12 " * 40: (1.0, -1.0),
            "#### 12 ": (0.0, 0.0),  # its row's answer is not a number: the call raises, the fallback
        }
        answers = ["12"] * 6 + ["twelve"]
        samples = [Sample([1, 2], [3] * 4, [0.0] * 4, True) for _ in responses]
        rows = [{"answer": a} for a in answers]
        total, parts = scorer.score(SampledResponses([QUESTION] * len(rows), samples, list(responses), rows))
        expected = torch.tensor(list(responses.values()))
        assert torch.allclose(parts["reward/correct"], expected[:, 0])
        assert torch.allclose(parts["reward/concise"], expected[:, 1])
        assert torch.allclose(total, expected[:, 0] + 0.2 * expected[:, 1])  # the documented weights
        assert parts["reward/correct/errors"][0] == pytest.approx(1 / 7)
        assert parts["reward/concise/errors"][0] == 0 and parts["reward/correct/timeouts"][0] == 0
    finally:
        scorer.close()


def test_a_function_without_a_configured_field_is_refused_before_any_model_loads(documented):
    documented["functions"]["concise"]["fields"] = ["answer"]
    cfg = run_config(documented)
    with pytest.raises(RunRefused) as refused:
        started_components(cfg, cfg.rewards)
    assert f"{refused.value.kind} error: {refused.value}" == (
        "config error: run.json: 'rewards.functions.concise.function': TypeError: my_rewards:concise cannot be "
        "called as f(prompt, response, answer): got an unexpected keyword argument 'answer'"
    )
    assert f"config error: {refused.value}" in " ".join(PAGE.read_text().split())
