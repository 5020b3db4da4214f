"""Run model-written Python against tests in a sandbox; count the share passed outside it, where the
code cannot reach: expected values never enter the sandbox. The parent keeps the literal side of each
``assert <expr> == <literal>``; the child (sandbox_harness.py) runs the code and reports
``repr(<expr>)``; the parent compares ``ast.literal_eval(reported)`` with the literal. A stdin/stdout
case runs the program once and the parent compares its output. Exiting early, printing "passed",
patching builtins or an ``__eq__`` that is always True earn nothing. Isolation: docs/sandbox.md; a
caller that scores code refuses mode "none" unless allowed (:func:`checked_isolation`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple

from engine.rewards.code_tests import AssertCase, IoCase, TestCase, normalise, score_records
from engine.run import faults

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
MODES = ("root", "userns", "none")  # strongest first; see isolation()
UID_BASE = 1 << 30  # sandbox uids: UID_BASE + 256 * (pid mod 2**22) + (call mod 256), unique per live sandbox
_calls = itertools.count()
CONTAINED = {  # what the namespaced modes keep from the code (docs/sandbox.md, "What holds, by mode")
    "root": "namespaces and a uid of its own: no network, a private root with the system directories read-only",
    "userns": "a user namespace: no network, a private root with the system directories read-only",
}
EXPOSED = (  # what the code runs with in mode "none"
    "the uid of the trainer or reward server (if that is root: a uid of its own), the host's network and every "
    "file that uid may read or write (the checkout, the run's outputs, /tmp, /dev/shm)"
)


class UnisolatedError(RuntimeError):
    """Only mode "none" works here, and running the code without isolation was not allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # RLIMIT_CPU, per process
    wall_s: float = 10.0  # wall clock for the whole response; then the whole process tree is killed
    memory_mb: int = 1024  # RLIMIT_AS, per process
    file_size_mb: int = 8  # RLIMIT_FSIZE
    processes: int = 32  # RLIMIT_NPROC: processes and threads of the sandbox
    output_kb: int = 256  # stdout/stderr read per run; more is cut and the run killed
    disk_mb: int = 64  # size of the private tmpfs holding the working directory and /tmp


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    total: int
    status: str  # "ok", or the first of "error", "killed", "timeout", "output_limit" among the runs
    stderr: str  # the tail of the last run's stderr, for logs


class _Run(NamedTuple):
    records: bytes
    stdout: bytes
    stderr: bytes
    status: str


def pass_rate(code: str, tests: list[TestCase], limits: SandboxLimits = SandboxLimits()) -> float:
    """Share of tests passed (0.0 .. 1.0), counted in the parent process."""
    result = run_tests(code, tests, limits)
    return result.passed / result.total


def run_tests(
    code: str, tests: list[TestCase], limits: SandboxLimits = SandboxLimits(), mode: str | None = None
) -> SandboxResult:
    """Run ``code`` against ``tests``: one run for all assert tests, one per stdin/stdout case, all
    within ``limits.wall_s``. ``mode`` forces an isolation mode (tests); None takes isolation()."""
    if not tests:
        raise ValueError("no tests to run")
    mode = mode or isolation()
    deadline = time.monotonic() + limits.wall_s
    asserts = [(i, t) for i, t in enumerate(tests) if isinstance(t, AssertCase)]
    passed = [False] * len(tests)
    runs: list[_Run] = []
    if asserts:
        runs.append(_run_once(mode, "assert", code, [t.expr for _, t in asserts], "", limits, deadline))
        for (i, _), ok in zip(asserts, score_records(runs[-1].records, [t for _, t in asserts])):
            passed[i] = ok
    for i, case in enumerate(tests):
        if isinstance(case, IoCase):
            runs.append(_run_once(mode, "program", code, [], case.stdin, limits, deadline))
            got = runs[-1].stdout.decode(errors="replace")
            passed[i] = runs[-1].status == "ok" and normalise(got) == normalise(case.stdout)
    status = next((run.status for run in runs if run.status != "ok"), "ok")
    stderr = runs[-1].stderr[-2000:].decode(errors="replace") if runs else ""
    return SandboxResult(passed=sum(passed), total=len(tests), status=status, stderr=stderr)


class ProgramRun(NamedTuple):
    stdout: str
    stderr: str  # its tail
    status: str  # as SandboxResult's


