"""The PPO score: reward-model heads and normalisation, reward components run in the worker pool
(verifiers, functions with fallbacks, timeouts and the failure share), penalties, clipping."""

from __future__ import annotations

import json
import textwrap
import time

import numpy as np
import pytest
import torch
from math_verify import parse, verify
from transformers import AutoTokenizer

from engine.models.loading import load_value_model
from engine.ppo.inputs import code_sandbox
from engine.ppo.rewards import RewardModelScorer, RewardScorer, SampledResponses
from engine.rewards.components import RewardComponents, RewardsConfigError, RewardsUnavailable
from engine.rewards.pool import Call, RewardPool
from engine.rewards.sandbox import describe_isolation, isolation
from engine.rewards.verifiers import final_answer, length_penalty, math_reward
from engine.rollout.sampler import Sample
from engine.run_config.rewards import RewardModelSection, RewardsSection

USER_FUNCTIONS = """
import os, time

def shouting(prompt, response, answer):
    return float(response.endswith("!")) + 0 * len(answer)

def picky(prompt, response):
    if "rude" in response.lower():
        raise ValueError("I do not score rude answers")
    return 0.25

def slow(prompt, response):
    time.sleep(30 if "Awful" in response else 0)
    return 1.0

def dies(prompt, response):
    os._exit(7)

def nap(prompt, response):
    time.sleep(0.05)
    return 1.0

def echo(prompt, response):
    return response
"""


