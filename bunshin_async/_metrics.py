"""Prometheus metrics of rollouts: what a trainer's dashboard watches while Bunshin serves.

:class:`RolloutMetrics` holds one registry (``prometheus_client``) fed three ways:

- per served call, through the scheduler's ``on_step`` hook (:meth:`RolloutMetrics.on_step`):
  calls by how they were served and the step latency (issued to served);
- per finished rollout and per finished run (:meth:`on_rollout`, :meth:`on_run`): rollouts by
  status, speculative branches by outcome, wasted and hidden tool seconds;
- at scrape time, from the backends it watches (:meth:`watch`): live workspace handles, the
  working set, and the shared and private bytes of the workspaces a caller lists.

Metric names (namespace ``bunshin``): ``bunshin_calls_total{served_by}``,
``bunshin_step_latency_seconds{served_by}`` (histogram), ``bunshin_rollouts_total{status}``,
``bunshin_speculation_branches_total{outcome}``, ``bunshin_speculation_wasted_seconds_total``,
``bunshin_speculation_hidden_seconds_total``, ``bunshin_live_workspaces``,
``bunshin_working_set_bytes``, ``bunshin_workspace_shared_bytes``,
``bunshin_workspace_private_bytes`` (gauges, labelled by ``backend``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ._backend import Backend, Workspace
from ._exceptions import BackendError, ConfigError
from ._scheduler import RolloutResult, RunResult, StepRecord
from ._trace import RolloutKey

__all__ = ["RolloutMetrics", "SERVED_BY"]

SERVED_BY = ("executed", "cache", "speculation")
"""How a call can be served (:attr:`StepRecord.source`)."""

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class _Watched(Collector):
    """Scrape-time gauges of the watched backends."""

    def __init__(self) -> None:
        self.backends: dict[str, tuple[Backend, Callable[[], Iterable[Workspace]] | None]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = GaugeMetricFamily("bunshin_live_workspaces", "Workspace, snapshot and delta handles not yet released", labels=["backend"])
        ws = GaugeMetricFamily("bunshin_working_set_bytes", "Physical memory the backend's workspaces use", labels=["backend"])
        shared = GaugeMetricFamily("bunshin_workspace_shared_bytes", "Bytes of the listed workspaces shared with another workspace", labels=["backend"])
        private = GaugeMetricFamily("bunshin_workspace_private_bytes", "Bytes of the listed workspaces private to one", labels=["backend"])
        for name, (backend, listed) in self.backends.items():
            live.add_metric([name], backend.live_handles())
            ws.add_metric([name], backend.working_set())
            if listed is not None:
                s = p = 0
                for w in listed():
                    if w.released:
                        continue
                    try:
                        m = backend.workspace_memory(w)
                    except BackendError:
                        continue  # released or gone meanwhile: not live any more
                    s += m.shared_bytes
                    p += m.private_bytes
                shared.add_metric([name], s)
                private.add_metric([name], p)
        yield from (live, ws, shared, private)


class RolloutMetrics:
    """The metrics of one service or run (see the module docstring).

    Args:
        registry: Where to register; a fresh :class:`CollectorRegistry` by default (so two
            instances never clash).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.calls = Counter("bunshin_calls", "Tool calls served, by how", ["served_by"], registry=r)
        self.step_latency = Histogram(
            "bunshin_step_latency_seconds", "Seconds from a call being issued to its observation being served",
            ["served_by"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.rollouts = Counter("bunshin_rollouts", "Rollouts ended, by status", ["status"], registry=r)
        self.branches = Counter("bunshin_speculation_branches", "Speculative branches, by outcome", ["outcome"], registry=r)
        self.wasted = Counter("bunshin_speculation_wasted_seconds", "Tool seconds spent in discarded branches", registry=r)
        self.hidden = Counter("bunshin_speculation_hidden_seconds", "Tool seconds of adopted branches the samples did not wait for", registry=r)
        for how in SERVED_BY:  # present (at 0) before the first call
            self.calls.labels(how)
            self.step_latency.labels(how)
        for outcome in ("hit", "miss", "error"):
            self.branches.labels(outcome)
        self._watched = _Watched()
        r.register(self._watched)

    def on_step(self, rollout: RolloutKey, record: StepRecord) -> None:
        """Count one served call (the scheduler's ``on_step`` hook)."""
        self.calls.labels(record.source).inc()
        self.step_latency.labels(record.source).observe(max(0.0, record.served - record.issued))

    def on_rollout(self, result: RolloutResult) -> None:
        """Count one ended rollout."""
        self.rollouts.labels(result.status).inc()

    def on_run(self, result: RunResult) -> None:
        """Add a finished run's speculation figures."""
        sp = result.spec
        self.branches.labels("hit").inc(sp.hits)
        self.branches.labels("miss").inc(sp.misses)
        self.branches.labels("error").inc(sp.errors)
        self.wasted.inc(sp.wasted_exec_seconds)
        self.hidden.inc(sp.hidden_exec_seconds)

    def watch(self, name: str, backend: Backend, workspaces: Callable[[], Iterable[Workspace]] | None = None) -> None:
        """Report *backend*'s live handles and working set at every scrape, labelled *name*,
        and the shared and private bytes of the live workspaces *workspaces* lists."""
        if name in self._watched.backends:
            raise ConfigError(f"a backend is already watched as {name!r}; give each a different name")
        self._watched.backends[name] = (backend, workspaces)

    def unwatch(self, name: str) -> None:
        """Stop reporting the backend watched as *name* (nothing if none is)."""
        self._watched.backends.pop(name, None)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)

    def asgi_app(self) -> Any:
        """An ASGI app serving :meth:`exposition` (mount it at ``/metrics``)."""
        from prometheus_client import make_asgi_app

        return make_asgi_app(self.registry)
