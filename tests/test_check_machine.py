"""`make setup`'s first step (data_prep/check_machine.py): this machine passes, and another Python is
refused by name, with what is needed, before anything installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from data_prep import check_machine

CHECK = REPO / "data_prep" / "check_machine.py"
PYTHON_3_10 = Path("/root/.pyenv/versions/3.10.13/bin/python")


def test_this_machine_passes_and_an_old_python_or_a_full_disk_is_refused(tmp_path, monkeypatch):
    passed = subprocess.run([sys.executable, CHECK, "cpu", tmp_path / "a" / ".venv"], capture_output=True, text=True)
    assert passed.returncode == 0 and "installing for cpu" in passed.stdout, passed.stderr
    assert check_machine.refusals("cpu", str(tmp_path / "not" / "yet" / ".venv")) == []
    monkeypatch.setitem(check_machine.FREE_DISK_GIB, "cuda", 10**9)  # more than any disk has
    (refusal,) = check_machine.refusals("cuda", str(tmp_path / ".venv"))
    assert refusal.startswith("1000000000 GiB of free disk is needed for the cuda install") and "VENV=" in refusal
    if not PYTHON_3_10.is_file():
        pytest.skip("no Python 3.10 on this machine to be refused")
    old = subprocess.run([PYTHON_3_10, CHECK, "cpu", tmp_path / ".venv"], capture_output=True, text=True)
    assert old.returncode == 2
    assert "Python 3.11, 3.12 or 3.13 is needed; this is 3.10" in old.stderr and "PYTHON=python3.11" in old.stderr
