"""`bunshin trace stats`: shared prefixes, prefix-cache skips and first-call agreement."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from bunshin_async import (
    MemoryProfile,
    Rollout,
    Step,
    Task,
    ToolCall,
    Trace,
    dump_trace,
    observation_digest,
    trace_stats,
)
from bunshin_async._cli import main

MEM = MemoryProfile(image_bytes=0, runtime_bytes=0, boot_time=0.0)


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name, args)


A, B, C, D, N = call("a"), call("b"), call("c"), call("d"), call("clock")


def st(c: ToolCall) -> Step:
    return Step(think_time=1.0, call=c, exec_time=1.0, observation_digest=observation_digest(c.name),
                observation_size=1, dirtied_bytes=0, cacheable=c.name != "clock")


def ro(task: str, sample: int, calls: list[ToolCall], epoch: int = 0) -> Rollout:
    return Rollout(epoch=epoch, task=task, group=0, sample=sample, reward=0.0, steps=[st(c) for c in calls])


def trace() -> Trace:
    return Trace(version=1, name="s", tasks=[Task(id="t", memory=MEM), Task(id="u", memory=MEM)], rollouts=[
        ro("t", 0, [A, B, C]),
        ro("t", 1, [A, B, D]),
        ro("t", 2, [B, A]),
        ro("u", 0, [N, A]),
        ro("u", 1, [N, A]),
    ])


def test_per_task_figures() -> None:
    st_ = trace_stats(trace())
    t, u = st_.tasks
    assert (t.task, t.groups, t.rollouts, t.steps, t.pairs) == ("t", 1, 3, 8, 3)
    # pairs: (0,1) share A B, (0,2) and (1,2) nothing
    assert t.shared_prefix == pytest.approx(2 / 3)
    assert t.shared_prefix_share == pytest.approx((2 / 3) / 3)
    # replay in trace order: sample 1 skips A and B; sample 2 misses at once
    assert t.cache_skip_share == pytest.approx(2 / 8)
    assert t.first_call_agreement == pytest.approx(1 / 3)
    # u: identical, but the first call is not cacheable, so a cache skips nothing
    assert u.shared_prefix == 2 and u.first_call_agreement == 1.0
    assert u.cache_skip_share == 0.0
    o = st_.overall
    assert (o.rollouts, o.steps, o.pairs) == (5, 12, 4)
    assert o.cache_skip_share == pytest.approx(2 / 12)
    assert o.first_call_agreement == pytest.approx(2 / 4)


def test_cache_persists_across_epochs() -> None:
    tr = Trace(version=1, name="e", tasks=[Task(id="t", memory=MEM)],
               rollouts=[ro("t", 0, [A, B], epoch=0), ro("t", 0, [A, C], epoch=1)])
    st_ = trace_stats(tr)
    assert st_.tasks[0].groups == 2 and st_.tasks[0].pairs == 0
    assert st_.tasks[0].cache_skip_share == pytest.approx(1 / 4)


def test_cli_stats_and_plot(tmp_path: pathlib.Path, capsys) -> None:
    path = tmp_path / "s.json"
    dump_trace(trace(), path)
    assert main(["trace", "stats", str(path), "--plot", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert "shared prefix" in out and "(all)" in out
    png = tmp_path / "figs" / "share.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_stats_bad_file(tmp_path: pathlib.Path, capsys) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1, "name": "x", "tasks": [')
    assert main(["trace", "stats", str(path)]) == 2
    assert "truncated" in capsys.readouterr().err
