"""The child side of the code sandbox (engine/rewards/sandbox.py): ``python -I -S sandbox_harness.py SPEC``.

With namespaces (``root`` in SPEC) it unshares fresh mount, PID, network, IPC and UTS namespaces
(inside a new user namespace in "userns" mode) and forks the namespace's init, which builds a private
root (a size-limited tmpfs with the system directories and the interpreter bound read-only, a new
/proc, /dev/null and friends), pivots into it, sets the resource limits, drops to the sandbox uid and
every capability, and only then runs the model's code. The first process waits and exits with it.

SPEC is a JSON file the parent wrote (hidden by the tmpfs before the code runs): ``kind``
("assert": run the code, then evaluate each expression of ``exprs`` and write ``[test id,
repr(value) or null]`` JSON lines to ``record_fd``; "program": run the code as ``__main__`` with
``stdin``), ``code``, ``limits``, ``uid`` (null: keep the uid), ``root`` (null: no namespaces,
run in ``workdir``), ``wall_s`` (the time left to the deadline). The expected values are never
here: the parent compares. Standard library only: this runs under the base interpreter with -I -S.
"""

import builtins
import ctypes
import json
import os
import resource
import select
import signal
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 2, 0x8000, 1, 2, 4
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_PRIVATE = 1 << 18
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (Linux 5.12+)
DEVICES = ("null", "zero", "full", "random", "urandom")
WORKDIR = "/sandbox"  # the code's cwd and HOME inside the private root
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound read-only

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    check(libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def make_readonly(path: str) -> None:
    """Read-only, nosuid, nodev, recursively (mount_setattr); the top mount only on older kernels."""
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    at_fdcwd = ctypes.c_int(-100)
    if libc.syscall(SYS_MOUNT_SETATTR, at_fdcwd, path.encode(), AT_RECURSIVE, attr, ctypes.sizeof(attr)) == 0:
        return
    # A remount must repeat the flags the kernel locked in a user namespace (statvfs ST_* == MS_*).
    kept = os.statvfs(path).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096)
    mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def open_paths(root: dict) -> tuple[int, list[tuple[str, int | str]]]:
    """O_PATH descriptors (in the new mount namespace) of the root's directory and of each directory
    to bind, the system's and this interpreter's (a symlink: its target), opened with the trainer's
    uid: the sandbox uid may not search them (e.g. an interpreter under /root)."""
    system = [path for path in SYSTEM_DIRS if os.path.lexists(path)]
    prefix = os.path.realpath(sys.base_prefix)
    paths = system + ([] if any(prefix.startswith(path + "/") for path in system) else [prefix])
    binds = [(p, os.readlink(p) if os.path.islink(p) else os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in paths]
    return os.open(root["dir"], os.O_PATH | os.O_DIRECTORY), binds


def start_id_mapper(uid: int) -> tuple[int, int]:
    """A helper left outside the user namespace: a root trainer maps the namespace's root to ``uid``
    from there (the namespace cannot map an id other than its creator's from inside)."""
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.read(go_r, 1)  # the parent has unshared
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{os.getppid()}/{name}", "w") as f:
                    f.write(f"0 {uid} 1")
        except OSError:
            os._exit(1)
        os._exit(0)
    os.close(go_r)
    return pid, go_w


def map_ids(mapper: tuple[int, int] | None) -> None:
    """Map the new user namespace's root: to the sandbox uid (a root trainer's mapper), else to us."""
    if mapper is not None:
        pid, go_w = mapper
        os.write(go_w, b"1")
        os.close(go_w)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            raise OSError("could not map the user namespace's ids")
        return
    ids = {"setgroups": "deny", "uid_map": f"0 {os.geteuid()} 1", "gid_map": f"0 {os.getegid()} 1"}
    for name, text in ids.items():
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def enter_namespaces(userns: bool, uid: int | None, wall_s: float) -> int:
    """Unshare the namespaces and fork; only the child (the PID namespace's init) returns, with a
    descriptor that reads EOF once this process (which waits for it, then exits alike) is gone.
    This process dies of SIGALRM after ``wall_s``, so its child and the namespace with it."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    mapper = start_id_mapper(uid) if userns and uid is not None else None
    check(libc.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        map_ids(mapper)
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # dies with this process
        return alive_r
    # The kernel enforces the deadline, however busy the CPUs (the trainer's own kill may run late
    # among a fork bomb's processes); the code cannot cancel another PID namespace's timer.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, max(wall_s, 0.001))  # 0 would disarm it
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # every process in the namespace is gone
    if code < 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent reads a kill as a kill
    os._exit(code)


def build_root(root: dict, root_fd: int, binds: list[tuple[str, int | str]], uid: int) -> None:
    """Mount the private root at root["dir"] (hiding SPEC) and pivot into it; cwd becomes WORKDIR."""
    new = root["dir"]
    mount("tmpfs", f"/proc/self/fd/{root_fd}", "tmpfs", MS_NOSUID | MS_NODEV, f"size={root['disk_mb']}m,mode=755")
    os.close(root_fd)
    for path, source in binds:
        inside = new + path
        os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
        if isinstance(source, str):  # /bin -> usr/bin on merged-/usr systems
            os.symlink(source, inside)
            continue
        os.makedirs(inside, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{source}", inside, None, MS_BIND | MS_REC)
        os.close(source)  # an open directory outside the root would be a way out
        make_readonly(inside)
    os.makedirs(new + "/dev", mode=0o755)
    for name in DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for path, mode in (("/dev/shm", 0o1777), ("/tmp", 0o1777), (WORKDIR, 0o700), ("/proc", 0o555)):
        os.makedirs(new + path)
        os.chmod(new + path, mode)
    os.chown(new + WORKDIR, uid, uid)
    try:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as e:  # e.g. a user namespace under a container that masks parts of /proc
        print(f"sandbox: no /proc ({e})", file=sys.stderr)
    os.chdir(new)
    if SYS_PIVOT_ROOT is None or libc.syscall(SYS_PIVOT_ROOT, b".", b".") != 0:
        os.chroot(".")  # safe too: the code never holds CAP_SYS_CHROOT nor a directory outside
    else:
        check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir(WORKDIR)


def set_limits(limits: dict, shared_uid: bool) -> None:
    """The rlimits, soft = hard. RLIMIT_NPROC counts every process of the uid: with the trainer's
    own uid (no namespaces, not root) the sandbox's allowance comes on top of what runs already."""
    mb = 1024 * 1024
    for which, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    processes = limits["processes"] + (tasks_of(os.getuid()) if shared_uid else 0)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def enter_workdir(workdir: str, uid: int | None) -> None:
    """Without namespaces: a fresh directory beside SPEC, the sandbox uid's if there is one."""
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chmod(os.path.dirname(workdir), 0o711)  # reachable, not listable: SPEC stays root's
        os.chown(workdir, uid, uid)
    os.chdir(workdir)


def drop_privileges(uid: int | None) -> None:
    """Switch to ``uid`` (root only) and drop every capability for good, then no new privileges."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # up to EINVAL past the last one, or EPERM: none held
        cap += 1
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # a change of uid cleared it


def run_assert(code: str, exprs: list[str], record_fd: int) -> None:
    """Run the code, then report repr() of each expression; a test that raises reports null."""
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except Exception:  # a crash after the definitions (e.g. a demo reading stdin) still lets them be tested
        traceback.print_exc(limit=-4)
    for test_id, expr in enumerate(exprs):
        try:
            reported = repr(eval(compile(expr, f"<test {test_id}>", "eval"), namespace))
        except BaseException:
            reported = None
        os.write(record_fd, (json.dumps([test_id, reported]) + "\n").encode())


def feed_stdin(text: str) -> None:
    """``text`` on descriptor 0 (a memfd, filled before RLIMIT_FSIZE applies); sys.stdin reads it."""
    fd = os.memfd_create("stdin")
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 0)
    os.close(fd)


def run_program(code: str) -> None:
    sys.argv = ["solution.py"]
    exec(compile(code, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    root, uid = spec["root"], spec["uid"]
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # dies with the trainer
    alive = -1
    if root is None:
        enter_workdir(spec["workdir"], uid)
    else:
        alive = enter_namespaces(root["userns"], uid, spec["wall_s"])
        root_fd, binds = open_paths(root)
        if root["userns"]:
            if uid is not None:  # become the namespace's root, i.e. the sandbox uid outside
                os.setgroups([])
                os.setresgid(0, 0, 0)
                os.setresuid(0, 0, 0)
            uid = None  # stay the namespace's root (without capabilities): the only uid it maps
        build_root(root, root_fd, binds, uid if uid is not None else os.getuid())
    if spec["kind"] == "program":
        feed_stdin(spec["stdin"])
    set_limits(spec["limits"], shared_uid=root is None and uid is None)
    drop_privileges(uid)
    if alive >= 0:
        if select.select([alive], [], [], 0)[0]:  # the first process died before pdeathsig was set
            os._exit(1)
        os.close(alive)
    if spec["kind"] == "assert":
        run_assert(spec["code"], spec["exprs"], spec["record_fd"])
    else:
        os.close(spec["record_fd"])
        run_program(spec["code"])


if __name__ == "__main__":
    main()
