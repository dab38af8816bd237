"""Prometheus metrics of a run (bunshin_async._metrics)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bunshin_async import ConfigError, HistorySelector, RolloutMetrics
from sim import build_simulation, run_virtual

from test_scheduler import TIER_TRACE


def samples(metrics: RolloutMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_follow_a_run() -> None:
    m = RolloutMetrics()
    sel = HistorySelector()
    for r in TIER_TRACE.rollouts:
        sel.observe(r.task, [s.call for s in r.steps])
    sim = build_simulation(TIER_TRACE, policy="full", spec_tail=1.0, selector=sel, on_step=m.on_step)
    live = []
    m.watch("sim", sim.backend, lambda: live)
    before = samples(m)
    assert before[("bunshin_calls_total", (("served_by", "cache"),))] == 0
    assert before[("bunshin_live_workspaces", (("backend", "sim"),))] == 0

    async def main():
        result = await sim.scheduler.run()
        # scraped before the backend closes: the tree's snapshots are released, nothing is live
        mid = samples(m)
        await sim.backend.aclose()
        return result, mid

    result, mid = run_virtual(main)
    for r in result.rollouts:
        m.on_rollout(r)
    m.on_run(result)
    got = samples(m)
    steps = [s for r in result.rollouts for s in r.steps]
    for how in ("executed", "cache", "speculation"):
        n = sum(s.source == how for s in steps)
        assert got[("bunshin_calls_total", (("served_by", how),))] == n
        assert got[("bunshin_step_latency_seconds_count", (("served_by", how),))] == n
    assert sum(s.source == "cache" for s in steps) > 0
    assert got[("bunshin_rollouts_total", (("status", "done"),))] == len(result.rollouts)
    assert got[("bunshin_speculation_branches_total", (("outcome", "hit"),))] == result.spec.hits
    assert got[("bunshin_speculation_branches_total", (("outcome", "miss"),))] == result.spec.misses
    assert got[("bunshin_speculation_wasted_seconds_total", ())] == pytest.approx(result.spec.wasted_exec_seconds)
    lat = sum(s.served - s.issued for s in steps)
    assert sum(v for (k, _), v in got.items() if k == "bunshin_step_latency_seconds_sum") == pytest.approx(lat)
    assert mid[("bunshin_live_workspaces", (("backend", "sim"),))] == sim.backend.live_handles()
    assert got[("bunshin_working_set_bytes", (("backend", "sim"),))] == 0


def test_watched_workspaces_report_shared_and_private_bytes() -> None:
    from sim import SimBackend, ToolModel

    backend = SimBackend("bunshin", ToolModel(TIER_TRACE))
    m = RolloutMetrics()
    held = []
    m.watch("b", backend, lambda: held)

    async def main():
        ws = await backend.create(TIER_TRACE.tasks[0])
        snap = await backend.freeze(ws)
        held.extend([await backend.fork(snap), await backend.fork(snap)])
        got = samples(m)
        mem = [backend.workspace_memory(w) for w in held]
        for h in held:
            await backend.release(h)
        await backend.release(snap)
        after = samples(m)
        await backend.aclose()
        return got, mem, after

    got, mem, after = run_virtual(main)
    assert got[("bunshin_workspace_shared_bytes", (("backend", "b"),))] == sum(x.shared_bytes for x in mem) > 0
    assert got[("bunshin_workspace_private_bytes", (("backend", "b"),))] == sum(x.private_bytes for x in mem)
    assert got[("bunshin_live_workspaces", (("backend", "b"),))] == 3
    assert after[("bunshin_workspace_shared_bytes", (("backend", "b"),))] == 0  # released ones are skipped
    with pytest.raises(ConfigError, match="already watched"):
        m.watch("b", backend)
    m.unwatch("b")
    assert ("bunshin_live_workspaces", (("backend", "b"),)) not in samples(m)


def test_two_metric_sets_do_not_clash() -> None:
    a, b = RolloutMetrics(), RolloutMetrics()
    from bunshin_async import StepRecord, ToolCall, ToolResult, RolloutKey

    rec = StepRecord(ToolCall(name="x"), ToolResult(observation_digest="d", observation_size=1, exec_time=0.5,
                                                    dirtied_bytes=0), "cache", 1.0, 1.25)
    a.on_step(RolloutKey(0, "t", 0, 0), rec)
    assert samples(a)[("bunshin_calls_total", (("served_by", "cache"),))] == 1
    assert samples(b)[("bunshin_calls_total", (("served_by", "cache"),))] == 0
    assert samples(a)[("bunshin_step_latency_seconds_sum", (("served_by", "cache"),))] == pytest.approx(0.25)


def test_the_service_serves_its_metrics() -> None:
    import anyio

    from test_serve import CALLS, close, do, open_group, register, serving, stats

    async def main() -> None:
        async with serving() as (client, backend):
            await register(client)
            group = await open_group(client, size=2)
            a, b = group["sessions"]
            for c in CALLS[0][:2]:
                await do(client, a, c)
            r = await client.get(client.base_url.join("/metrics"))
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            mid = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}
            assert mid[("bunshin_calls_total", (("served_by", "executed"),))] == 2
            # the two sessions hold their workspaces: shared pages with each other and the root
            assert mid[("bunshin_workspace_shared_bytes", (("backend", "service"),))] > 0
            assert mid[("bunshin_live_workspaces", (("backend", "service"),))] == backend.live_handles()
            for c in CALLS[1][:2]:
                assert (await do(client, b, c))["served_by"] == "cache"
            await close(client, a)
            await close(client, b, reward=0.0)
            r = await client.get(client.base_url.join("/metrics"))
            got = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}
            st = await stats(client)
            assert got[("bunshin_calls_total", (("served_by", "cache"),))] == 2
            assert got[("bunshin_rollouts_total", (("status", "done"),))] == 2
            assert st is not None

    anyio.run(main)
