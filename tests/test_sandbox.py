"""engine/rewards/sandbox.py and code_tests.py: test parsing, counting that the code cannot forge, and containment of
hostile code (real processes, no mocks). Every adversarial run must finish within the wall clock
plus a margin, leave no process and no file behind, and earn only what it passed before it blew up."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from engine.data.errors import DataFileError
from engine.rewards import sandbox
from engine.rewards.code_tests import AssertCase, IoCase, check_column, extract_code, parse_tests
from engine.rewards.sandbox import (
    SandboxLimits,
    UnisolatedError,
    checked_isolation,
    describe_isolation,
    isolation,
    pass_rate,
    run_tests,
)
from engine.rewards.verifiers import code_reward

REPO = Path(__file__).resolve().parent.parent
LIMITS = SandboxLimits(cpu_s=1, wall_s=1.5, memory_mb=256, processes=16, output_kb=64)  # for hostile code
ROOMY = SandboxLimits(cpu_s=5, wall_s=20, memory_mb=256, processes=16, output_kb=64)  # honest code never times out
MARKER = f"escaped-{uuid.uuid4().hex}"  # in the command line of a hostile program's grandchild
MARGIN_S = 2.0  # kill, namespace teardown and clean-up on a 2-core machine that other jobs load too
SQUARES = ["assert f(2) == 4", "assert f(3) == 9"]
MODES = [None, "userns"]  # the best mode here (root: "root"), and a user namespace (a root trainer's sandbox uid)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="measured as root; docs/sandbox.md has the non-root runs")


def score(code: str, tests: list, mode: str | None = None, limits: SandboxLimits = ROOMY) -> sandbox.SandboxResult:
    return run_tests(textwrap.dedent(code), parse_tests(tests), limits, mode)


def sandbox_processes() -> set[tuple[int, float]]:
    """Live processes of a sandbox: the harness and its forks, whatever runs under a sandbox uid, and
    what a hostile program started with MARKER in its command line.
    (Not zombies: dead, they wait for their parent; without a PID namespace that is the machine's init.)"""
    found = set()
    for p in psutil.process_iter(["cmdline", "uids", "create_time", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(p.info["cmdline"] or [])
            if sandbox.HARNESS in cmdline or MARKER in cmdline or p.info["uids"].real >= sandbox.UID_BASE:
                found.add((p.pid, p.info["create_time"]))
        except (psutil.Error, AttributeError):
            continue
    return found


@pytest.fixture
def contained():
    """Fails the test when a sandbox left a process or a temporary directory behind."""
    processes, tmp = sandbox_processes(), set(Path(tempfile.gettempdir()).glob("sandbox-*"))
    yield
    assert sandbox_processes() - processes == set()
    assert set(Path(tempfile.gettempdir()).glob("sandbox-*")) - tmp == set()


# --- parsing ---------------------------------------------------------------------------------------


def test_parse_tests_keeps_the_literal_side_outside():
    cases = parse_tests(["assert f(2) == 4", "assert [1, 'a'] == g(x=-1)", "assert h() == -1.5, 'msg'"])
    assert cases == [AssertCase("f(2)", 4), AssertCase("g(x=-1)", [1, "a"]), AssertCase("h()", -1.5)]
    assert parse_tests('[{"input": "1 2\\n", "output": "3"}]') == [IoCase(stdin="1 2\n", stdout="3")]


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        (5, r"^tests: expected a list or a JSON string holding a list, got int"),
        ("[1,", r"^tests: not JSON"),
        ([], r"^tests: no test cases"),
        (["assert f(1) == 1", "assert f(2)"], r"^tests\[1\]: expected 'assert <expr> == <literal>'"),
        (["assert f(1) == 1; import os"], r"^tests\[0\]: expected 'assert"),
        (["assert f(1) < 2"], r"^tests\[0\]: expected 'assert"),
        (["assert f(1) == g(1)"], r"^tests\[0\]: neither side of == is a literal"),
        (["assert 1 == 1"], r"^tests\[0\]: both sides of == are literals"),
        (["x", "assert f((1) == 2"], r"^tests\[0\]: expected 'assert"),
        (["assert f(1) == 1", "assert f((1) == 2"], r"^tests\[1\]: not Python"),
        ([{"input": "1"}], r"^tests\[0\]: expected exactly the keys 'input' and 'output', got \['input'\]"),
        ([{"input": 1, "output": "2"}], r"^tests\[0\]\.input: expected a string, got int"),
        (["assert f(1) == 1", 3], r"^tests\[1\]: expected an assert string or an input/output object, got int"),
    ],
)
def test_parse_tests_names_the_malformed_item(tests, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(tests)


@pytest.mark.parametrize(
    ("response", "code"),
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
        ("```python\nold = 1\n```\nbetter:\n```py\nnew = 2\n```", "new = 2\n"),
        ("```\nbare = 1\n```", "bare = 1\n"),
        ("```python\nx = 1\n```\n```text\noutput\n```", "x = 1\n"),
        ("def f():\n    return 1", "def f():\n    return 1"),
    ],
)
def test_extract_code_takes_the_last_python_block(response, code):
    assert extract_code(response) == code


# --- counting --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "rate"),
    [("def f(x):\n    return x * x", 1.0), ("def f(x):\n    return x * x if x < 3 else 0", 0.5), ("f = abs", 0.0)],
)
def test_assert_tests_score_the_share_passed(code, rate):
    assert pass_rate(code, parse_tests(SQUARES), ROOMY) == rate


