"""The live backend (engine ``restart``) on real workspaces: snapshots, forks, replay of
stateful calls, the cold tier, isolation of branches, the scheduler end to end, and recovery
after the controller is killed in the middle of a fork. Root only; nothing may leak."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

try:
    import bunshin_async._bunshin_c  # noqa: F401

    HAVE_CEXT = True
except ImportError:  # pragma: no cover
    HAVE_CEXT = False

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root"),
    pytest.mark.skipif(not HAVE_CEXT, reason="the C extension is not built"),
    pytest.mark.usefixtures("leak_check"),
]

from bunshin_async import (  # noqa: E402
    CacheableTools,
    CallContext,
    HistorySelector,
    MemoryProfile,
    RolloutKey,
    SchedulerConfig,
    Task,
    ToolCall,
    TracePolicy,
    WorkspaceReleasedError,
)
from bunshin_async._live import LiveBackend, demo_trace, live_trace  # noqa: E402
from bunshin_async._scheduler import Scheduler  # noqa: E402
from bunshin_async._spec import load_spec, spec_from_dict  # noqa: E402
from bunshin_async._trace import check_trace  # noqa: E402

TASK = Task("t", MemoryProfile(0, 0, 0.0))
CTX = CallContext(RolloutKey(0, "t", 0, 0), 0)


def spec():
    return spec_from_dict({
        "name": "live",
        "tools": {
            "sh": {"command": "{command}", "raw": ["command"], "shell": "main", "stateful": True},
            "write": {"command": "printf '%s' {text} > {path}"},
            "cat": {"command": "cat -- {path}", "cacheable": True, "timeout": 5},
        },
    })


def sh(command: str) -> ToolCall:
    return ToolCall("sh", {"command": command})


async def out(backend: LiveBackend, ws, call: ToolCall) -> bytes:
    return (await backend.execute(ws, call, CTX)).output or b""


def test_snapshot_fork_isolation_and_stateful_replay(state) -> None:
    async def main() -> None:
        async with LiveBackend(spec(), state=state) as b:
            ws = await b.create(TASK)
            await b.execute(ws, ToolCall("write", {"path": "/root/f", "text": "one"}), CTX)
            await b.execute(ws, sh("export X=42; cd /etc"), CTX)
            snap = await b.snapshot(ws)
            assert snap.frozen and not ws.frozen
            # the source goes on after the snapshot; the fork does not see what it does next
            await b.execute(ws, ToolCall("write", {"path": "/root/f", "text": "source"}), CTX)
            fork = await b.fork(snap)
            assert await out(b, fork, ToolCall("cat", {"path": "/root/f"})) == b"one"
            # the shell's state lives in a process: the fork replayed the stateful call
            assert await out(b, fork, sh("echo $X $(pwd)")) == b"42 /etc\n"
            await b.execute(fork, ToolCall("write", {"path": "/root/g", "text": "fork"}), CTX)
            assert b"No such file" in await out(b, ws, ToolCall("cat", {"path": "/root/g"}))
            sibling = await b.fork(snap)
            assert b"No such file" in await out(b, sibling, ToolCall("cat", {"path": "/root/g"}))
            assert await out(b, ws, ToolCall("cat", {"path": "/root/f"})) == b"source"
            assert b.statistics().replayed_calls == 2
            for h in (fork, sibling, snap, ws):
                await b.release(h)
            with pytest.raises(WorkspaceReleasedError):
                await b.release(ws)
            assert b.live_handles() == 0

    anyio.run(main)


def test_freeze_demote_promote_round_trip(state) -> None:
    async def main() -> None:
        async with LiveBackend(spec(), state=state) as b:
            ws = await b.create(TASK)
            await b.execute(ws, ToolCall("write", {"path": "/root/a", "text": "base"}), CTX)
            root = await b.freeze(ws)
            assert ws.released and root.frozen
            child_ws = await b.fork(root)
            await b.execute(child_ws, ToolCall("write", {"path": "/root/b", "text": "child"}), CTX)
            await b.execute(child_ws, sh("rm /root/a"), CTX)  # a whiteout over the parent's file
            child = await b.freeze(child_ws)
            cold = await b.demote(child, root)
            assert child.released and cold.stored_bytes > 0
            back = await b.promote(cold, root)
            w = await b.fork(back)
            assert await out(b, w, ToolCall("cat", {"path": "/root/b"})) == b"child"
            assert b"No such file" in await out(b, w, ToolCall("cat", {"path": "/root/a"}))
            mem = b.workspace_memory(w)
            assert mem.private_bytes > 0
            assert b.working_set() > 0
            for h in (w, back, cold, root):
                await b.release(h)
            assert b.live_handles() == 0

    anyio.run(main)


def test_deep_snapshot_chains_are_flattened(state) -> None:
    async def main() -> None:
        async with LiveBackend(spec(), state=state, flatten_depth=3) as b:
            ws = await b.create(TASK)
            for i in range(6):
                await b.execute(ws, ToolCall("write", {"path": f"/root/{i}", "text": str(i)}), CTX)
                ws = await b.fork(await b.freeze(ws)) if i % 2 else ws
                snap = await b.freeze(ws)
                ws = await b.fork(snap)
                await b.release(snap)
            assert b.statistics().flattens >= 1
            got = await out(b, ws, sh("cat /root/0 /root/1 /root/2 /root/3 /root/4 /root/5"))
            assert got == b"012345"
            await b.release(ws)

    anyio.run(main)


@pytest.fixture
def request_cleanup():
    paths: list[Path] = []
    yield paths
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def test_scheduler_end_to_end_is_transparent(state, tmp_path, request_cleanup) -> None:
    # the same trace replayed without and with caching: every sample is shown the same
    # observations (cacheable tools are deterministic here), and nothing is left behind
    sp = load_spec(os.path.join(os.path.dirname(__file__), "..", "examples", "workspace.toml"))
    # the opening calls read a directory only this test writes (the host's /etc may change
    # between the two runs, under a package manager, and so would `ls -la /etc`)
    probe = tmp_path.parent / f"bunshin-probe-{os.getpid()}"
    if str(probe).startswith(("/tmp", "/var/tmp", "/run")):  # emptied inside workspaces
        probe = Path("/root") / f".bunshin-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    request_cleanup.append(probe)
    (probe / "release").write_text("NAME=probe\nID=probe\n")
    trace = demo_trace(sp, tasks=2, group_size=2, epochs=2, think=0.01, probe_dir=str(probe),
                       probe_file=str(probe / "release"))
    seen = {}
    for policy in ("base", "full"):
        async def main(policy=policy):
            async with LiveBackend(sp, state=state) as b:
                config = SchedulerConfig.preset(policy)
                sched = Scheduler(
                    b, TracePolicy(trace, check=False), config,
                    selector=HistorySelector() if config.speculation else None,
                    cacheable=CacheableTools(n for n, t in sp.tools.items() if t.cacheable),
                )
                result = await sched.run()
                return result, live_trace(trace, result, b), b.live_handles()

        result, recorded, handles = anyio.run(main)
        assert handles == 0
        assert all(r.status == "done" for r in result.rollouts)
        seen[policy] = {r.key: r.observations for r in result.rollouts}
        assert check_trace(recorded) == []
        if policy == "full":
            assert sum(r.cache_hits for r in result.rollouts) > 0
            assert result.tree is not None and result.tree.hits > 0
        # the python step printed the sum it was given
        for r in recorded.rollouts:
            code = next(s for s in trace.rollouts if s.key == r.key).steps[-4].call.arguments["content"]
            n = int(code.split("range(")[1].split(")")[0])
            assert any(s.observation_size == len(f"{sum(range(n))}\n") for s in r.steps)
    assert seen["base"] == seen["full"]


def test_bunshin_run_records_a_live_trace_the_simulator_replays(state, tmp_path, capsys) -> None:
    from bunshin_async._cli import main
    from bunshin_async._trace import load_trace

    out = tmp_path / "live.json"
    rc = main(["run", "--state-dir", state.path, "--think-scale", "0.05", "--out", str(out), "--policy", "full"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "12 (12 done)" in text and "cache hit rate" in text
    recorded = load_trace(out)
    assert len(recorded.rollouts) == 12
    assert all(s.exec_time > 0 and not s.modelled for r in recorded.rollouts for s in r.steps)
    assert main(["replay", str(out), "--engine", "bunshin", "--policy", "base"]) == 0


def test_bunshin_run_rejects_undeclared_tools(state, tmp_path, capsys) -> None:
    from bunshin_async._cli import main
    from bunshin_async._trace import dump_trace
    from sim import generate, workload_params

    path = tmp_path / "osworld.json"
    dump_trace(generate(workload_params("osworld", tasks=1, group_size=1, epochs=1), seed=0), path)
    assert main(["run", "--state-dir", state.path, os.path.join(os.path.dirname(__file__), "..", "examples",
                 "workspace.toml"), str(path)]) == 2
    err = capsys.readouterr().err
    assert "does not declare" in err and "click" in err


CONTROLLER = textwrap.dedent("""
    import os, sys, anyio
    from bunshin_async._live import LiveBackend
    from bunshin_async._spec import spec_from_dict
    from bunshin_async._state import StateDir
    from bunshin_async import Task, MemoryProfile, ToolCall, CallContext, RolloutKey

    spec = spec_from_dict({"name": "k", "tools": {"sh": {"command": "{command}", "raw": ["command"],
                           "shell": "main", "stateful": True}}})
    task = Task("t", MemoryProfile(0, 0, 0.0))
    ctx = CallContext(RolloutKey(0, "t", 0, 0), 0)

    async def main():
        b = LiveBackend(spec, state=StateDir(sys.argv[1]))
        ws = await b.create(task)
        await b.execute(ws, ToolCall("sh", {"command": "export A=1; sleep 2"}), ctx)
        snap = await b.snapshot(ws)
        # fork, replaying the slow stateful call: killed in the middle of it
        await b.execute(ws, ToolCall("sh", {"command": "true"}), ctx)
        print("forking", flush=True)
        await b.fork(snap)

    anyio.run(main)
