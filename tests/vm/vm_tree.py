"""BUNSHIN_IOC_FORK_TREE, checked inside the lab VM (run by tests/test_vm.py through ``bunshin vm run``).

A workspace of four processes (a root P with two children A and B, and A's child G) in its own
pid and mount namespaces and cgroup, sharing a pipe (G writes, P reads), a unix socket pair (B
sends, A receives), a data file and a log, is frozen and forked as a whole into a target: a
"holder" that unshared new pid, mount, UTS, IPC and network namespaces and has no child yet (the
clone of P becomes the init of its pid namespace), or a running init (the clone of P becomes its
child). Each process also holds 1 MiB of random bytes; every line it logs carries their CRC.

The C extension (cext/, bunshin_async._bunshin_c) drives the module: it is loaded straight from the
build directory (the editable install's import hook would try to rebuild on the read-only root).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib.machinery
import importlib.util
import mmap
import os
import pty
import random
import re
import select
import signal
import socket
import struct
import termios
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from vm_fork import (
    CGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    RECORD,
    Procs,
    clean_target_main,
    data_file,
    fd_table,
    freeze,
    loaded_module,  # noqa: F401 (the module-scoped autouse fixture: load the module here too)
    make_cgroup,
    remove_cgroup,
    rollup,
    stat_fields,
    status,
    tasks_in_pid_ns,
    wait_for,
)
from vm_module import (
    _BAD_KERNEL_LOG,
    _D,
    _IOC_READ,
    _IOC_WRITE,
    ABI_VERSION,
    CAP_CHECKPOINT_RESTORE,
    DEVICE,
    ROOT,
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

# struct bunshin_tree_req: flags, count (u32); source_pids, child_pids (u64); target_pidfd,
# cgroup_fd (s32); source_ns (u64); reserved[3] (u64).
TREE_FMT = "=IIQQiiQ3Q"
TREE_SIZE = struct.calcsize(TREE_FMT)
assert TREE_SIZE == 64
IOC_FORK_TREE = _ioc(_IOC_READ | _IOC_WRITE, 0x02, TREE_SIZE)
assert "_IOWR(BUNSHIN_IOC_MAGIC, 0x02, struct bunshin_tree_req)" in _D["BUNSHIN_IOC_FORK_TREE"]
FEATURE_FORK_TREE = 1 << 6
assert _D["BUNSHIN_FEATURE_FORK_TREE"] == "(1ULL << 6)"
TREE_MAX = int(_D["BUNSHIN_TREE_MAX"])
MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _load_cext():
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    found = sorted((ROOT / "build").glob(f"*/cext/_bunshin_c{suffix}"))
    assert found, f"no _bunshin_c{suffix} under {ROOT}/build: run pip install --no-build-isolation -e . first"
    spec = importlib.util.spec_from_file_location("_bunshin_c", found[-1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


c = _load_cext()


# --- the workspace -----------------------------------------------------------------------------

ROLES = ("P", "A", "B", "G")


def _mem(mib_: int) -> tuple[bytearray, int]:
    buf = bytearray(os.urandom(MIB)) if mib_ == 1 else bytearray(b"\x5a") * (mib_ * MIB)
    return buf, ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _detach_and_wait(work: str) -> None:
    """In a workspace's root process: a session of its own, no fds but /dev/null on stdio,
    then wait for *work*/start."""
    os.setsid()
    os.closerange(3, 65536)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    while not os.path.exists(f"{work}/start"):
        time.sleep(0.01)


def workspace_main(work: str, *, root_mib: int = 1, thread_in: str = "", eventfd_in: str = "",
                   pty_in: str = "", outside_pipe: bool = False, fd_in_flight: bool = False,
                   b_uid: int = 0) -> None:
    """P: the root (the init of its pid namespace). Waits for *work*/start, then forks A (which
    leads a process group and forks G) and B. Buffered at fork time: "PIPEBUF;" in the pipe (A
    wrote it), "SOCKBUF;" in A's socket (B sent it). Nobody reads or writes them before *work*/go
    exists (in the process's own view of *work*); then G writes "G<i>;" into the pipe, P reads
    and logs what it gets, B sends "B<i>;", A receives and logs it, and P, if it is big
    (*root_mib* > 1), rewrites its memory once.

    Every process appends "role pid ppid sid pgid pidns counter crc payload" to *work*/log every
    30 ms (ids as seen in its pid namespace, crc of its memory)."""
    _detach_and_wait(work)
    data = os.open(f"{work}/data", os.O_RDONLY)
    log = os.open(f"{work}/log", os.O_WRONLY | os.O_APPEND)
    r, w = os.pipe()
    os.set_blocking(r, False)
    sa, sb = socket.socketpair()
    sa.setblocking(False)

    def loop(role: str, mib_: int, on_go, each) -> None:
        mem, addr = _mem(mib_)
        os.write(log, f"ADDR {role} {os.getpid()} {addr} {len(mem)}\n".encode())
        if role == thread_in:
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        if role == eventfd_in:
            efd = os.eventfd(0)  # noqa: F841 (kept open)
        if role == pty_in:
            pty = os.openpty()  # noqa: F841 (both ends kept open)
        i, went = 0, False
        crc = zlib.crc32(mem)
        while True:
            i += 1
            payload = "-"
            if not went and os.path.exists(f"{work}/go"):
                went = True
                if on_go:
                    on_go(mem, addr)
                    crc = zlib.crc32(mem)
            if went and each:
                payload = each(i) or "-"
            ns = os.readlink("/proc/self/ns/pid")
            os.write(log, f"{role} {os.getpid()} {os.getppid()} {os.getsid(0)} {os.getpgrp()} {ns} {i} "
                          f"{crc:08x} {payload}\n".encode())
            time.sleep(0.03)

    def read_pipe(_i: int) -> str:
        record = os.read(data, RECORD).decode() or "EOF"
        try:
            got = os.read(r, 4096).decode()
        except BlockingIOError:
            got = ""
        return f"{record}:{got}"

    def rewrite(mem: bytearray, addr: int) -> None:
        if root_mib > 1:
            ctypes.memset(addr, 0xA5, len(mem))

    if outside_pipe:  # a pipe whose write end only X (not named in the tree fork) holds
        r2, w2 = os.pipe()
        if os.fork() == 0:
            os.close(r2)
            while True:
                time.sleep(1)
        os.close(w2)
    if os.fork() == 0:  # A
        os.setpgid(0, 0)
        sb.close()
        os.close(r)
        os.write(w, b"PIPEBUF;")
        if os.fork() == 0:  # G
            sa.close()
            loop("G", 1, None, lambda i: os.write(w, f"G{i};".encode()) and None)
        os.close(w)

        def recv(_i: int) -> str:
            try:
                return sa.recv(4096).decode()
            except BlockingIOError:
                return ""

        loop("A", 1, None, recv)
    if os.fork() == 0:  # B
        sa.close()
        os.close(r)
        os.close(w)
        sb.send(b"SOCKBUF;")
        if fd_in_flight:
            socket.send_fds(sb, [b"FD;"], [0])
        if b_uid:  # B drops root: no capability left
            os.setgroups([])
            os.setgid(b_uid)
            os.setuid(b_uid)
        loop("B", 1, None, lambda i: sb.send(f"B{i};".encode()) and None)
    sa.close()
    sb.close()
    os.close(w)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    loop("P", root_mib, rewrite, read_pipe)


def log_lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [ln.split() for ln in text.splitlines() if ln.count(" ") == 8]


def addr_lines(path: Path) -> dict[str, tuple[int, int, int]]:
    """role -> (nspid, addr, len) from the ADDR lines."""
    out = {}
    for ln in path.read_text().splitlines():
        f = ln.split()
        if f and f[0] == "ADDR":
            out[f[1]] = (int(f[2]), int(f[3]), int(f[4]))
    return out


def payloads(lines: list[list[str]]) -> tuple[str, str]:
    """What P read from the pipe and A from the socket, in order."""
    p = "".join(f[8].split(":", 1)[1] for f in lines if f[0] == "P" and f[8] != "-")
    a = "".join(f[8] for f in lines if f[0] == "A" and f[8] != "-")
    return p, a


def traffic(log: Path) -> list[list[str]] | None:
    """The log's lines once P read a token of G and A one of B (after whatever was buffered)."""
    lines = log_lines(log)
    p, a = payloads(lines)
    return lines if re.search(r"G\d", p) and re.search(r"B\d", a) else None


def simple_source(procs: Procs) -> tuple[int, Path]:
    """A single process (only /dev/null open) in its own pid+mount namespaces and frozen cgroup."""
    def main() -> None:
        os.closerange(3, 65536)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        while True:
            time.sleep(0.05)

    cg = make_cgroup(f"bunshin-tree-one-{os.getpid()}-{time.monotonic_ns()}")
    pid = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, main)
    (cg / "cgroup.procs").write_text(str(pid))
    freeze(cg)
    return pid, cg


