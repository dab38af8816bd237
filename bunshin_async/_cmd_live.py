"""Live commands (real workspaces on this host; root only).

``bunshin gc``        remove what killed runs left behind (cgroups, processes, veths, directories);
``bunshin ws list``   list the workspaces and layers recorded in the state directory;
``bunshin ws exec``   start a workspace from a spec, run one command or tool call in it, remove it;
``bunshin run``       replay a trace's calls in real workspaces and record a live trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ._cli import _say
from ._exceptions import ConfigError

__all__ = ["default_spec_path", "register"]



def default_spec_path() -> str:
    """The bundled default workspace spec: installed beside this module, or ``examples/`` of
    a source checkout (an editable install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "workspace.toml")
    return installed if os.path.exists(installed) else os.path.join(os.path.dirname(here), "examples", "workspace.toml")


def _state(args: argparse.Namespace) -> Any:
    from ._state import StateDir

    return StateDir(args.state_dir)


def cmd_gc(args: argparse.Namespace, console: Console) -> int:
    """``bunshin gc``: remove the leftovers of dead controllers."""
    from ._state import gc

    state = _state(args)
    report = gc(state, include_alive=args.all)
    _say(console, f"{state.path}: removed {report.records} record(s): {report.processes} process(es), "
                  f"{report.cgroups} cgroup(s), {report.mounts} mount(s), {report.veths} veth(s), "
                  f"{report.dirs} directory(ies); {report.alive} still owned by a running controller")
    for err in report.errors:
        _say(Console(stderr=True), f"bunshin: gc: {err}")
    return 1 if report.errors else 0


def cmd_ws_list(args: argparse.Namespace, console: Console) -> int:
    """``bunshin ws list``: the records of the state directory."""
    state = _state(args)
    table = Table(title=f"workspaces in {state.path}")
    for col in ("id", "kind", "state", "owner", "alive", "pid 1", "age"):
        table.add_column(col)
    for rec in state.list():
        table.add_row(rec.id, rec.kind, rec.state, str(rec.owner_pid), "yes" if state.owner_alive(rec) else "no",
                      str(rec.init_pid or "-"), f"{time.time() - rec.created:.0f} s")
    console.print(table)
    return 0


