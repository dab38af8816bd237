"""Scale-out of the rollout service with Ray (``bunshin serve --ray``).

One Ray actor per node of the cluster runs a whole :class:`~bunshin_async.Service` there: its
own backend, prefix tree and HTTP server (:func:`~bunshin_async.create_app` served by
:func:`~bunshin_async.open_http_server` on the node's address). A front router, the process
that runs ``bunshin serve --ray``, serves the same ``/v1`` API and forwards each request over
HTTP to the node that owns the task it is about, so every group, session and step of a task
runs on one node and a group's forks share one kernel (copy-on-write sharing is per kernel).

Placement rule: a task is owned by the node it was registered on, and a new task is
registered on the live node holding the fewest tasks (ties: the lowest node index). Group and
session ids carry their node: the router answers ``n1-g0`` and ``n1-g0-s2`` for a node's
``g0`` and ``g0-s2``.

A node that dies takes its tasks' sessions with it: the request that finds it gone gets 502,
later requests about its tasks, groups and sessions get 503, each naming the node
(``extra.node``); the other nodes go on. Closing the router stops every node's service
(closing its sessions, releasing its workspaces) and kills every actor.

Ray is optional (``pip install 'bunshin[ray]'``); this module imports it only when a router
opens. See ``docs/ray.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec

from ._exceptions import BunshinError, ConfigError
from ._serve import API_PREFIX, ServeConfig, ServiceStatistics

__all__ = [
    "LiveNodeBackend",
    "RayNode",
    "RayRouter",
    "RayServiceStatistics",
    "SimNodeBackend",
    "create_router_app",
    "open_ray_service",
]


# -- what runs on each node ------------------------------------------------------------------------


class SimNodeBackend(msgspec.Struct, frozen=True, tag="sim"):
    """Each node serves the simulator's backend on a trace's tool outcomes."""

    trace: bytes
    """The trace, encoded (:func:`~bunshin_async.encode_trace`); it travels to every node."""
    engine: str = "bunshin"
    """The simulated fork engine."""


class LiveNodeBackend(msgspec.Struct, frozen=True, tag="live"):
    """Each node serves live workspaces (the actor's process must run as root there)."""

    spec: str
    """Path of the workspace spec; the file must exist at this path on every node."""
    state_dir: str | None = None
    """The state directory on each node (None: ``$BUNSHIN_STATE_DIR`` or ``/run/bunshin``)."""


NodeBackend = SimNodeBackend | LiveNodeBackend


@contextlib.asynccontextmanager
async def _open_node_backend(desc: NodeBackend) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """The backend *desc* describes, and the :func:`open_service` options that go with it."""
    if isinstance(desc, SimNodeBackend):
        from sim import SimBackend, ToolModel

        from ._trace import decode_trace

        trace = decode_trace(desc.trace)
        steps = [s for r in trace.rollouts for s in r.steps]
        cacheable = sorted({s.call.name for s in steps} - {s.call.name for s in steps if not s.cacheable})
        backend = SimBackend(desc.engine, ToolModel(trace))
        try:
            yield backend, {"tasks": trace.task_map(), "cacheable": cacheable}
        finally:
            await backend.aclose()
    else:
        from ._live import LiveBackend
        from ._spec import load_spec
        from ._state import StateDir

        spec = load_spec(desc.spec)
        async with LiveBackend(spec, state=StateDir(desc.state_dir)) as backend:
            yield backend, {"spec": spec}


class _NodeServer:
    """The body of the per-node actor: a service and its HTTP server, in a thread of their own
    (their own event loop), so that the actor's methods stay plain and short.

    Args:
        backend: What to serve, encoded (a :data:`NodeBackend`).
        config: The :class:`ServeConfig`, encoded.
        host: Address to listen on (None: the node's address, as Ray knows it).
    """

    def __init__(self, backend: bytes, config: bytes, host: str | None) -> None:
        self._desc: NodeBackend = msgspec.json.decode(backend, type=NodeBackend)
        self._config = msgspec.json.decode(config, type=ServeConfig)
        self._host = host
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._url: str | None = None
        self._error: str | None = None
        self._left: int | None = None  # the backend's live handles once the service closed
        self._thread: threading.Thread | None = None

    def start(self, timeout: float) -> dict[str, Any]:
        """Start the service; return where it listens (``url``, ``node_id``, ``pid``)."""
        import os

        import ray

        host = self._host or ray.util.get_node_ip_address()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(host),), name="bunshin-node",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise BunshinError(f"the node's service did not start within {timeout} s")
        if self._error is not None:
            raise BunshinError(f"the node's service could not start: {self._error}")
        return {"url": self._url, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def _serve(self, host: str) -> None:
        from ._serve import _describe, create_app, open_http_server, open_service

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with _open_node_backend(self._desc) as (backend, options):
                async with open_service(backend, self._config, **options) as service:
                    async with open_http_server(create_app(service), host=host, port=0) as server:
                        self._url = server.url
                        self._ready.set()
                        await self._stop.wait()
                self._left = backend.live_handles()
        except BaseException as exc:
            self._error = _describe(exc)
            raise
        finally:
            self._ready.set()

    def ping(self) -> str:
        """``ok`` while the service runs."""
        return "ok" if self._error is None and self._thread is not None and self._thread.is_alive() else "stopped"

    def stop(self, timeout: float) -> int | None:
        """Close the service (every session ends, every workspace and snapshot is released) and
        return the backend's live handles left after it (0 when all went well)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
        return self._left


# -- the router --------------------------------------------------------------------------------


class RayNode(msgspec.Struct, frozen=True):
    """A node of the router, and where its service listens."""

    name: str
    """The router's name for it (``n0``, ``n1``, ...), the prefix of its group and session ids."""
    node_id: str
    """Ray's node id."""
    url: str
    """Where its service listens (its API is under ``url + "/v1"``)."""
    pid: int
    """The process id of its actor (on its node)."""
    alive: bool
    """False once the router found it gone (it is never used again)."""
    tasks: list[str]
    """The tasks it owns."""
    left: int | None = None
    """Once the router closed: the live handles its backend held after its service closed (0:
    everything released); None before, or for a node that was gone."""


class RayServiceStatistics(msgspec.Struct, frozen=True):
    """What the nodes hold and did, summed over the live nodes, and each node's own figures."""

    tasks: int
    groups_open: int
    sessions_open: int
    sessions_ended: dict[str, int]
    steps: dict[str, int]
    refused: int
    live_workspaces: int
    live_handles: int
    working_set: int
    nodes: dict[str, ServiceStatistics | None]
    """Each node's ``GET /v1/stats`` (None for a node that is gone or did not answer)."""
    down: list[str]
    """Nodes found gone."""


class _Node:
    def __init__(self, name: str, actor: Any, node_id: str, url: str, pid: int) -> None:
        self.name = name
        self.pid = pid
        self.actor = actor
        self.node_id = node_id
        self.url = url
        self.alive = True
        self.why: str | None = None
        self.tasks: set[str] = set()
        self.left: int | None = None


def _error(status: int, detail: str, **extra: Any) -> tuple[int, bytes, dict[str, str]]:
    body = msgspec.json.encode({"status_code": status, "detail": detail, "extra": extra})
    return status, body, {"content-type": "application/json"}


class RayRouter:
    """The front of a Ray cluster of services; open it with :func:`open_ray_service`.

    Its requests go to the node's service over HTTP; :func:`create_router_app` serves it.
    """

    def __init__(self, nodes: list[_Node], client: Any, probe_timeout: float) -> None:
        self._nodes = {n.name: n for n in nodes}
        self._order = [n.name for n in nodes]
        self._client = client
        self._task_node: dict[str, str] = {}
        self._register = anyio.Lock()
        self._probe_timeout = probe_timeout

    @property
    def nodes(self) -> list[RayNode]:
        """The nodes, in order."""
        return [RayNode(n.name, n.node_id, n.url, n.pid, n.alive, sorted(n.tasks), n.left) for n in self._nodes.values()]

    def node_of_task(self, task_id: str) -> str | None:
        """The name of the node owning *task_id* (None: not registered through this router)."""
        return self._task_node.get(task_id)

    def _pick(self) -> _Node | None:
        live = [self._nodes[name] for name in self._order if self._nodes[name].alive]
        return min(live, key=lambda n: len(n.tasks)) if live else None

    # -- forwarding ------------------------------------------------------------------------------

    async def _probe(self, node: _Node, exc: BaseException) -> None:
        """A request to *node* failed in transport: ask Ray whether its actor lives."""
        import ray

        def ping() -> str:
            return ray.get(node.actor.ping.remote(), timeout=self._probe_timeout)

        try:
            answer = await anyio.to_thread.run_sync(ping, abandon_on_cancel=True)
        except Exception as probe:  # RayActorError, GetTimeoutError, ...
            answer = f"{type(probe).__name__}: {probe}"
        if answer != "ok":
            node.alive = False
            node.why = f"{type(exc).__name__}: {exc}; Ray: {answer}"

    def _down(self, node: _Node) -> tuple[int, bytes, dict[str, str]]:
        status, body, headers = _error(
            503, f"node {node.name} (Ray node {node.node_id}, {node.url}) is gone ({node.why}); "
            "its tasks, groups and sessions are lost", node=node.name, error="NodeLost",
        )
        return status, body, headers | {"retry-after": "1"}

    async def forward(self, node: _Node, method: str, path: str, body: bytes,
                      rewrite: Callable[[Any], Any] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """Send a request to *node*'s API (*path* under ``/v1``) and return its answer, ids
        rewritten by *rewrite* on success and the node named in an error's ``extra``."""
        import httpx

        if not node.alive:
            return self._down(node)
        try:
            r = await self._client.request(method, node.url + API_PREFIX + path, content=body or None,
                                           headers={"content-type": "application/json"} if body else None)
        except httpx.TransportError as exc:
            await self._probe(node, exc)
            return _error(502, f"node {node.name} (Ray node {node.node_id}, {node.url}) did not answer: "
                               f"{type(exc).__name__}: {exc}" + ("; it is gone, with its sessions" if not node.alive
                                                                  else ""), node=node.name, error="NodeUnreachable")
        headers = {k: v for k, v in r.headers.items() if k in ("content-type", "retry-after")}
        content = r.content
        if r.status_code >= 400 and content:
            with contextlib.suppress(msgspec.DecodeError, TypeError, AttributeError):
                err = msgspec.json.decode(content)
                err.setdefault("extra", {})["node"] = node.name
                content = msgspec.json.encode(err)
        elif rewrite is not None and content:
            content = msgspec.json.encode(rewrite(msgspec.json.decode(content)))
        return r.status_code, content, headers

    def _by_prefix(self, ident: str) -> tuple[_Node | None, str]:
        """The node an id names, and the id on that node (None: no such node)."""
        name, sep, local = ident.partition("-")
        node = self._nodes.get(name)
        return (node, local) if sep and local and node is not None else (None, "")

    def _no_such(self, ident: str, what: str) -> tuple[int, bytes, dict[str, str]]:
        return _error(404, f"no {what} {ident!r} (its id starts with its node: one of {', '.join(self._order)})",
                      error="NotFoundError")

    @staticmethod
    def _group(name: str) -> Callable[[Any], Any]:
        def rewrite(info: dict[str, Any]) -> dict[str, Any]:
            info["id"] = f"{name}-{info['id']}"
            info["sessions"] = [f"{name}-{s}" for s in info["sessions"]]
            return info
        return rewrite

    @staticmethod
    def _task(name: str) -> Callable[[Any], Any]:
        def rewrite(info: dict[str, Any]) -> dict[str, Any]:
            info["open_groups"] = [f"{name}-{g}" for g in info["open_groups"]]
            return info
        return rewrite

    @staticmethod
    def _session(name: str) -> Callable[[Any], Any]:
        def rewrite(info: dict[str, Any]) -> dict[str, Any]:
            for key in ("id", "group", "session"):
                if key in info:
                    info[key] = f"{name}-{info[key]}"
            return info
        return rewrite

    # -- the API ---------------------------------------------------------------------------------

    async def register_task(self, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        """``POST /v1/tasks``: register on the owning node (the least loaded for a new id)."""
        try:
            task_id = msgspec.json.decode(body).get("id")
        except (msgspec.DecodeError, AttributeError):
            task_id = None
        async with self._register:  # one registration at a time: the table and the loads stay exact
            owner = self._nodes.get(self._task_node.get(task_id, "")) if isinstance(task_id, str) else None
            if owner is not None and not owner.alive:  # lost with its node: register it again elsewhere
                owner.tasks.discard(task_id)
                del self._task_node[task_id]
                owner = None
            node = owner or self._pick()
            if node is None:
                return _error(503, "every node is gone: " + "; ".join(f"{n.name}: {n.why}" for n in self._nodes.values()),
                              error="NodeLost")
            status, content, headers = await self.forward(node, "POST", "/tasks", body, self._task(node.name))
            if status == 201 and isinstance(task_id, str):
                self._task_node[task_id] = node.name
                node.tasks.add(task_id)
            return status, content, headers

    def _task_owner(self, task_id: str) -> _Node | tuple[int, bytes, dict[str, str]]:
        name = self._task_node.get(task_id)
        if name is None:
            return _error(404, f"no task {task_id!r} is registered; register it with POST {API_PREFIX}/tasks",
                          error="NotFoundError")
        return self._nodes[name]

    async def task(self, method: str, task_id: str, suffix: str = "", body: bytes = b"") -> tuple[int, bytes, dict[str, str]]:
        """``GET``/``DELETE /v1/tasks/{id}`` and ``POST /v1/tasks/{id}/groups``."""
        node = self._task_owner(task_id)
        if isinstance(node, tuple):
            return node
        if method == "DELETE" and not node.alive:  # its snapshots went with its node
            self._task_node.pop(task_id, None)
            node.tasks.discard(task_id)
            return 204, b"", {}
        rewrite = self._group(node.name) if suffix else self._task(node.name)
        answer = await self.forward(node, method, f"/tasks/{task_id}{suffix}", body, rewrite)
        if method == "DELETE" and answer[0] == 204:
            self._task_node.pop(task_id, None)
            node.tasks.discard(task_id)
        return answer

    async def group(self, method: str, group_id: str) -> tuple[int, bytes, dict[str, str]]:
        """``GET``/``DELETE /v1/groups/{id}``."""
        node, local = self._by_prefix(group_id)
        if node is None:
            return self._no_such(group_id, "group")
        return await self.forward(node, method, f"/groups/{local}", b"", self._group(node.name))

    async def session(self, method: str, session_id: str, suffix: str = "", body: bytes = b""
                      ) -> tuple[int, bytes, dict[str, str]]:
        """``GET /v1/sessions/{id}``, ``POST .../step`` and ``POST .../close``."""
        node, local = self._by_prefix(session_id)
        if node is None:
            return self._no_such(session_id, "session")
        return await self.forward(node, method, f"/sessions/{local}{suffix}", body, self._session(node.name))

    async def _each(self, path: str) -> dict[str, Any]:
        """``GET path`` on every live node at once: decoded answers by node (None if none)."""
        out: dict[str, Any] = {}

        async def one(node: _Node) -> None:
            status, content, _ = await self.forward(node, "GET", path, b"")
            out[node.name] = msgspec.json.decode(content) if status == 200 else None

        async with anyio.create_task_group() as tg:
            for node in self._nodes.values():
                if node.alive:
                    tg.start_soon(one, node)
        return out

    async def tasks(self) -> list[Any]:
        """``GET /v1/tasks``: every live node's tasks."""
        answers = await self._each("/tasks")
        return [self._task(name)(t) for name in self._order for t in (answers.get(name) or [])]

    async def statistics(self) -> RayServiceStatistics:
        """``GET /v1/stats``: the live nodes' figures, summed, and each node's own."""
        answers = await self._each("/stats")
        per = {name: msgspec.convert(answers[name], ServiceStatistics) if answers.get(name) else None
               for name in self._order}
        got = [s for s in per.values() if s is not None]

        def add(field: str) -> dict[str, int]:
            total: dict[str, int] = {}
            for s in got:
                for k, v in getattr(s, field).items():
                    total[k] = total.get(k, 0) + v
            return total

        return RayServiceStatistics(
            tasks=sum(s.tasks for s in got), groups_open=sum(s.groups_open for s in got),
            sessions_open=sum(s.sessions_open for s in got), sessions_ended=add("sessions_ended"),
            steps=add("steps"), refused=sum(s.refused for s in got),
            live_workspaces=sum(s.live_workspaces for s in got), live_handles=sum(s.live_handles for s in got),
            working_set=sum(s.working_set for s in got), nodes=per,
            down=[n for n in self._order if not self._nodes[n].alive],
        )

    async def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /v1/health``: ``ok`` while every node answers, ``degraded`` while one does."""
        answers = await self._each("/health")
        nodes = {name: "ok" if answers.get(name) else "down" for name in self._order}
        up = sum(v == "ok" for v in nodes.values())
        status = "ok" if up == len(nodes) else "degraded" if up else "down"
        return (200 if up else 503), {"status": status, "nodes": nodes}

    async def schema(self) -> tuple[int, bytes, dict[str, str]]:
        """The OpenAPI document of a live node (the router serves the same API)."""
        node = self._pick()
        if node is None:
            return _error(503, "every node is gone", error="NodeLost")
        r = await self._client.get(node.url + "/schema/openapi.json")
        return r.status_code, r.content, {"content-type": r.headers.get("content-type", "application/json")}


def create_router_app(router: RayRouter) -> Any:
    """The Litestar app serving *router*: the API of :func:`~bunshin_async.create_app` under
    ``/v1`` (group and session ids prefixed with their node), and the nodes' OpenAPI document
    at ``/schema/openapi.json``."""
    from litestar import (
        Litestar,
        MediaType,
        Request,
        Response,
        Router,
        delete,
        get,
        post,
    )
    from litestar.logging import LoggingConfig
    from litestar.params import FromPath

    Answer = Awaitable[tuple[int, bytes, dict[str, str]]]

    async def send(request: Request, make: Callable[[bytes], Answer]) -> Response[bytes]:
        body = await request.body()
        answer: tuple[int, bytes, dict[str, str]] | None = None

        async def watch() -> None:  # the body is read: the next message is the disconnect
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()  # closing the node's connection abandons a step there
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            answer = await make(body)
            tg.cancel_scope.cancel()
        if answer is None:
            return Response(b"", status_code=499)
        status, content, headers = answer
        media = headers.pop("content-type", MediaType.JSON)
        return Response(content if status != 204 else b"", status_code=status, headers=headers, media_type=media)

    def json(status: int, value: Any) -> Response[bytes]:
        return Response(msgspec.json.encode(value), status_code=status, media_type=MediaType.JSON)

    @get("/health", summary="Liveness of the router and its nodes")
    async def health() -> Response[bytes]:
        return json(*await router.health())

    @get("/stats", summary="What the nodes hold and did")
    async def stats() -> Response[bytes]:
        return json(200, await router.statistics())

    @get("/nodes", summary="The router's nodes and the tasks each owns")
    async def nodes() -> Response[bytes]:
        return json(200, router.nodes)

    @post("/tasks", status_code=201, summary="Register a task on its node")
    async def register_task(request: Request) -> Response[bytes]:
        return await send(request, router.register_task)

    @get("/tasks", summary="List the registered tasks")
    async def list_tasks() -> Response[bytes]:
        return json(200, await router.tasks())

    @get("/tasks/{task_id:str}", summary="A registered task")
    async def get_task(task_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.task("GET", task_id))

    @delete("/tasks/{task_id:str}", status_code=200, summary="Forget a task (204)")
    async def delete_task(task_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.task("DELETE", task_id))

    @post("/tasks/{task_id:str}/groups", status_code=201, summary="Open a group of sessions of a task")
    async def open_group(task_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.task("POST", task_id, "/groups", body))

    @get("/groups/{group_id:str}", summary="A group of sessions")
    async def get_group(group_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.group("GET", group_id))

    @delete("/groups/{group_id:str}", status_code=200, summary="Close every open session of a group")
    async def close_group(group_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.group("DELETE", group_id))

    @get("/sessions/{session_id:str}", summary="A session")
    async def get_session(session_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.session("GET", session_id))

    @post("/sessions/{session_id:str}/step", status_code=200, summary="Run a tool call in a session")
    async def step(session_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.session("POST", session_id, "/step", body))

    @post("/sessions/{session_id:str}/close", status_code=200, summary="Close a session with its reward")
    async def close_session(session_id: FromPath[str], request: Request) -> Response[bytes]:
        return await send(request, lambda body: router.session("POST", session_id, "/close", body))

    @get("/schema/openapi.json", include_in_schema=False)
    async def schema() -> Response[bytes]:
        status, content, headers = await router.schema()
        return Response(content, status_code=status, media_type=headers["content-type"])

    api = Router(API_PREFIX, route_handlers=[
        health, stats, nodes, register_task, list_tasks, get_task, delete_task, open_group, get_group, close_group,
        get_session, step, close_session,
    ])
    return Litestar(
        route_handlers=[api, schema], openapi_config=None,
        signature_namespace={"Request": Request, "Response": Response, "FromPath": FromPath},
        logging_config=LoggingConfig(configure_root_logger=False, log_exceptions="always"),
    )


@contextlib.asynccontextmanager
async def open_ray_service(
    backend: NodeBackend,
    config: ServeConfig | None = None,
    *,
    address: str | None = None,
    host: str | None = None,
    start_timeout: float = 120.0,
    probe_timeout: float = 10.0,
) -> AsyncIterator[RayRouter]:
    """Start one service per node of a Ray cluster and open the router in front of them.

    Each node's actor is pinned to its node (node affinity, not soft) and asks for no CPU, so
    it fits beside the cluster's other work. On exit every node's service is closed (its
    sessions end, its workspaces and snapshots are released) and every actor is killed; a
    Ray instance this call started is shut down.

    Args:
        backend: What each node serves.
        config: Each node's limits and scheduler options (``max_workspaces`` and ``max_bytes``
            are per node).
        address: The cluster to join (``auto``, ``ray://...``, ``HOST:PORT``); None joins the
            one this process is connected to, else starts a local one.
        host: The address each node's service listens on (None: the node's own address).
        start_timeout: Seconds a node's service may take to start.
        probe_timeout: Seconds to wait for Ray's answer when a node stops answering HTTP.

    Raises:
        ConfigError: If Ray is not installed, the cluster has no live node, or a node's
            service could not start.
    """
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        raise ConfigError("scale-out with Ray needs ray: pip install 'bunshin[ray]'") from None
    import httpx

    config = config or ServeConfig()
    config.check()
    started = False
    if not ray.is_initialized():
        import os

        started = address is None and not os.environ.get("RAY_ADDRESS")
        options: dict[str, Any] = {"include_dashboard": False} if started else {}
        await anyio.to_thread.run_sync(lambda: ray.init(address=address, log_to_driver=False, **options))
    actors: list[Any] = []
    nodes: list[_Node] = []
    try:
        alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
        if not alive:
            raise ConfigError("the Ray cluster has no live node")
        cls = ray.remote(_NodeServer)
        encoded_backend = msgspec.json.encode(backend)
        encoded_config = msgspec.json.encode(config)
        for info in alive:
            actor = cls.options(
                num_cpus=0, max_restarts=0, max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=info["NodeID"], soft=False),
            ).remote(encoded_backend, encoded_config, host)
            actors.append(actor)
        refs = [a.start.remote(start_timeout) for a in actors]
        try:
            answers = await anyio.to_thread.run_sync(lambda: ray.get(refs, timeout=start_timeout + 30))
        except Exception as exc:
            raise ConfigError(f"a node's service could not start: {type(exc).__name__}: {exc}") from None
        for i, (actor, answer) in enumerate(zip(actors, answers)):
            nodes.append(_Node(f"n{i}", actor, answer["node_id"], answer["url"], answer["pid"]))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(trust_env=False, limits=limits,
                                     timeout=httpx.Timeout(30.0, read=None, pool=None)) as client:
            yield RayRouter(nodes, client, probe_timeout)
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(ray, actors, nodes, start_timeout)
            if started:
                await anyio.to_thread.run_sync(ray.shutdown)


async def _stop(ray: Any, actors: list[Any], nodes: list[_Node], timeout: float) -> None:
    """Close every node's service, then kill every actor (dead ones included)."""
    by_actor = {id(n.actor): n for n in nodes}
    refs = [(a, a.stop.remote(timeout)) for a in actors if id(a) not in by_actor or by_actor[id(a)].alive]

    def wait() -> None:
        for actor, ref in refs:
            try:
                left = ray.get(ref, timeout=timeout)
            except Exception:  # a node that died meanwhile
                left = None
            node = by_actor.get(id(actor))
            if node is not None:
                node.left = left

    await anyio.to_thread.run_sync(wait)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
