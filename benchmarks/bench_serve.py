"""The rollout service's own overhead: ``bunshin serve`` on the simulator's backend, over HTTP.

Usage: python benchmarks/bench_serve.py [--repeats 200] [--sessions 64]

Tool calls take no time here (every recorded execution time is 0, the task boots instantly), so
what is measured is the service: HTTP (uvicorn + Litestar + httpx on 127.0.0.1), the
scheduler run of each group and the prefix tree. Printed, side by side with the baseline of the
same run (``GET /v1/health``: one HTTP round trip that does nothing):

1. step latency, p50 and p99, of a step served by execution and of one served from the cache;
2. sessions per second: open a group of 16 and close its sessions, repeated;
3. steps per second with N sessions stepping at once (one httpx client: its connection pool
   costs more CPU than the service at this concurrency, so this is a lower bound).

"In service" is the step's ``timings.wait``: from the request reaching the service to its
response being ready, without HTTP.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import httpx

from bunshin_async import (
    MemoryProfile,
    Rollout,
    ServeConfig,
    Step,
    Task,
    ToolCall,
    Trace,
    create_app,
    observation_digest,
    open_http_server,
    open_service,
)
from sim import SimBackend, ToolModel


def make_trace() -> Trace:
    calls = [ToolCall("shell", {"cmd": c}) for c in ("a", "b", "c")]
    steps = [Step(think_time=0.0, call=c, exec_time=0.0, observation_digest=observation_digest(str(c.arguments)),
                  observation_size=10, dirtied_bytes=0) for c in calls]
    task = Task("t", MemoryProfile(0, 1 << 20, 0.0))
    return Trace(1, "bench", [task], [Rollout(0, "t", 0, 0, 1.0, steps)])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(args: argparse.Namespace) -> None:
    trace = make_trace()
    backend = SimBackend("bunshin", ToolModel(trace))
    config = ServeConfig(max_workspaces=max(64, args.sessions))
    async with open_service(backend, config, tasks=trace.task_map(), cacheable=["shell"]) as service:
        async with open_http_server(create_app(service)) as server:
            limits = httpx.Limits(max_connections=args.sessions, max_keepalive_connections=args.sessions)
            async with httpx.AsyncClient(base_url=server.url + "/v1", trust_env=False, limits=limits) as client:
                (await client.post("/tasks", json={"id": "t"})).raise_for_status()

                async def step(sid: str, cmd: str) -> dict:
                    r = await client.post(f"/sessions/{sid}/step", json={"call": {"name": "shell", "arguments": {"cmd": cmd}}})
                    r.raise_for_status()
                    return r.json()

                async def close(sid: str) -> None:
                    (await client.post(f"/sessions/{sid}/close", json={"reward": 1})).raise_for_status()

                # 1. latency
                base, executed, cached = [], [], []
                inside: dict[str, list[float]] = {"step, executed": [], "step, cache": []}
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    (await client.get("/health")).raise_for_status()
                    base.append(time.perf_counter() - t0)
                group = (await client.post("/tasks/t/groups", json={"size": 1})).json()
                sid = group["sessions"][0]
                for i in range(args.repeats):  # not cacheable after a miss: each is a new call
                    t0 = time.perf_counter()
                    body = await step(sid, f"x{i}")
                    executed.append(time.perf_counter() - t0)
                    inside["step, executed"].append(body["timings"]["wait"])
                    assert body["served_by"] == "executed"
                await client.post(f"/sessions/{sid}/close", json={"reward": 1})
                for i in range(args.repeats):  # a fresh session finds "a" in the tree
                    group = (await client.post("/tasks/t/groups", json={"size": 1})).json()
                    sid = group["sessions"][0]
                    if i == 0:
                        await step(sid, "a")
                    else:
                        t0 = time.perf_counter()
                        body = await step(sid, "a")
                        cached.append(time.perf_counter() - t0)
                        inside["step, cache"].append(body["timings"]["wait"])
                        assert body["served_by"] == "cache"
                    await client.post(f"/sessions/{sid}/close", json={"reward": 1})
                hb = statistics.median(base)
                print(f"{'step latency (client side)':28} {'p50 ms':>8} {'p99 ms':>8} {'x health p50':>13} "
                      f"{'in service p50 ms':>18}")
                for name, xs in (("GET /health (baseline)", base), ("step, executed", executed),
                                 ("step, cache", cached)):
                    own = f"{statistics.median(inside[name]) * 1e3:18.2f}" if name in inside else f"{'-':>18}"
                    print(f"{name:28} {statistics.median(xs) * 1e3:8.2f} {pct(xs, 0.99) * 1e3:8.2f} "
                          f"{statistics.median(xs) / hb:13.2f} {own}")

                # 2. sessions per second
                g, rounds = 16, max(5, args.repeats // 20)
                t0 = time.perf_counter()
                for _ in range(rounds):
                    group = (await client.post("/tasks/t/groups", json={"size": g})).json()
                    async with anyio.create_task_group() as tg:
                        for s in group["sessions"]:
                            tg.start_soon(close, s)
                dt = time.perf_counter() - t0
                print(f"\nsessions opened and closed (groups of {g}): {rounds * g / dt:.0f} sessions/s "
                      f"({dt / rounds * 1e3:.1f} ms per group)")

                # 3. concurrent steps
                n, per = args.sessions, 10
                group = (await client.post("/tasks/t/groups", json={"size": n})).json()

                async def drive(s: str, k: int) -> None:
                    for i in range(per):
                        await step(s, f"{k}-{i}")
                    await client.post(f"/sessions/{s}/close", json={"reward": 1})

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for k, s in enumerate(group["sessions"]):
                        tg.start_soon(drive, s, k)
                dt = time.perf_counter() - t0
                print(f"{n} sessions x {per} steps at once: {n * per / dt:.0f} steps/s "
                      f"(baseline: {1 / hb:.0f} health round trips/s one at a time)")
                await client.delete("/tasks/t")
    print(f"backend handles left: {backend.live_handles()}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=64)
    anyio.run(main, ap.parse_args())
