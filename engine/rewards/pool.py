"""A pool of reward worker processes (``engine/rewards/worker.py``) that calls reward functions
outside the trainer's process, each call with its own timeout.

A batch of calls is spread over the workers, one call per worker at a time. A call that raises
gives its traceback; a call that runs past its timeout, or a worker that dies, gets its worker
killed (its whole process group) and replaced, and that call alone fails: the batch goes on.
Functions are named ``"module:function"`` and imported in the workers, which start in the
trainer's working directory with it on their import path. Each worker imports the pool's ``imports``
when it starts (the warm-up), so no call's timeout pays for a slow import; :meth:`RewardPool.warm_up`
waits for it, with a timeout, before the first batch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any


@dataclass(frozen=True)
class Call:
    """One reward-function call: ``function(*args, **kwargs)`` within ``timeout_s`` seconds."""

    function: str  # "module:function"
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    structured: bool = False  # the value is any JSON value (an environment's reply), not a finite number


@dataclass(frozen=True)
class Outcome:
    """A call's value, or why there is none (``error``: the traceback or what happened)."""

    value: Any  # a float (a structured call's: any JSON value); None when there is none
    error: str | None = None
    timed_out: bool = False


class _Worker:
    def __init__(self, imports: Sequence[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.rewards.worker", *imports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # stdout unbuffered: what select() sees is all there is, besides ``received``
            start_new_session=True,  # its own process group: a kill takes what the function started
            env=env,
        )
        self.stdin: IO[bytes] = io.BufferedWriter(self.process.stdin)  # type: ignore[type-var]
        self.stdout: IO[bytes] = self.process.stdout  # type: ignore[assignment]
        self.received = bytearray()  # read from stdout, not yet taken as lines
        self.warming = True  # until its ready line is read

    def send(self, request: dict[str, Any]) -> None:
        self.stdin.write((json.dumps(request) + "\n").encode())
        self.stdin.flush()

    def receive(self) -> bool:
        """Read what its stdout holds (once select() saw it readable); False at its end (it died).
        One read, not a byte-at-a-time ``readline()`` of the unbuffered pipe."""
        chunk = os.read(self.stdout.fileno(), 1 << 16)
        self.received += chunk
        return bool(chunk)

    def take_line(self) -> dict[str, Any] | None:
        """The next whole line received, parsed; None when there is none yet."""
        end = self.received.find(b"\n")
        if end < 0:
            return None
        line = bytes(self.received[: end + 1])
        del self.received[: end + 1]
        return json.loads(line)

    def read_line(self, deadline: float) -> dict[str, Any] | None:
        """The next line it writes, parsed; None when none comes by ``deadline`` or it died."""
        while (line := self.take_line()) is None:
            with selectors.DefaultSelector() as selector:
                selector.register(self.stdout, selectors.EVENT_READ)
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())) or not self.receive():
                    return None
        return line

    def wait_ready(self, timeout_s: float) -> tuple[str, str] | None:
        """Wait for its warm-up: None when it imported everything, else (module, why not)."""
        deadline, module = time.monotonic() + timeout_s, "?"
        while self.warming:
            line = self.read_line(deadline)
            if line is None:
                code = self.process.poll()
                return module, f"not imported within {timeout_s:g} s" if code is None else f"exit code {code}"
            if "importing" in line:
                module = line["importing"]
                continue
            self.warming = False
            if not line["ready"]:
                return line["module"], line["error"].strip().splitlines()[-1]
        return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        with contextlib.suppress(OSError):  # a request it did not take: its buffer cannot be flushed
            self.stdin.close()
        self.stdout.close()


