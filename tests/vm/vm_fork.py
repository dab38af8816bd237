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
# reserved[5] (u64).
FORK_FMT = "=IiiiQ5Q"
FORK_SIZE = struct.calcsize(FORK_FMT)
assert FORK_SIZE == 64
IOC_FORK = _ioc(_IOC_READ | _IOC_WRITE, 0x01, FORK_SIZE)
assert "_IOWR(BUNSHIN_IOC_MAGIC, 0x01, struct bunshin_fork_req)" in _D["BUNSHIN_IOC_FORK"]
assert MAGIC == 0xBB and UAPI.exists()
FEATURE_FORK = 1 << 2
assert _D["BUNSHIN_FEATURE_FORK"] == "(1ULL << 2)"

MIB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")
_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)


def fork_ioctl(fd: int, source_pid: int, target_pidfd: int, *, flags: int = 0,
               reserved: tuple[int, ...] = (0,) * 5) -> tuple[int, int]:
    """BUNSHIN_IOC_FORK; returns (child_pid, source_ns)."""
    buf = bytearray(struct.pack(FORK_FMT, flags, source_pid, target_pidfd, 0, 0, *reserved))
    fcntl.ioctl(fd, IOC_FORK, buf)
    out = struct.unpack(FORK_FMT, buf)
    assert out[:3] == (flags, source_pid, target_pidfd) and out[5:] == reserved
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


def remove_cgroup(cg: Path) -> None:
    if not cg.exists():
        return
    freeze(cg, False)
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(500):
        if not (cg / "cgroup.procs").read_text().split():
            break
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
        lines = [ln.split() for ln in log.read_text().splitlines() if ln.count(" ") == 3]
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
    freeze(cg)
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
        assert st["State"].startswith("S")  # frozen with the source's cgroup
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


@pytest.mark.parametrize("field", ["flags", "reserved[0]", "reserved[4]"])
def test_nonzero_flags_or_reserved_is_einval(dev: int, world, field: str) -> None:
    source, _target, pidfd, cg, _log = world
    freeze(cg)
    reserved = [0] * 5
    flags = 1 if field == "flags" else 0
    if field != "flags":
        reserved[int(field[-2])] = 1
    assert errno_of(lambda: fork_ioctl(dev, source, pidfd, flags=flags, reserved=tuple(reserved))) == errno.EINVAL


def test_read_only_argument_is_efault_and_forks_nothing(dev: int, world) -> None:
    """The argument is checked writable before the fork: EFAULT, and no child appears."""
    import mmap

    source, target, pidfd, cg, _log = world
    freeze(cg)
    m = mmap.mmap(-1, mmap.PAGESIZE)
    m[:FORK_SIZE] = struct.pack(FORK_FMT, 0, source, pidfd, 0, 0, 0, 0, 0, 0, 0)
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