def cmd_ws_exec(args: argparse.Namespace, console: Console) -> int:
    """``bunshin ws exec``: one command or tool call in a fresh workspace."""
    import anyio

    from ._container import open_container
    from ._spec import load_spec
    from ._trace import ToolCall

    spec = load_spec(args.spec)
    if bool(args.tool) == bool(args.command):
        raise ConfigError("give either a command (after --) or --tool NAME [--args JSON]")
    try:
        arguments = json.loads(args.args) if args.args else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--args: not valid JSON: {exc}") from None

    async def main() -> Any:
        async with open_container(spec, state=_state(args)) as ws:
            if args.tool:
                return await ws.call(ToolCall(args.tool, arguments))
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return await ws.exec(command[0] if len(command) == 1 else command, timeout=args.timeout)

    result = anyio.run(main)
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    if result.timed_out:
        _say(Console(stderr=True), f"bunshin: timed out after {result.duration:.1f} s")
    if result.truncated:
        _say(Console(stderr=True), "bunshin: output truncated")
    return result.status if result.status >= 0 else 128 - result.status


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    """``bunshin run [SPEC] [TRACE]``: replay a trace's calls in real workspaces."""
    import anyio
    import msgspec
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ._cli import _summary
    from ._live import LiveBackend, demo_trace, live_trace
    from ._policy import TracePolicy
    from ._scheduler import SchedulerConfig
    from ._plugins import CacheableTools
    from ._selector import HistorySelector
    from ._spec import load_spec
    from ._trace import dump_trace, load_trace

    spec = load_spec(args.spec or default_spec_path())
    trace = load_trace(args.trace) if args.trace else demo_trace(spec, seed=args.seed)
    undeclared = sorted({s.call.name for r in trace.rollouts for s in r.steps} - set(spec.tools))
    if undeclared:
        raise ConfigError(
            f"{args.trace}: calls tools the spec {spec.path or spec.name} does not declare: "
            f"{', '.join(undeclared)}; declare them under [tools] or pick another spec"
        )
    over: dict[str, Any] = {"seed": args.seed}
    for name in ("batch_tasks", "group_size", "max_concurrent", "hot_budget"):
        v = getattr(args, name)
        if v is not None:
            over[name] = v
    config = SchedulerConfig.preset(args.policy, **over)
    # live observations differ from the ones recorded elsewhere: replay the calls, not checks
    policy = TracePolicy(trace, check=False, think_scale=args.think_scale)

    async def main() -> Any:
        from ._scheduler import Scheduler

        async with LiveBackend(spec, state=_state(args), memory_interval=args.memory_interval,
                               engine=args.engine) as backend:
            with Progress(TextColumn(f"live {args.policy}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("rollouts"), TimeElapsedColumn(), console=console, transient=True,
                          disable=not console.is_terminal) as progress:
                tid = progress.add_task("run", total=None)
                sched = Scheduler(
                    backend, policy, config,
                    selector=HistorySelector() if config.speculation else None,
                    cacheable=CacheableTools(n for n, t in spec.tools.items() if t.cacheable),
                    on_progress=lambda done, total: progress.update(tid, completed=done, total=total),
                )
                result = await sched.run()
            recorded = live_trace(trace, result, backend)
            return result, recorded, backend.statistics()

    result, recorded, stats = anyio.run(main)
    _summary(console, trace, f"{args.engine} (live)", args.policy, result)
    _say(console, f"live backend: {stats.creates} workspaces booted, {stats.forks} forks "
                  f"({stats.replayed_calls} stateful calls replayed), {stats.snapshots} snapshots, "
                  f"{stats.executions} calls run ({stats.failed_calls} failed), "
                  f"{stats.demotes} layers archived, {stats.promotes} restored"
                  + (f"; {stats.tree_forks} process trees {'restored' if args.engine == 'criu' else 'forked'}, "
                     f"workspaces frozen "
                     f"{stats.frozen_seconds:.3f} s in all (longest {stats.max_frozen_seconds * 1e3:.0f} ms)"
                     if args.engine != "restart" else ""))
    dump_trace(recorded, args.out)
    _say(console, f"wrote {args.out}: the live trace ({len(recorded.rollouts)} rollouts); replay it with "
                  f"`bunshin replay {args.out}`")
    if args.json:
        with open(args.json, "wb") as f:
            f.write(msgspec.json.encode(result))
        _say(console, f"wrote {args.json}")
    return 0


def register(sub: argparse._SubParsersAction, trace_sub: argparse._SubParsersAction) -> None:
    """Add the live commands to the ``bunshin`` parser."""
    state_help = "state directory (default $BUNSHIN_STATE_DIR or /run/bunshin)"

    p = sub.add_parser("gc", help="remove what killed live runs left behind")
    p.add_argument("--state-dir", help=state_help)
    p.add_argument("--all", action="store_true", help="also remove workspaces of controllers that still run")
    p.set_defaults(fn=cmd_gc)

    p = sub.add_parser("ws", help="live workspace utilities (debugging)")
    wsub = p.add_subparsers(dest="ws_command", required=True, metavar="SUBCOMMAND")
    w = wsub.add_parser("list", help="list recorded workspaces and layers")
    w.add_argument("--state-dir", help=state_help)
    w.set_defaults(fn=cmd_ws_list)
    w = wsub.add_parser("exec", help="run one command or tool call in a fresh workspace")
    w.add_argument("--spec", default=default_spec_path(), help="workspace spec (default: the bundled examples/workspace.toml)")
    w.add_argument("--state-dir", help=state_help)
    w.add_argument("--tool", help="a tool of the spec to call")
    w.add_argument("--args", help="the tool call's arguments, a JSON object")
    w.add_argument("--timeout", type=float, default=60.0, help="seconds (a command; default 60)")
    w.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...] (one argument: a shell command)")
    w.set_defaults(fn=cmd_ws_exec)

    from ._cli import parse_bytes

    p = sub.add_parser("run", help="run a trace's calls in real workspaces (root) and record a live trace")
    p.add_argument("spec", nargs="?", help="workspace spec (default: the bundled examples/workspace.toml)")
    p.add_argument("trace", nargs="?", help="trace whose calls to run (default: a demo trace for the spec)")
    p.add_argument("--policy", choices=("base", "spec", "full"), default="full", help="default full")
    p.add_argument("--engine", choices=("restart", "bunshin", "criu"), default="restart",
                   help="how forks are made: restart (boot and replay), bunshin (the kernel module's "
                        "tree fork), criu (a checkpoint on tmpfs, restored); default restart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tasks", type=int, help="groups per training step (default 32)")
    p.add_argument("--group-size", type=int, help="samples per group (default: all the trace has)")
    p.add_argument("--max-concurrent", type=int, help="workspaces running rollouts at once")
    p.add_argument("--hot-budget", type=parse_bytes, help="prefix-tree hot tier budget")
    p.add_argument("--think-scale", type=float, default=1.0, help="multiply recorded think times (default 1)")
    p.add_argument("--memory-interval", type=float, default=0.5,
                   help="seconds between page-scanner measurements of the working set (default 0.5)")
    p.add_argument("--out", default="live-trace.json", help="where to write the live trace (default live-trace.json)")
    p.add_argument("--json", metavar="FILE", help="write the whole run result as JSON")
    p.add_argument("--state-dir", help=state_help)
    p.set_defaults(fn=cmd_run)
