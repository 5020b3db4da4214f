"""A warm interpreter for the tests' launches: torch, DeepSpeed, transformers, PEFT and vLLM are
imported once here, and each request forks the processes of one launch, each running a script as
``python SCRIPT args...`` would (tests/helpers.py ``launch``, ``run_script``): the ~4.5 s of imports a
launched process pays on 2 CPU cores (~9 s with a vLLM sampler) is paid once per test session, and
each process still starts from one that has run nothing (a fork of this one, which only imported;
what vLLM's import adds to the environment, the child's own replaces).

    python tests/scripts/forking_python.py < requests

Reads one JSON object per line: ``processes`` (one ``{"argv": the arguments after python, "env": the
whole environment}`` per process: the ranks of a launch, started together), ``unbuffered`` (as
``python -u``, as the deepspeed launcher starts its ranks), ``cwd``, ``stdout`` and ``stderr`` (files
for file descriptors 1 and 2, shared by the processes). Answers on its own stdout with two JSON lines
per request: ``{"pids": [...]}`` when the processes start, ``{"rc": exit status}`` when they end. As
under the launcher, the first process to fail stops the others (SIGTERM to each one's process tree,
SIGKILL 5 s later) and its status is the launch's (negative: the signal that ended it, as
subprocess reports it). A process's exit is a normal interpreter exit (atexit handlers run); an
uncaught exception is exit 1 with its traceback, as in a fresh process.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first, as in the scripts: OpenMP's wait policy before torch loads

# isort: split
import io
import json
import os
import sys
import threading

import deepspeed  # noqa: F401
import peft  # noqa: F401
import psutil
import torch
import transformers.modeling_utils  # noqa: F401
from python_commands import run
from vllm import LLM, SamplingParams  # noqa: F401


def child(process: dict, request: dict) -> int:
    """Run one process of the request in this (forked) process; its exit status."""
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),  # new files, shared by the ranks
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    if request["unbuffered"]:
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.chdir(request["cwd"])
    added = [p for p in process["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = added  # where a fresh interpreter puts PYTHONPATH: after the script's directory
    os.environ.clear()
    os.environ.update(process["env"])
    if "OMP_NUM_THREADS" in os.environ:  # libgomp read this interpreter's count as torch loaded
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return run(process["argv"])


def signal_trees(pids: list[int], kill: bool) -> None:
    """SIGTERM (or SIGKILL) to each process and its children."""
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            for proc in [*parent.children(recursive=True), parent]:
                proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            continue


def wait_for(pids: set[int]) -> int:
    """Wait for the processes ``pids``; the first one's failure stops the others as the launcher
    does (SIGTERM now, SIGKILL to those left 5 s later). The launch's exit status."""
    rc, killer = 0, threading.Timer(5, lambda: signal_trees(list(pids), kill=True))
    while pids:
        pid, status = os.wait()
        pids.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code
            signal_trees(list(pids), kill=False)
            killer.start()
    killer.cancel()
    return rc


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pids = set()
        for process in request["processes"]:
            pid = os.fork()
            if pid == 0:
                answers.close()
                sys.exit(child(process, request))  # leaves the loop: the child's interpreter exits here
            pids.add(pid)
        answers.write(json.dumps({"pids": sorted(pids)}) + "\n")
        answers.flush()
        rc = wait_for(pids)
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
