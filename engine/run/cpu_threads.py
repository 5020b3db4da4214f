"""OpenMP settings for CPU runs: the wait policy (set on import, before torch loads) and
OpenMP teams confined to the main thread (:func:`confine_openmp_to_this_thread`).

Gloo runs parts of ZeRO-3's all-gathers and reduce-scatters on its own threads, and torch
starts an OpenMP team on each of them. Once libgomp manages more threads than there are cores
it "throttles": a worker spins only 100 times after a parallel region before it sleeps, so
every later region pays a wake-up, and a ZeRO-3 PPO iteration on 2 cores got ~40% slower,
generation included (0.85 vs 0.57 s measured with OMP_WAIT_POLICY=ACTIVE, whose throttled
spin is 1,000 and whose unthrottled spin lasts until the next region). ACTIVE is set only
for runs without an NVIDIA GPU (on a GPU machine spinning workers would hold cores that the
data and sampler threads need) and only when the user did not choose a policy.

With it the spin is bounded (``GOMP_SPINCOUNT``, :data:`SPIN_COUNT`, unless the user set one): an
idle worker spinning until the next region holds a core while the trainer waits on the processes
that need it, its reward workers and environments. Bounded, scoring and environment steps ran
on both cores (docs/design.md#cpu-threads); a much shorter spin pays a wake-up after every
pause between two operations.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys

SPIN_COUNT = "10000"  # an idle OpenMP worker's spins before it sleeps (GOMP_SPINCOUNT): tens of microseconds


def prefer_spinning_openmp_workers() -> None:
    if "torch" in sys.modules:  # libgomp has read its environment already
        return
    cpu_only = shutil.which("nvidia-smi") is None and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu"
    if cpu_only and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


prefer_spinning_openmp_workers()


def confine_openmp_to_this_thread() -> None:
    """Keep this thread's OpenMP/MKL thread count and give every thread started later one.

    torch applies its global thread count to a thread at that thread's first parallel
    operation, gloo's runloop threads included; their teams take libgomp over the core count
    into throttled mode. Here the global count becomes 1 and this (the main) thread keeps its
    own through libgomp's and MKL's per-thread calls, so only the main thread's team exists.
    Call it on CPU runs before the first collective and again after anything that sets the
    global count (vLLM's start). With a torch built without libgomp or MKL nothing changes.
    """
    import torch

    n = torch.get_num_threads()  # also completes this thread's lazy thread-pool set-up
    gomp, torch_cpu = _loaded_library("libgomp.so.1"), _loaded_library("libtorch_cpu.so")
    if n == 1 or gomp is None or torch_cpu is None:
        return
    try:
        omp_set_num_threads = ctypes.CDLL(gomp).omp_set_num_threads
        mkl_set_num_threads_local = getattr(ctypes.CDLL(torch_cpu), "mkl_set_num_threads_local", None)
    except OSError:
        return
    torch.set_num_threads(1)
    omp_set_num_threads(n)
    if mkl_set_num_threads_local is not None:  # MKL's per-thread count takes a pointer (Fortran-style entry)
        mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(n)))
    if torch.get_num_threads() != n:  # not the OpenMP that torch uses: undo
        torch.set_num_threads(n)


def _loaded_library(name: str) -> str | None:
    """Path of the shared library ``name`` this process has loaded (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            return next((path for line in maps if os.path.basename(path := line.split()[-1]) == name), None)
    except OSError:
        return None
