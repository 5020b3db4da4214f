"""The launched scripts choose OpenMP's wait policy before torch loads libgomp."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPTS = ["train_sft.py", "train_rm.py", "train_ppo.py", "train_dpo.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_cpu_threads_is_the_first_import(script):
    assert sorted(p.name for p in (REPO / "train").glob("train_*.py")) == sorted(SCRIPTS)  # every launched script
    tree = ast.parse((REPO / "train" / script).read_text())
    imports = [
        n
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) != "__future__"
    ]
    assert isinstance(imports[0], ast.Import) and imports[0].names[0].name == "engine.run.cpu_threads"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the policy is left alone on GPU machines")
def test_active_wait_policy_with_a_bounded_spin_on_cpu_unless_the_user_chose_one():
    probe = "import engine.run.cpu_threads, os, torch; print(os.getenv('OMP_WAIT_POLICY'), os.getenv('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = lambda extra: subprocess.run(
        [sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert run({}) == "ACTIVE 10000"  # spinning, for a bounded time
    assert run({"GOMP_SPINCOUNT": "500"}) == "ACTIVE 500"
    assert run({"OMP_WAIT_POLICY": "PASSIVE"}) == "PASSIVE None"


PROBE_CONFINED = """
import ctypes, threading, torch
from engine.run.cpu_threads import _loaded_library, confine_openmp_to_this_thread
torch.set_num_threads(2)
confine_openmp_to_this_thread()
seen = []
def worker():  # a thread started later, like gloo's: its first parallel op adopts the global count
    torch.ones(1 << 20).add_(1)
    seen.append(torch.get_num_threads())
t = threading.Thread(target=worker)
t.start(); t.join()
mkl = ctypes.CDLL(_loaded_library("libtorch_cpu.so")).mkl_get_max_threads()
print(torch.get_num_threads(), seen[0], mkl)
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_openmp_teams_stay_on_the_main_thread():
    """The main thread keeps 2 OpenMP and MKL threads; a thread started later gets 1, so
    libgomp never manages more threads than cores (no throttled spinning)."""
    out = subprocess.run([sys.executable, "-c", PROBE_CONFINED], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["2", "1", "2"]
