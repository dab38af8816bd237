"""Live workspaces: real containers on this host.

:func:`open_container` makes one from a :class:`WorkspaceSpec`:

1. a record in the state directory listing everything it will make (see :mod:`._state`);
2. upper, work and rootfs directories in the data directory, the upper prepared so the
   spec's ``empty_dirs`` (and the state directory itself) start empty;
3. its cgroups (v2 for freeze/kill, memory and pids wherever the host has them, see
   :mod:`._cgroup`) with the spec's limits;
4. a process cloned with ``clone3`` into new pid, mount, uts, ipc, net and cgroup namespaces,
   straight into the v2 cgroup. It is a fork of the controller (no exec: the root file
   system need not hold a Python). It closes every inherited fd but its socket, waits to be
   placed in its v1 cgroups, makes all mounts private, mounts the overlay (layers, topmost
   first, over the root), a fresh /proc, a minimal /dev (tmpfs, bind-mounted null, zero, full,
   random, urandom and tty, a private devpts, /dev/shm), a read-only /sys, sets the hostname,
   brings loopback up, pivots into the overlay, detaches the old root and becomes the
   workspace's pid 1: the agent (:mod:`._agent`), which starts the spec's init service;
5. optionally a veth pair to the host (pyroute2).

All mounts live in the workspace's own mount namespace, so they vanish with its last process;
the host's mount table is never touched. When the controller dies, the agent sees its socket
close and exits, which kills the pid namespace; :func:`gc` then removes the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc as _pygc
import os
import re
import signal
import socket
import struct
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any, NoReturn, Self

import anyio
import msgspec

from ._agent import (
    AgentError,
    Boot,
    Exec,
    ExecResult,
    Forked,
    Ping,
    Pong,
    Ready,
    Shell,
    recv,
    send,
    serve,
)
from ._cgroup import Cgroups, remove_group
from ._exceptions import BackendError, ConfigError
from ._spec import RenderedCall, WorkspaceSpec, render_call
from ._state import GcReport, Record, StateDir, gc, process_start_time, remove_tree
from . import _zygote
from ._trace import ToolCall

__all__ = ["Container", "ExecResult", "GcReport", "MemoryUsage", "StateDir", "gc", "open_container", "open_shell"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_BOOT_TIMEOUT = 60.0
_REPLY_GRACE = 30.0


class MemoryUsage(msgspec.Struct, frozen=True):
    """Memory charged to a workspace's memory cgroup."""

    current: int
    """All bytes charged (``memory.current``, or v1 ``memory.usage_in_bytes``)."""
    anon: int
    """Anonymous bytes (heap, stacks, tmpfs is counted as file here)."""
    file: int
    """Page-cache bytes (files read or written, tmpfs)."""


