"""The live backend: real containers on this host.

:class:`LiveBackend` implements :class:`Backend` with one of three fork engines
(``engine=``); every one keeps a snapshot's files as overlay layers (:mod:`._layers`), a copy
of the upper directory taken while the workspace is frozen. They differ in what a snapshot
holds of the processes and how a fork gets them back:

- ``restart`` (the default; any Linux with overlayfs): nothing; a fork boots a new workspace
  on the layers and replays the snapshot's ``stateful`` calls;
- ``bunshin`` (the kernel module, ``/dev/bunshin`` with ``BUNSHIN_FEATURE_TREE_SUBST``): a
  frozen live process tree; a fork tree-forks it (``BUNSHIN_IOC_FORK_TREE``) into a new
  container shell (:func:`._container.open_shell`), memory shared copy-on-write;
- ``criu`` (the baseline, Debian's ``criu``): a checkpoint image on a tmpfs; a fork restores
  it into a new container shell, a private copy of the memory per fork.

The ``restart`` engine in detail:

- ``create`` boots a workspace of the spec on its root file system (:mod:`._container`);
- ``freeze`` stops the workspace and keeps its overlay upper directory as a read-only layer
  (:mod:`._layers`) on top of the layers it already stood on; ``snapshot`` freezes it
  (cgroup freeze), copies the upper directory into a new layer and thaws it;
- ``fork`` boots a workspace on the snapshot's layers with a fresh upper directory and
  replays, in order, the calls of the snapshot's log whose tool is ``stateful`` (their effect
  lives in process state, which a file-system snapshot does not hold); forking a live
  workspace snapshots it first;
- ``demote`` archives a snapshot's own layer (its delta against its parent) with tar;
  ``promote`` extracts it again on top of the parent's layers;
- memory is measured, not modelled, by the page scanner (``/proc/PID/pagemap`` and
  ``/proc/kpagecount``) over the processes of the workspaces: the working set is the pages
  they map and nothing else does, a call's bytes dirtied are how much its workspace's own
  such pages grew, and :meth:`LiveBackend.task_profile` is the size the task's workspaces
  reached.

Snapshots of this engine hold no memory (their processes are gone), so
:meth:`LiveBackend.snapshot_charge` is 0.

The ``bunshin`` engine: ``snapshot`` prepares a container shell (cgroups, a holder process in
new namespaces) *before* freezing the source, then freezes it, copies its upper directory into
a layer, mounts the shell's overlay on it, tree-forks the processes into the shell (the
agent's channel to the controller replaced by a new socket pair: the clone's agent waits on
that one) and thaws the source: it is frozen for the copy, the mount and the fork's metadata
(measured: :attr:`LiveStatistics.frozen_seconds`), never for copying memory. The snapshot is
that frozen clone; ``freeze`` keeps the workspace itself, frozen, as the snapshot. ``fork`` of
a snapshot tree-forks its processes into a new shell on its layers with a fresh upper and
thaws it; ``fork`` of a live workspace does the same straight from it (one tree fork, not
two). A snapshot holds the pages its workspace dirtied since its parent (copy-on-write), so
:meth:`LiveBackend.snapshot_charge` is the bytes dirtied plus its page tables. A snapshot
promoted from the cold tier holds files only: its forks replay, as the ``restart`` engine's. Every layer lives under one directory recorded in
the state directory, so ``bunshin gc`` removes it if the controller is killed.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec

from ._backend import Backend, CallContext, ColdSnapshot, ToolResult, Workspace, WorkspaceMemory
from ._container import Container, ExecResult, fork_tree_into, mount_shell, open_container, open_shell, start_forked
from ._criu import _Criu
from ._exceptions import BackendError, ConfigError, WorkspaceReleasedError
from ._layers import Layer, LayerStore
from ._spec import WorkspaceSpec
from ._state import StateDir, gc, remove_tree
from ._scheduler import RunResult
from ._trace import TRACE_VERSION, MemoryProfile, Rollout, Step, Task, ToolCall, Trace, observation_digest

__all__ = ["ENGINES", "LiveBackend", "LiveStatistics", "demo_trace", "live_trace", "observation_bytes"]

ENGINES = ("restart", "bunshin", "criu")
_SCAN_DUTY = 4  # the working set is scanned at most once per this many times a scan's length
"""The fork engines of :class:`LiveBackend`."""


class LiveStatistics(msgspec.Struct, frozen=True):
    """What a live backend did."""

    creates: int
    """Workspaces booted by ``create``."""
    forks: int
    """Workspaces booted by ``fork``."""
    snapshots: int
    """Snapshots taken (``freeze`` and ``snapshot``)."""
    replayed_calls: int
    """Stateful calls replayed in forks."""
    demotes: int
    """Layers archived to the cold tier."""
    promotes: int
    """Layers extracted from the cold tier."""
    executions: int
    """Tool calls run."""
    failed_calls: int
    """Tool calls that exited non-zero or timed out (recorded as observations)."""
    flattens: int
    """Layer stacks merged because they grew deeper than the limit."""
    boot_seconds: float
    """Wall seconds spent booting workspaces (create and fork)."""
    fork_seconds: float
    """Wall seconds spent in forks, replays included."""
    tree_forks: int = 0
    """Process trees forked (``bunshin`` engine) or restored (``criu`` engine)."""
    frozen_seconds: float = 0.0
    """Wall seconds live workspaces spent frozen for snapshots and forks (``bunshin``,
    ``criu``; ``restart`` too, for its layer copy), summed."""
    max_frozen_seconds: float = 0.0
    """The longest of those."""
    tree_fork_seconds: float = 0.0
    """Wall seconds in the kernel's tree fork (``BUNSHIN_IOC_FORK_TREE``), summed."""


