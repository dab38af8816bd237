"""The workspace agent: pid 1 of every live workspace, and the protocol the controller speaks
to it.

The controller and the agent share a socketpair. Each message is a 4-byte big-endian length
and a msgpack document (a tagged :mod:`msgspec` struct). The controller sends one request at a
time and reads one reply: :class:`Exec` (run a program or a ``sh -c`` command in a fresh
process group), :class:`Shell` (run a command in a persistent shell session), :class:`Ping`.
Replies are :class:`ExecResult`, :class:`Pong` or :class:`AgentError`.

The agent is a blocking loop (no asyncio: it runs in a forked copy of the controller, which
may have had an event loop running). It waits on the socket and on SIGCHLD (a wakeup pipe),
reaps every child, orphans included (pid 1's duty), and exits when the socket closes, which
kills the whole pid namespace. It waits with ``poll()`` (no epoll fd): a tree fork
(``BUNSHIN_IOC_FORK_TREE``) refuses an epoll fd, and a frozen agent is forked while it waits.

A workspace forked from a frozen process tree (the ``bunshin`` and ``criu`` engines of the
live backend) has a clone of the agent as its pid 1, resumed where it waited, on a new socket
the controller substituted for its own; the controller's first request, :class:`Forked`, has it
mount a ``/proc`` of its new pid namespace (its holder, outside that namespace, could not).

A persistent session is a shell reading commands from a pipe. A command is sent as::

    __bunshin_cmd='<the command, single-quoted>'
    eval "$__bunshin_cmd" < /dev/null
    __bunshin_st=$?
    printf '\\n<marker>:%d\\n' "$__bunshin_st"; printf '\\n<marker>:0\\n' >&2

with a fresh random marker per call, so ``cd``, variables and functions persist, a syntax
error is just a status, and the output ends exactly before the marker line on each stream.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import time
from typing import Any

import msgspec

__all__ = [
    "AgentError",
    "Boot",
    "Exec",
    "ExecResult",
    "Forked",
    "Ping",
    "Pong",
    "Ready",
    "Rebind",
    "Shell",
    "recv",
    "send",
    "serve",
]


class Exec(msgspec.Struct, tag="exec"):
    """Run a program (argv) or a shell command (``sh -c``) in a fresh process group."""

    argv: list[str] | None = None
    command: str | None = None
    env: dict[str, str] = {}
    cwd: str = "/"
    timeout: float | None = None
    output_limit: int = 1 << 20
    stdin: bytes = b""


class Shell(msgspec.Struct, tag="shell"):
    """Run *command* in the persistent shell session *session* (started at first use)."""

    session: str
    command: str
    timeout: float | None = None
    output_limit: int = 1 << 20


class Ping(msgspec.Struct, tag="ping"):
    """Ask whether the agent is alive."""


class Forked(msgspec.Struct, tag="forked"):
    """Sent first to the clone of an agent: mount a ``/proc`` for the pid namespace it is
    now the init of (over whatever is at ``/proc``), then answer with :class:`Pong`."""

    proc: bool = True


class Rebind(msgspec.Struct, tag="rebind"):
    """Move the agent's channel into its own network namespace: the agent makes a new socket
    pair there, sends one end back (``SCM_RIGHTS``, with the byte ``r``) on the old channel,
    puts the other end at its channel's fd number (closing the old one) and answers with
    :class:`Pong` on the new channel. The ``criu`` engine asks for it before a checkpoint: a
    socket of the controller's network namespace is one CRIU cannot dump."""


class Boot(msgspec.Struct, tag="boot"):
    """Sent once by the controller after the agent's process is placed in its cgroups: how
    to set the workspace up (see :func:`bunshin_async._container._child_main`)."""

    rootfs: str
    lowerdirs: list[str]
    upper: str
    work: str
    chdir: str
    hostname: str
    env: dict[str, str]
    cwd: str
    shell: str
    init: list[str] | None = None
    sysfs: bool = True
    root_overlay: str | None = None
    """Mount the root (the last lowerdir) first as a read-only overlay here, and stack that:
    overlayfs refuses a layer below another layer's directory (the host root holds them all)."""
    proc: bool = True
    """Mount ``/proc``. A holder (the parent of a forked workspace's pid 1, outside its pid
    namespace) does not: the agent's clone mounts it on :class:`Forked`."""
    root_only: bool = False
    """Mount the overlay root only, and stay where it is (no ``/proc``, ``/dev``, ``/sys``,
    host name, loopback or ``pivot_root``): a holder whose mount namespace CRIU restores a
    workspace from (``--root``), with the workspace's own mounts and namespaces from its image."""


