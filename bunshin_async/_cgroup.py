"""Cgroups of live workspaces, on a pure cgroup v2 host or a hybrid v1/v2 one.

Each workspace gets a cgroup v2 group (its processes are cloned into it with
CLONE_INTO_CGROUP; it gives ``cgroup.freeze`` and ``cgroup.kill``) under ``bunshin/`` at the top
of the v2 hierarchy. The memory and pids controllers come from wherever the host has them: in
that v2 group when the v2 hierarchy has them, otherwise in a v1 group of the same name under
``bunshin/`` in the v1 ``memory`` (and ``pids``) hierarchy. :func:`layout` finds out which, once.
"""

from __future__ import annotations

import errno
import functools
import os
import time

import msgspec

__all__ = ["CgroupLayout", "Cgroups", "layout", "remove_group"]

_PARENT = "bunshin"


class CgroupLayout(msgspec.Struct, frozen=True):
    """Where the host's cgroup hierarchies are and which controllers each offers."""

    v2: str | None
    """Mount point of the cgroup v2 hierarchy, or None."""
    v2_controllers: frozenset[str]
    """Controllers available in the v2 hierarchy (``cgroup.controllers`` of its root)."""
    v1: dict[str, str]
    """Mount point of each v1 controller hierarchy mounted (``memory``, ``pids``, ...)."""

    def place(self, controller: str) -> str | None:
        """Return ``"v2"``, ``"v1"`` or None: where *controller* is used."""
        if self.v2 and controller in self.v2_controllers:
            return "v2"
        if controller in self.v1:
            return "v1"
        return None


@functools.cache
def layout() -> CgroupLayout:
    """Read /proc/self/mountinfo and describe the host's cgroup hierarchies."""
    v2 = None
    v1: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype, _, options = right.split()[:3]
            target = fields[4].replace("\\040", " ")
            if fstype == "cgroup2" and v2 is None:
                v2 = target
            elif fstype == "cgroup":
                for opt in options.split(","):
                    if opt in ("memory", "pids", "freezer") and opt not in v1:
                        v1[opt] = target
    controllers: frozenset[str] = frozenset()
    if v2 is not None:
        with open(os.path.join(v2, "cgroup.controllers")) as f:
            controllers = frozenset(f.read().split())
    return CgroupLayout(v2, controllers, v1)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(path: str) -> dict[str, int]:
    """Read a flat keyed file (``memory.stat``, ``cgroup.events``) into a dict."""
    out = {}
    for line in _read(path).splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


