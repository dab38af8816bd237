"""The zygote: a small, quiet process that clones the first process of every workspace.

A workspace's first process (its agent, or a forked workspace's holder) is a ``clone3`` child
running Python. Cloned from the controller itself, it shared the controller's whole heap
copy-on-write, and every page the controller wrote afterwards (its garbage collector walks
every object it tracks) left the agent holding a private copy of the old page: a workspace's
memory grew with the controller's activity, not its own (one ``gc.collect()`` in a controller
of about 44 MiB made an idle agent 14 MiB bigger), and what the simulator is given as the task's
runtime memory did not predict it.

The zygote is a fresh interpreter started once per controller process, on first use. It loads
only the modules a workspace's first process runs (not the package's ``__init__`` and its
integrations), freezes its garbage collector and then only waits for requests on a
``SOCK_SEQPACKET`` socket, so the pages an agent shares with it stay shared. It clones with
``CLONE_PARENT``: the new process is the controller's child, which reaps, signals and waits for
it exactly as before. A request carries the clone flags and, as ``SCM_RIGHTS``, the process's
end of its socket pair and the cgroup directory to be born in; the answer carries the pid and,
as ``SCM_RIGHTS``, its pidfd. The zygote exits when the controller closes its end (at exit,
or when the controller dies: the kernel closes it).
"""

from __future__ import annotations

import atexit
import os
import socket
import struct
import subprocess
import sys
import threading

__all__ = ["clone", "ready", "running_pid", "stop"]

_REQUEST = struct.Struct("=BQ")  # kind, clone flags
_REPLY = struct.Struct("=iii")  # pid, errno, the process's fd number of its socket end
_KINDS = ("agent", "holder")

_lock = threading.Lock()
_proc: subprocess.Popen[bytes] | None = None
_chan: socket.socket | None = None

_BOOT = """\
import importlib.util, sys, types
sys.path[:] = {path!r}
pkg = types.ModuleType("bunshin_async")
pkg.__path__ = [{pkgdir!r}]
sys.modules["bunshin_async"] = pkg
spec = importlib.util.spec_from_file_location("bunshin_async._bunshin_c", {cext!r})
mod = importlib.util.module_from_spec(spec)
sys.modules["bunshin_async._bunshin_c"] = mod
spec.loader.exec_module(mod)
from bunshin_async._zygote import _main
_main({fd})
"""


def running_pid() -> int | None:
    """The zygote's pid while one runs (tests that look for stray processes skip it)."""
    proc = _proc
    return proc.pid if proc is not None and proc.poll() is None else None


def _start() -> socket.socket:
    """Start the zygote (the caller holds ``_lock``) and wait until it is ready."""
    global _proc, _chan
    from . import _bunshin_c

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = _BOOT.format(path=[p for p in sys.path if p], pkgdir=os.path.dirname(os.path.abspath(__file__)),
                        cext=os.path.abspath(_bunshin_c.__file__), fd=theirs.fileno())
    try:
        proc = subprocess.Popen([sys.executable, "-S", "-c", code], pass_fds=(theirs.fileno(),),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        theirs.close()
    assert proc.stderr is not None
    ready = mine.recv(16)
    if ready != b"ready":
        proc.wait()
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        proc.stderr.close()
        mine.close()
        raise OSError(f"the workspace zygote ({sys.executable}) did not start: "
                      f"{err[-1] if err else f'exit status {proc.returncode}'}")
    proc.stderr.close()
    _proc, _chan = proc, mine
    return mine


def stop() -> None:
    """Stop the zygote (it is started again on next use)."""
    global _proc, _chan
    with _lock:
        if _chan is not None:
            _chan.close()
            _chan = None
        if _proc is not None:
            try:
                _proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _proc.kill()
                _proc.wait()
            _proc = None


atexit.register(stop)


def _forget_inherited() -> None:
    """In a child forked from a process that had a zygote: that zygote is the parent's (its
    channel would carry both processes' requests), so this one starts its own on first use."""
    global _proc, _chan, _lock
    if _chan is not None:
        _chan.close()  # this process's copy only: the parent's stays open
    _proc = _chan = None
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_inherited)


def _channel() -> socket.socket:
    """The channel to a running zygote, started if need be (the caller holds ``_lock``)."""
    if _proc is not None and _proc.poll() is None and _chan is not None:
        return _chan
    _forget()
    return _start()


