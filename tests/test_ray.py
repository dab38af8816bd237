"""Scale-out with Ray (``bunshin serve --ray``) on a local two-node Ray cluster on loopback.

One cluster (``ray.cluster_utils.Cluster``: two raylets on 127.0.0.1, one CPU and a small
object store each, no dashboard) serves the whole module; each test opens its own router on
it, with the simulator's backend on each node over a small trace whose calls run for tens of
milliseconds, and drives it with ``httpx.AsyncClient`` through the router's HTTP API. The
module is skipped when ray is not installed or cannot start here; whatever happens, every Ray
process the module started is gone at its end (checked with psutil).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from bunshin_async import (
    MemoryProfile,
    RayRouter,
    Rollout,
    SimNodeBackend,
    Step,
    Task,
    ToolCall,
    Trace,
    create_router_app,
    encode_trace,
    observation_digest,
    open_http_server,
    open_ray_service,
)

# Every Ray process of the module (raylets, workers, the CLI's driver) takes 127.0.0.1 as its
# node's address: without this Ray replaces loopback with the host's first address, and the
# driver then cannot reach a GCS listening on loopback. Read by Ray when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'bunshin[ray]')")
psutil = pytest.importorskip("psutil", reason="psutil is needed to check that no Ray process is left")
from ray.cluster_utils import Cluster

MiB = 1 << 20
EXEC = 0.02
G = 3
TASKS = [f"t{k}" for k in range(4)]


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=args)


def step(c: ToolCall) -> Step:
    return Step(think_time=0.0, call=c, exec_time=EXEC,
                observation_digest=observation_digest(f"{c.name}{sorted(c.arguments.items())}"),
                observation_size=10, dirtied_bytes=MiB, cacheable=True)


A, B = call("shell", cmd="a"), call("shell", cmd="b")
CALLS = [[A, B, call("shell", cmd=f"x{i}")] for i in range(G)]
TRACE = Trace(
    version=1, name="ray",
    tasks=[Task(id=t, memory=MemoryProfile(image_bytes=0, runtime_bytes=64 * MiB, boot_time=0.0)) for t in TASKS],
    rollouts=[Rollout(epoch=0, task=t, group=0, sample=i, reward=1.0, steps=[step(c) for c in calls])
              for t in TASKS for i, calls in enumerate(CALLS)],
)
RECORDED = {i: [step(c).observation_digest for c in calls] for i, calls in enumerate(CALLS)}
BACKEND = SimNodeBackend(encode_trace(TRACE))


def _ray_processes() -> list[Any]:
    from bunshin_async import _zygote  # started by earlier live tests: not Ray's

    zygote = _zygote.running_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != zygote]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    started = time.monotonic()
    c: Any = None
    try:
        args = {"num_cpus": 1, "object_store_memory": 80 * MiB, "node_ip_address": "127.0.0.1"}
        c = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
        c.add_node(**args)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
    except Exception as exc:  # no Ray here (sandbox, ports, shared memory): skip, after cleaning up
        procs = _ray_processes()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if c is not None:
            with contextlib.suppress(Exception):
                c.shutdown()
        _reap(procs)
        pytest.skip(f"a local Ray cluster cannot start here: {type(exc).__name__}: {exc}")
    print(f"\nRay cluster of 2 nodes up in {time.monotonic() - started:.1f} s")
    try:
        yield c
    finally:
        procs = _ray_processes()
        try:
            with contextlib.suppress(Exception):
                ray.shutdown()
            c.shutdown()
        finally:
            left = _reap(procs)
        assert not left, f"Ray processes left after shutdown (killed now): {left}"


def _reap(procs: list[Any]) -> list[str]:
    """Wait for *procs* to exit; kill and name those that do not."""
    _, alive = psutil.wait_procs(procs, timeout=15)
    names = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            names.append(f"{p.pid} {p.name()}")
            p.kill()
    return names


@contextlib.asynccontextmanager
async def routing(**options: Any) -> AsyncIterator[tuple[httpx.AsyncClient, RayRouter]]:
    async with open_ray_service(BACKEND, **options) as router:
        async with open_http_server(create_router_app(router), host="127.0.0.1", port=0) as server:
            async with httpx.AsyncClient(base_url=server.url + "/v1", trust_env=False, timeout=30) as client:
                yield client, router
    for node in router.nodes:  # each node's service released everything it made
        if node.alive:
            assert node.left == 0, node


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def register(client: httpx.AsyncClient, task: str) -> None:
    r = await client.post("/tasks", json={"id": task})
    assert r.status_code == 201, r.text


async def open_group(client: httpx.AsyncClient, task: str, size: int = G) -> dict[str, Any]:
    r = await client.post(f"/tasks/{task}/groups", json={"size": size, "wait": 5})
    assert r.status_code == 201, r.text
    return r.json()


async def do(client: httpx.AsyncClient, session: str, c: ToolCall) -> dict[str, Any]:
    r = await client.post(f"/sessions/{session}/step", json={"call": {"name": c.name, "arguments": c.arguments}})
    assert r.status_code == 200, r.text
    return r.json()


async def close(client: httpx.AsyncClient, session: str) -> dict[str, Any]:
    r = await client.post(f"/sessions/{session}/close", json={"reward": 1.0})
    assert r.status_code == 200, r.text
    return r.json()


def test_groups_stay_on_their_task_s_node_and_tasks_spread_over_the_nodes(cluster: Any) -> None:
    async def main() -> None:
        async with routing() as (client, router):
            nodes = router.nodes
            assert [n.name for n in nodes] == ["n0", "n1"]
            assert len({n.node_id for n in nodes}) == 2  # one actor on each node
            assert all(n.url.startswith("http://127.0.0.1:") for n in nodes)
            pids = [n.pid for n in nodes]
            for t in TASKS:
                await register(client, t)
            owner = {t: router.node_of_task(t) for t in TASKS}
            assert sorted(owner.values()) == ["n0", "n0", "n1", "n1"]  # least loaded: spread evenly
            listed = (await client.get("/nodes")).json()
            assert {n["name"]: sorted(n["tasks"]) for n in listed} == {
                name: sorted(t for t in TASKS if owner[t] == name) for name in ("n0", "n1")}
            assert (await client.post("/tasks", json={"id": "t0"})).status_code == 409  # on its node

            served: dict[str, list[list[str]]] = {t: [] for t in TASKS}

            async def drive(t: str, session: str, i: int) -> None:
                got = []
                for j, c in enumerate(CALLS[i]):
                    body = await do(client, session, c)
                    assert body["session"] == session and body["step"] == j
                    assert body["observation"]["digest"] == RECORDED[i][j]  # transparency
                    got.append(body["served_by"])
                info = await close(client, session)
                assert info["id"] == session and info["status"] == "closed"
                served[t].append(got)

            async def run_task(t: str) -> None:
                for _ in range(2):  # two groups of each task, one after the other
                    group = await open_group(client, t)
                    node = owner[t]
                    assert group["id"].startswith(node + "-")
                    assert all(s.startswith(group["id"] + "-") for s in group["sessions"])
                    task_info = (await client.get(f"/tasks/{t}")).json()
                    assert task_info["open_groups"] == [group["id"]]
                    await drive(t, group["sessions"][0], 0)
                    async with anyio.create_task_group() as tg:
                        for i in range(1, G):
                            tg.start_soon(drive, t, group["sessions"][i], i)
                    with anyio.fail_after(5):  # the group's run ends just after its last session
                        while (await client.get(f"/groups/{group['id']}")).json()["status"] != "ended":
                            await anyio.sleep(0.01)

            async with anyio.create_task_group() as tg:
                for t in TASKS:
                    tg.start_soon(run_task, t)

            for t in TASKS:
                first, *rest = served[t]
                assert first == ["executed"] * 3  # the task's first session ran its calls
                assert all(s[:2] == ["cache", "cache"] for s in rest)  # the others hit its node's tree
            stats = (await client.get("/stats")).json()
            assert stats["tasks"] == 4 and stats["sessions_open"] == 0 and stats["down"] == []
            assert stats["sessions_ended"]["closed"] == 4 * 2 * G
            # each node served exactly the sessions of its own tasks, with its own cache
            for name in ("n0", "n1"):
                node_stats = stats["nodes"][name]
                assert node_stats["tasks"] == 2
                assert node_stats["sessions_ended"]["closed"] == 2 * 2 * G
                assert node_stats["steps"]["executed"] + node_stats["steps"]["cache"] \
                    + node_stats["steps"]["speculation"] == 2 * 2 * G * 3
                assert node_stats["steps"]["cache"] >= 2 * (2 * G - 1) * 2
            tasks = (await client.get("/tasks")).json()
            assert sorted(t["id"] for t in tasks) == TASKS
            health = (await client.get("/health")).json()
            assert health == {"status": "ok", "nodes": {"n0": "ok", "n1": "ok"}}
            assert (await client.get("/sessions/n7-g0-s0")).status_code == 404
            assert (await client.get("/sessions/n0-g99-s0")).json()["extra"]["node"] == "n0"
            for t in TASKS:
                assert (await client.delete(f"/tasks/{t}")).status_code == 204
            assert all(n["tasks"] == [] for n in (await client.get("/nodes")).json())
            schema = await client.get(client.base_url.join("/schema/openapi.json"))
            assert schema.status_code == 200 and "/v1/sessions/{session_id}/step" in schema.json()["paths"]
        # every actor is gone, and each node's backend held nothing at the end (checked in routing)
        for pid in pids:
            with anyio.fail_after(10):
                while _alive(pid):
                    await anyio.sleep(0.1)

    anyio.run(main)


def test_a_node_that_dies_fails_its_sessions_and_the_other_goes_on(cluster: Any) -> None:
    async def main() -> None:
        async with routing(probe_timeout=5) as (client, router):
            await register(client, "t0")
            await register(client, "t1")
            owner = {t: router.node_of_task(t) for t in ("t0", "t1")}
            assert set(owner.values()) == {"n0", "n1"}
            groups = {t: await open_group(client, t) for t in ("t0", "t1")}
            for t in ("t0", "t1"):
                await do(client, groups[t]["sessions"][0], A)
            victim = next(n for n in router.nodes if n.name == owner["t1"])
            os.kill(victim.pid, signal.SIGKILL)  # the node's service crashes
            r = await client.post(f"/sessions/{groups['t1']['sessions'][1]}/step",
                                  json={"call": {"name": "shell", "arguments": {"cmd": "a"}}})
            assert r.status_code == 502, r.text
            assert r.json()["extra"]["node"] == victim.name and victim.name in r.json()["detail"]
            r = await client.get(f"/sessions/{groups['t1']['sessions'][0]}")
            assert r.status_code == 503 and r.json()["extra"]["node"] == victim.name
            assert "gone" in r.json()["detail"]
            assert (await client.post("/tasks/t1/groups", json={"size": 1})).status_code == 503
            # the other node goes on
            survivor = groups["t0"]["sessions"]
            body = await do(client, survivor[0], B)
            assert body["served_by"] == "executed"
            body = await do(client, survivor[1], A)
            assert body["served_by"] == "cache"
            for s in survivor:
                await close(client, s)
            health = (await client.get("/health")).json()
            assert health["status"] == "degraded" and health["nodes"][victim.name] == "down"
            stats = (await client.get("/stats")).json()
            assert stats["down"] == [victim.name] and stats["nodes"][victim.name] is None
            # a task lost with its node may be registered again, on a live node
            assert (await client.delete("/tasks/t1")).status_code == 204
            await register(client, "t2")
            assert router.node_of_task("t2") == owner["t0"]
        assert [n.left for n in router.nodes if n.name == victim.name] == [None]

    anyio.run(main)


def test_bunshin_serve_ray_joins_the_cluster(cluster: Any, tmp_path: Any) -> None:
    trace = tmp_path / "trace.json"
    trace.write_bytes(encode_trace(TRACE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bunshin_async._cli", "serve", "--ray", cluster.address, "--sim", str(trace),
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "listening on http://" in line, line + (proc.stderr.read() if proc.stderr and proc.poll() else "")
        url = line.split("listening on ")[1].split(";")[0].split()[0]
        with httpx.Client(base_url=url + "/v1", trust_env=False, timeout=30) as client:
            assert client.get("/health").json()["status"] == "ok"
            assert client.post("/tasks", json={"id": "t0"}).status_code == 201
            group = client.post("/tasks/t0/groups", json={"size": 2}).json()
            s = group["sessions"][0]
            assert client.post(f"/sessions/{s}/step", json={"call": {"name": "shell", "arguments": {"cmd": "a"}}}
                               ).json()["observation"]["digest"] == RECORDED[0][0]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "2 nodes" in out and "0 workspace handles left" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
