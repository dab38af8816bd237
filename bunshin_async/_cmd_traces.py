"""Commands on recorded agent trajectories.

``bunshin trace import FORMAT SRC... OUT``  import public trajectories into a trace;
``bunshin trace stats TRACE [--plot DIR]``  how much the samples of each group share;
``bunshin predict eval TRACE``              score Spec Tool Selectors, leave-one-trial-out.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from ._cli import _say
from ._exceptions import BunshinError, TraceError
from ._importers import IMPORT_FORMATS, ImportModel, import_trace
from ._selector import (
    BlendSelector,
    FrequencySelector,
    HistorySelector,
    NameBigramSelector,
    SpecToolSelector,
)
from ._stats import SelectorScore, TraceStats, evaluate_selectors, trace_stats
from ._trace import Trace, dump_trace, load_trace

__all__ = ["default_factories", "plot_stats", "register"]


def _observe_all(sel: SpecToolSelector, trace: Trace) -> SpecToolSelector:
    for r in trace.rollouts:
        sel.observe(r.task, [s.call for s in r.steps], observations=[s.observation_digest for s in r.steps])
    return sel


def default_factories() -> dict[str, Any]:
    """The predictors ``bunshin predict eval`` compares: the two baselines, the history
    selector and the blend, each a function from a training trace to a fitted predictor."""
    return {
        "most-frequent-call": lambda tr: _observe_all(FrequencySelector(), tr),
        "name-bigram": lambda tr: _observe_all(NameBigramSelector(), tr),
        "history": lambda tr: HistorySelector().fit(tr),
        "blend": lambda tr: BlendSelector().fit(tr),
    }


# -- trace import ------------------------------------------------------------------------------


def cmd_import(args: argparse.Namespace, console: Console) -> int:
    over: dict[str, Any] = {}
    for name in ("tokens_per_second", "default_exec_time"):
        v = getattr(args, name)
        if v is not None:
            over[name] = v
    if args.non_cacheable:
        over["non_cacheable"] = tuple(x for x in args.non_cacheable.split(",") if x)
    model = ImportModel(**over)
    trace = import_trace(args.format, args.src, model=model, name=args.name)
    dump_trace(trace, args.out)
    steps = sum(len(r.steps) for r in trace.rollouts)
    _say(console, f"wrote {args.out}: {len(trace.tasks)} tasks, {len(trace.rollouts)} rollouts, {steps} steps "
                  f"(imported from {args.format})")
    return 0


# -- trace stats -------------------------------------------------------------------------------


def _stats_table(trace: Trace, st: TraceStats) -> Table:
    t = Table(title=f"{trace.name}: what the samples of a group share")
    t.add_column("task", no_wrap=True)
    for c in ("groups", "rollouts", "mean steps", "shared prefix", "prefix share", "cache skip",
              "first call agree", "first name agree"):
        t.add_column(c, justify="right")
    rows = [*st.tasks, st.overall]
    for i, g in enumerate(rows):
        t.add_row(
            g.task, str(g.groups), str(g.rollouts), f"{g.mean_steps:.1f}", f"{g.shared_prefix:.2f}",
            f"{g.shared_prefix_share:.0%}", f"{g.cache_skip_share:.0%}", f"{g.first_call_agreement:.0%}",
            f"{g.first_name_agreement:.0%}", end_section=(i == len(rows) - 2),
        )
    return t


def plot_stats(st: TraceStats, outdir: str, title: str) -> str:
    """Write ``share.png`` (per task: shared-prefix share, cache-skip share, first-call
    agreement) into *outdir* and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    rows = [*st.tasks, st.overall]
    labels = [g.task for g in rows]
    series = (
        ("shared prefix (share of length)", [g.shared_prefix_share for g in rows]),
        ("steps a prefix cache skips", [g.cache_skip_share for g in rows]),
        ("first-call agreement", [g.first_call_agreement for g in rows]),
    )
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 3), 4), dpi=120)
    width = 0.8 / len(series)
    for j, (name, ys) in enumerate(series):
        ax.bar([i + (j - 1) * width for i in range(len(rows))], ys, width, label=name)
    ax.set_xticks(range(len(rows)), labels, rotation=45 if len(rows) > 12 else 0)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    ax.set_xlabel("task")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(outdir, "share.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def cmd_stats(args: argparse.Namespace, console: Console) -> int:
    trace = load_trace(args.trace)
    if not trace.rollouts:
        raise TraceError(f"{args.trace}: the trace has no rollouts")
    st = trace_stats(trace)
    console.print(_stats_table(trace, st))
    if args.plot:
        _say(console, f"wrote {plot_stats(st, args.plot, trace.name)}")
    return 0


# -- predict eval ------------------------------------------------------------------------------


def _eval_table(trace: Trace, scores: list[SelectorScore]) -> Table:
    t = Table(title=f"{trace.name}: next-call prediction, leave-one-trial-out ({scores[0].calls} calls)")
    t.add_column("predictor", no_wrap=True)
    for c in ("name top-1", "name top-3", "call top-1", "call top-3", "mean conf", "ECE", "p50 µs", "p99 µs"):
        t.add_column(c, justify="right")
    for s in scores:
        t.add_row(s.name, f"{s.top1_name:.1%}", f"{s.top3_name:.1%}", f"{s.top1_call:.1%}", f"{s.top3_call:.1%}",
                  f"{s.mean_confidence:.2f}", f"{s.ece:.3f}", f"{s.latency_p50_us:,.0f}", f"{s.latency_p99_us:,.0f}")
    steps = [s for r in trace.rollouts for s in r.steps]
    heard = sum(bool(s.context) for s in steps)
    t.caption = (f"conversation context on {heard} of {len(steps)} steps" if heard
                 else "no conversation context in this trace (selectors predict from calls and observations)")
    return t


def _reliability_table(score: SelectorScore) -> Table:
    t = Table(title=f"{score.name}: reliability of the top prediction's confidence")
    for c in ("confidence bin", "predictions", "mean confidence", "exactly right"):
        t.add_column(c, justify="right")
    for b in score.reliability:
        t.add_row(f"{b.low:.1f}-{b.high:.1f}", str(b.count), f"{b.confidence:.2f}", f"{b.accuracy:.2f}")
    return t


def cmd_eval(args: argparse.Namespace, console: Console) -> int:
    trace = load_trace(args.trace)
    if len(trace.rollouts) < 2:
        raise TraceError(f"{args.trace}: leave-one-trial-out needs at least two rollouts")
    factories = default_factories()
    if args.predictors:
        names = [x for x in args.predictors.split(",") if x]
        unknown = [n for n in names if n not in factories]
        if unknown:
            raise BunshinError(f"unknown predictor {unknown[0]!r} in --predictors; expected some of {', '.join(factories)}")
        factories = {n: factories[n] for n in names}
    with console.status("evaluating (leave one trial out)"):
        scores = evaluate_selectors(trace, factories)
    console.print(_eval_table(trace, scores))
    for s in scores:
        if s.name == "blend" or args.reliability:
            console.print(_reliability_table(s))
    return 0


def register(sub: Any, trace_sub: Any) -> None:
    """Add ``trace import``, ``trace stats`` and ``predict eval`` to the ``bunshin`` parser."""
    p = trace_sub.add_parser("import", help="import public agent trajectories into a trace")
    p.add_argument("format", choices=IMPORT_FORMATS, help="openai (tau-bench layout), swe-agent (.traj) or asciinema (.cast v2)")
    p.add_argument("src", nargs="+", help="input file(s) or directories (openai: one JSON file)")
    p.add_argument("out", help="output trace (.json, or .msgpack for msgpack)")
    p.add_argument("--name", help="trace name (default: from the input)")
    p.add_argument("--tokens-per-second", type=float, help="model decode speed for modelled think times (default 50)")
    p.add_argument("--default-exec-time", type=float, help="seconds a tool runs where not recorded (default 1.0)")
    p.add_argument("--non-cacheable", metavar="TOOLS", help="comma-separated tools to mark non-cacheable")
    p.set_defaults(fn=cmd_import)

    p = trace_sub.add_parser("stats", help="how much the samples of each group share")
    p.add_argument("trace")
    p.add_argument("--plot", metavar="DIR", help="write share.png to DIR")
    p.set_defaults(fn=cmd_stats)

    p = sub.add_parser("predict", help="Spec Tool Selector utilities")
    psub = p.add_subparsers(dest="predict_command", required=True, metavar="SUBCOMMAND")
    e = psub.add_parser("eval", help="score next-call predictors with leave-one-trial-out")
    e.add_argument("trace")
    e.add_argument("--predictors", help="comma-separated subset of most-frequent-call,name-bigram,history,blend")
    e.add_argument("--reliability", action="store_true", help="print every predictor's reliability bins")
    e.set_defaults(fn=cmd_eval)
