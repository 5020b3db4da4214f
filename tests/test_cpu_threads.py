"""The launched scripts choose OpenMP's wait policy before torch loads libgomp."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.parametrize("script", ["train_rm.py", "train_ppo.py"])
def test_cpu_threads_is_the_first_import(script):
    tree = ast.parse((REPO / "train" / script).read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) != "__future__"]
    assert isinstance(imports[0], ast.Import) and imports[0].names[0].name == "engine.cpu_threads"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the policy is left alone on GPU machines")
def test_active_wait_policy_on_cpu_unless_the_user_chose_one():
    probe = "import engine.cpu_threads, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = lambda extra: subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True, text=True,
                                       check=True).stdout.strip()
    assert run({}) == "ACTIVE"
    assert run({"OMP_WAIT_POLICY": "PASSIVE"}) == "PASSIVE"
