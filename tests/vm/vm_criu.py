"""The live backend's ``criu`` engine, checked inside the lab VM (issue 5).

A :class:`bunshin_async.LiveBackend` with ``engine="criu"`` snapshots a workspace with a CRIU
dump (``--leave-running``) to a tmpfs and forks by restoring that image into a new container.
The workspace's shell session holds state (an exported variable, its working directory, a
background ``sleep`` and a background Python process holding 48 MiB of random bytes); forks
must see the same processes (same pids, in a pid namespace of their own), variables and files,
and the same memory (a CRC the Python process computes on a signal), be isolated from the
source both ways, hold a private copy of the memory (the baseline's cost), and leave nothing
behind: no cgroup, record, mount, image, CRIU temporary directory or process.

The package is imported from the checkout as in ``vm_engine.py``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from vm_engine import (  # noqa: F401 (fixtures)
    DATA, MIB, PYTHON, STATE, _leftovers, _prepare, _rollup, _sh, ba, run, scheduler_run, spec,
)

pytestmark = pytest.mark.skipif(os.environ.get("BUNSHIN_VM") != "1" or os.geteuid() != 0,
                                reason="runs only as root inside the lab VM (bunshin vm run)")
# the VM runs the host's programs: Debian's criu must be installed there (.ci/run installs it)
needs_criu = pytest.mark.skipif(shutil.which("criu") is None,
                                reason="Debian's criu is not installed on the host (apt-get install criu)")

# 48 MiB of random bytes; on SIGUSR1 their CRC goes to /root/w/hog.crc (written, then renamed)
HOG = ("import os, signal, time, zlib\n"
       "b = bytearray(os.urandom(48 << 20))\n"
       "def crc(*_):\n"
       "    open('/root/w/hog.crc.tmp', 'w').write(f'{zlib.crc32(b):08x}')\n"
       "    os.rename('/root/w/hog.crc.tmp', '/root/w/hog.crc')\n"
       "signal.signal(signal.SIGUSR1, crc)\n"
       "open('/root/w/hog.ready', 'w').close()\n"
       "while True: time.sleep(3600)\n")

# what must be the same in a fork: the session's variable and directory, its shell's pid and
# parent, and the pids and command lines of the agent and the background processes
STATE_CMD = ("echo $FOO $(pwd) $$ $PPID; cat /root/w/file; "
             "for p in 1 $(cat /root/w/bg.pid) $(cat /root/w/hog.pid); do "
             "echo $p $(tr '\\0' ' ' < /proc/$p/cmdline | cut -c1-60); done")
CRC_CMD = ("rm -f /root/w/hog.crc; kill -USR1 $(cat /root/w/hog.pid); "
           "for i in $(seq 600); do [ -e /root/w/hog.crc ] && break; sleep 0.1; done; cat /root/w/hog.crc")


def _criu_leftovers() -> list[str]:
    out = _leftovers()
    for d in (Path(STATE, "criu"), Path("/dev/shm/criu")):
        if d.exists():
            out.append(f"image directory {d}: {sorted(os.listdir(d))}")
    out += [f"criu temporary {p}" for p in ("/tmp", "/run") for n in os.listdir(p) if n.startswith((".criu", "crtools"))]
    return out


@needs_criu
def test_criu_fork_keeps_state_isolates_and_copies(ba, spec):  # noqa: F811 (fixtures)
    async def main():
        async with ba._live.LiveBackend(spec, engine="criu") as b:
            ws = await _prepare(ba, b, hog=HOG)
            src = b._live[ws.id].container
            want = await _sh(ba, b, ws, STATE_CMD)
            crc = (await _sh(ba, b, ws, CRC_CMD)).strip()
            assert want.split()[:2] == ["bar", "/root"] and len(crc) == 8, (want, crc)
            t0 = time.perf_counter()
            fork = await b.fork(ws)
            took = time.perf_counter() - t0
            clone = b._live[fork.id].container
            # a private copy: right after the fork the clone's memory is its own
            rss, pss = _rollup(clone.pids())
            assert rss > 48 * MIB and pss > 0.8 * rss, (rss, pss)
            assert len(clone.pids()) == len(src.pids()) and clone.init_pid != src.init_pid
            assert os.readlink(f"/proc/{clone.init_pid}/ns/pid") != os.readlink(f"/proc/{src.init_pid}/ns/pid")
            assert os.readlink(f"/proc/{clone.init_pid}/ns/mnt") != os.readlink(f"/proc/{src.init_pid}/ns/mnt")
            assert Path(f"/proc/{clone.init_pid}/cgroup").read_text().strip().endswith(Path(clone.cgroups.v2).name)
            # the same processes (pids, command lines), session state, files and memory
            assert await _sh(ba, b, fork, STATE_CMD) == want
            assert (await _sh(ba, b, fork, CRC_CMD)).strip() == crc
            # isolated both ways
            await _sh(ba, b, fork, "echo x > /root/w/clonefile; export FOO=clone; kill $(cat /root/w/bg.pid)")
            await _sh(ba, b, ws, "echo y > /root/w/srcfile; export FOO=src")
            assert (await _sh(ba, b, ws, "echo $FOO; ls /root/w; kill -0 $(cat /root/w/bg.pid) && echo bg")).split() == \
                ["src", "bg.pid", "file", "hog.crc", "hog.pid", "hog.ready", "srcfile", "bg"]
            assert (await _sh(ba, b, fork, "echo $FOO; ls /root/w; kill -0 $(cat /root/w/bg.pid) 2>/dev/null || "
                                           "echo bg-gone")).split() == \
                ["clone", "bg.pid", "clonefile", "file", "hog.crc", "hog.pid", "hog.ready", "bg-gone"]
            # a snapshot forked twice (isolated from each other), a fork of a fork (a restored
            # workspace checkpointed again), a workspace frozen as its snapshot
            snap = await b.snapshot(ws)
            assert b.snapshot_charge(ws, 4096) > 48 * MIB  # the image holds every anonymous page
            f1, f2 = await b.fork(snap), await b.fork(snap)
            for f in (f1, f2):
                assert (await _sh(ba, b, f, "echo $FOO; cat /root/w/srcfile")).split() == ["src", "y"]
            await _sh(ba, b, f1, "echo one > /root/w/srcfile")
            assert (await _sh(ba, b, f2, "cat /root/w/srcfile")).split() == ["y"]
            f3 = await b.fork(fork)
            assert (await _sh(ba, b, f3, "echo $FOO; cat /root/w/clonefile")).split() == ["clone", "x"]
            assert (await _sh(ba, b, f3, CRC_CMD)).strip() == crc
            frozen = await b.freeze(f1)
            f4 = await b.fork(frozen)
            assert (await _sh(ba, b, f4, "cat /root/w/srcfile; echo $FOO")).split() == ["one", "src"]
            stats = b.statistics()
            assert stats.tree_forks == stats.forks == 5 and stats.snapshots == 4, stats
            images = list(Path(STATE, "criu").glob("*/image.*"))
            assert len(images) == 2  # snap's and frozen's; the others went with their forks
            print(f"\ncriu engine: fork of a live workspace {took * 1e3:.0f} ms; clone Rss {rss / MIB:.1f} MiB "
                  f"Pss {pss / MIB:.1f} MiB; frozen {stats.frozen_seconds * 1e3:.0f} ms in all, "
                  f"longest {stats.max_frozen_seconds * 1e3:.0f} ms")
            for h in (fork, snap, f2, f3, frozen, f4, ws):
                await b.release(h)
            assert b.live_handles() == 0
            assert list(Path(STATE, "criu").glob("*/*")) == []
    run(main)
    assert _criu_leftovers() == []


@needs_criu
def test_criu_dump_refused_cleanly(ba, spec):  # noqa: F811 (fixtures)
    """A connected TCP socket (CRIU dumps one only with --tcp-established): snapshot and fork
    raise BackendError naming CRIU's error, nothing is left, the source runs on; once that
    process is gone the workspace forks."""
    code = ("import socket, time; l = socket.create_server(('127.0.0.1', 0)); "
            "c = socket.create_connection(l.getsockname()); s, _ = l.accept(); "
            "open('/root/w/tcp.ready', 'w').close(); time.sleep(3600)")

    async def main():
        async with ba._live.LiveBackend(spec, engine="criu") as b:
            ws = await b.create(ba.Task("t", ba.MemoryProfile(0, 0, 0.0), "criu engine test"))
            await _sh(ba, b, ws, f"mkdir -p /root/w; {PYTHON} -c {shlex.quote(code)} & echo $! > /root/w/tcp.pid; "
                                 "for i in $(seq 600); do [ -e /root/w/tcp.ready ] && break; sleep 0.1; done")
            with pytest.raises(ba.BackendError, match="criu dump failed.*TCP"):
                await b.snapshot(ws)
            with pytest.raises(ba.BackendError, match="criu dump failed"):
                await b.fork(ws)
            assert b.live_handles() == 1
            assert len([d for d in Path("/sys/fs/cgroup/bunshin").iterdir() if d.is_dir()]) == 1
            assert list(Path(STATE, "criu").glob("*/*")) == []
            assert not b._live[ws.id].container.frozen
            # the source goes on
            assert (await _sh(ba, b, ws, "kill $(cat /root/w/tcp.pid); sleep 0.5; echo fine")).strip() == "fine"
            fork = await b.fork(ws)
            assert (await _sh(ba, b, fork, "echo ok")).strip() == "ok"
            await b.release(fork)
            await b.release(ws)
    run(main)
    assert _criu_leftovers() == []


def test_criu_engine_says_what_is_missing(ba, spec, monkeypatch):  # noqa: F811 (fixtures)
    import bunshin_async._criu as criu_mod

    monkeypatch.setattr(criu_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(criu_mod.os, "access", lambda path, mode: False)
    with pytest.raises(ba.ConfigError, match="needs criu: apt-get install"):
        ba._live.LiveBackend(spec, engine="criu")
    monkeypatch.undo()

    def failing_check(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", "Error (criu/cr-check.c:1): vdso: not supported\n")

    monkeypatch.setattr(criu_mod.subprocess, "run", failing_check)
    with pytest.raises(ba.ConfigError, match=r"`criu check` fails on this kernel .*vdso: not supported"):
        ba._live.LiveBackend(spec, engine="criu")
    assert DATA not in Path("/proc/self/mountinfo").read_text()


@needs_criu
def test_scheduler_replay_on_the_criu_engine(ba):  # noqa: F811 (the fixture)
    """The scheduler (prefix caching and speculation) replays the demo trace with its snapshots
    checkpointed and its forks restored by CRIU: every rollout finishes and nothing is left."""
    trace, result, stats = scheduler_run(ba, "criu")
    bad = [(r.status, r.error) for r in result.rollouts if r.status != "done"]
    assert bad == [] and len(result.rollouts) == len(trace.rollouts), bad
    assert stats.tree_forks >= 1 and stats.forks >= 1 and stats.snapshots >= 1
    print(f"\nscheduler on the criu engine: {stats.forks} forks, {stats.tree_forks} restores, "
          f"{stats.snapshots} checkpoints, {stats.executions} calls; frozen {stats.frozen_seconds * 1e3:.0f} ms "
          f"in all (longest {stats.max_frozen_seconds * 1e3:.0f} ms)")
    assert _criu_leftovers() == []
