"""The scheduler core: training steps of B tasks x G samples, a coroutine per sample.

Each sample asks the policy for its next call (the model thinks meanwhile), then gets the
call's observation in the cheapest correct way:

1. prefix caching: if an earlier sample of the task made the same cacheable calls, the
   prefix tree already holds the observation and the state after it; the call is skipped and
   the sample's workspace is only forked (from the nearest cached state) at its first miss;
2. speculation: while the model thinks, a predicted next call may already be running in a
   fork; if the policy's call matches, that branch is adopted, otherwise it is discarded;
3. otherwise the call runs in the sample's own workspace, a copy-on-write fork of the task's
   initialised workspace (memory sharing).

The scheduler reads time only through anyio, randomness only through ``config.seed``, and
does I/O only through the :class:`Backend` and :class:`Policy` interfaces, so the same code
runs live or in the simulator's virtual time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import anyio
import msgspec
from anyio.abc import TaskGroup

from ._backend import Backend, CallContext, ToolResult, Workspace, WorkspaceMemory
from ._exceptions import BackendError, ConfigError, ModelError, exception_leaves
from ._memory import MemoryAccountant, MemoryStatistics
from ._plugins import (
    CacheabilityPolicy,
    CacheableTools,
    EvictionPolicy,
    SpecContext,
    SpeculationPolicy,
    TailBenefitSpeculation,
    predict_checked,
)
from ._policy import Finish, Observation, Policy, SampleView
from ._selector import Prediction, SpecToolSelector, accepts_contexts
from ._trace import ContextMessage, RolloutKey, Task, ToolCall, call_key
from ._tree import Node, PrefixTree, Tier, TreeStatistics, open_prefix_tree

__all__ = [
    "SchedulerConfig",
    "Scheduler",
    "RunResult",
    "RolloutResult",
    "SpecStatistics",
    "StepRecord",
    "StepTiming",
    "TrainingPlan",
    "plan_steps",
    "run_rollouts",
    "POLICIES",
]

GiB = 1 << 30

POLICIES = ("base", "spec", "full")
"""The seed's three configurations: ``base`` shares memory only, ``spec`` adds speculative
tool execution, ``full`` adds speculation and tool-prefix caching."""


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a run is scheduled. Every field has a default; see :meth:`preset`."""

    batch_tasks: int = 32
    """Groups (tasks) per training step: B."""
    group_size: int | None = None
    """Samples per group, G; None takes every sample the plan has for the group."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: a step starts when the previous one has finished (the trainer waits for
    the whole batch). ``async``: bounded staleness, see ``staleness``."""
    staleness: int = 1
    """In ``async`` mode, step j may start once step j-1-staleness has finished; samples
    then start as slots (``max_concurrent``) free up."""
    max_concurrent: int | None = None
    """Rollouts that may run at once; None is one step's worth (B x G)."""
    train_time: float = 0.0
    """Seconds the trainer takes to update the model after a step's rollouts finish."""
    caching: bool = False
    """Use the tool-prefix tree."""
    coalesce: bool = True
    """With caching: a sample whose call is in flight from the same prefix-tree node in
    another sample (the samples of a group issue the same opening calls at about the same
    moment) waits for that call and takes its result from the tree, instead of running it
    again. Off, each runs it and the tree shares a call only once it has finished."""
    speculation: bool = False
    """Run predicted calls while the model thinks."""
    hot_budget: int = 32 * GiB
    """Bytes of snapshots the prefix tree may keep in memory (see :mod:`._tree`)."""
    cold_budget: int = 256 * GiB
    """Bytes of deltas the prefix tree may keep out of memory."""
    spec_budget: int = 32
    """Speculative branches that may run at once."""
    spec_tail: float = 0.25
    """Speculate only for samples of a step in which at most this share of rollouts still
    runs (the tail that decides when the step ends); 1.0 speculates for every sample."""
    spec_min_confidence: float = 0.3
    """Speculate only on a prediction at least this confident."""
    spec_rule: Literal["benefit", "confidence"] = "benefit"
    """When a confident enough prediction runs (these ``spec_*`` fields are the parameters of
    the default speculation policy, :class:`~bunshin_async.TailBenefitSpeculation`). ``confidence``: whenever it reaches
    ``spec_min_confidence``. ``benefit``: also only when its expected saving beats its
    expected cost, ``c * E > spec_waste_weight * (1 - c) * E + F``, where ``c`` is the
    prediction's confidence, ``E`` the mean execution time of that tool in this run so far
    (``spec_exec_prior`` before any call of it has run) and ``F`` the fork cost
    (``spec_fork_cost``)."""
    spec_waste_weight: float = 1.0
    """In the ``benefit`` rule, what a second of wasted tool time in a discarded branch
    costs, relative to a second saved by an adopted one (below 1 when spare capacity is
    cheap, above when branches compete with real work)."""
    spec_exec_prior: float = 1.0
    """In the ``benefit`` rule, the expected execution time, in seconds, of a tool that has
    not run in this run yet (the mean over tools that have run is used once there is one)."""
    spec_fork_cost: float | None = None
    """In the ``benefit`` rule, the seconds one speculative fork costs; None takes the mean
    time the speculative forks of this run have taken so far (0 before the first)."""
    seed: int = 0
    """Seed of the run's one random stream (tie-breaking; reserved for policies)."""

    @classmethod
    def preset(cls, policy: str, **overrides: object) -> SchedulerConfig:
        """The configuration of one of :data:`POLICIES`, with *overrides* applied."""
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        base = {"caching": policy == "full", "speculation": policy in ("spec", "full")}
        base.update(overrides)
        try:
            cfg = msgspec.convert(base, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad scheduler option: {exc}") from None
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise :class:`ConfigError` if a field is out of range."""
        def bad(name: str, want: str) -> ConfigError:
            return ConfigError(f"scheduler option {name}={getattr(self, name)!r} is invalid; expected {want}")

        if self.batch_tasks < 1:
            raise bad("batch_tasks", "an integer >= 1")
        if self.group_size is not None and self.group_size < 1:
            raise bad("group_size", "an integer >= 1 or None")
        if self.staleness < 0:
            raise bad("staleness", "an integer >= 0")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise bad("max_concurrent", "an integer >= 1 or None")
        if self.train_time < 0:
            raise bad("train_time", "seconds >= 0")
        if self.hot_budget < 0:
            raise bad("hot_budget", "bytes >= 0")
        if self.cold_budget < 0:
            raise bad("cold_budget", "bytes >= 0")
        if self.spec_budget < 0:
            raise bad("spec_budget", "an integer >= 0")
        if not 0.0 <= self.spec_tail <= 1.0:
            raise bad("spec_tail", "a share between 0 and 1")
        if not 0.0 <= self.spec_min_confidence <= 1.0:
            raise bad("spec_min_confidence", "a probability between 0 and 1")
        if self.spec_waste_weight < 0:
            raise bad("spec_waste_weight", "a weight >= 0")
        if self.spec_exec_prior < 0:
            raise bad("spec_exec_prior", "seconds >= 0")
        if self.spec_fork_cost is not None and self.spec_fork_cost < 0:
            raise bad("spec_fork_cost", "seconds >= 0 or None")


class TrainingPlan(msgspec.Struct, frozen=True):
    """The training steps of a run: each a list of groups, each a list of rollouts."""

    steps: list[list[list[tuple[RolloutKey, Task]]]]
    """``steps[j][g]`` is the g-th group of step j: its rollouts, sample order."""

    def epoch_of(self, j: int) -> int:
        """The epoch step *j* belongs to."""
        return self.steps[j][0][0][0].epoch


def plan_steps(planned: Sequence[tuple[RolloutKey, Task]], config: SchedulerConfig) -> TrainingPlan:
    """Cut *planned* rollouts into training steps of ``config.batch_tasks`` groups.

    Groups keep the order in which they first appear; a step never spans two epochs; with
    ``config.group_size`` set, each group keeps its first G samples.

    Raises:
        ConfigError: If a group has fewer samples than ``config.group_size``.
    """
    groups: dict[tuple[int, str, int], list[tuple[RolloutKey, Task]]] = {}
    for key, task in planned:
        groups.setdefault((key.epoch, key.task, key.group), []).append((key, task))
    steps: list[list[list[tuple[RolloutKey, Task]]]] = []
    cur: list[list[tuple[RolloutKey, Task]]] = []
    cur_epoch: int | None = None
    for (epoch, task_id, group), members in groups.items():
        members.sort(key=lambda kt: kt[0].sample)
        if config.group_size is not None:
            if len(members) < config.group_size:
                raise ConfigError(
                    f"group_size={config.group_size} but group e{epoch}/{task_id}/g{group} has only "
                    f"{len(members)} samples; lower group_size"
                )
            members = members[: config.group_size]
        if cur and (len(cur) == config.batch_tasks or epoch != cur_epoch):
            steps.append(cur)
            cur = []
        cur.append(members)
        cur_epoch = epoch
    if cur:
        steps.append(cur)
    return TrainingPlan(steps)


class StepRecord(msgspec.Struct, frozen=True):
    """How one call of a sample was served."""

    call: ToolCall
    """The call the policy made."""
    result: ToolResult
    """Its result (without the output bytes): for a cache hit, the result recorded when the
    call first ran; the observation is the one the sample was shown."""
    source: Literal["executed", "cache", "speculation"]
    """``executed`` in the sample's workspace, ``cache`` from the prefix tree, or
    ``speculation`` from an adopted speculative branch."""
    issued: float
    """When the policy emitted the call (seconds since the run began)."""
    served: float
    """When the sample had its observation."""


class RolloutResult(msgspec.Struct, frozen=True):
    """How one rollout went."""

    key: RolloutKey
    """Which rollout."""
    status: Literal["done", "cancelled", "failed"]
    """``done`` when the policy finished it, ``cancelled`` when it was cancelled, ``failed``
    when the backend could not carry out one of its operations (see ``error``); the other
    rollouts go on."""
    start: float
    """When the sample started (seconds since the run began)."""
    end: float
    """When it finished or was cancelled."""
    reward: float | None
    """The reward, None if cancelled."""
    observations: list[str]
    """Digest of each observation the sample was shown, in order."""
    steps: list[StepRecord]
    """How each call was served, in order."""
    cache_hits: int
    """Calls skipped because the prefix tree held their result."""
    spec_hits: int
    """Calls whose result came from an adopted speculative branch."""
    executed: int
    """Calls run in the sample's own workspace."""
    memory: WorkspaceMemory | None
    """The sample's workspace memory just before release (None if it never needed one)."""
    error: str | None = None
    """Why a ``failed`` rollout failed (the backend's error), else None."""


class SpecStatistics(msgspec.Struct, frozen=True):
    """What speculation did over a run."""

    launched: int
    """Speculative branches started."""
    hits: int
    """Branches adopted because the policy's call matched."""
    misses: int
    """Branches discarded because it did not (or the sample finished)."""
    errors: int
    """Branches that failed in the backend (discarded; the call then ran normally)."""
    wasted_exec_seconds: float
    """Tool execution time spent in discarded branches."""
    hidden_exec_seconds: float
    """Tool execution time of adopted branches that overlapped the model's thinking (the
    part the sample did not wait for)."""
    peak_active: int = 0
    """The most branches that ran at once (never above ``spec_budget``)."""


class StepTiming(msgspec.Struct, frozen=True):
    """When one training step ran."""

    epoch: int
    """Its epoch."""
    start: float
    """When the step was allowed to start (the previous step, or the one ``staleness``
    before it, had ended); its rollouts may then still wait for slots."""
    end: float
    """When its last rollout ended (before training time)."""
    rollouts: int
    """Rollouts in the step."""


class RunResult(msgspec.Struct, frozen=True):
    """Everything a run measured."""

    engine: str
    """The backend's fork engine."""
    config: SchedulerConfig
    """The configuration."""
    makespan: float
    """Seconds from start to the last step's end."""
    epoch_times: dict[int, float]
    """Per epoch, seconds from its first step's start to its last step's end."""
    steps: list[StepTiming]
    """Per training step."""
    rollouts: list[RolloutResult]
    """Per rollout, in plan order."""
    memory: MemoryStatistics
    """Working set peak and integral."""
    memory_timeline: list[tuple[float, int]]
    """``(seconds, bytes)`` at every change of the working set."""
    running_timeline: list[tuple[float, int]]
    """``(seconds, rollouts still running)`` at every change."""
    tree: TreeStatistics | None
    """Prefix-tree statistics (None without caching)."""
    spec: SpecStatistics
    """Speculation statistics."""
    cacheable_calls: int
    """Calls of cacheable tools the policy made."""
    prepared: int
    """Forks of cold or evicted prefix-tree nodes made while the model was thinking."""
    prepared_used: int
    """Of those, the ones a sample then used (its next call missed the tree)."""
    calls: int
    """Calls the policy made in all."""

    @property
    def cache_hit_rate(self) -> float:
        """Share of cacheable calls answered by the prefix tree."""
        hits = sum(r.cache_hits for r in self.rollouts)
        return hits / self.cacheable_calls if self.cacheable_calls else 0.0


class _Branch:
    __slots__ = ("call", "key", "scope", "done", "ws", "result", "exec_start", "end", "error")

    def __init__(self, call: ToolCall) -> None:
        self.call = call
        self.key = call_key(call)
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.ws: Workspace | None = None
        self.result: ToolResult | None = None
        self.exec_start: float | None = None
        self.end: float | None = None
        self.error: BaseException | None = None


class _Prep:
    """A fork of a cold or evicted prefix-tree node being made while the model thinks."""

    __slots__ = ("node", "scope", "done", "ws")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.ws: Workspace | None = None


class _Sample:
    """What one running sample holds."""

    __slots__ = ("key", "task", "root", "node", "on_tree", "ws", "ws_node", "branch", "prep",
                 "finish", "calls", "obs", "heard", "records", "hits", "spec_hits", "executed")

    def __init__(self, key: RolloutKey, task: Task, root: Node, on_tree: bool) -> None:
        self.key = key
        self.task = task
        self.root = root
        self.node = root  # the prefix-tree state the sample is in (while on the tree)
        self.on_tree = on_tree
        self.ws: Workspace | None = None  # its own live workspace, made at first need
        self.ws_node: Node | None = None  # the node ``ws`` is in the state of (on the tree)
        self.branch: _Branch | None = None  # its speculative branch, if one runs
        self.prep: _Prep | None = None  # a fork of ``node`` being made ahead of need
        self.finish: Finish | None = None
        self.calls: list[ToolCall] = []
        self.obs: list[Observation] = []
        self.heard: list[tuple[ContextMessage, ...]] = []  # the conversation before each call
        self.records: list[StepRecord] = []
        self.hits = 0
        self.spec_hits = 0
        self.executed = 0


class _StepState:
    """A training step's rollouts: how many, and how many have not finished (queued for a
    slot or running); speculation is for the step's tail."""

    __slots__ = ("size", "unfinished")

    def __init__(self, size: int) -> None:
        self.size = size
        self.unfinished = size


class Scheduler:
    """Runs a training plan against a backend with a policy.

    Args:
        backend: Where workspaces live (:class:`sim.SimBackend` or a live backend).
        policy: Produces the calls (a :class:`TracePolicy` replays a trace).
        config: Scheduling options.
        selector: Predicts next calls for speculation (required when it is on).
        cacheable: Says which calls may be cached and speculated; by default none.
        eviction: Chooses the snapshots that leave the prefix tree's tiers; by default
            :class:`~bunshin_async.LRUEviction`.
        speculation: Decides when and what to run ahead; by default
            :class:`~bunshin_async.TailBenefitSpeculation` (parameters from *config*).
        plan: The training steps; by default :func:`plan_steps` over ``policy.planned()``.
        on_progress: Called with ``(finished, total)`` rollouts each time one ends.
        on_step: Called with ``(rollout, record)`` each time a sample's call has been served,
            before the policy is asked for the next one.
        tree: A prefix tree opened by the caller (:func:`open_prefix_tree`) to use instead of
            one opened for this run, so that runs share cached prefixes (a long-running
            service); its own budgets and eviction policy apply, *config*'s ``hot_budget``,
            ``cold_budget`` and *eviction* are ignored, and it stays open after the run.
    """

    def __init__(
        self,
        backend: Backend,
        policy: Policy,
        config: SchedulerConfig,
        *,
        selector: SpecToolSelector | None = None,
        cacheable: CacheabilityPolicy | None = None,
        eviction: EvictionPolicy | None = None,
        speculation: SpeculationPolicy | None = None,
        plan: TrainingPlan | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_step: Callable[[RolloutKey, StepRecord], None] | None = None,
        tree: PrefixTree | None = None,
    ) -> None:
        config.check()
        if config.speculation and selector is None:
            raise ConfigError("speculation is on but no selector was given; pass selector=HistorySelector()")
        self._backend = backend
        self._policy = policy
        self._cfg = config
        self._selector = selector
        self._cacheability = cacheable if cacheable is not None else CacheableTools()
        self._eviction = eviction
        self._speculation = speculation if speculation is not None else TailBenefitSpeculation()
        for name, obj, base in (
            ("cacheable", cacheable, CacheabilityPolicy),
            ("eviction", eviction, EvictionPolicy),
            ("speculation", speculation, SpeculationPolicy),
            ("selector", selector, SpecToolSelector),
        ):
            if obj is not None and not isinstance(obj, base):
                raise ConfigError(f"{name}={obj!r} is not a {base.__name__} instance")
        self._plan = plan if plan is not None else plan_steps(policy.planned(), config)
        if not self._plan.steps:
            raise ConfigError("the plan has no rollouts to run")
        self._scopes: dict[RolloutKey, anyio.CancelScope] = {}
        self._samples: dict[RolloutKey, _Sample] = {}
        self._results: dict[RolloutKey, RolloutResult] = {}
        self._tree: PrefixTree | None = None
        self._acct: MemoryAccountant | None = None
        self._t0 = 0.0
        self._running = 0
        self._running_tl: list[tuple[float, int]] = []
        self._spec_active = 0
        self._exec_seen: dict[str, list[float]] = {}  # tool -> [total seconds, calls]
        self._fork_seen = [0.0, 0]  # speculative forks: total seconds, count
        self._spec = dict(launched=0, hits=0, misses=0, errors=0, wasted=0.0, hidden=0.0, peak=0)
        self._calls = 0
        self._cacheable_calls = 0
        self._prepared = 0
        self._prepared_used = 0
        self._steps: list[StepTiming | None] = [None] * len(self._plan.steps)
        self._on_progress = on_progress
        self._on_step = on_step
        self._shared_tree = tree
        self._total = sum(len(g) for step in self._plan.steps for g in step)

    # -- public ----------------------------------------------------------------------------

    @property
    def plan(self) -> TrainingPlan:
        """The training steps this scheduler runs."""
        return self._plan

    def cancel(self, rollout: RolloutKey) -> bool:
        """Cancel a running rollout; everything it holds is released. Returns False if it is
        not running."""
        scope = self._scopes.get(rollout)
        if scope is None:
            return False
        scope.cancel()
        return True

    def running(self) -> list[RolloutKey]:
        """Rollouts running now."""
        return list(self._scopes)

    def workspaces(self) -> list[Workspace]:
        """The live workspaces the running samples hold now: their own and their speculative
        branches' (prepared forks and the prefix tree's snapshots are not counted)."""
        out = []
        for s in self._samples.values():
            for ws in (s.ws, s.branch.ws if s.branch is not None else None):
                if ws is not None and not ws.released:
                    out.append(ws)
        return out

    def result(self, rollout: RolloutKey) -> RolloutResult | None:
        """The result of *rollout* once it has ended (everything it held is released by
        then), else None; usable while the run goes on, from ``on_progress`` for example."""
        return self._results.get(rollout)

    async def run(self) -> RunResult:
        """Run every step of the plan and return what was measured."""
        cfg = self._cfg
        self._t0 = anyio.current_time()
        self._acct = MemoryAccountant(0.0)
        self._running_tl = [(0.0, 0)]
        self._sample_memory()
        per_step = max(sum(len(g) for g in step) for step in self._plan.steps)
        limiter = anyio.CapacityLimiter(cfg.max_concurrent or per_step)
        done = [anyio.Event() for _ in self._plan.steps]
        if self._shared_tree is not None:
            tree = self._tree = self._shared_tree
            async with anyio.create_task_group() as tg:
                for j in range(len(self._plan.steps)):
                    tg.start_soon(self._run_step, j, done, limiter)
        else:
            async with open_prefix_tree(
                self._backend,
                hot_budget=cfg.hot_budget if cfg.caching else 0,
                cold_budget=cfg.cold_budget if cfg.caching else 0,
                on_change=self._sample_memory,
                eviction=self._eviction,
            ) as tree:
                self._tree = tree
                async with anyio.create_task_group() as tg:
                    for j in range(len(self._plan.steps)):
                        tg.start_soon(self._run_step, j, done, limiter)
        self._sample_memory()
        now = self._now()
        steps = [s for s in self._steps if s is not None]
        epochs: dict[int, tuple[float, float]] = {}
        for s in steps:
            a, b = epochs.get(s.epoch, (s.start, s.end))
            epochs[s.epoch] = (min(a, s.start), max(b, s.end))
        order = [key for step in self._plan.steps for g in step for key, _ in g]
        sp = self._spec
        return RunResult(
            engine=self._backend.engine,
            config=cfg,
            makespan=max((s.end for s in steps), default=0.0),
            epoch_times={e: b - a for e, (a, b) in sorted(epochs.items())},
            steps=steps,
            rollouts=[self._results[k] for k in order if k in self._results],
            memory=self._acct.statistics(now),
            memory_timeline=self._acct.timeline(),
            running_timeline=self._running_tl,
            tree=tree.statistics() if cfg.caching else None,
            spec=SpecStatistics(
                launched=sp["launched"], hits=sp["hits"], misses=sp["misses"], errors=sp["errors"],
                wasted_exec_seconds=sp["wasted"], hidden_exec_seconds=sp["hidden"],
                peak_active=sp["peak"],
            ),
            cacheable_calls=self._cacheable_calls,
            prepared=self._prepared,
            prepared_used=self._prepared_used,
            calls=self._calls,
        )

    # -- internals -------------------------------------------------------------------------

    def _now(self) -> float:
        return anyio.current_time() - self._t0

    def _sample_memory(self) -> None:
        if self._acct is not None:
            self._acct.sample(self._now(), self._backend.working_set())

    async def _release(self, ws: Workspace | None) -> None:
        if ws is not None and not ws.released:
            with anyio.CancelScope(shield=True):
                await self._backend.release(ws)
                self._sample_memory()

    async def _run_step(self, j: int, done: list[anyio.Event], limiter: anyio.CapacityLimiter) -> None:
        cfg = self._cfg
        wait_for = j - 1 if cfg.mode == "sync" else j - 1 - cfg.staleness
        if wait_for >= 0:
            await done[wait_for].wait()
        groups = self._plan.steps[j]
        state = _StepState(sum(len(g) for g in groups))
        start = self._now()
        async with anyio.create_task_group() as tg:
            for group in groups:
                tg.start_soon(self._run_group, group, state, limiter)
        self._steps[j] = StepTiming(self._plan.epoch_of(j), start, self._now(), state.size)
        if cfg.train_time:
            await anyio.sleep(cfg.train_time)
        done[j].set()

    async def _run_group(self, group: list[tuple[RolloutKey, Task]], state: _StepState, limiter: anyio.CapacityLimiter) -> None:
        assert self._tree is not None
        task = group[0][1]
        root = await self._tree.acquire_root(task)
        try:
            async with anyio.create_task_group() as tg:
                for key, _ in group:
                    tg.start_soon(self._run_sample, _Sample(key, task, root, self._cfg.caching), state, limiter)
        finally:
            await self._tree.release_root(root, keep=self._cfg.caching)

    async def _run_sample(self, s: _Sample, state: _StepState, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            scope = anyio.CancelScope()
            self._scopes[s.key] = scope
            self._samples[s.key] = s
            start = self._now()
            self._set_running(+1)
            error: str | None = None
            try:
                with scope:
                    await self._sample_loop(s, state)
            except* (BackendError, ModelError) as group:  # this sample fails; the batch goes on
                error = "; ".join(f"{type(e).__name__}: {e}" for e in exception_leaves(group))
            finally:
                state.unfinished -= 1
                self._set_running(-1)
                del self._scopes[s.key]
                del self._samples[s.key]
                mem = None
                if s.ws is not None and not s.ws.released:
                    try:
                        mem = self._backend.workspace_memory(s.ws)
                    except BackendError:
                        mem = None
                    ws, s.ws = s.ws, None
                    await self._release(ws)
                if s.branch is not None:
                    await self._discard(s)
                await self._drop_prep(s)
                self._results[s.key] = RolloutResult(
                    key=s.key,
                    status="done" if s.finish is not None else "failed" if error else "cancelled",
                    start=start,
                    end=self._now(),
                    reward=s.finish.reward if s.finish is not None else None,
                    observations=[o.digest for o in s.obs],
                    steps=s.records,
                    cache_hits=s.hits,
                    spec_hits=s.spec_hits,
                    executed=s.executed,
                    memory=mem,
                    error=error,
                )
                if self._on_progress is not None:
                    self._on_progress(len(self._results), self._total)

    def _record(self, s: _Sample, call: ToolCall, result: ToolResult, source: str, issued: float) -> None:
        if result.output is not None:
            result = msgspec.structs.replace(result, output=None)
        record = StepRecord(call, result, source, issued - self._t0, self._now())  # type: ignore[arg-type]
        s.records.append(record)
        if self._on_step is not None:
            self._on_step(s.key, record)

    def _set_running(self, delta: int) -> None:
        self._running += delta
        t = self._now()
        if self._running_tl and self._running_tl[-1][0] == t:
            self._running_tl[-1] = (t, self._running)
        else:
            self._running_tl.append((t, self._running))

    async def _sample_loop(self, s: _Sample, state: _StepState) -> None:
        assert self._tree is not None
        tree = self._tree
        async with anyio.create_task_group() as tg:
            while True:
                self._maybe_prepare(tg, s)
                view = SampleView(s.key, s.task, tuple(s.calls), tuple(s.obs))
                if self._selector is not None:  # only the selector listens
                    s.heard.append(self._policy.heard(view))
                self._maybe_speculate(tg, s, state)
                action = await self._policy.act(view)
                acted = anyio.current_time()
                if isinstance(action, Finish):
                    if s.branch is not None:
                        await self._discard(s)
                    await self._drop_prep(s)
                    s.finish = action
                    break
                call = action
                key = call_key(call)
                step = len(s.calls)
                self._calls += 1
                cacheable = self._cacheability.cacheable(s.task, call)
                self._cacheable_calls += cacheable
                result: ToolResult | None = None
                # 1. the prefix tree (after the same call in flight from here, if any,
                # unless a speculative branch runs it for this sample)
                coalesce = s.on_tree and cacheable and self._cfg.coalesce
                if coalesce and not (s.branch is not None and s.branch.key == key):
                    await tree.wait_running(s.node, call)
                if s.on_tree and cacheable:
                    child = tree.lookup(s.node, call)
                    if child is not None and child.observation is not None:
                        if s.branch is not None:
                            await self._discard(s)
                        await self._drop_prep(s)
                        s.node = child
                        s.hits += 1
                        s.calls.append(call)
                        s.obs.append(child.observation)
                        if child.result is not None:
                            self._record(s, call, child.result, "cache", acted)
                        continue
                # 2. an adopted speculative branch
                if s.branch is not None:
                    branch = s.branch
                    # adopt a matching branch once its call runs; one still forking (a slow
                    # engine) would only delay the call, so it is discarded instead
                    match = branch.key == key and branch.exec_start is not None
                    if match:
                        await branch.done.wait()
                    if match and branch.result is not None and branch.ws is not None:
                        s.branch = None
                        result = branch.result
                        await self._release(s.ws)
                        s.ws, branch.ws = branch.ws, None
                        s.ws_node = None
                        source = "speculation"
                        self._spec["hits"] += 1
                        assert branch.exec_start is not None
                        self._spec["hidden"] += max(0.0, min(result.exec_time, acted - branch.exec_start))
                        s.spec_hits += 1
                    else:
                        await self._discard(s)
                # 3. run it in the sample's own workspace (in flight until its node is in)
                if result is None:
                    source = "executed"
                    with tree.running(s.node, call) if coalesce else contextlib.nullcontext():
                        if s.ws is None or (s.on_tree and s.ws_node is not s.node):
                            ws, s.ws = s.ws, None
                            await self._release(ws)
                            s.ws = await self._take_prep(s)
                            if s.ws is None:
                                s.ws = await tree.fork(s.node, s.key)
                            s.ws_node = s.node
                        result = await self._backend.execute(s.ws, call, CallContext(s.key, step))
                        self._sample_memory()
                        s.executed += 1
                        self._note_exec(call, result)
                        await self._advance(s, call, result, cacheable)
                else:
                    await self._advance(s, call, result, cacheable)
                s.calls.append(call)
                s.obs.append(Observation(result.observation_digest, result.observation_size, result.output))
                self._record(s, call, result, source, acted)
        if self._selector is not None:
            if any(s.heard) and accepts_contexts(self._selector, "observe"):
                self._selector.observe(s.task.id, s.calls, contexts=s.heard[:len(s.calls)])
            else:
                self._selector.observe(s.task.id, s.calls)

    async def _advance(self, s: _Sample, call: ToolCall, result: ToolResult, cacheable: bool) -> None:
        """Move *s* down the prefix tree past *call* (inserting its node), or off the tree
        if the call is not cacheable."""
        if not s.on_tree:
            return
        if cacheable:
            assert self._tree is not None
            s.node = await self._tree.insert(s.node, call, result, s.ws)
            s.ws_node = s.node
        else:
            s.on_tree = False

    def _maybe_prepare(self, tg: TaskGroup, s: _Sample) -> None:
        """While the model thinks, rebuild the sample's state if it sits on a cold or evicted
        node and has no workspace there: if its next call misses, the fork is ready."""
        if not s.on_tree or s.prep is not None or s.node.tier is Tier.HOT:
            return
        if s.ws is not None and s.ws_node is s.node:
            return
        prep = _Prep(s.node)
        s.prep = prep
        tg.start_soon(self._prepare, prep, s.key)

    async def _prepare(self, prep: _Prep, key: RolloutKey) -> None:
        assert self._tree is not None
        try:
            with prep.scope:
                prep.ws = await self._tree.fork(prep.node, key)
                self._prepared += 1
        finally:
            prep.done.set()

    async def _take_prep(self, s: _Sample) -> Workspace | None:
        """The prepared fork of ``s.node``, waiting for it if it is still being made."""
        prep = s.prep
        if prep is None:
            return None
        if prep.node is not s.node:
            await self._drop_prep(s)
            return None
        await prep.done.wait()  # cancelled here, the sample's cleanup still finds s.prep
        s.prep = None
        ws, prep.ws = prep.ws, None
        if ws is not None:
            self._prepared_used += 1
        return ws

    async def _drop_prep(self, s: _Sample) -> None:
        prep, s.prep = s.prep, None
        if prep is None:
            return
        prep.scope.cancel()
        with anyio.CancelScope(shield=True):
            await prep.done.wait()
        ws, prep.ws = prep.ws, None
        await self._release(ws)

    def _note_exec(self, call: ToolCall, result: ToolResult) -> None:
        """Remember how long *call*'s tool ran (for the speculation rule)."""
        seen = self._exec_seen.setdefault(call.name, [0.0, 0])
        seen[0] += result.exec_time
        seen[1] += 1

    def _maybe_speculate(self, tg: TaskGroup, s: _Sample, state: _StepState) -> None:
        """While the model thinks, ask the speculation policy whether to run one of the
        selector's predictions in a fork; it is offered only predictions the cacheability
        policy allows and the prefix tree does not answer already, and its answer is checked
        against its contract (:class:`~bunshin_async.SpeculationPolicy`)."""
        cfg = self._cfg
        if not cfg.speculation or self._selector is None:
            return
        policy = self._speculation
        k = max(1, policy.top_k)

        def predict() -> list[Prediction]:
            assert self._selector is not None
            preds = predict_checked(self._selector, s.task.id, s.calls, k, s.obs, s.heard)
            return [
                p for p in preds
                if self._cacheability.cacheable(s.task, p.call)
                and not (s.on_tree and call_key(p.call) in s.node.children)  # the tree answers it anyway
            ]

        ctx = SpecContext(
            rollout=s.key, task=s.task, calls=tuple(s.calls), observations=tuple(s.obs),
            predict=predict, step_size=state.size, unfinished=state.unfinished,
            active=self._spec_active, budget=cfg.spec_budget, config=cfg,
            exec_seen=self._exec_seen, fork_seen=self._fork_seen,
        )
        choice = policy.choose(ctx)
        if choice is None:
            return
        call = ctx.check_choice(policy, choice).call
        source: Workspace | Node
        if s.ws is not None and (not s.on_tree or s.ws_node is s.node):
            source = s.ws
        elif s.on_tree:
            source = s.node
        elif s.ws is None:
            source = s.root
        else:
            return
        branch = _Branch(call)
        s.branch = branch
        self._spec["launched"] += 1
        self._spec_active += 1
        self._spec["peak"] = max(self._spec["peak"], self._spec_active)
        tg.start_soon(self._speculate, branch, source, s.key, len(s.calls))

    async def _speculate(self, branch: _Branch, source: Workspace | Node, key: RolloutKey, step: int) -> None:
        assert self._tree is not None
        try:
            with branch.scope:
                started = anyio.current_time()
                if isinstance(source, Node):
                    branch.ws = await self._tree.fork(source, key)
                else:
                    branch.ws = await self._backend.fork(source)
                self._sample_memory()
                branch.exec_start = anyio.current_time()
                self._fork_seen[0] += branch.exec_start - started
                self._fork_seen[1] += 1
                branch.result = await self._backend.execute(
                    branch.ws, branch.call, CallContext(key, step, "speculate")
                )
                self._note_exec(branch.call, branch.result)
                self._sample_memory()
        except BackendError as exc:
            branch.error = exc
            self._spec["errors"] += 1
        finally:
            self._spec_active -= 1
            branch.end = anyio.current_time()
            branch.done.set()

    async def _discard(self, s: _Sample) -> None:
        branch, s.branch = s.branch, None
        assert branch is not None
        branch.scope.cancel()
        with anyio.CancelScope(shield=True):
            await branch.done.wait()
        if branch.exec_start is not None and branch.end is not None:
            self._spec["wasted"] += branch.end - branch.exec_start
        if branch.error is None:
            self._spec["misses"] += 1
        ws, branch.ws = branch.ws, None
        await self._release(ws)


async def run_rollouts(backend: Backend, policy: Policy, config: SchedulerConfig, **options: Any) -> RunResult:
    """Run *policy*'s rollouts on *backend* and return the result; *options* are the keyword
    arguments of :class:`Scheduler` (``selector``, ``cacheable``, ``plan``, ``on_progress``)."""
    return await Scheduler(backend, policy, config, **options).run()