class Cgroups:
    """The cgroup directories of one workspace (see the module docstring).

    Attributes:
        v2: The v2 group (freeze, kill, and the controllers v2 has), or None on a v1-only host.
        memory: The group whose memory files to use, or None.
        memory_v1: True when :attr:`memory` is a v1 group.
        pids: The group whose ``pids.max`` to use, or None.
    """

    def __init__(self, name: str, lay: CgroupLayout | None = None) -> None:
        self.layout = lay = lay or layout()
        self.v2 = os.path.join(lay.v2, _PARENT, name) if lay.v2 else None
        self.memory = self._group(lay, "memory", name)
        self.memory_v1 = lay.place("memory") == "v1"
        self.pids = self._group(lay, "pids", name)

    @staticmethod
    def _group(lay: CgroupLayout, controller: str, name: str) -> str | None:
        where = lay.place(controller)
        if where == "v2":
            return os.path.join(lay.v2, _PARENT, name)  # type: ignore[arg-type]
        if where == "v1":
            return os.path.join(lay.v1[controller], _PARENT, name)
        return None

    @property
    def paths(self) -> list[str]:
        """Every directory of this workspace's groups, each once, v2 first."""
        out: list[str] = []
        for p in (self.v2, self.memory, self.pids):
            if p is not None and p not in out:
                out.append(p)
        return out

    def v1_paths(self) -> list[str]:
        """The v1 groups, which a new process must be moved into by pid."""
        return [p for p in self.paths if p != self.v2]

    def create(self, *, memory: int | None = None, pids: int | None = None) -> None:
        """Make the groups and set the limits (enabling v2 controllers on the way down)."""
        lay = self.layout
        if self.v2:
            parent = os.path.dirname(self.v2)
            os.makedirs(parent, exist_ok=True)
            wanted = {c for c in ("memory", "pids") if lay.place(c) == "v2"}
            for d in (lay.v2, parent):
                if wanted:
                    _write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in sorted(wanted)))
            os.mkdir(self.v2)
        for p in self.v1_paths():
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.mkdir(p)
        if memory is not None and self.memory:
            if self.memory_v1:
                _write(os.path.join(self.memory, "memory.limit_in_bytes"), str(memory))
            else:
                _write(os.path.join(self.memory, "memory.max"), str(memory))
                if os.path.exists(swap := os.path.join(self.memory, "memory.swap.max")):
                    _write(swap, "0")
        if pids is not None and self.pids:
            _write(os.path.join(self.pids, "pids.max"), str(pids))

    def attach(self, pid: int) -> None:
        """Move *pid* into the v1 groups (the v2 group is joined at clone time)."""
        for p in self.v1_paths():
            _write(os.path.join(p, "cgroup.procs"), str(pid))

    def procs(self) -> list[int]:
        """Host pids of the processes in the workspace (its v2 group, else its first group)."""
        paths = self.paths
        if not paths:
            return []
        try:
            return [int(x) for x in _read(os.path.join(paths[0], "cgroup.procs")).split()]
        except FileNotFoundError:
            return []

    def set_frozen(self, frozen: bool) -> None:
        """Write ``cgroup.freeze`` (the caller waits for :meth:`is_frozen`)."""
        if self.v2 is None:
            raise OSError(errno.ENOTSUP, "freezing needs a cgroup v2 hierarchy")
        _write(os.path.join(self.v2, "cgroup.freeze"), "1" if frozen else "0")

    def is_frozen(self) -> bool:
        """Whether ``cgroup.events`` says the group is frozen."""
        return self.v2 is not None and _keyed(os.path.join(self.v2, "cgroup.events")).get("frozen") == 1

    def kill(self) -> None:
        """SIGKILL every process of the groups (cgroup.kill, else one by one); ignores groups
        that are gone."""
        if self.v2 is not None:
            try:
                _write(os.path.join(self.v2, "cgroup.kill"), "1")
                return
            except FileNotFoundError:
                pass
        for p in self.paths:
            _kill_procs(p)

    def memory_usage(self) -> tuple[int, int, int]:
        """(current bytes, anonymous bytes, file bytes) charged to the workspace."""
        if self.memory is None:
            return (0, 0, 0)
        if self.memory_v1:
            current = int(_read(os.path.join(self.memory, "memory.usage_in_bytes")))
            st = _keyed(os.path.join(self.memory, "memory.stat"))
            return current, st.get("total_rss", st.get("rss", 0)), st.get("total_cache", st.get("cache", 0))
        current = int(_read(os.path.join(self.memory, "memory.current")))
        st = _keyed(os.path.join(self.memory, "memory.stat"))
        return current, st.get("anon", 0), st.get("file", 0)

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in the workspace so far."""
        if self.memory is None:
            return 0
        try:
            if self.memory_v1:
                return _keyed(os.path.join(self.memory, "memory.oom_control")).get("oom_kill", 0)
            return _keyed(os.path.join(self.memory, "memory.events")).get("oom_kill", 0)
        except FileNotFoundError:
            return 0


def _kill_procs(path: str) -> None:
    try:
        pids = [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
    except FileNotFoundError:
        return
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def remove_group(path: str, *, timeout: float = 5.0) -> bool:
    """Kill what is left in the group at *path* and remove it; return False if it is still
    there after *timeout* seconds (its processes would not die)."""
    if not os.path.isdir(path):
        return True
    try:
        if os.path.exists(os.path.join(path, "cgroup.freeze")):
            _write(os.path.join(path, "cgroup.freeze"), "0")
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(os.path.join(path, "cgroup.kill"), "1")
    except FileNotFoundError:
        return True
    deadline = time.monotonic() + timeout
    while True:
        _kill_procs(path)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.005)
