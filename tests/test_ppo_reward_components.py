"""PPO (REINFORCE++, no critic) without a reward model, on reward components alone: a verifier (math-verify
on a pattern that the server's format component also checks, so the two must agree),
reward functions that read their row's ground truth (one of them failing on some responses), a
length penalty and a real reward server on localhost that goes down mid-run (clean stop, exit 2,
checkpoint; --resume completes the run). The dry run's plan names no reward model. The rollouts
come from HF generate on the actor (``rollout.sampler hf``; vLLM's own tests are elsewhere)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO, free_port, launch, metric_series
from transformers import AutoTokenizer

from data_prep.synthetic_task import TOPICS
from engine.config import load_config
from engine.data.prompts import load_prompts
from engine.models.deepspeed_glue import training_ds_config
from engine.observe.records import read_records
from engine.run.dry_run import ppo_plan
from engine.run_config import PPOConfig

REWARD_FUNCTIONS = """
def grounded(prompt, response, answer):
    # 1 when the row's ground truth arrived with its own prompt's responses
    return float(answer in prompt[-1]["content"])

def picky(prompt, response):
    if len(response) % 3 == 0:
        raise ValueError("a length divisible by three")
    return 1.0
"""
ITERATIONS = 4


def start_server(port: int, log: Path) -> subprocess.Popen:
    """The reference reward server serving ``format`` (a pattern found in most responses)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "engine.rewards.server", "--port", str(port), "--format-pattern", "e", "--workers", "1"],
        cwd=REPO,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(log.read_text()[-3000:])


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, rm_data):
    """Prompts with an ``answer`` column (the topic each asks about), the reward functions' module, a server."""
    root = tmp_path_factory.mktemp("reward_components")
    messages = pq.read_table(rm_data / "prompts_train.parquet").column("prompt").to_pylist()[:64]
    answers = [next(t for t in TOPICS if t in m[-1]["content"]) for m in messages]
    table = pa.table({"prompt": messages, "answer": answers, "letter": ["e"] * len(messages)})
    pq.write_table(table, root / "prompts.parquet")
    (root / "my_rewards.py").write_text(textwrap.dedent(REWARD_FUNCTIONS))
    port = free_port()
    server = start_server(port, root / "server.log")
    yield root, port, server
    if server.poll() is None:
        stop(server)


def write_config(root: Path, tiny_model_dir: Path, port: int, out: str, **rewards) -> Path:
    config = {
        "actor": {"path": str(tiny_model_dir)},
        "data": {"prompts": str(root / "prompts.parquet")},
        "deepspeed": "tiny_cpu_zero3.json",
        "rewards": {
            "math": {"field": "letter", "pattern": "(e)"},  # 1.0 where an 'e' is found: the server's format too
            "length": {"target_tokens": 8, "weight": 0.5},
            "functions": {
                "grounded": {"function": "my_rewards:grounded", "weight": 0.5, "fields": ["answer"]},
                "picky": {"function": "my_rewards:picky", "weight": 0.2, "fallback": -1.0},
            },
            "remote": {
                "url": f"http://127.0.0.1:{port}",
                "components": {"format": 1.0},
                "retries": 1,
                "backoff_s": 0.2,
            },
            **rewards,
        },
        "rollout": {"sampler": "hf", "prompts_per_iteration": 8, "samples_per_prompt": 4, "max_new_tokens": 16},
        "ppo": {"advantage_estimator": "reinforce_pp", "mini_batch_size": 32, "kl_coef": 0.05},
        "train": {"iterations": ITERATIONS},
        "optim": {"lr": 5e-4, "warmup_ratio": 0.0, "lr_scheduler": "constant_with_warmup"},
        "checkpoint": {"every_steps": 100},
        "logging": {"output_dir": str(root / out), "progress_bar": False, "wandb": False},
    }
    path = root / f"{out}.json"
    path.write_text(json.dumps(config))
    return path