def children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def tree_of(root: int, skip: set[int] = frozenset()) -> list[int]:
    """root and its descendants, each parent before its children (breadth first)."""
    out, i = [root], 0
    while i < len(out):
        out += [p for p in children(out[i]) if p not in skip]
        i += 1
    return out


def nspid(pid: int) -> int:
    return int(status(pid)["NSpid"].split()[-1])


def read_mem(pid: int, addr: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(addr)
        return f.read(length)


def spawn_holder(procs: Procs, work: str, *, fifo: bool = False, devpts: bool = False) -> int:
    """A target with no child yet: a process that unshared new pid, mount, UTS, IPC and network
    namespaces, mounted its own tmpfs on *work* (a data file of "B" records, an empty log) and
    reaps its children. Its pid namespace for children is new and empty. With *devpts*, it has
    its own devpts instance on /dev/pts and /dev/ptmx is that instance's ptmx, as a workspace's."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET
            if _libc.unshare(flags) != 0:
                os._exit(97)
            _libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None)  # MS_PRIVATE | MS_REC
            assert _libc.mount(b"tmpfs", work.encode(), b"tmpfs", 0, None) == 0
            Path(work, "data").write_bytes(data_file("B"))
            Path(work, "log").write_bytes(b"")
            if fifo:
                os.mkfifo(f"{work}/fifo")
            if devpts:
                assert _libc.mount(b"devpts", b"/dev/pts", b"devpts", 0, b"newinstance,ptmxmode=0666") == 0
                assert _libc.mount(b"/dev/pts/ptmx", b"/dev/ptmx", None, 0x1000, None) == 0  # MS_BIND
            os.write(w, b"ok")
            os.close(w)
            while True:
                try:
                    os.wait()
                except ChildProcessError:
                    time.sleep(0.05)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 2) == b"ok", "the holder failed"
    os.close(r)
    procs.kill.append(pid)
    procs.helpers.append(pid)
    return pid


class Workspace:
    """The source workspace (workspace_main) in its own pid+mount namespaces and cgroup."""

    def __init__(self, procs: Procs, scratch: Path, **opts) -> None:
        self.work = scratch / "work"
        self.work.mkdir()
        (self.work / "data").write_bytes(data_file("A"))
        (self.work / "log").write_bytes(b"")
        self.log = self.work / "log"
        self.cg = make_cgroup(f"bunshin-tree-src-{os.getpid()}-{time.monotonic_ns()}")
        self.root = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: workspace_main(str(self.work), **opts))
        (self.cg / "cgroup.procs").write_text(str(self.root))
        (self.work / "start").write_bytes(b"")
        roles = set(ROLES)
        wait_for(lambda: roles <= {f[0] for f in log_lines(self.log) if int(f[6]) >= 2}, timeout=60,
                 what="every workspace process's lines")
        self.pids = tree_of(self.root)
        assert len(self.pids) == 4 + bool(opts.get("outside_pipe")), self.pids
        self.role = {}  # global pid -> role
        ns_role = {v[0]: k for k, v in addr_lines(self.log).items()}
        for p in self.pids:
            if nspid(p) in ns_role:
                self.role[p] = ns_role[nspid(p)]

    def close(self) -> None:
        remove_cgroup(self.cg)


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
def workspace(procs: Procs, tmp_path: Path, request):
    ws = Workspace(procs, tmp_path, **getattr(request, "param", {}))
    try:
        yield ws
    finally:
        ws.close()


@pytest.fixture
def target_cgroup():
    cg = make_cgroup(f"bunshin-tree-tgt-{os.getpid()}-{time.monotonic_ns()}")
    freeze(cg)
    fd = os.open(cg, os.O_PATH | os.O_CLOEXEC)
    try:
        yield cg, fd
    finally:
        os.close(fd)
        remove_cgroup(cg)


def kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_counter(log: Path, role: str) -> int:
    return max(int(f[6]) for f in log_lines(log) if f[0] == role)


# --- the tests ---------------------------------------------------------------------------------


def test_tree_feature(dev: int) -> None:
    v = c.bunshin_version(dev)
    assert v.abi_version == ABI_VERSION == 4
    assert v.features & FEATURE_FORK_TREE, kernel_log()[-2000:]
    assert v.features & c.BUNSHIN_FEATURE_TREE_SUBST == 1 << 7
    assert c.BUNSHIN_TREE_MAX == TREE_MAX == 1024
    assert c.BUNSHIN_TREE_SUBST_MAX == 1024


def test_tree_fork_into_a_new_pid_namespace(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """The whole tree, its shape, pids, sessions, memory, files, pipe and socket pair (with the
    bytes buffered at fork time), isolated from the source."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    troot = Path(f"/proc/{holder}/root{ws.work}")
    freeze(ws.cg)
    src_fds = {p: fd_table(p) for p in ws.pids}
    last = {r: last_counter(ws.log, r) for r in ROLES}
    crc = {f[0]: f[7] for f in log_lines(ws.log)}
    addrs = addr_lines(ws.log)
    pidfd = os.pidfd_open(holder)
    t0 = time.perf_counter()
    try:
        clones = c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd)
    finally:
        os.close(pidfd)
    print(f"tree fork of a 4-process workspace: {(time.perf_counter() - t0) * 1e3:.2f} ms")
    try:
        assert len(clones) == 4 and not set(clones) & set(ws.pids)
        of = dict(zip(ws.pids, clones))
        # Shape: the root clone is the init of the holder's new pid namespace, a child of the
        # holder; every other clone is a child of the clone of its source's parent.
        for src, cl in of.items():
            st = status(cl)
            src_ppid = int(status(src)["PPid"])
            assert int(st["PPid"]) == (holder if src == ws.root else of[src_ppid]), (src, cl)
            assert st["NSpid"].split()[1:] == (["1"] if src == ws.root else [str(nspid(src))])
            assert len(st["NSpid"].split()) == 2
            assert os.readlink(f"/proc/{cl}/ns/pid") == os.readlink(f"/proc/{holder}/ns/pid_for_children")
            for ns in ("mnt", "net", "uts", "ipc", "cgroup", "time"):
                assert os.readlink(f"/proc/{cl}/ns/{ns}") == os.readlink(f"/proc/{holder}/ns/{ns}"), ns
            assert Path(f"/proc/{cl}/cgroup").read_text() == f"0::/{tcg.name}\n"
        assert nspid(ws.root) == 1
        # Sessions and groups: P leads the session and P's group (with B); A leads A's (with G).
        p_, a_, b_, g_ = (next(cl for s, cl in of.items() if ws.role[s] == r) for r in ROLES)
        for cl, pgrp in ((p_, p_), (a_, a_), (b_, p_), (g_, a_)):
            st = stat_fields(cl)
            assert (int(st[2]), int(st[3]), int(st[4])) == (pgrp, p_, 0), (cl, st)
        # Memory: identical to the source's, byte for byte (the clones have not run).
        for src, cl in of.items():
            _n, addr, length = addrs[ws.role[src]]
            assert read_mem(cl, addr, length) == read_mem(src, addr, length)
        # Files: the same fd numbers; files reopened in the holder's tmpfs; the pipe and socket
        # pair new, shared by the clones as the sources' were.
        src_kinds: dict[str, str] = {}
        new_kinds: dict[str, str] = {}
        for src, cl in of.items():
            sf, cf = src_fds[src], fd_table(cl)
            assert sorted(sf) == sorted(cf), (sf, cf)
            for fd, what in sf.items():
                if what.startswith(("pipe:", "socket:")):
                    assert cf[fd] != what and cf[fd].split(":")[0] == what.split(":")[0]
                    assert new_kinds.setdefault(what, cf[fd]) == cf[fd]  # one new end per source end
                    src_kinds.setdefault(cf[fd], what)
                    assert src_kinds[cf[fd]] == what
                else:
                    assert cf[fd] == what
                    if what.startswith(str(ws.work)):
                        assert os.stat(f"/proc/{cl}/fd/{fd}").st_dev == os.stat(troot / "log").st_dev
        assert fd_table(ws.root) == src_fds[ws.root]  # the sources' tables are untouched
        # SO_PEERCRED of the new pair names the clone of its creator (P), as the source's names P.
        a_src = next(s for s in ws.pids if ws.role[s] == "A")
        sock_fd = next(int(fd) for fd, what in src_fds[a_src].items() if what.startswith("socket:"))
        for holder_of, creator in ((a_src, ws.root), (a_, p_)):
            pidfd = os.pidfd_open(holder_of)
            try:
                with socket.socket(fileno=c.pidfd_getfd(pidfd, sock_fd)) as s:
                    cred = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            finally:
                os.close(pidfd)
            assert cred == (creator, 0, 0), (holder_of, cred)
        # Run: thaw the clones, tell them to go (in the holder's tmpfs only).
        freeze(tcg, False)
        (troot / "go").write_bytes(b"")
        tlog = troot / "log"

        def settled() -> list[list[str]] | None:
            # The traffic, and a second line of every role (the first one may already hold it).
            got = traffic(tlog)
            return got if got and all(sum(f[0] == r for f in got) >= 2 for r in ROLES) else None

        lines = wait_for(settled, timeout=60, what="the clones' pipe and socket traffic")
        ns_of = {f[0]: f for f in lines}
        for r in ROLES:
            mine = [f for f in lines if f[0] == r]
            assert int(mine[0][6]) == last[r] + 1, (r, last[r], mine[0])  # resumes where it was frozen
            assert mine[0][7] == crc[r]  # the same memory
        # The pid namespace each logs is the clones' (but in a line whose text the source had made
        # before it was frozen mid-iteration: the clone writes it as the source would have).
        clone_ns = os.readlink(f"/proc/{holder}/ns/pid_for_children")
        src_ns_inode = os.readlink(f"/proc/{ws.root}/ns/pid")
        for r in ROLES:
            mine = [f for f in lines if f[0] == r]
            assert mine[0][5] in (clone_ns, src_ns_inode) and {f[5] for f in mine[1:]} == {clone_ns}, mine[:3]
        # In the clones' pid namespace: P is 1, ids as in the source.
        src_ns = {ws.role[s]: nspid(s) for s in ws.pids}
        for r, ppid, pgid in (("P", 0, 1), ("A", 1, src_ns["A"]), ("B", 1, 1), ("G", src_ns["A"], src_ns["A"])):
            f = ns_of[r]
            assert (int(f[1]), int(f[2]), int(f[3]), int(f[4])) == (1 if r == "P" else src_ns[r], ppid, 1, pgid), f
        # The buffered bytes came first, then the live traffic.
        p_payload, a_payload = payloads(lines)
        assert p_payload.startswith("PIPEBUF;G"), p_payload
        assert a_payload.startswith("SOCKBUF;B"), a_payload
        # The data file: the holder's records, from the source's offset.
        first_p = next(f for f in lines if f[0] == "P" and f[8] != "-")
        assert first_p[8].startswith("B"), first_p
        # Isolation: nothing of the clones reached the source's log.
        assert {f[5] for f in log_lines(ws.log)} == {src_ns_inode}
        # The source, thawed, still has its own buffered bytes; it reads them once told to go.
        freeze(ws.cg, False)
        (ws.work / "go").write_bytes(b"")

        src_lines = wait_for(lambda: traffic(ws.log), timeout=60, what="the source's own pipe and socket traffic")
        sp, sa = payloads(src_lines)
        assert sp.startswith("PIPEBUF;G") and sa.startswith("SOCKBUF;B"), (sp, sa)
        first_src = next(f for f in src_lines if f[0] == "P" and f[8] != "-")
        assert first_src[8].startswith("A"), first_src  # its own data file
        assert {f[5] for f in log_lines(tlog)} <= {clone_ns, src_ns_inode}
        assert len([f for f in log_lines(tlog) if f[5] != clone_ns]) <= len(ROLES)
    finally:
        kill_all(clones)


