"""Run the scheduler core in virtual time.

:class:`VirtualTimeLoop` is an asyncio event loop whose clock is a number, not the wall: when
no callback is ready it jumps straight to the next timer instead of sleeping. The scheduler
runs on it through anyio unchanged. Ready callbacks run first-in first-out and timers that
fall due together run in the order they were set, so a run is a deterministic function of its
inputs. (trio's ``MockClock(autojump_threshold=0)`` gives virtual time too, but trio shuffles
ready tasks on purpose, so equal-time events would be ordered differently run to run; the
scheduler also runs under trio, which the tests use to check it does not depend on asyncio.)
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from bunshin_async._exceptions import ConfigError
from bunshin_async._policy import TracePolicy
from bunshin_async._plugins import CacheabilityPolicy, EvictionPolicy, RecordedCacheability, SpeculationPolicy
from bunshin_async._scheduler import RunResult, Scheduler, SchedulerConfig, StepRecord
from bunshin_async._selector import HistorySelector, SpecToolSelector
from bunshin_async._trace import RolloutKey, Trace

from ._backend import SimBackend, ToolModel

__all__ = ["VirtualTimeLoop", "Simulation", "build_simulation", "run_virtual", "simulate"]

T = TypeVar("T")


class _VirtualSelector(selectors.BaseSelector):
    """A selector that never waits: a timeout advances the loop's virtual clock instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            # nothing ready and no timer: every task waits on something that never comes
            raise RuntimeError("virtual-time deadlock: every task is waiting and no timer is set")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock starting at 0 (see the module docstring).

    Only timers and ready callbacks make progress: I/O, threads and subprocesses are not
    available inside it.
    """

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by *seconds*.

        Past about 10**7 virtual seconds a float's spacing exceeds asyncio's clock resolution,
        so a timer landed on exactly would never count as due (``when < now + resolution``
        fails) and the loop would spin; the clock then moves one step further instead.
        """
        now = self._virtual_now + seconds
        if seconds > 0 and now + self._clock_resolution == now:
            now = math.nextafter(now, math.inf)
        self._virtual_now = now


def run_virtual(fn: Callable[[], Awaitable[T]]) -> T:
    """Run the async function *fn* through anyio on a fresh :class:`VirtualTimeLoop`."""
    return anyio.run(fn, backend="asyncio", backend_options={"loop_factory": VirtualTimeLoop})


class Simulation(msgspec.Struct, frozen=True):
    """A scheduler wired to a simulated backend, ready to run in virtual time."""

    scheduler: Scheduler
    """The scheduler (its ``cancel`` and ``plan`` are usable while it runs)."""
    backend: SimBackend
    """The simulated backend (its ``live_handles`` and ``statistics`` after the run)."""

    cancels: tuple[tuple[float, int], ...] = ()
    """``(t, i)``: cancel rollout number ``i`` of the plan (modulo the number of rollouts,
    counted over the steps in plan order) at virtual time ``t``."""

    def plan_keys(self) -> list[RolloutKey]:
        """The rollouts of the plan, in plan order (what :attr:`cancels` counts)."""
        return [k for step in self.scheduler.plan.steps for g in step for k, _ in g]

    async def run(self) -> RunResult:
        """Run every rollout (cancelling those of :attr:`cancels`), then close the backend;
        call inside :func:`run_virtual`."""
        if not self.cancels:
            result = await self.scheduler.run()
        else:
            keys = self.plan_keys()

            async def canceller() -> None:
                for t, i in sorted(self.cancels):
                    await anyio.sleep_until(t)
                    self.scheduler.cancel(keys[i % len(keys)])

            async with anyio.create_task_group() as tg:
                tg.start_soon(canceller)
                result = await self.scheduler.run()
                tg.cancel_scope.cancel()
        await self.backend.aclose()
        return result


def build_simulation(
    trace: Trace,
    *,
    engine: str = "bunshin",
    policy: str = "full",
    seed: int = 0,
    config: SchedulerConfig | None = None,
    page_size: int = 1 << 20,
    check: bool = True,
    selector: SpecToolSelector | None = None,
    cacheability: CacheabilityPolicy | None = None,
    eviction: EvictionPolicy | None = None,
    speculation: SpeculationPolicy | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_step: Callable[[RolloutKey, StepRecord], None] | None = None,
    cancels: Sequence[tuple[float, int]] = (),
    **overrides: Any,
) -> Simulation:
    """Wire a replay of *trace*: a :class:`SimBackend`, a :class:`TracePolicy` and a
    :class:`Scheduler`.

    Args:
        trace: The rollouts to replay (the policy replays their calls and think times).
        engine: The fork engine of the simulated backend.
        policy: ``base``, ``spec`` or ``full`` (ignored when *config* is given).
        seed: Seeds the backend's page model and the scheduler.
        config: A complete scheduler configuration, instead of *policy* and *overrides*.
        page_size: Resolution of the page model in bytes.
        check: Check every observation against the recording (semantic transparency).
        selector: The Spec Tool Selector; by default a :class:`HistorySelector` that starts
            empty, when speculation is on.
        cacheability: Which calls may be cached; by default the trace's marks
            (:class:`~bunshin_async.RecordedCacheability`). It is fitted to *trace* first.
        eviction: Which snapshots leave the prefix tree's tiers (LRU by default).
        speculation: When and what to run ahead (the config's tail-benefit rule by default).
        on_progress: Called with ``(finished, total)`` rollouts as they end.
        on_step: Called with ``(rollout, record)`` as each call is served.
        cancels: ``(t, i)`` pairs: cancel rollout number ``i`` of the plan at virtual time
            ``t`` (see :attr:`Simulation.cancels`).
        **overrides: :class:`SchedulerConfig` fields to change from the preset.

    Raises:
        ConfigError: On an unknown engine, policy or option.
    """
    if page_size < 1:
        raise ConfigError(f"page_size={page_size} is invalid; expected at least 1 byte (default 1 MiB)")
    if config is None:
        config = SchedulerConfig.preset(policy, seed=seed, **overrides)
    elif overrides:
        raise ConfigError("pass either config or keyword overrides, not both")
    backend = SimBackend(engine, ToolModel(trace), page_size=page_size, seed=seed)
    if selector is None and config.speculation:
        # starts empty and learns from rollouts as they finish (earlier epochs, earlier
        # samples), never from the trajectory it predicts
        selector = HistorySelector()
    if cacheability is None:
        cacheability = RecordedCacheability()
    cacheability.fit(trace)
    scheduler = Scheduler(
        backend,
        TracePolicy(trace, check=check),
        config,
        selector=selector,
        cacheable=cacheability,
        eviction=eviction,
        speculation=speculation,
        on_progress=on_progress,
        on_step=on_step,
    )
    for t, i in cancels:
        if t < 0 or i < 0:
            raise ConfigError(f"cancel ({t}, {i}) is invalid; expected a time >= 0 and a rollout number >= 0")
    return Simulation(scheduler, backend, tuple((float(t), int(i)) for t, i in cancels))


def simulate(trace: Trace, **options: Any) -> RunResult:
    """Replay *trace* in the simulator and return what the run measured; *options* are those
    of :func:`build_simulation`."""
    return run_virtual(build_simulation(trace, **options).run)
