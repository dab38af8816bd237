"""The Spec Tool Selector: predicts a sample's next tool call so it can run ahead.

:class:`SpecToolSelector` is the interface the scheduler uses; :class:`HistorySelector` is a
first predictor that learns from trajectories that have already finished (earlier epochs of
the same trace, and samples of the run that completed before the prediction is made), so
nothing it predicts with was produced after the moment of prediction.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Sequence

import msgspec

from ._trace import ToolCall, Trace, call_key

__all__ = ["SpecToolSelector", "HistorySelector", "Prediction"]


class Prediction(msgspec.Struct, frozen=True):
    """A predicted next call."""

    call: ToolCall
    """The call, with arguments."""
    confidence: float
    """Estimated probability that the policy's next call is exactly this one (0 to 1)."""


class SpecToolSelector(abc.ABC):
    """Predicts a sample's next call from its task and the calls it made so far."""

    @abc.abstractmethod
    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1) -> list[Prediction]:
        """Return up to *k* predictions for the call after *calls*, most likely first."""

    @abc.abstractmethod
    def observe(self, task: str, calls: Sequence[ToolCall]) -> None:
        """Learn from a finished trajectory of *task* that made *calls*."""


class HistorySelector(SpecToolSelector):
    """Predicts by counting what followed the same context in finished trajectories.

    Contexts, tried in order: the task and the whole prefix; the task and the last call; the
    last call in any task. The first context seen at least ``min_support`` times answers;
    confidence is the share of that context's continuations that were the predicted call,
    multiplied by ``backoff`` for each context skipped.

    Args:
        min_support: Observations a context needs before it is used.
        backoff: Confidence discount per fallback level (0 to 1).
    """

    def __init__(self, *, min_support: int = 1, backoff: float = 0.5) -> None:
        self._min = max(1, min_support)
        self._backoff = backoff
        self._calls: dict[bytes, ToolCall] = {}
        self._prefix: dict[tuple, Counter[bytes]] = {}
        self._task_bigram: dict[tuple, Counter[bytes]] = {}
        self._bigram: dict[bytes | None, Counter[bytes]] = {}

    def fit(self, trace: Trace, *, before_epoch: int | None = None) -> HistorySelector:
        """Learn from every rollout of *trace* (only those of epochs before *before_epoch*
        when given) and return self."""
        for r in trace.rollouts:
            if before_epoch is None or r.epoch < before_epoch:
                self.observe(r.task, [s.call for s in r.steps])
        return self

    def observe(self, task: str, calls: Sequence[ToolCall]) -> None:
        prefix: tuple[bytes, ...] = ()
        last: bytes | None = None
        for call in calls:
            k = call_key(call)
            self._calls.setdefault(k, call)
            self._prefix.setdefault((task, prefix), Counter())[k] += 1
            self._task_bigram.setdefault((task, last), Counter())[k] += 1
            self._bigram.setdefault(last, Counter())[k] += 1
            prefix = prefix + (k,)
            last = k

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1) -> list[Prediction]:
        keys = tuple(call_key(c) for c in calls)
        last = keys[-1] if keys else None
        scale = 1.0
        for table, ctx in (
            (self._prefix, (task, keys)),
            (self._task_bigram, (task, last)),
            (self._bigram, last),
        ):
            counts = table.get(ctx)
            if counts is not None:
                n = sum(counts.values())
                if n >= self._min:
                    return [
                        Prediction(self._calls[key], scale * c / n) for key, c in counts.most_common(k)
                    ]
            scale *= self._backoff
        return []

    def observed(self) -> int:
        """How many distinct calls the selector has seen."""
        return len(self._calls)


