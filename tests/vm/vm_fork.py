"""BUNSHIN_IOC_FORK, checked inside the lab VM (run by tests/test_vm.py through ``bunshin vm run``).

A source process in its own pid and mount namespaces, holding 64 MiB of written anonymous memory
and appending a counter to a log file, is frozen with the cgroup v2 freezer and forked into the
namespaces of a target (another set of pid, mount, UTS, IPC and network namespaces). The child
must land in the target's pid namespace under the target's init, share the 64 MiB copy-on-write,
and continue the source's loop where it was frozen.

The ioctl is issued with fcntl (the C extension's build directory is not visible in the VM).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import signal
import struct
import time
from pathlib import Path

import pytest
from vm_module import (
    _BAD_KERNEL_LOG,
    _D,
    _IOC_READ,
    _IOC_WRITE,
    CAP_CHECKPOINT_RESTORE,
    DEVICE,
    MAGIC,
    UAPI,
    _ioc,
    errno_of,
    in_child,
    kernel_log,
    load_module,
    module_loaded,
    set_effective_caps,
    unload_module,
    version,
)

pytestmark = pytest.mark.skipif(os.environ.get("BUNSHIN_VM") != "1" or os.geteuid() != 0,
                                reason="runs only as root inside the lab VM (bunshin vm run)")

# struct bunshin_fork_req: flags (u32), source_pid, target_pidfd, child_pid (s32), source_ns (u64),
# cgroup_fd, group_pidfd (s32), reserved[4] (u64).
FORK_FMT = "=IiiiQii4Q"
FORK_SIZE = struct.calcsize(FORK_FMT)
assert FORK_SIZE == 64
IOC_FORK = _ioc(_IOC_READ | _IOC_WRITE, 0x01, FORK_SIZE)
assert "_IOWR(BUNSHIN_IOC_MAGIC, 0x01, struct bunshin_fork_req)" in _D["BUNSHIN_IOC_FORK"]
assert MAGIC == 0xBB and UAPI.exists()
FEATURE_FORK = 1 << 2
FEATURE_FORK_CGROUP, FEATURE_FORK_SESSION, FEATURE_FORK_FILES = 1 << 3, 1 << 4, 1 << 5
assert _D["BUNSHIN_FEATURE_FORK"] == "(1ULL << 2)"
assert (_D["BUNSHIN_FEATURE_FORK_CGROUP"], _D["BUNSHIN_FEATURE_FORK_SESSION"], _D["BUNSHIN_FEATURE_FORK_FILES"]) == (
    "(1ULL << 3)", "(1ULL << 4)", "(1ULL << 5)")
FORK_CGROUP, FORK_SETSID, FORK_JOIN_GROUP, FORK_REOPEN_FILES = 1 << 0, 1 << 1, 1 << 2, 1 << 3
assert [_D[f"BUNSHIN_FORK_{n}"] for n in ("CGROUP", "SETSID", "JOIN_GROUP", "REOPEN_FILES")] == [
    "(1U << 0)", "(1U << 1)", "(1U << 2)", "(1U << 3)"]

MIB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)


def fork_ioctl(fd: int, source_pid: int, target_pidfd: int, *, flags: int = 0, cgroup_fd: int = 0,
               group_pidfd: int = 0, reserved: tuple[int, ...] = (0,) * 4) -> tuple[int, int]:
    """BUNSHIN_IOC_FORK; returns (child_pid, source_ns)."""
    buf = bytearray(struct.pack(FORK_FMT, flags, source_pid, target_pidfd, 0, 0, cgroup_fd, group_pidfd, *reserved))
    fcntl.ioctl(fd, IOC_FORK, buf)
    out = struct.unpack(FORK_FMT, buf)
    assert out[:3] == (flags, source_pid, target_pidfd) and out[5:] == (cgroup_fd, group_pidfd, *reserved)
    return out[3], out[4]


# --- processes in namespaces -------------------------------------------------------------------


def spawn_in_namespaces(flags: int, main) -> tuple[int, int]:
    """Fork a helper that unshares *flags* and forks the namespaces' init, which runs *main()*.

    Returns (helper_pid, init_pid), both in the caller's pid namespace. The helper waits for the
    init and exits with it."""
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(r)
            if _libc.unshare(flags) != 0:
                os._exit(97)
            if flags & CLONE_NEWNS:
                _libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None)  # MS_PRIVATE | MS_REC
            init = os.fork()
            if init == 0:
                os.close(w)
                try:
                    main()
                finally:
                    os._exit(0)
            os.write(w, str(init).encode())
            os.close(w)
            os.waitpid(init, 0)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    assert data, "the namespace helper failed"
    return helper, int(data)


def source_main(log: str, mib: int, threads: int = 1) -> None:
    """The source: touch *mib* MiB, then append "pid pidns counter" to *log* every 20 ms."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    buf = bytearray(b"\x5a") * (mib * MIB)  # written anonymous memory
    if threads > 1:
        import threading

        for _ in range(threads - 1):
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    i = 0
    while True:
        i += 1
        os.write(fd, f"{os.getpid()} {os.readlink('/proc/self/ns/pid')} {i} {buf[i]}\n".encode())
        time.sleep(0.02)