def test_the_plan_without_a_reward_model(setup, tiny_model_dir, capsys):
    """... and with a judge of rule components, which it names."""
    root, port, _ = setup
    path = write_config(root, tiny_model_dir, port, "planned")
    config = json.loads(path.read_text())
    config["data"]["eval_prompts"] = config["data"]["prompts"]
    config["judge"] = {"rewards": {"format": {"pattern": "e"}, "length": {"target_tokens": 8}}}
    path.write_text(json.dumps(config))
    cfg = load_config(PPOConfig, str(path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(cfg.data.prompts, cfg.rewards.fields())
    assert ppo_plan(cfg, prompts, [], tokenizer, training_ds_config(cfg.deepspeed, False), 1) == 0
    plan = capsys.readouterr().out
    assert "reward model none" in plan and "critic       none" in plan and "  reference " in plan
    assert (
        "score: 1 x math + 0.5 x length + 0.5 x grounded + 0.2 x picky + 1 x remote_format, clipped to +-10; "
        "2 reward worker(s) per rank" in plan
    ), plan
    assert "judge: format, length (held-out responses only)" in plan
    assert (
        "objective: reinforce_pp advantages; token ratios clipped at 0.2; token_mean; KL k1 x 0.05 in the reward"
        in plan
    )


def test_a_run_on_reward_components_stops_cleanly_when_the_server_goes_down(setup, tiny_model_dir):
    """Its server killed after iteration 2: a clean stop at the next scoring (exit 2, a checkpoint of
    the actor alone); --resume with the server back completes the run, every component scored at
    every iteration. (That a resumed PPO run repeats the straight one: tests/test_train_ppo.py.)"""
    root, port, server = setup
    env = {"PYTHONPATH": str(root)}
    config = write_config(root, tiny_model_dir, port, "interrupted")
    log = (root / "interrupted.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train" / "train_ppo.py"), "--config", str(config)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "2"},
    )
    run = root / "interrupted"
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and any(m["step"] >= 2 for m in read_records(str(metrics)))):
        assert proc.poll() is None and time.time() < deadline, (root / "interrupted.log").read_text()[-3000:]
        time.sleep(0.05)
    stop(server)
    assert proc.wait(timeout=300) == 2
    out = (root / "interrupted.log").read_text()
    assert f"reward error: reward server http://127.0.0.1:{port}/v1/score failed 2 attempts" in out, out[-3000:]
    assert "continue with the same command plus --resume" in out and "Traceback" not in out
    stopped_at = max(m["step"] for m in read_records(str(metrics)))
    assert 2 <= stopped_at < ITERATIONS
    saved = (run / "checkpoints" / "latest").read_text().strip()
    # critic-free REINFORCE++ without a reward model: the checkpoint holds the actor alone
    assert sorted(p.name for p in (run / "checkpoints" / saved).iterdir() if p.is_dir()) == ["actor"]

    server = start_server(port, root / "server.log")  # back up: the run continues
    try:
        resumed = launch("train_ppo.py", config, "--resume", env=env)
    finally:
        stop(server)
    assert f"ppo done: {ITERATIONS} iterations" in resumed.stdout, resumed.stdout[-3000:]
    assert (run / "actor" / "config.json").exists()
    records = read_records(str(metrics))
    assert "ppo/pg_loss" in records[-1] and not any(k.startswith("ppo/vf_") for m in records for k in m)
    for step in range(1, ITERATIONS + 1):
        assert metric_series(run, "reward/grounded")[step] == 1.0  # every response saw its own row's answer
    for key in ("reward/math", "reward/length", "reward/remote_format", "reward/picky"):
        assert sorted(metric_series(run, key)) == list(range(1, ITERATIONS + 1)), key
    errors = metric_series(run, "reward/picky/errors")
    assert 0 < max(errors.values()) < 1 and max(metric_series(run, "reward/picky/timeouts").values()) == 0
    served = metric_series(run, "reward/remote_format")
    assert min(served.values()) > 0
    assert metric_series(run, "reward/math") == pytest.approx(served)  # math-verify in the pool, a regex in the server
    assert -1 <= min(metric_series(run, "reward/length").values()) < 0  # some responses longer than 8 tokens