class Ready(msgspec.Struct, tag="ready"):
    """The workspace is set up; *pid* is the agent's pid inside (1)."""

    pid: int


class Pong(msgspec.Struct, tag="pong"):
    """Reply to :class:`Ping`."""

    sessions: list[str]
    """Names of the live shell sessions."""
    init_status: int | None
    """Exit status of the init service if it ended (negative: killed by that signal), else None."""


class ExecResult(msgspec.Struct, frozen=True, tag="result"):
    """What a command did. A command that fails is a result with its exit status, not an error."""

    status: int
    """Exit status; negative when killed by a signal (``-9`` after a timeout)."""
    stdout: bytes
    """Standard output, at most the output limit."""
    stderr: bytes
    """Standard error, at most the output limit."""
    truncated: bool
    """Whether stdout or stderr was cut at the output limit."""
    duration: float
    """Seconds from start to end, measured by the agent."""
    timed_out: bool
    """Whether the command was killed at its timeout."""

    @property
    def ok(self) -> bool:
        """Exit status 0 and not timed out."""
        return self.status == 0 and not self.timed_out


class AgentError(msgspec.Struct, tag="error"):
    """The agent could not do what was asked (*kind*: ``setup``, ``spawn``, ``protocol``)."""

    kind: str
    message: str


Request = Exec | Shell | Ping | Forked | Rebind
Reply = Ready | Pong | ExecResult | AgentError

