"""In-guest part of bench_engines_vm.py: the live backend's ``bunshin`` engine against its
baselines ``criu`` (checkpoint and restore) and ``restart`` (boot and replay).

Runs only inside the lab VM, as root, with the module loaded (``bunshin vm run --load-module``).
For each engine: a workspace whose shell session exports a variable and starts a background
``sleep`` and a background Python process holding 48 MiB; then ``--repeats`` forks of the live
workspace (``LiveBackend.fork``), each released after its memory was read. Prints the fork
latency (median, min, max), the source's frozen time per fork (bunshin: freeze, upper copy,
holder mounts, tree fork, thaw; criu: freeze, upper copy, the dump; restart: the upper copy)
and the clone's Rss and Pss right after the fork, and bunshin's ratios to each baseline.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vm"))
from checkout import import_checkout  # noqa: E402 (the in-VM import of the checkout, shared with the tests)

MIB = 1 << 20
SPEC = """
name = "bench"
root = "host"
cwd = "/root"
[limits]
memory = "1GiB"
[tools.shell]
command = "{command}"
raw = ["command"]
shell = "main"
stateful = true
timeout = 300
"""
HOG = ("import time; b = bytearray(48 << 20)\n"
       "for i in range(0, len(b), 4096): b[i] = 1\n"
       "open('/root/w/hog.ready', 'w').close()\n"
       "while True: time.sleep(3600)\n")


def rollup(pids) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            k, _, v = line.partition(":")
            if k == "Rss":
                rss += int(v.split()[0]) * 1024
            elif k == "Pss":
                pss += int(v.split()[0]) * 1024
    return rss, pss


async def bench(ba, spec, engine: str, repeats: int) -> dict:
    ctx = ba.CallContext(ba.RolloutKey(0, "t", 0, 0), 0)
    out: dict = {"fork": [], "frozen": [], "ioctl": [], "rss": [], "pss": []}
    async with ba._live.LiveBackend(spec, engine=engine) as b:
        ws = await b.create(ba.Task("t", ba.MemoryProfile(0, 0, 0.0), "bench"))
        # the replay of a restart fork must wait for a new hog too: the marker goes first
        cmd = (f"export FOO=bar; mkdir -p /root/w; rm -f /root/w/hog.ready; sleep 1000 & {sys.executable} -c {shlex.quote(HOG)} & "
               "for i in $(seq 600); do [ -e /root/w/hog.ready ] && break; sleep 0.1; done")
        await b.execute(ws, ba.ToolCall("shell", {"command": cmd}), ctx)
        for _ in range(repeats):
            before = b.statistics()
            t0 = time.perf_counter()
            f = await b.fork(ws)
            out["fork"].append(time.perf_counter() - t0)
            after = b.statistics()
            out["frozen"].append(after.frozen_seconds - before.frozen_seconds)
            out["ioctl"].append(after.tree_fork_seconds - before.tree_fork_seconds)
            rss, pss = rollup(b._live[f.id].container.pids())
            out["rss"].append(rss)
            out["pss"].append(pss)
            res = await b.execute(f, ba.ToolCall("shell", {"command": "echo $FOO"}), ctx)
            assert res.output.strip() == b"bar", res.output
            await b.release(f)
        await b.release(ws)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default="bunshin,criu,restart")
    a = ap.parse_args()
    os.environ.setdefault("BUNSHIN_STATE_DIR", "/run/bunshin-bench")
    os.environ.setdefault("BUNSHIN_DATA_DIR", "/tmp/bunshin-bench")
    ba = import_checkout()
    import anyio

    p = Path(tempfile.mkdtemp()) / "bench.toml"
    p.write_text(SPEC)
    spec = ba.load_spec(str(p))
    res = {e: anyio.run(bench, ba, spec, e, a.repeats) for e in a.engines.split(",")}
    med = {e: {k: statistics.median(v) for k, v in r.items()} for e, r in res.items()}
    print(f"{'engine':8} {'fork ms (med/min/max)':>24} {'frozen ms (med/min)':>20} {'ioctl ms':>9} "
          f"{'clone Rss MiB':>14} {'Pss MiB':>8}")
    for e, r in res.items():
        f = [x * 1e3 for x in r["fork"]]
        ioctl = f"{med[e]['ioctl'] * 1e3:9.0f}" if e == "bunshin" else f"{'-':>9}"
        print(f"{e:8} {med[e]['fork'] * 1e3:8.0f} {min(f):7.0f} {max(f):7.0f} {med[e]['frozen'] * 1e3:10.0f} "
              f"{min(r['frozen']) * 1e3:9.0f} {ioctl} {med[e]['rss'] / MIB:14.1f} {med[e]['pss'] / MIB:8.1f}")
    for base in ("criu", "restart"):
        if "bunshin" in med and base in med:
            b, o = med["bunshin"], med[base]
            print(f"bunshin/{base}: fork latency {b['fork'] / o['fork']:.2f}x, source frozen "
                  f"{b['frozen'] / max(o['frozen'], 1e-9):.2f}x, clone Pss {b['pss'] / max(1, o['pss']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
