"""Multi-turn episodes end to end (rollout.environment in train/train_ppo.py): on 2 ranks, the SFT
policy in colocated vLLM tensor parallel over both (the model compiled), a LoRA actor, GRPO with
dynamic sampling, an environment that answers every finished turn with an observation and scores
the turns (tests/scripts/notes_env.py), killed (SIGKILL) in iteration 4 after its rollout and
resumed from the iteration-2 checkpoint. Critic-free with a LoRA actor: the plan and the checkpoints
name no critic and no reference model. (An async rollout's episodes: tests/test_async_rollout.py;
the episode runner, masks and tools on their own: tests/test_episodes.py.)"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from helpers import REPO, assert_repeats, faults, launch, metric_series, ppo_plan_text, write_ppo_config

from engine.observe.records import read_records

ITERATIONS, EVERY = 4, 2
LORA = {"rank": 8, "alpha": 32.0}
SCRIPTS = REPO / "tests" / "scripts"
NOTES = {"name": "notes_env:Notes", "max_turns": 3, "max_observation_tokens": 4, "workers": 1}  # tests/scripts


def test_episodes_with_tensor_parallel_vllm_lora_and_dynamic_sampling_stay_in_sync_and_resume_after_a_kill(
    sft_run, rm_data, tmp_path, capsys
):
    """The killed run sampled multi-turn episodes (turns > 1, observation tokens, the environment's
    metric and reward) with vLLM's log-probs equal to the actor's on the packed multi-turn sequences;
    the resume repeats iteration 3 and finishes with the episodes plot."""
    sft_root, _ = sft_run
    run = tmp_path / "run"
    config = write_ppo_config(
        tmp_path / "ppo.json",
        sft_root / "run" / "model",
        sft_root / "run" / "model",
        rm_data,
        run,
        actor__lora=LORA,
        rollout__prompts_per_iteration=8,
        rollout__max_new_tokens=48,
        rollout__dynamic_sampling=True,
        rollout__tensor_parallel_size=2,
        rollout__vllm_compile=True,
        rollout__environment=NOTES,
        ppo__advantage_estimator="grpo",
        ppo__kl_coef=0.0,
        ppo__kl_target=None,
        ppo__kl_loss_coef=0.01,
        ppo__use_kl_in_reward=False,
        optim__lr=3e-3,
        train__iterations=ITERATIONS,
        train__eval_every=EVERY,
        checkpoint__every_steps=EVERY,
    )
    held_out = pq.read_table(rm_data / "prompts_validation.parquet").slice(0, 6)  # 3 and 3: both ranks' episodes
    pq.write_table(held_out, tmp_path / "held_out.parquet")
    data = json.loads(config.read_text())
    del data["reward_model"], data["critic"]
    data["data"]["eval_prompts"] = str(tmp_path / "held_out.parquet")
    config.write_text(json.dumps(data))
    env = {"PYTHONPATH": str(SCRIPTS)}
    plan = ppo_plan_text(config, 2, capsys)
    assert "critic       none: ppo.advantage_estimator grpo needs no value model (saves ZeRO-3, 2 rank(s): " in plan
    assert "reference    none: the actor with its LoRA adapters disabled" in plan
    assert "(LoRA rank 8: " in plan and "without LoRA:" in plan and "; the model compiled" in plan

    killed = launch("train_ppo.py", config, env={**env, **faults(kill_in_iteration_at=4)}, ranks=2, check=False)
    assert killed.returncode != 0 and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    logged = list(range(1, ITERATIONS))
    turns, share = metric_series(run, "ppo/turns"), metric_series(run, "ppo/observation_share")
    assert sorted(turns) == logged and all(1.2 < t <= 3 for t in turns.values()), turns
    assert all(0.1 < s < 0.8 for s in share.values()), share  # a note and its template ids per turn
    steps = metric_series(run, "environment/steps")
    assert all(1 <= s <= 3 for s in steps.values()) and steps.keys() == turns.keys(), steps
    assert all(0 < r < 3 for r in metric_series(run, "reward/environment").values())
    gap = metric_series(run, "ppo/sampler_logprob_gap")
    assert sorted(gap) == logged and max(gap.values()) < 1e-5, gap
    kept, rounds = metric_series(run, "ppo/kept_share"), metric_series(run, "ppo/generation_rounds")
    assert sorted(kept) == logged and all(0.2 < k <= 1 for k in kept.values()) and min(kept.values()) < 1, kept
    assert max(rounds.values()) >= 2, rounds  # groups without signal drawn again, in episodes
    assert sorted(p.name for p in (run / "checkpoints" / "step00000002").iterdir() if p.is_dir()) == ["actor"]
    before = read_records(str(run / "metrics.jsonl"))
    assert "ppo/pg_loss" in before[1] and not any(k.startswith("ppo/vf_") for m in before for k in m)

    resumed = launch("train_ppo.py", config, "--resume", env=env, ranks=2)
    assert "resumed at iteration 2" in resumed.stdout
    after = {m["step"]: m for m in read_records(str(run / "metrics.jsonl")) if "ppo/turns" in m}
    assert sorted(after) == list(range(1, ITERATIONS + 1))
    original = {m["step"]: m for m in before if "ppo/turns" in m}
    for key in ("ppo/turns", "ppo/observation_share", "environment/steps", "ppo/kept_share", "ppo/kl_loss"):
        assert_repeats({3: after[3][key]}, {3: original[3][key]}, what=key)
    assert (run / "report" / "episodes.png").stat().st_size > 0 and (run / "actor").is_dir()
