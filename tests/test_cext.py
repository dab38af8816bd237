"""The C extension bunshin_async._bunshin_c: every wrapper's success and error paths.

Runs as root (here and in CI). Children made with clone3 always end with os._exit; mounts are
made only inside a child's private mount namespace; cgroups are removed. An autouse fixture
checks that no fd, mount, child process or cgroup leaks from any test.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import pathlib
import signal
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bunshin_async import _bunshin_c as c

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root: namespaces, mounts, cgroups, and PFNs in /proc/PID/pagemap",
)

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGESIZE")


# ---------------------------------------------------------------------------------------
# helpers


def cgroup2_root() -> pathlib.Path | None:
    """The cgroup v2 mount point (/sys/fs/cgroup/unified here, /sys/fs/cgroup elsewhere)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return pathlib.Path(left.split()[4])
    return None


def children() -> set[int]:
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


class Child:
    """A clone3 child running ``body(child_side)``; talks JSON lines over pipes."""

    def __init__(self, pid: int, pidfd: int, recv_fd: int, send_fd: int) -> None:
        self.pid, self.pidfd = pid, pidfd
        self._recv = os.fdopen(recv_fd, "r")
        self._send = send_fd
        self.status: int | None = None

    def recv(self) -> Any:
        line = self._recv.readline()
        assert line, "the child exited without a message"
        return json.loads(line)

    def release(self) -> None:
        """Let a child blocked in ``wait_parent()`` go on (nothing to do if it has exited)."""
        try:
            os.write(self._send, b"x")
        except BrokenPipeError:
            pass

    def wait(self) -> int:
        """Reap the child; return its exit code (or -signal)."""
        if self.status is None:
            _, status = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(status)
            self._recv.close()
            os.close(self._send)
            if self.pidfd >= 0:
                os.close(self.pidfd)
        return self.status


class ChildSide:
    def __init__(self, send_fd: int, recv_fd: int) -> None:
        self._send, self._recv = send_fd, recv_fd

    def send(self, obj: Any) -> None:
        os.write(self._send, (json.dumps(obj) + "\n").encode())

    def wait_parent(self) -> None:
        os.read(self._recv, 1)


def spawn(flags: int, body: Callable[[ChildSide], None], **kwargs: Any) -> Child:
    """clone3 a child that runs body and always _exits (0 on success, 1 on an exception)."""
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid, pidfd = c.clone3(flags, **kwargs)
    if pid == 0:
        code = 1
        try:
            os.close(to_parent_r)
            os.close(to_child_w)
            body(ChildSide(to_parent_w, to_child_r))
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(to_parent_w)
    os.close(to_child_r)
    return Child(pid, pidfd, to_parent_r, to_child_w)


def clone3_error(flags: int, **kwargs: Any) -> BaseException:
    """Call clone3 expecting an exception; a child made by mistake exits at once."""
    try:
        pid, pidfd = c.clone3(flags, **kwargs)
    except (OSError, ValueError) as exc:
        return exc
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if pidfd >= 0:
        os.close(pidfd)
    pytest.fail("clone3 unexpectedly succeeded")


def mountinfo() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split(" ", 1)[1] for line in f)  # drop the mount id column


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    fds = sorted(os.listdir("/proc/self/fd"))
    mounts = mountinfo()
    kids = children()
    root = cgroup2_root()
    cgroups = sorted(p.name for p in root.iterdir() if p.is_dir()) if root else []
    yield
    assert sorted(os.listdir("/proc/self/fd")) == fds
    assert mountinfo() == mounts
    assert children() == kids
    if root:
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == cgroups


# ---------------------------------------------------------------------------------------
# constants


def test_constants_have_the_kernel_values() -> None:
    assert c.CLONE_NEWNS == 0x00020000
    assert c.CLONE_NEWPID == 0x20000000
    assert c.CLONE_NEWNET == 0x40000000
    assert c.CLONE_NEWUTS == 0x04000000
    assert c.CLONE_NEWIPC == 0x08000000
    assert c.CLONE_NEWCGROUP == 0x02000000
    assert c.CLONE_NEWTIME == 0x00000080
    assert c.CLONE_NEWUSER == 0x10000000
    assert c.CLONE_PIDFD == 0x00001000
    assert c.CLONE_CLEAR_SIGHAND == 1 << 32
    assert c.CLONE_INTO_CGROUP == 1 << 33
    assert (c.MS_RDONLY, c.MS_NOSUID, c.MS_NODEV, c.MS_NOEXEC) == (1, 2, 4, 8)
    assert (c.MS_REMOUNT, c.MS_BIND, c.MS_REC) == (32, 4096, 16384)
    assert (c.MS_PRIVATE, c.MS_SLAVE, c.MS_SHARED) == (1 << 18, 1 << 19, 1 << 20)
    assert (c.MS_RELATIME, c.MS_STRICTATIME) == (1 << 21, 1 << 24)
    assert (c.MNT_FORCE, c.MNT_DETACH, c.UMOUNT_NOFOLLOW) == (1, 2, 8)


