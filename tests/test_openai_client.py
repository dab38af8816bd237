"""The OpenAI-compatible chat policy against a real HTTP server on loopback.

The server (the ``server`` fixture) is an anyio TCP server speaking HTTP/1.1 through h11, run
in its own thread and event loop on 127.0.0.1 with a port the kernel picks. Each test scripts
its replies (``server.script(...)`` in order, or ``server.handler`` deciding from the request)
and reads back what the server received. The fixture stops it and checks that it raised
nothing, that its thread ended and that its port is closed.

Only the timeout tests wait on purpose (a request timeout of 0.5 s against a server that
stalls or trickles; 0.5 s leaves a loaded host ample time for the replies that must arrive); backoff bases are a millisecond or less, so nothing depends on how fast the host is.
"""

from __future__ import annotations

import json
import math
import random
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import h11
import msgspec
import pytest

from bunshin_async import (
    CHAT_API_KEY_ENV,
    Backend,
    CallContext,
    ChatModel,
    ChatPolicy,
    ChatStatistics,
    ColdSnapshot,
    ConfigError,
    Finish,
    MemoryProfile,
    ModelError,
    Observation,
    RolloutKey,
    SampleView,
    SchedulerConfig,
    Task,
    ToolCall,
    ToolResult,
    Workspace,
    WorkspaceMemory,
    WorkspaceReleasedError,
    observation_digest,
    plan_steps,
    run_rollouts,
)

# -- the scripted server ---------------------------------------------------------------------------


@dataclass
class Reply:
    """One scripted answer."""

    status: int = 200
    body: bytes | dict[str, Any] = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    stall: float = 0.0  # seconds to wait before answering
    drop: bool = False  # close the connection instead of answering
    trickle: float = 0.0  # send the body in 8 pieces, this many seconds apart


@dataclass
class Received:
    """One request the server read."""

    method: str
    path: str
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