class RewardPool:
    """``size`` worker processes importing ``imports`` (modules) when they start; :meth:`warm_up`,
    then :meth:`run` batches of calls, :meth:`close` at the end. A worker's warm-up or :meth:`check`
    waits at most ``import_timeout_s``."""

    def __init__(self, size: int, imports: Sequence[str] = (), import_timeout_s: float = 120.0):
        self.imports, self.import_timeout_s = list(dict.fromkeys(imports)), import_timeout_s
        self.workers = [_Worker(self.imports) for _ in range(size)]

    def warm_up(self) -> tuple[str, str] | None:
        """Wait for every worker's imports: None, or (module, why not) for the first that failed."""
        for worker in self.workers:
            if failed := worker.wait_ready(self.import_timeout_s):
                return failed
        return None

    def run(self, calls: Sequence[Call], slots: Sequence[int] | None = None) -> list[Outcome]:
        """The outcome of every call, in order; each call fails alone (error, timeout, dead worker).
        ``slots``: the worker each call must run in (an episode's calls go to the worker holding it)."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, deadline)
        selector = selectors.DefaultSelector()
        try:
            while pending or busy:
                for slot, worker in enumerate(self.workers):
                    if slot in busy:
                        continue
                    i = next((i for i in pending if slots is None or slots[i] == slot), None)
                    if i is not None:
                        pending.remove(i)
                        call = calls[i]
                        request = {"id": i, "function": call.function, "args": call.args, "kwargs": call.kwargs}
                        try:
                            worker.send(request | ({"structured": True} if call.structured else {}))
                        except (BrokenPipeError, OSError):  # died since its last call: replace it, retry the call
                            self._replace(slot)
                            pending.appendleft(i)
                            continue
                        busy[slot] = (i, time.monotonic() + call.timeout_s)
                        selector.register(worker.stdout, selectors.EVENT_READ, slot)
                if not busy:
                    continue
                for slot, reply in self._replies(busy, selector):
                    if reply is not None and "id" not in reply:  # a new worker's warm-up: the reply is to come
                        self.workers[slot].warming = "importing" in reply
                        continue
                    i, _ = busy.pop(slot)
                    selector.unregister(self.workers[slot].stdout)
                    if reply is not None:
                        outcomes[i] = Outcome(reply.get("value"), reply.get("error"))
                    else:
                        code = self.workers[slot].process.wait()
                        outcomes[i] = Outcome(None, f"the reward worker died (exit code {code}) during this call")
                        self._replace(slot)
                now = time.monotonic()
                for slot, (i, deadline) in list(busy.items()):
                    if now >= deadline:
                        busy.pop(slot)
                        selector.unregister(self.workers[slot].stdout)
                        outcomes[i] = Outcome(None, f"timed out after {calls[i].timeout_s:g} s", timed_out=True)
                        self._replace(slot)
        finally:
            selector.close()
        return [o for o in outcomes if o is not None]

    def _replies(
        self, busy: dict[int, tuple[int, float]], selector: selectors.BaseSelector
    ) -> list[tuple[int, dict[str, Any] | None]]:
        """(slot, line) of busy workers with a whole line, received already or within the earliest
        deadline; the line None where the worker died."""
        held = [(slot, self.workers[slot].take_line()) for slot in busy]
        ready: list[tuple[int, dict[str, Any] | None]] = [(slot, line) for slot, line in held if line is not None]
        if ready:
            return ready
        timeout = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
        for key, _ in selector.select(timeout=timeout):
            slot = key.data
            if not self.workers[slot].receive():
                ready.append((slot, None))
            elif (line := self.workers[slot].take_line()) is not None:
                ready.append((slot, line))
        return ready

    def check(self, function: str, positional: int, keywords: Sequence[str]) -> str | None:
        """None when a worker can import ``function`` and call it with ``positional`` arguments and
        ``keywords``; else the reason (the last line of the error)."""
        worker = self.workers[0]
        if failed := worker.wait_ready(self.import_timeout_s):
            self._replace(0)
            return f"the reward worker's warm-up failed: {failed[0]}: {failed[1]}"
        worker.send({"id": 0, "check": function, "args": positional, "kwargs": list(keywords)})
        reply = worker.read_line(time.monotonic() + self.import_timeout_s)
        if reply is None:
            self._replace(0)
            return f"the reward worker died or took more than {self.import_timeout_s:g} s importing it"
        error = reply.get("error")
        return error.strip().splitlines()[-1] if error else None

    def _replace(self, slot: int) -> None:
        """A new worker in ``slot``: its first call's timeout includes its warm-up."""
        self.workers[slot].kill()
        self.workers[slot] = _Worker(self.imports)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