class Container:
    """A live workspace: a container with its own namespaces, cgroups and overlay root.

    Made by :func:`open_container`; give it back with :meth:`destroy` (or use it as an async
    context manager). Commands run through its agent, one at a time.

    Attributes:
        id: Unique name (also of its cgroups and directories).
        spec: The spec it was made from.
        state: The state directory holding its record.
        layers: Read-only directories stacked over the root, topmost first.
        upper: Its writable layer (a directory on the host).
        dir: Its data directory (upper, work, rootfs).
        init_pid: Host pid of its pid 1, the agent (None until cloned).
        pidfd: A pidfd of the agent (-1 until cloned, or once destroyed).
        cgroups: Its cgroup directories.
    """

    def __init__(self, spec: WorkspaceSpec, id: str, state: StateDir, layers: tuple[str, ...]) -> None:
        self.id = id
        self.spec = spec
        self.state = state
        self.layers = layers
        self.dir = state.container_dir(id)
        self.upper = os.path.join(self.dir, "upper")
        self.work = os.path.join(self.dir, "work")
        self.mountpoint = os.path.join(self.dir, "rootfs")
        root = spec.root_dir.rstrip("/") + "/"
        self.lowermount = os.path.join(self.dir, "lower") if any(p.startswith(root) for p in layers) else None
        self.cgroups = Cgroups(state.host_name(id))
        self.init_pid: int | None = None
        self.pidfd = -1
        self.agent_fd = -1  # the agent's fd number of its end of the socket pair
        self.holder_pid: int | None = None  # a forked workspace's holder: the agent's parent
        self._holder: socket.socket | None = None
        self._holder_pidfd = -1
        self.veth: str | None = ("bs" + os.urandom(6).hex())[:15] if spec.network.veth else None
        self.record: Record = state.new_record(id, cgroups=self.cgroups.paths, mounts=[self.mountpoint], dirs=[self.dir],
                                               veths=[self.veth] if self.veth else [])
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._limiter: anyio.CapacityLimiter | None = None
        self._dead: str | None = None
        self._destroying = False
        self._destroyed: anyio.Event | None = None
        self._kept: str | None = None
        self.frozen = False

    def __repr__(self) -> str:
        return f"<Container {self.id} pid={self.init_pid}{' destroyed' if self._destroying else ''}>"

    @property
    def rootfs(self) -> str:
        """The workspace's root as the host sees it (``/proc/<init_pid>/root``)."""
        if self.init_pid is None:
            raise BackendError(f"workspace {self.id}: not started")
        return f"/proc/{self.init_pid}/root"

    @property
    def alive(self) -> bool:
        """Whether the agent is known to run (not destroyed, killed or found dead)."""
        return not self._destroying and self._dead is None and self._sock is not None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    # -- talking to the agent ---------------------------------------------------------------

    def _roundtrip(self, msg: Any, timeout: float | None) -> Any:
        with self._lock:
            sock = self._sock
            if sock is None or self._dead is not None:
                return None
            try:
                sock.settimeout(timeout)
                send(sock, msg)
                reply = recv(sock)
            except TimeoutError:
                self._dead = "did not answer in time"
                return None
            except OSError as exc:
                self._dead = self._death() or f"connection lost ({exc.strerror or exc})"
                return None
            if reply is None:
                self._dead = self._death() or "exited"
            return reply

    def _death(self) -> str | None:
        """How the agent ended, if it has (it stays to be reaped: ``WNOWAIT``), else None."""
        if self.pidfd < 0:
            return None
        for _ in range(50):  # its socket closes as it dies: give the exit a moment to show
            try:
                info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except (OSError, AttributeError):
                return None
            if info is not None:
                break
            time.sleep(0.001)
        else:
            return None
        if info.si_code == os.CLD_EXITED:
            return f"exited with status {info.si_status}"
        try:
            name = signal.Signals(info.si_status).name
        except ValueError:
            name = str(info.si_status)
        return f"died: killed by {name}"

    async def _rpc(self, msg: Any, timeout: float | None) -> Any:
        if self._destroying:
            raise BackendError(f"workspace {self.id}: already destroyed")
        if self.frozen:
            raise BackendError(f"workspace {self.id}: is frozen; thaw it before running commands")
        assert self._limiter is not None
        reply = await anyio.to_thread.run_sync(self._roundtrip, msg, timeout, abandon_on_cancel=True, limiter=self._limiter)
        if reply is None:
            raise BackendError(f"workspace {self.id}: its agent (pid {self.init_pid}) {self._dead or 'is gone'}{self._oom_note()}")
        if isinstance(reply, AgentError):
            raise BackendError(f"workspace {self.id}: {reply.message}")
        return reply

    def _oom_note(self) -> str:
        n = self.cgroups.oom_kills()
        return f"; out of memory: the kernel OOM-killed {n} process(es) in it{self._limit_note()}" if n else ""

    def _limit_note(self) -> str:
        limit = self.spec.limits.memory
        return f" (memory limit {limit} bytes)" if limit else ""

    async def _run(self, msg: Exec | Shell, timeout: float | None) -> ExecResult:
        before = self.cgroups.oom_kills()
        result = await self._rpc(msg, None if timeout is None else timeout + _REPLY_GRACE)
        kills = self.cgroups.oom_kills() - before
        if kills > 0:
            raise BackendError(
                f"workspace {self.id}: out of memory: the kernel OOM-killed {kills} process(es) during the call"
                f"{self._limit_note()}; the command ended with status {result.status}"
            )
        return result

    async def exec(self, argv: Sequence[str] | str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout: float | None = 60.0, stdin: bytes = b"", output_limit: int | None = None) -> ExecResult:
        """Run a program (*argv* a list) or a shell command (*argv* a string, run by ``sh -c``)
        in a fresh process group inside the workspace.

        Args:
            argv: The program and its arguments, or a shell command.
            env: Extra environment variables over the spec's environment.
            cwd: Working directory (default the spec's ``cwd``).
            timeout: Seconds before the process group is killed (None: no limit).
            stdin: Bytes fed to its standard input (default: /dev/null).
            output_limit: Bytes of stdout and of stderr kept (default the spec's).

        Returns:
            The result; a failing command is a result with its exit status.

        Raises:
            BackendError: The program could not be started, the agent died, or the kernel
                OOM-killed a process of the workspace during the call.
        """
        msg = Exec(
            argv=None if isinstance(argv, str) else list(argv),
            command=argv if isinstance(argv, str) else None,
            env={**self.spec.environment, **(env or {})},
            cwd=cwd or self.spec.cwd,
            timeout=timeout,
            output_limit=output_limit or self.spec.limits.output,
            stdin=stdin,
        )
        return await self._run(msg, timeout)

    async def shell(self, command: str, *, session: str = "main", timeout: float | None = 60.0,
                    output_limit: int | None = None) -> ExecResult:
        """Run *command* in the persistent shell session *session* (started at first use).

        ``cd``, variables and functions persist between calls of one session. If the command
        times out or exits the shell, the session ends (the next call starts a new one).
        """
        msg = Shell(session, command, timeout, output_limit or self.spec.limits.output)
        return await self._run(msg, timeout)

    async def call(self, call: ToolCall) -> ExecResult:
        """Run the tool call *call* as the spec's template for its tool says.

        Raises:
            ConfigError: The tool is not declared, or an argument is missing or unexpected.
            BackendError: As for :meth:`exec`.
        """
        rendered: RenderedCall = render_call(self.spec, call)
        if rendered.session is not None:
            return await self.shell(rendered.command or "", session=rendered.session, timeout=rendered.timeout)
        return await self.exec(rendered.argv if rendered.argv is not None else rendered.command or "", timeout=rendered.timeout)

    async def ping(self) -> Pong:
        """Check that the agent answers; returns its live sessions and the init service's status."""
        return await self._rpc(Ping(), _REPLY_GRACE)

    # -- control from the host --------------------------------------------------------------

    def pids(self) -> list[int]:
        """Host pids of the workspace's processes (agent included, a holder not)."""
        return [p for p in self.cgroups.procs() if p != self.holder_pid]

    def memory(self) -> MemoryUsage:
        """Memory charged to the workspace now."""
        return MemoryUsage(*self.cgroups.memory_usage())

    async def freeze(self, *, timeout: float = 10.0) -> None:
        """Freeze every process of the workspace (cgroup.freeze) and wait until it is frozen."""
        await self._set_frozen(True, timeout)

    async def thaw(self, *, timeout: float = 10.0) -> None:
        """Undo :meth:`freeze`."""
        await self._set_frozen(False, timeout)

    async def _set_frozen(self, frozen: bool, timeout: float) -> None:
        if self._destroying:
            raise BackendError(f"workspace {self.id}: already destroyed")
        try:
            self.cgroups.set_frozen(frozen)
            with anyio.fail_after(timeout):
                while self.cgroups.is_frozen() != frozen:
                    await anyio.sleep(0.001)
        except TimeoutError:
            raise BackendError(f"workspace {self.id}: did not become {'frozen' if frozen else 'thawed'} within {timeout} s") from None
        except OSError as exc:
            raise BackendError(f"workspace {self.id}: cannot {'freeze' if frozen else 'thaw'}: {exc}") from None
        self.frozen = frozen

    async def kill(self) -> None:
        """SIGKILL every process of the workspace, agent included; :meth:`destroy` it after."""
        self._dead = self._dead or "was killed"
        self.cgroups.kill()

    async def destroy(self, *, keep_upper: bool = False) -> str | None:
        """Kill the workspace's processes and remove its cgroups, veth, directories and record.

        Idempotent, and completes even when the caller is cancelled (it is shielded).

        Args:
            keep_upper: Keep the writable layer as a read-only layer for other workspaces
                (``layers=``): it moves to the data directory's ``layers/`` under its own
                record (so :func:`gc` removes it once this controller is gone) and its path is
                returned. Remove it with :meth:`StateDir.drop_layer`.

        Returns:
            The kept layer's path with *keep_upper*, else None.
        """
        if self._destroyed is not None:
            with anyio.CancelScope(shield=True):
                await self._destroyed.wait()
            return self._kept
        self._destroyed = anyio.Event()
        self._destroying = True
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(self._teardown, keep_upper)
            finally:
                self._destroyed.set()
        return self._kept

    def _teardown(self, keep_upper: bool) -> None:
        rec = self.record
        rec.state = "destroying"
        self.state.write(rec)
        with self._lock_or_abandon():
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)  # wakes a call still waiting on it
                self._sock.close()
                self._sock = None
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        # Kill before thawing: a frozen workspace (a snapshot) never runs again. A fatal
        # signal takes a task out of the cgroup freezer.
        with contextlib.suppress(OSError):
            self.cgroups.kill()
        with contextlib.suppress(OSError):
            self.cgroups.set_frozen(False)
        if self.init_pid is not None:
            _reap(self.init_pid)
        if self.holder_pid is not None:
            _reap(self.holder_pid)
        if self._holder_pidfd >= 0:
            os.close(self._holder_pidfd)
            self._holder_pidfd = -1
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        errors = []
        for path in self.cgroups.paths:
            if not remove_group(path):
                errors.append(f"cgroup {path} still has processes")
        if self.veth:
            from ._state import _delete_link

            try:
                _delete_link(self.veth)
            except Exception as exc:  # noqa: BLE001 - pyroute2 raises its own errors
                errors.append(f"veth {self.veth}: {exc}")
        if keep_upper and os.path.isdir(self.upper):
            layer = self.state.layer_dir(self.id)
            self.state.write(self.state.new_record(self.id + ".layer", kind="layer", state="running", dirs=[layer]))
            os.makedirs(os.path.dirname(layer), exist_ok=True)
            os.rename(self.upper, layer)
            self._kept = layer
        try:
            remove_tree(self.dir)
        except OSError as exc:
            errors.append(f"{self.dir}: {exc}")
        if errors:
            raise BackendError(f"workspace {self.id}: destroy left {'; '.join(errors)} (run `bunshin gc`)")
        self.state.remove(self.id)

    @contextlib.contextmanager
    def _lock_or_abandon(self) -> Generator[None, None, None]:
        # A call abandoned by a cancelled caller may still hold the lock while it waits for
        # the agent; killing the agent ends that wait, so do not wait for the lock long.
        got = self._lock.acquire(timeout=0.05)
        try:
            yield
        finally:
            if got:
                self._lock.release()


