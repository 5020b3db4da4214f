"""Process-group set-up for DeepSpeed on CPU (gloo) and GPU (nccl): one function, one job."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch

from engine.run.cpu_threads import confine_openmp_to_this_thread


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the launcher's process group; returns ``(rank, world_size)``.

    Works under the ``deepspeed`` launcher, ``torchrun``, or a plain ``python`` (one rank:
    the rendezvous variables are filled in). A finite timeout turns a mismatched collective
    into an error instead of a 30-minute hang.
    """
    import deepspeed
    import deepspeed.ops

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # deepspeed 0.19: the shm all-reduce op is JIT-compiled (~100 s) on first use; gloo alone is fine.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        _share_cpu_cores()
    deepspeed.init_distributed(
        dist_backend="nccl" if on_gpu else "gloo", timeout=timedelta(seconds=timeout_s), verbose=False
    )
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _share_cpu_cores() -> None:
    # The deepspeed launcher (0.19) does not set OMP_NUM_THREADS: N ranks each using every core
    # made a ZeRO-3 step 20x slower on 2 cores. Give each local rank its share unless told.
    if "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    confine_openmp_to_this_thread()  # before gloo's threads run their first parallel operation


def all_reduce(t: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce a small CPU tensor (counts, metric sums) in place and return it.

    NCCL reduces GPU tensors only: there the values travel through the rank's GPU and back.
    """
    if torch.distributed.get_backend(group) == "nccl":
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(on_gpu, op=op, group=group)
        t.copy_(on_gpu)
    else:
        torch.distributed.all_reduce(t, op=op, group=group)
    return t


def agree_max(value: int) -> int:
    """The largest ``value`` over all ranks (e.g. the micro-batch count every rank must run)."""
    return int(all_reduce(torch.tensor([value], dtype=torch.long), op=torch.distributed.ReduceOp.MAX).item())


def mean_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64)
    all_reduce(t)
    return {k: v / torch.distributed.get_world_size() for k, v in zip(keys, t.tolist())}


def ranks_not_sharing(directory: str) -> list[str]:
    """``"rank R (host)"`` for every rank that cannot see a file rank 0 writes in ``directory``:
    empty when all ranks share it (one node, or a filesystem every node mounts). Collective;
    leaves ``directory`` as it found it."""
    rank, created = torch.distributed.get_rank(), not os.path.isdir(directory)
    name = [
        f".shared_check_{socket.gethostname()}_{os.getpid()}_{time.time_ns()}"
    ]  # never looked up before: no stale cache
    torch.distributed.broadcast_object_list(name, src=0)
    probe = os.path.join(directory, name[0])
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        open(probe, "w").close()
    torch.distributed.barrier()
    seen: list[Any] = [None] * torch.distributed.get_world_size()  # (exists, host) per rank
    torch.distributed.all_gather_object(seen, (os.path.exists(probe), socket.gethostname()))
    if rank == 0:
        os.remove(probe)
        if created:
            os.rmdir(directory)
    return [f"rank {r} ({host})" for r, (ok, host) in enumerate(seen) if not ok]


def shutdown_distributed() -> None:
    """Leave the process group together: without it a rank that exits first can tear down gloo
    while another is still inside its last collective ("terminate called without an active
    exception", SIGABRT, seen with torch 2.13 on 2 CPU ranks)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def accelerator_memory_metrics() -> dict[str, float]:
    """This rank's peak accelerator memory so far (GiB): allocated by tensors and reserved by
    the caching allocator. Empty on a CPU."""
    if not torch.cuda.is_available():
        return {}
    return {
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "memory/peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }
