"""OpenMP's wait policy for CPU runs; the launched scripts import this before torch loads.

Gloo runs parts of ZeRO-3's all-gathers and reduce-scatters on its own threads, and torch
starts an OpenMP team on each of them. Once libgomp manages more threads than there are cores
it "throttles": a worker spins only 100 times after a parallel region before it sleeps, so
every later region pays a wake-up, and a ZeRO-3 PPO iteration on 2 cores got ~40% slower,
generation included (0.85 vs 0.57 s measured with OMP_WAIT_POLICY=ACTIVE, whose throttled
spin is 1,000 and whose unthrottled spin lasts until the next region). ACTIVE is set only
for runs without an NVIDIA GPU (on a GPU machine spinning workers would hold cores that the
data and sampler threads need) and only when the user did not choose a policy.
"""

from __future__ import annotations

import os
import shutil
import sys


def prefer_spinning_openmp_workers() -> None:
    if "torch" in sys.modules:  # libgomp has read its environment already
        return
    if shutil.which("nvidia-smi") is None and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")


prefer_spinning_openmp_workers()
