"""A rule-based state machine that drives scheduling policies through random sequences of
group starts and ends, forks, cache hits and misses, evictions, speculation and cancellation.

The machine plays the scheduler's part by hand against a real :class:`~bunshin_async.PrefixTree`
over a simulated backend, in virtual time, so hypothesis can interleave operations in orders a
replay would rarely produce and shrink a failure to a handful of steps. After every step it
checks the tree's invariants (budgets, tiers monotone down the tree, every backend handle owned
by someone) and that every observation a sample is shown is the one its own execution would
have returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .._backend import CallContext, Workspace
from .._plugins import LRUEviction, RecordedCacheability, SpecContext, TailBenefitSpeculation, predict_checked
from .._policy import Observation
from .._scheduler import SchedulerConfig
from .._selector import HistorySelector, Prediction
from .._trace import RolloutKey, ToolCall, Trace, call_key
from .._tree import Node, PrefixTree, Tier
from ._invariants import InvariantViolation, PolicySet
from ._strategies import CLOCK_TOOL, traces

__all__ = ["policy_machine"]

MiB = 1 << 20


class _Sample:
    def __init__(self, key: RolloutKey, group: _Group) -> None:
        self.key = key
        self.group = group
        self.node: Node = group.root
        self.on_tree = True
        self.ws: Workspace | None = None
        self.ws_node: Node | None = None
        self.calls: list[ToolCall] = []
        self.obs: list[Observation] = []
        self.branch: tuple[ToolCall, Workspace, Any] | None = None


class _Group:
    def __init__(self, root: Node) -> None:
        self.root = root
        self.samples: list[_Sample] = []


def policy_machine(
    policies: PolicySet, *, engine: str = "bunshin", on_start: Callable[[Trace], None] | None = None
) -> type[RuleBasedStateMachine]:
    """A state machine class (run it with ``hypothesis.stateful.run_state_machine_as_test``)
    that drives the policies of *policies* (defaults in the other slots) on the simulated
    *engine*; *on_start* is called with each run's trace."""

    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop: asyncio.AbstractEventLoop | None = None
            self.tree: PrefixTree | None = None
            self.groups: list[_Group] = []
            self.active = 0

        # -- plumbing ------------------------------------------------------------------

        def _await(self, coro: Any) -> Any:
            assert self.loop is not None
            return self.loop.run_until_complete(coro)

        def _settle(self) -> None:
            """Let background demotions finish (virtual time jumps an hour ahead)."""
            self._await(anyio.sleep(3600))

        @initialize(
            # every sample repeats its task's calls (the rules diverge from them), and one call in
            # three reads the clock: sequences where caching or speculation could go wrong
            trace=traces(max_tasks=2, max_group=3, max_epochs=1, max_steps=4, repetition=1.0,
                         tools=("read", "shell", CLOCK_TOOL)),
            hot_budget=st.sampled_from([0, 8 * MiB, 64 * MiB, 1 << 40]),
            cold_budget=st.sampled_from([0, 16 * MiB, 1 << 40]),
            spec_budget=st.integers(0, 3),
        )
        def setup(self, trace: Trace, hot_budget: int, cold_budget: int, spec_budget: int) -> None:
            from sim import SimBackend, ToolModel, VirtualTimeLoop

            if on_start is not None:
                on_start(trace)
            made = policies.make()
            self.cacheability = made.get("cacheability") or RecordedCacheability()
            self.cacheability.fit(trace)
            self.speculation = made.get("speculation") or TailBenefitSpeculation()
            self.selector = made.get("selector") or HistorySelector()
            for r in trace.rollouts:  # the recorded rollouts are the history it predicts from
                self.selector.observe(r.task, [x.call for x in r.steps])
            self.config = SchedulerConfig.preset("full", hot_budget=hot_budget, cold_budget=cold_budget,
                                                 spec_budget=spec_budget, spec_tail=1.0)
            self.trace = trace
            self.rollouts = {t.id: [r for r in trace.rollouts if r.task == t.id] for t in trace.tasks}
            self.backend = SimBackend(engine, ToolModel(trace))
            self.model = ToolModel(trace)
            self.loop = VirtualTimeLoop()
            asyncio.set_event_loop(self.loop)
            ready = asyncio.Event()
            self.stop = asyncio.Event()
            eviction = made.get("eviction") or LRUEviction()

            async def hold() -> None:
                from .._tree import open_prefix_tree

                async with open_prefix_tree(self.backend, hot_budget=hot_budget, cold_budget=cold_budget,
                                            eviction=eviction) as tree:
                    self.tree = tree
                    ready.set()
                    await self.stop.wait()

            self.holder = self.loop.create_task(hold())
            self._await(ready.wait())

        def teardown(self) -> None:
            if self.loop is None:
                return
            try:
                if self.tree is not None and not self.holder.done():
                    for g in list(self.groups):
                        self._end(g)
                    self.stop.set()
                    self._await(self.holder)
                    self._await(self.backend.aclose())
                    if self.backend.live_handles() or self.backend.working_set():
                        raise InvariantViolation(
                            f"{self.backend.live_handles()} handle(s) and {self.backend.working_set()} bytes "
                            "left alive after every group ended and the tree closed"
                        )
            finally:
                self.holder.cancel()
                try:
                    self.loop.run_until_complete(asyncio.sleep(0))
                finally:
                    asyncio.set_event_loop(None)
                    self.loop.close()

        # -- rules ---------------------------------------------------------------------

        @rule(data=st.data())
        def start_group(self, data: st.DataObject) -> None:
            """A training step starts a group: its task's root is acquired (booted, promoted
            or found hot) and pinned."""
            assert self.tree is not None
            task = data.draw(st.sampled_from(self.trace.tasks))
            root = self._await(self.tree.acquire_root(task))
            self.groups.append(_Group(root))

        @precondition(lambda self: bool(self.groups))
        @rule(data=st.data())
        def new_sample(self, data: st.DataObject) -> None:
            """A sample of a running group starts at its root, as one of the task's recorded
            rollouts (whose calls it then mostly makes)."""
            g = data.draw(st.sampled_from(self.groups))
            r = data.draw(st.sampled_from(self.rollouts[g.root.task.id]))
            g.samples.append(_Sample(r.key, g))

        @precondition(lambda self: any(g.samples for g in self.groups))
        @rule(data=st.data())
        def step(self, data: st.DataObject) -> None:
            """A sample makes its next call: served from the tree (a hit), from an adopted
            speculative branch, or run in its own fork (a miss, inserted when cacheable)."""
            s = self._pick(data)
            recorded = next(r for r in self.trace.rollouts if r.key == s.key).steps
            i = len(s.calls)
            if i < len(recorded) and data.draw(st.booleans(), label="follow the recording"):
                call = recorded[i].call
            else:
                pool = [st_.call for r in self.rollouts[s.key.task] for st_ in r.steps]
                call = data.draw(st.sampled_from(pool), label="another call of the task")
            self._await(self._step(s, call))

        @precondition(lambda self: any(g.samples for g in self.groups))
        @rule(data=st.data())
        def think(self, data: st.DataObject) -> None:
            """A sample's model starts thinking: the speculation policy may run a predicted
            call ahead in a fork."""
            s = self._pick(data)
            if s.branch is None:
                self._await(self._maybe_speculate(s))

        @precondition(lambda self: any(g.samples for g in self.groups))
        @rule(data=st.data())
        def finish_or_cancel(self, data: st.DataObject) -> None:
            """A sample ends (finished, or cancelled midway): everything it holds is released
            and, if it finished, the selector learns from it."""
            s = self._pick(data)
            finished = data.draw(st.booleans(), label="finished (not cancelled)")
            self._await(self._drop(s))
            s.group.samples.remove(s)
            if finished:
                self.selector.observe(s.key.task, s.calls, observations=s.obs)

        @precondition(lambda self: any(not g.samples for g in self.groups))
        @rule(data=st.data())
        def end_group(self, data: st.DataObject) -> None:
            """A group whose samples all ended unpins its root, which stays in the tree if it
            fits (groups still running at the end are ended with their samples cancelled)."""
            self._end(data.draw(st.sampled_from([g for g in self.groups if not g.samples])))

        # -- invariants ----------------------------------------------------------------

        @invariant()
        def tree_is_consistent(self) -> None:
            if self.tree is None:
                return
            self._settle()
            st_ = self.tree.statistics()
            if st_.hot_bytes > self.config.hot_budget or st_.hot_bytes_peak > self.config.hot_budget:
                raise InvariantViolation(f"hot tier at {st_.hot_bytes} (peak {st_.hot_bytes_peak}) bytes, budget {self.config.hot_budget}")
            if st_.cold_bytes_peak > self.config.cold_budget:
                raise InvariantViolation(f"cold tier peaked at {st_.cold_bytes_peak} bytes, budget {self.config.cold_budget}")
            held = 0
            for n in self.tree.nodes():
                p = n.parent
                if n.tier is Tier.HOT and p is not None and p.tier is not Tier.HOT:
                    raise InvariantViolation(f"{n!r} is hot under {p!r}: tiers must not get hotter down the tree")
                if n.tier is Tier.COLD and p is not None and p.tier not in (Tier.HOT, Tier.COLD):
                    raise InvariantViolation(f"{n!r} is cold under {p!r}: its delta has nothing to apply to")
                held += (n.snapshot is not None) + (n.cold is not None)
            mine = sum((s.ws is not None) + (s.branch is not None) for g in self.groups for s in g.samples)
            if self.backend.live_handles() != held + mine:
                raise InvariantViolation(
                    f"the backend holds {self.backend.live_handles()} handles; the tree owns {held} and "
                    f"the samples {mine}: a handle was leaked or released twice"
                )
            if self.active > self.config.spec_budget:
                raise InvariantViolation(f"{self.active} speculative branches at once, budget {self.config.spec_budget}")

        # -- the scheduler's part, by hand ---------------------------------------------

        def _pick(self, data: st.DataObject) -> _Sample:
            return data.draw(st.sampled_from([s for g in self.groups for s in g.samples]))

        def _ctx(self, s: _Sample) -> CallContext:
            return CallContext(s.key, len(s.calls))

        def _truth(self, s: _Sample, call: ToolCall) -> str:
            """The observation *call* returns in *s*'s own workspace (its own recording)."""
            hist = [call_key(c) for c in s.calls]
            return self.model.outcome(s.key.task, hist, call, self._ctx(s)).observation_digest

        async def _step(self, s: _Sample, call: ToolCall) -> None:
            assert self.tree is not None
            cacheable = self.cacheability.cacheable(s.group.root.task, call)
            obs: Observation | None = None
            if s.on_tree and cacheable:
                child = self.tree.lookup(s.node, call)
                if child is not None and child.observation is not None:
                    await self._discard(s)
                    s.node, obs = child, child.observation
            if obs is None:
                if s.branch is not None and s.branch[0] == call:
                    _, ws, result = s.branch
                    s.branch = None
                    self.active -= 1
                    await self._release(s.ws)
                    s.ws, s.ws_node = ws, None
                else:
                    await self._discard(s)
                    if s.ws is None or (s.on_tree and s.ws_node is not s.node):
                        await self._release(s.ws)
                        s.ws = None
                        s.ws = await self.tree.fork(s.node, s.key)
                        s.ws_node = s.node
                    result = await self.backend.execute(s.ws, call, self._ctx(s))
                obs = Observation(result.observation_digest, result.observation_size)
                if s.on_tree:
                    if cacheable:
                        s.node = await self.tree.insert(s.node, call, result, s.ws)
                        s.ws_node = s.node
                    else:
                        s.on_tree = False
            want = self._truth(s, call)
            if obs.digest != want:
                raise InvariantViolation(
                    f"sample {s.key} step {len(s.calls)} ({call.name} {call.arguments}) was shown {obs.digest}; "
                    f"its own execution returns {want}: a call that is not deterministic was cached"
                )
            s.calls.append(call)
            s.obs.append(obs)

        async def _maybe_speculate(self, s: _Sample) -> None:
            assert self.tree is not None
            policy = self.speculation
            k = max(1, policy.top_k)

            def predict() -> list[Prediction]:
                return [
                    p for p in predict_checked(self.selector, s.key.task, s.calls, k, s.obs)
                    if self.cacheability.cacheable(s.group.root.task, p.call)
                    and not (s.on_tree and call_key(p.call) in s.node.children)
                ]

            size = sum(len(g.samples) for g in self.groups)
            ctx = SpecContext(
                rollout=s.key, task=s.group.root.task, calls=tuple(s.calls), observations=tuple(s.obs),
                predict=predict, step_size=size, unfinished=size, active=self.active,
                budget=self.config.spec_budget, config=self.config, exec_seen={}, fork_seen=(0.0, 0),
            )
            choice: Prediction | None = policy.choose(ctx)
            if choice is None:
                return
            choice = ctx.check_choice(policy, choice)
            if s.ws is not None and (not s.on_tree or s.ws_node is s.node):
                ws = await self.backend.fork(s.ws)
            elif s.on_tree:
                ws = await self.tree.fork(s.node, s.key)
            else:
                return
            self.active += 1
            result = await self.backend.execute(ws, choice.call, CallContext(s.key, len(s.calls), "speculate"))
            s.branch = (choice.call, ws, result)

        async def _release(self, ws: Workspace | None) -> None:
            if ws is not None and not ws.released:
                await self.backend.release(ws)

        async def _discard(self, s: _Sample) -> None:
            if s.branch is not None:
                _, ws, _ = s.branch
                s.branch = None
                self.active -= 1
                await self._release(ws)

        async def _drop(self, s: _Sample) -> None:
            await self._discard(s)
            await self._release(s.ws)
            s.ws = None

        def _end(self, g: _Group) -> None:
            assert self.tree is not None
            for s in list(g.samples):
                self._await(self._drop(s))
            g.samples.clear()
            self.groups.remove(g)
            self._await(self.tree.release_root(g.root, keep=True))

    PolicyMachine.__name__ = PolicyMachine.__qualname__ = "PolicyMachine"
    return PolicyMachine