@pytest.mark.parametrize(
    ("code", "rate"),
    [
        ("n = int(input())\nprint(n * n, ' ')", 1.0),  # trailing spaces and newlines do not count
        ("n = int(input())\nprint(n * n if n < 3 else 0)", 0.5),
        ("print(int(input()) + 1)", 0.0),
        ("n = int(input())\nprint(n * n)\nraise SystemExit(1)", 0.0),  # the right output, but a failed run
    ],
)
def test_stdin_stdout_cases_score_the_share_passed(code, rate):
    tests = [{"input": "2\n", "output": "4\n"}, {"input": "3", "output": "9"}]
    assert pass_rate(code, parse_tests(tests), ROOMY) == rate


@pytest.mark.parametrize(
    ("value", "passes"),
    [("1", True), ("1.0", True), ("True", False), ("'1'", False), ("[1, True]", False), ("(1, 1)", False)],
)
def test_reported_values_are_compared_with_types(value, passes):
    """True != 1 and a tuple != a list, at any depth; 1.0 == 1 as in the assert itself."""
    expected = "[1, 1]" if "," in value else "1"
    assert score(f"def f():\n    return {value}", [f"assert f() == {expected}"]).passed == passes


def test_a_run_scores_the_tests_it_reported_before_dying():
    code = "def f(x):\n    return x * x\ndef g():\n    while True:\n        pass"
    result = score(code, ["assert f(2) == 4", "assert g() == 1", "assert f(3) == 9"], limits=LIMITS)
    assert (result.passed, result.total, result.status in ("killed", "timeout")) == (1, 3, True)  # RLIMIT_CPU


# --- reward hacking: no credit without the expected values ------------------------------------------

WRONG = "def f(x):\n    return x + 1\n"
HACKS = {
    "sys.exit(0) first": "import sys\nsys.exit(0)\n" + WRONG,
    "os._exit(0) first": "import os\nos._exit(0)\n" + WRONG,
    "prints success": WRONG + "print('all tests passed')\nprint('[0, \"4\"]')\nprint('[1, \"9\"]')",
    "fake records, then exit": WRONG
    + "import os, sys\nfd = sys._getframe(1).f_locals['record_fd']\n"
    + 'os.write(fd, b\'[0, "True"]\\n[1, "None"]\\n\')\nos._exit(0)',
    "right records, then the harness's": WRONG
    + "import os, sys\nos.write(sys._getframe(1).f_locals['record_fd'], b'[0, \"4\"]\\n[1, \"9\"]\\n')",
    "garbage record voids the run": "def f(x):\n    return x * x\n"
    + "import os, sys\nos.write(sys._getframe(1).f_locals['record_fd'], b'all passed\\n')",
    "patched builtins and harness": WRONG
    + "import builtins, json, sys\nbuiltins.repr = lambda value: 'True'\nbuiltins.eval = lambda *a, **k: True\n"
    + "json.dumps = lambda *a, **k: '[0, \"True\"]'\nsys.modules['__main__'].json = json",
    "__eq__ always True": "class Any:\n    def __eq__(self, other):\n        return True\n"
    + "    __hash__ = object.__hash__\ndef f(x):\n    return Any()",
    "SystemExit in __del__": "class D:\n    def __del__(self):\n        raise SystemExit(0)\nd = D()\ndel d\n" + WRONG,
    "atexit success": "import atexit\natexit.register(print, 'OK: 2/2 passed')\n" + WRONG,
}


