"""The state directory: a record of every host resource a live workspace holds, and ``gc``.

A record is written *before* each resource is made (so a controller killed at any point leaves
a record covering everything it made) and updated after. It names its owner, the controller
process, by pid and start time (pids are reused), and the boot it belongs to. :func:`gc`
removes everything a record lists whose owner is gone: it kills the cgroups' processes
(``cgroup.kill``), unmounts, deletes veths, removes directories and, last, the record.

Layout of a state directory (default ``/run/bunshin``, or ``$BUNSHIN_STATE_DIR``)::

    records/<id>.json      one record per workspace or kept layer
    gc.lock                taken while a gc runs
    containers/<id>.<key>/ upper, work and rootfs of a workspace   } in the data directory:
    layers/<id>.<key>/     read-only layers kept for snapshots       } see :class:`StateDir`

Names outside the record directory (data directories, which several state directories may
share, and cgroups, which the whole host shares) carry the state directory's :attr:`StateDir.key`,
so two controllers with different state directories never collide on a workspace id.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from typing import Literal

import msgspec

from ._cgroup import remove_group

__all__ = ["GcReport", "Record", "StateDir", "gc", "process_start_time"]

DEFAULT_STATE_DIR = "/run/bunshin"
DEFAULT_DATA_DIR = "/var/lib/bunshin"


class Record(msgspec.Struct, kw_only=True):
    """What one workspace (or kept layer) holds on the host. Mutable: updated as it grows."""

    id: str
    """The workspace's id (also the record's file name)."""
    kind: Literal["container", "layer"] = "container"
    """A workspace, or a directory kept as a read-only layer."""
    owner_pid: int
    """The controller process that made it."""
    owner_start: int
    """The owner's start time (clock ticks after boot, /proc/PID/stat field 22)."""
    boot_id: str
    """The boot the record belongs to (after a reboot, every owner is gone)."""
    created: float
    """Wall-clock time the record was first written."""
    state: Literal["creating", "running", "destroying"] = "creating"
    """How far the workspace got."""
    cgroups: list[str] = []
    """Cgroup directories (v2 and v1)."""
    mounts: list[str] = []
    """Mount points on the host (normally none: a workspace mounts in its own namespace)."""
    dirs: list[str] = []
    """Directories to remove (the workspace's data directory, a layer)."""
    veths: list[str] = []
    """Host-side veth interfaces."""
    init_pid: int | None = None
    """Host pid of the workspace's pid 1 (its agent)."""
    init_start: int | None = None
    """That process's start time, to tell it from a later process with the same pid."""


class GcReport(msgspec.Struct, frozen=True):
    """What :func:`gc` removed and what it left."""

    records: int = 0
    """Records of dead owners removed."""
    alive: int = 0
    """Records left alone because their owner still runs."""
    processes: int = 0
    """Processes killed."""
    cgroups: int = 0
    """Cgroup directories removed."""
    mounts: int = 0
    """Mount points unmounted."""
    veths: int = 0
    """Veth interfaces deleted."""
    dirs: int = 0
    """Directories removed."""
    errors: tuple[str, ...] = ()
    """What could not be removed, and why (its record is kept for a later gc)."""


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def process_start_time(pid: int) -> int | None:
    """Start time of *pid* in clock ticks after boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(data[data.rindex(b")") + 2 :].split()[19])


def _is_tmpfs(path: str) -> bool:
    """Whether *path* (or its nearest existing ancestor) lives on a tmpfs."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            target = left.split()[4].replace("\\040", " ")
            if (path == target or path.startswith(target.rstrip("/") + "/")) and len(target) >= len(best):
                best, fstype = target, right.split()[0]
    return fstype == "tmpfs"


