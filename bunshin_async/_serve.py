"""The rollout service (``bunshin serve``): workspaces behind an HTTP API, in environment and agent mode.

A trainer registers a task (set-up calls run once in the task's root workspace), opens a group
of G sessions forked from it, steps each session with tool calls and gets the observations
back, and closes the sessions with their rewards. Underneath, each group is one run of the
ordinary :class:`~bunshin_async.Scheduler` (a plan of one step holding one group of G samples)
whose policy is an :class:`ExternalPolicy`: ``act`` hands the sample's latest observation to
the HTTP request that asked for it and waits for the session's next step or close. The time
between a step's response and the next step request is the model's think time, during which
the scheduler speculates, exactly as in a simulated run. All groups share one backend and one
:class:`~bunshin_async.PrefixTree`, so prefix caching works across groups of a task, and one
:class:`~bunshin_async.HistorySelector` per task, so speculation learns from every finished
session of the task.

Limits: at most ``max_workspaces`` sessions are open at once (each holds at most one workspace
of its own; speculative branches start only while fewer than ``max_workspaces`` workspaces are
live) and, where ``max_bytes`` is set, a group opens only while the backend's working set is
below it. A group that does not fit waits up to the wait its request gives, then is refused
(:class:`~bunshin_async.CapacityError`: 429 or 503 with ``Retry-After``). A session idle for
longer than ``idle_timeout`` is expired and its workspace released; a client that disconnects
mid-step fails its session only; a backend failure fails the sessions it hit only. Closing
the service ends every session and releases every workspace and snapshot.

Agent mode (:meth:`Service.start_run`): the service drives the agent loop itself. A run is
one group like the above whose policy asks an OpenAI-compatible endpoint for each call (a
:class:`~bunshin_async.ChatPolicy`), records every served call with its observation and
``served_by``, and ends each trajectory with the environment verifier's reward (a call run in
the trajectory's workspace whose output ends in a number) or a reward the client fixed, said
so in the result. Its progress is a stream of events; a model failure fails its trajectory
only; cancelling a run releases everything it holds.

The HTTP layer is a Litestar app (:func:`create_app`, request and response bodies are msgspec
structs; the OpenAPI document is at ``/schema/openapi.json``) served by uvicorn in-process
(:func:`open_http_server`). The API is described in ``docs/serve.md``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal

import anyio
import msgspec
from anyio.abc import TaskGroup

from ._backend import (
    Backend,
    CallContext,
    ColdSnapshot,
    ToolResult,
    Workspace,
    WorkspaceMemory,
)
from ._exceptions import (
    BackendError,
    BunshinError,
    CapacityError,
    ConfigError,
    ModelError,
    NotFoundError,
    StateConflictError,
)
from ._plugins import (
    CacheableTools,
    SpecContext,
    SpeculationPolicy,
    TailBenefitSpeculation,
)
from ._metrics import RolloutMetrics
from ._openai import ChatModel, ChatPolicy
from ._policy import Finish, Observation, Policy, SampleView
from ._scheduler import (
    RolloutResult,
    Scheduler,
    SchedulerConfig,
    StepRecord,
    TrainingPlan,
)
from ._selector import HistorySelector, Prediction
from ._spec import WorkspaceSpec, _fields, render_call
from ._trace import MemoryProfile, RolloutKey, Task, ToolCall
from ._tree import PrefixTree, open_prefix_tree

__all__ = [
    "ServeConfig",
    "Service",
    "ServiceStatistics",
    "ExternalPolicy",
    "HTTPServer",
    "open_service",
    "create_app",
    "open_http_server",
    "tools_from_spec",
]

API_PREFIX = "/v1"
"""Every endpoint of the API is under this path."""

_NDJSON = "application/x-ndjson"  # the media type of a run's event stream

_SETUP_GROUP = -1  # the RolloutKey group (and sample) of a task's set-up calls


# -- configuration ----------------------------------------------------------------------------


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the service limits and schedules its sessions. Every field has a default."""

    max_workspaces: int = 64
    """Sessions open at once, over all groups; each holds at most one workspace of its own."""
    max_bytes: int | None = None
    """A group opens only while the backend's working set is below this many bytes (None: no
    limit). Speculation also stops above it."""
    idle_timeout: float = 600.0
    """Seconds a session may wait for its next step or close; then it is expired and its
    workspace released."""
    max_wait: float = 300.0
    """The longest an open-group request may wait for capacity, whatever it asks."""
    retry_after: float = 1.0
    """Seconds suggested in the ``Retry-After`` header of a refused request."""
    keep_ended: int = 1024
    """Ended groups whose sessions stay queryable; older ones are forgotten (404)."""
    scheduler: SchedulerConfig | None = None
    """The scheduler options of every group run (None: :meth:`default_scheduler`);
    ``batch_tasks``, ``group_size``, ``mode`` and ``max_concurrent`` are set per group."""
    journal: str | None = None
    """A file where the service keeps the ids of its open sessions and agent runs (rewritten
    atomically as they open and end). A service started on the journal a killed one left
    reports those as lost: ``GET /v1/sessions/{id}`` answers ``failed`` with the reason, a step
    or close on them is 409, and ``/v1/stats`` counts them. None keeps no journal."""

    @staticmethod
    def default_scheduler() -> SchedulerConfig:
        """Caching and speculation on; speculation for every session (``spec_tail=1``), since
        an external trainer's groups have no step tail the scheduler could see."""
        return SchedulerConfig.preset("full", spec_tail=1.0)

    def check(self) -> None:
        """Raise :class:`ConfigError` if a field is out of range."""
        def bad(name: str, want: str) -> ConfigError:
            return ConfigError(f"serve option {name}={getattr(self, name)!r} is invalid; expected {want}")

        if self.max_workspaces < 1:
            raise bad("max_workspaces", "an integer >= 1")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise bad("max_bytes", "bytes >= 1 or None")
        if not self.idle_timeout > 0:
            raise bad("idle_timeout", "seconds > 0")
        if self.max_wait < 0:
            raise bad("max_wait", "seconds >= 0")
        if self.retry_after < 0:
            raise bad("retry_after", "seconds >= 0")
        if self.keep_ended < 0:
            raise bad("keep_ended", "an integer >= 0")
        if self.scheduler is not None:
            self.scheduler.check()


# -- request and response bodies ----------------------------------------------------------------

TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                     description="letters, digits, '.', '_' and '-', at most 128")]
SessionStatus = Literal["starting", "ready", "stepping", "closing", "closed", "failed", "expired"]


class TaskRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Register a task: ``POST /v1/tasks``."""

    id: TaskId
    """The task's id, unique in the service."""
    description: str = ""
    """What the task asks (kept for the client; the service does not read it)."""
    setup: list[ToolCall] = []
    """Calls run, in order, in the task's root workspace when it boots; every session of the
    task starts from the state they leave."""
    cacheable: list[str] | None = None
    """Tools whose calls may be served from the prefix tree and speculated; None takes the
    backend's marks (the workspace spec's ``cacheable`` tools, or in simulation the tools the
    trace marks cacheable)."""


class ObservationBody(msgspec.Struct, frozen=True):
    """What a call returned."""

    digest: str
    """The observation's digest (``sha256:`` and 16 hex digits)."""
    size: int
    """Its size in bytes."""
    output: str | None = None
    """The observation as text (UTF-8, undecodable bytes replaced); None where the backend
    keeps no output (the simulator)."""


class TaskInfo(msgspec.Struct, frozen=True):
    """A registered task."""

    id: str
    description: str
    setup: list[ToolCall]
    """Its set-up calls."""
    cacheable: list[str]
    """The tools whose calls are cached and speculated."""
    setup_observations: list[ObservationBody]
    """What the set-up calls returned the last time the task's root booted (empty before
    the first group opens)."""
    open_groups: list[str]
    """Ids of its groups still running."""
    open_runs: list[str] = []
    """Ids of its agent-mode runs still running."""


class GroupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Open a group of sessions: ``POST /v1/tasks/{task_id}/groups``."""

    size: Annotated[int, msgspec.Meta(ge=1, description="sessions in the group, G")]
    """Sessions in the group (G)."""
    wait: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Seconds to wait for capacity before the request is refused (capped by the service's
    ``max_wait``); 0 refuses at once."""


class GroupInfo(msgspec.Struct, frozen=True):
    """A group of sessions."""

    id: str
    task: str
    size: int
    sessions: list[str]
    """Its sessions' ids, in sample order."""
    status: Literal["running", "ended"]
    """``running`` while one of its sessions is open."""
    error: str | None = None
    """Why the group's run failed as a whole (its root workspace could not be made), if it did."""


class StepRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Step a session: ``POST /v1/sessions/{session_id}/step``."""

    call: ToolCall
    """The tool call to run."""


class StepTimings(msgspec.Struct, frozen=True):
    """When a step happened, in seconds."""

    issued: float
    """When the call reached the scheduler, since the group opened."""
    served: float
    """When its observation was ready, since the group opened."""
    exec_time: float
    """How long the tool ran (for a cache hit, when it first ran)."""
    wait: float
    """How long this request waited for its response, in the service."""
    think: float | None
    """Time from the previous step's response to this request (the model's think time, during
    which the service speculated); None for the first step."""


class StepResponse(msgspec.Struct, frozen=True):
    """The observation of a step."""

    session: str
    step: int
    """The step's index in the session (0 for the first call)."""
    call: ToolCall
    observation: ObservationBody
    served_by: Literal["executed", "cache", "speculation"]
    """``executed`` in the session's workspace, ``cache`` from the prefix tree (the call was
    skipped), ``speculation`` from a speculative branch that ran it while the model thought."""
    timings: StepTimings


class CloseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Close a session: ``POST /v1/sessions/{session_id}/close``."""

    reward: float | None = None
    """The trajectory's reward; None closes it without one (the scheduler records 0)."""


class SessionInfo(msgspec.Struct, frozen=True):
    """A session and how it went."""

    id: str
    group: str
    task: str
    rollout: str
    """Its rollout key in the scheduler (``e0/TASK/gN/sI``)."""
    status: SessionStatus
    """``starting`` (its workspace is being prepared; steps are queued), ``ready`` (waiting
    for a step or close), ``stepping``, ``closing``, then one of ``closed`` (by a close
    request or with its group), ``failed`` (see ``reason``) or ``expired`` (idle too long)."""
    steps: int
    """Calls served so far."""
    served_by: dict[str, int]
    """How many calls were ``executed``, served from the ``cache`` or from ``speculation``."""
    reward: float | None = None
    """The reward given at close."""
    reason: str | None = None
    """Why the session ended, unless it was closed with a reward."""


class _JournalSession(msgspec.Struct, frozen=True, array_like=True):
    group: str
    task: str
    rollout: str


class _Journal(msgspec.Struct, frozen=True):
    """What :attr:`ServeConfig.journal` holds: the service's open sessions and runs."""

    pid: int
    next_group: int
    sessions: dict[str, _JournalSession]
    runs: list[str]


class LimitsInfo(msgspec.Struct, frozen=True):
    """The service's limits."""

    max_workspaces: int
    max_bytes: int | None
    idle_timeout: float
    max_wait: float


class ServiceStatistics(msgspec.Struct, frozen=True):
    """What the service holds and did so far."""

    tasks: int
    """Registered tasks."""
    groups_open: int
    """Groups with a session still open."""
    sessions_open: int
    """Sessions and agent-mode trajectories not yet ended (counted against ``max_workspaces``)."""
    sessions_ended: dict[str, int]
    """Ended sessions by final status (``closed``, ``failed``, ``expired``)."""
    steps: dict[str, int]
    """Steps served, by how (``executed``, ``cache``, ``speculation``)."""
    refused: int
    """Open-group and agent-run requests refused for capacity."""
    live_workspaces: int
    """Live (not frozen) workspaces the backend holds now, speculative branches included."""
    live_handles: int
    """Workspaces, snapshots and cold snapshots the backend holds now (the prefix tree's
    snapshots included)."""
    working_set: int
    """Bytes of memory the backend's workspaces occupy now (as the backend measures it)."""
    engine: str
    """The backend's fork engine."""
    limits: LimitsInfo
    runs_open: int = 0
    """Agent-mode runs still running."""
    trajectories_ended: dict[str, int] = {}
    """Agent-mode trajectories ended, by status (``done``, ``failed``, ``cancelled``)."""
    lost: int = 0
    """Sessions and agent runs a previous, killed service left open (see
    :attr:`ServeConfig.journal`)."""


# -- agent mode: request, response and event bodies ---------------------------------------------


class VerifierReward(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="verifier", tag_field="kind"):
    """The reward is the environment verifier's: after the model's final answer, *call* runs in
    the trajectory's own workspace (so it sees the state the agent left), and the last non-empty
    line of its output must parse as a finite number. Anything else fails the trajectory; no
    reward is ever made up."""

    call: ToolCall
    """The verifier call, a tool of the workspace (with a live spec it is checked against it)."""
    answer_argument: str | None = None
    """An argument of *call* set to the model's final text (``""`` when the trajectory was cut
    at ``max_steps``); None runs *call* as given."""


class FixedReward(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="fixed", tag_field="kind"):
    """Every finished trajectory gets *value*, as the client says. The result says so
    (``reward_source: "fixed"``): for a client that scores the trajectories itself, from their
    ``answer`` and steps."""

    value: float
    """The reward of every finished trajectory."""


class RunRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Start an agent-mode run of a task: ``POST /v1/tasks/{task_id}/runs``."""

    model: ChatModel
    """The OpenAI-compatible endpoint and its sampling settings (``base_url``, ``model``,
    ``api_key``, ``temperature``, ``max_tokens``, ``timeout``, ``retries``, ...). When
    ``api_key`` is null no key is sent: the service never forwards a key of its own."""
    reward: VerifierReward | FixedReward
    """How each finished trajectory's reward is computed: ``{"kind": "verifier", "call": ...}``
    or ``{"kind": "fixed", "value": ...}``."""
    size: Annotated[int, msgspec.Meta(ge=1, description="trajectories in the group, G")]
    """Trajectories in the group (G), each in a session forked from the task's root."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools offered to the model; None derives them from the workspace spec's
    tools (the verifier's tool left out), and is refused where the service has no spec."""
    system_prompt: str = ""
    """The system message (left out when empty); the user message is the task's description."""
    max_steps: Annotated[int, msgspec.Meta(ge=1)] = 32
    """Most tool calls per trajectory; a trajectory reaching it is cut (``truncated``) and
    rewarded as if the model had answered ``""``."""
    wait: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Seconds to wait for capacity before the request is refused, as for a group."""
    seed: int = 0
    """Seeds the model client's retry jitter."""
    stream: bool = True
    """Answer with the run's event stream (newline-delimited JSON); false answers with the run
    at once (its events are at ``GET /v1/runs/{id}/events``)."""


ServedBy = Literal["executed", "cache", "speculation"]
TrajectoryStatus = Literal["running", "done", "failed", "cancelled"]


class AgentStep(msgspec.Struct, frozen=True):
    """One served call of an agent-mode trajectory."""

    step: int
    """Its index in the trajectory (0 for the first call)."""
    call: ToolCall
    observation: ObservationBody
    served_by: ServedBy
    """``executed``, ``cache`` (from the prefix tree) or ``speculation`` (from a branch that ran
    it while the model was thinking)."""
    issued: float
    """When the model's call reached the scheduler, in seconds since the run started."""
    served: float
    """When its observation was ready, likewise."""
    exec_time: float
    """How long the tool ran (for a cache hit, when it first ran)."""
    think: float
    """Seconds from the previous observation (or the run's start) to this call: the model's
    latency, during which the service speculated."""


class TrajectoryInfo(msgspec.Struct, frozen=True):
    """One trajectory of an agent-mode run."""

    sample: int
    """Its index in the group."""
    rollout: str
    """Its rollout key in the scheduler (``e0/TASK/gN/sI``)."""
    status: TrajectoryStatus
    """``running``, then ``done``, ``failed`` (``error`` says why) or ``cancelled``."""
    steps: list[AgentStep]
    """The model's calls and their observations, in order (the verifier's call is not one)."""
    served_by: dict[str, int]
    """How many of ``steps`` were ``executed``, from the ``cache`` or from ``speculation``."""
    answer: str | None
    """The model's final text (null while running, when it failed, or when it was cut)."""
    truncated: bool
    """It reached ``max_steps`` and was cut."""
    reward: float | None
    """Its reward once ``done``; null otherwise."""
    reward_source: Literal["verifier", "fixed"]
    """Where the reward comes from: the verifier call's output, or the value the client fixed."""
    verifier: AgentStep | None
    """The verifier call and its observation, once it ran."""
    error: str | None
    """Why it failed or was cancelled."""


class RunInfo(msgspec.Struct, frozen=True):
    """An agent-mode run: one group of trajectories driven by the model."""

    id: str
    task: str
    size: int
    model: str
    """The served model's name."""
    base_url: str
    """Where it is served."""
    reward_source: Literal["verifier", "fixed"]
    status: Literal["running", "ended"]
    """``ended`` once every trajectory has ended (done, failed or cancelled)."""
    cancelled: bool
    """It was cancelled (``DELETE``) or the service shut down before it ended."""
    error: str | None
    """Why the run failed as a whole (the task's root workspace could not be made), if it did."""
    trajectories: list[TrajectoryInfo]


class RunStarted(msgspec.Struct, frozen=True, tag="started", tag_field="event"):
    """The first event of a run: its group is open."""

    run: str
    task: str
    size: int
    model: str
    rollouts: list[str]
    """The trajectories' rollout keys, in sample order."""
    time: float
    """Seconds since the run started (every event has it)."""


class StepEvent(msgspec.Struct, frozen=True, tag="step", tag_field="event"):
    """A call of a trajectory was served."""

    run: str
    sample: int
    step: AgentStep
    verifier: bool
    """This is the verifier's call, not the model's."""
    time: float


class TrajectoryEvent(msgspec.Struct, frozen=True, tag="trajectory", tag_field="event"):
    """A trajectory ended."""

    run: str
    sample: int
    status: TrajectoryStatus
    steps: int
    """The model's calls served."""
    answer: str | None
    truncated: bool
    reward: float | None
    reward_source: Literal["verifier", "fixed"]
    error: str | None
    time: float


class RunEnded(msgspec.Struct, frozen=True, tag="ended", tag_field="event"):
    """The last event of a run: every trajectory has ended and every workspace is released."""

    run: str
    cancelled: bool
    trajectories: dict[str, int]
    """Trajectories by final status."""
    error: str | None
    time: float


RunEvent = RunStarted | StepEvent | TrajectoryEvent | RunEnded


# -- the backend as the service sees it -------------------------------------------------------


class _ServiceBackend(Backend):
    """Wraps the service's backend: runs a task's set-up calls when its root boots and counts
    live workspaces. Never closes the wrapped backend (its owner does)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.engine = inner.engine
        self.setup: dict[str, tuple[ToolCall, ...]] = {}
        self.setup_results: dict[str, list[ToolResult]] = {}
        self._live: set[int] = set()

    def live_workspaces(self) -> int:
        return len(self._live)

    async def create(self, task: Task) -> Workspace:
        ws = await self.inner.create(task)
        self._live.add(ws.id)
        results = []
        try:
            for i, call in enumerate(self.setup.get(task.id, ())):
                ctx = CallContext(RolloutKey(0, task.id, _SETUP_GROUP, _SETUP_GROUP), i)
                results.append(await self.inner.execute(ws, call, ctx))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.release(ws)
            raise
        self.setup_results[task.id] = results
        return ws

    async def freeze(self, workspace: Workspace) -> Workspace:
        snap = await self.inner.freeze(workspace)
        self._live.discard(workspace.id)
        return snap

    async def snapshot(self, workspace: Workspace) -> Workspace:
        return await self.inner.snapshot(workspace)

    async def fork(self, source: Workspace) -> Workspace:
        ws = await self.inner.fork(source)
        if not ws.frozen:
            self._live.add(ws.id)
        return ws

    async def execute(self, workspace: Workspace, call: ToolCall, context: CallContext) -> ToolResult:
        return await self.inner.execute(workspace, call, context)

    async def demote(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> ColdSnapshot:
        return await self.inner.demote(snapshot, parent)

    async def promote(self, cold: ColdSnapshot, parent: Workspace | None) -> Workspace:
        return await self.inner.promote(cold, parent)

    async def release(self, handle: Workspace | ColdSnapshot) -> None:
        try:
            await self.inner.release(handle)
        finally:
            if isinstance(handle, Workspace) and not handle.frozen:
                self._live.discard(handle.id)

    def snapshot_charge(self, workspace: Workspace, dirtied_bytes: int) -> int:
        return self.inner.snapshot_charge(workspace, dirtied_bytes)

    def workspace_memory(self, workspace: Workspace) -> WorkspaceMemory:
        return self.inner.workspace_memory(workspace)

    def working_set(self) -> int:
        return self.inner.working_set()

    def live_handles(self) -> int:
        return self.inner.live_handles()


class _SpareCapacitySpeculation(SpeculationPolicy):
    """Speculates as *inner* does, but only while the service has spare capacity."""

    def __init__(self, inner: SpeculationPolicy, service: Service) -> None:
        self.inner = inner
        self.top_k = inner.top_k
        self._service = service

    def choose(self, ctx: SpecContext) -> Prediction | None:
        if not self._service._spare_capacity():
            return None
        return self.inner.choose(ctx)


# -- sessions and the policy -------------------------------------------------------------------


class _Abort:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Pending:
    """A step request waiting for its observation."""

    __slots__ = ("call", "received", "done", "response", "error")

    def __init__(self, call: ToolCall, received: float) -> None:
        self.call = call
        self.received = received
        self.done = anyio.Event()
        self.response: StepResponse | None = None
        self.error: BunshinError | None = None


class _Session:
    """One sample of a group, as the HTTP API sees it."""

    def __init__(self, id: str, group: _Group, key: RolloutKey, counters: dict[str, int]) -> None:
        self.id = id
        self._counters = counters  # the service's steps by source
        self.group = group
        self.key = key
        self.status: SessionStatus = "starting"
        self.reason: str | None = None
        self.reward: float | None = None
        self.steps = 0
        self.served_by = {"executed": 0, "cache": 0, "speculation": 0}
        self.pending: _Pending | None = None
        self.record: StepRecord | None = None
        self.last_response: float | None = None
        self.abandoned: str | None = None
        self.ready = anyio.Event()  # set once the scheduler first asks for an action, or at end
        self.ended = anyio.Event()
        self._action: ToolCall | Finish | _Abort | None = None
        self._action_set = anyio.Event()

    @property
    def terminal(self) -> bool:
        return self.status in ("closed", "failed", "expired")

    def put(self, action: ToolCall | Finish | _Abort) -> None:
        self._action = action
        self._action_set.set()

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id, group=self.group.id, task=self.key.task, rollout=str(self.key), status=self.status,
            steps=self.steps, served_by=dict(self.served_by), reward=self.reward, reason=self.reason,
        )

    async def next_action(self, sample: SampleView, idle_timeout: float) -> ToolCall | Finish:
        """Hand the sample's latest observation to the waiting step request, then wait for
        the next step or close (at most *idle_timeout* seconds)."""
        n = len(sample.calls)
        pending, record = self.pending, self.record
        if n and pending is not None and record is not None and n == self.steps + 1:
            obs = sample.observations[-1]
            now = anyio.current_time()
            pending.response = StepResponse(
                session=self.id, step=n - 1, call=record.call,
                observation=ObservationBody(
                    obs.digest, obs.size, obs.output.decode("utf-8", errors="replace") if obs.output is not None else None
                ),
                served_by=record.source,
                timings=StepTimings(
                    issued=record.issued, served=record.served, exec_time=record.result.exec_time,
                    wait=now - pending.received,
                    think=None if self.last_response is None else pending.received - self.last_response,
                ),
            )
            self.served_by[record.source] += 1
            self._counters[record.source] += 1
            self.last_response = now
            self.pending = None
            pending.done.set()
        self.steps = n
        if self.status in ("starting", "stepping") and self.pending is None:  # else a step is queued
            self.status = "ready"
        self.ready.set()
        if not self._action_set.is_set():
            with anyio.move_on_after(idle_timeout):
                await self._action_set.wait()
            if not self._action_set.is_set():
                self.status = "expired"
                self.reason = f"idle for more than {idle_timeout:g} s: expired and its workspace released"
                raise ModelError(f"session {self.id}: {self.reason}")
        action, self._action = self._action, None
        self._action_set = anyio.Event()
        if isinstance(action, _Abort):
            raise ModelError(f"session {self.id}: {action.reason}")
        assert action is not None
        return action

    def end(self, result: RolloutResult | None, why: str) -> bool:
        """Record how the session ended; False if it had already ended."""
        if self.ended.is_set():
            return False
        if self.status == "expired":
            pass
        elif self.abandoned is not None:
            self.status, self.reason = "failed", self.abandoned
        elif result is not None and result.status == "done":
            self.status = "closed"
            if self.reward is None:
                self.reason = "closed without a reward (the scheduler recorded 0)"
        elif result is not None and result.status == "failed":
            self.status, self.reason = "failed", result.error
        elif self.group.closing is not None:
            self.status, self.reason = "closed", self.group.closing
        else:
            self.status, self.reason = "failed", why
        pending, self.pending = self.pending, None
        if pending is not None and pending.response is None:
            where = f"session {self.id} {self.status} during this step: {self.reason}"
            backend_failed = result.status == "failed" if result is not None else self.group.error is not None
            pending.error = BackendError(where) if backend_failed else StateConflictError(where)
            pending.done.set()
        self.ready.set()
        self.ended.set()
        return True


class _Group:
    def __init__(self, id: str, number: int, entry: _TaskEntry, size: int, counters: dict[str, int]) -> None:
        self.id = id
        self.number = number
        self.entry = entry
        self.sessions = [
            _Session(f"{id}-s{i}", self, RolloutKey(0, entry.task.id, number, i), counters) for i in range(size)
        ]
        self.by_key = {s.key: s for s in self.sessions}
        self.scheduler: Scheduler | None = None
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.error: str | None = None
        self.closing: str | None = None

    def info(self) -> GroupInfo:
        return GroupInfo(
            id=self.id, task=self.entry.task.id, size=len(self.sessions), sessions=[s.id for s in self.sessions],
            status="ended" if self.done.is_set() else "running", error=self.error,
        )


class _TaskEntry:
    def __init__(self, task: Task, setup: list[ToolCall], cacheable: list[str]) -> None:
        self.task = task
        self.setup = setup
        self.cacheable = CacheableTools(cacheable)
        self.selector = HistorySelector()
        self.groups: dict[str, _Group] = {}
        self.runs: dict[str, _Run] = {}


class ExternalPolicy(Policy):
    """A policy whose calls come from outside the scheduler, one session per sample.

    ``act`` hands the sample's latest observation to the step request waiting for it, then
    waits for the session's next step (a :class:`ToolCall`) or close (:class:`Finish`). A
    session left idle longer than *idle_timeout* raises :class:`ModelError`, which fails only
    its rollout (its workspace is released).

    Args:
        sessions: The service's sessions of one group, by rollout key.
        idle_timeout: Seconds a session may wait for its next step or close.
    """

    def __init__(self, sessions: Mapping[RolloutKey, _Session], idle_timeout: float) -> None:
        self._sessions = sessions
        self._idle = idle_timeout

    async def act(self, sample: SampleView) -> ToolCall | Finish:
        session = self._sessions.get(sample.rollout)
        if session is None:
            raise ConfigError(f"rollout {sample.rollout} has no session")
        return await session.next_action(sample, self._idle)


# -- agent mode: runs and their policy ---------------------------------------------------------


def tools_from_spec(spec: WorkspaceSpec, *, exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """OpenAI function tools for the tools of *spec* (but *exclude*): each takes the arguments
    its command template names, as strings, required unless the tool has a default for them."""
    out = []
    skip = set(exclude)
    for name, tool in sorted(spec.tools.items()):
        if name in skip:
            continue
        fields = sorted(_fields(tool.command))
        out.append({"type": "function", "function": {
            "name": name,
            "description": tool.description or f"Run the workspace tool {name!r}.",
            "parameters": {
                "type": "object",
                "properties": {f: {"type": "string"} for f in fields},
                "required": [f for f in fields if f not in tool.defaults],
            },
        }})
    return out


def _verifier_reward(rollout: RolloutKey, obs: Observation) -> float:
    """The reward the verifier's observation gives: its last non-empty line, as a number."""
    where = f"rollout {rollout}: the verifier"
    if obs.output is None:
        raise BackendError(f"{where} returned no output (the backend keeps none), so there is no reward to read")
    lines = [line.strip() for line in obs.output.decode("utf-8", errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    try:
        value = float(last)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise BackendError(f"{where}'s output does not end in a finite number: last line {last[:200]!r}")
    return value


class _Trajectory:
    """One sample of an agent-mode run."""

    def __init__(self, sample: int, key: RolloutKey) -> None:
        self.sample = sample
        self.key = key
        self.status: TrajectoryStatus = "running"
        self.steps: list[AgentStep] = []
        self.records: list[StepRecord] = []  # what the scheduler served, by call index
        self.served_by = {"executed": 0, "cache": 0, "speculation": 0}
        self.answer: str | None = None
        self.truncated = False
        self.reward: float | None = None
        self.verifying = False
        self.verifier: AgentStep | None = None
        self.error: str | None = None

    def info(self, source: Literal["verifier", "fixed"]) -> TrajectoryInfo:
        return TrajectoryInfo(
            sample=self.sample, rollout=str(self.key), status=self.status, steps=list(self.steps),
            served_by=dict(self.served_by), answer=self.answer, truncated=self.truncated, reward=self.reward,
            reward_source=source, verifier=self.verifier, error=self.error,
        )


class _Run:
    """An agent-mode run: one group of samples whose calls come from the model."""

    def __init__(self, id: str, number: int, entry: _TaskEntry, request: RunRequest, chat: ChatPolicy,
                 answers: dict[RolloutKey, str]) -> None:
        self.id = id
        self.number = number
        self.entry = entry
        self.request = request
        self.chat = chat
        self.answers = answers  # the model's final text, by rollout, until its trajectory reads it
        self.source: Literal["verifier", "fixed"] = "verifier" if isinstance(request.reward, VerifierReward) else "fixed"
        self.trajectories = [_Trajectory(i, RolloutKey(0, entry.task.id, number, i)) for i in range(request.size)]
        self.by_key = {t.key: t for t in self.trajectories}
        self.scheduler: Scheduler | None = None
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.cancelled: str | None = None
        self.error: str | None = None
        self.started = anyio.current_time()
        self.events: list[bytes] = []  # newline-terminated JSON, in order
        self._new_event = anyio.Event()

    def now(self) -> float:
        return anyio.current_time() - self.started

    def emit(self, event: RunEvent) -> None:
        self.events.append(msgspec.json.encode(event) + b"\n")
        self._new_event.set()
        self._new_event = anyio.Event()

    async def stream(self) -> AsyncIterator[bytes]:
        """Every event so far, then each new one as it comes, until the run's last."""
        i = 0
        while True:
            new = self._new_event
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done.is_set():
                return
            await new.wait()

    def observe(self, t: _Trajectory, sample: SampleView) -> None:
        """Record (and announce) the calls of *sample* served since its last action."""
        seen = len(t.steps) + (t.verifier is not None)
        for i in range(seen, len(sample.calls)):
            call, obs = sample.calls[i], sample.observations[i]
            record = t.records[i] if i < len(t.records) else None
            prev = t.records[i - 1].served if 0 < i <= len(t.records) else 0.0
            issued = record.issued if record is not None else prev
            step = AgentStep(
                step=i, call=call,
                observation=ObservationBody(
                    obs.digest, obs.size, obs.output.decode("utf-8", errors="replace") if obs.output is not None else None
                ),
                served_by=record.source if record is not None else "cache",
                issued=issued, served=record.served if record is not None else issued,
                exec_time=record.result.exec_time if record is not None else 0.0,
                think=max(0.0, issued - prev),
            )
            verifier = t.verifying and i == len(sample.calls) - 1
            if verifier:
                t.verifier = step
            else:
                t.steps.append(step)
                t.served_by[step.served_by] += 1
            self.emit(StepEvent(run=self.id, sample=t.sample, step=step, verifier=verifier, time=self.now()))

    def info(self) -> RunInfo:
        model = self.request.model
        return RunInfo(
            id=self.id, task=self.entry.task.id, size=len(self.trajectories), model=model.model,
            base_url=model.base_url, reward_source=self.source,
            status="ended" if self.done.is_set() else "running", cancelled=self.cancelled is not None,
            error=self.error, trajectories=[t.info(self.source) for t in self.trajectories],
        )


class _AgentPolicy(Policy):
    """The policy of an agent-mode run: each next call comes from the run's :class:`ChatPolicy`
    (checked against the workspace spec, where there is one); the model's final answer is
    followed by the verifier's call, whose output gives the reward (or the fixed reward ends
    the trajectory at once). Every served call is recorded, with its output, and announced."""

    def __init__(self, run: _Run, check_call: Callable[[ToolCall, str], None]) -> None:
        self._run = run
        self._check = check_call

    async def act(self, sample: SampleView) -> ToolCall | Finish:
        run = self._run
        t = run.by_key[sample.rollout]
        run.observe(t, sample)
        if t.verifying:
            t.reward = _verifier_reward(sample.rollout, sample.observations[-1])
            return Finish(t.reward)
        n = len(sample.calls)
        if n >= run.request.max_steps:
            t.truncated = True
            answer = ""
        else:
            action = await run.chat.act(sample)
            if isinstance(action, ToolCall):
                try:
                    self._check(action, f"rollout {sample.rollout} step {n}: the model's call")
                except ConfigError as exc:  # the model's mistake: this trajectory fails
                    raise ModelError(str(exc)) from None
                return action
            answer = t.answer = run.answers.pop(sample.rollout, "")
        reward = run.request.reward
        if isinstance(reward, FixedReward):
            t.reward = reward.value
            return Finish(reward.value)
        t.verifying = True
        if reward.answer_argument is None:
            return reward.call
        return ToolCall(name=reward.call.name, arguments={**reward.call.arguments, reward.answer_argument: answer})


# -- the service ---------------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def _observation(result: ToolResult) -> ObservationBody:
    out = result.output.decode("utf-8", errors="replace") if result.output is not None else None
    return ObservationBody(result.observation_digest, result.observation_size, out)


class Service:
    """The service core: tasks, groups of sessions and their scheduler runs; open it with
    :func:`open_service`. The HTTP app (:func:`create_app`) only translates requests into
    these calls and the exceptions they raise into statuses.
    """

    def __init__(
        self, backend: Backend, tree: PrefixTree, task_group: TaskGroup, config: ServeConfig, *,
        spec: WorkspaceSpec | None, tasks: Mapping[str, Task], cacheable: Iterable[str],
    ) -> None:
        self._backend = backend if isinstance(backend, _ServiceBackend) else _ServiceBackend(backend)
        self._tree = tree
        self._tg = task_group
        self._cfg = config
        sched = config.scheduler or ServeConfig.default_scheduler()
        self._sched_cfg = msgspec.structs.replace(
            sched, batch_tasks=1, group_size=None, mode="sync", max_concurrent=None
        )
        self._spec = spec
        self._known_tasks = dict(tasks)
        self._default_cacheable = sorted(set(cacheable))
        self._speculation = _SpareCapacitySpeculation(TailBenefitSpeculation(), self)
        self._tasks: dict[str, _TaskEntry] = {}
        self._groups: dict[str, _Group] = {}
        self._sessions: dict[str, _Session] = {}
        self._ended_groups: deque[_Group] = deque()
        self._runs: dict[str, _Run] = {}
        self._ended_runs: deque[_Run] = deque()
        self._trajectories_ended = {"done": 0, "failed": 0, "cancelled": 0}
        self._lost: dict[str, SessionInfo | str] = {}  # id -> a lost session, or why a run was lost
        self._next_group = self._read_journal()  # group and run numbers (ids gN, rN)
        self._open = 0  # sessions not yet ended
        self._capacity = anyio.Event()
        self._closing = False
        self._ended = {"closed": 0, "failed": 0, "expired": 0}
        self._refused = 0
        self._steps = {"executed": 0, "cache": 0, "speculation": 0}
        self.metrics = RolloutMetrics()
        """Prometheus metrics of the service (``GET /metrics``)."""
        self.metrics.watch("service", self._backend, self._workspaces)
        self._save_journal()

    @property
    def config(self) -> ServeConfig:
        """The service's configuration."""
        return self._cfg

    @property
    def backend(self) -> Backend:
        """The backend the sessions run on (as the service wraps it)."""
        return self._backend

    # -- lookups --------------------------------------------------------------------------------

    def _task(self, task_id: str) -> _TaskEntry:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise NotFoundError(f"no task {task_id!r} is registered; register it with POST {API_PREFIX}/tasks") from None

    def _group(self, group_id: str) -> _Group:
        try:
            return self._groups[group_id]
        except KeyError:
            raise NotFoundError(f"no group {group_id!r} (never opened, or ended long ago and forgotten)") from None

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            lost = self._lost.get(session_id)
            if isinstance(lost, SessionInfo):
                raise StateConflictError(f"session {session_id} was lost: {lost.reason}") from None
            raise NotFoundError(f"no session {session_id!r} (never opened, or ended long ago and forgotten)") from None

    # -- the journal ------------------------------------------------------------------------------

    def _read_journal(self) -> int:
        """Load what a killed service left in the journal; return the next group number."""
        path = self._cfg.journal
        if path is None or not os.path.exists(path):
            return 0
        try:
            with open(path, "rb") as f:
                old = msgspec.json.decode(f.read(), type=_Journal)
        except (OSError, msgspec.DecodeError) as exc:
            raise ConfigError(f"journal {path}: cannot read it ({exc}); remove it to start afresh") from None
        why = (f"the service (pid {old.pid}) stopped while it was open (killed or crashed); "
               "its workspace was removed when the service restarted")
        for sid, j in old.sessions.items():
            self._lost[sid] = SessionInfo(id=sid, group=j.group, task=j.task, rollout=j.rollout, status="failed",
                                          steps=0, served_by={}, reason=why)
        for rid in old.runs:
            self._lost[rid] = why
        return old.next_group

    def _save_journal(self) -> None:
        path = self._cfg.journal
        if path is None:
            return
        sessions = {
            s.id: _JournalSession(s.group.id, s.group.entry.task.id, str(s.key))
            for s in self._sessions.values() if not s.terminal
        }
        runs = [r.id for r in self._runs.values() if not r.done.is_set()]
        data = msgspec.json.encode(_Journal(os.getpid(), self._next_group, sessions, runs))
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _new_number(self) -> int:
        number = self._next_group
        self._next_group += 1
        return number

    def _check_call(self, call: ToolCall, where: str) -> None:
        if self._spec is not None:
            try:
                render_call(self._spec, call)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None

    # -- tasks ------------------------------------------------------------------------------------

    def register_task(self, request: TaskRequest) -> TaskInfo:
        """Register a task.

        Raises:
            StateConflictError: If a task of that id is registered.
            ConfigError: If a set-up call or a cacheable tool is not one the workspace spec
                declares (or a call's arguments do not fit its tool).
        """
        if request.id in self._tasks:
            raise StateConflictError(f"task {request.id!r} is already registered; delete it first or pick another id")
        for i, call in enumerate(request.setup):
            self._check_call(call, f"setup[{i}]")
        if request.cacheable is None:
            cacheable = self._default_cacheable
        else:
            if self._spec is not None:
                for i, name in enumerate(request.cacheable):
                    if name not in self._spec.tools:
                        raise ConfigError(
                            f"cacheable[{i}]: tool {name!r} is not declared in the workspace spec "
                            f"{self._spec.name!r}; declared: {', '.join(sorted(self._spec.tools)) or 'none'}"
                        )
            cacheable = sorted(set(request.cacheable))
        known = self._known_tasks.get(request.id)
        task = Task(
            id=request.id,
            memory=known.memory if known is not None else MemoryProfile(0, 0, 0.0),
            description=request.description,
        )
        entry = _TaskEntry(task, list(request.setup), cacheable)
        self._tasks[task.id] = entry
        self._backend.setup[task.id] = tuple(request.setup)
        return self.task_info(task.id)

    def task_info(self, task_id: str) -> TaskInfo:
        """A registered task (:class:`NotFoundError` if none)."""
        entry = self._task(task_id)
        return TaskInfo(
            id=entry.task.id, description=entry.task.description, setup=list(entry.setup),
            cacheable=sorted(entry.cacheable.tools),
            setup_observations=[_observation(r) for r in self._backend.setup_results.get(task_id, [])],
            open_groups=[g.id for g in entry.groups.values() if not g.done.is_set()],
            open_runs=[r.id for r in entry.runs.values() if not r.done.is_set()],
        )

    def tasks(self) -> list[TaskInfo]:
        """Every registered task."""
        return [self.task_info(t) for t in self._tasks]

    async def delete_task(self, task_id: str) -> None:
        """Forget a task and release its prefix tree (its cached snapshots).

        Raises:
            NotFoundError: If no such task is registered.
            StateConflictError: If one of its groups is still running.
        """
        entry = self._task(task_id)
        running = [g.id for g in entry.groups.values() if not g.done.is_set()]
        running += [r.id for r in entry.runs.values() if not r.done.is_set()]
        if running or not await self._tree.forget(task_id):
            raise StateConflictError(
                f"task {task_id!r} has running groups ({', '.join(running) or 'ending'}); close them first "
                f"(DELETE {API_PREFIX}/groups/ID, DELETE {API_PREFIX}/runs/ID)"
            )
        del self._tasks[task_id]
        self._backend.setup.pop(task_id, None)
        self._backend.setup_results.pop(task_id, None)

    # -- capacity ---------------------------------------------------------------------------------

    def _spare_capacity(self) -> bool:
        cfg = self._cfg
        if self._backend.live_workspaces() >= cfg.max_workspaces:
            return False
        return cfg.max_bytes is None or self._backend.working_set() < cfg.max_bytes

    def _over_limit(self, size: int) -> CapacityError | None:
        cfg = self._cfg
        if self._closing:
            return CapacityError("the service is shutting down", limit="shutdown", in_use=self._open,
                                 maximum=cfg.max_workspaces, retry_after=cfg.retry_after)
        if self._open + size > cfg.max_workspaces:
            return CapacityError(
                f"limit max_workspaces reached: {self._open} of {cfg.max_workspaces} sessions are open and "
                f"the group asks for {size}; retry later, or pass a longer wait",
                limit="max_workspaces", in_use=self._open, maximum=cfg.max_workspaces, retry_after=cfg.retry_after,
            )
        if cfg.max_bytes is not None:
            ws = self._backend.working_set()
            if ws >= cfg.max_bytes:
                return CapacityError(
                    f"limit max_bytes reached: the workspaces hold {ws} bytes, the limit is {cfg.max_bytes}; "
                    "retry later, or pass a longer wait",
                    limit="max_bytes", in_use=ws, maximum=cfg.max_bytes, retry_after=cfg.retry_after,
                )
        return None

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = anyio.Event()

    def _check_size(self, size: int) -> None:
        if size > self._cfg.max_workspaces:
            raise ConfigError(
                f"size: a group of {size} can never open, the service allows {self._cfg.max_workspaces} sessions "
                "(max_workspaces); lower size"
            )

    async def _reserve(self, size: int, wait: float) -> None:
        """Wait up to *wait* seconds (at most ``max_wait``) until *size* more sessions fit;
        the caller then counts them in ``_open`` (without awaiting in between)."""
        deadline = anyio.current_time() + min(wait, self._cfg.max_wait)
        while (refusal := self._over_limit(size)) is not None:
            left = deadline - anyio.current_time()
            if left <= 0 or refusal.limit == "shutdown":
                self._refused += 1
                raise refusal
            with anyio.move_on_after(min(left, 0.25)):  # the working set changes unannounced
                await self._capacity.wait()

    # -- groups -----------------------------------------------------------------------------------

    async def open_group(self, task_id: str, request: GroupRequest) -> GroupInfo:
        """Open a group of ``request.size`` sessions of *task_id*, waiting up to
        ``request.wait`` seconds (at most ``max_wait``) for capacity; returns once every
        session is ready for its first step.

        Raises:
            NotFoundError: If the task is not registered.
            ConfigError: If the group is larger than ``max_workspaces`` (it could never open).
            CapacityError: If it does not fit within the wait.
            BackendError: If the task's root workspace could not be made (its set-up failed).
        """
        entry = self._task(task_id)
        cfg = self._cfg
        size = request.size
        self._check_size(size)
        await self._reserve(size, request.wait)
        number = self._new_number()
        group = _Group(f"g{number}", number, entry, size, self._steps)
        group.scheduler = Scheduler(
            self._backend, ExternalPolicy(group.by_key, cfg.idle_timeout), self._sched_cfg,
            selector=entry.selector if self._sched_cfg.speculation else None,
            cacheable=entry.cacheable,
            speculation=self._speculation,
            plan=TrainingPlan([[[(s.key, entry.task) for s in group.sessions]]]),
            on_progress=lambda done, total: self._collect(group),
            on_step=lambda key, record: self._on_step(group, key, record),
            tree=self._tree,
        )
        self._open += size
        self._groups[group.id] = group
        entry.groups[group.id] = group
        for s in group.sessions:
            self._sessions[s.id] = s
        self._save_journal()
        self._tg.start_soon(self._run_group, group)
        for s in group.sessions:
            await s.ready.wait()
        if group.error is not None:
            raise BackendError(f"group {group.id} of task {task_id!r} could not start: {group.error}")
        return group.info()

    async def _run_group(self, group: _Group) -> None:
        assert group.scheduler is not None
        try:
            with group.scope:
                self.metrics.on_run(await group.scheduler.run())
        except Exception as exc:  # the root could not be made, or a policy broke its contract
            group.error = _describe(exc)
        finally:
            why = group.error or group.closing or "the group's run ended"
            for s in group.sessions:
                self._end_session(s, group.scheduler.result(s.key), why)
            group.done.set()
            self._forget_old(group)

    def _on_step(self, group: _Group, key: RolloutKey, record: StepRecord) -> None:
        group.by_key[key].record = record
        self.metrics.on_step(key, record)

    def _workspaces(self) -> list[Workspace]:
        running = [*self._groups.values(), *self._runs.values()]
        return [ws for g in running if g.scheduler is not None and not g.done.is_set()
                for ws in g.scheduler.workspaces()]

    def _collect(self, group: _Group) -> None:
        """A rollout of *group* ended: end its session (its workspace is released by now)."""
        assert group.scheduler is not None
        for s in group.sessions:
            if not s.ended.is_set():
                result = group.scheduler.result(s.key)
                if result is not None:
                    self._end_session(s, result, result.error or "ended")

    def _end_session(self, s: _Session, result: RolloutResult | None, why: str) -> None:
        if s.end(result, why):
            if result is not None:
                self.metrics.on_rollout(result)
            self._open -= 1
            self._ended[s.status] = self._ended.get(s.status, 0) + 1
            self._capacity_changed()
            self._save_journal()

    def _forget_old(self, group: _Group) -> None:
        self._ended_groups.append(group)
        while len(self._ended_groups) > self._cfg.keep_ended:
            old = self._ended_groups.popleft()
            self._groups.pop(old.id, None)
            old.entry.groups.pop(old.id, None)
            for s in old.sessions:
                self._sessions.pop(s.id, None)

    def group_info(self, group_id: str) -> GroupInfo:
        """A group (:class:`NotFoundError` if none)."""
        return self._group(group_id).info()

    async def close_group(self, group_id: str) -> GroupInfo:
        """End every session of the group still open (steps in progress are cancelled; their
        sessions end ``closed`` without a reward) and release its workspaces."""
        group = self._group(group_id)
        if not group.done.is_set():
            group.closing = f"closed with its group {group.id} (DELETE {API_PREFIX}/groups/{group.id})"
            group.scope.cancel()
            await group.done.wait()
        return group.info()

    # -- sessions ---------------------------------------------------------------------------------

    def session_info(self, session_id: str) -> SessionInfo:
        """A session (:class:`NotFoundError` if none); a session a killed service left open
        is reported ``failed`` (see :attr:`ServeConfig.journal`)."""
        lost = self._lost.get(session_id)
        if isinstance(lost, SessionInfo) and session_id not in self._sessions:
            return lost
        return self._session(session_id).info()

    def _check_open(self, s: _Session, what: str) -> None:
        if s.terminal:
            raise StateConflictError(f"cannot {what} session {s.id}: it is {s.status} ({s.reason})")
        if s.status in ("stepping", "closing"):
            raise StateConflictError(
                f"cannot {what} session {s.id}: it is {s.status}; wait for the response of its current request"
            )

    async def step(self, session_id: str, call: ToolCall) -> StepResponse:
        """Run *call* in the session (or serve it from the prefix tree or a speculative
        branch) and return the observation.

        Raises:
            NotFoundError: If there is no such session.
            StateConflictError: If it has ended or a request of it is in progress, or it ended
                during the step (its group was closed).
            ConfigError: If the call does not fit the workspace spec.
            BackendError: If the backend failed during the step (the session is failed).
        """
        s = self._session(session_id)
        self._check_open(s, "step")
        self._check_call(call, "call")
        pending = _Pending(call, anyio.current_time())
        s.pending = pending
        s.status = "stepping"
        s.put(call)
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.response is not None
        return pending.response

    def abandon(self, session_id: str, reason: str) -> None:
        """Fail the session (its client went away): cancel its rollout, releasing what it holds."""
        s = self._sessions.get(session_id)
        if s is None or s.terminal:
            return
        s.abandoned = reason
        group = s.group
        if group.scheduler is None or not group.scheduler.cancel(s.key):
            s.put(_Abort(reason))

    async def close_session(self, session_id: str, reward: float | None) -> SessionInfo:
        """End the session with *reward* (None: without one; the scheduler records 0) and
        return it once its workspace is released.

        Raises:
            NotFoundError: If there is no such session.
            StateConflictError: If it has ended or a request of it is in progress.
        """
        s = self._session(session_id)
        self._check_open(s, "close")
        s.status = "closing"
        s.reward = reward
        s.put(Finish(reward if reward is not None else 0.0))
        await s.ended.wait()
        return s.info()

    # -- agent mode -------------------------------------------------------------------------------

    def _run(self, run_id: str) -> _Run:
        try:
            return self._runs[run_id]
        except KeyError:
            lost = self._lost.get(run_id)
            if isinstance(lost, str):
                raise StateConflictError(f"run {run_id} was lost: {lost}") from None
            raise NotFoundError(f"no run {run_id!r} (never started, or ended long ago and forgotten)") from None

    async def start_run(self, task_id: str, request: RunRequest) -> RunInfo:
        """Start an agent-mode run: a group of ``request.size`` samples of *task_id* whose
        calls come from the model, waiting for capacity as :meth:`open_group` does. Returns
        once the run is started (its events are at :meth:`run_events`).

        Raises:
            NotFoundError: If the task is not registered.
            ConfigError: If the group could never open, the task has no description (the
                user message), no tools are given and the service has no spec to derive them
                from, or the tools, the model settings or the verifier call are invalid.
            CapacityError: If it does not fit within the wait.
        """
        entry = self._task(task_id)
        self._check_size(request.size)
        if not entry.task.description.strip():
            raise ConfigError(
                f"task {task_id!r} has no description; in agent mode it is the model's user message, so register "
                "the task with one"
            )
        reward = request.reward
        if isinstance(reward, VerifierReward):
            call = reward.call
            if reward.answer_argument is not None:
                call = ToolCall(name=call.name, arguments={**call.arguments, reward.answer_argument: ""})
            self._check_call(call, "reward.call")
        tools = request.tools
        if tools is None:
            if self._spec is None:
                raise ConfigError(
                    "tools: the service has no workspace spec to derive the model's tools from; give them as "
                    'OpenAI function tools ({"type": "function", "function": {"name", "parameters"}})'
                )
            skip = [reward.call.name] if isinstance(reward, VerifierReward) else []
            tools = tools_from_spec(self._spec, exclude=skip)
        model = request.model
        if model.api_key is None:  # never forward a key of the service to a URL a client names
            model = msgspec.structs.replace(model, api_key="")
        answers: dict[RolloutKey, str] = {}

        def keep_answer(sample: SampleView, text: str) -> float:
            answers[sample.rollout] = text
            return 0.0  # a placeholder: the reward is the verifier's or the fixed one (see _AgentPolicy)

        try:
            chat = ChatPolicy(model, tools, [entry.task], reward=keep_answer, group_size=request.size,
                              system_prompt=request.system_prompt, seed=request.seed)
        except ConfigError as exc:
            raise ConfigError(f"agent run: {exc}") from None
        try:
            await self._reserve(request.size, request.wait)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await chat.aclose()
            raise
        number = self._new_number()
        run = _Run(f"r{number}", number, entry, request, chat, answers)
        run.scheduler = Scheduler(
            self._backend, _AgentPolicy(run, self._check_call), self._sched_cfg,
            selector=entry.selector if self._sched_cfg.speculation else None,
            cacheable=entry.cacheable,
            speculation=self._speculation,
            plan=TrainingPlan([[[(t.key, entry.task) for t in run.trajectories]]]),
            on_progress=lambda done, total: self._collect_run(run),
            on_step=lambda key, record: self._on_run_step(run, key, record),
            tree=self._tree,
        )
        self._open += request.size
        self._runs[run.id] = run
        entry.runs[run.id] = run
        self._save_journal()
        run.emit(RunStarted(run=run.id, task=task_id, size=request.size, model=request.model.model,
                            rollouts=[str(t.key) for t in run.trajectories], time=run.now()))
        self._tg.start_soon(self._run_agent, run)
        return run.info()

    async def _run_agent(self, run: _Run) -> None:
        assert run.scheduler is not None
        try:
            with run.scope:
                self.metrics.on_run(await run.scheduler.run())
        except Exception as exc:  # the root could not be made, or a policy broke its contract
            run.error = _describe(exc)
        finally:
            with anyio.CancelScope(shield=True):
                await run.chat.aclose()
            why = run.error or run.cancelled or "the run ended before it"
            for t in run.trajectories:
                self._end_trajectory(run, t, run.scheduler.result(t.key), why)
            counts = {"done": 0, "failed": 0, "cancelled": 0}
            for t in run.trajectories:
                counts[t.status] += 1
            run.emit(RunEnded(run=run.id, cancelled=run.cancelled is not None, trajectories=counts,
                              error=run.error, time=run.now()))
            run.done.set()
            self._save_journal()
            self._forget_old_run(run)

    def _on_run_step(self, run: _Run, key: RolloutKey, record: StepRecord) -> None:
        run.by_key[key].records.append(record)
        self._steps[record.source] += 1
        self.metrics.on_step(key, record)

    def _collect_run(self, run: _Run) -> None:
        """A sample of *run* ended: end its trajectory (its workspace is released by now)."""
        assert run.scheduler is not None
        for t in run.trajectories:
            if t.status == "running":
                result = run.scheduler.result(t.key)
                if result is not None:
                    self._end_trajectory(run, t, result, "ended")

    def _end_trajectory(self, run: _Run, t: _Trajectory, result: RolloutResult | None, why: str) -> None:
        if t.status != "running":
            return
        if result is not None:
            self.metrics.on_rollout(result)
        if result is not None and result.status == "done":
            t.status = "done"
        elif result is not None and result.status == "failed":
            t.status, t.error = "failed", result.error
        elif run.cancelled is not None:
            t.status, t.error = "cancelled", run.cancelled
        else:
            t.status, t.error = ("failed", why) if run.error is not None else ("cancelled", why)
        if t.status != "done":
            t.reward = None
        self._open -= 1
        self._trajectories_ended[t.status] += 1
        self._capacity_changed()
        run.emit(TrajectoryEvent(
            run=run.id, sample=t.sample, status=t.status, steps=len(t.steps), answer=t.answer,
            truncated=t.truncated, reward=t.reward, reward_source=run.source, error=t.error, time=run.now(),
        ))

    def _forget_old_run(self, run: _Run) -> None:
        self._ended_runs.append(run)
        while len(self._ended_runs) > self._cfg.keep_ended:
            old = self._ended_runs.popleft()
            self._runs.pop(old.id, None)
            old.entry.runs.pop(old.id, None)

    def run_info(self, run_id: str) -> RunInfo:
        """An agent-mode run and its trajectories so far (:class:`NotFoundError` if none)."""
        return self._run(run_id).info()

    def run_events(self, run_id: str) -> AsyncIterator[bytes]:
        """The run's events as newline-terminated JSON: every one so far, then each new one as
        it comes, until its ``ended`` event (:class:`NotFoundError` if there is no such run).
        A reader that stops early does not affect the run."""
        return self._run(run_id).stream()

    async def cancel_run(self, run_id: str) -> RunInfo:
        """Cancel the run: its trajectories still running end ``cancelled`` (model requests in
        flight are dropped), and every workspace they hold is released before this returns."""
        run = self._run(run_id)
        if not run.done.is_set():
            run.cancelled = f"cancelled (DELETE {API_PREFIX}/runs/{run.id})"
            run.scope.cancel()
            await run.done.wait()
        return run.info()

    # -- the whole ----------------------------------------------------------------------------------

    def statistics(self) -> ServiceStatistics:
        """What the service holds and did so far."""
        cfg = self._cfg
        return ServiceStatistics(
            tasks=len(self._tasks),
            groups_open=sum(not g.done.is_set() for g in self._groups.values()),
            sessions_open=self._open,
            sessions_ended=dict(self._ended),
            steps=dict(self._steps),
            refused=self._refused,
            runs_open=sum(not r.done.is_set() for r in self._runs.values()),
            trajectories_ended=dict(self._trajectories_ended),
            lost=len(self._lost),
            live_workspaces=self._backend.live_workspaces(),
            live_handles=self._backend.live_handles(),
            working_set=self._backend.working_set(),
            engine=self._backend.engine,
            limits=LimitsInfo(cfg.max_workspaces, cfg.max_bytes, cfg.idle_timeout, cfg.max_wait),
        )

    async def aclose(self) -> None:
        """End every session (``closed``, reason: the service shut down) and cancel every
        agent-mode run, and wait until their workspaces are released; new groups and runs are
        refused from now on."""
        self._closing = True
        self._capacity_changed()
        with anyio.CancelScope(shield=True):
            for group in list(self._groups.values()):
                if not group.done.is_set():
                    group.closing = "the service shut down"
                    group.scope.cancel()
            for run in list(self._runs.values()):
                if not run.done.is_set():
                    run.cancelled = "the service shut down"
                    run.scope.cancel()
            for group in list(self._groups.values()):
                await group.done.wait()
            for run in list(self._runs.values()):
                await run.done.wait()


@contextlib.asynccontextmanager
async def open_service(
    backend: Backend,
    config: ServeConfig | None = None,
    *,
    spec: WorkspaceSpec | None = None,
    tasks: Mapping[str, Task] | None = None,
    cacheable: Iterable[str] = (),
) -> AsyncIterator[Service]:
    """Open the service core on *backend*; on exit every session is ended and every workspace
    and snapshot it made is released (*backend* itself stays open: its owner closes it).

    Args:
        backend: Where the workspaces live (a :class:`LiveBackend`, or a simulator's backend).
        config: Limits and scheduler options.
        spec: The workspace spec of a live backend: calls are checked against its tools, and
            its ``cacheable`` marks are the default cacheability of a task.
        tasks: Known tasks by id (a trace's): a registered task of one of these ids gets its
            memory profile (what a simulated backend charges).
        cacheable: The default cacheable tools when no *spec* is given.
    """
    config = config or ServeConfig()
    config.check()
    sched = config.scheduler or ServeConfig.default_scheduler()
    marks = [n for n, t in spec.tools.items() if t.cacheable] if spec is not None else list(cacheable)
    wrapped = _ServiceBackend(backend)
    async with anyio.create_task_group() as tg:
        async with open_prefix_tree(wrapped, hot_budget=sched.hot_budget if sched.caching else 0,
                                    cold_budget=sched.cold_budget if sched.caching else 0) as tree:
            service = Service(wrapped, tree, tg, config, spec=spec, tasks=tasks or {}, cacheable=marks)
            try:
                yield service
            finally:
                await service.aclose()


# -- HTTP ------------------------------------------------------------------------------------------


def _error_response(exc: Exception) -> Any:
    from litestar import MediaType, Response

    status = {NotFoundError: 404, StateConflictError: 409, ConfigError: 422, BackendError: 502}
    code = 500
    for cls, value in status.items():
        if isinstance(exc, cls):
            code = value
            break
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {"error": type(exc).__name__}
    if isinstance(exc, CapacityError):
        code = 429 if exc.limit == "max_workspaces" else 503
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        extra.update(limit=exc.limit, in_use=exc.in_use, maximum=exc.maximum)
    return Response(
        content={"status_code": code, "detail": str(exc), "extra": extra},
        status_code=code, headers=headers, media_type=MediaType.JSON,
    )


def create_app(service: Service) -> Any:
    """The Litestar app serving *service* under :data:`API_PREFIX`, with its OpenAPI document
    at ``/schema/openapi.json``."""
    from litestar import Litestar, MediaType, Request, Response, Router, delete, get, post
    from litestar.logging import LoggingConfig
    from litestar.openapi import OpenAPIConfig
    from litestar.params import FromPath, JSONBody
    from litestar.response import Stream

    from . import __version__

    @get("/health", summary="Liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/stats", summary="What the service holds and did")
    async def stats() -> ServiceStatistics:
        return service.statistics()

    @post("/tasks", status_code=201, summary="Register a task")
    async def register_task(data: JSONBody[TaskRequest]) -> TaskInfo:
        return service.register_task(data)

    @get("/tasks", summary="List the registered tasks")
    async def list_tasks() -> list[TaskInfo]:
        return service.tasks()

    @get("/tasks/{task_id:str}", summary="A registered task")
    async def get_task(task_id: FromPath[str]) -> TaskInfo:
        return service.task_info(task_id)

    @delete("/tasks/{task_id:str}", status_code=204, summary="Forget a task and release its cached snapshots")
    async def delete_task(task_id: FromPath[str]) -> None:
        await service.delete_task(task_id)

    @post("/tasks/{task_id:str}/groups", status_code=201, summary="Open a group of sessions of a task")
    async def open_group(task_id: FromPath[str], data: JSONBody[GroupRequest]) -> GroupInfo:
        return await service.open_group(task_id, data)

    @get("/groups/{group_id:str}", summary="A group of sessions")
    async def get_group(group_id: FromPath[str]) -> GroupInfo:
        return service.group_info(group_id)

    @delete("/groups/{group_id:str}", status_code=200, summary="Close every open session of a group")
    async def close_group(group_id: FromPath[str]) -> GroupInfo:
        return await service.close_group(group_id)

    @get("/sessions/{session_id:str}", summary="A session")
    async def get_session(session_id: FromPath[str]) -> SessionInfo:
        return service.session_info(session_id)

    @post("/sessions/{session_id:str}/step", status_code=200, summary="Run a tool call in a session")
    async def step(session_id: FromPath[str], data: JSONBody[StepRequest], request: Request) -> StepResponse:
        response: StepResponse | None = None

        async def watch() -> None:  # the body is read: the next message is the disconnect
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    service.abandon(session_id, "the client disconnected during a step")
                    return

        error: BunshinError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                response = await service.step(session_id, data.call)
            except BunshinError as exc:  # raised outside the task group, so not as a group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            raise error
        assert response is not None
        return response

    @post("/sessions/{session_id:str}/close", status_code=200, summary="Close a session with its reward")
    async def close_session(session_id: FromPath[str], data: JSONBody[CloseRequest]) -> SessionInfo:
        return await service.close_session(session_id, data.reward)

    @post("/tasks/{task_id:str}/runs", status_code=201,
          summary="Start an agent-mode run: the service drives a group of trajectories with the model")
    async def start_run(task_id: FromPath[str], data: JSONBody[RunRequest]) -> Response[Any]:
        run = await service.start_run(task_id, data)
        headers = {"Location": f"{API_PREFIX}/runs/{run.id}"}
        if data.stream:
            return Stream(service.run_events(run.id), media_type=_NDJSON, status_code=201, headers=headers)
        return Response(run, status_code=201, headers=headers, media_type=MediaType.JSON)

    @get("/runs/{run_id:str}", summary="An agent-mode run and its trajectories")
    async def get_run(run_id: FromPath[str]) -> RunInfo:
        return service.run_info(run_id)

    @get("/runs/{run_id:str}/events", summary="The run's events, newline-delimited JSON, as they happen")
    async def run_events(run_id: FromPath[str]) -> Stream:
        return Stream(service.run_events(run_id), media_type=_NDJSON)

    @delete("/runs/{run_id:str}", status_code=200, summary="Cancel an agent-mode run and release what it holds")
    async def cancel_run(run_id: FromPath[str]) -> RunInfo:
        return await service.cancel_run(run_id)

    @get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4; charset=utf-8",
         include_in_schema=False)
    async def metrics() -> bytes:
        return service.metrics.exposition()

    api = Router(API_PREFIX, route_handlers=[
        health, stats, register_task, list_tasks, get_task, delete_task, open_group, get_group, close_group,
        get_session, step, close_session, start_run, get_run, run_events, cancel_run,
    ], signature_namespace={"Response": Response, "Stream": Stream})
    return Litestar(
        route_handlers=[api, metrics],
        exception_handlers={BunshinError: lambda request, exc: _error_response(exc)},
        # unexpected errors are logged (logger "litestar"); the process's root logger is left alone
        logging_config=LoggingConfig(configure_root_logger=False, log_exceptions="always"),
        openapi_config=OpenAPIConfig(
            title="Bunshin rollout service", version=__version__,
            description="Environment mode: tasks, groups of forked sessions, steps served from the prefix "
            "tree, a speculative branch or execution. Agent mode: runs whose trajectories the service drives "
            "with an OpenAI-compatible model. See docs/serve.md.",
        ),
    )


class HTTPServer:
    """A running HTTP server (see :func:`open_http_server`).

    Attributes:
        host: The address it listens on.
        port: The port it listens on (the one the kernel picked when 0 was asked).
        url: ``http://HOST:PORT``.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def open_http_server(app: Any, *, host: str = "127.0.0.1", port: int = 0,
                           graceful_timeout: float = 5.0) -> AsyncIterator[HTTPServer]:
    """Serve the ASGI *app* with uvicorn in this event loop (asyncio) until the block exits;
    then stop accepting, give in-flight requests up to *graceful_timeout* seconds, and close.

    Signals are left to the caller (``bunshin serve`` stops on SIGINT and SIGTERM).
    """
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    # keep idle connections longer than clients do (httpx drops them after 5 s, uvicorn's default
    # too): else a client may reuse a connection the server is closing, and a step is lost
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=graceful_timeout, timeout_keep_alive=65)
    server = _Server(config)
    async with anyio.create_task_group() as tg:
        failed: list[BaseException] = []

        stopped = anyio.Event()

        async def run() -> None:
            try:
                await server.serve()
            except BaseException as exc:  # uvicorn exits (SystemExit) when it cannot bind
                failed.append(exc)
            finally:
                server.started = server.started or bool(failed)
                stopped.set()

        tg.start_soon(run)
        while not server.started:
            await anyio.sleep(0.01)
        if failed or not server.servers:
            raise ConfigError(f"cannot serve on {host}:{port}: {_describe(failed[0]) if failed else 'not started'}")
        bound = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield HTTPServer(host, bound)
        finally:
            server.should_exit = True
            with anyio.CancelScope(shield=True):  # its sockets close as it returns
                await stopped.wait()