def _reap(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.002)


class _Opener:
    """What :func:`open_container` returns: await it, or use it as an async context manager."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self._args = args
        self._container: Container | None = None

    def __await__(self) -> Generator[Any, None, Container]:
        return _open(*self._args).__await__()

    async def __aenter__(self) -> Container:
        self._container = await _open(*self._args)
        return self._container

    async def __aexit__(self, *exc: object) -> None:
        assert self._container is not None
        await self._container.destroy()


def open_container(spec: WorkspaceSpec, *, layers: Sequence[str] = (), name: str | None = None,
                   state: StateDir | None = None) -> _Opener:
    """Start a live workspace from *spec*.

    Use ``container = await open_container(spec)`` (then ``await container.destroy()``) or
    ``async with open_container(spec) as container:``.

    Args:
        spec: The workspace spec.
        layers: Read-only directories stacked above the spec's root, topmost first (for
            example layers kept by :meth:`Container.destroy`).
        name: The workspace's id (default: the spec's name and a random suffix).
        state: The state directory (default :class:`StateDir()`).

    Raises:
        ConfigError: A bad *name* or a missing layer.
        BackendError: The workspace could not be made (everything made so far is removed).
    """
    return _Opener((spec, tuple(layers), name, state))


async def _open(spec: WorkspaceSpec, layers: tuple[str, ...], name: str | None, state: StateDir | None) -> Container:
    from . import _bunshin_c as c

    state = state or StateDir()
    id = name or f"{spec.name}-{os.urandom(4).hex()}"
    if not _ID.match(id) or id.endswith(".layer"):
        raise ConfigError(f"bad workspace name {id!r}: expected letters, digits, '_', '.', '-' (at most 128)")
    for layer in layers:
        if not os.path.isdir(layer) or any(ch in layer for ch in ",:\\"):
            raise ConfigError(f"layer {layer!r} is not a directory (or has ',', ':' or '\\' in its path)")
    if state.read(id) is not None or os.path.lexists(state.container_dir(id)):
        raise ConfigError(f"a workspace named {id!r} already exists in {state.path}")
    ct = Container(spec, id, state, layers)
    state.write(ct.record)  # before anything exists
    try:
        for d in (ct.upper, ct.work, ct.mountpoint, ct.lowermount):
            if d is not None:
                os.makedirs(d)
        _prepare_upper(ct, state)
        ct.cgroups.create(memory=spec.limits.memory, pids=spec.limits.pids)
        ct._limiter = anyio.CapacityLimiter(1)
        await anyio.to_thread.run_sync(_zygote.ready)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cgfd = os.open(ct.cgroups.v2, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if ct.cgroups.v2 else -1
        flags = c.CLONE_NEWPID | c.CLONE_NEWNS | c.CLONE_NEWUTS | c.CLONE_NEWIPC | c.CLONE_NEWNET | c.CLONE_NEWCGROUP
        try:
            # cloned by the zygote, so that it shares no memory with this controller
            pid, pidfd, ct.agent_fd = _zygote.clone("agent", flags, child, cgfd)
        except OSError as exc:
            parent.close()
            raise BackendError(f"workspace {id}: cannot clone its first process: {exc}") from None
        finally:
            child.close()
            if cgfd >= 0:
                os.close(cgfd)
        ct._sock = parent
        ct.init_pid, ct.pidfd = pid, pidfd
        ct.record.init_pid, ct.record.init_start = pid, process_start_time(pid)
        state.write(ct.record)
        try:
            ct.cgroups.attach(pid)
        except OSError as exc:
            raise BackendError(f"workspace {id}: cannot move its first process into its cgroups: {exc}") from None
        boot = _boot_of(ct, init=list(spec.init) if spec.init else None)
        reply = await anyio.to_thread.run_sync(_boot, parent, boot, abandon_on_cancel=True)
        if not isinstance(reply, Ready):
            why = reply.message if isinstance(reply, AgentError) else "its first process died during set-up"
            raise BackendError(f"workspace {id}: set-up failed: {why}{ct._oom_note()}")
        if spec.network.veth:
            await anyio.to_thread.run_sync(_setup_veth, ct)
        ct.record.state = "running"
        state.write(ct.record)
        return ct
    except BaseException:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(BackendError):
                await ct.destroy()
        raise


def _boot_of(ct: Container, **over: Any) -> Boot:
    """The Boot of *ct*'s first process: its overlay (``ct.layers`` over the spec's root, paths
    inside the data directory given relative to it), hostname, environment, cwd and shell;
    *over* sets the rest (``init``, ``proc``, ``root_only``)."""
    spec, data = ct.spec, ct.state.data
    return Boot(
        rootfs=ct.mountpoint,
        lowerdirs=[os.path.relpath(p, data) if p.startswith(data + "/") else p for p in (*ct.layers, spec.root_dir)],
        upper=os.path.relpath(ct.upper, data),
        work=os.path.relpath(ct.work, data),
        chdir=data,
        hostname=spec.hostname,
        env=spec.environment,
        cwd=spec.cwd,
        shell=spec.shell,
        root_overlay=os.path.relpath(ct.lowermount, data) if ct.lowermount else None,
        **over,
    )


def _boot(sock: socket.socket, boot: Boot) -> Any:
    sock.settimeout(_BOOT_TIMEOUT)
    try:
        send(sock, boot)
        return recv(sock)
    except OSError:
        return None


def _prepare_upper(ct: Container, state: StateDir) -> None:
    """Make the spec's empty_dirs (and, over the host root, the state and data directories)
    opaque directories in the upper layer, owned and moded like the directory they hide."""
    spec = ct.spec
    hide = list(spec.empty_dirs)
    if spec.root == "host":
        hide += [state.path, state.data]
    lowers = (*ct.layers, spec.root_dir)
    done: list[str] = []
    for path in hide:
        path = os.path.normpath(path)
        if any(path == d or path.startswith(d.rstrip("/") + "/") for d in done):
            continue  # already inside an emptied directory
        done.append(path)
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            sub = "/" + "/".join(parts[:i])
            target = ct.upper + sub
            if os.path.isdir(target):
                continue
            st = next((os.stat(low + sub) for low in lowers if os.path.isdir(low + sub)), None)
            if st is None:
                break  # nothing to hide below here
            os.mkdir(target)
            os.chown(target, st.st_uid, st.st_gid)
            os.chmod(target, st.st_mode & 0o7777)
        else:
            os.setxattr(ct.upper + "/" + "/".join(parts), "trusted.overlay.opaque", b"y")


def _setup_veth(ct: Container) -> None:
    """Add the veth pair: the host end (named in the record), ``eth0`` in the workspace."""
    from pyroute2 import IPRoute

    from . import _bunshin_c as c

    net = ct.spec.network
    assert ct.veth is not None and ct.init_pid is not None
    tmp = "bt" + ct.veth[2:]
    with IPRoute() as ipr:
        ipr.link("add", ifname=ct.veth, kind="veth", peer=tmp)
        host_idx = ipr.link_lookup(ifname=ct.veth)[0]
        peer_idx = ipr.link_lookup(ifname=tmp)[0]
        ipr.link("set", index=peer_idx, net_ns_pid=ct.init_pid)
        if net.bridge:
            br = ipr.link_lookup(ifname=net.bridge)
            if not br:
                raise BackendError(f"workspace {ct.id}: no bridge named {net.bridge!r} on the host")
            ipr.link("set", index=host_idx, master=br[0])
        if net.peer_address:
            addr, plen = net.peer_address.split("/")
            ipr.addr("add", index=host_idx, address=addr, prefixlen=int(plen))
        ipr.link("set", index=host_idx, state="up")
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(f"/proc/{ct.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        c.setns(target, c.CLONE_NEWNET)
        try:
            with IPRoute() as ipr:
                idx = ipr.link_lookup(ifname=tmp)[0]
                ipr.link("set", index=idx, ifname="eth0")
                if net.address:
                    addr, plen = net.address.split("/")
                    ipr.addr("add", index=idx, address=addr, prefixlen=int(plen))
                ipr.link("set", index=idx, state="up")
                if net.gateway:
                    ipr.route("add", dst="default", gateway=net.gateway)
        finally:
            c.setns(own, c.CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)


# --- the child: set the workspace up, then become its agent ------------------------------------


def _null_stdio() -> None:
    null = os.open("/dev/null", os.O_RDWR)
    for i in range(3):
        os.dup2(null, i)
    if null > 2:
        os.close(null)


def _boot_first_process(sock: socket.socket) -> Boot:
    """The start of a workspace's first process (cloned by the zygote): every fd but its
    socket closed, the Boot received and the workspace set up with it. Exits at once if the
    controller closes the socket instead."""
    signal.set_wakeup_fd(-1)
    # Objects inherited from the zygote (its channel) must never be finalised here: their fd
    # numbers are closed below and may be reused.
    _pygc.freeze()
    fd = sock.fileno()
    _null_stdio()
    os.closerange(3, fd)  # the socket's fd is never below 3: stdio was open
    os.closerange(fd + 1, 1 << 30)
    sock.settimeout(None)
    boot = recv(sock, "boot")
    if boot is None:
        os._exit(0)
    _setup(boot)
    return boot


def _child_main(sock: socket.socket) -> NoReturn:
    """Run in the cloned child: never returns (ends with ``os._exit``)."""
    code = 1
    try:
        boot = _boot_first_process(sock)
        # stdio again, now from the workspace's own /dev (a tree fork reopens every file at
        # its path in the clone's root: the host's /dev/null is outside this one)
        _null_stdio()
        serve(sock, boot)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, then _exit
        with contextlib.suppress(BaseException):
            send(sock, AgentError("setup", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(code)


def _setup(boot: Boot) -> None:
    from . import _bunshin_c as c

    os.setsid()
    c.mount(None, "/", None, c.MS_REC | c.MS_PRIVATE)
    os.chdir(boot.chdir)
    r = boot.rootfs
    lowers = list(boot.lowerdirs)
    if boot.root_overlay is not None:
        # A read-only overlay needs two lower layers: the root, and an empty directory on
        # another file system (a tiny tmpfs), so that neither contains the other.
        t = boot.root_overlay
        c.mount("tmpfs", t, "tmpfs", c.MS_NOSUID | c.MS_NODEV, "mode=755,size=16k")
        os.mkdir(t + "/empty")
        os.mkdir(t + "/root")
        c.mount("overlay", t + "/root", "overlay", c.MS_RDONLY, f"lowerdir={lowers[-1]}:{t}/empty")
        lowers[-1] = t + "/root"
    c.mount("overlay", r, "overlay", 0, f"lowerdir={':'.join(lowers)},upperdir={boot.upper},workdir={boot.work}")
    if boot.root_only:
        return
    nosuid = c.MS_NOSUID | c.MS_NODEV | c.MS_NOEXEC
    os.makedirs(r + "/proc", exist_ok=True)
    if boot.proc:
        c.mount("proc", r + "/proc", "proc", nosuid)
    os.makedirs(r + "/dev", exist_ok=True)
    c.mount("tmpfs", r + "/dev", "tmpfs", c.MS_NOSUID | c.MS_NOEXEC, "mode=755,size=65536k")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        open(f"{r}/dev/{name}", "w").close()
        c.mount(f"/dev/{name}", f"{r}/dev/{name}", None, c.MS_BIND)
    os.mkdir(r + "/dev/pts")
    c.mount("devpts", r + "/dev/pts", "devpts", c.MS_NOSUID | c.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.mkdir(r + "/dev/shm")
    c.mount("shm", r + "/dev/shm", "tmpfs", nosuid, "mode=1777")
    for link, to in (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                     ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(to, f"{r}/dev/{link}")
    if boot.sysfs:
        os.makedirs(r + "/sys", exist_ok=True)
        c.mount("sysfs", r + "/sys", "sysfs", nosuid | c.MS_RDONLY)
    socket.sethostname(boot.hostname)
    _loopback_up()
    os.chdir(r)
    c.pivot_root(".", ".")
    c.umount2(".", c.MNT_DETACH)
    os.chdir("/")


def _loopback_up() -> None:
    """Bring ``lo`` up (SIOCGIFFLAGS/SIOCSIFFLAGS: no netlink library needed this early)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))



