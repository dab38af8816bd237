"""The rollout service's agent mode: the service drives the model (an OpenAI-compatible
endpoint) itself and returns whole trajectories, streaming progress.

The model is the scripted HTTP server of ``test_openai_client`` (its own thread and event loop,
127.0.0.1, a port the kernel picks); the service runs on the simulator's backend over
``test_serve``'s trace, with a ``reward`` tool whose output is the verifier's score.
"""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import anyio
import httpx
from test_openai_client import Received, Reply, completion, server  # noqa: F401 - server is a fixture
from test_serve import CALLS, RECORDED, SLOW, TASK, TRACE, G, open_group, serving, stats

from bunshin_async import (
    CallContext,
    ServeConfig,
    ToolCall,
    ToolResult,
    Workspace,
    create_app,
    observation_digest,
    open_http_server,
    open_service,
    tools_from_spec,
)
from sim import SimBackend, ToolModel

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"the {name} tool",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}} for name in ("shell", "clock")]
VERIFIER = {"kind": "verifier", "call": {"name": "reward", "arguments": {}}, "answer_argument": "answer"}


class VerifiedBackend(SimBackend):
    """The simulator, plus a ``reward`` tool: the verifier prints 1 for the answer 42, a log and
    0.25 for any other answer, and no number at all for the answer ``garbage``."""

    def __init__(self) -> None:
        super().__init__("bunshin", ToolModel(TRACE))

    async def execute(self, workspace: Workspace, c: ToolCall, context: CallContext) -> ToolResult:
        if c.name != "reward":
            return await super().execute(workspace, c, context)
        answer = c.arguments.get("answer")
        out = b"1\n" if answer == "42" else b"no score here\n" if answer == "garbage" else b"checking...\n0.25\n"
        return ToolResult(observation_digest(out.decode()), len(out), 0.001, 0, output=out)


def model(srv: Any, **fields: Any) -> dict[str, Any]:
    return {"base_url": srv.url, "model": "m", "backoff_base": 0.001, "backoff_cap": 0.01, **fields}


def history(request: Received) -> list[dict[str, Any]]:
    """The calls the conversation made so far."""
    return [
        {"name": m["tool_calls"][0]["function"]["name"], "arguments": json.loads(m["tool_calls"][0]["function"]["arguments"])}
        for m in request.body["messages"] if m["role"] == "assistant"
    ]


class Agent:
    """Scripts the model: step j of the k-th sample to reach step 2 calls ``CALLS[k][j]``, then
    answers ``answers[k]``. ``special[k, j]`` replaces a reply; the first sample's first
    request is answered at once, the others after *lag* seconds (so it leads, and the others
    find its calls in the prefix tree)."""

    def __init__(self, answers: list[str], special: dict[tuple[int, int], Reply] | None = None, lag: float = 0.3) -> None:
        self.answers = answers
        self.special = special or {}
        self.lag = lag
        self._first = itertools.count()
        self._third = itertools.count()
        self._lock = threading.Lock()

    def __call__(self, request: Received) -> Reply:
        made = history(request)
        j = len(made)
        if j < 2:
            with self._lock:
                lead = j == 0 and next(self._first) == 0
            return Reply(body=completion((CALLS[0][j].name, CALLS[0][j].arguments)), stall=0 if lead or j else self.lag)
        if j == 2:
            with self._lock:
                k = next(self._third)
        else:
            k = int(made[2]["arguments"]["cmd"][1:])
        if (k, j) in self.special:
            return self.special[k, j]
        if j < len(CALLS[k]):
            c = CALLS[k][j]
            return Reply(body=completion((c.name, c.arguments)))
        return Reply(body=completion(content=self.answers[k]))


async def read_stream(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) async for line in response.aiter_lines() if line]


async def register(client: httpx.AsyncClient, **body: Any) -> None:
    r = await client.post("/tasks", json={"id": "t", "description": "Find the answer.", **body})
    assert r.status_code == 201, r.text