# ---------------------------------------------------------------------------------------
# clone3


def test_clone3_child_in_new_pid_mount_uts_net_namespaces() -> None:
    host_name = socket.gethostname()
    flags = c.CLONE_NEWPID | c.CLONE_NEWNS | c.CLONE_NEWUTS | c.CLONE_NEWNET

    def body(side: ChildSide) -> None:
        socket.sethostname("bunshin-child")
        side.send({
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "ns": {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "mnt", "uts", "net")},
        })

    child = spawn(flags, body)
    msg = child.recv()
    assert child.wait() == 0
    assert msg["pid"] == 1
    assert msg["hostname"] == "bunshin-child"
    assert socket.gethostname() == host_name
    for ns in ("mnt", "uts", "net"):
        assert msg["ns"][ns] != os.readlink(f"/proc/self/ns/{ns}"), ns


def test_clone3_pidfd_signal_and_waitid() -> None:
    child = spawn(c.CLONE_PIDFD, lambda side: side.wait_parent())
    assert child.pidfd >= 0
    assert os.get_inheritable(child.pidfd) is False
    c.pidfd_send_signal(child.pidfd, signal.SIGTERM)
    assert child.wait() == -signal.SIGTERM

    child = spawn(c.CLONE_PIDFD, lambda side: os._exit(7))
    result = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED)
    assert (result.si_pid, result.si_status) == (child.pid, 7)
    with pytest.raises(ProcessLookupError, match="pidfd_send_signal"):
        c.pidfd_send_signal(child.pidfd, signal.SIGTERM)
    os.close(child.pidfd)
    child._recv.close()
    os.close(child._send)


def test_clone3_without_pidfd_flag_returns_minus_one() -> None:
    child = spawn(0, lambda side: None)
    assert child.pidfd == -1
    assert child.wait() == 0


def test_clone3_into_cgroup() -> None:
    root = cgroup2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy mounted")
    group = root / f"bunshin-test-{os.getpid()}"
    group.mkdir()
    try:
        fd = os.open(group, os.O_RDONLY | os.O_DIRECTORY)
        try:
            child = spawn(c.CLONE_INTO_CGROUP, lambda side: side.wait_parent(), cgroup_fd=fd)
        finally:
            os.close(fd)
        try:
            with open(f"/proc/{child.pid}/cgroup") as f:
                v2 = [line for line in f if line.startswith("0::")]
            assert v2 == [f"0::/{group.name}\n"]
            assert int((group / "cgroup.procs").read_text()) == child.pid
        finally:
            child.release()
            assert child.wait() == 0
    finally:
        group.rmdir()


def test_clone3_set_tid() -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    wanted = next(p for p in range(pid_max - 1, 300, -1) if not os.path.exists(f"/proc/{p}"))
    child = spawn(0, lambda side: side.send(os.getpid()), set_tid=[wanted])
    assert child.pid == wanted
    assert child.recv() == wanted
    assert child.wait() == 0


def test_clone3_refuses_bad_arguments() -> None:
    for flags, kwargs, pattern in [
        (0x00000100, {}, "not fork-like"),  # CLONE_VM
        (0x00010000, {}, "not fork-like"),  # CLONE_THREAD
        (c.CLONE_INTO_CGROUP, {}, "needs cgroup_fd"),
        (0, {"cgroup_fd": 3}, "only used with CLONE_INTO_CGROUP"),
        (0, {"set_tid": list(range(1, 34))}, "at most 32"),
        (0, {"set_tid": [0]}, "not a valid pid"),
        (0, {"exit_signal": 999}, "out of range"),
    ]:
        exc = clone3_error(flags, **kwargs)
        assert isinstance(exc, ValueError)
        assert pattern in str(exc)
    with pytest.raises(OverflowError):
        c.clone3(-1)


def test_clone3_kernel_errors_name_the_syscall() -> None:
    exc = clone3_error(c.CLONE_INTO_CGROUP, cgroup_fd=9999)
    assert isinstance(exc, OSError) and exc.errno == errno.EBADF
    assert "clone3" in str(exc)
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    exc = clone3_error(0, set_tid=[pid_max + 1])
    assert isinstance(exc, OSError) and exc.errno == errno.EINVAL
    assert str(exc) == "[Errno 22] clone3: Invalid argument"