def run_program(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> ProgramRun:
    """Run ``code`` as a program reading ``stdin`` (a tool's call): what it printed, within ``limits``.
    :class:`UnisolatedError` where no namespaces can be made: a tool has no key to accept that."""
    mode = checked_isolation(allow_unisolated=False)
    run = _run_once(mode, "program", code, [], stdin, limits, time.monotonic() + limits.wall_s)
    stderr = run.stderr[-2000:].decode(errors="replace")
    return ProgramRun(run.stdout.decode(errors="replace"), stderr, run.status)


def checked_isolation(allow_unisolated: bool) -> str:
    """:func:`isolation`, where "none" is refused (:class:`UnisolatedError`, saying what it exposes)
    unless ``allow_unisolated``."""
    mode = isolation()
    if mode == "none" and not allow_unisolated:
        raise UnisolatedError(
            "the code sandbox cannot create namespaces here (neither as root nor in a user namespace: the probe's "
            f"errors are above), so model-written code would run with {EXPOSED}; allow user namespaces or run as root "
            "(docs/sandbox.md)"
        )
    return mode


def describe_isolation(mode: str) -> str:
    """``mode`` in one line for the logs: what it keeps from the code, or for "none" a warning saying what
    the code can reach."""
    if mode == "none":
        return f"warning: the code sandbox runs without isolation here: model-written code runs with {EXPOSED}"
    return f"code sandbox: {mode} ({CONTAINED[mode]})"


@functools.cache
def isolation() -> str:
    """The strongest mode that works here, found by running a probe: "root" (namespaces, per-sandbox
    uid; the trainer is root), "userns" (namespaces inside a user namespace), else "none"."""
    if faults.no_namespaces():
        print("sandbox: modes root and userns refused by RLHF_FAULTS no_namespaces", file=sys.stderr)
        return "none"
    errors = []
    for mode in MODES if sys.platform == "linux" else ("none",):
        if mode == "root" and os.geteuid() != 0:
            continue
        code = "import fractions\nx = fractions.Fraction(2)"  # a module the harness has not loaded
        probe = _run_once(mode, "assert", code, ["int(x + 1)"], "", SandboxLimits(), time.monotonic() + 30)
        if score_records(probe.records, [AssertCase("int(x + 1)", 3)]) == [True]:
            return mode
        errors.append(f"{mode}: {probe.status} {probe.stderr[-300:].decode(errors='replace')}")
        print(f"sandbox: mode {errors[-1]}", file=sys.stderr)
    raise RuntimeError(f"the code sandbox cannot run here ({'; '.join(errors)})")


def _run_once(
    mode: str, kind: str, code: str, exprs: list[str], stdin: str, limits: SandboxLimits, deadline: float
) -> _Run:
    """One sandboxed process (tree) in a fresh temporary directory, killed at ``deadline``."""
    if deadline <= time.monotonic():
        return _Run(b"", b"", b"", "timeout")
    # A uid no other live sandbox has (from a root trainer): RLIMIT_NPROC counts this sandbox only.
    uid = UID_BASE + 256 * (os.getpid() % (1 << 22)) + next(_calls) % 256 if os.geteuid() == 0 else None
    tmp = tempfile.mkdtemp(prefix="sandbox-")
    read_end, write_end = os.pipe()
    try:
        root = None if mode == "none" else {"dir": tmp, "disk_mb": limits.disk_mb, "userns": mode == "userns"}
        spec: dict[str, object] = {"kind": kind, "code": code, "exprs": exprs, "stdin": stdin, "uid": uid}
        spec |= {"root": root, "workdir": os.path.join(tmp, "work"), "record_fd": write_end}
        spec |= {"limits": limits.__dict__, "wall_s": deadline - time.monotonic()}
        with open(os.path.join(tmp, "spec.json"), "w") as f:  # hidden under the sandbox's root before the code runs
            json.dump(spec, f)
        proc = _start(mode, f.name, write_end)
        os.close(write_end)
        write_end = -1  # the harness holds the only write end: EOF once every process of it is gone
        assert proc.stdout and proc.stderr
        streams = {"records": read_end, "stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno()}
        out, stop = _collect(streams, deadline, limits.output_kb * 1024)
        if not stop:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:  # it closed its pipes and went on
                stop = "timeout"
        if stop:
            _kill(proc, mode)
        proc.wait()
        if uid is not None and (mode == "none" or proc.returncode < 0):
            _kill_uid(uid)  # what left the process group (no namespaces), or still dies with a killed harness
        proc.stdout.close()
        proc.stderr.close()
        status = stop or _status(proc.returncode)
        return _Run(bytes(out["records"]), bytes(out["stdout"]), bytes(out["stderr"]), status)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
        _remove(tmp)


def _status(returncode: int) -> str:
    if returncode == -signal.SIGALRM:  # the harness's own deadline (with namespaces)
        return "timeout"
    return "ok" if returncode == 0 else "killed" if returncode < 0 else "error"


def _start(mode: str, spec_path: str, record_fd: int) -> subprocess.Popen:
    """The harness under the base interpreter, isolated (-I: no user site, no PYTHON* variables; -S:
    no site-packages, the standard library only), in a clean environment."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    home = "/sandbox" if mode != "none" else os.path.join(os.path.dirname(spec_path), "work")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp" if mode != "none" else home}
    env |= {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONSAFEPATH": "1"}  # for Pythons it starts
    return subprocess.Popen(
        [python, "-I", "-S", "-B", HARNESS, spec_path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(record_fd,),
        env=env,
        start_new_session=mode == "none",
    )


def _collect(streams: dict[str, int], deadline: float, cap: int) -> tuple[dict[str, bytearray], str | None]:
    """Read every stream to its end; stop with "timeout" at ``deadline`` or "output_limit" past ``cap`` bytes."""
    out = {name: bytearray() for name in streams}
    total = 0
    with selectors.DefaultSelector() as selector:
        for name, fd in streams.items():
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ, name)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return out, "timeout"
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                total += len(chunk)
                if total > cap:
                    return out, "output_limit"
                if not chunk:
                    selector.unregister(key.fd)
                out[key.data] += chunk
    return out, None


def _kill(proc: subprocess.Popen, mode: str) -> None:
    """SIGKILL the whole tree: without namespaces, the process group; with them, the PID namespace's
    init, through a pidfd so a recycled pid is never hit (every process in the namespace dies with
    it, setsid() or not), then the harness's first process, which exits once the namespace is gone."""
    try:
        if mode == "none":
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _children(proc.pid) if mode != "none" else []:
            pidfd = os.pidfd_open(pid)
            try:
                if pid in _children(proc.pid):  # still the harness's child, so pidfd is the init
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass
    proc.kill()


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process of a sandbox uid until none is left (a fork may race one sweep)."""
    for _ in range(100):
        pids = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError, IndexError), open(f"/proc/{name}/stat") as f:
                zombie = f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # a kill cannot remove it
                if not zombie and os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            return
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _remove(path: str) -> None:
    """Remove a temporary directory, even one whose code made subdirectories unreadable."""
    for parent, dirs, _ in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
