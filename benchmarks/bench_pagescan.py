"""How fast the exact page scanner runs.

Starts a process that maps and writes SIZE (1 GiB) of anonymous memory, then times, in the
same run and alternately, ``scan_pages([pid])`` (pagemap + kpagecount, exact sharing) and
reading ``/proc/PID/smaps_rollup`` (the kernel's own summary: Rss/Pss, no set semantics),
as medians over repeats, and prints pages per second side by side with the ratio: first
while its pages are private, then after it forks a twin that writes nothing (the pages are
shared: kpagecount must be read for each), alone and together with the twin (twice the
mappings, the same pages). Target: well over 1M pages/s. Needs root.

    python benchmarks/bench_pagescan.py [--size-mib 1024] [--repeats 7] [--thp]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from bunshin_async._bunshin_c import scan_pages

CHUNK = 1 << 20


def start_holder(size: int, thp: bool) -> tuple[int, int, int]:
    """Fork a process holding ``size`` written bytes; return (pid, read fd, control fd).

    Each byte written to the control fd moves it on: the first forks a twin that shares
    every page copy-on-write and writes nothing (its pid is then readable), the second
    ends both.
    """
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(go_w)
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if thp:
                buf.madvise(mmap.MADV_HUGEPAGE)
            block = b"\x5a" * CHUNK
            for off in range(0, size, CHUNK):
                buf[off : off + CHUNK] = block
            os.write(ready_w, b"ready\n")
            os.read(go_r, 1)
            twin = os.fork()
            if twin == 0:
                try:
                    os.read(go_r, 1)
                finally:
                    os._exit(0)
            os.write(ready_w, f"{twin}\n".encode())
            os.waitpid(twin, 0)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 6) == b"ready\n"
    return pid, ready_r, go_w


def read_rollup(pids: list[int]) -> int:
    """Sum Rss (in kB) of smaps_rollup over pids."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Rss:"):
                    total += int(line.split()[1])
                    break
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--thp", action="store_true", help="madvise(MADV_HUGEPAGE) the buffer")
    args = ap.parse_args()
    console = Console(width=130)
    if os.geteuid() != 0:
        sys.exit("bench_pagescan: needs root (PFNs in /proc/PID/pagemap read as 0 otherwise)")

    size = args.size_mib << 20
    page_size = os.sysconf("SC_PAGESIZE")
    walls: dict[tuple[str, str], list[float]] = {}
    pages: dict[tuple[str, str], int] = {}

    def measure(cases: dict[str, list[int]]) -> None:
        for _ in range(args.repeats):
            for name, pids in cases.items():  # alternate, so drift affects both alike
                t0 = time.perf_counter()
                scan = scan_pages(pids)
                walls.setdefault((name, "scan_pages"), []).append(time.perf_counter() - t0)
                pages[(name, "scan_pages")] = sum(v[0] for v in scan.per_pid.values())
                t0 = time.perf_counter()
                rss_kb = read_rollup(pids)
                walls.setdefault((name, "smaps_rollup"), []).append(time.perf_counter() - t0)
                pages[(name, "smaps_rollup")] = rss_kb * 1024 // page_size

    pid, ready, go = start_holder(size, args.thp)
    try:
        measure({"1 process, private pages": [pid]})
        os.write(go, b"x")
        twin = int(os.read(ready, 64))
        measure({"1 process, pages shared with a fork": [pid], "process + its fork": [pid, twin]})
        last = scan_pages([pid, twin])
    finally:
        os.write(go, b"xx")
        os.close(go)
        os.close(ready)
        os.waitpid(pid, 0)

    table = Table(title=f"Page scan of a {args.size_mib} MiB written process "
                        f"(median of {args.repeats}{', THP' if args.thp else ''})")
    for col in ("processes", "method", "pages (per-process sum)", "wall ms", "pages/s", "scan_pages / smaps_rollup time"):
        table.add_column(col, justify="right")
    for name in dict.fromkeys(n for n, _ in walls):
        med = {m: statistics.median(walls[(name, m)]) for m in ("scan_pages", "smaps_rollup")}
        for method in ("scan_pages", "smaps_rollup"):
            n = pages[(name, method)]
            ratio = f"{med['scan_pages'] / med['smaps_rollup']:.2f}x" if method == "scan_pages" else ""
            table.add_row(name, method, f"{n:,}", f"{med[method] * 1e3:.1f}", f"{n / med[method] / 1e6:.2f} M", ratio)
    console.print(table)
    console.print(
        f"process + fork, exact: resident {last.resident:,} pages, private {last.private:,}, "
        f"shared_inside {last.shared_inside:,}, shared_outside {last.shared_outside:,}"
    )


if __name__ == "__main__":
    main()
