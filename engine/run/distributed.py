"""Process-group set-up for DeepSpeed on CPU (gloo) and GPU (nccl): one function, one job."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch

from engine.run.cpu_threads import confine_openmp_to_this_thread


@dataclass(frozen=True)
class SplitWorld:
    """A launched world split in two (PPO's async rollout, engine/rollout/remote.py): the first
    ``trainers`` ranks train (their process group is torch's default one, so DeepSpeed and every
    collective see only them), the last ranks generate (their own default group, which vLLM's
    external launcher adopts). ``store`` (the launcher's rendezvous address) is shared by all."""

    store: Any  # torch.distributed.TCPStore
    rank: int  # in the launched world
    world: int
    trainers: int

    def generates(self) -> bool:
        return self.rank >= self.trainers


class Joined(NamedTuple):
    """This process in the launched world: its rank and the size of its process group, and the
    :class:`SplitWorld` it belongs to (None when every rank trains)."""

    rank: int
    world: int
    split: SplitWorld | None


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """:func:`join_world` with every rank training: ``(rank, world_size)``."""
    rank, world, _ = join_world(timeout_s=timeout_s)
    return rank, world


def join_world(generation_ranks: int = 0, timeout_s: float = 600.0) -> Joined:
    """Join the launcher's process group. With ``generation_ranks`` the last that many ranks form a
    group of their own and the others the training group (:class:`SplitWorld`); the rank and size
    returned are in this process's group.

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
    timeout, backend = timedelta(seconds=timeout_s), "nccl" if on_gpu else "gloo"
    split = _join_split_world(generation_ranks, backend, timeout) if generation_ranks else None
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)  # adopts a group made first
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return Joined(torch.distributed.get_rank(), torch.distributed.get_world_size(), split)


def _join_split_world(generation_ranks: int, backend: str, timeout: timedelta) -> SplitWorld:
    """Make this rank's default process group its side's (trainers or generators) over one store at
    the launcher's address, and set RANK / WORLD_SIZE to match (DeepSpeed and vLLM read them)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=timeout
    )
    split = SplitWorld(store, rank, world, world - generation_ranks)
    side, first, size = (
        ("generators", split.trainers, generation_ranks) if split.generates() else ("trainers", 0, split.trainers)
    )
    torch.distributed.init_process_group(
        backend,
        store=torch.distributed.PrefixStore(f"{side}/", store),
        rank=rank - first,
        world_size=size,
        timeout=timeout,
    )
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank - first), str(size)
    return split


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


class RankSums:
    """Float64 sums of this rank (counts, metric sums) by name, reduced over ranks in one
    :func:`all_reduce`: ``add(pairs=B, loss=losses.sum())`` per micro-batch, then
    ``reduced().mean("loss", over="pairs")``. ``names`` fix the (n,) layout: the fixed fields,
    then any named block (e.g. ``f"loss/{component}"`` per component); an unknown name is a KeyError."""

    def __init__(self, names: Iterable[str]) -> None:
        self.sums = dict.fromkeys(names, 0.0)

    def add(self, **values: float | torch.Tensor) -> None:
        """Add to the named sums (a tensor: its one value)."""
        for name, value in values.items():
            self.sums[name] += float(value)

    def __getitem__(self, name: str) -> float:
        return self.sums[name]

    def mean(self, name: str, *, over: str) -> float:
        """``name``'s sum per ``over``, a count taken as at least 1 (nothing counted: the sum, 0)."""
        return self.sums[name] / max(self.sums[over], 1.0)

    def reduced(self) -> RankSums:
        """The sums over all ranks (this rank's alone without a process group); a collective."""
        t = torch.tensor(list(self.sums.values()), dtype=torch.float64)
        if torch.distributed.is_initialized():
            all_reduce(t)
        total = RankSums(())
        total.sums = dict(zip(self.sums, t.tolist()))
        return total


def agree_max(value: int) -> int:
    """The largest ``value`` over all ranks (e.g. the micro-batch count every rank must run)."""
    return int(all_reduce(torch.tensor([value], dtype=torch.long), op=torch.distributed.ReduceOp.MAX).item())


def first_reason(reason: str) -> str:
    """The first rank's non-empty ``reason``, on every rank: a collective, once all ranks know that one has one."""
    everyone = [""] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, reason)
    return next(r for r in everyone if r)


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
