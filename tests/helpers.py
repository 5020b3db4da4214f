"""Helpers shared by the end-to-end tests: launching the train scripts under the real launcher."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from data_prep.synthetic_task import FILLER, NEGATIVE, POSITIVE, TOPICS
from engine.config import load_config
from engine.models.deepspeed_glue import training_ds_config
from engine.observe.records import read_records
from engine.ppo.inputs import load_fitting_prompts
from engine.run.dry_run import ppo_plan
from engine.run.preflight import load_tokenizer
from engine.run_config import PPOConfig

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = str(Path(sys.executable).parent / "deepspeed")
RM_COMPONENTS = {"helpful": 0.5, "harmless": 0.5}
TASK_WORDS = {*FILLER, *NEGATIVE, *POSITIVE, *TOPICS}  # the synthetic task's vocabulary (lower case)
SFT_STEPS, SFT_EVERY = (
    40,
    15,
)  # into the second epoch of 1,136 demonstrations; a checkpoint and an evaluation every 15 steps
RM_STEPS, RM_EVERY = 60, 20  # two epochs of 1,900 pairs; a checkpoint every 20 steps
PPO_ITERATIONS, PPO_EVERY = 30, 10  # evaluation and checkpoint every 10 iterations


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_cmd(ranks: int) -> list[str]:
    """The deepspeed launcher on a free rendezvous port (its default 29500 collides with any
    other launch running on the machine at the same time)."""
    return [LAUNCHER, "--num_gpus", str(ranks), "--master_port", str(free_port())]


def launch_two_nodes(
    script: str,
    config: Path,
    hostfile_dir: Path,
    *extra: str,
    node_extra: tuple[list[str], list[str]] = ([], []),
    check: bool = True,
) -> list[subprocess.CompletedProcess]:
    """train/<script> on two "nodes" of one rank each, as on a cluster without ssh: one launcher
    per node (``--hostfile H --no_ssh --node_rank k``), the master on 127.0.0.1. ``node_extra``:
    arguments for one node only."""
    hostfile = hostfile_dir / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")  # host names are labels with --no_ssh
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                LAUNCHER,
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(k),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(REPO / "train" / script),
                "--config",
                str(config),
                *extra,
                *node_extra[k],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for k in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    if check:
        for r in results:
            assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return results


class ForkingPython:
    """Launches run in forks of a warm interpreter (tests/scripts/forking_python.py): ``python SCRIPT
    args...``, or the ranks of a launch, each the same process a fresh ``python`` would make, less ~4.5 s
    of imports (~9 s with vLLM) each. One launch at a time."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _started(self) -> subprocess.Popen:
        if self.server is None or self.server.poll() is not None:
            self.server = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "scripts" / "forking_python.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "2"},  # libgomp reads it as torch loads: the one-rank runs'
            )
            atexit.register(self.server.stdin.close)  # type: ignore[union-attr]  # the server then exits
        return self.server

    def run(self, processes: list[dict], timeout: float, unbuffered: bool = False) -> subprocess.CompletedProcess:
        """Run ``processes`` (``{"argv": after python, "env": the whole environment}`` each) together:
        the first to fail stops the others and its exit status is the result's; their output shared."""
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            server = self._started()
            assert server.stdin and server.stdout
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"processes": processes, "unbuffered": unbuffered, "cwd": str(REPO)}
            server.stdin.write(json.dumps(request | {"stdout": str(out), "stderr": str(err)}) + "\n")
            server.stdin.flush()
            pids = json.loads(server.stdout.readline())["pids"]
            timer = threading.Timer(timeout, lambda: [os.kill(pid, signal.SIGKILL) for pid in pids])
            timer.start()
            try:
                rc = json.loads(server.stdout.readline())["rc"]
            finally:
                timer.cancel()
            return subprocess.CompletedProcess(processes[0]["argv"], rc, out.read_text(), err.read_text())


FORKING_PYTHON = ForkingPython()


def run_ranks(
    argv: list[str], ranks: int, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus ranks SCRIPT args...`` (``argv``) as the launcher starts it: each rank
    ``python -u SCRIPT --local_rank=k args...`` with the launcher's rendezvous variables and the working
    directory on PYTHONPATH, one OpenMP thread each (one rank: two); the first rank to fail stops the
    others and gives the exit status. The ranks are forked from a warm interpreter (:class:`ForkingPython`);
    the launcher's own paths are tested by the runs of two nodes, the signal and exit-code tests
    (:func:`start_launched`, tests/test_crash_resume.py) and the README's commands."""
    path = os.pathsep.join(p for p in (str(REPO), (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH"))) if p)
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
    world |= {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(ranks), "PYTHONPATH": path}
    threads = {"OMP_NUM_THREADS": "1" if ranks > 1 else "2"}
    processes = [
        {
            "argv": [argv[0], f"--local_rank={k}", *argv[1:]],
            "env": {**os.environ, **threads, **(env or {}), **world, "RANK": str(k), "LOCAL_RANK": str(k)},
        }
        for k in range(ranks)
    ]
    result = FORKING_PYTHON.run(processes, timeout=900, unbuffered=True)
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def launch(
    script: str, config: Path, *extra: str, ranks: int = 1, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus ranks train/<script> --config config extra...`` (:func:`run_ranks`); one
    rank runs as ``python train/<script> ...``, which joins a one-rank group itself
    (engine/run/distributed.py): for one rank the launcher adds ~5 s of start-up and nothing else."""
    script_cmd = [str(REPO / "train" / script), "--config", str(config), *extra]
    if ranks > 1:
        return run_ranks(script_cmd, ranks, env, check)
    run_env = {**os.environ, "OMP_NUM_THREADS": "2", "MASTER_PORT": str(free_port()), **(env or {})}
    result = FORKING_PYTHON.run([{"argv": script_cmd, "env": run_env}], timeout=900)
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def run_script(
    script: str, config: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python train/<script> --config config extra...`` (one rank, forked from a warm interpreter) for
    runs that are refused before training or dry runs: no process group, no environment for the run
    (``env`` adds variables, e.g. RLHF_FAULTS)."""
    argv = [str(REPO / "train" / script), "--config", str(config), *extra]
    return FORKING_PYTHON.run([{"argv": argv, "env": {**os.environ, **(env or {})}}], timeout=300)


def faults(**spec) -> dict[str, str]:
    """The environment that injects faults (engine/run/faults.py)."""
    return {"RLHF_FAULTS": json.dumps(spec)}


def read_events(output_dir: Path) -> list[dict]:
    return read_records(str(output_dir / "events.jsonl"))


def write_sft_config(path: Path, tiny_model_dir: Path, sft_data: Path, output_dir: Path, **train) -> Path:
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train": str(sft_data / "sft_train.parquet"), "validation": str(sft_data / "sft_validation.parquet")},
        "deepspeed": "tiny_cpu_zero3.json",
        "train": {
            "epochs": 2,
            "conversations_per_step": 32,
            "max_tokens_per_micro_batch": 1024,
            "max_steps": SFT_STEPS,
            "eval_every_steps": SFT_EVERY,
            **train,
        },
        "optim": {
            "lr": 2e-3,
            "warmup_ratio": 0.0,
            "lr_scheduler": "constant_with_warmup",
        },  # a shorter run follows the same curve
        "checkpoint": {"every_steps": SFT_EVERY, "keep_last": 5},
        "logging": {"output_dir": str(output_dir), "progress_bar": False, "wandb": False},
    }
    path.write_text(json.dumps(config))
    return path


def write_rm_config(path: Path, tiny_model_dir: Path, rm_data: Path, output_dir: Path, **train) -> Path:
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train": str(rm_data / "train.parquet"), "validation": str(rm_data / "validation.parquet")},
        "deepspeed": "tiny_cpu_zero3.json",
        "rm": {"components": RM_COMPONENTS},
        "train": {"pairs_per_step": 32, "max_tokens_per_micro_batch": 1024, "max_steps": RM_STEPS, **train},
        "optim": {"lr": 1e-3, "warmup_ratio": 0.1},
        "checkpoint": {"every_steps": RM_EVERY, "keep_last": 5},
        "logging": {"output_dir": str(output_dir), "progress_bar": False, "wandb": False},
    }
    path.write_text(json.dumps(config))
    return path


def write_ppo_config(path: Path, tiny_model_dir: Path, rm_dir: Path, data: Path, output_dir: Path, **overrides) -> Path:
    config = {
        "actor": {"path": str(tiny_model_dir)},
        "reward_model": {"path": str(rm_dir)},
        "rewards": {"clip": 5.0},
        "data": {
            "prompts": str(data / "prompts_train.parquet"),
            "eval_prompts": str(data / "prompts_validation.parquet"),
        },
        "deepspeed": "tiny_cpu_zero3.json",
        "critic": {"init_from": "reward_model", "lr": 1e-4},
        "rollout": {
            "sampler": "vllm",
            "prompts_per_iteration": 16,
            "samples_per_prompt": 4,
            "max_new_tokens": 24,
            "vllm_kv_cache_mb": 64,
            "vllm_max_model_len": 256,
        },
        "ppo": {"mini_batch_size": 32, "kl_coef": 0.05, "kl_target": 0.05, "kl_horizon": 100},
        "train": {"iterations": PPO_ITERATIONS, "eval_every": PPO_EVERY},
        "optim": {"lr": 5e-4, "warmup_ratio": 0.0, "lr_scheduler": "constant_with_warmup"},
        "checkpoint": {"every_steps": PPO_EVERY, "keep_last": 5},
        "logging": {"output_dir": str(output_dir), "progress_bar": False, "wandb": False},
    }
    for key, value in overrides.items():
        section, name = key.split("__")
        config.setdefault(section, {})[name] = value
    path.write_text(json.dumps(config))
    return path


def metric_series(output_dir: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_records(str(output_dir / "metrics.jsonl")) if key in m}


# A run repeated (resumed, or on another arrangement of the same ranks) computes the same math in
# the same order: bit for bit where the CPU's math kernels are run-to-run deterministic (so it is on
# the development machines), but CI once saw one step's KL differ in the 8th digit, 4 iterations
# into an otherwise identical resumed PPO run, and the later steps drift by ~1e-7. A resume bug (a
# lost optimizer, schedule, controller or RNG state) differs by orders of magnitude more.
REPEAT_REL, REPEAT_ABS = 1e-5, 1e-6


def assert_repeats(
    repeated: dict[int, float], original: dict[int, float], steps: range | None = None, what: str = ""
) -> None:
    """Metric series ``repeated`` equals ``original`` at ``steps`` (all of the original's when None),
    to float rounding."""
    steps = sorted(original) if steps is None else steps
    assert [repeated.get(s) for s in steps] == pytest.approx(
        [original[s] for s in steps], rel=REPEAT_REL, abs=REPEAT_ABS
    ), what


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two state dicts hold the same tensors, to float rounding (see :data:`REPEAT_REL`)."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], rtol=REPEAT_REL, atol=REPEAT_ABS, msg=k)


def ppo_plan_text(config: Path, world: int, capsys: pytest.CaptureFixture) -> str:
    """The dry run's plan of a PPO config for `world` ranks, printed in process (the launched dry run:
    tests/test_dry_run.py)."""
    cfg = load_config(PPOConfig, str(config))
    tokenizer = load_tokenizer(cfg.actor.path, "actor.path")
    prompts = load_fitting_prompts(cfg.data.prompts, tokenizer, cfg, 0)
    capsys.readouterr()
    assert ppo_plan(cfg, prompts, [], tokenizer, training_ds_config(cfg.deepspeed, False), world) == 0
    return capsys.readouterr().out


def start_launched(script: str, config: Path, *extra: str) -> subprocess.Popen:
    """One rank of train/<script> under the launcher, in the background, in its own session
    (so ``os.killpg(proc.pid, SIGKILL)`` kills the launcher and the rank together)."""
    cmd = [*launcher_cmd(1), str(REPO / "train" / script), "--config", str(config), *extra]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until metrics.jsonl has logged ``step`` (fails if the run exits first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(m["step"] >= step for m in read_records(str(metrics))):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The training ranks of a launch (the launcher's children that carry ``--local_rank``)."""
    return [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if any(a.startswith("--local_rank") for a in p.cmdline())
    ]