def target_main() -> None:
    """The target's init: reaps every child automatically and waits."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        signal.pause()


class Procs:
    """Processes started by a test, killed (and their helpers reaped) at the end."""

    def __init__(self) -> None:
        self.helpers: list[int] = []
        self.kill: list[int] = []

    def spawn(self, flags: int, main) -> int:
        helper, init = spawn_in_namespaces(flags, main)
        self.helpers.append(helper)
        self.kill.append(init)
        return init

    def close(self) -> None:
        for pid in self.kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self.helpers:
            os.waitpid(pid, 0)


def make_cgroup(name: str) -> Path:
    cg = CGROUP / name
    cg.mkdir(exist_ok=True)
    return cg


def freeze(cg: Path, frozen: bool = True) -> None:
    (cg / "cgroup.freeze").write_text("1" if frozen else "0")
    want = f"frozen {int(frozen)}"
    for _ in range(1000):
        if want in (cg / "cgroup.events").read_text().splitlines():
            return
        time.sleep(0.005)
    raise AssertionError(f"{cg} did not reach '{want}'")


SYS_CLOCK_NANOSLEEP = 230  # x86-64: what time.sleep() waits in


def freeze_between_lines(cg: Path, pid: int) -> None:
    """Freeze *cg* with its source *pid* (source_main) asleep between two log lines.

    A freeze stops a task at its next return to user space, which may be after the source read
    its pid namespace for a line and before it wrote it: a child forked there first writes that
    line, the source's pid namespace in it, so its own lines seem to start a counter late
    (seen as "(last 4, first child line 6)"). Freeze again until the source is in its sleep."""
    for _ in range(200):
        freeze(cg)
        if Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(SYS_CLOCK_NANOSLEEP):
            return
        freeze(cg, False)
        time.sleep(0.003)
    raise AssertionError(f"source {pid} was never frozen in its sleep between two lines")


def remove_cgroup(cg: Path) -> None:
    """Thaw *cg*, kill what is in it and remove it (its killed tasks may keep it busy a moment)."""
    if not cg.exists():
        return
    freeze(cg, False)
    for _ in range(500):
        for pid in (cg / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            cg.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        time.sleep(0.01)
    cg.rmdir()


def status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


def rollup(pid: int) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+):\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup")
                                                 .read_text(), re.MULTILINE)}


def wait_lines(log: Path, pred, timeout: float = 20.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = log.read_text()
        except FileNotFoundError:  # the source has not opened it yet
            text = ""
        lines = [ln.split() for ln in text.splitlines() if ln.count(" ") == 3]
        if pred(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def loaded_module():
    ko = os.environ.get("BUNSHIN_KO")
    assert ko and os.path.exists(ko), "BUNSHIN_KO must name the built bunshin.ko (bunshin vm run sets it)"
    if module_loaded():
        unload_module()
    load_module(ko)
    for _ in range(100):
        if os.path.exists(DEVICE):
            break
        time.sleep(0.01)
    yield ko
    if module_loaded():
        unload_module()


@pytest.fixture
def dev():
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def world(procs: Procs, scratch: Path):
    """(source_pid, target_init_pid, target_pidfd, cgroup, log): a running source (not frozen yet)
    in its own pid+mount namespaces and cgroup, and a target init in five new namespaces."""
    log = scratch / "log"
    cg = make_cgroup(f"bunshin-src-{os.getpid()}-{time.monotonic_ns()}")
    source = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: source_main(str(log), 64))
    (cg / "cgroup.procs").write_text(str(source))
    target = procs.spawn(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET, target_main)
    pidfd = os.pidfd_open(target)
    wait_lines(log, lambda lines: len(lines) >= 3)
    try:
        yield source, target, pidfd, cg, log
    finally:
        os.close(pidfd)
        remove_cgroup(cg)


# --- the tests ---------------------------------------------------------------------------------


def test_fork_feature(dev: int) -> None:
    assert version(dev)[2] & FEATURE_FORK, kernel_log()[-2000:]


def test_fork_into_target(dev: int, world) -> None:
    source, target, pidfd, cg, log = world
    freeze_between_lines(cg, source)
    before = wait_lines(log, lambda lines: True)
    last = max(int(f[2]) for f in before)
    t0 = time.perf_counter()
    child, source_ns = fork_ioctl(dev, source, pidfd)
    elapsed = time.perf_counter() - t0
    print(f"fork of a 64 MiB source: ioctl {elapsed * 1e3:.2f} ms, in the source {source_ns / 1e6:.2f} ms")
    try:
        assert child > 0 and child not in (source, target)
        st = status(child)
        nspid = st["NSpid"].split()
        assert nspid[0] == str(child) and len(nspid) == 2  # one level below ours: the target's
        assert os.readlink(f"/proc/{child}/ns/pid") == os.readlink(f"/proc/{target}/ns/pid")
        for ns in ("mnt", "net", "uts", "ipc", "cgroup", "time"):
            assert os.readlink(f"/proc/{child}/ns/{ns}") == os.readlink(f"/proc/{target}/ns/{ns}"), ns
        assert os.readlink(f"/proc/{child}/ns/pid") != os.readlink(f"/proc/{source}/ns/pid")
        assert os.readlink(f"/proc/{child}/ns/mnt") != os.readlink(f"/proc/{source}/ns/mnt")
        assert int(st["PPid"]) == target  # the target's init
        # Frozen with the source's cgroup (once it has run into the freezer: it may still be "R").
        wait_for(lambda: status(child)["State"].startswith("S"), timeout=5, what="the child to freeze")
        # The 64 MiB are shared copy-on-write with the source.
        r = rollup(child)
        assert r["Rss"] >= 64 * 1024, r
        assert r["Pss"] < 0.6 * r["Rss"], r
        # Thawed, the child continues the source's loop where it was frozen.
        freeze(cg, False)
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        lines = wait_lines(log, lambda lines: sum(f[1] == target_ns for f in lines) >= 3)
        mine = [f for f in lines if f[1] == target_ns]
        assert len(mine) >= 3, lines[-10:]
        assert {f[0] for f in mine} == {nspid[1]}
        counters = [int(f[2]) for f in mine]
        assert counters[0] == last + 1 and counters == sorted(counters), (last, counters)
        assert {f[3] for f in mine} == {str(0x5A)}
        src_after = [int(f[2]) for f in lines if f[1] != target_ns and int(f[2]) > last]
        assert src_after and src_after[0] == last + 1  # the source resumed too
    finally:
        os.kill(child, signal.SIGKILL)


def test_unknown_source_is_esrch(dev: int, world) -> None:
    _source, _target, pidfd, _cg, _log = world
    assert errno_of(lambda: fork_ioctl(dev, 4_000_000, pidfd)) == errno.ESRCH
    assert errno_of(lambda: fork_ioctl(dev, 0, pidfd)) == errno.ESRCH


def test_source_not_frozen_is_ebusy(dev: int, world) -> None:
    source, _target, pidfd, _cg, _log = world
    assert errno_of(lambda: fork_ioctl(dev, source, pidfd)) == errno.EBUSY


def test_target_not_a_pidfd_is_ebadf(dev: int, world) -> None:
    source, _target, _pidfd, cg, _log = world
    freeze(cg)
    assert errno_of(lambda: fork_ioctl(dev, source, dev)) == errno.EBADF
    assert errno_of(lambda: fork_ioctl(dev, source, -1)) == errno.EBADF


def test_multithreaded_source_is_einval(dev: int, procs: Procs, scratch: Path) -> None:
    log = scratch / "log"
    cg = make_cgroup(f"bunshin-mt-{os.getpid()}")
    try:
        source = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: source_main(str(log), 1, threads=2))
        wait_lines(log, lambda lines: len(lines) >= 2)
        (cg / "cgroup.procs").write_text(str(source))
        freeze(cg)
        pidfd = os.pidfd_open(source)
        try:
            assert errno_of(lambda: fork_ioctl(dev, source, pidfd)) == errno.EINVAL
        finally:
            os.close(pidfd)
        assert f"source pid {source} has 2 threads" in kernel_log()
    finally:
        remove_cgroup(cg)


@pytest.mark.parametrize("field", ["flags", "reserved[0]", "reserved[3]", "cgroup_fd", "group_pidfd",
                                   "setsid+join"])
def test_bad_flags_or_fields_are_einval(dev: int, world, field: str) -> None:
    """Unknown flags, nonzero reserved fields, a field without its flag, SETSID with JOIN_GROUP."""
    source, _target, pidfd, cg, _log = world
    freeze(cg)
    reserved = [0] * 4
    kw: dict = {}
    if field == "flags":
        kw["flags"] = 1 << 31
    elif field == "cgroup_fd":
        kw["cgroup_fd"] = 3
    elif field == "group_pidfd":
        kw["group_pidfd"] = pidfd
    elif field == "setsid+join":
        kw.update(flags=FORK_SETSID | FORK_JOIN_GROUP, group_pidfd=pidfd)
    else:
        reserved[int(field[-2])] = 1
    assert errno_of(lambda: fork_ioctl(dev, source, pidfd, reserved=tuple(reserved), **kw)) == errno.EINVAL


def test_read_only_argument_is_efault_and_forks_nothing(dev: int, world) -> None:
    """The argument is checked writable before the fork: EFAULT, and no child appears."""
    import mmap

    source, target, pidfd, cg, _log = world
    freeze(cg)
    m = mmap.mmap(-1, mmap.PAGESIZE)
    m[:FORK_SIZE] = struct.pack(FORK_FMT, 0, source, pidfd, 0, 0, 0, 0, 0, 0, 0, 0)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert _libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ) == 0
    _libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    assert _libc.ioctl(dev, IOC_FORK, ctypes.c_void_p(addr)) == -1
    assert ctypes.get_errno() == errno.EFAULT
    assert Path(f"/proc/{target}/task/{target}/children").read_text().split() == []
    assert Path(f"/proc/{source}/task/{source}/children").read_text().split() == []


def test_fork_needs_cap_sys_admin(dev: int, world) -> None:
    """CAP_CHECKPOINT_RESTORE (enough for VERSION) is not enough to fork."""
    source, _target, pidfd, cg, _log = world
    freeze(cg)

    def child() -> int:
        set_effective_caps({CAP_CHECKPOINT_RESTORE})
        if errno_of(lambda: version(dev)) != 0:
            return 98
        return errno_of(lambda: fork_ioctl(dev, source, pidfd))

    assert in_child(child) == errno.EPERM


def test_100_forks_then_unload(world, loaded_module: str) -> None:
    """100 fork+kill cycles leave no task, no reference: the module unloads, no warning."""
    source, target, pidfd, cg, _log = world
    freeze(cg)
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    times = []
    try:
        for _ in range(100):
            t0 = time.perf_counter()
            child, _ = fork_ioctl(fd, source, pidfd)
            times.append(time.perf_counter() - t0)
            os.kill(child, signal.SIGKILL)
    finally:
        os.close(fd)
    times.sort()
    print(f"100 forks of a 64 MiB source: median {times[50] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms")
    freeze(cg, False)
    # The children are reaped by the target's init (SIGCHLD ignored).
    for _ in range(500):
        children = Path(f"/proc/{target}/task/{target}/children").read_text().split()
        if not children:
            break
        time.sleep(0.02)
    assert not children
    unload_module()
    assert not module_loaded()
    bad = [ln for ln in kernel_log().splitlines() if _BAD_KERNEL_LOG.search(ln)]
    assert not bad, "\n".join(bad)
    tainted = int(Path("/proc/sys/kernel/tainted").read_text())
    assert not tainted & ((1 << 7) | (1 << 9)), f"kernel tainted {tainted:#x} (D: died, W: warning)"
    load_module(loaded_module)


# --- the second slice: cgroup, session, fd table -------------------------------------------------

RECORD = 8  # bytes per record of the data files: "A0000042" in the source's, "B0000042" in the target's


def data_file(letter: str, n: int = 20000) -> bytes:
    return b"".join(f"{letter}{i:07d}".encode() for i in range(n))


def clean_source_main(workdir: str, *, ctty: bool = False, socket_fd: bool = False, mib: int = 0) -> None:
    """A source holding only fds of known kinds: /dev/null on 0-2, *workdir*/data (read one record
    a step) and *workdir*/log (appended "pid pidns counter record sid pgid" every 20 ms); with
    *ctty*, a pty as its controlling tty (a new session); with *socket_fd*, a socket pair too;
    *mib* MiB of written anonymous memory."""
    buf = bytearray(b"\x5a") * (mib * MIB)  # noqa: F841 (kept)
    os.closerange(3, 65536)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    if ctty:
        import termios

        os.setsid()
        master, slave = os.openpty()  # kept open: closing the master hangs the session up
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    if socket_fd:
        import socket

        pair = socket.socketpair()  # noqa: F841 (kept open)
    data = os.open(f"{workdir}/data", os.O_RDONLY)
    log = os.open(f"{workdir}/log", os.O_WRONLY | os.O_APPEND)
    i = 0
    while True:
        i += 1
        record = os.read(data, RECORD).decode() or "-"
        ns = os.readlink("/proc/self/ns/pid")  # read each time: the child lives in another
        os.write(log, f"{os.getpid()} {ns} {i} {record} {os.getsid(0)} {os.getpgrp()}\n".encode())
        time.sleep(0.02)


def clean_target_main(workdir: str) -> None:
    """The target's init: a session of its own, and its own tmpfs on *workdir* holding a data file
    of "B" records and an empty log; then what target_main does."""
    os.setsid()
    assert _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 0, None) == 0
    Path(workdir, "data").write_bytes(data_file("B"))
    Path(workdir, "log").write_bytes(b"")
    Path(workdir, "ready").write_bytes(b"")
    target_main()


def log_lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [ln.split() for ln in text.splitlines() if ln.count(" ") == 5]


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def fd_table(pid: int) -> dict[str, str]:
    d = f"/proc/{pid}/fd"
    return {fd: os.readlink(f"{d}/{fd}") for fd in os.listdir(d)}


def tasks_in_pid_ns(pid: int) -> list[int]:
    ns = os.readlink(f"/proc/{pid}/ns/pid")
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()  # fields from 3 (state) on


@pytest.fixture
def clean_world(procs: Procs, scratch: Path, request):
    """A clean source (clean_source_main, options from the test's "source" marker-free parameter
    `request.param`) frozen-ready in its own cgroup, and a clean target (clean_target_main) with
    its own files at the same paths. Yields a dict."""
    opts = getattr(request, "param", {})
    work = scratch / "work"
    work.mkdir()
    (work / "data").write_bytes(data_file("A"))
    (work / "log").write_bytes(b"")
    cg = make_cgroup(f"bunshin-csrc-{os.getpid()}-{time.monotonic_ns()}")
    source = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: clean_source_main(str(work), **opts))
    (cg / "cgroup.procs").write_text(str(source))
    target = procs.spawn(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET,
                         lambda: clean_target_main(str(work)))
    troot = Path(f"/proc/{target}/root{work}")
    wait_for(lambda: (troot / "ready").exists(), what="the target's files")
    pidfd = os.pidfd_open(target)
    wait_for(lambda: len(log_lines(work / "log")) >= 3, what="the source's first lines")
    try:
        yield {"source": source, "target": target, "pidfd": pidfd, "cg": cg, "work": work,
               "log": work / "log", "tlog": troot / "log"}
    finally:
        os.close(pidfd)
        remove_cgroup(cg)


@pytest.fixture
def target_cgroup():
    cg = make_cgroup(f"bunshin-tgt-{os.getpid()}-{time.monotonic_ns()}")
    freeze(cg)
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield cg, fd
    finally:
        os.close(fd)
        remove_cgroup(cg)


def test_fork_features(dev: int) -> None:
    features = version(dev)[2]
    assert features & FEATURE_FORK_CGROUP and features & FEATURE_FORK_SESSION and features & FEATURE_FORK_FILES, (
        kernel_log()[-2000:])


def test_fork_into_target_cgroup(dev: int, world, target_cgroup) -> None:
    """The child is born in the target cgroup, frozen there until that cgroup (only) thaws."""
    source, target, pidfd, cg, log = world
    tcg, tcg_fd = target_cgroup
    freeze_between_lines(cg, source)
    last = max(int(f[2]) for f in wait_lines(log, lambda lines: True))
    child, _ = fork_ioctl(dev, source, pidfd, flags=FORK_CGROUP, cgroup_fd=tcg_fd)
    try:
        assert Path(f"/proc/{child}/cgroup").read_text() == f"0::/{tcg.name}\n"
        assert str(child) in (tcg / "cgroup.procs").read_text().split()
        assert str(child) not in (cg / "cgroup.procs").read_text().split()
        freeze(cg, False)  # the source's cgroup thaws: the child stays frozen
        freeze(tcg)  # the target cgroup is frozen with the child in it
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        wait_lines(log, lambda lines: sum(f[1] != target_ns and int(f[2]) > last for f in lines) >= 5)
        assert not [f for f in wait_lines(log, lambda lines: True) if f[1] == target_ns]
        assert status(child)["State"].startswith("S")
        freeze(tcg, False)
        lines = wait_lines(log, lambda lines: sum(f[1] == target_ns for f in lines) >= 3)
        counters = [int(f[2]) for f in lines if f[1] == target_ns]
        assert counters and counters[0] == last + 1, (last, counters)
    finally:
        os.kill(child, signal.SIGKILL)


def test_cgroup_fd_must_be_a_cgroup_v2_directory(dev: int, world, scratch: Path) -> None:
    source, target, pidfd, cg, _log = world
    freeze(cg)
    plain = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert errno_of(lambda: fork_ioctl(dev, source, pidfd, flags=FORK_CGROUP, cgroup_fd=plain)) == errno.EBADF
        assert errno_of(lambda: fork_ioctl(dev, source, pidfd, flags=FORK_CGROUP, cgroup_fd=-1)) == errno.EBADF
    finally:
        os.close(plain)
    assert Path(f"/proc/{target}/task/{target}/children").read_text().split() == []


def test_child_thawed_before_it_runs_restarts_its_system_call(dev: int, clean_world) -> None:
    """The source sleeps in clock_nanosleep(TIMER_ABSTIME), which a freeze interrupts with
    -ERESTARTNOHAND; the cgroup thaws right after the fork, often before the child first runs
    (whose schedule_tail() recalculates TIF_SIGPENDING): the child must still restart the call,
    never see errno 514. Ten times."""
    w = clean_world
    source, target = w["source"], w["target"]
    target_ns = os.readlink(f"/proc/{target}/ns/pid")
    for _ in range(10):
        freeze(w["cg"])
        child, _ = fork_ioctl(dev, source, w["pidfd"])
        freeze(w["cg"], False)
        try:
            nspid = status(child)["NSpid"].split()[1]
            wait_for(lambda: [f for f in log_lines(w["log"]) if f[1] == target_ns and f[0] == nspid], timeout=10,
                     what=f"a line of child {child} (it died if the source's sleep failed in it)")
        finally:
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("clean_world", [{"ctty": True}], indirect=True)
def test_fork_setsid_detaches_the_tty(dev: int, clean_world) -> None:
    """SETSID: the child leads a new session and process group, and has no controlling tty."""
    w = clean_world
    source, target = w["source"], w["target"]
    assert int(stat_fields(source)[4]) != 0  # tty_nr: the source has its pty
    freeze(w["cg"])
    child, _ = fork_ioctl(dev, source, w["pidfd"], flags=FORK_SETSID)
    try:
        st = stat_fields(child)  # state ppid pgrp session tty_nr ...
        assert (int(st[1]), int(st[2]), int(st[3]), int(st[4])) == (target, child, child, 0), st
        nspid = status(child)["NSpid"].split()[1]
        assert status(child)["NSsid"].split()[1] == nspid == status(child)["NSpgid"].split()[1]
        freeze(w["cg"], False)
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        # No REOPEN_FILES: the child writes to the source's log (an fd table copy).
        lines = wait_for(lambda: [f for f in log_lines(w["log"]) if f[1] == target_ns], what="the child's lines")
        assert lines[0][4] == lines[0][5] == nspid  # getsid(0), getpgrp() in the child
    finally:
        os.kill(child, signal.SIGKILL)


def test_fork_joins_a_group_of_the_target(dev: int, clean_world) -> None:
    """JOIN_GROUP: the child joins the session and process group of a process of the target."""
    w = clean_world
    source, target = w["source"], w["target"]
    freeze(w["cg"])
    child, _ = fork_ioctl(dev, source, w["pidfd"], flags=FORK_JOIN_GROUP, group_pidfd=w["pidfd"])
    try:
        st = stat_fields(child)
        assert (int(st[1]), int(st[2]), int(st[3]), int(st[4])) == (target, target, target, 0), st
        freeze(w["cg"], False)
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        lines = wait_for(lambda: [f for f in log_lines(w["log"]) if f[1] == target_ns], what="the child's lines")
        assert lines[0][4] == lines[0][5] == "1"  # the target's init leads that session and group
    finally:
        os.kill(child, signal.SIGKILL)
    # A group process of another pid namespace (the source's) is refused.
    src_pidfd = os.pidfd_open(source)
    try:
        freeze(w["cg"])
        assert errno_of(lambda: fork_ioctl(dev, source, w["pidfd"], flags=FORK_JOIN_GROUP,
                                           group_pidfd=src_pidfd)) == errno.EINVAL
    finally:
        os.close(src_pidfd)


def test_fork_reopens_files_in_the_target(dev: int, clean_world, target_cgroup) -> None:
    """REOPEN_FILES: the child's fds are the same paths reopened in the target's root, at the same
    offsets; the source's own fd table is untouched. With CGROUP and SETSID too."""
    w = clean_world
    source, target = w["source"], w["target"]
    tcg, tcg_fd = target_cgroup

    def position() -> int:
        return int(dict(ln.split(":\t") for ln in Path(f"/proc/{source}/fdinfo/3").read_text().splitlines())["pos"])

    # the source reads a record, then logs it: a freeze between the two would leave the log a
    # record behind the offset, so freeze again until it lands between iterations
    for _ in range(50):
        freeze(w["cg"])
        last = max(int(f[2]) for f in log_lines(w["log"]))
        if position() == last * RECORD:
            break
        freeze(w["cg"], False)
        time.sleep(0.01)
    else:
        pytest.fail("the source was never frozen between two iterations")
    before = fd_table(source)
    flags = FORK_REOPEN_FILES | FORK_CGROUP | FORK_SETSID
    child, _ = fork_ioctl(dev, source, w["pidfd"], flags=flags, cgroup_fd=tcg_fd)
    try:
        assert fd_table(source) == before
        assert fd_table(child) == before  # same paths (the target's files, as the child sees them)
        assert os.stat(f"/proc/{child}/fd/3").st_ino != os.stat(f"/proc/{source}/fd/3").st_ino
        assert os.stat(f"/proc/{child}/fd/3").st_dev == os.stat(f"/proc/{target}/root{w['work']}/data").st_dev
        pos = dict(ln.split(":\t") for ln in Path(f"/proc/{child}/fdinfo/3").read_text().splitlines())["pos"]
        assert int(pos) == last * RECORD
        freeze(w["cg"], False)
        assert not log_lines(w["tlog"])  # still frozen in the target cgroup
        freeze(tcg, False)
        lines = wait_for(lambda: log_lines(w["tlog"]) if len(log_lines(w["tlog"])) >= 3 else None,
                         what="the child's lines in the target's log")
        assert int(lines[0][2]) == last + 1
        assert lines[0][3] == f"B{last:07d}"  # the target's data, at the source's offset
        assert lines[1][3] == f"B{last + 1:07d}"
        assert lines[0][4] == lines[0][5] == lines[0][0]  # its own session
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        mine = [f for f in log_lines(w["log"]) if f[1] == target_ns]
        assert not mine  # nothing reached the source's log
        src = wait_for(lambda: [f for f in log_lines(w["log"]) if int(f[2]) > last], what="the source resuming")
        assert src[0][3] == f"A{last:07d}"  # the source reads on in its own file
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("clean_world", [{"socket_fd": True}], indirect=True)
def test_unsupported_fd_kind_is_einval_and_leaves_nothing(dev: int, clean_world, target_cgroup) -> None:
    w = clean_world
    source, target = w["source"], w["target"]
    tcg, tcg_fd = target_cgroup
    freeze(w["cg"])
    before = fd_table(source)
    socket_fd = min(int(fd) for fd, what in before.items() if what.startswith("socket:"))
    last = max(int(f[2]) for f in log_lines(w["log"]))
    flags = FORK_REOPEN_FILES | FORK_CGROUP | FORK_SETSID
    assert errno_of(lambda: fork_ioctl(dev, source, w["pidfd"], flags=flags, cgroup_fd=tcg_fd)) == errno.EINVAL
    assert f"source pid {source}: fd {socket_fd} is a socket" in kernel_log()
    assert tasks_in_pid_ns(target) == [target]
    assert (tcg / "cgroup.procs").read_text().split() == []
    assert fd_table(source) == before
    freeze(w["cg"], False)
    src = wait_for(lambda: [f for f in log_lines(w["log"]) if int(f[2]) > last], what="the source resuming")
    assert int(src[0][2]) == last + 1 and src[0][3] == f"A{last:07d}"
    assert fd_table(source) == before