class StateDir:
    """Where workspace records (and, by default, workspace directories) live.

    Args:
        path: The record directory; default ``$BUNSHIN_STATE_DIR`` or ``/run/bunshin``.
        data: Where workspace upper/work directories and layers go; default
            ``$BUNSHIN_DATA_DIR``, else *path* itself unless it is on a tmpfs, in which case
            ``/var/lib/bunshin`` (writable layers belong on disk, not in memory).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, data: str | os.PathLike[str] | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path or os.environ.get("BUNSHIN_STATE_DIR") or DEFAULT_STATE_DIR))
        if data is None:
            data = os.environ.get("BUNSHIN_DATA_DIR") or (DEFAULT_DATA_DIR if _is_tmpfs(self.path) else self.path)
        self.data = os.path.abspath(os.fspath(data))
        self.records = os.path.join(self.path, "records")
        self._owner = (os.getpid(), process_start_time(os.getpid()) or 0, _boot_id())

    def __repr__(self) -> str:
        return f"StateDir({self.path!r}, data={self.data!r})"

    @functools.cached_property
    def key(self) -> str:
        """Eight hex digits naming this state directory (a digest of its path)."""
        return hashlib.sha256(self.path.encode()).hexdigest()[:8]

    def host_name(self, id: str) -> str:
        """The host-wide name of workspace or layer *id*: its cgroups' and data directories'
        name, unique across state directories."""
        return f"{id}.{self.key}"

    def container_dir(self, id: str) -> str:
        """The data directory of workspace *id*."""
        return os.path.join(self.data, "containers", self.host_name(id))

    def layer_dir(self, id: str) -> str:
        """The directory of kept layer *id*."""
        return os.path.join(self.data, "layers", self.host_name(id))

    def layer_record(self, path: str) -> str:
        """The record id of the layer kept at *path* (a :meth:`layer_dir`)."""
        name = os.path.basename(os.path.normpath(path))
        suffix = "." + self.key
        if not name.endswith(suffix):
            raise ValueError(f"{path} is not a layer directory of {self!r}")
        return name[: -len(suffix)] + ".layer"

    def drop_layer(self, path: str) -> None:
        """Remove a layer kept by :meth:`Container.destroy` and its record."""
        remove_tree(path)
        self.remove(self.layer_record(path))

    def new_record(self, id: str, **fields: object) -> Record:
        """A record of *id* owned by this process (not yet written)."""
        pid, start, boot = self._owner
        return Record(id=id, owner_pid=pid, owner_start=start, boot_id=boot, created=time.time(), **fields)  # type: ignore[arg-type]

    def write(self, record: Record) -> None:
        """Write *record* atomically (durable against a SIGKILL of this process)."""
        os.makedirs(self.records, exist_ok=True)
        final = os.path.join(self.records, record.id + ".json")
        tmp = f"{final}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(record))
        os.replace(tmp, final)

    def remove(self, id: str) -> None:
        """Delete the record of *id* (gone already is fine)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.records, id + ".json"))

    def read(self, id: str) -> Record | None:
        """The record of *id*, or None."""
        try:
            with open(os.path.join(self.records, id + ".json"), "rb") as f:
                return msgspec.json.decode(f.read(), type=Record)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def list(self) -> list[Record]:
        """Every readable record (a half-written temporary file is ignored)."""
        out = []
        try:
            names = sorted(os.listdir(self.records))
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(".json"):
                rec = self.read(name[:-5])
                if rec is not None:
                    out.append(rec)
        return out

    def owner_alive(self, record: Record) -> bool:
        """Whether *record*'s owner still runs (same boot, same pid, same start time)."""
        if record.boot_id != self._owner[2]:
            return False
        return process_start_time(record.owner_pid) == record.owner_start

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the gc lock (one gc at a time per state directory)."""
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(os.path.join(self.path, "gc.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def gc(state_dir: StateDir | str | None = None, *, include_alive: bool = False) -> GcReport:
    """Remove everything the workspaces of dead controllers left behind.

    Args:
        state_dir: The state directory (a :class:`StateDir` or its path); default as in
            :class:`StateDir`.
        include_alive: Also remove the resources of owners that still run (for ``bunshin gc
            --all`` after a controller hung; never while it still uses them).

    Returns:
        What was removed. A resource that could not be removed is listed in
        :attr:`GcReport.errors` and its record kept, so a later gc tries again.
    """
    state = state_dir if isinstance(state_dir, StateDir) else StateDir(state_dir)
    counts = dict.fromkeys(("records", "alive", "processes", "cgroups", "mounts", "veths", "dirs"), 0)
    errors: list[str] = []
    with state.locked():
        for rec in state.list():
            if not include_alive and state.owner_alive(rec):
                counts["alive"] += 1
                continue
            before = len(errors)
            _collect(rec, counts, errors)
            if len(errors) == before:
                state.remove(rec.id)
                counts["records"] += 1
    return GcReport(**counts, errors=tuple(errors))


def _collect(rec: Record, counts: dict[str, int], errors: list[str]) -> None:
    """Remove what *rec* lists, counting into *counts* and noting failures in *errors*."""
    if rec.init_pid is not None and rec.init_start is not None and process_start_time(rec.init_pid) == rec.init_start:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.init_pid, 9)
            counts["processes"] += 1
    for path in rec.cgroups:
        if not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                counts["processes"] += len(f.read().split())
        except OSError:
            pass
        if remove_group(path):
            counts["cgroups"] += 1
        else:
            errors.append(f"{rec.id}: cgroup {path} still has processes that will not die")
    for path in rec.mounts:
        if _is_mountpoint(path):
            try:
                from ._bunshin_c import MNT_DETACH, umount2

                umount2(path, MNT_DETACH)
                counts["mounts"] += 1
            except OSError as exc:
                errors.append(f"{rec.id}: cannot unmount {path}: {exc}")
    for name in rec.veths:
        try:
            if _delete_link(name):
                counts["veths"] += 1
        except Exception as exc:  # noqa: BLE001 - pyroute2 raises its own errors
            errors.append(f"{rec.id}: cannot delete veth {name}: {exc}")
    for path in rec.dirs:
        if os.path.lexists(path):
            try:
                remove_tree(path)
                counts["dirs"] += 1
            except OSError as exc:
                errors.append(f"{rec.id}: cannot remove {path}: {exc}")


def remove_tree(path: str) -> None:
    """Remove the directory tree at *path* (overlay work directories included)."""

    def onerror(func: object, p: str, exc_info: object) -> None:
        exc = exc_info[1]  # type: ignore[index]
        if isinstance(exc, FileNotFoundError):
            return
        if isinstance(exc, OSError) and exc.errno in (errno.EBUSY,) and _is_mountpoint(p):
            from ._bunshin_c import MNT_DETACH, umount2

            umount2(p, MNT_DETACH)
            shutil.rmtree(p)
            return
        raise exc  # type: ignore[misc]

    shutil.rmtree(path, onerror=onerror)


def _is_mountpoint(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].replace("\\040", " ") == path for line in f)


def _delete_link(name: str) -> bool:
    """Delete the network interface *name* in this namespace; False when there is none."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=name)
        if not idx:
            return False
        try:
            ipr.link("del", index=idx[0])
        except NetlinkError as exc:
            if exc.code == errno.ENODEV:
                return False
            raise
        return True
