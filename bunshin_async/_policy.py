"""The Policy interface, and :class:`TracePolicy`, which replays recorded trajectories.

A policy is the model: given a sample's trajectory so far it reasons for a while (taking time
through anyio) and emits the next tool call, or finishes with a reward.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import anyio
import msgspec

from ._exceptions import ConfigError, TransparencyError
from ._trace import ContextMessage, Rollout, RolloutKey, Task, ToolCall, Trace

__all__ = ["Policy", "TracePolicy", "Finish", "Observation", "SampleView"]


class Finish(msgspec.Struct, frozen=True):
    """The policy ends the trajectory."""

    reward: float
    """The trajectory's reward."""


class Observation(msgspec.Struct, frozen=True):
    """What a sample was shown after a call."""

    digest: str
    """The observation's digest."""
    size: int
    """Its size in bytes."""
    output: bytes | None = None
    """The observation itself, where the backend has it."""


class SampleView(msgspec.Struct, frozen=True):
    """What a policy sees of a sample: who it is and what it did so far."""

    rollout: RolloutKey
    """The sample's rollout key."""
    task: Task
    """Its task."""
    calls: Sequence[ToolCall]
    """The calls made so far, in order."""
    observations: Sequence[Observation]
    """The observation each of those calls returned."""


class Policy(abc.ABC):
    """Produces a sample's next tool call, taking the model's thinking time to do it."""

    @abc.abstractmethod
    async def act(self, sample: SampleView) -> ToolCall | Finish:
        """Think (sleeping through anyio for as long as the model reasons) and return the
        next call of *sample*, or :class:`Finish`."""

    def planned(self) -> Sequence[tuple[RolloutKey, Task]]:
        """The rollouts this policy can produce, in the order a trainer would issue them.

        Used to build the training steps when no explicit plan is given; the default is none.
        """
        return ()

    def heard(self, sample: SampleView) -> tuple[ContextMessage, ...]:
        """The conversation that reaches the model before it thinks about *sample*'s next call
        (the user's messages, its own text since its last call; see
        :attr:`bunshin_async.Step.context`). The scheduler asks before each :meth:`act` and
        shows it to the Spec Tool Selector. The default is none."""
        return ()


class TracePolicy(Policy):
    """Replays the recorded calls and think times of a trace.

    With ``check=True`` (the default) every observation the scheduler hands back is checked
    against the recorded one: a mismatch raises :class:`TransparencyError`, which means a tool
    marked cacheable is not deterministic in the trace, or the scheduler broke transparency.

    Args:
        trace: The trace to replay.
        check: Check observations against the recording.
        think_scale: Multiply every think time by this (1.0 replays as recorded).
    """

    def __init__(self, trace: Trace, *, check: bool = True, think_scale: float = 1.0) -> None:
        if think_scale < 0:
            raise ConfigError(f"think_scale must be >= 0, got {think_scale}")
        self._trace = trace
        self._tasks = trace.task_map()
        self._rollouts: dict[RolloutKey, Rollout] = {r.key: r for r in trace.rollouts}
        self._check = check
        self._scale = think_scale

    def rollout(self, key: RolloutKey) -> Rollout:
        """The recorded rollout *key*."""
        return self._rollouts[key]

    def planned(self) -> Sequence[tuple[RolloutKey, Task]]:
        return [(r.key, self._tasks[r.task]) for r in self._trace.rollouts]

    def heard(self, sample: SampleView) -> tuple[ContextMessage, ...]:
        rollout = self._rollouts.get(sample.rollout)
        i = len(sample.calls)
        return rollout.steps[i].context if rollout is not None and i < len(rollout.steps) else ()

    async def act(self, sample: SampleView) -> ToolCall | Finish:
        try:
            rollout = self._rollouts[sample.rollout]
        except KeyError:
            raise ConfigError(f"rollout {sample.rollout} is not in trace {self._trace.name!r}") from None
        i = len(sample.calls)
        if self._check and i:
            got = sample.observations[i - 1]
            want = rollout.steps[i - 1]
            if got.digest != want.observation_digest:
                raise TransparencyError(
                    f"rollout {sample.rollout} step {i - 1} ({want.call.name}): observed "
                    f"{got.digest}, recorded {want.observation_digest}"
                )
        if i < len(rollout.steps):
            step = rollout.steps[i]
            await anyio.sleep(step.think_time * self._scale)
            return step.call
        await anyio.sleep(rollout.final_think_time * self._scale)
        return Finish(rollout.reward)