@pytest.mark.parametrize("code", HACKS.values(), ids=HACKS.keys())
def test_reward_hacks_get_no_credit(code):
    assert score(code, SQUARES).passed == 0


def test_a_program_that_claims_success_gets_no_credit():
    code = "print('all tests passed')\nimport sys\nsys.exit(0)"
    assert score(code, [{"input": "2", "output": "4"}]).passed == 0


# --- containment -------------------------------------------------------------------------------------

SOLVED = "def f(x):\n    return x * x\n"  # passes SQUARES


def escape(seconds: int, execs: bool = True) -> str:
    """Sleep ``seconds`` beside a double-forked setsid() grandchild that sleeps as long: a Python whose
    command line holds MARKER, or (``execs`` False) the fork itself."""
    grandchild = (
        f'os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep({seconds})", "{MARKER}"])'
        if execs
        else f"time.sleep({seconds})"
    )
    return f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()  # out of the process group
    if os.fork() == 0:
        {grandchild}
    os._exit(0)
time.sleep({seconds})
"""


class Hostile(NamedTuple):
    action: str  # run after SOLVED, before the tests
    tame: str  # the same action within the limits: the run passes both tests
    statuses: set[str]  # of the hostile run
    passed: int  # by the hostile run: 0 when its limit ends the run before the tests


HOSTILE = {
    # RLIMIT_CPU, or the wall clock under load
    "infinite loop": Hostile("while True:\n    pass", "for _ in range(1000):\n    pass", {"killed", "timeout"}, 0),
    "sleep with a setsid() grandchild": Hostile(escape(60), escape(0), {"timeout"}, 0),
    "fork bomb": Hostile(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()",
        {"timeout"},
        0,
    ),
    # RLIMIT_AS: a MemoryError, after which the run goes on and the tests pass
    "memory bomb": Hostile(
        "x = []\nwhile True:\n    x.append(bytearray(50 << 20))", "x = [bytearray(50 << 20)]", {"ok"}, 2
    ),
    "stdout flood": Hostile(
        "import os\nwhile True:\n    os.write(1, b'x' * (1 << 20))",
        "import os\nos.write(1, b'x' * 1024)",
        {"output_limit"},
        0,
    ),
    "stderr flood": Hostile(
        "import sys\nwhile True:\n    sys.stderr.write('x' * (1 << 20))",
        "import sys\nsys.stderr.write('x' * 1024)",
        {"output_limit"},
        0,
    ),
    "record flood": Hostile(
        "import os, sys\nfd = sys._getframe(1).f_locals['record_fd']\nwhile True:\n    os.write(fd, b'[' * 65536)",
        "import os, sys\nfd = sys._getframe(1).f_locals['record_fd']",  # found, left alone
        {"output_limit"},
        0,
    ),
}


# The limits do not depend on the mode: the user namespace reruns only what its PID namespace and uid decide.
RUNS = [(name, None) for name in HOSTILE] + [
    (name, "userns") for name in ("sleep with a setsid() grandchild", "fork bomb")
]


@pytest.mark.parametrize(("name", "mode"), RUNS)
def test_hostile_code_is_contained(name, mode, contained):
    """A solution, then a hostile action: its limit strikes within the wall clock (the status), the run
    earns only what it passed before (the memory bomb's MemoryError lets it go on), and no process is
    left (``contained``: the setsid() grandchild is found by its MARKER). The same action within the
    limits passes both tests: the limit failed the run, not the program."""
    hostile = HOSTILE[name]
    tame = score(SOLVED + hostile.tame, SQUARES, mode, LIMITS)
    assert (tame.passed, tame.status) == (2, "ok"), tame
    start = time.monotonic()
    result = score(SOLVED + hostile.action, SQUARES, mode, LIMITS)
    assert time.monotonic() - start < LIMITS.wall_s + MARGIN_S
    assert (result.passed, result.status in hostile.statuses) == (hostile.passed, True), result


@pytest.mark.parametrize("mode", MODES)
def test_code_cannot_write_outside_its_directory(mode, tmp_path, contained):
    tmp_path.chmod(0o777)  # writable by anyone: only the isolation can keep the code out
    targets = [tmp_path / "escape", Path(tempfile.gettempdir()) / f"escape-{uuid.uuid4().hex}"]
    targets.append(Path("/dev/shm") / f"escape-{uuid.uuid4().hex}")
    code = f"""
        for path in {[str(t) for t in targets]!r} + ["../escape-up", "mine"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
            except OSError:
                pass
        def mine():
            with open("mine") as f:
                return f.read()
    """
    assert score(code, ["assert mine() == 'x'"], mode).passed == 1  # it ran, and wrote in its own directory
    assert [t for t in targets if t.exists()] == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_code_has_no_network(mode, contained):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        code = f"""
            import socket
            def connect():
                try:
                    socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=1).close()
                    return "connected"
                except OSError as e:
                    return str(e)
            def ran():
                return True
        """
        assert score(code, ["assert ran() == True", "assert connect() == 'connected'"], mode).passed == 1
        with pytest.raises(BlockingIOError):
            listener.accept()


LEAK = """
import os
def leak():
    found = [v for v in os.environ.values() if "s3cr3t" in v]
    for pid in [str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found += [v.decode() for v in f.read().split(b"\\0") if b"s3cr3t" in v]
        except OSError:
            pass
    return found[0].split("=")[-1] if found else None
def ran():
    return True
"""


@pytest.mark.parametrize("mode", MODES)
def test_code_cannot_read_the_trainers_environment(mode, contained):
    """A trainer started with a secret in its environment (so its /proc/<pid>/environ holds it too)."""
    trainer = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from engine.rewards.code_tests import parse_tests
from engine.rewards.sandbox import SandboxLimits, run_tests
tests = parse_tests(["assert ran() == True", "assert leak() == 's3cr3t-8d1f'"])
print(run_tests(sys.stdin.read(), tests, SandboxLimits(wall_s=20), {mode!r}).passed)
"""
    env = {**os.environ, "TRAINER_SECRET": "s3cr3t-8d1f"}
    out = subprocess.run(
        [sys.executable, "-c", trainer], input=LEAK, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["1"], out.stderr


def test_concurrent_sandboxes_score_independently(contained):
    codes = ["def f(x):\n    return x * x", "f = abs"] * 2
    rates = [0.0] * len(codes)

    def work(i: int) -> None:
        rates[i] = pass_rate(codes[i], parse_tests(SQUARES), ROOMY)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(codes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rates == [1.0, 0.0, 1.0, 0.0]


def test_a_trivial_response_costs_well_under_half_a_second():
    """In CPU seconds (the trainer's and the sandbox's processes'), which other jobs on the machine
    do not inflate as they do wall time; docs/sandbox.md has the wall time."""
    isolation()  # the one-off probe
    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    for _ in range(5):
        assert pass_rate("def f(x):\n    return x * x", parse_tests(SQUARES), ROOMY) == 1.0
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_s = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)) / 5
    assert 0.0 < cpu_s < 0.25


def test_mode_none_is_refused_unless_allowed(monkeypatch):
    """Where only mode "none" works (the probe's answer forced here; a launched dry run in
    tests/test_dry_run.py), the check refuses it, saying what the code would run with, unless allowed;
    so does each code_reward call in a reward worker, which probes for itself."""
    monkeypatch.setattr(sandbox, "isolation", lambda: "none")
    with pytest.raises(
        UnisolatedError, match=r"would run with the uid of the trainer .*, the host.s network and every file"
    ):
        checked_isolation(allow_unisolated=False)
    assert checked_isolation(allow_unisolated=True) == "none"
    assert describe_isolation("none").startswith("warning: the code sandbox runs without isolation")
    with pytest.raises(UnisolatedError):
        code_reward(SOLVED, SQUARES, cpu_s=1, wall_s=1.0, memory_mb=64, allow_unisolated=False)


@needs_root
def test_isolation_as_root_uses_namespaces_and_a_sandbox_uid():
    assert isolation() == "root"
    assert score("import os\ndef uid():\n    return os.getuid()", ["assert uid() == 0"]).passed == 0


@needs_root
def test_without_namespaces_the_limits_and_the_uid_still_hold(contained):
    """Mode "none" (the fallback): scoring, the CPU limit, and, for a root trainer, the sweep of
    the sandbox uid's processes that left the process group. (Here the sandbox uid cannot read the
    interpreter's standard library under /root, so the code imports only what the harness loaded.)"""
    assert score("def f(x):\n    return x * x", SQUARES, "none").passed == 2
    assert score("while True:\n    pass", SQUARES, "none", LIMITS).status in ("killed", "timeout")
    start = time.monotonic()
    result = score(SOLVED + escape(60, execs=False), SQUARES, "none", LIMITS)
    assert (result.passed, result.status) == (0, "timeout")
    assert time.monotonic() - start < LIMITS.wall_s + MARGIN_S


NOBODY = '''
import os, socket, sys
sys.path.insert(0, sys.argv[1])
from engine.rewards.code_tests import parse_tests
from engine.rewards.sandbox import SandboxLimits, isolation, run_tests
listener = socket.create_server(("127.0.0.1", 0))
code = f"""
import os, socket
def f(x):
    return x * x
def uid():
    return os.getuid()
def net():
    try:
        socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), timeout=1)
        return "connected"
    except OSError:
        return "refused"
"""
tests = parse_tests(["assert f(2) == 4", "assert uid() == 65534", "assert net() == 'connected'"])
limits = SandboxLimits(cpu_s=5, wall_s=20, memory_mb=256)
print(os.getuid(), isolation(), *(run_tests(code, tests, limits, mode).passed for mode in ("userns", "none")))
'''


def closed_ancestor(path: str) -> Path | None:
    """The topmost directory above ``path`` (not /) that other users may not enter, if any."""
    return next((p for p in reversed(Path(path).parents[:-1]) if not p.stat().st_mode & stat.S_IXOTH), None)


@needs_root
@pytest.mark.skipif(not (shutil.which("unshare") and shutil.which("setpriv")), reason="needs util-linux")
def test_as_a_non_root_trainer(tmp_path):
    """As uid 65534: user namespaces here, so mode "userns" with no network; mode "none" has the network
    (and runs as the trainer's uid). That trainer runs a world-readable copy of engine/ under the base
    interpreter with the standard library only (-I -S, as the harness does), so the test does not depend
    on where the checkout and its virtualenv live; an interpreter under a directory that uid may not
    enter (e.g. /root) is bound back into a private mount namespace so that it can run it."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    script_dir = Path(tempfile.mkdtemp())  # pytest's tmp_path is not reachable for uid 65534
    try:
        shutil.copytree(REPO / "engine", script_dir / "engine", ignore=shutil.ignore_patterns("__pycache__"))
        (script_dir / "nobody.py").write_text(NOBODY)
        for path in [script_dir, *script_dir.rglob("*")]:  # whatever the umask and the checkout's modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        closed = closed_ancestor(prefix)
        view = tmp_path / "prefix"
        view.mkdir()
        rebind = (
            f'mount --bind "{prefix}" "{view}" && mount -t tmpfs -o mode=755 tmpfs "{closed}" && '
            f'mkdir -p "{prefix}" && mount --bind "{view}" "{prefix}" && '
            if closed
            else ""
        )
        run_as_nobody = "setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps=-all --bounding-set=-all"
        command = f"{rebind}exec {run_as_nobody} {python} -I -S {script_dir / 'nobody.py'} {script_dir}"
        unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", command]
        out = subprocess.run(unshare, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(script_dir)
    assert out.stdout.split() == ["65534", "userns", "1", "3"], out.stderr


def test_a_data_file_with_malformed_tests_is_refused_by_row():
    check_column("p.parquet", "tests", [["assert f(1) == 2"], '[{"input": "1", "output": "2"}]'])
    with pytest.raises(DataFileError, match=r"p.parquet\[row 1\]: column 'tests': tests\[0\]: "):
        check_column("p.parquet", "tests", [["assert f(1) == 2"], ["assert f(1)"]])
