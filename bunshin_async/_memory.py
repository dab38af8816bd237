"""Memory accounting: the working set over time, its peak and its integral.

The scheduler samples the backend's working set after every operation that can change it;
between samples the working set is taken as constant, so in the simulator (where memory only
changes at operations) the integral is exact.
"""

from __future__ import annotations

import msgspec

__all__ = ["MemoryAccountant", "MemoryStatistics"]


class MemoryStatistics(msgspec.Struct, frozen=True):
    """A summary of the working set over a run."""

    peak_bytes: int
    """Largest working set seen, including one that lasted no time (two operations at the
    same instant); the timeline keeps only the last value at each instant."""
    peak_time: float
    """When it was first reached (seconds since the run started)."""
    total_byte_seconds: float
    """The working set integrated over the run (byte-seconds): the seed's "total memory"."""
    mean_bytes: float
    """``total_byte_seconds`` divided by the run's duration (0 for an empty run)."""
    duration: float
    """Seconds from the first sample to the last."""


class MemoryAccountant:
    """Integrates a piecewise-constant working set.

    Args:
        start: The time of the first sample.
        keep_timeline: Record every change as ``(time, bytes)`` for plotting.
    """

    def __init__(self, start: float = 0.0, *, keep_timeline: bool = True) -> None:
        self._start = start
        self._last_t = start
        self._last_v = 0
        self._total = 0.0
        self._peak = 0
        self._peak_t = start
        self._timeline: list[tuple[float, int]] | None = [(start, 0)] if keep_timeline else None

    def sample(self, now: float, working_set: int) -> None:
        """Record that the working set is *working_set* bytes from time *now* on."""
        if now < self._last_t:
            raise ValueError(f"time went backwards: {now} < {self._last_t}")
        self._total += self._last_v * (now - self._last_t)
        self._last_t = now
        if working_set == self._last_v:
            return
        self._last_v = working_set
        if working_set > self._peak:
            self._peak = working_set
            self._peak_t = now
        tl = self._timeline
        if tl is not None:
            if tl[-1][0] == now:
                tl[-1] = (now, working_set)
            else:
                tl.append((now, working_set))

    @property
    def current(self) -> int:
        """The working set last sampled."""
        return self._last_v

    def timeline(self) -> list[tuple[float, int]]:
        """The recorded ``(time, bytes)`` changes, times relative to the start."""
        return [(t - self._start, v) for t, v in (self._timeline or [])]

    def statistics(self, now: float | None = None) -> MemoryStatistics:
        """Summarise up to *now* (default: the last sample)."""
        end = self._last_t if now is None else max(now, self._last_t)
        total = self._total + self._last_v * (end - self._last_t)
        duration = end - self._start
        return MemoryStatistics(
            peak_bytes=self._peak,
            peak_time=self._peak_t - self._start,
            total_byte_seconds=total,
            mean_bytes=total / duration if duration > 0 else 0.0,
            duration=duration,
        )