def ready_target(procs: Procs, ws: Workspace) -> int:
    """A clean target (new pid, mount, UTS, IPC and network namespaces; no child yet) whose
    files are ready: its host pid."""
    target = procs.spawn(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET,
                         lambda: clean_target_main(str(ws.work)))
    wait_for(lambda: Path(f"/proc/{target}/root{ws.work}/ready").exists(), what="the target's files")
    return target


def tree_fork(dev: int, pids: list[int], target: int, cgroup_fd: int, **kw: Any) -> list[int]:
    """Tree-fork the (frozen) processes *pids* into *target* (a pid), born in the cgroup
    *cgroup_fd* (*kw*: ``subst``): the clones' host pids, in the order of *pids*."""
    pidfd = os.pidfd_open(target)
    try:
        return c.bunshin_fork_tree(dev, pids, pidfd, cgroup_fd, **kw)
    finally:
        os.close(pidfd)


def frozen_tree_fork(dev: int, ws: Workspace, target: int, cgroup_fd: int) -> list[int]:
    """Freeze *ws* and tree-fork its processes into *target* (see :func:`tree_fork`)."""
    freeze(ws.cg)
    return tree_fork(dev, ws.pids, target, cgroup_fd)


def test_tree_fork_under_a_running_init(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """A target whose pid namespace has its init: the root clone is that init's child (pid 1 is
    taken: another pid), the others keep their pids and shape."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    target = ready_target(procs, ws)
    clones = frozen_tree_fork(dev, ws, target, tcg_fd)
    try:
        of = dict(zip(ws.pids, clones))
        assert int(status(of[ws.root])["PPid"]) == target
        assert nspid(of[ws.root]) != 1
        for src, cl in of.items():
            if src != ws.root:
                assert nspid(cl) == nspid(src)
                assert int(status(cl)["PPid"]) == of[int(status(src)["PPid"])]
            assert os.readlink(f"/proc/{cl}/ns/pid") == os.readlink(f"/proc/{target}/ns/pid")
        assert sorted(int(x) for x in (tcg / "cgroup.procs").read_text().split()) == sorted(clones)
        sid = {int(stat_fields(cl)[3]) for cl in clones}
        assert sid == {of[ws.root]}  # the root clone leads the clones' session
        assert sorted(tasks_in_pid_ns(target)) == sorted([target, *clones])
    finally:
        kill_all(clones)


@pytest.mark.parametrize("workspace", [{"b_uid": 65534}], indirect=True)
def test_tree_fork_of_an_unprivileged_process(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """B runs as nobody without capabilities: its clone is still born in the target cgroup with its
    pid (the module raises the capabilities those checks need for the fork only), and has B's
    credentials and (empty) capability sets."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    clones = frozen_tree_fork(dev, ws, holder, tcg_fd)
    try:
        for src, cl in zip(ws.pids, clones):
            st_src, st_cl = status(src), status(cl)
            for key in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"):
                assert st_cl[key] == st_src[key], (ws.role[src], key, st_src[key], st_cl[key])
            assert st_cl["NSpid"].split()[1] == ("1" if src == ws.root else str(nspid(src)))
            assert Path(f"/proc/{cl}/cgroup").read_text() == f"0::/{tcg.name}\n"
        b = next(p for p in ws.pids if ws.role[p] == "B")
        assert status(b)["Uid"].split()[0] == "65534" and int(status(b)["CapEff"], 16) == 0
    finally:
        kill_all(clones)


def test_tree_fork_shares_memory_copy_on_write(dev: int, procs: Procs, tmp_path: Path, target_cgroup) -> None:
    """256 MiB written in the root: right after the fork the clone's Pss is about half its Rss;
    once the clone rewrote it, its pages are its own and the source's are unchanged."""
    try:  # the memory controller for the cgroups below the root (the target cgroup among them)
        (CGROUP / "cgroup.subtree_control").write_text("+memory")
    except OSError:
        pass
    ws = Workspace(procs, tmp_path, root_mib=256)
    tcg, tcg_fd = target_cgroup
    memcg = (tcg / "memory.current").exists()
    try:
        holder = spawn_holder(procs, str(ws.work))
        freeze(ws.cg)
        _n, addr, length = addr_lines(ws.log)["P"]
        pidfd = os.pidfd_open(holder)
        try:
            t0 = time.perf_counter()
            clones = c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd)
            print(f"tree fork of a 4-process workspace holding 256 MiB: {(time.perf_counter() - t0) * 1e3:.2f} ms")
        finally:
            os.close(pidfd)
        try:
            root = clones[0]
            # The clones' kernel memory (page tables: 512 KiB for 256 MiB, task structs, the new
            # pipe and socket pair, reopened files) is charged to the target cgroup.
            charged = int((tcg / "memory.current").read_text()) if memcg else 0
            print(f"target cgroup memory.current after the fork: {charged} bytes")
            assert not memcg or charged >= 512 * 1024, charged
            r = rollup(root)
            print(f"clone of the 256 MiB root: Rss {r['Rss']} kB, Pss {r['Pss']} kB")
            assert r["Rss"] >= 256 * 1024, r
            assert 0.4 * r["Rss"] < r["Pss"] < 0.6 * r["Rss"], r
            freeze(tcg, False)
            troot = Path(f"/proc/{holder}/root{ws.work}")
            (troot / "go").write_bytes(b"")
            wait_for(lambda: [f for f in log_lines(troot / "log") if f[0] == "P" and f[8] != "-"], timeout=60,
                     what="the clone to rewrite its memory")
            freeze(tcg)
            r2 = rollup(root)
            print(f"after the clone rewrote it: Rss {r2['Rss']} kB, Pss {r2['Pss']} kB")
            assert r2["Pss"] > 0.9 * r2["Rss"] - 40 * 1024, r2  # its own, but for the interpreter's pages
            assert read_mem(root, addr, 4096) == b"\xa5" * 4096
            src = read_mem(ws.root, addr, length)
            assert src.count(b"\x5a") == length  # the source's pages are unchanged
        finally:
            kill_all(clones)
    finally:
        ws.close()