@pytest.fixture
def user_functions(tmp_path, monkeypatch):
    """A module of reward functions in the working directory, where the reward workers find it."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_FUNCTIONS))
    monkeypatch.chdir(tmp_path)
    return "my_rewards"


def test_verifiers():
    assert final_answer("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "3"
    assert final_answer("first #### 41\nthen #### 42 ") == "42" and final_answer("no answer") is None
    assert final_answer("Answer: 7.", pattern=r"Answer: (\d+)") == "7"
    assert [math_reward(r, "1/2") for r in ("#### 0.5", "\\boxed{\\frac12}", "#### 2", "0.5")] == [1.0, 1.0, 0.0, 0.0]
    assert math_reward("#### 1,000", 1000) == 1.0 and math_reward("#### abc", 3) == 0.0
    for guess, gold in [("042", 42), ("-0", "0"), ("41", 42), ("7", " 7"), ("-12", 12), ("7.0", 7)]:  # as math-verify
        assert math_reward(f"#### {guess}", gold) == float(verify(parse(f"${gold}$"), parse(f"${guess}$")))
    assert [length_penalty(n, 20, 60) for n in (5, 20, 40, 60, 99)] == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_pool_isolates_each_failing_call(user_functions):
    pool = RewardPool(2)
    try:
        assert pool.check(f"{user_functions}:shouting", 2, ["answer"]) is None
        assert "unexpected keyword argument 'answer'" in pool.check(f"{user_functions}:picky", 2, ["answer"])
        assert "No module named 'nowhere'" in pool.check("nowhere:f", 2, [])
        assert "has no function 'nothing'" in pool.check(f"{user_functions}:nothing", 2, [])
        long_reply = "0123456789" * 30_000
        calls = [
            Call(f"{user_functions}:picky", [[], "Rude!"]),
            Call(f"{user_functions}:slow", [[], "Awful"], timeout_s=0.5),
            Call(f"{user_functions}:dies", [[], "x"]),
            *[Call(f"{user_functions}:shouting", [[], r], {"answer": "1"}) for r in ("yes!", "no", "again!", "x")],
            Call(f"{user_functions}:echo", [[], long_reply], structured=True),  # a reply of several pipe reads
        ]
        start = time.monotonic()
        outcomes = pool.run(calls)
        assert time.monotonic() - start < 5  # the sleeper was killed at its timeout, not waited for
        assert outcomes[0].value is None and "I do not score rude answers" in outcomes[0].error
        assert outcomes[1].value is None and outcomes[1].timed_out
        assert outcomes[2].value is None and "exit code 7" in outcomes[2].error
        assert [o.value for o in outcomes[3:7]] == [1.0, 0.0, 1.0, 0.0]  # the replaced workers go on
        assert outcomes[7].value == long_reply
    finally:
        pool.close()


def test_workers_import_modules_before_the_first_call_and_a_hanging_import_is_refused(user_functions, tmp_path):
    (tmp_path / "stamped.py").write_text(
        "import time\nIMPORTED_AT = time.time()\n\n\ndef stamp(p, r):\n    return IMPORTED_AT\n"
    )
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "broken.py").write_text("raise ImportError('no licence for this reward')\n")
    pool = RewardPool(2, ["stamped", user_functions])
    try:
        assert pool.warm_up() is None
        before = time.time()
        assert all(o.value < before for o in pool.run([Call("stamped:stamp", [[], "x"])] * 2))  # not in the call
    finally:
        pool.close()

    def first_failure(imports: list[str], check: str = "") -> object:
        pool = RewardPool(1, imports, import_timeout_s=1)
        try:
            return pool.check(check, 2, []) if check else pool.warm_up()
        finally:
            pool.close()

    assert first_failure(["broken"]) == ("broken", "ImportError: no licence for this reward")
    start = time.monotonic()
    assert first_failure([user_functions, "sleepy"]) == ("sleepy", "not imported within 1 s")
    took = "the reward worker died or took more than 1 s importing it"
    assert first_failure([], check="sleepy:f") == took  # no warm-up: the check itself is bounded
    section = RewardsSection.model_validate({"functions": {"nap": {"function": "sleepy:f"}}, "import_timeout_s": 1})
    components = RewardComponents(section, max_new_tokens=16)
    with pytest.raises(RewardsConfigError, match=r"'rewards.functions.nap.function': .* sleepy: not imported within"):
        components.check()
    components.close()
    assert time.monotonic() - start < 10  # three hangs of 1 s, none waited for to its end


def test_scorer_combines_rm_components_and_penalties(process_group, rm_run, user_functions):
    root, _ = rm_run
    model_dir = str(root / "run" / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rm = load_value_model(model_dir).eval()
    stats = json.loads((root / "run" / "model" / "reward_stats.json").read_text())
    prompts = [[{"role": "user", "content": "Tell me about the garden in Alder."}]] * 4
    responses = ["The garden is lovely and calm!", "Awful rude garden. #### 3", "The garden is lovely and calm!"]
    responses.append("```python\ndef f(x):\n    return x * x\n```")
    finished, tokens = [True, True, False, True], [6, 12, 6, 9]
    fields = [{"answer": "3", "tests": ["assert f(2) == 4", "assert f(3) == 9", "assert f(1) == 2"]}] * 4
    # Scorers without the policy's tokenizer read the texts; the samples carry the lengths and whether each finished.
    batch = SampledResponses(prompts, [Sample([], [0] * n, [], f) for n, f in zip(tokens, finished)], responses, fields)

    raw_rm = RewardModelScorer(rm, tok, RewardModelSection(path=model_dir, normalize=False), 512)
    raw, parts = RewardScorer(raw_rm, None, RewardsSection(clip=100.0)).score(batch)
    # The RM's total is the weighted sum of its heads, with the weights saved by train_rm.py.
    weights = torch.tensor([stats["weights"]["helpful"], stats["weights"]["harmless"]])
    torch.testing.assert_close(
        raw, torch.stack([parts["reward/rm_helpful"], parts["reward/rm_harmless"]], -1) @ weights
    )
    assert raw[0] > raw[1]  # the trained RM prefers the kind answer
    torch.testing.assert_close(raw[0], raw[2], atol=1e-5, rtol=0)  # finishing does not matter without a penalty
    raw_all = raw
    # length_debias: the RM's term loses its least-squares slope on the sampled lengths (numpy's fit).
    debias_rm = RewardModelScorer(rm, tok, RewardModelSection(path=model_dir, normalize=False, length_debias=True), 512)
    debiased, parts = RewardScorer(debias_rm, None, RewardsSection(clip=100.0)).score(batch)
    slope = float(np.polyfit(tokens, raw.double().numpy(), 1)[0])
    assert parts["reward/rm_length_slope"].tolist() == pytest.approx([slope] * 4)
    torch.testing.assert_close(debiased, raw - slope * (torch.tensor(tokens) - np.mean(tokens)), atol=1e-5, rtol=0)
    assert abs(np.polyfit(tokens, debiased.double().numpy(), 1)[0]) < 1e-5 and abs(slope) > 1e-3

    rewards = RewardsSection.model_validate(
        {
            "math": {"weight": 2.0},
            "code": {"weight": 3.0, "wall_s": 20},
            "format": {"pattern": "!$", "weight": 0.5},
            "length": {"target_tokens": 8, "weight": 1.0},
            "functions": {
                "shout": {"function": f"{user_functions}:shouting", "weight": 0.5, "fields": ["answer"]},
                "picky": {"function": f"{user_functions}:picky", "weight": 1.0, "fallback": -2.0},
                "slow": {"function": f"{user_functions}:slow", "weight": 0.0, "timeout_s": 1.0, "fallback": 0.5},
            },
            "max_failure_share": 0.5,
            "no_eos_penalty": -1.0,
            "clip": 100.0,
        }
    )
    components = RewardComponents(rewards, max_new_tokens=16)
    components.check()
    assert code_sandbox([components, None]) == [
        describe_isolation(isolation())
    ]  # the mode the check probed: plan and log
    rm_half = RewardModelScorer(rm, tok, RewardModelSection(path=model_dir, weight=0.5), 512)
    scorer = RewardScorer(rm_half, components, rewards)
    try:
        score, parts = scorer.score(batch)
        expected = {
            "reward/math": [0.0, 1.0, 0.0, 0.0],
            "reward/code": [0.0, 0.0, 0.0, 2 / 3],  # the code passes two of the row's three tests
            "reward/format": [1.0, 0.0, 1.0, 0.0],
            "reward/length": [0.0, -0.5, 0.0, -0.125],
            "reward/shout": [1.0, 0.0, 1.0, 0.0],
            "reward/picky": [0.25, -2.0, 0.25, 0.25],  # raised on the rude answer: its fallback
            "reward/slow": [1.0, 0.5, 1.0, 1.0],  # timed out on it: its fallback
            "reward/picky/errors": [1 / 4] * 4,
            "reward/slow/timeouts": [1 / 4] * 4,
            "reward/math/errors": [0.0] * 4,
            "reward/code/errors": [0.0] * 4,
        }
        for key, values in expected.items():
            assert parts[key].tolist() == pytest.approx(values), key
        want = (
            0.5 * (raw_all - stats["mean"]) / stats["std"]
            + 2.0 * parts["reward/math"]
            + 3.0 * parts["reward/code"]
            + 0.5 * parts["reward/format"]
            + parts["reward/length"]
            + 0.5 * parts["reward/shout"]
            + parts["reward/picky"]
            + torch.tensor([0.0, 0.0, -1.0, 0.0])  # the unfinished response
        )
        torch.testing.assert_close(score, want, atol=1e-5, rtol=0)

        # More failures than rewards.max_failure_share: the run must stop, naming the function and its error.
        scorer.rewards = rewards.model_copy(update={"max_failure_share": 0.2})
        with pytest.raises(RewardsUnavailable, match=r"(?s)'picky' failed on 25% .*I do not score rude answers"):
            scorer.score(batch)
        clipped = RewardScorer(rm_half, None, RewardsSection(clip=0.1)).score(batch)[0]
        unclipped = 0.5 * (raw_all - stats["mean"]) / stats["std"]
        assert (unclipped.abs() > 0.1).any()  # the clip cuts
        torch.testing.assert_close(clipped, unclipped.clamp(-0.1, 0.1), atol=1e-5, rtol=0)
        # A critic that kept the reward model's head starts as its term of the reward: standardised and weighted.
        heads = torch.stack([parts["reward/rm_helpful"], parts["reward/rm_harmless"]], -1)
        torch.testing.assert_close(rm_half.readout()(heads), unclipped, atol=1e-5, rtol=0)
    finally:
        scorer.close()


def test_every_rank_stops_with_the_reason_of_the_rank_whose_server_call_failed(process_group, monkeypatch):
    """Fake ranks: this rank scored its batch, another's reward server call failed; this rank raises
    the other's reason (what rank 0 prints), not a reason of its own."""
    rewards = RewardsSection.model_validate({"length": {"target_tokens": 8}})
    scorer = RewardScorer(None, RewardComponents(rewards, max_new_tokens=16), rewards)
    batch = SampledResponses([[{"role": "user", "content": "Hi."}]], [Sample([], [0] * 4, [], True)], ["Hello."], [{}])
    theirs = "the reward server at http://10.0.0.2:8000 answered without 1 scores of component(s) ['math']"

    def their_counts_too(t, **kwargs):  # (server down, failures per component, responses)
        t += torch.tensor([1.0, 0.0, 1.0], dtype=t.dtype)

    def their_reason_too(everyone, mine, **kwargs):  # rank 0's (this one's: none), then theirs
        everyone[:] = [mine, theirs]

    monkeypatch.setattr(torch.distributed, "all_reduce", their_counts_too)
    monkeypatch.setattr(torch.distributed, "all_gather_object", their_reason_too)
    with pytest.raises(RewardsUnavailable) as error:
        scorer.score(batch)
    assert str(error.value) == theirs


