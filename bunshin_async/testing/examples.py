"""Example policies: one well-behaved, three deliberately wrong (each caught by a check).

Try them::

    bunshin check-policy bunshin_async.testing.examples:CostAwareEviction     # passes
    bunshin check-policy bunshin_async.testing.examples:CacheEverything       # transparency
    bunshin check-policy bunshin_async.testing.examples:LargestFirstEviction  # contract
    bunshin check-policy bunshin_async.testing.examples:EagerSpeculation      # budgets

``docs/policies.md`` walks through one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .._plugins import CacheabilityPolicy, EvictionPolicy, SnapshotInfo, SpecContext, SpeculationPolicy
from .._selector import Prediction
from .._trace import Task, ToolCall

__all__ = ["CostAwareEviction", "CacheEverything", "LargestFirstEviction", "EagerSpeculation"]


class CostAwareEviction(EvictionPolicy):
    """Evicts the snapshots that served the fewest hits per byte first (ties: least recently
    used). Respects the contract: it only picks snapshots marked evictable."""

    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        ok = [s for s in snapshots if s.evictable]
        return sorted(ok, key=lambda s: ((s.hits + 1) / max(s.bytes, 1), s.last_used, s.id))


class CacheEverything(CacheabilityPolicy):
    """WRONG: caches every call, the clock-reading tool's too, so a later sample is shown the
    time an earlier sample read. The transparency check catches it."""

    def cacheable(self, task: Task, call: ToolCall) -> bool:
        return True


class LargestFirstEviction(EvictionPolicy):
    """WRONG: frees the largest snapshots first and ignores whether they are in use, so it
    picks the root a running group is forking from. The tree refuses (PolicyError) and every
    check that runs it reports the broken contract."""

    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        return sorted(snapshots, key=lambda s: (-s.bytes, s.id))


class EagerSpeculation(SpeculationPolicy):
    """WRONG: runs the top prediction whenever there is one, ignoring the branch budget. The
    budget check catches it (the scheduler refuses the branch beyond the budget)."""

    def choose(self, ctx: SpecContext) -> Prediction | None:
        return ctx.predictions[0] if ctx.predictions else None
