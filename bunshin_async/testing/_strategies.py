"""Hypothesis strategies for traces, workload configurations and policy parameters.

The traces are built from hypothesis' own primitives (not from a seeded generator), so a failing
example shrinks to a small trace: few tasks, few samples, short rollouts, round numbers.

A trace drawn here is consistent the way a recorded one is: a deterministic tool's observation
depends only on the task and the calls made before it (so two samples that made the same calls
see the same thing, and caching it is correct), while a call of a clock-reading tool
(:data:`CLOCK_TOOL`) returns something different every time and is recorded as not cacheable.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import strategies as st

from .._trace import MemoryProfile, Rollout, Step, Task, ToolCall, Trace, observation_digest

__all__ = ["traces", "configs", "policy_params", "cancellations", "TOOLS", "CLOCK_TOOL"]

MiB = 1 << 20
GiB = 1 << 30

CLOCK_TOOL = "clock"
"""A tool whose observation changes at every call (it reads the time): never cacheable."""

TOOLS = ("read", "shell", "click", "search", "type", CLOCK_TOOL)
"""The call vocabulary's tool names, deterministic ones first."""

_LATENCY = (0.1, 0.5, 1.0, 2.0)
_TAIL_LATENCY = (10.0, 30.0, 120.0)
_THINK = (0.5, 1.0, 3.0, 10.0)
_DIRTY = (0, 1 * MiB, 4 * MiB, 16 * MiB)


def _digest(*parts: object) -> str:
    return observation_digest(repr(parts))


def _calls(draw: Any, tools: tuple[str, ...], n: int, args: int) -> list[ToolCall]:
    return [
        ToolCall(name=draw(st.sampled_from(tools)), arguments={"x": draw(st.integers(0, args - 1))})
        for _ in range(n)
    ]


@st.composite
def traces(
    draw: Any,
    *,
    max_tasks: int = 3,
    min_group: int = 1,
    max_group: int = 4,
    max_epochs: int = 2,
    max_steps: int = 6,
    tools: tuple[str, ...] = TOOLS,
    arguments: int = 3,
    repetition: float | None = None,
    tail_weight: float | None = None,
    dirtied: tuple[int, ...] = _DIRTY,
) -> Trace:
    """A trace of 1 to *max_tasks* tasks, each with *min_group* to *max_group* samples in each
    of 1 to *max_epochs* epochs, rollouts of 1 to *max_steps* calls.

    Args:
        tools: The tool names calls are drawn from (:data:`CLOCK_TOOL` among them makes some
            calls non-cacheable).
        arguments: Distinct argument values per tool (fewer means more repetition).
        repetition: The share of its task's reference script a rollout repeats before it
            diverges (drawn per rollout when None); 1.0 means every sample of a task makes the
            same calls, which is what prefix caching and speculation feed on.
        tail_weight: The probability that a call's latency comes from the heavy tail (10 s to
            2 min) instead of 0.1 to 2 s; drawn per trace when None.
        dirtied: The bytes a call may dirty.
    """
    n_tasks = draw(st.integers(1, max_tasks))
    group = draw(st.integers(min_group, max_group))
    epochs = draw(st.integers(1, max_epochs))
    tail = draw(st.sampled_from([0.0, 0.1, 0.5])) if tail_weight is None else tail_weight
    tasks: list[Task] = []
    scripts: list[list[ToolCall]] = []
    for t in range(n_tasks):
        tasks.append(Task(
            id=f"t{t}",
            memory=MemoryProfile(
                image_bytes=draw(st.sampled_from([0, 64 * MiB])),
                runtime_bytes=draw(st.sampled_from([16 * MiB, 64 * MiB, 256 * MiB])),
                boot_time=draw(st.sampled_from([0.0, 1.0, 5.0])),
            ),
        ))
        scripts.append(_calls(draw, tools, draw(st.integers(1, max_steps)), arguments))
    rollouts: list[Rollout] = []
    for e in range(epochs):  # the trainer's order: epoch by epoch, task by task
        for task, script in zip(tasks, scripts):
            for i in range(group):
                if repetition is None:  # shrinks towards repeating the whole script
                    keep = len(script) - draw(st.integers(0, len(script)))
                else:
                    keep = round(repetition * len(script))
                calls = script[:keep] + _calls(draw, tools, draw(st.integers(0, max_steps - keep)), arguments)
                steps = []
                history: list[tuple[str, int]] = []
                for j, c in enumerate(calls or script[:1]):
                    clock = c.name == CLOCK_TOOL
                    history.append((c.name, c.arguments["x"]))
                    slow = tail > 0 and draw(st.floats(0, 1)) < tail
                    steps.append(Step(
                        think_time=draw(st.sampled_from(_THINK)),
                        call=c,
                        exec_time=draw(st.sampled_from(_TAIL_LATENCY if slow else _LATENCY)),
                        # the clock's answer differs at every call; any other tool's depends
                        # only on the task and the calls before it
                        observation_digest=_digest(task.id, e, i, j) if clock else _digest(task.id, tuple(history)),
                        observation_size=100,
                        dirtied_bytes=draw(st.sampled_from(dirtied)),
                        cacheable=not clock,
                    ))
                rollouts.append(Rollout(
                    epoch=e, task=task.id, group=0, sample=i,
                    reward=float(hashlib.blake2b(repr(history).encode(), digest_size=1).digest()[0] % 2),
                    steps=steps,
                    final_think_time=draw(st.sampled_from(_THINK)),
                ))
    return Trace(version=1, name="hypothesis", tasks=tasks, rollouts=rollouts, meta={"generator": "bunshin_async.testing.traces"})


def policy_params() -> st.SearchStrategy[dict[str, Any]]:
    """The speculation parameters of :class:`~bunshin_async.SchedulerConfig` (the built-in
    speculation policy's; a user policy may read them from its context)."""
    return st.fixed_dictionaries({
        "spec_budget": st.integers(0, 8),
        "spec_tail": st.sampled_from([0.25, 1.0]),
        "spec_min_confidence": st.sampled_from([0.0, 0.3, 0.9]),
        "spec_rule": st.sampled_from(["benefit", "confidence"]),
    })


def configs() -> st.SearchStrategy[dict[str, Any]]:
    """Scheduler options (keyword arguments of :meth:`SchedulerConfig.preset`): batch sizes,
    sync or async steps, budgets small enough to force demotions, drops and replays, and
    whether a call in flight is waited for (``coalesce``),
    merged with :func:`policy_params`."""
    base = st.fixed_dictionaries({
        "batch_tasks": st.integers(1, 4),
        "mode": st.sampled_from(["sync", "async"]),
        "staleness": st.integers(0, 2),
        "hot_budget": st.sampled_from([8 * GiB, 512 * MiB, 64 * MiB, 0]),
        "cold_budget": st.sampled_from([64 * GiB, 256 * MiB, 0]),
        "coalesce": st.sampled_from([True, False]),
    })
    return st.builds(lambda a, b: {**a, **b}, base, policy_params())


def cancellations(max_size: int = 4) -> st.SearchStrategy[list[tuple[float, int]]]:
    """``(t, i)`` pairs: cancel rollout number ``i`` of the plan at virtual second ``t``."""
    return st.lists(st.tuples(st.sampled_from([0.0, 1.0, 5.0, 20.0, 100.0, 600.0]), st.integers(0, 63)), max_size=max_size)
