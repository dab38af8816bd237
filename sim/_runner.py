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
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec

from bunshin_async._exceptions import ConfigError
from bunshin_async._policy import TracePolicy
from bunshin_async._scheduler import RunResult, Scheduler, SchedulerConfig, caching_policy
from bunshin_async._selector import HistorySelector, SpecToolSelector
from bunshin_async._trace import Trace

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
        """Move the clock forward by *seconds*."""
        self._virtual_now += seconds


def run_virtual(fn: Callable[[], Awaitable[T]]) -> T:
    """Run the async function *fn* through anyio on a fresh :class:`VirtualTimeLoop`."""
    return anyio.run(fn, backend="asyncio", backend_options={"loop_factory": VirtualTimeLoop})


class Simulation(msgspec.Struct, frozen=True):
    """A scheduler wired to a simulated backend, ready to run in virtual time."""

    scheduler: Scheduler
    """The scheduler (its ``cancel`` and ``plan`` are usable while it runs)."""
    backend: SimBackend
    """The simulated backend (its ``live_handles`` and ``statistics`` after the run)."""

    async def run(self) -> RunResult:
        """Run every rollout, then close the backend; call inside :func:`run_virtual`."""
        result = await self.scheduler.run()
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
    on_progress: Callable[[int, int], None] | None = None,
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
        on_progress: Called with ``(finished, total)`` rollouts as they end.
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
    scheduler = Scheduler(
        backend,
        TracePolicy(trace, check=check),
        config,
        selector=selector,
        cacheable=caching_policy(trace),
        on_progress=on_progress,
    )
    return Simulation(scheduler, backend)


def simulate(trace: Trace, **options: Any) -> RunResult:
    """Replay *trace* in the simulator and return what the run measured; *options* are those
    of :func:`build_simulation`."""
    return run_virtual(build_simulation(trace, **options).run)