""")


def test_gc_after_sigkill_in_the_middle_of_a_fork(state) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, state.path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "forking\n"
    time.sleep(0.5)  # into the fork: the new workspace is replaying the 2-second call
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    proc.stdout.close()
    from bunshin_async._state import gc

    report = gc(state)
    assert not report.errors
    assert report.records >= 2  # the workspaces and the run's layer directory
    assert state.list() == []


def test_memory_a_call_adds_and_the_task_profile(state) -> None:
    # bytes dirtied: how much the workspace's own pages grew; the task profile: the size its
    # workspaces reached (the simulator's workspaces have a fixed size)
    grow = 4 << 20

    async def main() -> None:
        async with LiveBackend(spec(), state=state) as b:
            assert b.task_profile(TASK.id) is None
            ws = await b.create(TASK)
            boot = b.task_profile(TASK.id)
            assert boot is not None and 0 < boot.runtime_bytes < 16 << 20 and boot.image_bytes == 0
            await b.execute(ws, sh("true"), CTX)  # the shell session starts
            res = await b.execute(ws, sh(f"X=$(head -c {grow} /dev/zero | tr '\\0' a); echo ${{#X}}"), CTX)
            assert res.output == f"{grow}\n".encode()
            assert res.dirtied_bytes >= grow  # the variable lives on in the session's bash
            small = await b.execute(ws, ToolCall("cat", {"path": "/etc/hostname"}), CTX)
            assert small.dirtied_bytes < grow // 4
            own = b.workspace_memory(ws).private_bytes
            assert own >= boot.runtime_bytes + grow
            other = await b.create(TASK)
            for h in (ws, other):
                await b.release(h)
            # the median of the two booted workspaces: one grown, one as booted
            prof = b.task_profile(TASK.id)
            assert prof is not None and prof.boot_time == boot.boot_time
            assert boot.runtime_bytes + grow // 2 <= prof.runtime_bytes <= own

    anyio.run(main)