# ---------------------------------------------------------------------------------------
# pidfd_*


def test_pidfd_open() -> None:
    fd = c.pidfd_open(os.getpid())
    try:
        assert os.get_inheritable(fd) is False
        c.pidfd_send_signal(fd, 0)
    finally:
        os.close(fd)
    fd = c.pidfd_open(os.getpid(), c.PIDFD_NONBLOCK)
    os.close(fd)
    with pytest.raises(ProcessLookupError, match="pidfd_open") as info:
        c.pidfd_open(2**22)
    assert info.value.errno == errno.ESRCH
    assert str(info.value) == "[Errno 3] pidfd_open: No such process"
    with pytest.raises(OSError, match="pidfd_open") as info:
        c.pidfd_open(os.getpid(), 0x1234)
    assert info.value.errno == errno.EINVAL


def test_pidfd_send_signal_errors() -> None:
    with pytest.raises(OSError, match="pidfd_send_signal") as info:
        c.pidfd_send_signal(9999, signal.SIGTERM)
    assert info.value.errno == errno.EBADF
    r, w = os.pipe()
    try:
        with pytest.raises(OSError, match="pidfd_send_signal") as info:
            c.pidfd_send_signal(r, 0)  # not a pidfd
        assert info.value.errno == errno.EBADF
    finally:
        os.close(r)
        os.close(w)


def test_pidfd_getfd_duplicates_a_pipe_of_a_child() -> None:
    def body(side: ChildSide) -> None:
        r, w = os.pipe()
        os.write(w, b"hello from the child")
        side.send({"r": r})
        side.wait_parent()

    child = spawn(c.CLONE_PIDFD, body)
    try:
        target = child.recv()["r"]
        fd = c.pidfd_getfd(child.pidfd, target)
        try:
            assert os.get_inheritable(fd) is False
            assert os.read(fd, 100) == b"hello from the child"
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="pidfd_getfd") as info:
            c.pidfd_getfd(child.pidfd, 9999)
        assert info.value.errno == errno.EBADF
    finally:
        child.release()
        assert child.wait() == 0


# ---------------------------------------------------------------------------------------
# setns, unshare


def test_setns_with_a_namespace_fd_and_with_a_pidfd() -> None:
    def holder(side: ChildSide) -> None:
        socket.sethostname("bunshin-holder")
        side.send("ready")
        side.wait_parent()

    target = spawn(c.CLONE_NEWUTS | c.CLONE_PIDFD, holder)
    try:
        assert target.recv() == "ready"

        def join_by_nsfd(side: ChildSide) -> None:
            fd = os.open(f"/proc/{target.pid}/ns/uts", os.O_RDONLY)
            c.setns(fd, c.CLONE_NEWUTS)
            side.send(socket.gethostname())

        def join_by_pidfd(side: ChildSide) -> None:
            c.setns(target.pidfd, c.CLONE_NEWUTS)
            side.send(socket.gethostname())

        for body in (join_by_nsfd, join_by_pidfd):
            joiner = spawn(0, body)
            assert joiner.recv() == "bunshin-holder"
            assert joiner.wait() == 0
        assert socket.gethostname() != "bunshin-holder"
    finally:
        target.release()
        assert target.wait() == 0


def test_setns_errors() -> None:
    with pytest.raises(OSError, match="setns") as info:
        c.setns(-1)
    assert info.value.errno == errno.EBADF
    fd = os.open("/proc/self/ns/uts", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="setns") as info:
            c.setns(fd, c.CLONE_NEWNET)  # the fd is a uts namespace
        assert info.value.errno == errno.EINVAL
    finally:
        os.close(fd)


def test_unshare() -> None:
    def body(side: ChildSide) -> None:
        before = os.readlink("/proc/self/ns/uts")
        c.unshare(c.CLONE_NEWUTS)
        socket.sethostname("bunshin-unshared")
        side.send([before, os.readlink("/proc/self/ns/uts"), socket.gethostname()])

    child = spawn(0, body)
    before, after, name = child.recv()
    assert child.wait() == 0
    assert before != after
    assert name == "bunshin-unshared" != socket.gethostname()
    with pytest.raises(OSError, match="unshare") as info:
        c.unshare(-1)
    assert info.value.errno == errno.EINVAL


# ---------------------------------------------------------------------------------------
# mount, umount2, pivot_root