def test_concurrent_tree_forks_of_one_source(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """Two threads tree-fork the same frozen workspace at once, 60 times each, into two targets.

    Each source makes its clone with the clone's fd table swapped in as its own; a request that
    read that source's table meanwhile (its first phase, from the caller) got the other
    request's table, whose files were reopened in the other target, and refused the fork with
    EINVAL ("fd 0 is a character device 1:3 (outside the source's root)": about one scheduler
    run in five on the live bunshin engine, which forks a snapshot for several samples at once).
    Every fork must succeed."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    tcg2 = make_cgroup(f"bunshin-tree-tgt2-{os.getpid()}-{time.monotonic_ns()}")
    freeze(tcg2)
    tcg2_fd = os.open(tcg2, os.O_PATH | os.O_CLOEXEC)
    targets = [procs.spawn(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET,
                           lambda: clean_target_main(str(ws.work))) for _ in range(2)]
    pidfds = [os.pidfd_open(t) for t in targets]
    errors: list[str] = []
    counts = [0, 0]

    def forks(i: int, cg: Path, cg_fd: int) -> None:
        fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(60):
                try:
                    c.bunshin_fork_tree(fd, ws.pids, pidfds[i], cg_fd)
                except OSError as exc:
                    errors.append(f"request {i}, fork {counts[i]}: {exc}")
                    return
                counts[i] += 1
                (cg / "cgroup.kill").write_text("1")
        finally:
            os.close(fd)

    try:
        for t in targets:
            wait_for(lambda t=t: Path(f"/proc/{t}/root{ws.work}/ready").exists(), what="the targets' files")
        freeze(ws.cg)
        threads = [threading.Thread(target=forks, args=(0, tcg, tcg_fd)),
                   threading.Thread(target=forks, args=(1, tcg2, tcg2_fd))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == [], (errors, [ln for ln in kernel_log().splitlines() if "tree fork" in ln][-4:])
        assert counts == [60, 60]
        for cg, t in ((tcg, targets[0]), (tcg2, targets[1])):
            wait_for(lambda cg=cg: not (cg / "cgroup.procs").read_text().split(), what="the clones to die")
            wait_for(lambda t=t: tasks_in_pid_ns(t) == [t], what="the clones to be reaped")
    finally:
        for pidfd in pidfds:
            os.close(pidfd)
        os.close(tcg2_fd)
        remove_cgroup(tcg2)


@pytest.mark.parametrize("workspace", [{"pty_in": "A"}], indirect=True)
def test_500_tree_forks_then_unload(procs: Procs, workspace: Workspace, target_cgroup,
                                    loaded_module: str) -> None:  # noqa: F811 (the fixture)
    """500 tree forks and kills in a row (A holding a pty pair too): no task, file, pty or module
    reference left, no warning."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    target = ready_target(procs, ws)
    freeze(ws.cg)
    files_before = int(Path("/proc/sys/fs/file-nr").read_text().split()[0])
    ptys_before = int(Path("/proc/sys/kernel/pty/nr").read_text())
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    pidfd = os.pidfd_open(target)
    times = []
    try:
        for _ in range(500):
            t0 = time.perf_counter()
            assert len(c.bunshin_fork_tree(fd, ws.pids, pidfd, tcg_fd)) == 4
            times.append(time.perf_counter() - t0)
            (tcg / "cgroup.kill").write_text("1")
    finally:
        os.close(pidfd)
        os.close(fd)
    times.sort()
    print(f"500 tree forks of a 4-process workspace (1 MiB each, a pipe, a socket pair, a pty pair, 2 files): median "
          f"{times[250] * 1e3:.2f} ms, min {times[0] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms")
    wait_for(lambda: not (tcg / "cgroup.procs").read_text().split(), what="the clones to die")
    wait_for(lambda: tasks_in_pid_ns(target) == [target], what="the clones to be reaped")
    files_after = int(Path("/proc/sys/fs/file-nr").read_text().split()[0])
    assert files_after < files_before + 200, (files_before, files_after)  # 500 x 10 files made
    wait_for(lambda: int(Path("/proc/sys/kernel/pty/nr").read_text()) <= ptys_before,
             what="the clones' ptys to be released")  # 500 made
    unload_module()
    assert not module_loaded()
    bad = [ln for ln in kernel_log().splitlines() if _BAD_KERNEL_LOG.search(ln)]
    assert not bad, "\n".join(bad)
    tainted = int(Path("/proc/sys/kernel/tainted").read_text())
    assert not tainted & ((1 << 7) | (1 << 9)), f"kernel tainted {tainted:#x} (D: died, W: warning)"
    load_module(loaded_module)
    wait_for(lambda: os.path.exists(DEVICE), what="the device")


def fifo_main(work: str) -> None:
    """R (the root) reads *work*/fifo, W (its child) writes it: "FIFOBUF;" before the fork, then
    "F<i>;" every 30 ms once *work*/go exists. Both log "role pid counter payload"."""
    _detach_and_wait(work)
    log = os.open(f"{work}/log", os.O_WRONLY | os.O_APPEND)
    r = os.open(f"{work}/fifo", os.O_RDONLY | os.O_NONBLOCK)
    role, i = "R", 0
    if os.fork() == 0:
        role = "W"
        os.close(r)
        w = os.open(f"{work}/fifo", os.O_WRONLY)
        os.write(w, b"FIFOBUF;")
    while True:
        i += 1
        payload = "-"
        if os.path.exists(f"{work}/go"):
            if role == "W":
                os.write(w, f"F{i};".encode())
            else:
                try:
                    payload = os.read(r, 4096).decode() or "EOF"
                except BlockingIOError:
                    pass
        os.write(log, f"{role} {os.getpid()} {i} {payload}\n".encode())
        time.sleep(0.03)


def test_tree_fork_reopens_fifos_in_the_target(dev: int, procs: Procs, tmp_path: Path, target_cgroup) -> None:
    """A FIFO between two processes: the clones hold the target's FIFO at the same path, which
    gets the bytes buffered at fork time; the source's FIFO keeps its own."""
    tcg, tcg_fd = target_cgroup
    work = tmp_path / "work"
    work.mkdir()
    os.mkfifo(work / "fifo")
    (work / "log").write_bytes(b"")
    (work / "data").write_bytes(b"")
    cg = make_cgroup(f"bunshin-tree-fifo-{os.getpid()}-{time.monotonic_ns()}")
    try:
        root = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: fifo_main(str(work)))
        (cg / "cgroup.procs").write_text(str(root))
        (work / "start").write_bytes(b"")

        def lines(path: Path) -> list[list[str]]:
            return [ln.split() for ln in path.read_text().splitlines() if ln.count(" ") == 3]

        wait_for(lambda: {"R", "W"} <= {f[0] for f in lines(work / "log")}, what="both processes' lines")
        pids = tree_of(root)
        assert len(pids) == 2
        holder = spawn_holder(procs, str(work), fifo=True)
        troot = Path(f"/proc/{holder}/root{work}")
        freeze(cg)
        before = {p: fd_table(p) for p in pids}
        clones = tree_fork(dev, pids, holder, tcg_fd)
        try:
            fifo_ino = os.stat(troot / "fifo").st_ino
            for src, cl in zip(pids, clones):
                fifo_fds = [fd for fd, what in before[src].items() if what.endswith("/work/fifo")]
                assert fifo_fds and fd_table(cl) == before[src], (before[src], fd_table(cl))
                for fd in fifo_fds:
                    assert os.stat(f"/proc/{cl}/fd/{fd}").st_ino == fifo_ino
                    assert os.stat(f"/proc/{src}/fd/{fd}").st_ino == os.stat(work / "fifo").st_ino
            freeze(tcg, False)
            (troot / "go").write_bytes(b"")

            def read_by_r(path: Path) -> str:
                return "".join(f[3] for f in lines(path) if f[0] == "R" and f[3] != "-")

            def traffic_of(path: Path) -> str | None:
                x = read_by_r(path)
                return x if re.search(r"F\d", x) else None

            got = wait_for(lambda: traffic_of(troot / "log"), timeout=60, what="the clones' FIFO traffic")
            assert got.startswith("FIFOBUF;F"), got
            freeze(cg, False)
            (work / "go").write_bytes(b"")
            got = wait_for(lambda: traffic_of(work / "log"), timeout=60, what="the source's own FIFO traffic")
            assert got.startswith("FIFOBUF;F"), got  # its bytes were still there
        finally:
            kill_all(clones)
    finally:
        remove_cgroup(cg)


