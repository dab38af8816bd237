"""The ``criu`` engine of the live backend: checkpoint a workspace's process tree with the
``criu`` program to a tmpfs, and restore it into a new container shell (the baseline the
``bunshin`` engine is measured against: every fork is a private copy of the memory).

A **checkpoint** (:meth:`_Criu.dump`, the workspace frozen by the caller) is ``criu dump
--leave-running`` of the agent's tree, with everything the tree holds that is not the
workspace's own named for CRIU as external:

- the agent's channel to the controller: one end of a stream socket pair whose other end the
  controller holds (``--external unix[INO]``). CRIU finds sockets through ``sock_diag`` of the
  workspace's network namespace, so the channel must belong to it: :meth:`_Criu.prepare` has
  the agent make a new channel there first (:class:`._agent.Rebind`) when it does not;
- files mapped by processes that were not started inside the workspace (the agent is a clone
  of the controller's zygote: its interpreter, libraries and extension modules are the
  controller's files, on a mount the workspace's mount namespace does not have):
  ``--external file[MNT:INO]``, each recorded with its path;
- bind mounts of the host's device nodes (``/dev/null`` and the others the workspace's
  ``/dev`` holds): ``--external mnt[MOUNTPOINT]:KEY``, each recorded with its source.

What was made external is written to ``bunshin-criu.json`` beside the image.

A **restore** (:meth:`_Criu.restore`) runs ``criu restore`` into a container shell whose
holder mounted the overlay root only (:func:`._container.mount_shell` with ``root_only``): in
the holder's mount namespace, with ``--root`` the overlay, born in the shell's cgroup, as a
child of the controller (``--restore-sibling``). CRIU makes the workspace's namespaces (pid,
mount, network, UTS, IPC, cgroup) and mounts from the image; the externals are handed back
open (``--inherit-fd``: a new socket pair for the channel, the recorded files reopened and
checked to be the same inodes) and the device nodes bound from the host's. The restored agent
resumes waiting on its new channel.

Images live in one directory per live backend on a tmpfs (the state directory when it is
one, else ``/dev/shm``), recorded in the state directory so that ``bunshin gc`` removes it
if the controller dies. Debian's criu 3.17 needs a kernel it supports (``criu check``): the
lab VM's (``docs/labvm.md``) is one, with its ``switch_root`` into the host root (a chroot
leaves a root CRIU refuses to dump).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from ._agent import Pong, Rebind, recv, send
from ._exceptions import BackendError, ConfigError
from ._state import StateDir, _is_tmpfs, remove_tree

if TYPE_CHECKING:
    from ._container import Container

__all__: list[str] = []

_META = "bunshin-criu.json"
_TIMEOUT = 600.0  # seconds a dump or a restore may take (a large tree under TCG takes tens)
_SIOCGSKNS = 0x894C  # the network namespace of a socket, as an fd


class _Criu:
    """Dump and restore workspaces through the ``criu`` program.

    Args:
        binary: The ``criu`` program.
        nsenter: util-linux's ``nsenter`` (a restore runs in the shell holder's mount
            namespace, which a multi-threaded controller cannot enter itself).
        network_lock: CRIU's ``--network-lock`` method: ``iptables`` where
            ``iptables-restore`` exists, else ``nftables``.
    """

    def __init__(self, binary: str, nsenter: str, network_lock: str) -> None:
        self.binary = binary
        self.nsenter = nsenter
        self.network_lock = network_lock
        self.root: Path | None = None
        self._state: StateDir | None = None
        self._record: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def find(cls) -> _Criu:
        """Find ``criu`` and check that it works on this kernel (``criu check``).

        Raises:
            ConfigError: criu or nsenter is missing, or ``criu check`` fails (naming why).
        """
        binary = shutil.which("criu") or next((p for p in ("/usr/sbin/criu", "/sbin/criu") if os.access(p, os.X_OK)), None)
        if binary is None:
            raise ConfigError("the criu engine needs criu: apt-get install --no-install-recommends criu")
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            raise ConfigError("the criu engine needs nsenter (util-linux): apt-get install util-linux")
        try:
            proc = subprocess.run([binary, "check"], capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"the criu engine cannot run `{binary} check`: {exc}") from None
        if proc.returncode != 0:
            why = _log_errors(proc.stdout + proc.stderr) or f"exit status {proc.returncode}"
            raise ConfigError(f"`criu check` fails on this kernel ({os.uname().release}): {why}; the criu engine "
                              "needs a kernel CRIU supports (on a host where it does not, use the lab VM: "
                              "bunshin vm run -- ...)")
        lock = "iptables" if shutil.which("iptables-restore") else "nftables"
        return cls(binary, nsenter, lock)

    # -- images ------------------------------------------------------------------------------

    def new_image_dir(self, state: StateDir, owner: str) -> Path:
        """A new, empty directory for one checkpoint (on a tmpfs), under this backend's image
        root, which is made and recorded in *state* (as *owner*``.criu``) on first use."""
        with self._lock:
            if self.root is None:
                base = state.path if _is_tmpfs(state.path) else "/dev/shm"
                root = Path(base, "criu", state.host_name(owner))
                record = owner + ".criu"
                state.write(state.new_record(record, kind="layer", state="running", dirs=[str(root)]))
                root.mkdir(parents=True, exist_ok=True)
                self.root, self._state, self._record = root, state, record
        return Path(tempfile.mkdtemp(prefix="image.", dir=self.root))

    def close(self) -> None:
        """Remove the image root and its record (images still there included)."""
        with self._lock:
            if self.root is not None and self._state is not None and self._record is not None:
                remove_tree(str(self.root))
                with contextlib.suppress(OSError):  # the parent, if no other backend uses it
                    self.root.parent.rmdir()
                self._state.remove(self._record)
            self.root = self._state = self._record = None

    # -- checkpoint --------------------------------------------------------------------------

    async def prepare(self, container: Container) -> None:
        """Make sure the agent's channel belongs to the workspace's network namespace (before
        it is frozen for a dump): if not, have the agent move it there (:class:`Rebind`).

        Raises:
            BackendError: The agent is gone, or did not move its channel.
        """
        if not container.alive or container.init_pid is None:
            raise BackendError(f"workspace {container.id}: its agent is gone; it cannot be checkpointed")
        try:
            elsewhere = _socket_netns(container) != _netns(container.init_pid)
        except OSError as exc:
            raise BackendError(f"workspace {container.id}: cannot tell where its agent's channel is: {exc}") from None
        if not elsewhere:
            return
        assert container._limiter is not None
        await anyio.to_thread.run_sync(_rebind, container, abandon_on_cancel=True, limiter=container._limiter)

    def dump(self, container: Container, image: Path) -> None:
        """Checkpoint the frozen *container*'s process tree into *image* (blocking; run it in
        a worker thread). The tree is left as it was (frozen, running on once thawed).

        Raises:
            BackendError: criu failed (the error lines of its log are in the message), or the
                workspace holds something that cannot be made external.
        """
        agent = container.init_pid
        if agent is None or not container.frozen:
            raise BackendError(f"workspace {container.id}: freeze it before its checkpoint")
        sock_ino = os.stat(f"/proc/{agent}/fd/{container.agent_fd}").st_ino
        mounts = _external_mounts(agent)
        files = _external_files(container.pids(), agent)
        meta = {"agent_fd": container.agent_fd, "socket": sock_ino, "mounts": mounts,
                "files": {k: list(v) for k, v in files.items()}}
        (image / _META).write_text(json.dumps(meta))
        argv = [self.binary, "dump", "--tree", str(agent), "--images-dir", str(image), "--log-file", "dump.log",
                "--leave-running", "--freeze-cgroup", container.cgroups.v2 or "", "--manage-cgroups=ignore",
                "--network-lock", self.network_lock, "--external", f"unix[{sock_ino}]"]
        for mountpoint, (key, _) in mounts.items():
            argv += ["--external", f"mnt[{mountpoint}]:{key}"]
        for key in files:
            argv += ["--external", key]
        proc = _run(argv)
        if proc.returncode != 0:
            raise BackendError(f"workspace {container.id}: criu dump failed (exit status {proc.returncode}): "
                               f"{_log_errors(_read(image / 'dump.log'), proc.stderr)}")

    # -- restore -----------------------------------------------------------------------------

    async def restore(self, image: Path, shell: Container) -> None:
        """Restore the checkpoint in *image* into *shell* (an open shell whose holder mounted
        the overlay root only): its processes are born in the shell's cgroup and run; the
        shell's channel is the new agent's. :func:`._container.start_forked` finishes it.

        Raises:
            BackendError: A recorded file changed since the checkpoint, or criu failed (the
                error lines of its log are in the message).
        """
        meta = json.loads((image / _META).read_text())
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []  # the recorded files, opened
        try:
            inherit = [f"fd[{child.fileno()}]:socket:[{meta['socket']}]"]
            for key, (path, dev, ino) in meta["files"].items():
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise BackendError(f"workspace {shell.id}: cannot restore: {path} (mapped by a process of the "
                                       f"checkpoint) cannot be opened: {exc.strerror}") from None
                fds.append(fd)
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (dev, ino):
                    raise BackendError(f"workspace {shell.id}: cannot restore: {path} (mapped by a process of the "
                                       "checkpoint) was replaced since the checkpoint")
                inherit.append(f"fd[{fd}]:{key}")
            work = Path(tempfile.mkdtemp(prefix="restore.", dir=image))
            try:
                pid = await anyio.to_thread.run_sync(self._restore, image, work, shell, inherit, meta["mounts"],
                                                     [child.fileno(), *fds])
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(remove_tree, str(work))
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            for fd in fds:
                os.close(fd)
        try:
            _adopt(shell, pid, parent, meta["agent_fd"])
        except OSError as exc:  # the restored agent died at once
            parent.close()
            raise BackendError(f"workspace {shell.id}: the restored agent (pid {pid}) is gone: {exc}") from None

    def _restore(self, image: Path, work: Path, shell: Container, inherit: list[str],
                 mounts: dict[str, list[str]], fds: list[int]) -> int:
        assert shell.holder_pid is not None and shell.cgroups.v2 is not None
        argv = [self.binary, "restore", "--images-dir", str(image), "--work-dir", str(work), "--log-file", "restore.log",
                "--pidfile", str(work / "pid"), "--root", shell.mountpoint, "--restore-detached", "--restore-sibling",
                "--manage-cgroups=ignore"]
        for spec in inherit:
            argv += ["--inherit-fd", spec]
        for key, source in mounts.values():
            argv += ["--external", f"mnt[{key}]:{source}"]
        # born in the shell's cgroup (the restored tree is made by criu's own forks), run in
        # the holder's mount namespace (where the overlay --root is mounted)
        wrapper = ["/bin/sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', shell.cgroups.v2,
                   self.nsenter, f"--mount=/proc/{shell.holder_pid}/ns/mnt", "--", *argv]
        proc = _run(wrapper, fds)
        if proc.returncode != 0:
            raise BackendError(f"workspace {shell.id}: criu restore failed (exit status {proc.returncode}): "
                               f"{_log_errors(_read(work / 'restore.log'), proc.stderr)}")
        try:
            return int((work / "pid").read_text())
        except (OSError, ValueError) as exc:
            raise BackendError(f"workspace {shell.id}: criu restore wrote no pid file: {exc}") from None


# --- helpers -----------------------------------------------------------------------------------


def _run(argv: list[str], fds: Sequence[int] = ()) -> subprocess.CompletedProcess[str]:
    for fd in fds:
        os.set_inheritable(fd, True)
    try:
        return subprocess.run(argv, pass_fds=tuple(fds), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise BackendError(f"{argv[0]} did not finish within {_TIMEOUT:g} s: {' '.join(argv[:3])} ...") from None
    except OSError as exc:
        raise BackendError(f"cannot run {argv[0]}: {exc.strerror}") from None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _log_errors(log: str, stderr: str = "") -> str:
    """The lines of a criu log (or its output) that say what failed, at most the last six."""
    lines = [ln.strip() for ln in (log + "\n" + stderr).splitlines() if "Error" in ln or "error" in ln]
    # the exit statuses of helper programs criu tries and does without say nothing
    lines = [ln for ln in lines if not re.search(r"exited, status=|execvp\(|-save -V failed|tun: Unable", ln)]
    if lines:
        return "; ".join(lines[-6:])
    rest = log.strip().splitlines() or stderr.strip().splitlines()
    return rest[-1] if rest else "(criu wrote no log)"


def _netns(pid: int | None) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _socket_netns(container: Container) -> int:
    """The inode of the network namespace the controller's end of the channel belongs to."""
    import fcntl

    assert container._sock is not None
    fd = fcntl.ioctl(container._sock.fileno(), _SIOCGSKNS)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _rebind(container: Container) -> None:
    """Have the agent of *container* move its channel into its own network namespace
    (:class:`Rebind`); the container talks over the new one afterwards."""
    with container._lock:
        sock = container._sock
        if sock is None or container._dead is not None:
            raise BackendError(f"workspace {container.id}: its agent {container._dead or 'is gone'}")
        try:
            sock.settimeout(30.0)
            send(sock, Rebind())
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            if len(fds) != 1:
                raise BackendError(f"workspace {container.id}: the agent sent no new channel")
            new = socket.socket(fileno=fds[0])
            new.settimeout(30.0)
            reply = recv(new)
        except OSError as exc:
            container._dead = f"connection lost ({exc.strerror or exc})"
            raise BackendError(f"workspace {container.id}: moving its agent's channel failed: {exc}") from None
        if not isinstance(reply, Pong):
            new.close()
            raise BackendError(f"workspace {container.id}: the agent answered {reply!r} to Rebind")
        container._sock = new
        sock.close()


