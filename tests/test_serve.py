"""The rollout service (``bunshin serve``, environment mode) over HTTP.

Each test starts the service on 127.0.0.1 with a port the kernel picks, on the simulator's
backend over a small hand-made trace whose tool calls run for tens of milliseconds (in real
time: the HTTP server needs a real event loop), and drives it with ``httpx.AsyncClient``. One
test runs it on real workspaces (root only).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from bunshin_async import (
    BackendError,
    CallContext,
    ConfigError,
    MemoryProfile,
    Rollout,
    SchedulerConfig,
    ServeConfig,
    Step,
    Task,
    ToolCall,
    ToolResult,
    Trace,
    Workspace,
    create_app,
    observation_digest,
    open_http_server,
    open_service,
)
from sim import SimBackend, ToolModel

MiB = 1 << 20
EXEC = 0.02  # seconds every recorded call runs


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=args)


def step(c: ToolCall, exec_time: float = EXEC, *, cacheable: bool = True) -> Step:
    return Step(
        think_time=0.0, call=c, exec_time=exec_time,
        observation_digest=observation_digest(f"{c.name}{sorted(c.arguments.items())}"),
        observation_size=10, dirtied_bytes=MiB, cacheable=cacheable,
    )


A, B = call("shell", cmd="a"), call("shell", cmd="b")
SLOW = call("shell", cmd="sleep")
CLOCK = call("clock")
G = 4
# every sample opens with A, B; then a call of its own, and the clock (not cacheable)
CALLS = [[A, B, call("shell", cmd=f"x{i}"), CLOCK] for i in range(G)]
TASK = Task(id="t", memory=MemoryProfile(image_bytes=0, runtime_bytes=64 * MiB, boot_time=0.0))
TRACE = Trace(
    version=1, name="serve", tasks=[TASK],
    rollouts=[
        Rollout(epoch=0, task="t", group=0, sample=i, reward=1.0,
                steps=[step(c, cacheable=c.name != "clock") for c in calls])
        for i, calls in enumerate(CALLS)
    ] + [Rollout(epoch=0, task="t", group=0, sample=G, reward=0.0, steps=[step(SLOW, 1.0)])],  # a slow call
)
RECORDED = {(i, j): s.observation_digest for i, r in enumerate(TRACE.rollouts) for j, s in enumerate(r.steps)}


class FaultyBackend(SimBackend):
    """Fails every call named ``crash``, as a workspace that died would."""

    async def execute(self, workspace: Workspace, c: ToolCall, context: CallContext) -> ToolResult:
        if c.name == "crash":
            await anyio.sleep(EXEC)
            raise BackendError(f"workspace {workspace.id} died")
        return await super().execute(workspace, c, context)


@contextlib.asynccontextmanager
async def serving(config: ServeConfig | None = None, backend: SimBackend | None = None
                  ) -> AsyncIterator[tuple[httpx.AsyncClient, SimBackend]]:
    backend = backend or SimBackend("bunshin", ToolModel(TRACE))
    async with open_service(backend, config, tasks=TRACE.task_map(), cacheable=["shell"]) as service:
        async with open_http_server(create_app(service), host="127.0.0.1", port=0) as server:
            async with httpx.AsyncClient(base_url=server.url + "/v1", trust_env=False, timeout=10) as client:
                yield client, backend
    assert backend.live_handles() == 0  # the service released everything it made


async def register(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/tasks", json={"id": "t", **body})
    assert r.status_code == 201, r.text
    return r.json()


async def open_group(client: httpx.AsyncClient, size: int = G, task: str = "t", **body: Any) -> dict[str, Any]:
    r = await client.post(f"/tasks/{task}/groups", json={"size": size, **body})
    assert r.status_code == 201, r.text
    return r.json()


async def do(client: httpx.AsyncClient, session: str, c: ToolCall) -> dict[str, Any]:
    r = await client.post(f"/sessions/{session}/step", json={"call": {"name": c.name, "arguments": c.arguments}})
    assert r.status_code == 200, r.text
    return r.json()


async def close(client: httpx.AsyncClient, session: str, reward: float | None = 1.0) -> dict[str, Any]:
    r = await client.post(f"/sessions/{session}/close", json={} if reward is None else {"reward": reward})
    assert r.status_code == 200, r.text
    return r.json()


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/stats")).json()


def run(fn: Any) -> Any:
    return anyio.run(fn)


# -- transparency, caching, speculation ------------------------------------------------------------


def test_observations_are_the_recorded_ones_and_shared_prefixes_come_from_the_cache() -> None:
    async def main() -> None:
        async with serving() as (client, backend):
            await register(client)
            group = await open_group(client)
            sessions = group["sessions"]
            assert len(sessions) == G and group["status"] == "running"
            served: dict[int, list[str]] = {}

            async def drive(i: int) -> None:
                served[i] = []
                for j, c in enumerate(CALLS[i]):
                    body = await do(client, sessions[i], c)
                    assert body["step"] == j and body["call"]["name"] == c.name
                    assert body["observation"]["digest"] == RECORDED[i, j]  # transparency
                    served[i].append(body["served_by"])
                info = await close(client, sessions[i], reward=0.5 + i)
                assert info["status"] == "closed" and info["reward"] == 0.5 + i and info["steps"] == len(CALLS[i])

            await drive(0)  # the first sample runs its calls; the others find A and B in the tree
            async with anyio.create_task_group() as tg:
                for i in range(1, G):
                    tg.start_soon(drive, i)
            assert served[0] == ["executed"] * 4
            for i in range(1, G):
                assert served[i][:2] == ["cache", "cache"]
                assert served[i][3] == "executed"  # the clock is never cached
            assert (await client.get(f"/groups/{group['id']}")).json()["status"] == "ended"
            s = await stats(client)
            assert s["sessions_open"] == 0 and s["live_workspaces"] == 0
            assert s["steps"]["cache"] == 2 * (G - 1)
            # a second group of the task shares the first one's prefix tree
            group2 = await open_group(client, size=1)
            body = await do(client, group2["sessions"][0], A)
            assert body["served_by"] == "cache" and body["observation"]["digest"] == RECORDED[0, 0]
            await close(client, group2["sessions"][0])
            # deleting the task releases its cached snapshots
            assert (await client.delete("/tasks/t")).status_code == 204
            assert backend.live_handles() == 0

    run(main)


def test_speculation_is_adopted_when_the_model_thinks_long_enough() -> None:
    # caching off, so that calls seen before are run again, ahead of the model, not looked up
    config = ServeConfig(scheduler=SchedulerConfig.preset("spec", spec_tail=1.0))

    async def main() -> None:
        async with serving(config) as (client, _):
            await register(client)
            first = await open_group(client, size=1)  # teaches the task's predictor A, B, x0
            for c in CALLS[0][:3]:
                assert (await do(client, first["sessions"][0], c))["served_by"] == "executed"
            await close(client, first["sessions"][0])
            second = await open_group(client, size=1)
            sid = second["sessions"][0]
            got = []
            for c in CALLS[0][:3]:
                await anyio.sleep(5 * EXEC)  # the model thinks; the predicted call runs meanwhile
                got.append(await do(client, sid, c))
            assert [b["served_by"] for b in got] == ["speculation"] * 3
            assert got[0]["timings"]["think"] is None
            assert [b["observation"]["digest"] for b in got] == [RECORDED[0, j] for j in range(3)]
            assert got[2]["timings"]["think"] >= 5 * EXEC
            assert got[2]["timings"]["wait"] < got[2]["timings"]["think"]  # the answer was (nearly) ready
            await close(client, sid)

    run(main)


def test_with_caching_on_speculation_serves_calls_the_tree_cannot() -> None:
    async def main() -> None:
        async with serving() as (client, _):
            await register(client)
            first = await open_group(client, size=1)
            sid = first["sessions"][0]
            seen = [await do(client, sid, c) for c in (CLOCK, A, B)]
            assert [b["served_by"] for b in seen] == ["executed"] * 3
            await close(client, sid)
            # after the clock (not cacheable) the sample is off the tree: A and B are run ahead
            second = await open_group(client, size=1)
            sid = second["sessions"][0]
            got = [await do(client, sid, CLOCK)]
            for c in (A, B):
                await anyio.sleep(5 * EXEC)
                got.append(await do(client, sid, c))
            assert [b["served_by"] for b in got] == ["executed", "speculation", "speculation"]
            assert [b["observation"] for b in got] == [b["observation"] for b in seen]
            await close(client, sid)

    run(main)


# -- bad requests ---------------------------------------------------------------------------------


def test_bad_requests_get_4xx_that_say_what_is_wrong() -> None:
    async def main() -> None:
        async with serving(ServeConfig(max_workspaces=4)) as (client, _):
            r = await client.post("/tasks", json={"id": "bad id!"})
            assert r.status_code == 400 and r.json()["extra"][0]["key"] == "id"
            r = await client.post("/tasks", json={"description": "no id"})
            assert r.status_code == 400 and "id" in r.text
            r = await client.post("/tasks", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400
            r = await client.post("/tasks", json={"id": "t", "setup": [{"arguments": {}}]})
            assert r.status_code == 400 and "name" in r.text
            await register(client)
            r = await client.post("/tasks", json={"id": "t"})
            assert r.status_code == 409 and "already registered" in r.json()["detail"]
            r = await client.post("/tasks/nope/groups", json={"size": 1})
            assert r.status_code == 404 and "no task 'nope'" in r.json()["detail"]
            r = await client.post("/tasks/t/groups", json={"size": 0})
            assert r.status_code == 400 and r.json()["extra"][0]["key"] == "size"
            r = await client.post("/tasks/t/groups", json={"size": 5})
            assert r.status_code == 422 and "max_workspaces" in r.json()["detail"]
            r = await client.post("/sessions/g9-s0/step", json={"call": {"name": "shell"}})
            assert r.status_code == 404
            group = await open_group(client, size=2)
            s0, s1 = group["sessions"]
            r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": "shell"}, "think": 1})
            assert r.status_code == 400 and "think" in r.text
            r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": ""}})
            assert r.status_code == 400 and "name" in r.text
            # one request at a time per session
            async with anyio.create_task_group() as tg:
                tg.start_soon(do, client, s0, SLOW)
                await anyio.sleep(0.2)
                r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": "shell"}})
                assert r.status_code == 409 and "stepping" in r.json()["detail"]
                r = await client.post(f"/sessions/{s0}/close", json={})
                assert r.status_code == 409
            info = await close(client, s0, reward=None)
            assert info["reward"] is None and "without a reward" in info["reason"]
            r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": "shell"}})
            assert r.status_code == 409 and "closed" in r.json()["detail"]
            r = await client.post(f"/sessions/{s0}/close", json={"reward": 1})
            assert r.status_code == 409
            r = await client.delete("/tasks/t")
            assert r.status_code == 409 and "running groups" in r.json()["detail"]
            closed = (await client.delete(f"/groups/{group['id']}")).json()
            assert closed["status"] == "ended"
            info = (await client.get(f"/sessions/{s1}")).json()
            assert info["status"] == "closed" and "closed with its group" in info["reason"]
            assert (await client.delete("/tasks/t")).status_code == 204
            assert (await client.get("/tasks/t")).status_code == 404

    run(main)


def test_a_live_spec_checks_calls_against_its_tools() -> None:
    from bunshin_async._spec import spec_from_dict

    spec = spec_from_dict({"name": "s", "tools": {"cat": {"command": "cat -- {path}", "cacheable": True}}})

    async def main() -> None:
        backend = SimBackend("bunshin", ToolModel(TRACE))
        async with open_service(backend, spec=spec) as service:
            async with open_http_server(create_app(service)) as server:
                async with httpx.AsyncClient(base_url=server.url + "/v1", trust_env=False) as client:
                    r = await client.post("/tasks", json={"id": "t", "setup": [{"name": "rm", "arguments": {}}]})
                    assert r.status_code == 422 and "setup[0]" in r.text and "'rm' is not declared" in r.text
                    r = await client.post("/tasks", json={"id": "t", "cacheable": ["cat", "ls"]})
                    assert r.status_code == 422 and "cacheable[1]" in r.text
                    info = await register(client)
                    assert info["cacheable"] == ["cat"]
                    group = await open_group(client, size=1)
                    sid = group["sessions"][0]
                    r = await client.post(f"/sessions/{sid}/step", json={"call": {"name": "cat", "arguments": {}}})
                    assert r.status_code == 422 and "missing argument 'path'" in r.text
                    body = await do(client, sid, call("cat", path="/etc/hostname"))
                    assert body["served_by"] == "executed"
                    await close(client, sid)

    run(main)


# -- limits, idle sessions, faults ------------------------------------------------------------------


def test_groups_beyond_the_limits_wait_or_are_refused() -> None:
    async def main() -> None:
        async with serving(ServeConfig(max_workspaces=4, retry_after=2)) as (client, _):
            await register(client)
            first = await open_group(client, size=3)
            r = await client.post("/tasks/t/groups", json={"size": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            body = r.json()
            assert body["extra"]["limit"] == "max_workspaces" and body["extra"]["in_use"] == 3
            assert "max_workspaces" in body["detail"]
            # a group that waits opens as soon as a session closes
            opened: dict[str, Any] = {}

            async def wait_for_room() -> None:
                opened.update(await open_group(client, size=2, wait=5))

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_room)
                await anyio.sleep(0.3)
                assert not opened
                await close(client, first["sessions"][0])
            assert len(opened["sessions"]) == 2
            s = await stats(client)
            assert s["sessions_open"] == 4 and s["refused"] == 1
            for gid in (first["id"], opened["id"]):
                await client.delete(f"/groups/{gid}")
        # bytes: once the task's workspaces are in memory, the next group is refused with 503
        async with serving(ServeConfig(max_bytes=1)) as (client, _):
            await register(client)
            group = await open_group(client, size=1)
            r = await client.post("/tasks/t/groups", json={"size": 1, "wait": 0.3})
            assert r.status_code == 503 and r.json()["extra"]["limit"] == "max_bytes"
            await close(client, group["sessions"][0])

    run(main)


def test_an_idle_session_expires_and_its_workspace_is_released() -> None:
    async def main() -> None:
        async with serving(ServeConfig(idle_timeout=0.4)) as (client, _):
            await register(client)
            group = await open_group(client, size=2)
            s0, s1 = group["sessions"]
            await do(client, s0, A)
            for _ in range(6):  # s1 keeps stepping while s0 idles
                await anyio.sleep(0.1)
                await do(client, s1, call("shell", cmd="x1"))
            info = (await client.get(f"/sessions/{s0}")).json()
            assert info["status"] == "expired" and "idle for more than 0.4 s" in info["reason"]
            r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": "shell"}})
            assert r.status_code == 409 and "expired" in r.json()["detail"]
            await close(client, s1)
            s = await stats(client)
            assert s["sessions_ended"]["expired"] == 1 and s["live_workspaces"] == 0

    run(main)


def test_a_client_that_disconnects_mid_step_fails_only_its_session() -> None:
    async def main() -> None:
        async with serving() as (client, _):
            await register(client)
            group = await open_group(client, size=2)
            s0, s1 = group["sessions"]
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"/sessions/{s0}/step", json={"call": {"name": "shell", "arguments": {"cmd": "sleep"}}},
                                  timeout=0.2)
            for _ in range(100):
                info = (await client.get(f"/sessions/{s0}")).json()
                if info["status"] == "failed":
                    break
                await anyio.sleep(0.02)
            assert info["status"] == "failed" and "disconnected" in info["reason"]
            assert (await do(client, s1, A))["observation"]["digest"] == RECORDED[1, 0]
            await close(client, s1)
            assert (await stats(client))["live_workspaces"] == 0

    run(main)


def test_a_workspace_that_dies_fails_its_session_and_the_others_go_on() -> None:
    async def main() -> None:
        async with serving(backend=FaultyBackend("bunshin", ToolModel(TRACE))) as (client, _):
            await register(client)
            group = await open_group(client, size=2)
            s0, s1 = group["sessions"]
            r = await client.post(f"/sessions/{s0}/step", json={"call": {"name": "crash"}})
            assert r.status_code == 502 and "died" in r.json()["detail"]
            info = (await client.get(f"/sessions/{s0}")).json()
            assert info["status"] == "failed" and "BackendError" in info["reason"]
            assert (await do(client, s1, A))["served_by"] == "executed"
            await close(client, s1)
            # a task whose set-up fails: its group is refused with 502, and the service goes on
            r = await client.post("/tasks", json={"id": "broken", "setup": [{"name": "crash"}]})
            assert r.status_code == 201
            r = await client.post("/tasks/broken/groups", json={"size": 2})
            assert r.status_code == 502 and "could not start" in r.json()["detail"] and "died" in r.text
            s = await stats(client)
            assert s["sessions_open"] == 0 and s["sessions_ended"]["failed"] == 3 and s["live_workspaces"] == 0
            assert (await client.delete("/tasks/broken")).status_code == 204

    run(main)


def test_set_up_calls_run_once_in_the_root() -> None:
    async def main() -> None:
        async with serving() as (client, backend):
            info = await register(client, setup=[{"name": "shell", "arguments": {"cmd": "a"}}])
            assert info["setup_observations"] == []
            group = await open_group(client, size=2)
            info = (await client.get("/tasks/t")).json()
            assert [o["digest"] for o in info["setup_observations"]] == [RECORDED[0, 0]]
            assert info["open_groups"] == [group["id"]]
            assert backend.statistics().executions == 1  # the set-up call, once
            for sid in group["sessions"]:
                await close(client, sid)

    run(main)


def test_shutdown_closes_open_sessions_and_releases_everything() -> None:
    async def main() -> None:
        backend = SimBackend("bunshin", ToolModel(TRACE))
        async with serving(backend=backend) as (client, _):
            await register(client)
            group = await open_group(client, size=3)
            await do(client, group["sessions"][0], A)
            assert backend.live_handles() > 0
        assert backend.live_handles() == 0  # also checked by serving()

    run(main)


def test_many_concurrent_sessions() -> None:
    # issue 7's load figure: 256 sessions stepping at once, no errors, nothing left, and the
    # working set within the bound the service is given. The bound is the most the model lets
    # them hold: the task's root, plus every byte each session's calls dirty, twice (its own
    # fork and a speculative branch of the same call), plus the tree's snapshot of each call.
    n, groups = 256, 16
    bound = TASK.memory.runtime_bytes + 3 * n * len(CALLS[0]) * MiB

    async def main() -> None:
        async with serving(ServeConfig(max_workspaces=n, max_bytes=bound)) as (client, backend):
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, backend.working_set())
                    await anyio.sleep(0.005)

            await register(client)
            opened = []

            async def open_one() -> None:
                opened.append(await open_group(client, size=n // groups))

            async with anyio.create_task_group() as tg:
                for _ in range(groups):
                    tg.start_soon(open_one)
            sessions = [s for g in opened for s in g["sessions"]]
            assert len(set(sessions)) == n
            r = await client.post("/tasks/t/groups", json={"size": 1})
            assert r.status_code == 429
            results: list[str] = []

            async def drive(i: int, sid: str) -> None:
                for j, c in enumerate(CALLS[i % G]):
                    body = await do(client, sid, c)
                    assert body["observation"]["digest"] == RECORDED[i % G, j]
                    results.append(body["served_by"])
                await close(client, sid, reward=1.0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                async with anyio.create_task_group() as drivers:
                    for i, sid in enumerate(sessions):
                        drivers.start_soon(drive, i, sid)
                tg.cancel_scope.cancel()
            s = await stats(client)
            assert len(results) == 4 * n and s["sessions_ended"]["closed"] == n
            # sessions in lock-step may all miss the tree: how many hit depends on timing
            assert sum(s["steps"].values()) == 4 * n and s["live_workspaces"] == 0
            assert 0 < peak <= bound

    run(main)


def test_the_openapi_document_lists_the_endpoints() -> None:
    async def main() -> None:
        async with serving() as (client, _):
            r = await client.get(str(client.base_url).removesuffix("/v1/") + "/schema/openapi.json")
            assert r.status_code == 200
            doc = r.json()
            assert doc["info"]["title"] == "Bunshin rollout service"
            paths = doc["paths"]
            for path, method in [
                ("/v1/tasks", "post"), ("/v1/tasks/{task_id}", "get"), ("/v1/tasks/{task_id}", "delete"),
                ("/v1/tasks/{task_id}/groups", "post"), ("/v1/groups/{group_id}", "delete"),
                ("/v1/sessions/{session_id}", "get"), ("/v1/sessions/{session_id}/step", "post"),
                ("/v1/sessions/{session_id}/close", "post"), ("/v1/stats", "get"),
            ]:
                assert method in paths[path], (path, method)
            step_schema = doc["components"]["schemas"]
            assert "StepResponse" in step_schema and "served_by" in step_schema["StepResponse"]["properties"]
            assert (await client.get("/health")).json() == {"status": "ok"}

    run(main)


# -- real workspaces ------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root")
@pytest.mark.usefixtures("leak_check")
def test_live_workspaces_behind_the_api(state) -> None:
    pytest.importorskip("bunshin_async._bunshin_c")
    from bunshin_async._live import LiveBackend
    from bunshin_async._spec import spec_from_dict

    spec = spec_from_dict({
        "name": "serve",
        "tools": {
            "sh": {"command": "{command}", "raw": ["command"], "shell": "main", "stateful": True},
            "write": {"command": "printf '%s' {text} > {path}"},
            "cat": {"command": "cat -- {path}", "cacheable": True, "timeout": 5},
        },
    })

    async def main() -> None:
        async with LiveBackend(spec, state=state) as backend:
            async with open_service(backend, spec=spec) as service:
                async with open_http_server(create_app(service)) as server:
                    async with httpx.AsyncClient(base_url=server.url + "/v1", trust_env=False, timeout=60) as client:
                        await register(client, setup=[{"name": "write", "arguments": {"path": "/root/f", "text": "hello"}}])
                        group = await open_group(client, size=2)
                        s0, s1 = group["sessions"]
                        first = await do(client, s0, call("cat", path="/root/f"))
                        assert first["observation"]["output"] == "hello" and first["served_by"] == "executed"
                        second = await do(client, s1, call("cat", path="/root/f"))
                        assert second["served_by"] == "cache" and second["observation"] == first["observation"]
                        # the sessions are isolated forks
                        await do(client, s0, call("write", path="/root/f", text="mine"))
                        assert (await do(client, s0, call("cat", path="/root/f")))["observation"]["output"] == "mine"
                        assert (await do(client, s1, call("sh", command="cat /root/f")))["observation"]["output"] == "hello"
                        r = await client.post(f"/sessions/{s1}/step", json={"call": {"name": "rm", "arguments": {}}})
                        assert r.status_code == 422
                        await close(client, s0)
                        await close(client, s1, reward=0.0)
                        assert (await client.delete("/tasks/t")).status_code == 204
                        assert backend.live_handles() == 0
                await service.aclose()
            assert backend.live_handles() == 0

    anyio.run(main)


def test_a_restarted_service_reports_the_sessions_a_killed_one_left(tmp_path) -> None:
    journal = str(tmp_path / "journal.json")
    config = ServeConfig(journal=journal)

    async def first() -> tuple[bytes, list[str]]:
        async with serving(config) as (client, _):
            await register(client)
            group = await open_group(client, size=2)
            await do(client, group["sessions"][0], A)
            with open(journal, "rb") as f:
                left = f.read()  # what a SIGKILL now would leave behind
            return left, group["sessions"]

    left, sessions = run(first)
    with open(journal, "rb") as f:
        assert json.loads(f.read())["sessions"] == {}  # a clean shutdown leaves nothing open
    with open(journal, "wb") as f:
        f.write(left)

    async def second() -> None:
        async with serving(config) as (client, _):
            for sid in sessions:
                info = (await client.get(f"/sessions/{sid}")).json()
                assert info["status"] == "failed" and "stopped while it was open" in info["reason"]
                assert info["task"] == "t"
            r = await client.post(f"/sessions/{sessions[0]}/step", json={"call": {"name": "shell", "arguments": {"cmd": "a"}}})
            assert r.status_code == 409 and "was lost" in r.json()["detail"]
            assert (await stats(client))["lost"] == 2
            await register(client)
            group = await open_group(client, size=1)
            assert not set(group["sessions"]) & set(sessions)  # new ids never reuse lost ones
            await close(client, group["sessions"][0])

    run(second)
    with open(journal, "w") as f:
        f.write("{not json")

    async def third() -> None:
        async with serving(config):
            pass

    with pytest.raises(BaseException) as info:
        run(third)
    leaves, todo = [], [info.value]
    while todo:
        e = todo.pop()
        todo.extend(e.exceptions) if isinstance(e, BaseExceptionGroup) else leaves.append(e)
    assert any(isinstance(e, ConfigError) and "cannot read it" in str(e) for e in leaves)


def _start_serve(*args: str) -> tuple[Any, str]:
    """``bunshin serve`` as a process of its own; returns it and its API URL."""
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "bunshin_async._cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = ""
    for line in proc.stdout:
        seen += line
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m is not None:
            return proc, m.group(1) + "/v1"
    proc.wait()
    raise AssertionError(f"bunshin serve did not start: {seen}")



@pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root")
@pytest.mark.usefixtures("leak_check")
def test_a_killed_live_service_leaves_nothing_and_its_restart_reports_the_lost_sessions(state) -> None:
    import signal

    pytest.importorskip("bunshin_async._bunshin_c")
    proc, url = _start_serve("--state-dir", state.path)
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            client.post("/tasks", json={"id": "k", "description": "a task"}).raise_for_status()
            group = client.post("/tasks/k/groups", json={"size": 2}).json()
            r = client.post(f"/sessions/{group['sessions'][0]}/step",
                            json={"call": {"name": "shell", "arguments": {"command": "echo hi > /tmp/x"}}})
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGKILL)  # no clean-up of its own: workspaces, cgroups, layers stay
        proc.communicate()
    proc, url = _start_serve("--state-dir", state.path)  # its backend removes what the killed one left
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            for sid in group["sessions"]:
                info = client.get(f"/sessions/{sid}").json()
                assert info["status"] == "failed" and "stopped while it was open" in info["reason"]
            assert client.get("/stats").json()["lost"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "0 workspace handles left" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root")
def test_the_readme_trainer_example_runs_end_to_end(tmp_path) -> None:
    # examples/trainer.py, as the README shows it, against `bunshin serve` on live workspaces
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "trainer.py"
    proc = subprocess.Popen([sys.executable, "-m", "bunshin_async._cli", "serve", "--port", "0",
                             "--state-dir", str(tmp_path / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            if m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1) + "/v1"
                break
        assert url, "the service did not start"
        runs = []
        for group in (4, 3):  # the second group finds the opening calls in the prefix tree
            r = subprocess.run([sys.executable, str(example), "--url", url, "--group", str(group)],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            samples = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
            assert len(samples) == group and all(s["reward"] in (0.0, 1.0) for s in samples)
            # samples 0 and 1 count right, sample 2 counts every file: the verifier tells them apart
            assert [s["reward"] for s in samples][:3] == [1.0, 1.0, 0.0]
            runs.append(samples)
        assert all(s["served_by"][:2] == ["cache", "cache"] for s in runs[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "0 workspace handles left" in out, out


@pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root")
@pytest.mark.usefixtures("leak_check")
def test_a_live_workspace_that_dies_fails_its_session_and_the_others_go_on(state) -> None:
    import signal
    from pathlib import Path

    import psutil

    pytest.importorskip("bunshin_async._bunshin_c")
    sh = {"name": "shell", "arguments": {"command": "echo alive"}}
    proc, url = _start_serve("--state-dir", state.path, "--policy", "base")
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
            client.post("/tasks", json={"id": "d", "description": "a task"}).raise_for_status()
            group = client.post("/tasks/d/groups", json={"size": 3, "wait": 30}).json()
            for sid in group["sessions"]:
                assert client.post(f"/sessions/{sid}/step", json={"call": sh}).status_code == 200
            # the workspaces' agents are the service's children (the zygote clones them with
            # CLONE_PARENT), each in its workspace's cgroup; the zygote is a child too
            agents = [p for p in psutil.Process(proc.pid).children()
                      if "/bunshin/" in Path(f"/proc/{p.pid}/cgroup").read_text()]
            assert len(agents) == 3
            agents[0].kill()  # one workspace dies under its session (a zombie until the service reaps it)
            results = [client.post(f"/sessions/{sid}/step", json={"call": sh}) for sid in group["sessions"]]
            failed = [sid for sid, r in zip(group["sessions"], results) if r.status_code != 200]
            assert len(failed) == 1, [r.text for r in results]
            r = results[group["sessions"].index(failed[0])]
            assert r.status_code == 502 and "died: killed by SIGKILL" in r.json()["detail"], r.text
            info = client.get(f"/sessions/{failed[0]}").json()
            assert info["status"] == "failed" and info["reason"]
            for sid in group["sessions"]:
                if sid not in failed:  # the others go on, and close with their rewards
                    assert client.post(f"/sessions/{sid}/step", json={"call": sh}).json()["served_by"] == "executed"
                    client.post(f"/sessions/{sid}/close", json={"reward": 1.0}).raise_for_status()
            s = client.get("/stats").json()
            assert s["sessions_open"] == 0 and s["sessions_ended"]["failed"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "0 workspace handles left" in out, out
