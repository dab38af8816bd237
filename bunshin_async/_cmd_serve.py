"""``bunshin serve``: the rollout service's HTTP API (environment mode), until SIGINT or SIGTERM.

With ``--spec FILE`` (the default: the bundled workspace spec) sessions run in real workspaces
(root only); with ``--sim TRACE`` they run in the simulator's backend on the trace's tool
outcomes, in real time (for tests and demos). See docs/serve.md.

With ``--ray [ADDRESS]`` the service scales out over a Ray cluster: one service per node, this
process a router in front of them (see docs/ray.md).
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import msgspec

from rich.console import Console

from ._cli import _say, parse_bytes
from ._exceptions import ConfigError

__all__ = ["register"]


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    """``bunshin serve``: run the service until SIGINT or SIGTERM."""
    import anyio

    from ._scheduler import SchedulerConfig
    from ._serve import ServeConfig, create_app, open_http_server, open_service

    if args.spec and args.sim:
        raise ConfigError("give either --spec FILE (live workspaces) or --sim TRACE (the simulator), not both")
    over: dict[str, Any] = {"spec_tail": 1.0}
    for name in ("hot_budget", "cold_budget", "spec_budget"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    config = ServeConfig(max_workspaces=args.max_workspaces, max_bytes=args.max_bytes,
                         idle_timeout=args.idle_timeout, max_wait=args.max_wait,
                         scheduler=SchedulerConfig.preset(args.policy, **over))
    config.check()
    if args.ray is not None:
        return _serve_ray(args, config, console)

    async def serve(backend: Any, journal: str | None, **options: Any) -> None:
        cfg = msgspec.structs.replace(config, journal=journal)
        async with open_service(backend, cfg, **options) as service:
            lost = service.statistics().lost
            if lost:
                _say(console, f"bunshin serve: {lost} sessions or runs were left open by a service that was killed; "
                              f"they are reported as failed (journal {journal})")
            async with open_http_server(create_app(service), host=args.host, port=args.port) as server:
                _say(console, f"bunshin serve: {backend.engine} backend, listening on {server.url}{' (simulated)' if args.sim else ''}; "
                              f"API under {server.url}/v1, OpenAPI document at {server.url}/schema/openapi.json; "
                              "stop with Ctrl-C")
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        _say(console, f"bunshin serve: {signal.Signals(sig).name}: closing every session")
                        break
                await service.aclose()
        stats = service.statistics()
        _say(console, f"bunshin serve: stopped; {sum(stats.sessions_ended.values())} sessions served, "
                      f"steps {stats.steps}, {stats.live_handles} workspace handles left")

    async def main() -> None:
        if args.sim:
            from sim import SimBackend, ToolModel

            from ._trace import load_trace

            trace = load_trace(args.sim)
            cacheable = sorted({s.call.name for r in trace.rollouts for s in r.steps}
                               - {s.call.name for r in trace.rollouts for s in r.steps if not s.cacheable})
            backend = SimBackend(args.engine, ToolModel(trace))
            try:
                await serve(backend, args.journal, tasks=trace.task_map(), cacheable=cacheable)
            finally:
                await backend.aclose()
        else:
            from ._cmd_live import default_spec_path
            from ._live import LiveBackend
            from ._spec import load_spec
            from ._state import StateDir

            spec = load_spec(args.spec or default_spec_path())
            state = StateDir(args.state_dir)
            journal = args.journal or os.path.join(state.path, "serve-journal.json")
            async with LiveBackend(spec, state=state) as backend:  # removes what a killed service left
                await serve(backend, journal, spec=spec)

    anyio.run(main)
    return 0


def _serve_ray(args: argparse.Namespace, config: Any, console: Console) -> int:
    """``bunshin serve --ray``: one service per node of a Ray cluster, and the router here."""

    import anyio

    from ._ray import (
        LiveNodeBackend,
        SimNodeBackend,
        create_router_app,
        open_ray_service,
    )
    from ._serve import open_http_server

    backend: SimNodeBackend | LiveNodeBackend
    if args.sim:
        from ._trace import encode_trace, load_trace

        backend = SimNodeBackend(encode_trace(load_trace(args.sim)), engine=args.engine)
    else:
        from ._cmd_live import default_spec_path

        backend = LiveNodeBackend(os.path.abspath(args.spec or default_spec_path()), state_dir=args.state_dir)

    async def main() -> None:
        address = None if args.ray == "local" else args.ray
        async with open_ray_service(backend, config, address=address) as router:
            async with open_http_server(create_router_app(router), host=args.host, port=args.port) as server:
                where = ", ".join(f"{n.name} on {n.url}" for n in router.nodes)
                _say(console, f"bunshin serve --ray: {len(router.nodes)} node{'s' * (len(router.nodes) != 1)} ({where}), listening on {server.url}; "
                              f"API under {server.url}/v1; stop with Ctrl-C")
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for sig in signals:
                        _say(console, f"bunshin serve --ray: {signal.Signals(sig).name}: closing every node's sessions")
                        break
        left = {n.name: n.left for n in router.nodes}
        _say(console, f"bunshin serve --ray: stopped {len(left)} node{'s' * (len(left) != 1)}; workspace handles left per node: "
                      + ", ".join(f"{name} {'lost' if n is None else n}" for name, n in left.items())
                      + f"; {sum(n or 0 for n in left.values())} workspace handles left")

    anyio.run(main)
    return 0


def register(sub: argparse._SubParsersAction, trace_sub: argparse._SubParsersAction) -> None:
    """Add ``bunshin serve`` to the ``bunshin`` parser."""
    p = sub.add_parser("serve", help="serve workspaces over an HTTP API (environment mode; see docs/serve.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 lets the kernel pick)")
    p.add_argument("--spec", metavar="FILE", help="workspace spec of live workspaces (root; default: the bundled one)")
    p.add_argument("--sim", metavar="TRACE", help="serve the simulator's backend on TRACE's tool outcomes instead")
    p.add_argument("--engine", default="bunshin", help="--sim: the simulated fork engine (default bunshin)")
    p.add_argument("--max-workspaces", type=int, default=64, help="sessions open at once (default 64)")
    p.add_argument("--max-bytes", type=parse_bytes, help="open groups only while the working set is below this (e.g. 8GiB)")
    p.add_argument("--idle-timeout", type=float, default=600.0,
                   help="seconds a session may wait for its next step before it is expired (default 600)")
    p.add_argument("--max-wait", type=float, default=300.0,
                   help="longest an open-group request may wait for capacity (default 300)")
    p.add_argument("--policy", choices=("base", "spec", "full"), default="full",
                   help="base: forks only; spec: plus speculation; full: plus prefix caching (default)")
    p.add_argument("--hot-budget", type=parse_bytes, help="prefix-tree hot tier budget, shared by all tasks (default 32GiB)")
    p.add_argument("--cold-budget", type=parse_bytes, help="prefix-tree cold tier budget (default 256GiB)")
    p.add_argument("--spec-budget", type=int, help="speculative branches at once per group (default 32)")
    p.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="scale out over a Ray cluster: one service per node, a router here (ADDRESS: a running "
                        "cluster, default auto; 'local' starts a one-node Ray here; see docs/ray.md)")
    p.add_argument("--state-dir", help="live: state directory (default $BUNSHIN_STATE_DIR or /run/bunshin)")
    p.add_argument("--journal", metavar="FILE",
                   help="where to keep the ids of open sessions, so that a restart reports those a killed service "
                        "left (default: serve-journal.json in the state directory when live; none with --sim)")
    p.set_defaults(fn=cmd_serve)