def test_mount_tmpfs_in_a_private_mount_namespace(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()

    def body(side: ChildSide) -> None:
        c.mount(None, "/", None, c.MS_REC | c.MS_PRIVATE)
        c.mount("tmpfs", target, "tmpfs", c.MS_NOSUID | c.MS_NODEV, "size=1m,mode=0700")
        (target / "file").write_text("inside")
        with open("/proc/self/mountinfo") as f:
            line = next(line for line in f if line.split()[4] == str(target))
        c.mount(None, str(target).encode(), None, c.MS_REMOUNT | c.MS_RDONLY | c.MS_NOSUID | c.MS_NODEV)
        try:
            (target / "other").write_text("x")
            readonly = False
        except OSError as exc:
            readonly = exc.errno == errno.EROFS
        c.umount2(target)
        side.send({"line": line, "readonly": readonly, "after": os.listdir(target)})

    child = spawn(c.CLONE_NEWNS, body)
    msg = child.recv()
    assert child.wait() == 0
    assert " - tmpfs tmpfs " in msg["line"]
    assert "nosuid" in msg["line"] and "nodev" in msg["line"]
    assert msg["readonly"] is True
    assert msg["after"] == []
    assert os.listdir(target) == []  # the host never saw it


def test_mount_and_umount2_errors(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="mount") as info:
        c.mount("tmpfs", missing, "tmpfs")
    assert info.value.filename == str(missing)
    assert str(info.value) == f"[Errno 2] mount: No such file or directory: '{missing}'"
    with pytest.raises(OSError, match="mount") as info:
        c.mount("none", tmp_path, "no-such-filesystem-type")
    assert info.value.errno == errno.ENODEV
    with pytest.raises(OSError, match="umount2") as info:
        c.umount2(tmp_path)  # not a mount point
    assert info.value.errno == errno.EINVAL
    assert info.value.filename == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="umount2"):
        c.umount2(missing, c.MNT_DETACH)
    with pytest.raises(ValueError):
        c.umount2("a\0b")
    with pytest.raises(TypeError):
        c.mount(None, 42)


def test_pivot_root_in_a_child(tmp_path: pathlib.Path) -> None:
    new_root = tmp_path / "root"
    new_root.mkdir()

    def body(side: ChildSide) -> None:
        c.mount(None, "/", None, c.MS_REC | c.MS_PRIVATE)
        c.mount("tmpfs", new_root, "tmpfs", 0, "size=1m")
        (new_root / "old").mkdir()
        (new_root / "marker").write_text("new root")
        c.pivot_root(new_root, new_root / "old")
        os.chdir("/")
        marker = pathlib.Path("/marker").read_text()
        c.umount2("/old", c.MNT_DETACH)
        side.send({"marker": marker, "listing": sorted(os.listdir("/"))})

    child = spawn(c.CLONE_NEWNS, body)
    msg = child.recv()
    assert child.wait() == 0
    assert msg == {"marker": "new root", "listing": ["marker", "old"]}


def test_pivot_root_in_the_host_namespace_fails(tmp_path: pathlib.Path) -> None:
    # tmp_path is not a mount point, so the kernel refuses before changing anything
    with pytest.raises(OSError, match="pivot_root") as info:
        c.pivot_root(tmp_path, tmp_path)
    assert info.value.errno in (errno.EINVAL, errno.EBUSY)
    assert (info.value.filename, info.value.filename2) == (str(tmp_path), str(tmp_path))


# ---------------------------------------------------------------------------------------
# scan_pages


def memory_holder(size: int) -> Callable[[ChildSide], None]:
    """A child body that writes ``size`` bytes of anonymous memory, then on each release
    forks a child that writes nothing (the first time), and finally exits."""

    def body(side: ChildSide) -> None:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block = b"\xa5" * MIB
        for off in range(0, size, MIB):
            buf[off : off + MIB] = block
        side.send("written")
        side.wait_parent()
        twin_r, twin_w = os.pipe()
        # not os.fork(): in a clone3 child of a process that had threads (numpy's
        # OpenBLAS pool, imported by other tests), glibc's atfork handlers would wait
        # for threads that the child does not have (see docs/cext.md)
        twin, _ = c.clone3(0)
        if twin == 0:
            try:
                os.close(twin_w)
                os.read(twin_r, 1)
            finally:
                os._exit(0)
        os.close(twin_r)
        side.send(twin)
        side.wait_parent()
        os.close(twin_w)
        os.waitpid(twin, 0)
        buf.close()

    return body


def rss_pages(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("Rss:"))
    return kib * 1024 // PAGE