PTY_ROWS, PTY_COLS = 33, 101


def pty_main(work: str) -> None:
    """E (the root) holds a pty master and never uses it; its child T (pty.fork(): a session
    leader whose controlling tty, stdin, stdout and stderr are the slave) turns echo off, sets a
    33x101 window, creates *work*/ready and answers every line it reads with "reply LINE TTY
    CTTY FG LEADER ROWSxCOLS" (its slave's path, whether /dev/tty opens, whether its group is the
    tty's foreground group, whether it leads its session, the window size)."""
    _detach_and_wait(work)
    pid, _master = pty.fork()
    if pid == 0:
        attrs = termios.tcgetattr(0)
        attrs[3] &= ~termios.ECHO
        termios.tcsetattr(0, termios.TCSANOW, attrs)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", PTY_ROWS, PTY_COLS, 0, 0))
        Path(work, "ready").write_bytes(b"")
        while True:
            line = os.read(0, 4096).decode().strip()
            try:
                os.close(os.open("/dev/tty", os.O_RDWR))
                ctty = "ctty"
            except OSError:
                ctty = "noctty"
            fg = "fg" if os.tcgetpgrp(0) == os.getpgrp() else "bg"
            rows, cols = struct.unpack("HHHH", fcntl.ioctl(0, termios.TIOCGWINSZ, bytes(8)))[:2]
            os.write(1, f"reply {line} {os.ttyname(0)} {ctty} {fg} {os.getsid(0) == os.getpid()} "
                        f"{rows}x{cols}\n".encode())
    while True:
        time.sleep(1)


def read_reply(fd: int, timeout: float = 30.0) -> str:
    """One line read from the pty master *fd* (a copy of someone's, through pidfd_getfd)."""
    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"no reply on the pty master (got {got!r})"
        if select.select([fd], [], [], left)[0]:
            got += os.read(fd, 4096)
    return got.decode().replace("\r", "").strip()


def tty_nr(path: str) -> int:
    """The tty_nr /proc/PID/stat shows for the tty at *path*."""
    rdev = os.stat(path).st_rdev
    major, minor = os.major(rdev), os.minor(rdev)
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


def fd_flags(pid: int, fd: str) -> str:
    return next(ln.split()[1] for ln in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                if ln.startswith("flags:"))