@pytest.mark.parametrize("clean_world", [{"mib": 64}], indirect=True)
def test_100_full_forks_then_unload(clean_world, target_cgroup, loaded_module: str) -> None:
    """100 fork+kill cycles with every flag: no task, no reference left; unload clean."""
    w = clean_world
    source, target = w["source"], w["target"]
    tcg, tcg_fd = target_cgroup
    freeze(w["cg"])
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    times, inside = [], []
    flags = FORK_REOPEN_FILES | FORK_CGROUP | FORK_SETSID
    try:
        for _ in range(100):
            t0 = time.perf_counter()
            child, ns = fork_ioctl(fd, source, w["pidfd"], flags=flags, cgroup_fd=tcg_fd)
            times.append(time.perf_counter() - t0)
            inside.append(ns)
            os.kill(child, signal.SIGKILL)
    finally:
        os.close(fd)
    times.sort()
    inside.sort()
    print(f"100 forks of a 64 MiB source (cgroup, setsid, 5 fds reopened): median {times[50] * 1e3:.2f} ms, "
          f"max {times[-1] * 1e3:.2f} ms, in the source median {inside[50] / 1e6:.2f} ms")
    freeze(tcg, False)
    wait_for(lambda: not (tcg / "cgroup.procs").read_text().split(), what="the children to die")
    wait_for(lambda: tasks_in_pid_ns(target) == [target], what="the children to be reaped")
    unload_module()
    assert not module_loaded()
    bad = [ln for ln in kernel_log().splitlines() if _BAD_KERNEL_LOG.search(ln)]
    assert not bad, "\n".join(bad)
    tainted = int(Path("/proc/sys/kernel/tainted").read_text())
    assert not tainted & ((1 << 7) | (1 << 9)), f"kernel tainted {tainted:#x} (D: died, W: warning)"
    load_module(loaded_module)
