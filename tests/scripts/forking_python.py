"""A warm interpreter for the tests' one-rank runs: torch, DeepSpeed, transformers, PEFT and vLLM
are imported once here, and each request forks a child that runs a script as ``python SCRIPT args...``
would (tests/helpers.py ``launch``, ``run_script``): the ~4.5 s of imports a launched process pays on
2 CPU cores (~9 s with a vLLM sampler) is paid once per test session, and each run still starts from a
process that has run nothing (a fork of this one, which only imported; what vLLM's import adds to the
environment, the child's own replaces).

    python tests/scripts/forking_python.py < requests

Reads one JSON object per line: ``argv`` (the arguments after ``python``), ``env`` (the whole
environment), ``cwd``, ``stdout`` and ``stderr`` (files for file descriptors 1 and 2). Answers on its
own stdout with two JSON lines per request: ``{"pid": child}`` when the child starts, ``{"rc": exit
status}`` when it ends (negative: the signal that ended it, as subprocess reports it). The child's
exit is a normal interpreter exit (atexit handlers run); an uncaught exception is exit 1 with its
traceback, as in a fresh process.
"""

from __future__ import annotations

import engine.run.cpu_threads  # noqa: F401 -- first, as in the scripts: OpenMP's wait policy before torch loads

# isort: split
import json
import os
import sys

import deepspeed  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import transformers.modeling_utils  # noqa: F401
from python_commands import run
from vllm import LLM, SamplingParams  # noqa: F401


def child(request: dict) -> int:
    """Run the request's script in this (forked) process; its exit status."""
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    return run(request["argv"])


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            sys.exit(child(request))  # leaves the loop: the child's interpreter exits here
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