# --- forked workspaces: a shell whose processes come from a frozen tree ------------------------
#
# The ``bunshin`` engine of the live backend makes a workspace in three steps, so the source is
# frozen only for the middle one: :func:`open_shell` (before freezing the source: record,
# directories, cgroups, and the *holder*, a process in new mount, UTS, IPC, network and cgroup
# namespaces waiting for its layers), :func:`mount_shell` (the overlay on the snapshot's layers
# with a fresh upper, /dev, /sys, the host name, loopback, ``pivot_root``, then
# ``unshare(CLONE_NEWPID)``: its pid namespace for children is new and empty) and
# :func:`fork_tree_into` (``BUNSHIN_IOC_FORK_TREE`` of the source's tree, the agent's end of
# its socket pair replaced by one end of a new pair: the root clone becomes pid 1 of the
# holder's pid namespace, born in the shell's frozen cgroup). :func:`start_forked` thaws it and
# has the agent's clone mount its /proc.


async def open_shell(spec: WorkspaceSpec, *, name: str | None = None, state: StateDir | None = None) -> Container:
    """Make the shell of a forked workspace: its record, directories, cgroups and holder.

    Raises:
        ConfigError: A bad *name*, or a spec the forked workspaces cannot have (``network.veth``).
        BackendError: It could not be made (everything made so far is removed).
    """
    from . import _bunshin_c as c

    state = state or StateDir()
    id = name or f"{spec.name}-{os.urandom(4).hex()}"
    if not _ID.match(id) or id.endswith(".layer"):
        raise ConfigError(f"bad workspace name {id!r}: expected letters, digits, '_', '.', '-' (at most 128)")
    if spec.network.veth:
        raise ConfigError(f"workspace {id}: network.veth is not carried over by a tree fork yet; use the restart engine")
    if state.read(id) is not None or os.path.lexists(state.container_dir(id)):
        raise ConfigError(f"a workspace named {id!r} already exists in {state.path}")
    ct = Container(spec, id, state, ())
    ct.veth = None
    state.write(ct.record)
    try:
        for d in (ct.upper, ct.work, ct.mountpoint):
            os.makedirs(d)
        ct.cgroups.create(memory=spec.limits.memory, pids=spec.limits.pids)
        if ct.cgroups.v2 is None:
            raise BackendError(f"workspace {id}: a forked workspace needs a cgroup v2 hierarchy (freezer)")
        ct._limiter = anyio.CapacityLimiter(1)
        await anyio.to_thread.run_sync(_zygote.ready)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cgfd = os.open(ct.cgroups.v2, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        flags = c.CLONE_NEWNS | c.CLONE_NEWUTS | c.CLONE_NEWIPC | c.CLONE_NEWNET | c.CLONE_NEWCGROUP
        try:
            pid, pidfd, _ = _zygote.clone("holder", flags, child, cgfd)
        except OSError as exc:
            parent.close()
            raise BackendError(f"workspace {id}: cannot clone its holder: {exc}") from None
        finally:
            child.close()
            os.close(cgfd)
        ct._holder, ct.holder_pid, ct._holder_pidfd = parent, pid, pidfd
        ct.cgroups.attach(pid)
        return ct
    except BaseException:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(BackendError):
                await ct.destroy()
        raise


async def mount_shell(ct: Container, layers: Sequence[str], *, root_only: bool = False) -> None:
    """Have the holder of *ct* mount the overlay (*layers* topmost first over the spec's root,
    a fresh upper), /dev and /sys, pivot into it and unshare a new pid namespace. With
    *root_only*, the overlay only, at ``ct.mountpoint`` (see :attr:`Boot.root_only`)."""
    spec, state = ct.spec, ct.state
    ct.layers = tuple(layers)
    root = spec.root_dir.rstrip("/") + "/"
    if any(p.startswith(root) for p in ct.layers):
        ct.lowermount = os.path.join(ct.dir, "lower")
        os.makedirs(ct.lowermount, exist_ok=True)
    _prepare_upper(ct, state)
    boot = _boot_of(ct, init=None, proc=False, root_only=root_only)
    assert ct._holder is not None
    reply = await anyio.to_thread.run_sync(_boot, ct._holder, boot, abandon_on_cancel=True)
    if not isinstance(reply, Ready):
        why = reply.message if isinstance(reply, AgentError) else "the holder died during set-up"
        raise BackendError(f"workspace {ct.id}: set-up failed: {why}")


def tree_of(ct: Container) -> list[int]:
    """Host pids of *ct*'s processes, its agent first, each one's parent before it."""
    assert ct.init_pid is not None
    children: dict[int, list[int]] = {}
    pids = [p for p in ct.pids() if p != ct.init_pid]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(pid)
    order = [ct.init_pid]
    for pid in order:  # grows while iterating: breadth first
        order.extend(sorted(children.get(pid, ())))
    stray = sorted(set(pids) - set(order))
    if stray:
        raise BackendError(f"workspace {ct.id}: processes {stray} are not below its agent; cannot fork it")
    return order


async def fork_tree_into(ct: Container, source: Container, dev_fd: int) -> float:
    """Tree-fork the frozen workspace *source* into the mounted shell *ct*, whose cgroup is
    frozen first (the clones start frozen: :func:`start_forked` thaws them). The agent's clone
    holds one end of a new socket pair at its source's fd number; *ct* talks over the other.

    Returns:
        Seconds the ioctl took.
    """
    from . import _bunshin_c as c

    if not source.frozen:
        raise BackendError(f"workspace {source.id}: freeze it before forking its processes")
    pids = tree_of(source)
    await ct.freeze()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cgfd = os.open(ct.cgroups.v2 or "", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # shielded: once asked, the fork is made and its clones recorded (a cancelled caller
        # then destroys them with the shell), never left unknown
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            clones = await anyio.to_thread.run_sync(
                lambda: c.bunshin_fork_tree(dev_fd, pids, ct._holder_pidfd, cgfd,
                                            subst=[(0, source.agent_fd, child.fileno())]))
            took = time.perf_counter() - t0
    except BaseException as exc:
        parent.close()
        if isinstance(exc, OSError):
            raise BackendError(f"workspace {ct.id}: cannot fork the processes of {source.id} ({_describe(pids)}): "
                               f"{exc} (the kernel log says why)") from None
        raise
    finally:
        child.close()
        os.close(cgfd)
    ct._sock = parent
    ct.agent_fd = source.agent_fd
    ct.init_pid = clones[0]
    ct.pidfd = c.pidfd_open(clones[0])
    ct.record.init_pid, ct.record.init_start = clones[0], process_start_time(clones[0])
    ct.state.write(ct.record)
    for pid in clones:
        ct.cgroups.attach(pid)
    assert ct._holder is not None
    ct._holder.sendall(b"g")  # the root clone is its child: wait for it
    return took


def _describe(pids: Sequence[int]) -> str:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").strip().decode(errors="replace")[:60]
        except OSError:
            cmd = "?"
        out.append(f"{pid} {cmd}")
    return "; ".join(out)


async def start_forked(ct: Container) -> Pong:
    """Thaw the forked workspace *ct* and have its agent mount its /proc; returns its Pong."""
    await ct.thaw()
    pong = await ct._rpc(Forked(), _REPLY_GRACE)
    ct.record.state = "running"
    ct.state.write(ct.record)
    return pong


def _holder_main(sock: socket.socket) -> NoReturn:
    """Run in a forked workspace's holder: set the namespaces up, unshare a pid namespace,
    then reap its init (the agent's clone) until none is left. Never returns."""
    from . import _bunshin_c as c

    code = 1
    try:
        _boot_first_process(sock)
        c.unshare(c.CLONE_NEWPID)
        send(sock, Ready(os.getpid()))
        sock.recv(1)  # the controller's go (the tree is forked) or its close (it is not)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, then _exit
        with contextlib.suppress(BaseException):
            send(sock, AgentError("setup", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(code)
