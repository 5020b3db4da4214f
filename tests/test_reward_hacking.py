"""Reward hacking is caught, not reported as success: PPO from the SFT policy against its reward
model with no KL control and a high learning rate games the reward model within a few iterations;
the collapse monitors flag it and, with ``monitors.action stop``, the run checkpoints and exits 3
with the flags in its last line; a judge the policy is not trained on disagrees with the reward
model. (A default run raising no flag: tests/test_train_ppo.py's learning run.)"""

from __future__ import annotations

from helpers import launch, metric_series, read_events, write_ppo_config

MAX_ITERATIONS = 12


def test_a_policy_gaming_its_reward_model_is_flagged_and_stopped_with_a_checkpoint(sft_run, rm_run, rm_data, tmp_path):
    (sft_root, _), (rm_root, _) = sft_run, rm_run
    config = write_ppo_config(
        tmp_path / "ppo.json",
        sft_root / "run" / "model",
        rm_root / "run" / "model",
        rm_data,
        tmp_path / "run",
        ppo__kl_coef=0.0,
        ppo__kl_target=None,
        optim__lr=5e-3,
        train__iterations=MAX_ITERATIONS,
        train__eval_every=2,
        checkpoint__every_steps=0,
        monitors__action="stop",
        judge__rewards={"length": {"target_tokens": 8}},  # a judge the policy is not trained on: brevity
    )
    result = launch("train_ppo.py", config, check=False)
    run = tmp_path / "run"
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    flags = [e for e in read_events(run) if e["event"].startswith("monitor/")]
    assert flags, read_events(run)
    stopped = flags[0]["step"]
    assert stopped <= 8 and all(e["step"] == stopped for e in flags), flags  # the first flags stop the run
    last_line = result.stderr.strip().splitlines()[-1]
    assert f"stopped after iteration {stopped}: reward-hacking monitor/" in last_line, last_line
    assert f"checkpoints/step{stopped:08d}" in last_line and "Traceback" not in result.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{stopped:08d}"
    score = metric_series(run, "ppo/score")
    assert max(score) == stopped and score[stopped] > score[1]  # the reward model was pleased all along
    assert flags[0]["event"] in (run / "report.html").read_text()  # in its events table
    # The judge scored the held-out responses at each evaluation, in total and per part, and
    # disagreed: the reward model's win rate rose while the judge's fell.
    judged = metric_series(run, "eval/judge_win_rate")
    assert sorted(judged) == sorted(metric_series(run, "eval/judge_win_rate/length")) == [0, stopped]
    assert "monitor/judge_disagrees" in {e["event"] for e in flags}
    assert metric_series(run, "eval/win_rate")[stopped] - judged[stopped] > 0.3