def _mount_ids(pid: int) -> dict[int, tuple[str, str, str]]:
    """The mounts of *pid*'s mount namespace: id -> (major:minor, root within its fs, mountpoint)."""
    out = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            out[int(fields[0])] = (fields[2], _unescape(fields[3]), _unescape(fields[4]))
    return out


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _external_mounts(agent: int) -> dict[str, tuple[str, str]]:
    """Bind mounts in the workspace of a file system none of its mounts shows whole (the
    host's device nodes): mountpoint -> (key, the source path in the controller's view)."""
    theirs = _mount_ids(agent).values()
    whole = {dev for dev, root, _ in theirs if root == "/"}
    mine = [(dev, mp) for dev, root, mp in _mount_ids(os.getpid()).values() if root == "/"]
    out = {}
    for dev, root, mountpoint in theirs:
        if dev in whole:
            continue
        base = next((mp for d, mp in mine if d == dev), None)
        if base is None:
            raise BackendError(f"the workspace's mount {mountpoint} ({root} of device {dev}) has no source "
                               "the controller can see: it cannot be checkpointed")
        key = "m" + re.sub(r"[^A-Za-z0-9]", "-", mountpoint)
        out[mountpoint] = (key, os.path.join(base, root.lstrip("/")))
    return out


def _external_files(pids: list[int], agent: int) -> dict[str, tuple[str, int, int]]:
    """Files the tree maps (and executables it runs) that lie on a mount outside the
    workspace's mount namespace: CRIU key ``file[MNT:INO]`` -> (path, device, inode)."""
    inside = set(_mount_ids(agent))
    out: dict[str, tuple[str, int, int]] = {}
    for pid in pids:
        links = [f"/proc/{pid}/exe"]
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        links.append(f"/proc/{pid}/map_files/{parts[0]}")
        except FileNotFoundError:
            continue  # it exited (a frozen tree loses no process, but a zombie has no maps)
        for link in dict.fromkeys(links):
            try:
                fd = os.open(link, os.O_PATH | os.O_CLOEXEC)
            except (FileNotFoundError, ProcessLookupError):
                continue
            try:
                mnt = _fd_mount_id(fd)
                if mnt in inside:
                    continue
                st = os.fstat(fd)
                key = f"file[{mnt:x}:{st.st_ino:x}]"
                if key not in out:
                    path = os.readlink(link)
                    if path.endswith(" (deleted)"):
                        raise BackendError(f"process {pid} maps {path}: a deleted file outside the workspace "
                                           "cannot be checkpointed")
                    out[key] = (path, st.st_dev, st.st_ino)
            finally:
                os.close(fd)
    return out


def _fd_mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise BackendError("this kernel does not show mnt_id in /proc/self/fdinfo")


def _adopt(shell: Container, pid: int, sock: socket.socket, agent_fd: int) -> None:
    """Make the restored tree whose agent is *pid* the processes of *shell*, talking over *sock*."""
    from . import _bunshin_c as c
    from ._state import process_start_time

    shell._sock = sock
    shell.agent_fd = agent_fd
    shell.init_pid = pid
    shell.pidfd = c.pidfd_open(pid)
    shell.record.init_pid, shell.record.init_start = pid, process_start_time(pid)
    shell.state.write(shell.record)
    for p in shell.pids():
        shell.cgroups.attach(p)
