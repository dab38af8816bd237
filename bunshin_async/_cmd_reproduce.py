"""``bunshin reproduce``: regenerate the report that sets the seed's figures beside the simulator's."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["register", "cmd_reproduce"]


def cmd_reproduce(args: argparse.Namespace, console: Console) -> int:
    """Run :func:`sim.reproduce` with a progress bar and print the comparison table."""
    from sim._reproduce import reproduce

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("runs"),
        TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal,
    )
    with progress:
        tid = progress.add_task("reproducing", total=None)

        def tick(what: str, done: int, total: int) -> None:
            progress.update(tid, description=what, completed=done, total=total)

        rows = reproduce(args.out, quick=args.quick, progress=tick)
    t = Table(title="seed vs simulator")
    for col in ("figure", "seed", "simulator", "error", "within"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    from sim._reproduce import _err, _fmt

    for c in rows:
        t.add_row(c.figure, ("> " if c.bound else "") + _fmt(c.seed, c.unit), _fmt(c.sim, c.unit), _err(c),
                  "yes" if c.ok or (c.bound and c.error == 0) else "no")
    console.print(t)
    console.print(f"wrote {args.out}/report.md", markup=False, highlight=False)
    return 0


def register(sub: argparse._SubParsersAction, trace_sub: argparse._SubParsersAction) -> None:
    """Add ``bunshin reproduce`` to the top-level subcommands."""
    p = sub.add_parser("reproduce", help="reproduce the seed's evaluation in the simulator (report + figures)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for report.md and the PNG figures")
    p.add_argument("--quick", action="store_true", help="a small configuration (smoke test; not comparable with the seed)")
    p.set_defaults(fn=cmd_reproduce)