def test_tree_fork_recreates_a_pty_pair(dev: int, procs: Procs, tmp_path: Path, target_cgroup) -> None:
    """A pty pair inside the tree (E holds the master, its child T runs on the slave, pty.fork()):
    the clones get a new pair from the target's own devpts instance, the same fd numbers and
    flags, the slave's termios (echo off) and window size, T's clone has the new slave as its
    controlling tty with its group in the foreground; a line written to the clone's master is
    answered by T's clone; the source's pair goes on working on its own."""
    tcg, tcg_fd = target_cgroup
    work = tmp_path / "work"
    work.mkdir()
    cg = make_cgroup(f"bunshin-tree-pty-{os.getpid()}-{time.monotonic_ns()}")
    own: list[int] = []
    try:
        root = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: pty_main(str(work)))
        (cg / "cgroup.procs").write_text(str(root))
        (work / "start").write_bytes(b"")
        wait_for(lambda: (work / "ready").exists(), timeout=60, what="the pty child")
        pids = tree_of(root)
        assert len(pids) == 2
        e, t = pids
        holder = spawn_holder(procs, str(work), devpts=True)
        freeze(cg)
        before = {p: fd_table(p) for p in pids}
        mfd = next(fd for fd, what in before[e].items() if what.endswith("ptmx"))
        src_slave = before[t]["0"]
        assert src_slave.startswith("/dev/pts/") and before[t]["1"] == before[t]["2"] == src_slave, before[t]
        src_stat = stat_fields(t)
        assert int(src_stat[4]) == tty_nr(f"/proc/{t}/fd/0") and int(src_stat[5]) == t  # tty_nr, tpgid
        clones = tree_fork(dev, pids, holder, tcg_fd)
        try:
            ce, ct = clones
            # The new pair lives in the holder's devpts instance, not in the source's.
            holder_pts = os.stat(f"/proc/{holder}/root/dev/pts/ptmx").st_dev
            assert holder_pts != os.stat(src_slave).st_dev
            assert fd_table(ce).keys() == before[e].keys() and fd_table(ct).keys() == before[t].keys()
            slave = os.readlink(f"/proc/{ct}/fd/0")
            assert slave.startswith("/dev/pts/"), fd_table(ct)
            for fd in ("0", "1", "2"):
                st = os.stat(f"/proc/{ct}/fd/{fd}")
                assert st.st_dev == holder_pts and st.st_rdev == os.stat(f"/proc/{ct}/fd/0").st_rdev
                assert fd_flags(ct, fd) == fd_flags(t, fd)
            assert os.stat(f"/proc/{ce}/fd/{mfd}").st_dev == holder_pts
            assert fd_flags(ce, mfd) == fd_flags(e, mfd)
            # T's clone: the new slave is its controlling tty, its group the foreground one; E's
            # clone has none, as E.
            st = stat_fields(ct)
            assert int(st[3]) == ct and int(st[4]) == tty_nr(f"/proc/{ct}/fd/0") and int(st[5]) == ct, st
            assert int(stat_fields(ce)[4]) == int(stat_fields(e)[4]) == 0
            # The slave's termios and window size, read through the clone's own slave.
            cpidfd = os.pidfd_open(ct)
            own.append(cpidfd)
            cslave = c.pidfd_getfd(cpidfd, 0)
            own.append(cslave)
            assert not termios.tcgetattr(cslave)[3] & termios.ECHO
            assert termios.tcgetattr(cslave)[3] & termios.ICANON
            assert struct.unpack("HHHH", fcntl.ioctl(cslave, termios.TIOCGWINSZ, bytes(8)))[:2] == (PTY_ROWS, PTY_COLS)

            freeze(tcg, False)
            epidfd = os.pidfd_open(ce)
            own.append(epidfd)
            cmaster = c.pidfd_getfd(epidfd, int(mfd))
            own.append(cmaster)
            os.write(cmaster, b"clone-ping\n")
            # Echo off: the reply is the first thing on the master, not the line written.
            assert read_reply(cmaster) == f"reply clone-ping {slave} ctty fg True {PTY_ROWS}x{PTY_COLS}"

            # The source's pair: nothing of the clone's traffic, and it answers on its own.
            freeze(cg, False)
            spidfd = os.pidfd_open(e)
            own.append(spidfd)
            smaster = c.pidfd_getfd(spidfd, int(mfd))
            own.append(smaster)
            assert not select.select([smaster], [], [], 0.5)[0]
            os.write(smaster, b"source-ping\n")
            assert read_reply(smaster) == f"reply source-ping {src_slave} ctty fg True {PTY_ROWS}x{PTY_COLS}"
            os.write(cmaster, b"clone-again\n")
            assert read_reply(cmaster) == f"reply clone-again {slave} ctty fg True {PTY_ROWS}x{PTY_COLS}"
            assert not select.select([smaster], [], [], 0.3)[0]
        finally:
            kill_all(clones)
            for fd in own:
                os.close(fd)
    finally:
        remove_cgroup(cg)


# --- bad requests ------------------------------------------------------------------------------


def assert_nothing_made(ws: Workspace, tcg: Path, holder: int, before: dict[int, dict[str, str]]) -> None:
    """No clone anywhere: the target cgroup is empty and the holder's new pid namespace has never
    had a process (its pid_for_children link exists once the namespace has an init, and stays);
    the sources resume untouched: same fd tables, next counter."""
    assert (tcg / "cgroup.procs").read_text().split() == []
    with pytest.raises(FileNotFoundError):
        os.readlink(f"/proc/{holder}/ns/pid_for_children")
    for p, table in before.items():
        assert fd_table(p) == table
    last = {r: last_counter(ws.log, r) for r in ROLES}
    freeze(ws.cg, False)
    wait_for(lambda: all(last_counter(ws.log, r) > last[r] for r in ROLES), what="the sources to resume")
    lines = log_lines(ws.log)
    for r in ROLES:
        assert min(int(f[6]) for f in lines if f[0] == r and int(f[6]) > last[r]) == last[r] + 1


def refused(dev: int, ws: Workspace, holder: int, tcg_fd: int, pids=None) -> int:
    pidfd = os.pidfd_open(holder)
    try:
        return errno_of(lambda: c.bunshin_fork_tree(dev, ws.pids if pids is None else pids, pidfd, tcg_fd))
    finally:
        os.close(pidfd)


@pytest.mark.parametrize("workspace", [{"eventfd_in": "G"}], indirect=True)
def test_unsupported_fd_in_the_tree_is_einval_and_leaves_nothing(dev: int, procs: Procs, workspace: Workspace,
                                                                target_cgroup) -> None:
    """An eventfd held by the grandchild: EINVAL, the kernel log names it; no clone, the holder's
    new pid namespace still empty (a later good request gets pid 1 there), the sources untouched."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    g = next(p for p in ws.pids if ws.role[p] == "G")
    efd = next(int(fd) for fd, what in before[g].items() if "eventfd" in what)
    assert refused(dev, ws, holder, tcg_fd) == errno.EINVAL
    assert f"source pid {g}: fd {efd} is a anonymous inode [eventfd]" in kernel_log()
    assert_nothing_made(ws, tcg, holder, before)
    # The holder's pid namespace is unchanged, still empty: the next tree's root becomes its init.
    one, one_cg = simple_source(procs)
    pidfd = os.pidfd_open(holder)
    try:
        clones = c.bunshin_fork_tree(dev, [one], pidfd, tcg_fd)
        assert nspid(clones[0]) == 1
        kill_all(clones)
    finally:
        os.close(pidfd)
        remove_cgroup(one_cg)


@pytest.mark.parametrize("workspace", [{"pty_in": "A"}], indirect=True)
def test_pty_with_its_slave_held_outside_the_tree_is_einval(dev: int, procs: Procs, workspace: Workspace,
                                                            target_cgroup) -> None:
    """A holds both ends of a pty pair; the test opens the slave too (a process outside the tree):
    EINVAL, the log names A, the fd and the pty, nothing is made. Once the outside file is closed,
    the same request forks the tree, A's clone holding a new pair (the same fd numbers)."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    a = next(p for p in ws.pids if ws.role[p] == "A")
    sfd = next(fd for fd, what in before[a].items() if re.fullmatch(r"/dev/pts/\d+", what))
    mfd = next(fd for fd, what in before[a].items() if what.endswith("ptmx"))
    outside = os.open(f"/proc/{a}/fd/{sfd}", os.O_RDWR | os.O_NOCTTY)
    try:
        assert refused(dev, ws, holder, tcg_fd) == errno.EINVAL
    finally:
        os.close(outside)
    name = "pts" + before[a][sfd].rsplit("/", 1)[1]
    assert re.search(rf"tree fork: source pid {a}: fd ({sfd}|{mfd}) is a pty \({name}\) that a process outside "
                     r"the tree holds open: the fork is refused", kernel_log())
    assert_nothing_made(ws, tcg, holder, before)
    clones = frozen_tree_fork(dev, ws, holder, tcg_fd)
    try:
        ca = clones[ws.pids.index(a)]
        table = fd_table(ca)
        assert table.keys() == before[a].keys()
        assert re.fullmatch(r"/dev/pts/\d+", table[sfd]) and table[sfd] != before[a][sfd], table
        assert os.stat(f"/proc/{ca}/fd/{mfd}").st_rdev == os.stat("/dev/ptmx").st_rdev
    finally:
        kill_all(clones)


