"""How fast the simulator runs.

Prints, for one OSWorld-scale epoch (32 tasks x 8 samples = 256 rollouts, engine bunshin):
the wall time with all three techniques on (policy ``full``: sharing, speculation, prefix
caching) next to the same epoch with caching and speculation off (policy ``base``), measured
alternately in the same run, as medians over repeats; and simulated tool steps per wall
second. Target: the ``full`` epoch under 1 s on a 2-core machine.

    python benchmarks/bench_sim.py [--repeats 7] [--epochs 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from sim import generate, simulate, workload_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--engine", default="bunshin")
    args = ap.parse_args()
    console = Console()

    trace = generate(workload_params("osworld", epochs=args.epochs), seed=0)
    steps = sum(len(r.steps) for r in trace.rollouts)
    rollouts = len(trace.rollouts)
    walls: dict[str, list[float]] = {"full": [], "base": []}
    results = {}
    simulate(trace, engine=args.engine, policy="full")  # warm imports and caches
    for _ in range(args.repeats):
        for policy in ("full", "base"):  # alternate, so drift affects both alike
            t0 = time.perf_counter()
            results[policy] = simulate(trace, engine=args.engine, policy=policy)
            walls[policy].append(time.perf_counter() - t0)

    t = Table(title=f"simulator speed: osworld, {rollouts} rollouts, {steps} tool steps, "
                    f"engine {args.engine}, median of {args.repeats}")
    for c in ("policy", "wall s (median)", "min", "max", "tool steps / wall s", "simulated epoch (min)", "peak GiB"):
        t.add_column(c, justify="right")
    for policy in ("full", "base"):
        w = walls[policy]
        r = results[policy]
        t.add_row(
            policy,
            f"{statistics.median(w):.3f}",
            f"{min(w):.3f}",
            f"{max(w):.3f}",
            f"{steps / statistics.median(w):,.0f}",
            " ".join(f"{v / 60:.1f}" for v in r.epoch_times.values()),
            f"{r.memory.peak_bytes / 2**30:.1f}",
        )
    console.print(t)
    full, base = statistics.median(walls["full"]), statistics.median(walls["base"])
    console.print(f"full / base wall-time ratio: {full / base:.2f}")
    verdict = "meets" if full < 1.0 else "misses"
    console.print(f"target: one epoch with all three techniques under 1 s: {full:.3f} s, {verdict} it")


if __name__ == "__main__":
    main()
