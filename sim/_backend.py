"""The simulated backend: workspaces in virtual time, with exact page-level memory accounting.

:class:`SimBackend` implements :class:`bunshin_async.Backend` on top of two models: an engine
cost model (:class:`sim.EngineModel`), which says how long each operation takes and what it does
to memory, and a :class:`ToolModel`, built from a trace, which says what a tool call returns,
how long it runs and how much memory it writes. Every cost is charged with ``anyio.sleep``, so
under a virtual clock (trio's ``MockClock(autojump_threshold=0)``) a simulated epoch takes no
wall time, and the same trace and seed give the same results.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import anyio
import msgspec
import numpy as np

from bunshin_async._backend import (
    Backend,
    CallContext,
    ColdSnapshot,
    ToolResult,
    Workspace,
    WorkspaceMemory,
)
from bunshin_async._exceptions import BackendError, WorkspaceReleasedError
from bunshin_async._trace import RolloutKey, Step, Task, ToolCall, Trace, call_key, observation_digest

from ._engines import EngineModel, engine_model
from ._memory import PageModel

__all__ = ["SimBackend", "SimStatistics", "ToolModel", "ToolOutcome"]

_DEFAULT_EXEC_TIME = 1.0


# -- the tool-outcome oracle -----------------------------------------------------------------


class ToolOutcome(msgspec.Struct, frozen=True):
    """What :meth:`ToolModel.outcome_at` decided a call returns, and on what grounds."""

    result: ToolResult
    """The call's result."""
    source: str
    """``rollout``: the asking rollout's own recorded step; ``prefix``: another rollout of the
    task made the same call after the same history; ``model``: no recording matches, the
    result is modelled from the tool's medians."""


class _Medians(msgspec.Struct, frozen=True):
    exec_time: float
    dirtied_bytes: int
    observation_size: int


def _medians(steps: Sequence[Step]) -> _Medians:
    return _Medians(
        exec_time=float(np.median([s.exec_time for s in steps])),
        dirtied_bytes=int(round(float(np.median([s.dirtied_bytes for s in steps])))),
        observation_size=int(round(float(np.median([s.observation_size for s in steps])))),
    )


def _result(step: Step) -> ToolResult:
    return ToolResult(
        observation_digest=step.observation_digest,
        observation_size=step.observation_size,
        exec_time=step.exec_time,
        dirtied_bytes=step.dirtied_bytes,
    )