def check_sums(scan: Any) -> None:
    assert scan.resident == scan.private + scan.shared_inside + scan.shared_outside
    for resident, private, inside, outside in scan.per_pid.values():
        assert resident == private + inside + outside


def test_scan_pages_private_shared_inside_and_outside() -> None:
    n_mib = 32
    pages = n_mib * MIB // PAGE
    child = spawn(0, memory_holder(n_mib * MIB))
    try:
        assert child.recv() == "written"
        alone = c.scan_pages([child.pid])
        check_sums(alone)
        assert alone.page_size == PAGE
        assert alone.private >= pages
        assert alone.per_pid == {child.pid: (alone.resident, alone.private, alone.shared_inside, alone.shared_outside)}
        assert abs(alone.resident - rss_pages(child.pid)) <= 0.03 * rss_pages(child.pid)

        child.release()
        twin = child.recv()
        both = c.scan_pages([child.pid, twin])
        check_sums(both)
        assert both.shared_inside >= pages
        assert both.private < alone.private - pages + 0.01 * pages
        # each page counts once for the set, whatever the number of mappings
        assert both.resident <= alone.resident + 0.03 * alone.resident
        for pid in (child.pid, twin):
            resident, private, inside, outside = both.per_pid[pid]
            assert inside >= pages
            assert abs(resident - rss_pages(pid)) <= 0.03 * rss_pages(pid)

        parent_only = c.scan_pages([child.pid])
        check_sums(parent_only)
        assert parent_only.shared_outside >= pages
        assert parent_only.private < pages
        assert parent_only.per_pid[child.pid][3] == parent_only.shared_outside

        # a pid given twice is scanned once
        assert c.scan_pages([child.pid, child.pid]).resident == parent_only.resident
    finally:
        child.release()
        child.release()
        assert child.wait() == 0


def test_scan_pages_empty_set() -> None:
    scan = c.scan_pages([])
    assert (scan.resident, scan.private, scan.shared_inside, scan.shared_outside) == (0, 0, 0, 0)
    assert scan.per_pid == {}
    assert isinstance(scan, c.PageScan)


def test_scan_pages_vanished_pid() -> None:
    child = spawn(0, lambda side: None)
    child.wait()
    with pytest.raises(ProcessLookupError, match=f"pid {child.pid}") as info:
        c.scan_pages([os.getpid(), child.pid])
    assert info.value.errno == errno.ESRCH
    assert "scan_pages" in str(info.value)
    assert info.value.filename == f"/proc/{child.pid}/maps"


def test_scan_pages_bad_arguments() -> None:
    with pytest.raises(ValueError, match="not a valid pid"):
        c.scan_pages([0])
    with pytest.raises(TypeError):
        c.scan_pages(5)
    with pytest.raises(TypeError):
        c.scan_pages(["1"])


def test_scan_pages_without_privilege_raises_permission_error() -> None:
    def body(side: ChildSide) -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        # setuid made the process non-dumpable (its /proc files root's): undo that
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(4, 1, 0, 0, 0) == 0  # PR_SET_DUMPABLE
        try:
            c.scan_pages([os.getpid()])
        except PermissionError as exc:
            side.send({"errno": exc.errno, "message": str(exc), "filename": exc.filename})
        else:
            side.send(None)

    child = spawn(0, body)
    msg = child.recv()
    assert child.wait() == 0
    assert msg is not None
    assert msg["errno"] == errno.EPERM
    assert msg["filename"] == f"/proc/{child.pid}/pagemap"
    assert "scan_pages" in msg["message"] and "CAP_SYS_ADMIN" in msg["message"]


def test_module_ioctls_on_a_file_that_is_not_the_device(tmp_path) -> None:
    # /dev/bunshin exists only in the lab VM (tests/vm/vm_fork.py drives it there); here the
    # wrappers must fail cleanly on any other file, naming the ioctl
    from bunshin_async import _bunshin_c as c

    with open(tmp_path / "plain", "w") as f:
        with pytest.raises(OSError) as e:
            c.bunshin_version(f.fileno())
        assert e.value.errno == errno.ENOTTY and "BUNSHIN_IOC_VERSION" in str(e.value)
        with pytest.raises(OSError) as e:
            c.bunshin_fork(f.fileno(), os.getpid(), -1)
        assert e.value.errno in (errno.ENOTTY, errno.EBADF) and "BUNSHIN_IOC_FORK" in str(e.value)
    with pytest.raises(OSError) as e:
        c.bunshin_version(-1)
    assert e.value.errno == errno.EBADF
    assert c.BunshinVersion.n_sequence_fields == 3