def tty_source_main(path: str) -> None:
    """A single process holding the tty at *path* open as fd 3 (not as its controlling tty)."""
    os.closerange(3, 65536)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    assert os.open(path, os.O_RDWR | os.O_NOCTTY) == 3
    while True:
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["pty slave", "console"])
def test_tty_outside_the_workspace_is_einval(dev: int, procs: Procs, tmp_path: Path, target_cgroup,
                                             kind: str) -> None:
    """A process holding a pty slave whose master the test holds (outside the tree), or the
    console: EINVAL, the log names the pid, fd 3 and its kind; no clone, the holder's pid
    namespace still empty, the source's table unchanged."""
    tcg, tcg_fd = target_cgroup
    master, slave = os.openpty()
    path = os.ttyname(slave) if kind == "pty slave" else "/dev/console"
    cg = make_cgroup(f"bunshin-tree-tty-{os.getpid()}-{time.monotonic_ns()}")
    try:
        pid = procs.spawn(CLONE_NEWPID | CLONE_NEWNS, lambda: tty_source_main(path))
        (cg / "cgroup.procs").write_text(str(pid))
        wait_for(lambda: "3" in fd_table(pid), what="the tty open in the source")
        holder = spawn_holder(procs, str(tmp_path))
        freeze(cg)
        before = fd_table(pid)
        pidfd = os.pidfd_open(holder)
        try:
            assert errno_of(lambda: c.bunshin_fork_tree(dev, [pid], pidfd, tcg_fd)) == errno.EINVAL
        finally:
            os.close(pidfd)
        if kind == "pty slave":
            want = rf"source pid {pid}: fd 3 is a pty slave whose master is not in the tree: the fork is refused"
        else:
            want = rf"source pid {pid}: fd 3 is a tty \(character device 5:1\): this kind is not carried over"
        assert re.search(want, kernel_log())
        assert (tcg / "cgroup.procs").read_text().split() == []
        with pytest.raises(FileNotFoundError):
            os.readlink(f"/proc/{holder}/ns/pid_for_children")
        assert fd_table(pid) == before
    finally:
        os.close(master)
        os.close(slave)
        remove_cgroup(cg)


