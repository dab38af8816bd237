"""Load on the rollout service with real workspaces: N concurrent sessions stepping for a while.

Starts ``bunshin serve`` (live workspaces of the bundled spec, its own state directory) as a
process of its own, registers a task, opens N sessions in groups of G at once, and has every
session run cheap shell calls back to back for ``--seconds`` before closing it. Prints the
sessions and steps served, errors, step latency (median and p99, from the client), the peak of
the service's working set against ``--max-bytes`` (sampled from ``/v1/stats``), and what was
left after the service stopped: state records, workspace cgroups, the service's exit status.
Issue 7's load figure: 256 concurrent sessions, no errors, nothing left, memory within the
bound. Needs root.

    sudo python3 benchmarks/bench_serve_load.py [--sessions 256] [--group 16] [--seconds 20] [--max-bytes 8GiB]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import httpx

from bunshin_async._cli import parse_bytes

CGROUP_ROOTS = ("/sys/fs/cgroup/unified/bunshin", "/sys/fs/cgroup/memory/bunshin", "/sys/fs/cgroup/bunshin")


def cgroups() -> set[str]:
    out = set()
    for root in CGROUP_ROOTS:
        for dirpath, dirnames, _ in os.walk(root):
            out |= {os.path.join(dirpath, d) for d in dirnames}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long every session steps")
    ap.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("8GiB"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_serve_load.py runs live workspaces: run it as root")
    if args.sessions % args.group:
        sys.exit("--sessions must be a multiple of --group")
    before = cgroups()
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bunshin_async._cli", "serve", "--port", "0", "--state-dir", state,
             "--max-workspaces", str(args.sessions), "--max-bytes", str(args.max_bytes), "--max-wait", "600"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1) + "/v1"
                break
        if url is None:
            sys.exit(f"bunshin serve did not start: {proc.stdout.read()}")
        result = anyio.run(load, url, args)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
        records = os.listdir(os.path.join(state, "records")) if os.path.isdir(os.path.join(state, "records")) else []
    left = cgroups() - before
    lat = sorted(result["latency"])
    print(f"sessions {args.sessions} in groups of {args.group}, stepping {args.seconds:g} s each")
    print(f"steps served: {len(lat)} ({result['served']}), errors: {len(result['errors'])}"
          + (f" (first: {result['errors'][0]})" if result["errors"] else ""))
    if lat:
        print(f"step latency from the client: median {statistics.median(lat) * 1000:.1f} ms, "
              f"p99 {lat[int(0.99 * (len(lat) - 1))] * 1000:.1f} ms; {len(lat) / result['wall']:.0f} steps/s")
    print(f"groups opened in {result['open_s']:.1f} s; peak working set {result['peak'] / 2**20:.0f} MiB "
          f"against --max-bytes {args.max_bytes / 2**20:.0f} MiB: {'within' if result['peak'] <= args.max_bytes else 'OVER'}")
    print(f"after the service stopped (exit {proc.returncode}): {len(records)} state records, "
          f"{len(left)} workspace cgroups left; its last line: {out.strip().splitlines()[-1] if out.strip() else '-'}")


async def load(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.sessions + 8, max_keepalive_connections=args.sessions + 8)
    latency: list[float] = []
    errors: list[str] = []
    served: dict[str, int] = {}
    peak = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as client:
        r = await client.post("/tasks", json={"id": "load", "description": "load"})
        r.raise_for_status()
        sessions: list[str] = []
        t0 = time.perf_counter()

        async def open_group() -> None:
            r = await client.post("/tasks/load/groups", json={"size": args.group, "wait": 600})
            if r.status_code != 201:
                errors.append(f"open: {r.status_code} {r.text[:200]}")
                return
            sessions.extend(r.json()["sessions"])

        async with anyio.create_task_group() as tg:
            for _ in range(args.sessions // args.group):
                tg.start_soon(open_group)
        open_s = time.perf_counter() - t0

        async def watch() -> None:
            nonlocal peak
            while True:
                st = (await client.get("/stats")).json()
                peak = max(peak, st["working_set"])
                await anyio.sleep(0.2)

        async def drive(i: int, sid: str) -> None:
            end = time.perf_counter() + args.seconds
            n = 0
            while time.perf_counter() < end:
                call = {"name": "shell", "arguments": {"command": f"echo {i}-{n}"}} if n % 2 else \
                    {"name": "shell", "arguments": {"command": "cat /etc/hostname"}}
                t = time.perf_counter()
                r = await client.post(f"/sessions/{sid}/step", json={"call": call})
                if r.status_code != 200:
                    info = (await client.get(f"/sessions/{sid}")).json()
                    group = (await client.get(f"/groups/{info.get('group')}")).json()
                    errors.append(f"step: {r.status_code} {r.text[:200]} (session: {info.get('reason')}; "
                                  f"group: {group.get('error')})")
                    return
                latency.append(time.perf_counter() - t)
                how = r.json()["served_by"]
                served[how] = served.get(how, 0) + 1
                n += 1
            r = await client.post(f"/sessions/{sid}/close", json={"reward": 1.0})
            if r.status_code != 200:
                errors.append(f"close: {r.status_code} {r.text[:200]}")

        t1 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as drivers:
                for i, sid in enumerate(sessions):
                    drivers.start_soon(drive, i, sid)
            tg.cancel_scope.cancel()
        wall = time.perf_counter() - t1
    return {"latency": latency, "errors": errors, "served": served, "peak": peak, "open_s": open_s, "wall": wall}


if __name__ == "__main__":
    main()