def ready() -> None:
    """Start the zygote unless it runs (blocking: about the time an interpreter takes to start
    and import the workspace modules; call it from a worker thread)."""
    with _lock:
        _channel()


def clone(kind: str, flags: int, sock: socket.socket, cgroup_fd: int = -1) -> tuple[int, int, int]:
    """Clone a workspace's first process from the zygote.

    Args:
        kind: ``"agent"`` (runs ``_container._child_main``) or ``"holder"``
            (``_container._holder_main``).
        flags: ``clone3`` flags (``CLONE_PIDFD`` and ``CLONE_PARENT`` are added;
            ``CLONE_INTO_CGROUP`` when *cgroup_fd* is given).
        sock: The process's end of its socket pair (the caller closes its copy after).
        cgroup_fd: A directory fd of the cgroup to be born in, or -1.

    Returns:
        ``(pid, pidfd, fd)``: the new process (a child of this process), a pidfd of it, and the
        fd number its end of the socket pair has in it.

    Raises:
        OSError: ``clone3`` failed (its errno), or the zygote could not be started or died.
    """
    from . import _bunshin_c as c

    flags |= c.CLONE_PIDFD | c.CLONE_PARENT | (c.CLONE_INTO_CGROUP if cgroup_fd >= 0 else 0)
    fds = [sock.fileno()] + ([cgroup_fd] if cgroup_fd >= 0 else [])
    msg = _REQUEST.pack(_KINDS.index(kind), flags)
    with _lock:
        for attempt in range(2):
            # A zygote that died since it was last used (killed, say) may not look dead yet:
            # the request then fails or finds the channel closed, and a new zygote takes it.
            # Only a zygote killed between its clone and its answer leaves a clone nobody
            # knows of; it finds its socket closed, exits and stays a zombie of this process.
            chan = _channel()
            try:
                socket.send_fds(chan, [msg], fds)
                data, got, _, _ = socket.recv_fds(chan, _REPLY.size, 1)
            except OSError as exc:
                _forget()
                if attempt:
                    raise OSError(exc.errno, f"the workspace zygote is gone: {exc.strerror}") from None
                continue
            if len(data) == _REPLY.size:
                break
            for fd in got:
                os.close(fd)
            _forget()
            if attempt:
                raise OSError("the workspace zygote died during a clone")
    pid, err, child_fd = _REPLY.unpack(data)
    if err:
        raise OSError(err, f"clone3: {os.strerror(err)}")
    return pid, got[0], child_fd


def _forget() -> None:
    global _proc, _chan
    if _chan is not None:
        _chan.close()
        _chan = None
    if _proc is not None:
        _proc.kill()
        _proc.wait()
        _proc = None


def _main(fd: int) -> None:
    """The zygote's loop (in the fresh interpreter)."""
    import gc

    from . import _bunshin_c as c
    from ._container import _child_main, _holder_main

    chan = socket.socket(fileno=fd)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 2)  # nothing more goes to the controller's pipe
    os.close(null)
    gc.collect()
    gc.freeze()  # from here on the heap the clones share is never walked or written
    chan.send(b"ready")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(chan, _REQUEST.size, 2)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)  # the controller closed its end, or died
        kind, flags = _REQUEST.unpack(data)
        sock = socket.socket(fileno=fds[0])
        cgroup_fd = fds[1] if len(fds) > 1 else -1
        try:
            # with CLONE_PARENT, clone3 takes no exit signal: the child gets this process's
            # own (SIGCHLD), which its parent, the controller, receives
            pid, pidfd = c.clone3(flags, cgroup_fd=cgroup_fd, exit_signal=0)
        except OSError as exc:
            pid, pidfd, err = -1, -1, exc.errno or 1
        else:
            err = 0
        if pid == 0:
            (_child_main if _KINDS[kind] == "agent" else _holder_main)(sock)
        child_fd = sock.fileno()
        sock.close()
        if cgroup_fd >= 0:
            os.close(cgroup_fd)
        socket.send_fds(chan, [_REPLY.pack(pid, err, child_fd)], [pidfd] if pidfd >= 0 else [])
        if pidfd >= 0:
            os.close(pidfd)
