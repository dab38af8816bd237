"""The Backend interface: what the scheduler asks of a world of workspaces.

A backend creates, freezes, snapshots, forks, runs tool calls in, measures and releases
workspaces. The scheduler never touches a workspace any other way, so the same scheduler runs
against the simulator (:class:`sim.SimBackend`) and against real containers.

Vocabulary:

- a *workspace* is a live, writable environment (a container): tool calls run in it;
- a *snapshot* is a frozen workspace: nothing runs in it, it only serves as the source of
  forks; a hot prefix-tree node holds one;
- a *cold snapshot* is a snapshot's delta against its parent, written out of memory (to disk);
  it is brought back with :meth:`Backend.promote` on top of its parent's snapshot.

Every handle a backend returns must be given back to :meth:`Backend.release` exactly once;
:meth:`Backend.live_handles` counts those not yet released, so a run can prove it left nothing
behind.
"""

from __future__ import annotations

import abc
from typing import Literal

import msgspec

from ._trace import RolloutKey, Task, ToolCall

__all__ = [
    "Backend",
    "Workspace",
    "ColdSnapshot",
    "CallContext",
    "ToolResult",
    "WorkspaceMemory",
]


class Workspace:
    """A handle on a live workspace or a (hot) snapshot, owned by the backend that made it.

    Attributes:
        task: The task whose workspace this is.
        id: Unique among the backend's handles.
        frozen: True for a snapshot (nothing may run in it), False for a live workspace.
        released: True once :meth:`Backend.release` was called on it.
    """

    __slots__ = ("task", "id", "frozen", "released", "__weakref__")

    def __init__(self, task: Task, id: int, frozen: bool = False) -> None:
        self.task = task
        self.id = id
        self.frozen = frozen
        self.released = False

    def __repr__(self) -> str:
        kind = "snapshot" if self.frozen else "workspace"
        gone = " released" if self.released else ""
        return f"<{kind} {self.id} of task {self.task.id!r}{gone}>"


class ColdSnapshot:
    """A handle on a snapshot's delta written out of memory.

    Attributes:
        task: The task whose workspace this is.
        id: Unique among the backend's handles.
        stored_bytes: How much the delta takes where it is stored.
        released: True once :meth:`Backend.release` was called on it.
    """

    __slots__ = ("task", "id", "stored_bytes", "released", "__weakref__")

    def __init__(self, task: Task, id: int, stored_bytes: int) -> None:
        self.task = task
        self.id = id
        self.stored_bytes = stored_bytes
        self.released = False

    def __repr__(self) -> str:
        return f"<cold snapshot {self.id} of task {self.task.id!r}, {self.stored_bytes} bytes>"


class CallContext(msgspec.Struct, frozen=True):
    """Why a tool call runs: which rollout asked for it, at which step, for what purpose."""

    rollout: RolloutKey
    """The rollout the call belongs to."""
    step: int
    """Index of the call in that rollout's trajectory."""
    purpose: Literal["sample", "speculate", "replay"] = "sample"
    """``sample``: the policy asked for it; ``speculate``: a predicted call run ahead of the
    policy; ``replay``: rebuilding an evicted prefix-tree node."""


class ToolResult(msgspec.Struct, frozen=True):
    """What a tool call returned and what it cost."""

    observation_digest: str
    """Digest of the observation (see :func:`bunshin_async.observation_digest`)."""
    observation_size: int
    """Size of the observation in bytes."""
    exec_time: float
    """Seconds the call ran."""
    dirtied_bytes: int
    """Bytes of workspace memory the call wrote."""
    output: bytes | None = None
    """The observation itself where the backend has it (a live backend), else None."""


class WorkspaceMemory(msgspec.Struct, frozen=True):
    """A workspace's resident memory, split by whether another workspace maps the same pages."""

    shared_bytes: int
    """Bytes mapped by this workspace and at least one other live workspace or snapshot."""
    private_bytes: int
    """Bytes mapped by this workspace alone (including per-workspace overheads such as page
    tables or a guest kernel)."""


class Backend(abc.ABC):
    """The operations the scheduler needs from a world of workspaces.

    All methods that take time are async and take it through anyio, so a simulated backend
    can charge costs in virtual time. Methods raise :class:`BackendError` on failure.
    """

    engine: str
    """The fork engine: ``bunshin``, ``criu``, ``microvm``, ``restart`` or ``cold``."""

    @abc.abstractmethod
    async def create(self, task: Task) -> Workspace:
        """Boot and initialise a fresh live workspace for *task*."""

    @abc.abstractmethod
    async def freeze(self, workspace: Workspace) -> Workspace:
        """Turn the live *workspace* into a snapshot in place and return it.

        The handle passed in is consumed (the returned one replaces it), so nothing is copied.
        """

    @abc.abstractmethod
    async def snapshot(self, workspace: Workspace) -> Workspace:
        """Return a snapshot of the live *workspace* as it is now; *workspace* stays live."""

    @abc.abstractmethod
    async def fork(self, source: Workspace) -> Workspace:
        """Return a new live workspace in the state of *source* (a snapshot or a live one)."""

    @abc.abstractmethod
    async def execute(self, workspace: Workspace, call: ToolCall, context: CallContext) -> ToolResult:
        """Run *call* in the live *workspace* and return its result."""

    @abc.abstractmethod
    async def demote(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> ColdSnapshot:
        """Write *snapshot*'s delta against *parent* (None: against nothing) out of memory.

        *snapshot* is consumed: it is released once the delta is stored.
        """

    @abc.abstractmethod
    async def promote(self, cold: ColdSnapshot, parent: Workspace | None) -> Workspace:
        """Rebuild a snapshot from *cold* on top of the snapshot *parent* (the state the delta
        was taken against; None when it was taken against nothing). *cold* stays stored."""

    @abc.abstractmethod
    async def release(self, handle: Workspace | ColdSnapshot) -> None:
        """Destroy *handle*'s workspace, snapshot or stored delta and free what it held.

        Releasing the same handle twice raises :class:`WorkspaceReleasedError`. Must complete
        even when the caller is being cancelled (callers shield it).
        """

    @abc.abstractmethod
    def snapshot_charge(self, workspace: Workspace, dirtied_bytes: int) -> int:
        """At most how many bytes a snapshot of the live *workspace* would hold that its
        parent snapshot does not, given the workspace wrote *dirtied_bytes* since it was in
        the parent's state: the dirtied pages for a copy-on-write engine (plus the snapshot's
        own page tables), the whole image for an engine that copies memory out, nothing for
        one whose snapshots hold no memory. The prefix tree charges this to its hot tier."""

    @abc.abstractmethod
    def workspace_memory(self, workspace: Workspace) -> WorkspaceMemory:
        """Shared and private bytes of *workspace* now."""

    @abc.abstractmethod
    def working_set(self) -> int:
        """Bytes of memory everything this backend holds occupies now (each physical page
        once), including in-memory checkpoint images and per-workspace overheads."""

    @abc.abstractmethod
    def live_handles(self) -> int:
        """How many workspaces, snapshots and cold snapshots are not yet released."""

    async def aclose(self) -> None:
        """Release whatever the backend itself holds. The default does nothing."""