class ToolModel:
    """The outcome oracle: what a tool call returns in a simulated workspace, from a trace.

    A workspace's *path* is a hash of its task and of the canonical keys
    (:func:`bunshin_async.call_key`) of the calls executed in it since its task's root,
    extended one call at a time (:meth:`root`, :meth:`extend`), so a backend carries it per
    workspace and every lookup is O(1).

    Lookup order for a call after a history:

    1. the asking rollout's own recorded step at that position, if it made the same call after
       the same history;
    2. else the first recorded step (in trace order) of any rollout of the task that made the
       same call after exactly this history;
    3. else a modelled outcome: the medians of the tool's recorded steps in the task (else in
       the whole trace, else 1 s and 0 bytes) and a digest derived from the path.

    Args:
        trace: The trace to draw outcomes from.
    """

    def __init__(self, trace: Trace) -> None:
        self._rollouts: dict[RolloutKey, tuple[list[Step], list[bytes]]] = {}
        self._first: dict[bytes, Step] = {}
        per_task: dict[tuple[str, str], list[Step]] = {}
        per_tool: dict[str, list[Step]] = {}
        for r in trace.rollouts:
            path = self.root(r.task)
            paths = [path]
            for s in r.steps:
                path = self.extend(path, call_key(s.call))
                paths.append(path)
                self._first.setdefault(path, s)
                per_task.setdefault((r.task, s.call.name), []).append(s)
                per_tool.setdefault(s.call.name, []).append(s)
            self._rollouts[r.key] = (r.steps, paths)
        self._task_medians = {k: _medians(v) for k, v in per_task.items()}
        self._tool_medians = {k: _medians(v) for k, v in per_tool.items()}

    @staticmethod
    def root(task_id: str) -> bytes:
        """The path hash of *task_id*'s root workspace (no calls yet)."""
        return hashlib.blake2b(b"bunshin-path\0" + task_id.encode(), digest_size=16).digest()

    @staticmethod
    def extend(path: bytes, key: bytes) -> bytes:
        """The path hash after the call with canonical key *key* runs at *path*."""
        h = hashlib.blake2b(path, digest_size=16)
        h.update(len(key).to_bytes(8, "little"))
        h.update(key)
        return h.digest()

    def path_of(self, task_id: str, history: Sequence[bytes]) -> bytes:
        """The path hash of *task_id*'s workspace after the calls *history* (canonical keys)."""
        path = self.root(task_id)
        for key in history:
            path = self.extend(path, key)
        return path

    def outcome(self, task_id: str, history: Sequence[bytes], call: ToolCall, context: CallContext) -> ToolResult:
        """The result of *call* after the calls *history* (canonical keys) in a workspace of
        *task_id*, asked for by *context* (see the class docstring for the lookup order)."""
        path = self.path_of(task_id, history)
        return self.outcome_at(task_id, path, len(history), call, context).result

    def outcome_at(
        self,
        task_id: str,
        path: bytes,
        depth: int,
        call: ToolCall,
        context: CallContext,
        key: bytes | None = None,
    ) -> ToolOutcome:
        """Like :meth:`outcome`, for a workspace at path hash *path* after *depth* calls.

        Args:
            task_id: The workspace's task.
            path: The workspace's path hash (see :meth:`root` and :meth:`extend`).
            depth: How many calls the workspace has run since its task's root.
            call: The call.
            context: Who asks.
            key: ``call_key(call)``, if the caller already has it.
        """
        if key is None:
            key = call_key(call)
        after = self.extend(path, key)
        own = self._rollouts.get(context.rollout)
        if own is not None:
            steps, paths = own
            if depth < len(steps) and paths[depth + 1] == after:
                return ToolOutcome(_result(steps[depth]), "rollout")
        step = self._first.get(after)
        if step is not None:
            return ToolOutcome(_result(step), "prefix")
        med = self._task_medians.get((task_id, call.name)) or self._tool_medians.get(call.name)
        if med is None:
            med = _Medians(_DEFAULT_EXEC_TIME, 0, 0)
        result = ToolResult(
            observation_digest=observation_digest(after),
            observation_size=med.observation_size,
            exec_time=med.exec_time,
            dirtied_bytes=med.dirtied_bytes,
        )
        return ToolOutcome(result, "model")


# -- statistics ------------------------------------------------------------------------------


class SimStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What a :class:`SimBackend` did so far: operation counts and the seconds charged."""

    creates: int
    """Workspaces booted by :meth:`SimBackend.create`."""
    freezes: int
    """Workspaces turned into snapshots in place."""
    snapshots: int
    """Snapshots taken of live workspaces (which stay live)."""
    forks: int
    """Live workspaces forked from a snapshot or a live workspace."""
    executions: int
    """Tool calls executed."""
    demotes: int
    """Snapshots written out to the cold tier."""
    promotes: int
    """Snapshots rebuilt from the cold tier."""
    releases: int
    """Handles released (workspaces, snapshots, cold snapshots; consumed ones not counted)."""
    create_seconds: float
    """Seconds charged to creates (boots)."""
    freeze_seconds: float
    """Seconds charged to freezes."""
    snapshot_seconds: float
    """Seconds charged to snapshots."""
    fork_seconds: float
    """Seconds charged to forks (including restores and call-log replays)."""
    execution_seconds: float
    """Seconds charged to tool calls."""
    demote_seconds: float
    """Seconds charged to demotions."""
    promote_seconds: float
    """Seconds charged to promotions."""
    release_seconds: float
    """Seconds charged to releases."""
    recorded_outcomes: int
    """Executions whose result came from a recorded step (own rollout or same prefix)."""
    modelled_outcomes: int
    """Executions whose result was modelled (no recorded step after the same history)."""
    peak_working_set: int
    """The largest working set reached, in bytes."""


_KINDS = ("create", "freeze", "snapshot", "fork", "execution", "demote", "promote", "release")


# -- the backend -----------------------------------------------------------------------------


class _State:
    """What the backend keeps per live handle."""

    __slots__ = ("handle", "mapping", "labels", "overhead", "image_bytes", "path", "depth", "replay_time")

    def __init__(self, handle: Workspace, path: bytes, depth: int, replay_time: float) -> None:
        self.handle = handle
        self.mapping: int | None = None  # page-model mapping
        self.labels: np.ndarray | None = None  # content of a checkpoint image held in tmpfs
        self.overhead = 0  # private bytes outside the page model
        self.image_bytes = 0  # bytes of a checkpoint image held in tmpfs (0 for one on disk)
        self.path = path  # path hash (ToolModel)
        self.depth = depth  # calls since the task's root
        self.replay_time = replay_time  # sum of those calls' exec times


class _ColdState:
    __slots__ = ("handle", "labels", "positions", "path", "depth", "replay_time")

    def __init__(
        self,
        handle: ColdSnapshot,
        labels: np.ndarray | None,
        positions: np.ndarray,
        path: bytes,
        depth: int,
        replay_time: float,
    ) -> None:
        self.handle = handle
        self.labels = labels  # full content of the demoted snapshot; None: it held no memory
        self.positions = positions  # runtime positions stored (the delta)
        self.path = path
        self.depth = depth
        self.replay_time = replay_time


class SimBackend(Backend):
    """A :class:`Backend` in virtual time: engine cost models and an exact page model.

    Args:
        engine: The fork engine, by name (``bunshin``, ``criu``, ``microvm``, ``restart``,
            ``cold``) or as an :class:`EngineModel` (for a variant with other numbers).
        tools: The outcome oracle (see :class:`ToolModel`).
        page_size: Bytes per model page, the memory model's resolution (see
            :class:`PageModel`).
        seed: Seeds the one random generator (which pages a call dirties).

    Attributes:
        engine: The engine's name.
        model: The engine's cost model.
        tools: The outcome oracle.

    Raises:
        ConfigError: If *engine* names no engine.
    """

    def __init__(
        self, engine: str | EngineModel, tools: ToolModel, *, page_size: int = 1 << 20, seed: int = 0
    ) -> None:
        self.model = engine if isinstance(engine, EngineModel) else engine_model(engine)
        self.engine = self.model.name
        self.tools = tools
        self._pages = PageModel(page_size)
        self._rng = np.random.default_rng(seed)
        self._states: dict[int, _State] = {}
        self._colds: dict[int, _ColdState] = {}
        self._next_id = 0
        self._overhead_total = 0
        self._image_total = 0
        self._peak = 0
        self._counts = dict.fromkeys(_KINDS, 0)
        self._seconds = dict.fromkeys(_KINDS, 0.0)
        self._recorded = 0
        self._modelled = 0

    @property
    def pages(self) -> PageModel:
        """The page model (read it, do not change it)."""
        return self._pages

    # -- Backend ------------------------------------------------------------------------------

    async def create(self, task: Task) -> Workspace:
        m = self.model
        cost = task.memory.boot_time + m.vm_boot_time
        await self._charge("create", cost)
        st = self._new_workspace(task, False, ToolModel.root(task.id), 0, 0.0)
        self._map_fresh(st, shared_image=m.page_cache_image)
        self._set_overhead(st, self._live_overhead(st))
        self._account()
        return st.handle

    async def freeze(self, workspace: Workspace) -> Workspace:
        st = self._live(workspace, "freeze")
        m = self.model
        mapped = self._mapped_bytes(st)
        if self.engine == "bunshin":
            cost = m.freeze_time
        elif self.engine == "criu":
            cost = m.dump_time(self._anon_bytes(st))
        elif self.engine == "microvm":
            cost = m.vm_snapshot_time(mapped)
        else:  # restart, cold
            cost = m.freeze_time
        await self._charge("freeze", cost)
        st = self._live(workspace, "freeze")
        snap = self._new_workspace(workspace.task, True, st.path, st.depth, st.replay_time)
        if self.engine == "bunshin":  # the frozen process tree keeps its pages and page tables
            snap.mapping, st.mapping = st.mapping, None
            self._set_overhead(snap, st.overhead)
        elif self.engine == "criu":  # the dump becomes the image; the process is killed
            self._hold_image(snap, self._content(st))
        elif self.engine == "microvm":  # the guest memory file keeps the pages; the VM is gone
            snap.mapping, st.mapping = st.mapping, None
        self._discard(st)
        self._account()
        return snap.handle

    async def snapshot(self, workspace: Workspace) -> Workspace:
        st = self._live(workspace, "snapshot")
        m = self.model
        mapped = self._mapped_bytes(st)
        if self.engine == "bunshin":
            cost = m.fork_time(mapped)
        elif self.engine == "criu":
            cost = m.dump_time(self._anon_bytes(st))
        elif self.engine == "microvm":
            cost = m.vm_snapshot_time(mapped)
        else:
            cost = m.freeze_time
        await self._charge("snapshot", cost)
        st = self._live(workspace, "snapshot")
        snap = self._new_workspace(workspace.task, True, st.path, st.depth, st.replay_time)
        if self.engine == "bunshin":
            snap.mapping = self._pages.share(self._mapping(st))
            self._set_overhead(snap, m.overhead_bytes(mapped))
        elif self.engine == "criu":
            self._hold_image(snap, self._content(st))
        elif self.engine == "microvm":
            snap.mapping = self._pages.share(self._mapping(st))
        self._account()
        return snap.handle

    def snapshot_charge(self, workspace: Workspace, dirtied_bytes: int) -> int:
        st = self._live(workspace, "snapshot_charge")
        anon = self._anon_bytes(st)
        if self.engine == "bunshin":  # CoW pages it will keep, and its own page tables
            return min(dirtied_bytes, anon) + self.model.overhead_bytes(self._mapped_bytes(st))
        if self.engine == "microvm":  # CoW pages of the guest memory file
            return min(dirtied_bytes, anon)
        if self.engine == "criu":  # an image of all anonymous memory: in tmpfs, or on disk
            return anon if self.model.checkpoint_in_memory else 0
        return 0  # restart, cold: the snapshot holds no memory

    async def fork(self, source: Workspace) -> Workspace:
        st = self._state(source)
        await self._charge("fork", self._fork_cost(st))
        st = self._state(source)
        ws = self._new_workspace(source.task, False, st.path, st.depth, st.replay_time)
        self._fork_memory(st, ws)
        self._set_overhead(ws, self._live_overhead(ws))
        self._account()
        return ws.handle

    async def execute(self, workspace: Workspace, call: ToolCall, context: CallContext) -> ToolResult:
        st = self._state(workspace)
        if workspace.frozen:
            raise BackendError(f"cannot execute {call.name!r} in {workspace!r}: it is a frozen snapshot; fork it first")
        key = call_key(call)
        out = self.tools.outcome_at(workspace.task.id, st.path, st.depth, call, context, key)
        result = out.result
        await self._charge("execution", result.exec_time)
        st = self._state(workspace)
        if st.mapping is not None:
            self._pages.write(st.mapping, result.dirtied_bytes, self._rng)
        st.path = ToolModel.extend(st.path, key)
        st.depth += 1
        st.replay_time += result.exec_time
        if out.source == "model":
            self._modelled += 1
        else:
            self._recorded += 1
        self._account()
        return result

    async def demote(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> ColdSnapshot:
        st = self._state(snapshot)
        if not snapshot.frozen:
            raise BackendError(f"cannot demote {snapshot!r}: only a frozen snapshot can be demoted")
        parent_labels = self._parent_labels(snapshot, parent)
        content = self._content(st)
        if content is None:  # restart, cold: the snapshot holds no memory
            positions = np.zeros(0, dtype=np.int64)
            cost = self.model.tier_time
        else:
            positions = self._pages.delta(content, parent_labels)
            cost = self.model.disk_write_time(len(positions) * self._pages.page_size)
        await self._charge("demote", cost)
        st = self._state(snapshot)
        stored = len(positions) * self._pages.page_size
        cold = ColdSnapshot(snapshot.task, self._take_id(), stored)
        self._colds[cold.id] = _ColdState(cold, content, positions, st.path, st.depth, st.replay_time)
        self._discard(st)
        self._account()
        return cold

    async def promote(self, cold: ColdSnapshot, parent: Workspace | None) -> Workspace:
        cs = self._cold(cold)
        pst = None
        if parent is not None:
            pst = self._state(parent)
            if parent.task.id != cold.task.id:
                raise BackendError(f"cannot promote {cold!r} on {parent!r}: they belong to different tasks")
        m = self.model
        if cs.labels is None:
            cost = m.tier_time
        else:
            cost = (self._fork_cost(pst, of_snapshot=True) if pst is not None else 0.0) + m.disk_read_time(
                cold.stored_bytes
            )
        await self._charge("promote", cost)
        cs = self._cold(cold)
        if parent is not None:
            pst = self._state(parent)
        snap = self._new_workspace(cold.task, True, cs.path, cs.depth, cs.replay_time)
        if cs.labels is not None:
            labels = cs.labels
            if self.engine == "criu":
                self._hold_image(snap, labels.copy())
            else:
                if pst is not None and pst.mapping is not None:
                    snap.mapping = self._pages.patch(pst.mapping, cs.positions, labels[cs.positions])
                else:
                    img, rt = self._task_pages(cold.task)
                    snap.mapping = self._pages.create(
                        cold.task.id, img, rt, shared_image=m.page_cache_image, runtime_labels=labels[img:]
                    )
                if self.engine == "bunshin":
                    self._set_overhead(snap, m.overhead_bytes(self._mapped_bytes(snap)))
        self._account()
        return snap.handle

    async def release(self, handle: Workspace | ColdSnapshot) -> None:
        if isinstance(handle, ColdSnapshot):
            self._cold(handle)
            del self._colds[handle.id]
            handle.released = True
        else:
            self._discard(self._state(handle))
        self._counts["release"] += 1
        cost = self.model.release_time
        if cost > 0:  # the release is done already; a cancelled caller loses only the wait
            await anyio.sleep(cost)
            self._seconds["release"] += cost

    def workspace_memory(self, workspace: Workspace) -> WorkspaceMemory:
        st = self._state(workspace)
        shared = private = 0
        if st.mapping is not None:
            usage = self._pages.usage(st.mapping)
            shared, private = usage.shared_bytes, usage.private_bytes
        return WorkspaceMemory(shared_bytes=shared, private_bytes=private + st.overhead + st.image_bytes)

    def working_set(self) -> int:
        return self._pages.physical_bytes + self._overhead_total + self._image_total

    def live_handles(self) -> int:
        return len(self._states) + len(self._colds)

    def statistics(self) -> SimStatistics:
        """Counts of operations and the seconds charged to each kind so far."""
        c, s = self._counts, self._seconds
        return SimStatistics(
            creates=c["create"],
            freezes=c["freeze"],
            snapshots=c["snapshot"],
            forks=c["fork"],
            executions=c["execution"],
            demotes=c["demote"],
            promotes=c["promote"],
            releases=c["release"],
            create_seconds=s["create"],
            freeze_seconds=s["freeze"],
            snapshot_seconds=s["snapshot"],
            fork_seconds=s["fork"],
            execution_seconds=s["execution"],
            demote_seconds=s["demote"],
            promote_seconds=s["promote"],
            release_seconds=s["release"],
            recorded_outcomes=self._recorded,
            modelled_outcomes=self._modelled,
            peak_working_set=self._peak,
        )

    # -- costs and memory effects ------------------------------------------------------------

    def _fork_cost(self, st: _State, *, of_snapshot: bool | None = None) -> float:
        m = self.model
        frozen = st.handle.frozen if of_snapshot is None else of_snapshot
        if self.engine == "bunshin":
            return m.fork_time(self._mapped_bytes(st))
        if self.engine == "criu":
            anon = self._anon_bytes(st)
            return m.restore_time(anon) if frozen else m.dump_time(anon) + m.restore_time(anon)
        if self.engine == "microvm":
            if frozen:
                return m.restore_base
            return m.vm_snapshot_time(self._mapped_bytes(st)) + m.restore_base
        boot = st.handle.task.memory.boot_time
        if self.engine == "restart":
            return m.fork_base + boot * m.restart_boot_factor + st.replay_time
        return boot + st.replay_time  # cold

    def _fork_memory(self, src: _State, ws: _State) -> None:
        if self.engine in ("bunshin", "microvm"):
            ws.mapping = self._pages.share(self._mapping(src))
        elif self.engine == "criu":
            if src.mapping is not None:
                ws.mapping = self._pages.private_copy(src.mapping, src.handle.task.id)
            else:
                img, rt = self._task_pages(src.handle.task)
                labels = self._content(src)
                assert labels is not None
                ws.mapping = self._pages.create(src.handle.task.id, img, rt, runtime_labels=labels[img:])
        else:  # restart, cold: processes rebuilt, runtime pages private
            self._map_fresh(ws, shared_image=True)

    def _map_fresh(self, st: _State, *, shared_image: bool) -> None:
        img, rt = self._task_pages(st.handle.task)
        st.mapping = self._pages.create(st.handle.task.id, img, rt, shared_image=shared_image)

    def _live_overhead(self, st: _State) -> int:
        return self.model.overhead_bytes(self._mapped_bytes(st))

    def _task_pages(self, task: Task) -> tuple[int, int]:
        return self._pages.pages(task.memory.image_bytes), self._pages.pages(task.memory.runtime_bytes)

    def _mapped_bytes(self, st: _State) -> int:
        img, rt = self._task_pages(st.handle.task)
        return (img + rt) * self._pages.page_size

    def _anon_bytes(self, st: _State) -> int:
        return self._task_pages(st.handle.task)[1] * self._pages.page_size

    def _content(self, st: _State) -> np.ndarray | None:
        if st.mapping is not None:
            return self._pages.labels(st.mapping)
        return None if st.labels is None else st.labels.copy()

    def _parent_labels(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> np.ndarray | None:
        if parent is None:
            return None
        if parent.task.id != snapshot.task.id:
            raise BackendError(f"cannot demote {snapshot!r} against {parent!r}: they belong to different tasks")
        if isinstance(parent, ColdSnapshot):
            return self._cold(parent).labels
        return self._content(self._state(parent))

    def _hold_image(self, st: _State, labels: np.ndarray | None) -> None:
        """Make *st* a checkpoint image with content *labels*: in tmpfs (its bytes count in the
        working set) or on disk (they do not), as the engine keeps its images."""
        st.labels = labels
        st.image_bytes = self._anon_bytes(st) if self.model.checkpoint_in_memory else 0
        self._image_total += st.image_bytes

    def _set_overhead(self, st: _State, nbytes: int) -> None:
        self._overhead_total += nbytes - st.overhead
        st.overhead = nbytes

    # -- handles -----------------------------------------------------------------------------

    def _take_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _new_workspace(self, task: Task, frozen: bool, path: bytes, depth: int, replay_time: float) -> _State:
        ws = Workspace(task, self._take_id(), frozen)
        st = _State(ws, path, depth, replay_time)
        self._states[ws.id] = st
        return st

    def _discard(self, st: _State) -> None:
        """Free everything *st* holds and mark its handle released."""
        if st.mapping is not None:
            self._pages.drop(st.mapping)
            st.mapping = None
        self._set_overhead(st, 0)
        self._image_total -= st.image_bytes
        st.image_bytes = 0
        st.labels = None
        del self._states[st.handle.id]
        st.handle.released = True

    def _state(self, handle: Workspace) -> _State:
        if not isinstance(handle, Workspace):
            raise BackendError(f"expected a workspace or snapshot handle, got {handle!r}")
        st = self._states.get(handle.id)
        if st is None or st.handle is not handle:
            if handle.released:
                raise WorkspaceReleasedError(f"{handle!r} was already released (or consumed by freeze or demote)")
            raise BackendError(f"{handle!r} was not made by this backend")
        return st

    def _live(self, handle: Workspace, op: str) -> _State:
        st = self._state(handle)
        if handle.frozen:
            raise BackendError(f"cannot {op} {handle!r}: it is already a frozen snapshot")
        return st

    def _cold(self, handle: ColdSnapshot) -> _ColdState:
        cs = self._colds.get(handle.id)
        if cs is None or cs.handle is not handle:
            if handle.released:
                raise WorkspaceReleasedError(f"{handle!r} was already released")
            raise BackendError(f"{handle!r} was not made by this backend")
        return cs

    def _mapping(self, st: _State) -> int:
        if st.mapping is None:
            raise BackendError(f"{st.handle!r} holds no memory to fork from")
        return st.mapping

    async def _charge(self, kind: str, cost: float) -> None:
        await anyio.sleep(cost)
        self._counts[kind] += 1
        self._seconds[kind] += cost

    def _account(self) -> None:
        ws = self.working_set()
        if ws > self._peak:
            self._peak = ws
