"""Figures of runs: the working set over time and the rollouts still running over time.

The two kinds of figure the seed shows; matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._scheduler import RunResult

__all__ = ["plot_runs"]

GiB = 1 << 30


def _steps(points: list[tuple[float, int]], scale: float) -> tuple[list[float], list[float]]:
    xs = [t / 60 for t, _ in points]
    ys = [v / scale for _, v in points]
    return xs, ys


def plot_runs(results: Mapping[str, RunResult], outdir: str, title: str) -> list[str]:
    """Write ``working_set.png`` and ``running.png`` for *results* (label -> run) into
    *outdir* (created if missing) and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    paths = []
    for name, series, scale, ylabel in (
        ("working_set.png", "memory_timeline", GiB, "working set (GiB)"),
        ("running.png", "running_timeline", 1, "rollouts still running"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
        for label, r in results.items():
            pts = getattr(r, series)
            if pts:
                pts = list(pts) + [(r.makespan, pts[-1][1])]
            xs, ys = _steps(pts, scale)
            ax.step(xs, ys, where="post", label=label, linewidth=1.2)
        ax.set_xlabel("time (minutes)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(outdir, name)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
