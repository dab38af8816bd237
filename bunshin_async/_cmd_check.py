"""``bunshin check-policy``: run every invariant against a user's scheduling policy."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ._cli import _say

__all__: list[str] = []


def cmd_check_policy(args: argparse.Namespace, console: Console) -> int:
    from ._plugins import load_policy
    from .testing import CHECKS, DEFAULT_EXAMPLES, check_policy

    kind, _ = load_policy(args.policy, args.kind)  # a bad name fails here, before any work
    only = tuple(args.only.split(",")) if args.only else CHECKS
    examples = args.examples or DEFAULT_EXAMPLES
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("examples"),
        TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal,
    )
    t0 = time.perf_counter()
    with progress:
        ids = {name: progress.add_task(name, total=examples) for name in only}

        def tick(name: str, done: int, total: int) -> None:
            progress.update(ids[name], completed=done, total=total)

        results = check_policy(args.policy, kind=kind, examples=examples, seed=args.seed,
                               out_dir=args.out, only=only, on_progress=tick)
    wall = time.perf_counter() - t0
    ran = sum(r.examples for r in results)
    t = Table(title=f"{args.policy} ({kind} policy): {examples} examples per check, seed {args.seed}")
    t.add_column("check", no_wrap=True)
    t.add_column("result")
    t.add_column("examples run", justify="right")
    t.add_column("seconds", justify="right")
    for r in results:
        t.add_row(r.check, Text("pass", style="green") if r.passed else Text("FAIL", style="red"),
                  str(r.examples), f"{r.seconds:.1f}")
    console.print(t)
    failed = [r for r in results if not r.passed]
    for r in failed:
        console.print(Text(f"\n{r.check}: ", style="bold red") + Text(r.error or ""), highlight=False, soft_wrap=True)
        if r.size:
            size = ", ".join(f"{v} {k}" for k, v in r.size.items())
            console.print(Text(f"  shrunk counterexample: {size}"), highlight=False)
        if r.counterexample:
            console.print(Text(f"  written to {r.counterexample}; replay it with:"), highlight=False)
            console.print(Text(f"  {r.replay}"), highlight=False, soft_wrap=True)
        if r.program:
            console.print(Text("  the operations, as hypothesis prints them:"), highlight=False)
            console.print(Text(r.program), highlight=False, soft_wrap=True)
    verdict = "passes every check" if not failed else f"fails {len(failed)} of {len(results)} checks"
    _say(console, f"{args.policy} {verdict}: {ran} examples in {wall:.1f} s ({ran / wall:.0f} per second)",
         "green" if not failed else "red")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction, trace_sub: argparse._SubParsersAction) -> None:
    """Add ``bunshin check-policy`` to the top-level subcommands."""
    from ._plugins import POLICY_KINDS

    p = sub.add_parser(
        "check-policy",
        help="test a scheduling policy against every invariant; print a replayable counterexample on failure",
        description="Runs the invariants of bunshin_async.testing (semantic transparency, budgets, every rollout "
        "finished once with nothing left alive, determinism, engine order, and a state machine of forks, hits, "
        "misses, evictions, speculation and cancellation) against POLICY in its slot, built-in policies in the "
        "others. Exit status 0 if every check passes, 1 if one fails.",
    )
    p.add_argument("policy", metavar="POLICY", help="module:attribute (a policy class or a function returning one), or a built-in name")
    p.add_argument("--kind", choices=POLICY_KINDS, help="the slot, when a built-in name is ambiguous (default: from the class)")
    p.add_argument("--examples", type=int, help="examples per check (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the example generation (default 0)")
    p.add_argument("--only", metavar="CHECKS", help="comma-separated checks to run (default all)")
    p.add_argument("--out", default="counterexamples", metavar="DIR",
                   help="folder for counterexample traces (default ./counterexamples)")
    p.set_defaults(fn=cmd_check_policy)