async def wait_ended(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    for _ in range(500):
        info = (await client.get(f"/runs/{run_id}")).json()
        if info["status"] == "ended":
            return info
        await anyio.sleep(0.02)
    raise AssertionError(f"run {run_id} did not end: {info}")


def test_a_run_drives_the_model_and_streams_its_progress(server) -> None:  # noqa: F811
    server.handler = Agent(["42"] * G)
    backend = VerifiedBackend()

    async def main() -> None:
        async with serving(backend=backend) as (client, _):
            await register(client)
            body = {"model": model(server), "reward": VERIFIER, "size": G, "tools": TOOLS, "system_prompt": "Be brief."}
            async with client.stream("POST", "/tasks/t/runs", json=body) as r:
                assert r.status_code == 201 and r.headers["content-type"].startswith("application/x-ndjson")
                events = await read_stream(r)
            run_id = events[0]["run"]
            assert r.headers["location"] == f"/v1/runs/{run_id}"
            # the stream: started, then per sample its steps in order and its end, then ended
            assert events[0]["event"] == "started" and events[0]["size"] == G and len(events[0]["rollouts"]) == G
            assert events[-1]["event"] == "ended" and events[-1]["trajectories"] == {"done": G, "failed": 0, "cancelled": 0}
            assert [e["event"] for e in events[1:-1]].count("trajectory") == G
            assert len(events) == 2 + G * (len(CALLS[0]) + 1) + G  # 4 calls and the verifier's per sample
            times = [e["time"] for e in events]
            assert times == sorted(times)
            for sample in range(G):
                mine = [e for e in events if e.get("sample") == sample]
                assert [e["event"] for e in mine] == ["step"] * 5 + ["trajectory"]
                assert [e["step"]["step"] for e in mine[:5]] == list(range(5))
                assert [e["verifier"] for e in mine[:5]] == [False] * 4 + [True]
                assert all(e["step"]["served_by"] in ("executed", "cache", "speculation") for e in mine[:5])
                assert mine[-1]["status"] == "done" and mine[-1]["reward"] == 1.0 and mine[-1]["answer"] == "42"
            # the whole trajectories
            info = (await client.get(f"/runs/{run_id}")).json()
            assert info["status"] == "ended" and not info["cancelled"] and info["reward_source"] == "verifier"
            by_k = {int(t["steps"][2]["call"]["arguments"]["cmd"][1:]): t for t in info["trajectories"]}
            assert sorted(by_k) == list(range(G))
            for k, t in by_k.items():
                assert t["status"] == "done" and t["reward"] == 1.0 and t["answer"] == "42" and not t["truncated"]
                assert [s["call"] for s in t["steps"]] == [{"name": c.name, "arguments": c.arguments} for c in CALLS[k]]
                assert [s["observation"]["digest"] for s in t["steps"]] == [RECORDED[k, j] for j in range(4)]  # transparency
                assert t["verifier"]["call"] == {"name": "reward", "arguments": {"answer": "42"}}
                assert t["verifier"]["observation"]["output"] == "1\n"
                assert t["steps"][3]["served_by"] == "executed"  # the clock is never cached
                assert all(s["think"] >= 0 for s in t["steps"])
            # one sample led; the others found its calls in the prefix tree
            first_two = sorted(tuple(s["served_by"] for s in t["steps"][:2]) for t in info["trajectories"])
            assert first_two == [("cache", "cache")] * (G - 1) + [("executed", "executed")]
            s = await stats(client)
            assert s["steps"]["cache"] >= 2 * (G - 1) and s["trajectories_ended"]["done"] == G
            assert s["runs_open"] == 0 and s["sessions_open"] == 0 and s["live_workspaces"] == 0
            # what the model was sent
            first = server.requests[0].body
            assert [m["role"] for m in first["messages"]] == ["system", "user"]
            assert first["messages"][1]["content"] == "Find the answer."
            assert [t["function"]["name"] for t in first["tools"]] == ["shell", "clock"]
            assert len(server.requests) == G * 5 and "authorization" not in server.requests[0].headers
            # the events can be read again once the run has ended
            r = await client.get(f"/runs/{run_id}/events")
            assert [json.loads(line) for line in r.text.splitlines()] == events
        assert backend.live_handles() == 0

    anyio.run(main)


def test_a_model_that_times_out_or_answers_garbage_fails_only_its_trajectory(server) -> None:  # noqa: F811
    server.handler = Agent(
        ["-", "-", "42", "garbage"],
        special={(0, 3): Reply(body=completion(("clock", {}))), (0, 4): Reply(stall=1.0, body=completion(content="late")),
                 (1, 3): Reply(body=b"<html>oops</html>")},
        lag=0.0,
    )
    backend = VerifiedBackend()

    async def main() -> None:
        async with serving(backend=backend) as (client, _):
            await register(client)
            body = {"model": model(server, timeout=0.3, retries=0), "reward": VERIFIER, "size": G, "tools": TOOLS,
                    "stream": False}
            r = await client.post("/tasks/t/runs", json=body)
            assert r.status_code == 201 and r.json()["status"] == "running"
            info = await wait_ended(client, r.json()["id"])
            by_k = {int(t["steps"][2]["call"]["arguments"]["cmd"][1:]): t for t in info["trajectories"]}
            timed_out, garbage, fine, bad_score = (by_k[k] for k in range(G))
            assert timed_out["status"] == "failed" and "timeout=0.3" in timed_out["error"] and timed_out["reward"] is None
            assert len(timed_out["steps"]) == 4  # what it did before is kept
            assert garbage["status"] == "failed" and "not valid JSON" in garbage["error"] and len(garbage["steps"]) == 3
            assert fine["status"] == "done" and fine["reward"] == 1.0
            assert bad_score["status"] == "failed" and "does not end in a finite number" in bad_score["error"]
            assert bad_score["reward"] is None and bad_score["answer"] == "garbage"
            assert bad_score["verifier"]["observation"]["output"] == "no score here\n"
            s = await stats(client)
            assert s["trajectories_ended"] == {"done": 1, "failed": 3, "cancelled": 0} and s["live_workspaces"] == 0
        assert backend.live_handles() == 0

    anyio.run(main)


def test_a_client_leaving_the_stream_does_not_stop_the_run_and_delete_cancels_it(server) -> None:  # noqa: F811
    def handler(request: Received) -> Reply:
        made = history(request)
        if any(m["role"] == "user" and m["content"] == "slow" for m in request.body["messages"]):
            return Reply(body=completion((SLOW.name, SLOW.arguments)))  # a call that runs for 1 s
        return Reply(body=completion((CALLS[0][len(made)].name, CALLS[0][len(made)].arguments)), stall=0.05)

    server.handler = handler
    backend = VerifiedBackend()

    async def main() -> None:
        async with serving(backend=backend) as (client, _):
            await register(client)
            # a run cut at max_steps, with a fixed reward; its client leaves after the first event
            body = {"model": model(server), "reward": {"kind": "fixed", "value": 0.5}, "size": 2, "tools": TOOLS,
                    "max_steps": 3}
            async with client.stream("POST", "/tasks/t/runs", json=body) as r:
                lines = r.aiter_lines()
                first = json.loads(await lines.__anext__())
            assert first["event"] == "started"
            info = await wait_ended(client, first["run"])
            assert info["reward_source"] == "fixed" and not info["cancelled"]
            for t in info["trajectories"]:
                assert t["status"] == "done" and t["truncated"] and t["reward"] == 0.5 and t["answer"] is None, t
                assert len(t["steps"]) == 3 and t["verifier"] is None
            # cancelling a run in the middle of its calls releases everything
            r = await client.post("/tasks", json={"id": "slow", "description": "slow"})
            body = {"model": model(server), "reward": VERIFIER, "size": 3, "tools": TOOLS, "stream": False}
            run = (await client.post("/tasks/slow/runs", json=body)).json()
            assert (await client.get("/tasks/slow")).json()["open_runs"] == [run["id"]]
            r = await client.delete("/tasks/slow")
            assert r.status_code == 409 and run["id"] in r.json()["detail"]
            await anyio.sleep(0.3)
            # one trajectory runs the slow call; the two others wait for that call in flight
            assert (await stats(client))["live_workspaces"] >= 1
            r = await client.delete(f"/runs/{run['id']}")
            assert r.status_code == 200
            info = r.json()
            assert info["status"] == "ended" and info["cancelled"]
            assert all(t["status"] == "cancelled" and t["reward"] is None for t in info["trajectories"])
            events = [json.loads(line) for line in (await client.get(f"/runs/{run['id']}/events")).text.splitlines()]
            assert events[-1]["event"] == "ended" and events[-1]["cancelled"]
            assert events[-1]["trajectories"] == {"done": 0, "failed": 0, "cancelled": 3}
            s = await stats(client)
            assert s["live_workspaces"] == 0 and s["sessions_open"] == 0 and s["runs_open"] == 0
            assert (await client.delete("/tasks/slow")).status_code == 204
        assert backend.live_handles() == 0

    anyio.run(main)


def test_bad_run_requests_and_limits(server) -> None:  # noqa: F811
    server.handler = Agent(["42"] * G)

    async def main() -> None:
        async with serving(ServeConfig(max_workspaces=4, retry_after=2), backend=VerifiedBackend()) as (client, _):
            body = {"model": model(server), "reward": VERIFIER, "size": 2, "tools": TOOLS, "stream": False}
            r = await client.post("/tasks/t/runs", json=body)
            assert r.status_code == 404
            r = await client.post("/tasks", json={"id": "t"})
            r = await client.post("/tasks/t/runs", json=body)
            assert r.status_code == 422 and "no description" in r.json()["detail"]
            await client.delete("/tasks/t")
            await register(client)
            r = await client.post("/tasks/t/runs", json={**body, "tools": None})
            assert r.status_code == 422 and "tools" in r.json()["detail"]
            r = await client.post("/tasks/t/runs", json={**body, "tools": [{"type": "web"}]})
            assert r.status_code == 422 and "tools[0]" in r.json()["detail"]
            r = await client.post("/tasks/t/runs", json={**body, "model": model(server, temperature=5)})
            assert r.status_code == 422 and "ChatModel.temperature=5" in r.json()["detail"]
            r = await client.post("/tasks/t/runs", json={**body, "reward": {"kind": "guess"}})
            assert r.status_code == 400
            r = await client.post("/tasks/t/runs", json={**body, "size": 5})
            assert r.status_code == 422 and "max_workspaces" in r.json()["detail"]
            assert (await client.get("/runs/r9")).status_code == 404
            assert (await client.delete("/runs/r9")).status_code == 404
            assert (await client.get("/runs/r9/events")).status_code == 404
            # the same limits as a group: 429 with Retry-After
            group = await open_group(client, size=3)
            r = await client.post("/tasks/t/runs", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "2" and r.json()["extra"]["in_use"] == 3
            await client.delete(f"/groups/{group['id']}")
            doc = (await client.get(str(client.base_url).removesuffix("/v1/") + "/schema/openapi.json")).json()
            for path in ("/v1/tasks/{task_id}/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/events"):
                assert path in doc["paths"]

    anyio.run(main)


def test_with_a_spec_the_tools_come_from_it_and_calls_are_checked(server) -> None:  # noqa: F811
    from bunshin_async._spec import spec_from_dict

    spec = spec_from_dict({"name": "s", "tools": {
        "shell": {"command": "{cmd}", "raw": ["cmd"], "cacheable": True, "description": "Run a command."},
        "clock": {"command": "date"},
        "reward": {"command": "score {answer}"},
    }})
    tools = tools_from_spec(spec, exclude=["reward"])
    assert [t["function"]["name"] for t in tools] == ["clock", "shell"]
    assert tools[1]["function"]["parameters"] == {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
    }

    def handler(request: Received) -> Reply:
        made = history(request)
        if request.body["messages"][0]["content"] == "bad":  # the system prompt
            return Reply(body=completion(("shell", {"path": "/"})))  # not the spec's arguments
        if len(made) < 2:
            return Reply(body=completion((CALLS[0][len(made)].name, CALLS[0][len(made)].arguments)))
        return Reply(body=completion(content="42"))

    server.handler = handler

    async def main() -> None:
        backend = VerifiedBackend()
        async with open_service(backend, spec=spec, tasks={TASK.id: TASK}) as service:
            async with open_http_server(create_app(service)) as srv:
                async with httpx.AsyncClient(base_url=srv.url + "/v1", trust_env=False, timeout=10) as client:
                    await register(client)
                    body = {"model": model(server), "reward": VERIFIER, "size": 2, "stream": False}
                    r = await client.post("/tasks/t/runs", json={**body, "reward": {"kind": "verifier", "call": {
                        "name": "rm", "arguments": {}}}})
                    assert r.status_code == 422 and "reward.call" in r.json()["detail"]
                    info = await wait_ended(client, (await client.post("/tasks/t/runs", json=body)).json()["id"])
                    assert [t["status"] for t in info["trajectories"]] == ["done", "done"]
                    assert sorted(t["function"]["name"] for t in server.requests[0].body["tools"]) == ["clock", "shell"]
                    bad = await client.post("/tasks/t/runs", json={**body, "size": 1, "system_prompt": "bad"})
                    info = await wait_ended(client, bad.json()["id"])
                    t = info["trajectories"][0]
                    assert t["status"] == "failed" and "the model's call: tool 'shell': missing argument 'cmd'" in t["error"] and t["steps"] == []
                    assert service.statistics().live_workspaces == 0
        assert backend.live_handles() == 0

    anyio.run(main)
