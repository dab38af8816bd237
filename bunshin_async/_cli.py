"""The ``bunshin`` command.

This module holds the simulator commands (``replay``, ``compare``, ``generate``, ``trace
validate``); the modules of :data:`_COMMAND_MODULES` add the others (trace import and stats,
predict, reproduce, the live commands, the lab VM).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ._exceptions import BunshinError, exception_leaves
from ._scheduler import POLICIES, RunResult, SchedulerConfig
from ._trace import Trace, check_trace, dump_trace, load_trace

__all__ = ["main"]

ENGINE_NAMES = ("bunshin", "criu", "microvm", "restart", "cold")
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _say(console: Console, text: str, style: str | None = None) -> None:
    """Print *text* as it is (file names may hold brackets, which rich would read as markup)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True, style=style)


def parse_page_size(text: str) -> int:
    """Parse a page size: like :func:`parse_bytes`, at least 1 byte."""
    n = parse_bytes(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"invalid page size {text!r}; expected at least 1 byte, e.g. 1MiB")
    return n


def parse_bytes(text: str) -> int:
    """Parse ``"32GiB"``, ``"512M"``, ``"1.5GB"`` or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}; expected a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _load_or_generate(args: argparse.Namespace, console: Console) -> Trace:
    if args.trace:
        return load_trace(args.trace)
    from sim import generate, workload_params

    params = workload_params(args.workload)
    with console.status(f"generating the {args.workload} workload (seed {args.seed})"):
        return generate(params, seed=args.seed)


def _config(args: argparse.Namespace, policy: str) -> SchedulerConfig:
    over: dict[str, Any] = {"seed": args.seed, "mode": args.mode}
    for name in ("batch_tasks", "group_size", "staleness", "max_concurrent", "hot_budget",
                 "cold_budget", "spec_budget", "spec_tail", "spec_min_confidence", "spec_rule", "train_time"):
        v = getattr(args, name, None)
        if v is not None:
            over[name] = v
    if getattr(args, "no_coalesce", False):
        over["coalesce"] = False
    return SchedulerConfig.preset(policy, **over)


def _run(trace: Trace, engine: str, policy: str, args: argparse.Namespace, progress: Progress | None) -> RunResult:
    from sim import simulate

    cfg = _config(args, policy)
    tid = progress.add_task(f"{engine}/{policy}", total=None) if progress else None

    def tick(done: int, total: int) -> None:
        if progress is not None and tid is not None:
            progress.update(tid, completed=done, total=total)

    return simulate(trace, engine=engine, config=cfg, page_size=args.page_size, on_progress=tick,
                    cancels=getattr(args, "cancel", None) or (), **_plugins(args))


def _plugins(args: argparse.Namespace) -> dict[str, Any]:
    """Fresh instances of the policies named by --cacheability, --eviction, --speculation and
    --selector (a built-in name or module:attribute)."""
    from ._plugins import POLICY_KINDS, load_policy

    out: dict[str, Any] = {}
    for kind in POLICY_KINDS:
        spec = getattr(args, kind, None)
        if spec:
            _, factory = load_policy(spec, kind)
            out[kind] = factory()
    return out


def parse_cancel(text: str) -> tuple[float, int]:
    """``T:N``: cancel rollout number N of the plan at virtual second T."""
    t, sep, n = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(t), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not T:N (cancel rollout number N at second T), e.g. 20:3") from None


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rollouts"),
        TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal,
    )


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f}"


def _row(r: RunResult) -> dict[str, str]:
    epochs = list(r.epoch_times.values())
    return {
        "epochs (min)": " ".join(f"{t / 60:.1f}" for t in epochs),
        "peak GiB": _gib(r.memory.peak_bytes),
        "total GiB·h": f"{r.memory.total_byte_seconds / GiB / 3600:,.1f}",
        "cache hit": f"{r.cache_hit_rate:.0%}" if r.config.caching else "-",
        "spec hit/miss": f"{r.spec.hits}/{r.spec.misses}" if r.config.speculation else "-",
        "spec waste s": f"{r.spec.wasted_exec_seconds:,.0f}" if r.config.speculation else "-",
    }


def _summary(console: Console, trace: Trace, engine: str, policy: str, r: RunResult) -> None:
    t = Table(title=f"{trace.name}: engine {engine}, policy {policy}", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    n = len(r.rollouts)
    counts = {k: sum(x.status == k for x in r.rollouts) for k in ("done", "failed", "cancelled")}
    t.add_row("rollouts", f"{n} (" + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k == "done") + ")")
    for x in r.rollouts:
        if x.error:
            t.add_row(f"failed: {x.key}", x.error)
    t.add_row("training steps", str(len(r.steps)))
    for e, secs in r.epoch_times.items():
        t.add_row(f"epoch {e} time", f"{secs / 60:.2f} min")
    t.add_row("makespan", f"{r.makespan / 60:.2f} min")
    t.add_row("peak memory", _size(r.memory.peak_bytes))
    t.add_row("total memory", f"{r.memory.total_byte_seconds / GiB / 3600:,.2f} GiB·h")
    mems = [x.memory for x in r.rollouts if x.memory is not None]
    if mems:
        shared = [m.shared_bytes for m in mems]
        private = [m.private_bytes for m in mems]
        t.add_row("per workspace at end: shared", f"{_size(sum(shared) / len(mems))} mean, {_size(max(shared))} max")
        t.add_row("per workspace at end: private", f"{_size(sum(private) / len(mems))} mean, {_size(max(private))} max")
    t.add_row("calls", f"{r.calls} ({r.cacheable_calls} cacheable)")
    if r.tree is not None:
        t.add_row("cache hit rate", f"{r.cache_hit_rate:.1%} ({r.tree.hits} skipped; {r.tree.waits} lookups "
                  f"waited for the same call in flight)")
        t.add_row("prefix tree", f"{r.tree.nodes} nodes ({r.tree.admitted_hot} admitted hot, "
                  f"{r.tree.admitted_evicted} as call logs), hot peak {_size(r.tree.hot_bytes_peak)} "
                  f"of {_size(r.tree.hot_budget)}")
        t.add_row("prefix tree tiers", f"{r.tree.demotions} demoted, {r.tree.promotions} promoted, "
                  f"{r.tree.drops} dropped, {r.tree.replayed_calls} calls replayed")
        t.add_row("forks made during think time", f"{r.prepared} ({r.prepared_used} used)")
    if r.config.speculation:
        t.add_row("speculation", f"{r.spec.launched} launched, {r.spec.hits} hits, {r.spec.misses} misses")
        t.add_row("speculation wasted work", f"{r.spec.wasted_exec_seconds:,.1f} s of tool time")
        t.add_row("speculation hidden work", f"{r.spec.hidden_exec_seconds:,.1f} s of tool time")
    console.print(t)


def cmd_replay(args: argparse.Namespace, console: Console) -> int:
    trace = _load_or_generate(args, console)
    with _progress(console) as progress:
        r = _run(trace, args.engine, args.policy, args, progress)
    _summary(console, trace, args.engine, args.policy, r)
    if args.json:
        import msgspec

        with open(args.json, "wb") as f:
            f.write(msgspec.json.encode(r))
        _say(console, f"wrote {args.json}")
    if args.plot:
        from ._plot import plot_runs

        for path in plot_runs({f"{args.engine}/{args.policy}": r}, args.plot, trace.name):
            _say(console, f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    trace = _load_or_generate(args, console)
    engines = args.engines.split(",")
    policies = args.policies.split(",")
    for name, items in (("--engines", engines), ("--policies", policies)):
        dup = sorted({x for x in items if items.count(x) > 1})
        if dup:
            raise BunshinError(f"{name} names {', '.join(dup)} more than once; name each once")
    for e in engines:
        if e not in ENGINE_NAMES:
            raise BunshinError(f"unknown engine {e!r} in --engines; expected some of {', '.join(ENGINE_NAMES)}")
    for p in policies:
        if p not in POLICIES:
            raise BunshinError(f"unknown policy {p!r} in --policies; expected some of {', '.join(POLICIES)}")
    results: dict[str, RunResult] = {}
    with _progress(console) as progress:
        for e in engines:
            for p in policies:
                results[f"{e}/{p}"] = _run(trace, e, p, args, progress)
    base_key = f"{engines[0]}/{policies[0]}"
    base = results[base_key]
    t = Table(title=f"{trace.name}: {len(trace.rollouts)} rollouts; × is the ratio to {base_key}")
    t.add_column("engine/policy", no_wrap=True)
    cols = list(_row(base))
    for c in cols:
        t.add_column(c, justify="right")
    t.add_column("peak ×", justify="right")
    t.add_column("total ×", justify="right")
    t.add_column("time ×", justify="right")
    for k, r in results.items():
        row = _row(r)
        t.add_row(
            k, *(row[c] for c in cols),
            f"{r.memory.peak_bytes / base.memory.peak_bytes:.2f}" if base.memory.peak_bytes else "-",
            f"{r.memory.total_byte_seconds / base.memory.total_byte_seconds:.2f}"
            if base.memory.total_byte_seconds else "-",
            f"{r.makespan / base.makespan:.2f}" if base.makespan else "-",
        )
    console.print(t)
    if args.plot:
        from ._plot import plot_runs

        for path in plot_runs(results, args.plot, trace.name):
            _say(console, f"wrote {path}")
    return 0


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    from sim import generate, workload_params

    over: dict[str, Any] = {}
    for name in ("tasks", "group_size", "epochs"):
        v = getattr(args, name)
        if v is not None:
            over[name] = v
    params = workload_params(args.workload, **over)
    with console.status(f"generating {args.workload}"):
        trace = generate(params, seed=args.seed)
    dump_trace(trace, args.out)
    steps = sum(len(r.steps) for r in trace.rollouts)
    _say(console, f"wrote {args.out}: {len(trace.tasks)} tasks, {len(trace.rollouts)} rollouts, {steps} steps")
    return 0


def cmd_validate(args: argparse.Namespace, console: Console) -> int:
    bad = 0
    for path in args.files:
        try:
            trace = load_trace(path)
        except BunshinError as exc:
            console.print(Text("error ", style="red") + Text(str(exc)), highlight=False, soft_wrap=True)
            bad += 1
            continue
        warnings = check_trace(trace)
        for w in warnings:
            console.print(Text(path, style="yellow") + Text(f": {w}"), highlight=False, soft_wrap=True)
        steps = sum(len(r.steps) for r in trace.rollouts)
        _say(console, f"{path}: ok, version {trace.version}, {len(trace.tasks)} tasks, "
                      f"{len(trace.rollouts)} rollouts, {steps} steps, {len(warnings)} warnings")
    return 1 if bad else 0


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="trace file (JSON or msgpack); default: generate --workload")
    p.add_argument("--workload", default="osworld", choices=("osworld", "webarena"),
                   help="workload to generate when no TRACE is given (default: osworld)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run (and of a generated workload)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync", help="training steps: synchronous or bounded-staleness async")
    p.add_argument("--staleness", type=int, help="async mode: steps a rollout may lag (default 1)")
    p.add_argument("--batch-tasks", type=int, help="groups (tasks) per training step (default 32)")
    p.add_argument("--group-size", type=int, help="samples per group (default: all the trace has)")
    p.add_argument("--max-concurrent", type=int, help="rollouts running at once (default: one step's worth)")
    p.add_argument("--train-time", type=float, help="seconds of training between steps (default 0)")
    p.add_argument("--hot-budget", type=parse_bytes, help="prefix-tree hot tier budget, e.g. 32GiB (default)")
    p.add_argument("--cold-budget", type=parse_bytes, help="prefix-tree cold tier budget (default 256GiB)")
    p.add_argument("--no-coalesce", action="store_true",
                   help="with caching, run a call again rather than wait for the same call in flight from the same "
                   "prefix-tree node in another sample")
    p.add_argument("--spec-budget", type=int, help="speculative branches at once (default 32)")
    p.add_argument("--spec-tail", type=float, help="speculate once at most this share of a step still runs (default 0.25)")
    p.add_argument("--spec-min-confidence", type=float, help="least prediction confidence to speculate on (default 0.3)")
    p.add_argument("--spec-rule", choices=("benefit", "confidence"), help="speculate when the expected saving beats the cost, "
                   "or on confidence alone (default benefit)")
    for kind, default, what in (
        ("cacheability", "recorded: the trace's marks", "which calls may be cached"),
        ("eviction", "lru", "which snapshots leave the prefix tree's tiers"),
        ("speculation", "tail-benefit", "when and what to run ahead"),
        ("selector", "history", "the next-call predictor"),
    ):
        p.add_argument(f"--{kind}", metavar="POLICY",
                       help=f"{what}: a built-in name or module:attribute (default {default}); see docs/policies.md")
    p.add_argument("--page-size", type=parse_page_size, default=1 << 20, help="page model resolution (default 1MiB)")
    p.add_argument("--plot", metavar="DIR", help="write PNG figures to DIR")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``bunshin`` command."""
    ap = argparse.ArgumentParser(
        prog="bunshin",
        description="Bunshin: agentic-RL rollouts with live workspace forks, tool-prefix caching and "
        "speculative tool execution. Simulate with replay/compare/reproduce; run live (root) with run.",
        epilog="Without a TRACE, replay and compare generate the default workload (--workload) in memory. "
        "`bunshin COMMAND --help` describes each command.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("replay", help="replay a trace in the simulator and print a summary")
    _add_run_options(p)
    p.add_argument("--engine", choices=ENGINE_NAMES, default="bunshin", help="fork engine (default bunshin)")
    p.add_argument("--policy", choices=POLICIES, default="full", help="base, spec or full (default full)")
    p.add_argument("--json", metavar="FILE", help="write the whole result as JSON")
    p.add_argument("--cancel", metavar="T:N", type=parse_cancel, action="append",
                   help="cancel rollout number N of the plan at virtual second T (repeatable)")
    p.set_defaults(fn=cmd_replay)

    p = sub.add_parser("compare", help="replay under several engines and policies, side by side")
    _add_run_options(p)
    p.add_argument("--engines", default="criu,microvm,bunshin", help="comma-separated engines (default criu,microvm,bunshin)")
    p.add_argument("--policies", default="base,full", help="comma-separated policies (default base,full)")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("generate", help="write a workload trace")
    p.add_argument("workload", choices=("osworld", "webarena"))
    p.add_argument("out", help="output file (.json, or .msgpack for msgpack)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", type=int, help="number of tasks")
    p.add_argument("--group-size", type=int, help="samples per task per epoch")
    p.add_argument("--epochs", type=int, help="epochs")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("trace", help="trace utilities")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    v = tsub.add_parser("validate", help="check trace files; exit 1 if any is invalid")
    v.add_argument("files", nargs="+")
    v.set_defaults(fn=cmd_validate)
    for name in _COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub, tsub)
    return ap


# Modules that add commands: each defines ``register(sub, trace_sub)``, adding parsers to the
# top-level subcommands and to ``bunshin trace``; a parser's ``fn(args, console) -> int`` runs it.
_COMMAND_MODULES = ("_cmd_traces", "_cmd_reproduce", "_cmd_live", "_cmd_vm", "_cmd_check", "_cmd_serve")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bunshin`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    try:
        return int(args.fn(args, console))
    except BunshinError as exc:
        _say(Console(stderr=True), f"bunshin: error: {exc}")
        return 2
    except BaseExceptionGroup as group:  # a run's task groups wrap what failed inside them
        ours = [e for e in exception_leaves(group) if isinstance(e, BunshinError)]
        if not ours:
            raise
        _say(Console(stderr=True), f"bunshin: error: {type(ours[0]).__name__}: {ours[0]}")
        return 2
    except OSError as exc:  # writing an output file or folder
        where = f"{exc.filename}: " if exc.filename else ""
        _say(Console(stderr=True), f"bunshin: error: {where}{exc.strerror or exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