@pytest.mark.parametrize("workspace", [{"fd_in_flight": True}], indirect=True)
def test_socket_with_fds_in_flight_is_einval(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """B sent an fd to A (SCM_RIGHTS) that A has not received yet: refused, nothing made."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    assert refused(dev, ws, holder, tcg_fd) == errno.EINVAL
    assert re.search(r"fd \d+ is a unix socket that has file descriptors in flight: the fork is refused",
                     kernel_log())
    assert_nothing_made(ws, tcg, holder, before)


@pytest.mark.parametrize("workspace", [{"outside_pipe": True}], indirect=True)
def test_pipe_with_an_end_outside_the_tree_is_einval(dev: int, procs: Procs, workspace: Workspace,
                                                    target_cgroup) -> None:
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    outside = next(p for p in ws.pids if p not in ws.role)  # X: holds the write end
    pids = [p for p in ws.pids if p != outside]
    freeze(ws.cg)
    before = {p: fd_table(p) for p in pids}
    assert refused(dev, ws, holder, tcg_fd, pids) == errno.EINVAL
    assert "with 1 readers and 1 writers, 1 and 0 of them in the tree" in kernel_log()
    assert_nothing_made(ws, tcg, holder, before)


@pytest.mark.parametrize("workspace", [{"thread_in": "B"}], indirect=True)
def test_multithreaded_process_in_the_tree_is_einval(dev: int, procs: Procs, workspace: Workspace,
                                                   target_cgroup) -> None:
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    b = next(p for p in ws.pids if ws.role[p] == "B")
    assert refused(dev, ws, holder, tcg_fd) == errno.EINVAL
    assert f"tree fork: source pid {b} has 2 threads: multi-threaded sources are refused" in kernel_log()
    assert_nothing_made(ws, tcg, holder, before)


def test_bad_source_lists(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """Unknown pid: ESRCH; not frozen: EBUSY; a child before its parent, a pid twice, a pid of
    another pid namespace: EINVAL; too many or no pids: ValueError in the binding, EINVAL in the
    module. Nothing is made."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    before = {p: fd_table(p) for p in ws.pids}
    assert refused(dev, ws, holder, tcg_fd) == errno.EBUSY  # not frozen yet
    freeze(ws.cg)
    assert refused(dev, ws, holder, tcg_fd, [*ws.pids, 4_000_000]) == errno.ESRCH
    assert refused(dev, ws, holder, tcg_fd, list(reversed(ws.pids))) == errno.EINVAL
    assert refused(dev, ws, holder, tcg_fd, [*ws.pids, ws.pids[1]]) == errno.EINVAL
    one, one_cg = simple_source(procs)
    try:
        assert refused(dev, ws, holder, tcg_fd, [ws.pids[0], one]) == errno.EINVAL  # another pid namespace
    finally:
        remove_cgroup(one_cg)
    with pytest.raises(ValueError):
        c.bunshin_fork_tree(dev, [], 0, tcg_fd)
    with pytest.raises(ValueError):
        c.bunshin_fork_tree(dev, [1] * (TREE_MAX + 1), 0, tcg_fd)
    pidfd = os.pidfd_open(holder)
    try:
        assert errno_of(lambda: c.bunshin_fork_tree(dev, ws.pids, dev, tcg_fd)) == errno.EBADF  # not a pidfd
        plain = os.open(ws.work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert errno_of(lambda: c.bunshin_fork_tree(dev, ws.pids, pidfd, plain)) == errno.EBADF  # not a cgroup
        finally:
            os.close(plain)
    finally:
        os.close(pidfd)
    assert_nothing_made(ws, tcg, holder, before)


def raw_tree_ioctl(fd: int, req_addr: int) -> int:
    _libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    if _libc.ioctl(fd, IOC_FORK_TREE, ctypes.c_void_p(req_addr)) == 0:
        return 0
    return ctypes.get_errno()


def test_garbage_and_truncated_arguments(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """Nonzero flags or reserved fields, a count of 0 or above the maximum: EINVAL; unreadable
    source pids, an unwritable pid array, a truncated or missing argument: EFAULT; another size
    in the command: ENOTTY. Nothing is made."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    pidfd = os.pidfd_open(holder)
    n = len(ws.pids)
    src = (ctypes.c_int32 * n)(*ws.pids)
    out = (ctypes.c_int32 * n)()
    page = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    try:
        def req(**kw) -> bytes:
            f = {"flags": 0, "count": n, "src": ctypes.addressof(src), "out": ctypes.addressof(out), "pidfd": pidfd,
                 "cgroup": tcg_fd, "ns": 0, "reserved": (0, 0, 0)}
            f.update(kw)
            return struct.pack(TREE_FMT, f["flags"], f["count"], f["src"], f["out"], f["pidfd"], f["cgroup"],
                               f["ns"], *f["reserved"])

        def call(buf: bytes) -> int:
            arg = bytearray(buf)
            return errno_of(lambda: fcntl.ioctl(dev, IOC_FORK_TREE, arg))

        assert call(req(flags=1)) == errno.EINVAL
        assert call(req(reserved=(0, 0, 7))) == errno.EINVAL
        assert call(req(count=0)) == errno.EINVAL
        assert call(req(count=TREE_MAX + 1)) == errno.EINVAL
        assert call(req(src=8)) == errno.EFAULT
        assert call(req(src=0xDEAD0000DEAD0000)) == errno.EFAULT
        assert call(req(out=8)) == errno.EFAULT
        # The pid arrays at the end of a readable page followed by a page that is not.
        ro = base + mmap.PAGESIZE - 4 * n
        ctypes.memmove(ro, src, 4 * n)
        assert _libc.mprotect(ctypes.c_void_p(base), mmap.PAGESIZE, 1) == 0  # PROT_READ
        assert _libc.mprotect(ctypes.c_void_p(base + mmap.PAGESIZE), mmap.PAGESIZE, 0) == 0  # PROT_NONE
        assert call(req(out=ro)) == errno.EFAULT  # the output array is read-only
        assert call(req(src=ro + 4, count=n)) == errno.EFAULT  # runs into the PROT_NONE page
        # The argument itself truncated by the PROT_NONE page, then missing.
        assert _libc.mprotect(ctypes.c_void_p(base), mmap.PAGESIZE, 3) == 0
        arg_at = base + mmap.PAGESIZE - TREE_SIZE // 2
        ctypes.memmove(arg_at, req()[:TREE_SIZE // 2], TREE_SIZE // 2)
        assert raw_tree_ioctl(dev, arg_at) == errno.EFAULT
        assert raw_tree_ioctl(dev, 0) == errno.EFAULT
        # A size the module does not know: another command.
        short = _ioc(_IOC_READ | _IOC_WRITE, 0x02, 32)
        assert errno_of(lambda: fcntl.ioctl(dev, short, bytearray(32))) == errno.ENOTTY
        assert list(out) == [0] * n
    finally:
        os.close(pidfd)
    assert_nothing_made(ws, tcg, holder, before)


def test_tree_fork_needs_cap_sys_admin(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    pidfd = os.pidfd_open(holder)

    def child() -> int:
        set_effective_caps({CAP_CHECKPOINT_RESTORE})
        if errno_of(lambda: version(dev)) != 0:
            return 98
        return errno_of(lambda: c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd))

    try:
        assert in_child(child) == errno.EPERM
    finally:
        os.close(pidfd)
    assert (tcg / "cgroup.procs").read_text().split() == []


def test_target_exiting_midway(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """The target's init is killed while the tree forks into its pid namespace (at random points):
    the request succeeds or fails, never hangs or crashes; no clone is left once the namespace is
    gone; the sources resume."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    rng = random.Random(5)
    outcomes = []
    for _ in range(12):
        target = procs.spawn(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET,
                             lambda: clean_target_main(str(ws.work)))
        ready = Path(f"/proc/{target}/root{ws.work}/ready")
        wait_for(ready.exists, what="the target's files")
        target_ns = os.readlink(f"/proc/{target}/ns/pid")
        pidfd = os.pidfd_open(target)
        delay = rng.uniform(0, 0.05)
        killer = threading.Timer(delay, os.kill, (target, signal.SIGKILL))
        killer.start()
        try:
            clones = c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd)
            outcomes.append(0)
        except OSError as exc:
            assert exc.errno in (errno.ESRCH, errno.ENOMEM, errno.EINVAL), exc
            outcomes.append(exc.errno)
            clones = []
        finally:
            killer.join()
            os.close(pidfd)
        freeze(tcg, False)  # let whatever is left die
        kill_all(clones)

        def gone(target_ns: str = target_ns) -> bool:
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        if os.readlink(f"/proc/{entry}/ns/pid") == target_ns:
                            return False
                    except OSError:
                        pass
            return True

        wait_for(gone, timeout=30, what="the target's pid namespace to empty")
        wait_for(lambda: not (tcg / "cgroup.procs").read_text().split(), what="the target cgroup to empty")
        freeze(tcg)
    print(f"target killed midway: outcomes (0 = forked) {outcomes}")
    for p, table in before.items():
        assert fd_table(p) == table
    last = {r: last_counter(ws.log, r) for r in ROLES}
    freeze(ws.cg, False)
    wait_for(lambda: all(last_counter(ws.log, r) > last[r] for r in ROLES), what="the sources to resume")


def _socket_fd(pid: int) -> int:
    """The fd of *pid*'s end of the workspace's unix socket pair (A's and B's)."""
    socks = [int(fd) for fd, path in fd_table(pid).items() if path.startswith("socket:")]
    assert len(socks) == 1, fd_table(pid)
    return socks[0]


def test_tree_fork_with_fd_substitutions(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """BUNSHIN_TREE_SUBST (ABI 4): both ends of the A-B socket pair replaced by the caller's
    own pair: the clones hold the caller's sockets at the same fd numbers (shared open files,
    not copies); the rest of the tree is carried over as without substitutions, and what the
    caller sends on its pair reaches the clone of A, which logs it."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    target = ready_target(procs, ws)
    freeze(ws.cg)
    a = next(p for p, r in ws.role.items() if r == "A")
    b = next(p for p, r in ws.role.items() if r == "B")
    fa, fb = _socket_fd(a), _socket_fd(b)
    sa, sb = socket.socketpair()
    subst = [(ws.pids.index(a), fa, sa.fileno()), (ws.pids.index(b), fb, sb.fileno())]
    clones = tree_fork(dev, ws.pids, target, tcg_fd, subst=subst)
    try:
        of = dict(zip(ws.pids, clones))
        assert os.stat(f"/proc/{of[a]}/fd/{fa}").st_ino == os.fstat(sa.fileno()).st_ino
        assert os.stat(f"/proc/{of[b]}/fd/{fb}").st_ino == os.fstat(sb.fileno()).st_ino
        assert os.stat(f"/proc/{of[a]}/fd/{fa}").st_ino != os.stat(f"/proc/{a}/fd/{fa}").st_ino
        # the source's table is untouched
        assert os.stat(f"/proc/{a}/fd/{fa}").st_ino != os.fstat(sa.fileno()).st_ino
    finally:
        kill_all(clones)
        sa.close()
        sb.close()


def test_tree_fork_substitution_errors(dev: int, procs: Procs, workspace: Workspace, target_cgroup) -> None:
    """Bad substitutions are refused before anything is made: an index out of range, one fd
    twice, an fd the source has not open (EINVAL, logged), a caller fd not open (EBADF), a
    substitution pointer without the flag (EINVAL) or unreadable (EFAULT); only one end of the
    socket pair substituted leaves the other refused (EINVAL)."""
    ws = workspace
    tcg, tcg_fd = target_cgroup
    holder = spawn_holder(procs, str(ws.work))
    freeze(ws.cg)
    before = {p: fd_table(p) for p in ws.pids}
    a = next(p for p, r in ws.role.items() if r == "A")
    fa = _socket_fd(a)
    ia = ws.pids.index(a)
    sa, sb = socket.socketpair()
    closed = 999  # an fd the caller has not open
    with pytest.raises(OSError):
        os.fstat(closed)
    pidfd = os.pidfd_open(holder)

    def fork(subst) -> int:
        return errno_of(lambda: c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd, subst=subst))

    try:
        assert fork([(len(ws.pids), fa, sa.fileno())]) == errno.EINVAL
        assert fork([(ia, fa, sa.fileno()), (ia, fa, sb.fileno())]) == errno.EINVAL
        assert fork([(ia, 900, sa.fileno())]) == errno.EINVAL
        assert "has no fd 900 to substitute" in kernel_log()
        assert fork([(ia, fa, closed)]) == errno.EBADF
        assert fork([(ia, fa, sa.fileno())]) == errno.EINVAL  # B's end now has its peer outside
        with pytest.raises(ValueError):
            c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd, subst=[(0, 0, 0)] * (c.BUNSHIN_TREE_SUBST_MAX + 1))
        with pytest.raises(TypeError):
            c.bunshin_fork_tree(dev, ws.pids, pidfd, tcg_fd, subst=[(0, 1)])
        n = len(ws.pids)
        src = (ctypes.c_int32 * n)(*ws.pids)
        out = (ctypes.c_int32 * n)()

        def raw(flags: int, subst: int, count: int) -> int:
            arg = bytearray(struct.pack(TREE_FMT, flags, n, ctypes.addressof(src), ctypes.addressof(out), pidfd,
                                        tcg_fd, 0, subst, count, 0))
            return errno_of(lambda: fcntl.ioctl(dev, IOC_FORK_TREE, arg))

        assert raw(0, 8, 0) == errno.EINVAL  # a pointer without the flag
        assert raw(0, 0, 1) == errno.EINVAL  # a count without the flag
        assert raw(1, 0, 0) == errno.EINVAL  # the flag without a count
        assert raw(1, 8, 1) == errno.EFAULT
        assert raw(3, 8, 1) == errno.EINVAL  # an unknown flag
    finally:
        os.close(pidfd)
        sa.close()
        sb.close()
    assert_nothing_made(ws, tcg, holder, before)
