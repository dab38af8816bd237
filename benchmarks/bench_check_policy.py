"""How long ``bunshin check-policy`` takes: the whole invariant suite on one policy.

For each policy named (by default every built-in of each kind, and the example user policy
``CostAwareEviction``) it runs every check with the default number of examples and prints the
wall time, the examples run (hypothesis runs more than asked when it shrinks or, for the state
machine, when a run ends early) and examples per second, with the built-in LRU eviction as the
baseline measured in the same run. Issue 8's target: under a minute per policy on this machine.

    python benchmarks/bench_check_policy.py [--examples 100] [--seed 0] [POLICY ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from rich.console import Console
from rich.table import Table

from bunshin_async import BUILTIN_POLICIES
from bunshin_async.testing import CHECKS, DEFAULT_EXAMPLES, check_policy

BASELINE = "lru"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="*", help="policies to time (default: every built-in and the example)")
    ap.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="examples per check (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = args.policies or [n for kind in BUILTIN_POLICIES for n in BUILTIN_POLICIES[kind]] + [
        "bunshin_async.testing.examples:CostAwareEviction"
    ]
    if BASELINE not in names:
        names.insert(0, BASELINE)
    console = Console(width=200)
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            t0 = time.perf_counter()
            with console.status(f"checking {name}"):
                results = check_policy(name, examples=args.examples, seed=args.seed, out_dir=out)
            wall = time.perf_counter() - t0
            rows[name] = (wall, sum(r.examples for r in results), all(r.passed for r in results),
                          {r.check: r.seconds for r in results})
    base = rows[BASELINE][0]
    t = Table(title=f"check-policy, {args.examples} examples per check, seed {args.seed} (baseline: {BASELINE})")
    for col in ("policy", "result", "wall s", "x baseline", "examples", "examples/s", *CHECKS):
        t.add_column(col, justify="left" if col in ("policy", "result") else "right")
    for name, (wall, n, ok, per) in rows.items():
        t.add_row(name, "pass" if ok else "FAIL", f"{wall:.1f}", f"{wall / base:.2f}", str(n), f"{n / wall:.0f}",
                  *(f"{per[c]:.1f}" for c in CHECKS))
    console.print(t)
    walls = [w for w, *_ in rows.values()]
    console.print(f"median {statistics.median(walls):.1f} s per policy, max {max(walls):.1f} s "
                  f"({'under' if max(walls) < 60 else 'OVER'} the one-minute target)")


if __name__ == "__main__":
    main()
