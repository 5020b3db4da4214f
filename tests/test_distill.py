"""On-policy distillation (the ``distill`` section of train/train_ppo.py) end to end on the tiny model:
the teacher refused by name before any model loads, the dry run's teacher, and one run whose teacher
is the student itself, resumed. (The formulas: tests/test_distill_losses.py; the teacher's chunked
head: tests/test_lm_head.py.)"""

from __future__ import annotations

import json
import shutil

import torch
from helpers import assert_repeats, launch, metric_series, run_script, write_ppo_config
from safetensors.torch import load_file

from data_prep import make_tiny_model
from engine.observe.records import read_records

ITERATIONS, EVERY = 4, 2


def distill_config(path, actor, teacher, data, output_dir, **overrides):
    """A PPO config that distils ``teacher`` into ``actor`` with no reward at all (GRPO, no critic)."""
    write_ppo_config(
        path,
        actor,
        actor,
        data,
        output_dir,
        rollout__sampler="hf",  # HF generate on the actor: vLLM starts in the runs that test it
        rollout__temperature=0.7,
        ppo__advantage_estimator="grpo",
        ppo__mini_batch_size=32,
        train__iterations=ITERATIONS,
        train__eval_every=EVERY,
        checkpoint__every_steps=EVERY,
        **overrides,
    )
    config = json.loads(path.read_text())
    del config["reward_model"]
    config["distill"] = {"teacher": str(teacher), **config.get("distill", {})}
    path.write_text(json.dumps(config))
    return path


def test_a_teacher_is_refused_by_name_before_any_model_loads(tiny_model_dir, rm_data, tmp_path):
    """Another tokenizer, and GKD with dataset responses (lmbda < 1): exit 2, the key named, no
    traceback; the dry run prices the teacher."""
    other = tmp_path / "other"
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "a wholly other corpus of words " * 50}) + "\n")
    assert make_tiny_model.main(["--text", str(tmp_path / "text.jsonl"), "--out", str(other), "--num-layers", "1"]) == 0
    config = distill_config(tmp_path / "other.json", tiny_model_dir, other, rm_data, tmp_path / "run")
    refused = run_script("train_ppo.py", config)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"config error: 'distill.teacher' ({other}): its vocabulary is not the actor's" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "run").exists()

    config = distill_config(tmp_path / "gkd.json", tiny_model_dir, tiny_model_dir, rm_data, tmp_path / "run")
    refused = run_script("train_ppo.py", config, "--distill.mode", "gkd", "--distill.lmbda", "0.5")
    assert refused.returncode == 2 and "distill: 'lmbda' (0.5): only 1 is supported" in refused.stderr
    assert "Traceback" not in refused.stderr

    plan = run_script("train_ppo.py", config, "--dry-run")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "  teacher  " in plan.stdout and "parameters (frozen)" in plan.stdout.split("  teacher  ")[1]
    assert f"distillation: reverse_kl from {tiny_model_dir}" in plan.stdout


def test_the_student_as_its_own_teacher_learns_nothing_logs_distillation_and_resumes(tiny_model_dir, rm_data, tmp_path):
    """Teacher = student, no reward: the reverse KL to the teacher is 0 on the rollouts and on the
    held-out responses, every advantage is 0, so the exported actor is the start, bit for bit; the
    distillation metrics and plot are there, and a resume from iteration 2 repeats iterations 3-4."""
    config = distill_config(tmp_path / "ppo.json", tiny_model_dir, tiny_model_dir, rm_data, tmp_path / "run")
    result = launch("train_ppo.py", config)
    run = tmp_path / "run"
    reverse_kl = metric_series(run, "distill/reverse_kl")
    assert sorted(reverse_kl) == list(range(1, ITERATIONS + 1)) and max(map(abs, reverse_kl.values())) < 1e-6
    held_out = metric_series(run, "eval/distill/reverse_kl")
    assert sorted(held_out) == [0, 2, 4] and max(map(abs, held_out.values())) < 1e-6
    teacher = metric_series(run, "distill/teacher_logprob")
    assert sorted(teacher) == sorted(reverse_kl) and all(-10 < v < 0 for v in teacher.values()), teacher
    assert metric_series(run, "ppo/pg_loss") == dict.fromkeys(range(1, ITERATIONS + 1), 0.0)
    start, trained = (load_file(d / "model.safetensors") for d in (tiny_model_dir, run / "actor"))
    assert start.keys() == trained.keys() and all(torch.equal(trained[k], v) for k, v in start.items())
    png = (run / "report" / "distill.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 'src="report/distill.png"' in (run / "report.html").read_text()
    assert "distill/jsd" not in read_records(str(run / "metrics.jsonl"))[1]  # reverse_kl: no JSD in the loss
    assert "held-out reward" in result.stdout

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "actor")
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step00000002"
    config_data = json.loads(config.read_text())
    config_data["logging"]["output_dir"] = str(resumed)
    (tmp_path / "resume.json").write_text(json.dumps(config_data))
    assert "resumed at iteration 2" in launch("train_ppo.py", tmp_path / "resume.json", "--resume").stdout
    for key in ("distill/teacher_logprob", "distill/reverse_kl", "ppo/response_length", "ppo/entropy"):
        assert_repeats(metric_series(resumed, key), metric_series(run, key), range(3, ITERATIONS + 1), key)
    assert_repeats(metric_series(resumed, "eval/distill/reverse_kl"), held_out)