class _Handle:
    __slots__ = ("handle", "container", "stack", "log", "extra", "image", "booted", "largest", "own")

    def __init__(self, handle: Workspace, container: Container | None, stack: tuple[Layer, ...],
                 log: tuple[ToolCall, ...], extra: tuple[Layer, ...] = (), image: Path | None = None) -> None:
        self.handle = handle
        # None for a snapshot of files only; a frozen container for a bunshin snapshot
        self.container = container
        self.stack = stack  # layers it holds, topmost first
        self.log = log  # calls run since the task's root, in order
        self.extra = extra  # more layers it holds (those a frozen container still mounts)
        self.image = image  # a criu snapshot's checkpoint directory
        self.booted = False  # its processes were started afresh (create, a restart fork)
        self.largest = 0  # the most bytes of its own it held when measured (before and after calls)
        self.own: int | None = None  # its own bytes after its last call, while nothing forked it since


class _Cold:
    __slots__ = ("handle", "archive", "log")

    def __init__(self, handle: ColdSnapshot, archive: Path, log: tuple[ToolCall, ...]) -> None:
        self.handle = handle
        self.archive = archive
        self.log = log


class LiveBackend(Backend):
    """Real workspaces of one spec on this host (see the module docstring); root only.

    Use ``async with LiveBackend(spec) as backend:``, or call :meth:`aclose` when done.

    Args:
        spec: The workspace spec (:func:`bunshin_async.load_spec`).
        state: The state directory (default :class:`StateDir()`); a run starts by removing
            what dead controllers left in it.
        flatten_depth: Deepest layer stack kept as is; deeper ones are merged.
        memory_interval: Seconds a working-set measurement is reused (the page scanner reads
            every workspace's page tables, so it is not run after every operation).
        engine: ``restart``, ``bunshin`` (needs ``/dev/bunshin``, ABI 4) or ``criu`` (needs
            ``criu``); see the module docstring.

    Raises:
        ConfigError: Not root, an unknown engine, or what the engine needs is missing.
    """

    engine = "restart"

    def __init__(self, spec: WorkspaceSpec, *, state: StateDir | None = None, flatten_depth: int = 16,
                 memory_interval: float = 0.5, engine: str = "restart") -> None:
        if os.geteuid() != 0:
            raise ConfigError("live workspaces need root (namespaces, mounts and cgroups)")
        if engine not in ENGINES:
            raise ConfigError(f"unknown live engine {engine!r}; expected one of {', '.join(ENGINES)}")
        self.engine = engine
        self._dev = -1
        self._criu: _Criu | None = None
        if engine == "bunshin":
            self._dev = _open_device()
        elif engine == "criu":
            self._criu = _Criu.find()
        self.spec = spec
        self._state = state or StateDir()
        gc(self._state)
        self._run_id = f"live-{os.getpid()}-{id(self):x}"
        root = self._state.layer_dir(self._run_id)
        self._state.write(self._state.new_record(self._run_id + ".layer", kind="layer", state="running", dirs=[root]))
        self._layers = LayerStore(Path(root), flatten_depth=flatten_depth)
        self._ids = itertools.count()
        self._live: dict[int, _Handle] = {}
        self._cold: dict[int, _Cold] = {}
        self._boot_times: dict[str, float] = {}  # per task: its first workspace's boot time
        self._sizes: dict[str, list[int]] = {}  # per task: the largest own bytes of booted workspaces
        self._interval = memory_interval
        # the working set: the last measurement and when it was taken; after the first,
        # measurements run in a thread (see working_set)
        self._ws_value = 0
        self._ws_at = -math.inf
        self._ws_thread: threading.Thread | None = None
        self._ws_cost = 0.0  # seconds the last one took
        self._n = dict(creates=0, forks=0, snapshots=0, replayed=0, demotes=0, promotes=0, executions=0, failed=0)
        self._secs = dict(boot=0.0, fork=0.0, frozen=0.0, max_frozen=0.0, ioctl=0.0)
        self._tree_forks = 0
        self._closed = False

    async def __aenter__(self) -> LiveBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- helpers -----------------------------------------------------------------------------

    def _get(self, handle: Workspace) -> _Handle:
        st = self._live.get(handle.id)
        if st is None or handle.released:
            raise WorkspaceReleasedError(f"{handle!r} was already released")
        return st

    def _new(self, task: Task, container: Container | None, stack: tuple[Layer, ...], log: tuple[ToolCall, ...],
             *, frozen: bool, extra: tuple[Layer, ...] = (), image: Path | None = None) -> Workspace:
        ws = Workspace(task, next(self._ids), frozen)
        self._live[ws.id] = _Handle(ws, container, stack, log, extra, image)
        return ws

    async def _boot(self, task: Task, stack: tuple[Layer, ...]) -> Container:
        t0 = anyio.current_time()
        name = f"{_safe(task.id)}-{next(self._ids)}"
        try:
            c = await open_container(self.spec, layers=[str(layer.path) for layer in stack], name=name, state=self._state)
        except OSError as exc:  # fails this workspace's rollout only, as any backend error
            raise BackendError(f"could not make workspace {name} of task {task.id!r}: {exc}") from exc
        self._secs["boot"] += anyio.current_time() - t0
        return c

    def _stateful(self, call: ToolCall) -> bool:
        tool = self.spec.tools.get(call.name)
        return bool(tool is not None and tool.stateful)

    def task_profile(self, task_id: str) -> MemoryProfile | None:
        """The memory profile of *task_id*'s workspaces as measured, or None before one booted.

        ``runtime_bytes`` is the median, over the task's workspaces whose processes were started
        afresh (every workspace of the ``restart`` engine, the created ones otherwise), of the
        most memory of its own each held: pages its processes map and nothing outside them
        does (:meth:`_own_bytes`), measured at boot and around every call. A workspace grows
        as its first calls run (the agent's first command, a shell session), and the
        simulator's workspaces have a fixed size, so the size they reach is what the trace
        gives it. ``image_bytes`` is 0: the workspaces' files are the host's page cache (the
        root is read-only and shared), which their own bytes do not count. ``boot_time`` is
        the first workspace's."""
        if task_id not in self._sizes:
            return None
        # workspaces released so far, else those still live
        sizes = self._sizes[task_id] or [st.largest for st in self._live.values()
                                         if st.booted and st.handle.task.id == task_id]
        if not sizes:
            return None
        return MemoryProfile(image_bytes=0, runtime_bytes=int(statistics.median(sizes)),
                             boot_time=self._boot_times[task_id])

    def _note_size(self, st: _Handle, nbytes: int) -> None:
        st.largest = max(st.largest, nbytes)

    # -- Backend -----------------------------------------------------------------------------

    async def create(self, task: Task) -> Workspace:
        t0 = anyio.current_time()
        container = await self._boot(task, ())
        self._n["creates"] += 1
        self._boot_times.setdefault(task.id, anyio.current_time() - t0)
        ws = self._new(task, container, (), (), frozen=False)
        await self._booted(self._live[ws.id])
        return ws

    async def _booted(self, st: _Handle) -> None:
        st.booted = True
        self._note_size(st, await self._measure_own(st))
        self._sizes.setdefault(st.handle.task.id, [])

    async def freeze(self, workspace: Workspace) -> Workspace:
        st = self._get(workspace)
        if workspace.frozen:
            return workspace
        assert st.container is not None
        if self.engine == "bunshin":
            # the workspace itself, frozen, is the snapshot: its processes stay as they are
            c = st.container
            t0 = time.perf_counter()
            await c.freeze()
            try:
                stack = await anyio.to_thread.run_sync(self._layers.capture, Path(c.upper), st.stack)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await c.thaw()
                raise
            self._note_frozen(time.perf_counter() - t0)
            del self._live[workspace.id]
            workspace.released = True
            self._n["snapshots"] += 1
            return self._new(workspace.task, c, stack, st.log, frozen=True, extra=st.stack)
        if self.engine == "criu":
            snap = await self.snapshot(workspace)
            await self.release(workspace)
            return snap
        await st.container.freeze()
        kept = await st.container.destroy(keep_upper=True)
        if kept is None:
            raise BackendError(f"workspace {st.container.id}: its upper directory was not kept")
        stack = await anyio.to_thread.run_sync(self._adopt, kept, st.stack)
        self._layers.drop(st.stack)
        del self._live[workspace.id]
        workspace.released = True
        self._n["snapshots"] += 1
        return self._new(workspace.task, None, stack, st.log, frozen=True)

    def _adopt(self, kept: str, below: tuple[Layer, ...]) -> tuple[Layer, ...]:
        stack = self._layers.adopt(Path(kept), below)
        self._state.remove(self._state.layer_record(kept))  # the store's record covers it now
        return stack

    async def snapshot(self, workspace: Workspace) -> Workspace:
        st = self._get(workspace)
        st.own = None
        if workspace.frozen or st.container is None:
            raise BackendError(f"cannot snapshot {workspace!r}: it is already a snapshot; fork it")
        c = st.container
        if self.engine == "bunshin":
            shell = await self._shell(workspace.task)
            try:
                stack = await self._fork_frozen(c, shell, st.stack)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await shell.destroy()
                raise
            self._n["snapshots"] += 1
            return self._new(workspace.task, shell, stack, st.log, frozen=True)
        if self.engine == "criu":
            assert self._criu is not None
            await self._criu.prepare(c)  # the agent's channel where CRIU can dump it
            image = self._criu.new_image_dir(self._state, self._run_id)
            t0 = time.perf_counter()
            try:
                await c.freeze()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(remove_tree, str(image))
                raise
            try:
                stack = await anyio.to_thread.run_sync(self._layers.capture, Path(c.upper), st.stack)
                try:
                    await anyio.to_thread.run_sync(self._criu.dump, c, image)
                except BaseException:
                    self._layers.drop(stack)
                    raise
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(remove_tree, str(image))
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await c.thaw()
                self._note_frozen(time.perf_counter() - t0)
            self._n["snapshots"] += 1
            return self._new(workspace.task, None, stack, st.log, frozen=True, image=image)
        t0 = time.perf_counter()
        await c.freeze()
        try:
            stack = await anyio.to_thread.run_sync(self._layers.capture, Path(c.upper), st.stack)
        finally:
            with anyio.CancelScope(shield=True):
                await c.thaw()
            self._note_frozen(time.perf_counter() - t0)
        self._n["snapshots"] += 1
        return self._new(workspace.task, None, stack, st.log, frozen=True)

    def _note_frozen(self, seconds: float) -> None:
        self._secs["frozen"] += seconds
        self._secs["max_frozen"] = max(self._secs["max_frozen"], seconds)

    async def _shell(self, task: Task) -> Container:
        name = f"{_safe(task.id)}-{next(self._ids)}"
        try:
            return await open_shell(self.spec, name=name, state=self._state)
        except OSError as exc:
            raise BackendError(f"could not make workspace {name} of task {task.id!r}: {exc}") from exc

    async def _fork_frozen(self, source: Container, shell: Container, below: tuple[Layer, ...]) -> tuple[Layer, ...]:
        """Freeze the live *source*, copy its upper directory into a layer over *below*, mount
        *shell* on it and tree-fork *source* into it, then thaw *source*. Returns the held
        stack *shell* stands on; *shell* stays frozen."""
        t0 = time.perf_counter()
        await source.freeze()
        stack: tuple[Layer, ...] | None = None
        try:
            stack = await anyio.to_thread.run_sync(self._layers.capture, Path(source.upper), below)
            await mount_shell(shell, [str(layer.path) for layer in stack])
            self._secs["ioctl"] += await fork_tree_into(shell, source, self._dev)
        except BaseException:
            if stack is not None:
                self._layers.drop(stack)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await source.thaw()
            self._note_frozen(time.perf_counter() - t0)
        self._tree_forks += 1
        return stack

    async def fork(self, source: Workspace) -> Workspace:
        st = self._get(source)
        st.own = None
        if self.engine == "bunshin" and (not source.frozen or st.container is not None):
            return await self._tree_fork(st)
        if self.engine == "criu" and st.image is not None:
            return await self._restore(st)
        if not source.frozen:
            snap = await self.snapshot(source)
            try:
                return await self.fork(snap)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.release(snap)
        t0 = anyio.current_time()
        stack = self._layers.hold(st.stack)
        try:
            container = await self._boot(source.task, stack)
        except BaseException:
            self._layers.drop(stack)
            raise
        ws = self._new(source.task, container, stack, st.log, frozen=False)
        try:
            for call in st.log:
                if self._stateful(call):
                    await container.call(call)
                    self._n["replayed"] += 1
            await self._booted(self._live[ws.id])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.release(ws)
            raise
        self._n["forks"] += 1
        self._secs["fork"] += anyio.current_time() - t0
        return ws

    async def _tree_fork(self, st: _Handle) -> Workspace:
        """A ``bunshin`` fork: the processes of the snapshot (or of the live workspace, frozen
        meanwhile) tree-forked into a new shell on its layers with a fresh upper, thawed."""
        t0 = anyio.current_time()
        source = st.handle
        assert st.container is not None
        shell = await self._shell(source.task)
        try:
            if not source.frozen:
                stack = await self._fork_frozen(st.container, shell, st.stack)
            else:
                stack = self._layers.hold(st.stack)
                try:
                    await mount_shell(shell, [str(layer.path) for layer in stack])
                    self._secs["ioctl"] += await fork_tree_into(shell, st.container, self._dev)
                except BaseException:
                    self._layers.drop(stack)
                    raise
                self._tree_forks += 1
        except BaseException:
            with anyio.CancelScope(shield=True):
                await shell.destroy()
            raise
        ws = self._new(source.task, shell, stack, st.log, frozen=False)
        try:
            await start_forked(shell)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.release(ws)
            raise
        self._n["forks"] += 1
        self._secs["fork"] += anyio.current_time() - t0
        return ws

    async def _restore(self, st: _Handle) -> Workspace:
        """A ``criu`` fork: the snapshot's checkpoint restored into a new shell on its layers
        with a fresh upper."""
        assert self._criu is not None and st.image is not None
        t0 = anyio.current_time()
        shell = await self._shell(st.handle.task)
        stack = self._layers.hold(st.stack)
        ws = self._new(st.handle.task, shell, stack, st.log, frozen=False)
        try:
            await mount_shell(shell, [str(layer.path) for layer in stack], root_only=True)
            await self._criu.restore(st.image, shell)
            self._tree_forks += 1
            await start_forked(shell)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.release(ws)
            raise
        self._n["forks"] += 1
        self._secs["fork"] += anyio.current_time() - t0
        return ws

    async def execute(self, workspace: Workspace, call: ToolCall, context: CallContext) -> ToolResult:
        st = self._get(workspace)
        if workspace.frozen or st.container is None:
            raise BackendError(f"cannot execute {call.name!r} in {workspace!r}: it is a snapshot; fork it first")
        # between calls what a workspace alone maps changes only by its background processes
        # (their growth counts in the next call's) or by a fork or snapshot of it (its pages
        # become shared with the clone), which forgets the last measurement
        before = st.own if st.own is not None else await self._measure_own(st)
        t0 = anyio.current_time()
        res = await st.container.call(call)
        elapsed = anyio.current_time() - t0
        after = st.own = await self._measure_own(st)
        self._note_size(st, max(before, after))
        self._n["executions"] += 1
        if not res.ok:
            self._n["failed"] += 1
        st.log = (*st.log, call)
        out = observation_bytes(res)
        return ToolResult(
            observation_digest=observation_digest(out),
            observation_size=len(out),
            exec_time=elapsed,
            dirtied_bytes=max(0, after - before),
            output=out,
        )

    async def demote(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> ColdSnapshot:
        st = self._get(snapshot)
        if not snapshot.frozen:
            raise BackendError(f"cannot demote {snapshot!r}: only a snapshot can be demoted")
        if not st.stack:
            # nothing of its own on disk: an empty archive stands for "the root's state"
            archive = self._layers.root / "archives" / f"empty-{next(self._ids)}.tar"
            await anyio.to_thread.run_sync(_empty_archive, archive)
            size = archive.stat().st_size
        else:
            archive, size = await anyio.to_thread.run_sync(self._layers.archive, st.stack[0])
        cold = ColdSnapshot(snapshot.task, next(self._ids), size)
        self._cold[cold.id] = _Cold(cold, archive, st.log)
        self._n["demotes"] += 1
        await self.release(snapshot)
        return cold

    async def promote(self, cold: ColdSnapshot, parent: Workspace | None) -> Workspace:
        cs = self._cold.get(cold.id)
        if cs is None or cold.released:
            raise WorkspaceReleasedError(f"{cold!r} was already released")
        below = self._get(parent).stack if parent is not None else ()
        layer = await anyio.to_thread.run_sync(self._layers.restore, cs.archive)
        stack = self._layers.hold((layer, *below))
        self._n["promotes"] += 1
        return self._new(cold.task, None, stack, cs.log, frozen=True)

    async def release(self, handle: Workspace | ColdSnapshot) -> None:
        if isinstance(handle, ColdSnapshot):
            cs = self._cold.pop(handle.id, None)
            if cs is None or handle.released:
                raise WorkspaceReleasedError(f"{handle!r} was already released")
            handle.released = True
            cs.archive.unlink(missing_ok=True)
            return
        st = self._get(handle)
        del self._live[handle.id]
        handle.released = True
        if st.booted and not handle.frozen:
            self._sizes[handle.task.id].append(st.largest)
        with anyio.CancelScope(shield=True):
            try:
                if st.container is not None:
                    await st.container.destroy()
            finally:
                self._layers.drop(st.stack)
                self._layers.drop(st.extra)
                if st.image is not None:
                    await anyio.to_thread.run_sync(remove_tree, str(st.image))

    def snapshot_charge(self, workspace: Workspace, dirtied_bytes: int) -> int:
        if self.engine == "restart":
            return 0  # a restart snapshot is files on disk: its processes are gone
        st = self._live.get(workspace.id)
        c = st.container if st is not None else None
        if c is None or not c.alive:
            return dirtied_bytes
        if self.engine == "criu":
            return c.memory().anon  # the image is a copy of every anonymous page
        # copy-on-write: the pages the workspace dirtied, plus the snapshot's page tables
        return dirtied_bytes + _page_table_bytes(c.pids())

    def _pids(self, handles: Sequence[_Handle]) -> list[int]:
        pids: list[int] = []
        for st in handles:
            if st.container is not None and st.container.alive:
                pids.extend(st.container.pids())
        return pids

    def _scan(self, handles: Sequence[_Handle]):  # noqa: ANN202 - PageScan
        from ._bunshin_c import scan_pages

        for _ in range(3):  # a process may exit between listing and scanning
            pids = self._pids(handles)
            if not pids:
                return None
            try:
                return scan_pages(pids)
            except ProcessLookupError:
                continue
        return None

    async def _measure_own(self, st: _Handle) -> int:
        """:meth:`_own_bytes` in a worker thread (a scan takes about a millisecond or two; the
        scanner releases the GIL)."""
        return await anyio.to_thread.run_sync(self._own_bytes, st)

    def _own_bytes(self, st: _Handle) -> int:
        """Bytes of pages only this workspace's processes map (private and shared among them)."""
        scan = self._scan([st])
        return 0 if scan is None else (scan.private + scan.shared_inside) * scan.page_size

    def workspace_memory(self, workspace: Workspace) -> WorkspaceMemory:
        scan = self._scan([self._get(workspace)])
        if scan is None:
            return WorkspaceMemory(0, 0)
        return WorkspaceMemory(
            shared_bytes=scan.shared_outside * scan.page_size,
            private_bytes=(scan.private + scan.shared_inside) * scan.page_size,
        )

    def working_set(self) -> int:
        """Pages the processes of every live workspace and snapshot map and nothing else does,
        measured by the page scanner at most every ``memory_interval`` seconds, and no more
        often than every ``_SCAN_DUTY`` times the last scan's length (a scan over hundreds of
        workspaces takes a good part of a second; this keeps it to a quarter of one core). The
        first measurement is taken at once; later ones run in a thread and this returns the
        latest one finished, so a scan never blocks the event loop (the scanner releases the
        GIL). With nothing live it is 0."""
        if not self._live:
            return 0
        now = anyio.current_time()
        if self._ws_at == -math.inf:
            self._measure(list(self._live.values()), now)
        elif (now - self._ws_at >= max(self._interval, _SCAN_DUTY * self._ws_cost)
              and (self._ws_thread is None or not self._ws_thread.is_alive())):
            self._ws_thread = threading.Thread(
                target=self._measure, args=(list(self._live.values()), now), name="bunshin-working-set", daemon=True
            )
            self._ws_thread.start()
        return self._ws_value

    def _measure(self, handles: list[_Handle], at: float) -> None:
        t0 = time.perf_counter()
        try:
            scan = self._scan(handles)
        except (OSError, BackendError):  # a workspace went away mid-scan: keep the last value
            return
        finally:
            self._ws_cost = time.perf_counter() - t0
        self._ws_value = 0 if scan is None else (scan.private + scan.shared_inside) * scan.page_size
        self._ws_at = at

    def live_handles(self) -> int:
        return len(self._live) + len(self._cold)

    def statistics(self) -> LiveStatistics:
        """Counts and seconds of what the backend did."""
        n = self._n
        return LiveStatistics(
            creates=n["creates"], forks=n["forks"], snapshots=n["snapshots"], replayed_calls=n["replayed"],
            demotes=n["demotes"], promotes=n["promotes"], executions=n["executions"], failed_calls=n["failed"],
            flattens=self._layers.flattens, boot_seconds=self._secs["boot"], fork_seconds=self._secs["fork"],
            tree_forks=self._tree_forks, frozen_seconds=self._secs["frozen"],
            max_frozen_seconds=self._secs["max_frozen"], tree_fork_seconds=self._secs["ioctl"],
        )

    async def aclose(self) -> None:
        """Release every handle still held, then remove the layer directory and its record."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._ws_thread is not None:  # a measurement in flight: let it end first
                await anyio.to_thread.run_sync(self._ws_thread.join)
            for st in list(self._live.values()):
                await self.release(st.handle)
            for cs in list(self._cold.values()):
                await self.release(cs.handle)
            await anyio.to_thread.run_sync(remove_tree, str(self._layers.root))
            self._state.remove(self._run_id + ".layer")
            if self._criu is not None:
                await anyio.to_thread.run_sync(self._criu.close)
            if self._dev >= 0:
                os.close(self._dev)
                self._dev = -1


def observation_bytes(res: ExecResult) -> bytes:
    """What the policy is shown of a call: its output, then the exit status where it is not 0
    or the fact that it timed out."""
    out = bytes(res.stdout) + bytes(res.stderr)
    if res.timed_out:
        out += b"\n[timed out]"
    elif res.status != 0:
        out += f"\n[exit status {res.status}]".encode()
    if res.truncated:
        out += b"\n[output truncated]"
    return out


def _open_device() -> int:
    """Open /dev/bunshin and check it can fork a workspace (ABI 4: fd substitution)."""
    from . import _bunshin_c as c

    try:
        fd = os.open("/dev/bunshin", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"the bunshin engine needs the kernel module (/dev/bunshin: {exc.strerror}); load it, "
                          "or run in the lab VM: bunshin vm run --load-module -- ...") from None
    try:
        ver = c.bunshin_version(fd)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"/dev/bunshin does not answer BUNSHIN_IOC_VERSION: {exc}") from None
    if not ver.features & c.BUNSHIN_FEATURE_TREE_SUBST:
        os.close(fd)
        raise ConfigError(f"the bunshin module loaded (ABI {ver.abi_version}, features {ver.features:#x}) cannot fork a "
                          "workspace: it needs BUNSHIN_FEATURE_TREE_SUBST (ABI 4); load this checkout's module")
    return fd


def _page_table_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmPTE:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def _empty_archive(path: Path) -> None:
    import tarfile

    with tarfile.open(path, "w"):
        pass


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in text)[:40] or "task"


def demo_trace(spec: WorkspaceSpec, *, tasks: int = 2, group_size: int = 3, epochs: int = 2, seed: int = 0,
               think: float = 0.3, probe_dir: str = "/etc", probe_file: str = "/etc/os-release",
               pattern: str = "^ID=") -> Trace:
    """A small trace for the bundled workspace spec: each task opens with the same read-only
    calls (``ls``, ``cat``, ``search``: cacheable, so later samples skip them), then each
    sample writes and runs its own files. Observations and costs are not known before a live
    run, so they are marked modelled; think times are ``think`` seconds, jittered. The opening
    calls read *probe_dir*, *probe_file* and search it for *pattern*.

    Raises:
        ConfigError: If the spec lacks a tool the demo uses.
    """
    import random

    need = ("ls", "cat", "search", "write_file", "shell", "python")
    missing = [t for t in need if t not in spec.tools]
    if missing:
        raise ConfigError(f"the demo trace needs the tools {', '.join(need)}; {spec.path or spec.name} "
                          f"lacks {', '.join(missing)}; give a TRACE recorded for this spec")
    rng = random.Random(seed)
    empty = observation_digest(b"")
    modelled = ("exec_time", "observation_digest", "observation_size", "dirtied_bytes")

    def step(name: str, **args: object) -> Step:
        return Step(
            think_time=round(think * rng.uniform(0.5, 1.5), 3), call=ToolCall(name, args), exec_time=0.0,
            observation_digest=empty, observation_size=0, dirtied_bytes=0,
            cacheable=spec.tools[name].cacheable, modelled=modelled,
        )

    task_list = [Task(f"demo-{i}", MemoryProfile(0, 0, 0.0), f"inspect the system, then write and run script {i}")
                 for i in range(tasks)]
    rollouts = []
    for e in range(epochs):
        for t in task_list:
            for s in range(group_size):
                steps = [step("ls", path=probe_dir), step("cat", path=probe_file)]
                if rng.random() < 0.7:
                    steps.append(step("search", pattern=pattern, path=probe_file))
                n = rng.randint(2, 40)
                path = f"/root/{t.id}/main.py"
                steps.append(step("write_file", path=path, content=f"print(sum(range({n})))\n"))
                steps.append(step("shell", command=f"cd /root/{t.id} && export RUNS=$((RUNS+1))"))
                steps.append(step("python", code=f"exec(open({path!r}).read())"))
                steps.append(step("shell", command="echo runs=$RUNS in $(pwd)"))
                rollouts.append(Rollout(e, t.id, 0, s, reward=float(rng.random() < 0.5), steps=steps,
                                        final_think_time=round(think * rng.uniform(0.5, 1.5), 3)))
    return Trace(TRACE_VERSION, f"demo-{spec.name}", task_list, rollouts,
                 {"generator": "bunshin_async.demo_trace", "seed": seed, "spec": spec.name})


def live_trace(trace: Trace, result: RunResult, backend: LiveBackend) -> Trace:
    """The trace a live run recorded, in the format the simulator replays: the replayed
    think times, and for each call the measured execution time, observation digest and size
    and bytes dirtied (for a cache hit, those of the run that first executed the call);
    tasks carry the memory profile measured at their first boot. Cancelled rollouts are
    left out."""
    replayed = {r.key: r for r in trace.rollouts}
    tasks = [
        msgspec.structs.replace(t, memory=backend.task_profile(t.id) or t.memory) for t in trace.tasks
    ]
    rollouts = []
    for rr in result.rollouts:
        if rr.status != "done":
            continue
        src = replayed[rr.key]
        steps = []
        for rec, old in zip(rr.steps, src.steps, strict=True):
            tool = backend.spec.tools.get(rec.call.name)
            steps.append(Step(
                think_time=old.think_time, call=rec.call, exec_time=rec.result.exec_time,
                observation_digest=rec.result.observation_digest, observation_size=rec.result.observation_size,
                dirtied_bytes=rec.result.dirtied_bytes, cacheable=bool(tool and tool.cacheable),
                modelled=tuple(m for m in old.modelled if m == "think_time"),
            ))
        rollouts.append(msgspec.structs.replace(src, steps=steps))
    meta = dict(trace.meta)
    meta.update({"recorded_by": "bunshin run", "engine": backend.engine, "spec": backend.spec.name,
                 "source_trace": trace.name})
    return Trace(TRACE_VERSION, f"{trace.name}-live", tasks, rollouts, meta)