def test_a_function_that_cannot_be_called_is_refused_by_its_key(user_functions):
    for function, error in (
        (f"{user_functions}:picky", "unexpected keyword argument 'answer'"),
        ("nowhere:f", "nowhere"),
    ):
        section = RewardsSection.model_validate({"functions": {"mine": {"function": function, "fields": ["answer"]}}})
        components = RewardComponents(section, max_new_tokens=16)
        with pytest.raises(RewardsConfigError, match=rf"'rewards.functions.mine.function': .*{error}"):
            components.check()
        with pytest.raises(RewardsConfigError, match=r"'judge.rewards.functions.mine.function': "):
            components.check("judge.rewards")  # a judge's section is named as such
        components.close()


def test_win_rate_of_a_policy_over_itself_is_one_half(process_group, rm_run, rm_data, tiny_model_dir, capsys):
    """engine/ppo/win_rate.py: the same seed for both policies, so a policy against itself draws the
    same responses, every prompt ties, and the win rate is 0.5 exactly."""
    from engine.ppo import win_rate

    root, _ = rm_run
    args = ["--policy", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--max-new-tokens", "8"]
    args += ["--reward-model", str(root / "run" / "model"), "--prompts", str(rm_data / "prompts_validation.parquet")]
    assert win_rate.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompts"] == 21 and result["win_rate"] == 0.5 and result["win_rate_stderr"] == 0.0
    assert result["policy_reward"] == result["baseline_reward"] and 0 < result["policy_length"] <= 8
