"""Live commands (real workspaces on this host; root only).

``bunshin gc``        remove what killed runs left behind (cgroups, processes, veths, directories);
``bunshin ws list``   list the workspaces and layers recorded in the state directory;
``bunshin ws exec``   start a workspace from a spec, run one command or tool call in it, remove it.
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

from ._exceptions import ConfigError

__all__ = ["default_spec_path", "register"]



def default_spec_path() -> str:
    """The bundled default workspace spec: installed beside this module, or ``examples/`` of
    a source checkout (an editable install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "workspace.toml")
    return installed if os.path.exists(installed) else os.path.join(os.path.dirname(here), "examples", "workspace.toml")


def _say(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


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

    # `bunshin run SPEC TRACE` (the live backend driving the scheduler) is registered here.