_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 1 << 30
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_boot_decoder = msgspec.msgpack.Decoder(Boot)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def send(sock: socket.socket, msg: Any) -> None:
    """Send one framed message."""
    data = _encoder.encode(msg)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, kind: str = "reply") -> Any:
    """Receive one framed message: a reply (controller side), a ``request`` or the ``boot``
    message (agent side). Returns None when the peer closed the socket."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > _MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes is too large")
    data = _recv_exact(sock, size)
    if data is None:
        return None
    decoder = {"reply": _reply_decoder, "request": _request_decoder, "boot": _boot_decoder}[kind]
    return decoder.decode(data)


# --- the agent side --------------------------------------------------------------------------


class _Sink:
    """Collects one output stream: keeps the first *cap* bytes, and with a *marker* finds where
    the output ends (the marker line ``\\n<marker>:<status>\\n``)."""

    def __init__(self, cap: int, marker: bytes | None = None) -> None:
        self.cap = cap
        self.head = bytearray()
        self.total = 0
        self.marker = marker
        self.tail = bytearray()
        self.tail_start = 0
        self.end: int | None = None
        self.status = 0

    def feed(self, data: bytes) -> None:
        if len(self.head) < self.cap:
            self.head += data[: self.cap - len(self.head)]
        self.total += len(data)
        if self.marker is None or self.end is not None:
            return
        self.tail += data
        i = self.tail.find(self.marker)
        if i >= 0:
            j = self.tail.find(b"\n", i + len(self.marker))
            if j >= 0:
                self.end = self.tail_start + i
                try:
                    self.status = int(self.tail[i + len(self.marker) : j])
                except ValueError:
                    self.status = 255
        else:
            keep = len(self.marker) + 24
            if len(self.tail) > keep:
                cut = len(self.tail) - keep
                del self.tail[:cut]
                self.tail_start += cut

    def output(self) -> tuple[bytes, bool]:
        end = self.total if self.end is None else self.end
        return bytes(self.head[: min(end, self.cap)]), end > self.cap


class _Agent:
    def __init__(self, sock: socket.socket, boot: Boot) -> None:
        self.sock = sock
        self.boot = boot
        self.statuses: dict[int, int] = {}
        self.watched: set[int] = set()
        self.sessions: dict[str, subprocess.Popen[bytes]] = {}
        self.init: subprocess.Popen[bytes] | None = None
        self.init_status: int | None = None
        self.child_oom_adj = "0"
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = r
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # Other signals keep their default action: as the pid namespace's init, the kernel
        # only delivers them from the host (and an ignored signal would be inherited by tools).

    # -- children --

    def _spawn(self, argv: list[str], *, env: dict[str, str], cwd: str, stdin: Any, stdout: Any, stderr: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=True, close_fds=True, restore_signals=True)
        self.watched.add(proc.pid)
        # Undo the agent's OOM protection (inherited), or without it make the tool the OOM
        # killer's first pick. Popen returns after the exec, before a tool allocates much.
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/oom_score_adj", "w") as f:
            f.write(self.child_oom_adj)
        return proc

    def reap(self) -> None:
        """Collect every child that ended (orphans too); remember statuses of watched ones."""
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.watched:
                self.watched.discard(pid)
                self.statuses[pid] = os.waitstatus_to_exitcode(st)
                if self.init is not None and pid == self.init.pid:
                    self.init_status = self.statuses.pop(pid)
                    self.init.returncode = self.init_status

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    # -- requests --

    def start_init(self) -> None:
        if self.boot.init:
            log = os.open("/run/bunshin-init.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644) \
                if os.path.isdir("/run") else subprocess.DEVNULL
            try:
                self.init = self._spawn(list(self.boot.init), env=self.boot.env, cwd=self.boot.cwd,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            finally:
                if log != subprocess.DEVNULL:
                    os.close(log)

    def run(self, proc: subprocess.Popen[bytes], timeout: float | None, out: _Sink, err: _Sink,
            stdin: bytes = b"", *, until_markers: bool = False) -> tuple[int | None, bool]:
        """Pump *proc*'s pipes into the sinks until it ends (or, with *until_markers*, until both
        markers arrived), killing its process group at *timeout*. Returns (exit status or None
        if it still runs, timed out)."""
        sel = selectors.PollSelector()
        streams = {proc.stdout: out, proc.stderr: err}
        for f in streams:
            os.set_blocking(f.fileno(), False)  # type: ignore[union-attr]
            sel.register(f, selectors.EVENT_READ)  # type: ignore[arg-type]
        pending = memoryview(stdin)
        if proc.stdin is not None:
            if pending:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin, selectors.EVENT_WRITE)
            elif not until_markers:
                proc.stdin.close()
        sel.register(self.wake_r, selectors.EVENT_READ)
        deadline = None if timeout is None else time.monotonic() + timeout
        linger = None
        timed_out = False
        status: int | None = None
        try:
            while True:
                self.reap()
                if status is None and proc.pid in self.statuses:
                    status = self.statuses.pop(proc.pid)
                    proc.returncode = status
                reading = [f for f in streams if f in sel.get_map()]  # type: ignore[comparison-overlap]
                if until_markers and out.end is not None and err.end is not None:
                    break
                if status is not None:
                    if not reading:
                        break
                    if linger is None:  # a background child still holds the pipes
                        linger = time.monotonic() + 0.05
                now = time.monotonic()
                if deadline is not None and now >= deadline and not timed_out:
                    timed_out = True
                    _killpg(proc.pid)
                    if until_markers:
                        break
                    deadline = None
                if linger is not None and now >= linger:
                    break
                wait = [t - now for t in (deadline, linger) if t is not None]
                for key, _ in sel.select(max(0.0, min(wait)) if wait else None):
                    f = key.fileobj
                    if f == self.wake_r:
                        self._drain_wakeup()
                    elif f is proc.stdin:
                        try:
                            n = os.write(proc.stdin.fileno(), pending)  # type: ignore[union-attr]
                        except BrokenPipeError:
                            n = len(pending)
                        pending = pending[n:]
                        if not pending:
                            sel.unregister(f)
                            if not until_markers:
                                proc.stdin.close()  # type: ignore[union-attr]
                    else:
                        data = os.read(f.fileno(), 1 << 16)  # type: ignore[union-attr]
                        if data:
                            streams[f].feed(data)  # type: ignore[index]
                        else:
                            sel.unregister(f)
        finally:
            sel.close()
        return status, timed_out

    def exec(self, req: Exec) -> ExecResult | AgentError:
        argv = req.argv if req.argv is not None else ["/bin/sh", "-c", req.command or ""]
        start = time.monotonic()
        try:
            proc = self._spawn(argv, env=req.env, cwd=req.cwd, stdin=subprocess.PIPE if req.stdin else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            return AgentError("spawn", f"cannot run {shlex.join(argv)}: {exc.strerror or exc}")
        out, err = _Sink(req.output_limit), _Sink(req.output_limit)
        try:
            status, timed_out = self.run(proc, req.timeout, out, err, req.stdin)
        finally:
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
        if status is None:  # ended by the linger rule: it exited, but we stopped reading
            status = proc.returncode if proc.returncode is not None else 0
        if timed_out:
            _killpg(proc.pid)
        proc.returncode = status
        o, t1 = out.output()
        e, t2 = err.output()
        return ExecResult(status, o, e, t1 or t2, time.monotonic() - start, timed_out)

    def shell(self, req: Shell) -> ExecResult | AgentError:
        start = time.monotonic()
        proc = self.sessions.get(req.session)
        if proc is None or proc.returncode is not None:
            shell = self.boot.shell if os.path.exists(self.boot.shell) else "/bin/sh"
            argv = [shell, "--noprofile", "--norc"] if os.path.basename(shell) == "bash" else [shell]
            try:
                proc = self._spawn(argv, env=self.boot.env, cwd=self.boot.cwd, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                return AgentError("spawn", f"cannot start the shell {shell}: {exc.strerror or exc}")
            self.sessions[req.session] = proc
        mark = "__bunshin_" + os.urandom(8).hex()
        script = (
            f"__bunshin_cmd={shlex.quote(req.command)}\n"
            'eval "$__bunshin_cmd" < /dev/null\n'
            "__bunshin_st=$?\n"
            f"printf '\\n{mark}:%d\\n' \"$__bunshin_st\"; printf '\\n{mark}:0\\n' >&2\n"
        ).encode()
        marker = b"\n" + mark.encode() + b":"
        out, err = _Sink(req.output_limit, marker), _Sink(req.output_limit, marker)
        status, timed_out = self.run(proc, req.timeout, out, err, script, until_markers=True)
        if timed_out or status is not None or out.end is None:
            # the session is gone: it timed out (its group is killed) or the shell exited
            _killpg(proc.pid)
            self._close_session(req.session)
            if status is None:
                status = -signal.SIGKILL if timed_out else proc.returncode or 0
        else:
            status = out.status
        o, t1 = out.output()
        e, t2 = err.output()
        return ExecResult(status, o, e, t1 or t2, time.monotonic() - start, timed_out)

    def _close_session(self, name: str) -> None:
        proc = self.sessions.pop(name, None)
        if proc is not None:
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
            if proc.returncode is None:
                proc.returncode = -signal.SIGKILL

    def forked(self, req: Forked) -> Pong | AgentError:
        if req.proc:
            from . import _bunshin_c as c

            try:
                with contextlib.suppress(OSError):
                    c.umount2("/proc", c.MNT_DETACH)
                c.mount("proc", "/proc", "proc", c.MS_NOSUID | c.MS_NODEV | c.MS_NOEXEC)
            except OSError as exc:
                return AgentError("setup", f"cannot mount /proc in the forked workspace: {exc}")
        self.reap()
        return Pong(sorted(n for n, p in self.sessions.items() if p.returncode is None), self.init_status)

    def rebind(self) -> Pong:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [b"r"], [theirs.fileno()])
        finally:
            theirs.close()
        os.dup2(mine.fileno(), self.sock.fileno(), inheritable=False)
        mine.close()
        self.reap()
        return Pong(sorted(n for n, p in self.sessions.items() if p.returncode is None), self.init_status)

    def loop(self) -> None:
        sel = selectors.PollSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj == self.wake_r:
                    self._drain_wakeup()
                    continue
                try:
                    req = recv(self.sock, "request")
                except (msgspec.DecodeError, ValueError) as exc:
                    send(self.sock, AgentError("protocol", str(exc)))
                    continue
                if req is None:
                    return
                if isinstance(req, Exec):
                    reply: Any = self.exec(req)
                elif isinstance(req, Shell):
                    reply = self.shell(req)
                elif isinstance(req, Forked):
                    reply = self.forked(req)
                elif isinstance(req, Rebind):
                    reply = self.rebind()
                else:
                    self.reap()
                    reply = Pong(sorted(n for n, p in self.sessions.items() if p.returncode is None), self.init_status)
                send(self.sock, reply)
            self.reap()
            for name, proc in list(self.sessions.items()):
                if proc.pid in self.statuses:
                    proc.returncode = self.statuses.pop(proc.pid)
                    self._close_session(name)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve(sock: socket.socket, boot: Boot) -> None:
    """Run the agent loop on *sock* until the controller closes it (called as pid 1 inside the
    workspace, after the set-up). Starts the init service first."""
    agent = _Agent(sock, boot)
    # The agent's RSS counts every page it shares with the controller it was forked from, so
    # the OOM killer would rank it first. It should go last: -999 (not -1000: it stays
    # killable when nothing else is left). Lowering needs CAP_SYS_RESOURCE; without it, its
    # children are raised to 1000 instead.
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-999")
    except PermissionError:
        agent.child_oom_adj = "1000"
    agent.start_init()
    send(sock, Ready(os.getpid()))
    agent.loop()