class ScriptedServer:
    """Answers every request with ``handler(request)``; records the requests."""

    def __init__(self) -> None:
        self.url = ""
        self.port = 0
        self.requests: list[Received] = []
        self.errors: list[BaseException] = []
        self.handler: Callable[[Received], Reply] = lambda r: Reply(500, b"no script")
        self._lock = threading.Lock()

    def script(self, *replies: Reply) -> None:
        """Answer the next requests with *replies*, in order."""
        queue = list(replies)

        def handler(request: Received) -> Reply:
            if not queue:
                raise AssertionError(f"request {len(self.requests)} came after the script ended")
            return queue.pop(0)

        self.handler = handler

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
            await listener.serve(self._connection)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        try:
            async with stream:
                await self._exchange(stream)
        except Exception as exc:  # noqa: BLE001 - reported by the fixture
            self.errors.append(exc)

    async def _exchange(self, stream: anyio.abc.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            request: h11.Request | None = None
            raw = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        conn.receive_data(await stream.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        return  # the client closed the connection
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    raw += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert request is not None
            got = Received(
                request.method.decode(),
                request.target.decode(),
                {k.decode().lower(): v.decode() for k, v in request.headers},
                raw,
            )
            with self._lock:
                self.requests.append(got)
                reply = self.handler(got)
            if reply.stall:
                await anyio.sleep(reply.stall)
            if reply.drop:
                return
            body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))] + reply.headers
            try:
                await stream.send(conn.send(h11.Response(status_code=reply.status, headers=headers)))
                if reply.trickle:
                    step = -(-len(body) // 8)
                    for i in range(0, len(body), step):
                        await anyio.sleep(reply.trickle)
                        await stream.send(conn.send(h11.Data(data=body[i : i + step])))
                else:
                    await stream.send(conn.send(h11.Data(data=body)))
                await stream.send(conn.send(h11.EndOfMessage()))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the client gave up (a stalled reply after its timeout)
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    """A scripted chat-completions server on 127.0.0.1, stopped and checked after the test."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)  # the client must reach loopback directly
    monkeypatch.delenv(CHAT_API_KEY_ENV, raising=False)
    srv = ScriptedServer()
    with anyio.from_thread.start_blocking_portal() as portal:
        thread = portal.call(threading.current_thread)
        future, srv.port = portal.start_task(srv.serve)
        srv.url = f"http://127.0.0.1:{srv.port}/v1"
        try:
            yield srv
        finally:
            future.cancel()
    assert not thread.is_alive(), "the server thread is still running"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1.0).close()
    assert not srv.errors, srv.errors


# -- replies -------------------------------------------------------------------------------------


def completion(
    *calls: tuple[str, Any], content: str | None = None, usage: tuple[int, int] | None = (10, 5),
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A chat completion whose message makes *calls* (name, arguments: a dict or a raw string)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"chatcmpl-tool-{i}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]
    reason = finish_reason or ("tool_calls" if calls else "stop")
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
    }
    if usage is not None:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    return body


def call_reply(name: str, **args: Any) -> Reply:
    return Reply(body=completion((name, args)))


def final_reply(text: str) -> Reply:
    return Reply(body=completion(content=text))


# -- a small backend: each workspace is a dict of files ---------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                "required": ["path", "text"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


class FilesBackend(Backend):
    """Workspaces are dicts of files; ``write_file`` and ``read_file`` run deterministically."""

    engine = "restart"

    def __init__(self) -> None:
        self._files: dict[int, dict[str, str]] = {}
        self._cold: dict[int, dict[str, str]] = {}
        self._next = 0

    def _new(self, task: Task, files: dict[str, str], frozen: bool) -> Workspace:
        ws = Workspace(task, self._next, frozen)
        self._next += 1
        self._files[ws.id] = dict(files)
        return ws

    def _of(self, handle: Workspace) -> dict[str, str]:
        if handle.released:
            raise WorkspaceReleasedError(f"{handle!r} was released")
        return self._files[handle.id]

    async def create(self, task: Task) -> Workspace:
        return self._new(task, {}, False)

    async def freeze(self, workspace: Workspace) -> Workspace:
        self._of(workspace)
        workspace.frozen = True
        return workspace

    async def snapshot(self, workspace: Workspace) -> Workspace:
        return self._new(workspace.task, self._of(workspace), True)

    async def fork(self, source: Workspace) -> Workspace:
        return self._new(source.task, self._of(source), False)

    async def execute(self, workspace: Workspace, call: ToolCall, context: CallContext) -> ToolResult:
        files = self._of(workspace)
        path = call.arguments["path"]
        if call.name == "write_file":
            files[path] = call.arguments["text"]
            out = f"wrote {len(files[path])} characters to {path}"
        else:
            out = files.get(path, f"no such file: {path}")
        await anyio.lowlevel.checkpoint()
        data = out.encode()
        return ToolResult(observation_digest(data), len(data), 0.0, len(data), output=data)

    async def demote(self, snapshot: Workspace, parent: Workspace | ColdSnapshot | None) -> ColdSnapshot:
        files = self._of(snapshot)
        cold = ColdSnapshot(snapshot.task, self._next, sum(map(len, files.values())))
        self._next += 1
        self._cold[cold.id] = dict(files)
        await self.release(snapshot)
        return cold

    async def promote(self, cold: ColdSnapshot, parent: Workspace | None) -> Workspace:
        return self._new(cold.task, self._cold[cold.id], True)

    async def release(self, handle: Workspace | ColdSnapshot) -> None:
        if handle.released:
            raise WorkspaceReleasedError(f"{handle!r} was released twice")
        handle.released = True
        (self._cold if isinstance(handle, ColdSnapshot) else self._files).pop(handle.id)

    def snapshot_charge(self, workspace: Workspace, dirtied_bytes: int) -> int:
        return dirtied_bytes

    def workspace_memory(self, workspace: Workspace) -> WorkspaceMemory:
        return WorkspaceMemory(0, sum(map(len, self._of(workspace).values())))

    def working_set(self) -> int:
        return sum(sum(map(len, f.values())) for f in self._files.values())

    def live_handles(self) -> int:
        return len(self._files) + len(self._cold)


def make_task(tid: str, description: str) -> Task:
    return Task(id=tid, memory=MemoryProfile(image_bytes=0, runtime_bytes=0, boot_time=0.0), description=description)


TASK = make_task("hello", "Write hello to a.txt, then read it back and tell me what it says.")
SYSTEM = "You are a careful agent. Use the tools."


def episode(request: Received) -> Reply:
    """The scripted model: write, read, then answer with what it read."""
    messages = request.body["messages"]
    tool_results = [m for m in messages if m["role"] == "tool"]
    if len(tool_results) == 0:
        return call_reply("write_file", path="a.txt", text="hello")
    if len(tool_results) == 1:
        return call_reply("read_file", path="a.txt")
    return final_reply(f"The file says: {tool_results[-1]['content']}")


def verifier(sample: SampleView, final_text: str) -> float:
    return 1.0 if final_text.endswith("hello") else 0.0


def model_at(server: ScriptedServer, **options: Any) -> ChatModel:
    options.setdefault("backoff_base", 0.001)
    options.setdefault("backoff_cap", 0.01)
    options.setdefault("timeout", 5.0)
    return ChatModel(base_url=server.url, model="m", **options)


def view(task: Task = TASK, calls: tuple[ToolCall, ...] = (), outputs: tuple[bytes | None, ...] = ()) -> SampleView:
    obs = tuple(
        Observation(observation_digest(o), len(o), o) if o is not None else Observation("sha256:00000000deadbeef", 42)
        for o in outputs
    )
    return SampleView(RolloutKey(0, task.id, 0, 3), task, calls, obs)


def act_once(server: ScriptedServer, sample: SampleView | None = None, **options: Any) -> tuple[Any, ChatStatistics]:
    """Run one ``act`` (returning the action or the ModelError raised) and the statistics."""
    seed = options.pop("seed", 0)

    async def main() -> tuple[Any, ChatStatistics]:
        async with ChatPolicy(
            model_at(server, **options), TOOLS, [TASK], reward=verifier, system_prompt=SYSTEM, seed=seed
        ) as policy:
            try:
                action: Any = await policy.act(sample or view())
            except ModelError as exc:
                action = exc
            return action, policy.statistics()

    return anyio.run(main)


# -- a whole episode through the scheduler ------------------------------------------------------------


def run_episode(server: ScriptedServer, backend_name: str = "asyncio", group_size: int = 2):
    server.handler = episode
    backend = FilesBackend()
    tasks = [TASK, make_task("hello2", "Same again: write hello to a.txt and read it.")]

    async def main():
        async with ChatPolicy(
            model_at(server), TOOLS, tasks, reward=verifier, group_size=group_size, system_prompt=SYSTEM
        ) as policy:
            result = await run_rollouts(backend, policy, SchedulerConfig(batch_tasks=2))
            return result, policy.statistics()

    result, stats = anyio.run(main, backend=backend_name)
    return result, stats, backend


def check_episode(server: ScriptedServer, result, stats: ChatStatistics, backend: FilesBackend) -> None:
    n = 4  # 2 tasks x 2 samples
    assert [r.status for r in result.rollouts] == ["done"] * n
    assert [r.reward for r in result.rollouts] == [1.0] * n
    for r in result.rollouts:
        assert [s.call for s in r.steps] == [
            ToolCall("write_file", {"path": "a.txt", "text": "hello"}),
            ToolCall("read_file", {"path": "a.txt"}),
        ]
        assert r.observations == [observation_digest("wrote 5 characters to a.txt"), observation_digest("hello")]
    assert backend.live_handles() == 0
    assert stats == ChatStatistics(
        requests=3 * n, retries=0, failures=0, tool_calls=2 * n, finishes=n,
        prompt_tokens=10 * 3 * n, completion_tokens=5 * 3 * n, dropped_tool_calls=0, backoff_seconds=0.0,
    )
    assert len(server.requests) == 3 * n
    for req in server.requests:
        assert (req.method, req.path) == ("POST", "/v1/chat/completions")
        assert req.headers["content-type"] == "application/json"
        assert "authorization" not in req.headers
    # the last request of a rollout of task "hello": the whole conversation, in order
    last = [
        r.body for r in server.requests
        if len(r.body["messages"]) == 6 and r.body["messages"][1]["content"] == TASK.description
    ]
    assert len(last) == 2
    body = last[0]
    assert body["model"] == "m" and body["tools"] == TOOLS and body["tool_choice"] == "auto"
    assert body["temperature"] == 1.0 and "max_tokens" not in body
    assert body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK.description},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "write_file", "arguments": '{"path":"a.txt","text":"hello"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_0", "content": "wrote 5 characters to a.txt"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.txt"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    ]
    # each earlier request is a prefix of the conversation
    prefixes = sorted({len(r.body["messages"]) for r in server.requests})
    assert prefixes == [2, 4, 6]


def test_a_multi_step_episode_runs_through_the_scheduler(server: ScriptedServer) -> None:
    check_episode(server, *run_episode(server))


def test_a_multi_step_episode_runs_under_trio(server: ScriptedServer) -> None:
    check_episode(server, *run_episode(server, "trio"))


def test_a_model_error_fails_only_its_rollout(server: ScriptedServer) -> None:
    # task "slow": the server stalls past the timeout on every attempt; the others go on
    slow = make_task("slow", "This one never gets an answer.")

    def handler(request: Received) -> Reply:
        if slow.description in (m["content"] for m in request.body["messages"] if m["role"] == "user"):
            return Reply(stall=3.0, body=completion(content="too late"))
        return episode(request)

    server.handler = handler
    backend = FilesBackend()

    async def main():
        async with ChatPolicy(
            model_at(server, timeout=0.5, retries=1), TOOLS, [TASK, slow], reward=verifier, group_size=2
        ) as policy:
            result = await run_rollouts(backend, policy, SchedulerConfig(batch_tasks=2))
            return result, policy.statistics()

    result, stats = anyio.run(main)
    by_task = {(r.key.task, r.key.sample): r for r in result.rollouts}
    for s in (0, 1):
        ok, failed = by_task["hello", s], by_task["slow", s]
        assert (ok.status, ok.reward, ok.error) == ("done", 1.0, None)
        assert failed.status == "failed" and failed.reward is None and failed.steps == []
        assert failed.error is not None
        assert failed.error.startswith(f"ModelError: rollout e0/slow/g0/s{s} step 0: no usable reply from ")
        assert "after 2 attempts (1 + retries=1)" in failed.error
        assert "no reply within timeout=0.5 s" in failed.error
    assert stats.failures == 2 and stats.retries == 2 and stats.finishes == 2
    assert backend.live_handles() == 0


# -- the plan and the messages ---------------------------------------------------------------------


def test_planned_gives_every_task_group_size_samples_per_epoch() -> None:
    tasks = [make_task("a", "do a"), make_task("b", "do b")]
    policy = ChatPolicy(
        ChatModel(base_url="http://127.0.0.1:1/v1", model="m"), TOOLS, tasks, reward=verifier, group_size=3, epochs=2
    )
    anyio.run(policy.aclose)
    keys = [k for k, _ in policy.planned()]
    assert keys == [RolloutKey(e, t, 0, s) for e in (0, 1) for t in ("a", "b") for s in range(3)]
    assert [t.id for _, t in policy.planned()] == [k.task for k in keys]
    plan = plan_steps(policy.planned(), SchedulerConfig(batch_tasks=2, group_size=3))
    assert [[[k.task for k, _ in g] for g in step] for step in plan.steps] == [[["a"] * 3, ["b"] * 3]] * 2


def test_messages_decode_outputs_and_name_missing_ones() -> None:
    policy = ChatPolicy(ChatModel(base_url="http://127.0.0.1:1/v1", model="m"), TOOLS, [TASK], reward=verifier)
    anyio.run(policy.aclose)
    calls = (ToolCall("read_file", {"path": "b"}), ToolCall("read_file", {"path": "c", "n": [1, 2]}))
    sample = view(calls=calls, outputs=(b"caf\xc3\xa9 \xff!", None))
    msgs = policy.messages(sample)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool"]  # no system prompt
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_0", "content": "caf\u00e9 \ufffd!"}
    assert msgs[3]["tool_calls"][0]["id"] == "call_1"
    assert json.loads(msgs[3]["tool_calls"][0]["function"]["arguments"]) == {"path": "c", "n": [1, 2]}
    assert msgs[4] == {
        "role": "tool", "tool_call_id": "call_1",
        "content": "[no output kept: observation sha256:00000000deadbeef, 42 bytes]",
    }


# -- replies that are used --------------------------------------------------------------------------


def test_the_first_of_several_tool_calls_is_taken_and_the_rest_counted(server: ScriptedServer) -> None:
    server.script(Reply(body=completion(("read_file", {"path": "x"}), ("write_file", {"path": "y", "text": ""}),
                                        ("read_file", {"path": "z"}))))
    action, stats = act_once(server)
    assert action == ToolCall("read_file", {"path": "x"})
    assert stats.dropped_tool_calls == 2 and stats.tool_calls == 1


def test_empty_arguments_are_an_empty_object(server: ScriptedServer) -> None:
    server.script(Reply(body=completion(("read_file", "  "))))
    action, _ = act_once(server)
    assert action == ToolCall("read_file", {})


def test_a_reply_without_a_tool_call_finishes_with_the_verifiers_reward(server: ScriptedServer) -> None:
    seen: list[tuple[RolloutKey, str]] = []

    async def reward(sample: SampleView, text: str) -> float:
        await anyio.lowlevel.checkpoint()
        seen.append((sample.rollout, text))
        return 0.25

    server.script(final_reply("done: hello"), Reply(body=completion(content=None, usage=None)))

    async def main() -> tuple[list[Any], ChatStatistics]:
        async with ChatPolicy(model_at(server), TOOLS, [TASK], reward=reward) as policy:
            return [await policy.act(view()), await policy.act(view())], policy.statistics()

    actions, stats = anyio.run(main)
    assert actions == [Finish(0.25), Finish(0.25)]
    assert seen == [(RolloutKey(0, "hello", 0, 3), "done: hello"), (RolloutKey(0, "hello", 0, 3), "")]
    assert (stats.finishes, stats.prompt_tokens, stats.completion_tokens) == (2, 10, 5)  # one reported usage


def test_a_reward_that_is_not_a_number_is_a_config_error(server: ScriptedServer) -> None:
    server.script(final_reply("hello"))

    async def main() -> None:
        async with ChatPolicy(model_at(server), TOOLS, [TASK], reward=lambda s, t: "1.0") as policy:
            await policy.act(view())

    with pytest.raises(ConfigError, match=r"rollout e0/hello/g0/s3: the reward function returned '1.0'"):
        anyio.run(main)


def test_request_body_carries_settings_and_extra_fields(server: ScriptedServer) -> None:
    server.script(final_reply("hello"))
    act_once(server, temperature=0.7, max_tokens=256, extra_body={"top_p": 0.9, "tool_choice": "required"})
    body = server.requests[0].body
    assert (body["temperature"], body["max_tokens"], body["top_p"], body["tool_choice"]) == (0.7, 256, 0.9, "required")


# -- the API key -------------------------------------------------------------------------------------


def test_api_key_is_sent_as_a_bearer_token(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    server.handler = lambda r: final_reply("hello")
    act_once(server, api_key="sk-given")
    act_once(server)  # no key, no variable: no header
    monkeypatch.setenv(CHAT_API_KEY_ENV, "sk-from-env")
    act_once(server)
    act_once(server, api_key="")  # "" means no key, whatever the variable says
    auth = [r.headers.get("authorization") for r in server.requests]
    assert auth == ["Bearer sk-given", None, "Bearer sk-from-env", None]


def test_a_rejected_key_is_not_retried_and_says_where_to_look(server: ScriptedServer) -> None:
    server.script(Reply(401, {"error": {"message": "invalid api key"}}))
    error, stats = act_once(server, api_key="sk-wrong", retries=3)
    assert isinstance(error, ModelError)
    msg = str(error)
    assert msg.startswith(f"rollout e0/hello/g0/s3 step 0: {server.url}/chat/completions answered HTTP 401: ")
    assert "invalid api key" in msg and CHAT_API_KEY_ENV in msg
    assert (stats.requests, stats.retries, stats.failures) == (1, 0, 1)


def test_the_repr_hides_the_api_key() -> None:
    m = ChatModel(base_url="http://127.0.0.1:8000/v1", model="m", api_key="sk-secret")
    assert "sk-secret" not in repr(m) and "api_key='***'" in repr(m)
    assert m.api_key == "sk-secret"


# -- retries -----------------------------------------------------------------------------------------


def test_a_500_is_retried(server: ScriptedServer) -> None:
    server.script(Reply(500, b"engine overloaded"), call_reply("read_file", path="a.txt"))
    action, stats = act_once(server)
    assert action == ToolCall("read_file", {"path": "a.txt"})
    assert (stats.requests, stats.retries, stats.failures) == (2, 1, 0)
    assert 0.0 <= stats.backoff_seconds <= 0.001


def test_retry_after_replaces_the_jitter_and_is_capped(server: ScriptedServer) -> None:
    # a jittered backoff of base 0 would be 0; Retry-After: 30 capped at 0.05 makes it 0.05
    server.script(Reply(429, b"slow down", headers=[("Retry-After", "30")]), final_reply("hello"))
    action, stats = act_once(server, backoff_base=0.0, backoff_cap=0.05)
    assert action == Finish(1.0)
    assert (stats.retries, stats.backoff_seconds) == (1, 0.05)
    # Retry-After: 0 retries at once, where the jitter (base = cap = 1 s) would draw more
    server.script(Reply(503, b"", headers=[("Retry-After", "0")]), final_reply("hello"))
    action, stats = act_once(server, backoff_base=1.0, backoff_cap=1.0)
    assert action == Finish(1.0) and (stats.retries, stats.backoff_seconds) == (1, 0.0)


def test_the_backoff_is_full_jitter_from_the_seeded_stream(server: ScriptedServer) -> None:
    server.script(*[Reply(502, b"bad gateway")] * 3, final_reply("hello"), *[Reply(502, b"bad gateway")] * 3,
                  final_reply("hello"))
    _, a = act_once(server, seed=7, backoff_base=0.0004, backoff_cap=0.001)
    _, b = act_once(server, seed=7, backoff_base=0.0004, backoff_cap=0.001)
    r = random.Random(7)
    want = r.uniform(0, 0.0004) + r.uniform(0, 0.0008) + r.uniform(0, 0.001)
    assert a.retries == b.retries == 3
    assert a.backoff_seconds == b.backoff_seconds == pytest.approx(want, rel=1e-12)


def test_a_stall_past_the_timeout_is_retried(server: ScriptedServer) -> None:
    server.script(Reply(stall=3.0, body=completion(content="too late")), call_reply("read_file", path="a.txt"))
    action, stats = act_once(server, timeout=0.5)
    assert action == ToolCall("read_file", {"path": "a.txt"})
    assert (stats.requests, stats.retries) == (2, 1)


def test_the_timeout_bounds_the_whole_request(server: ScriptedServer) -> None:
    # every gap is well inside the timeout, the whole reply is not: 8 x 0.1 s > 0.5 s
    server.script(Reply(trickle=0.1, body=completion(content="too late")), call_reply("read_file", path="a.txt"))
    action, stats = act_once(server, timeout=0.5)
    assert action == ToolCall("read_file", {"path": "a.txt"})
    assert (stats.requests, stats.retries) == (2, 1)


def test_a_dropped_connection_is_retried(server: ScriptedServer) -> None:
    server.script(Reply(drop=True), Reply(408, b"request timeout"), final_reply("hello"))
    action, stats = act_once(server)
    assert action == Finish(1.0) and (stats.requests, stats.retries) == (3, 2)


def test_a_refused_connection_is_retried_then_a_model_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = ChatModel(
        base_url=f"http://127.0.0.1:{port}/v1", model="m", retries=2, backoff_base=0.001, backoff_cap=0.001
    )

    async def main() -> ChatStatistics:
        async with ChatPolicy(model, TOOLS, [TASK], reward=verifier) as policy:
            with pytest.raises(ModelError) as info:
                await policy.act(view())
            msg = str(info.value)
            assert msg.startswith(f"rollout e0/hello/g0/s3 step 0: no usable reply from http://127.0.0.1:{port}/v1/")
            assert "after 3 attempts (1 + retries=2); last error: ConnectError" in msg
            return policy.statistics()

    stats = anyio.run(main)
    assert (stats.requests, stats.retries, stats.failures) == (3, 2, 1)


# -- replies that are not usable ------------------------------------------------------------------------


UNUSABLE = {
    "garbage": (
        Reply(body=b"<html>502 from the proxy</html>"),
        r"step 2: the reply is not valid JSON \(.*\): '<html>502 from the proxy</html>'",
    ),
    "error-object": (
        Reply(body={"error": {"message": "boom"}}),
        r"step 2: the reply is not a chat completion \(Object missing required field `choices`\)",
    ),
    "wrong-type": (
        Reply(body={"choices": [{"message": {"content": 3}}]}),
        r"not a chat completion \(Expected `str \| null`, got `int` - at `\$.choices\[0\].message.content`\)",
    ),
    "no-choices": (Reply(body={"choices": []}), r"step 2: the reply has no choices: "),
    "unknown-tool": (
        call_reply("rm_rf", path="/"),
        r"step 2: the model called unknown tool 'rm_rf'; the tools are write_file, read_file",
    ),
    "list-arguments": (
        Reply(body=completion(("read_file", '["a.txt"]'))),
        r"step 2: the arguments of 'read_file' are a JSON array, expected an object: '\[\"a.txt\"\]'",
    ),
    "null-arguments": (
        Reply(body=completion(("read_file", "null"))),
        r"the arguments of 'read_file' are a JSON null, expected an object",
    ),
    "string-arguments": (
        Reply(body=completion(("read_file", '"a.txt"'))),
        r"the arguments of 'read_file' are a JSON string, expected an object",
    ),
    "cut-arguments": (
        Reply(body=completion(("read_file", '{"path": "a.t'), finish_reason="length")),
        (
            r"the arguments of 'read_file' are not valid JSON \(.*\) "
            r"\(the reply was cut at max_tokens; raise max_tokens\): '\{\"path\": \"a.t'"
        ),
    ),
    "http-400": (
        Reply(400, {"object": "error", "message": "maximum context length is 4096 tokens"}),
        r"answered HTTP 400: .*maximum context length.*--enable-auto-tool-choice",
    ),
    "http-404": (Reply(404, b"Not Found"), r"answered HTTP 404: 'Not Found' \(check ChatModel.base_url"),
}


@pytest.mark.parametrize(("reply", "want"), UNUSABLE.values(), ids=UNUSABLE.keys())
def test_an_unusable_reply_is_a_model_error_naming_rollout_and_step(
    server: ScriptedServer, reply: Reply, want: str
) -> None:
    server.script(reply)
    calls = (ToolCall("read_file", {"path": "a"}), ToolCall("read_file", {"path": "b"}))
    error, stats = act_once(server, view(calls=calls, outputs=(b"", b"")))
    assert isinstance(error, ModelError)
    assert str(error).startswith("rollout e0/hello/g0/s3 step 2: ")
    assert len(str(error)) < 600  # an excerpt, not the whole body
    assert re.search(want, str(error)), str(error)
    assert (stats.requests, stats.retries, stats.failures) == (1, 0, 1)


def test_a_long_bad_body_is_quoted_as_an_excerpt(server: ScriptedServer) -> None:
    server.script(Reply(body=b"x" * 5000))
    error, _ = act_once(server)
    assert isinstance(error, ModelError)
    assert "'" + "x" * 200 + "... (5000 bytes)'" in str(error)


def test_using_a_closed_policy_is_an_error_and_closing_twice_is_fine() -> None:
    async def main() -> None:
        policy = ChatPolicy(ChatModel(base_url="http://127.0.0.1:1/v1", model="m"), TOOLS, [TASK], reward=verifier)
        async with policy:
            pass
        await policy.aclose()
        with pytest.raises(anyio.ClosedResourceError, match="inside `async with"):
            await policy.act(view())

    anyio.run(main)


# -- settings --------------------------------------------------------------------------------------------

GOOD = {"base_url": "http://127.0.0.1:8000/v1", "model": "m"}


@pytest.mark.parametrize(
    ("options", "field_"),
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "base_url"),
        ({"base_url": "ftp://host/v1"}, "base_url"),
        ({"base_url": "http:///v1"}, "base_url"),
        ({"base_url": "http://h/v1?x=1"}, "base_url"),
        ({"base_url": ""}, "base_url"),
        ({"model": ""}, "model"),
        ({"api_key": "sk bad"}, "api_key"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"retries": True}, "retries"),
        ({"backoff_base": -1.0}, "backoff_base"),
        ({"backoff_base": 2.0, "backoff_cap": 1.0}, "backoff_cap"),
        ({"extra_body": {"messages": []}}, "extra_body"),
        ({"extra_body": {"stream": True}}, "extra_body"),
        ({"extra_body": {"x": object()}}, "extra_body"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(options: dict[str, Any], field_: str) -> None:
    with pytest.raises(ConfigError, match=rf"^ChatModel\.{field_}=.* is invalid; expected "):
        ChatModel(**{**GOOD, **options})


def test_settings_convert_from_a_mapping_and_are_checked() -> None:
    m = msgspec.convert({**GOOD, "retries": 5, "extra_body": {"seed": 1}}, ChatModel)
    assert (m.retries, m.extra_body, m.url) == (5, {"seed": 1}, "http://127.0.0.1:8000/v1/chat/completions")
    with pytest.raises(ConfigError, match=r"^ChatModel\.timeout=-1.0 is invalid"):
        msgspec.convert({**GOOD, "timeout": -1.0}, ChatModel)
    with pytest.raises(ConfigError) as info:
        ChatModel(**GOOD, api_key="sk bad")
    assert "sk bad" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({"tools": []}, r"tools must be a non-empty list"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, r"tools\[0\]\.function\.name is None"),
        ({"tools": [{"type": "code_interpreter"}]}, r"tools\[0\] has type 'code_interpreter'"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, r"tools\[1\]\.function\.name 'write_file' repeats tools\[0\]"),
        ({"tasks": []}, r"tasks is empty"),
        ({"tasks": [make_task("a", " ")]}, r"tasks\[0\] \('a'\) has an empty description"),
        ({"tasks": [TASK, TASK]}, r"tasks\[1\]: task id 'hello' appears twice"),
        ({"group_size": 0}, r"group_size=0 is invalid"),
        ({"epochs": 0}, r"epochs=0 is invalid"),
        ({"reward": None}, r"reward must be callable"),
    ],
)
def test_bad_policy_arguments_are_config_errors(change: dict[str, Any], want: str) -> None:
    args: dict[str, Any] = {"tools": TOOLS, "tasks": [TASK], "reward": verifier, **change}
    with pytest.raises(ConfigError, match=want):
        ChatPolicy(ChatModel(**GOOD), args.pop("tools"), args.pop("tasks"), **args)
