"""In-guest part of bench_fork_vm.py: Bunshin fork vs plain fork() vs CRIU dump+restore.

Runs only inside the lab VM, as root, with the module loaded:

    bunshin vm run --load-module --mem 4G --share OUT -- PYTHON benchmarks/vm_fork_bench.py --out OUT/r.json

For each size (default 64, 256, 1024 MiB) one source process is started: a Python process that
writes a bytearray of that size and then sleeps in a loop, alone in its own cgroup v2 group. On it:

  fork   a plain fork() by the source itself (on SIGUSR1; the parent's os.fork() wall time):
         the floor, page-table copy.
  bunshin  freeze the source's cgroup, BUNSHIN_IOC_FORK it (FORK_CGROUP: the clone is born into
         a second, frozen cgroup, so it stays frozen while the source thaws), thaw the source.
         Reported: the ioctl time, the time the module reports in the source, and the source's
         frozen time (freeze request to thawed, the fork in between).
  criu   ``criu dump --leave-running`` to tmpfs (the dump time is the source's frozen time),
         then kill the source and ``criu restore -d`` (same pid), which brings the source back.

Memory per clone before writes: the clone's private pages (Private_Clean + Private_Dirty from
smaps_rollup) and its page tables (VmPTE), as a share of the source's Rss.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
CGROUP = Path("/sys/fs/cgroup")
DEVICE = "/dev/bunshin"
WORK = Path("/tmp/bunshin-forkbench")
ROOT = Path(__file__).resolve().parent.parent
UAPI = ROOT / "kmod" / "include" / "uapi" / "linux" / "bunshin.h"

FORK_FMT = "=IiiiQii4Q"  # struct bunshin_fork_req
FORK_CGROUP = 1 << 0
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x20000000, 0x40000000)
CRIU_MODULES = ["inet_diag", "tcp_diag", "udp_diag", "raw_diag", "unix_diag", "netlink_diag",
                "af_packet_diag", "tun", "veth", "nf_tables", "nfnetlink"]
_libc = ctypes.CDLL(None, use_errno=True)

# The source: write SIZE MiB, then sleep. On SIGUSR1 it fork()s, timing its own os.fork(), and
# writes "ns child_pid" to WORK/fork.<pid>; the child only sleeps (it writes nothing).
SOURCE = r"""
import os, signal, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
work = sys.argv[2]
def on_usr1(*_):
    t0 = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:
        while True:
            time.sleep(3600)
    dt = time.perf_counter_ns() - t0
    p = f"{work}/fork.{os.getpid()}"
    with open(p + ".tmp", "w") as f:
        f.write(f"{dt} {pid}")
    os.rename(p + ".tmp", p)
signal.signal(signal.SIGUSR1, on_usr1)
buf = bytearray(b"\x5a") * (int(sys.argv[1]) << 20)
open(f"{work}/ready.{os.getpid()}", "w").close()
while True:
    time.sleep(0.5)
"""


def ioc_fork() -> int:
    magic = int(re.search(r"#define\s+BUNSHIN_IOC_MAGIC\s+(\S+)", UAPI.read_text())[1], 0)
    return (3 << 30) | (struct.calcsize(FORK_FMT) << 16) | (magic << 8) | 0x01


def bunshin_fork(fd: int, source: int, pidfd: int, flags: int, cgroup_fd: int) -> tuple[int, int]:
    buf = bytearray(struct.pack(FORK_FMT, flags, source, pidfd, 0, 0, cgroup_fd, 0, 0, 0, 0, 0))
    fcntl.ioctl(fd, IOC_FORK, buf)
    out = struct.unpack(FORK_FMT, buf)
    return out[3], out[4]


def set_frozen(cg: Path, frozen: bool, timeout: float = 30.0) -> None:
    (cg / "cgroup.freeze").write_text("1" if frozen else "0")
    want = f"frozen {int(frozen)}"
    events = cg / "cgroup.events"
    deadline = time.monotonic() + timeout
    while want not in events.read_text().splitlines():  # tight poll: the latency is measured
        if time.monotonic() > deadline:
            raise RuntimeError(f"{cg} did not reach '{want}'")


def rollup(pid: int) -> dict[str, int]:
    d = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+):\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text(),
                                              re.MULTILINE)}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmPTE:"):
            d["VmPTE"] = int(line.split()[1])
    return d


def added(child: int) -> dict[str, int]:
    r = rollup(child)
    return {"private_kb": r["Private_Clean"] + r["Private_Dirty"], "pte_kb": r["VmPTE"], "rss_kb": r["Rss"],
            "pss_kb": r["Pss"]}


def kill_wait(pid: int, timeout: float = 30.0) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            st = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return
        if st[st.rindex(")") + 2] in "ZX":
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                time.sleep(0.01)
                continue
            return
        time.sleep(0.005)
    raise RuntimeError(f"pid {pid} did not die")


def reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def spawn_target() -> tuple[int, int]:
    """A target init in new pid, mount, UTS, IPC and network namespaces (reaps its children)."""
    r, w = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(r)
            if _libc.unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET) != 0:
                os._exit(97)
            _libc.mount(b"none", b"/", None, 0x40000 | 0x4000, None)
            init = os.fork()
            if init == 0:
                os.close(w)
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)
                while True:
                    signal.pause()
            os.write(w, str(init).encode())
            os.close(w)
            os.waitpid(init, 0)
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    return helper, int(data)


def start_source(mib: int, cg: Path) -> int:
    p = subprocess.Popen([sys.executable, "-c", SOURCE, str(mib), str(WORK)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True)
    (cg / "cgroup.procs").write_text(str(p.pid))
    ready = WORK / f"ready.{p.pid}"
    deadline = time.monotonic() + 300
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {mib} MiB source did not start (status {p.poll()})")
        time.sleep(0.05)
    time.sleep(0.3)  # let it settle into its sleep
    return p.pid


def bench_plain_fork(source: int, repeats: int) -> dict:
    times, mem = [], []
    for _ in range(repeats):
        out = WORK / f"fork.{source}"
        out.unlink(missing_ok=True)
        os.kill(source, signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the source's fork() did not report")
            time.sleep(0.002)
        ns, child = map(int, out.read_text().split())
        times.append(ns / 1e9)
        time.sleep(0.05)
        mem.append(added(child))
        kill_wait(child)
    return {"fork_s": times, "mem": mem}


def bench_bunshin(source: int, cg: Path, repeats: int) -> dict:
    helper, target = spawn_target()
    pidfd = os.pidfd_open(target)
    tcg = CGROUP / "bunshin-bench-clones"
    tcg.mkdir(exist_ok=True)
    set_frozen(tcg, True)
    tcg_fd = os.open(tcg, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    dev = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    res: dict = {"ioctl_s": [], "in_source_s": [], "freeze_s": [], "thaw_s": [], "frozen_s": [], "mem": []}
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            set_frozen(cg, True)
            t1 = time.perf_counter()
            child, source_ns = bunshin_fork(dev, source, pidfd, FORK_CGROUP, tcg_fd)
            t2 = time.perf_counter()
            set_frozen(cg, False)
            t3 = time.perf_counter()
            res["freeze_s"].append(t1 - t0)
            res["ioctl_s"].append(t2 - t1)
            res["thaw_s"].append(t3 - t2)
            res["frozen_s"].append(t3 - t0)
            res["in_source_s"].append(source_ns / 1e9)
            res["mem"].append(added(child))  # still frozen in tcg: nothing written
            kill_wait(child)
            time.sleep(0.05)
    finally:
        os.close(dev)
        os.close(tcg_fd)
        os.close(pidfd)
        kill_wait(target)
        try:
            os.waitpid(helper, 0)
        except ChildProcessError:
            pass
        set_frozen(tcg, False)
        for pid in (tcg / "cgroup.procs").read_text().split():
            kill_wait(int(pid))
        for _ in range(200):
            try:
                tcg.rmdir()
                break
            except OSError:
                time.sleep(0.01)
    return res


def criu_prepare() -> tuple[str | None, str]:
    """(path to criu or None, a note: why it is absent or `criu check`'s verdict)."""
    criu = shutil.which("criu") or next((p for p in ("/usr/sbin/criu", "/sbin/criu") if os.path.exists(p)), None)
    if criu is None:
        return None, "criu is not installed on the host (apt-get install -y criu)"
    modroot = os.environ.get("BUNSHIN_VM_MODULES_ROOT", "")
    failed = []
    for m in CRIU_MODULES:
        r = subprocess.run(["modprobe", "-d", modroot, m], capture_output=True, text=True, check=False)
        if r.returncode:
            failed.append(f"{m}: {r.stderr.strip()}")
    subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, check=False)
    r = subprocess.run([criu, "check"], capture_output=True, text=True, check=False)
    lines = (r.stdout + r.stderr).strip().splitlines()
    good = [ln for ln in lines if "Looks good" in ln]
    note = f"criu check: {good[0] if good else (lines[-1] if lines else '?')} (status {r.returncode})"
    if failed:
        note += "; modprobe failed for " + "; ".join(failed)
    ver = subprocess.run([criu, "--version"], capture_output=True, text=True, check=False).stdout.split()
    note = f"{' '.join(ver[:2])}; {note}"
    if r.returncode:
        return None, note
    return criu, note


def bench_criu(criu: str, source: int, repeats: int) -> tuple[dict, int]:
    """Dump + kill + restore, *repeats* times; the restored process (same pid) is the next source."""
    res: dict = {"dump_s": [], "restore_s": [], "total_s": [], "image_mib": [], "mem": []}
    for i in range(repeats):
        images = WORK / f"criu-{source}-{i}"
        images.mkdir()
        t0 = time.perf_counter()
        r = subprocess.run([criu, "dump", "-t", str(source), "-D", str(images), "--leave-running",
                            "-o", "dump.log", "-v2"], capture_output=True, text=True, check=False)
        t1 = time.perf_counter()
        if r.returncode:
            tail = (images / "dump.log").read_text()[-1500:] if (images / "dump.log").exists() else r.stderr
            raise RuntimeError(f"criu dump failed ({r.returncode}):\n{tail}")
        size = sum(p.stat().st_size for p in images.iterdir()) / MIB
        kill_wait(source)
        t2 = time.perf_counter()
        r = subprocess.run([criu, "restore", "-D", str(images), "-d", "-o", "restore.log", "-v2"],
                           capture_output=True, text=True, check=False)
        t3 = time.perf_counter()
        if r.returncode:
            tail = (images / "restore.log").read_text()[-1500:] if (images / "restore.log").exists() else r.stderr
            raise RuntimeError(f"criu restore failed ({r.returncode}):\n{tail}")
        reap()
        if not os.path.exists(f"/proc/{source}"):
            raise RuntimeError(f"criu restore reported success but pid {source} is absent")
        res["dump_s"].append(t1 - t0)
        res["restore_s"].append(t3 - t2)
        res["total_s"].append((t1 - t0) + (t3 - t2))
        res["image_mib"].append(size)
        time.sleep(0.2)
        res["mem"].append(added(source))  # the restored process: a private copy
        shutil.rmtree(images)
    return res, source


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024", help="source sizes in MiB (default: 64,256,1024)")
    ap.add_argument("--repeats", type=int, default=15, help="Bunshin and fork() repeats (default 15)")
    ap.add_argument("--criu-repeats", type=int, default=5, help="CRIU repeats (default 5)")
    ap.add_argument("--no-criu", action="store_true")
    ap.add_argument("--out", help="write the raw figures as JSON here (a --share directory)")
    a = ap.parse_args()
    if os.environ.get("BUNSHIN_VM") != "1" or os.geteuid() != 0 or not os.path.exists(DEVICE):
        print("run inside the lab VM as root with the module loaded: bunshin vm run --load-module ...",
              file=sys.stderr)
        return 2
    global IOC_FORK
    IOC_FORK = ioc_fork()
    _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: restored processes become ours
    WORK.mkdir(parents=True, exist_ok=True)
    criu, criu_note = (None, "skipped (--no-criu)") if a.no_criu else criu_prepare()
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs; CRIU: {criu_note}", flush=True)
    results: dict = {"kernel": os.uname().release, "criu": criu_note, "sizes": {}}
    for mib in [int(s) for s in a.sizes.split(",")]:
        cg = CGROUP / f"bunshin-bench-src-{mib}"
        cg.mkdir(exist_ok=True)
        source = start_source(mib, cg)
        src = rollup(source)
        print(f"[{mib} MiB] source pid {source}: Rss {src['Rss'] / 1024:.1f} MiB, VmPTE {src['VmPTE']} kB",
              flush=True)
        entry: dict = {"source": src}
        try:
            entry["fork"] = bench_plain_fork(source, a.repeats)
            print(f"[{mib} MiB] fork(): median {med(entry['fork']['fork_s']) * 1e3:.2f} ms", flush=True)
            entry["bunshin"] = bench_bunshin(source, cg, a.repeats)
            print(f"[{mib} MiB] bunshin: ioctl median {med(entry['bunshin']['ioctl_s']) * 1e3:.2f} ms, "
                  f"frozen {med(entry['bunshin']['frozen_s']) * 1e3:.2f} ms", flush=True)
            if criu:
                try:
                    entry["criu"], source = bench_criu(criu, source, a.criu_repeats)
                    print(f"[{mib} MiB] criu: dump {med(entry['criu']['dump_s']):.3f} s, "
                          f"restore {med(entry['criu']['restore_s']):.3f} s", flush=True)
                except Exception as e:  # noqa: BLE001 (reported, the rest goes on)
                    entry["criu_error"] = str(e)
                    print(f"[{mib} MiB] criu FAILED: {e}", flush=True)
        finally:
            kill_wait(source)
            set_frozen(cg, False)
            for pid in (cg / "cgroup.procs").read_text().split():
                kill_wait(int(pid))
            for _ in range(200):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
        results["sizes"][mib] = entry

    # The side-by-side table.
    print()
    print(f"Medians; Bunshin/fork() over {a.repeats} repeats, CRIU over {a.criu_repeats}. Kernel "
          f"{results['kernel']} under TCG. CRIU: {criu_note}")
    hdr = (f"{'size':>6} | {'fork() ms':>9} | {'Bunshin ioctl ms':>16} {'in src ms':>9} {'freeze ms':>9} {'thaw ms':>7} {'frozen ms':>9} | "
           f"{'CRIU dump s':>11} {'restore s':>9} {'total s':>8} | {'Bunshin/fork':>12} {'frozen/fork':>11} {'CRIU/Bunshin':>12} "
           f"{'CRIU/Bunshin frozen':>19}")
    print("Bunshin: freeze = request to 'frozen 1', ioctl = BUNSHIN_IOC_FORK (in src = the module's own figure), "
          "thaw = request to 'frozen 0', frozen = all three. CRIU: dump --leave-running (the source's frozen time), "
          "restore -d after killing the source (same pid). CRIU/Bunshin = (dump+restore)/ioctl; "
          "CRIU/Bunshin frozen = dump/frozen.")
    print(hdr)
    print("-" * len(hdr))
    for mib, e in results["sizes"].items():
        f = med(e["fork"]["fork_s"])
        b = e["bunshin"]
        bi, bs, bf = med(b["ioctl_s"]), med(b["in_source_s"]), med(b["frozen_s"])
        if "criu" in e:
            cd, cr, ct = med(e["criu"]["dump_s"]), med(e["criu"]["restore_s"]), med(e["criu"]["total_s"])
            crius = f"{cd:>11.3f} {cr:>9.3f} {ct:>8.3f}"
            ratio, fratio = f"{ct / bi:>11.0f}x", f"{cd / bf:>18.0f}x"
        else:
            crius, ratio, fratio = f"{'absent':>11} {'':>9} {'':>8}", f"{'n/a':>12}", f"{'n/a':>19}"
        fz, th = med(b["freeze_s"]), med(b["thaw_s"])
        print(f"{mib:>4}Mi | {f * 1e3:>9.2f} | {bi * 1e3:>16.2f} {bs * 1e3:>9.2f} {fz * 1e3:>9.2f} {th * 1e3:>7.2f} "
              f"{bf * 1e3:>9.2f} | {crius} | "
              f"{bi / f:>11.2f}x {bf / f:>10.2f}x {ratio} {fratio}")
    print()
    print("Memory added per clone before any write (median; clone's Private_Clean+Private_Dirty, page tables "
          "VmPTE), as a share of the source's Rss:")
    print(f"{'size':>6} | {'source Rss MiB':>14} | {'Bunshin priv kB':>15} {'+PTE kB':>8} {'share':>7} | "
          f"{'fork() priv kB':>14} {'+PTE kB':>8} {'share':>7} | {'CRIU restored priv MiB':>22} {'share':>7}")
    for mib, e in results["sizes"].items():
        rss = e["source"]["Rss"]

        def cols(mem: list[dict], rss: int = rss) -> tuple[float, float, float]:
            p = med([m["private_kb"] for m in mem])
            t = med([m["pte_kb"] for m in mem])
            return p, t, 100 * (p + t) / rss

        bp, bt, bsh = cols(e["bunshin"]["mem"])
        fp, ft, fsh = cols(e["fork"]["mem"])
        crow = "absent"
        if "criu" in e:
            cp, _, csh = cols(e["criu"]["mem"])
            crow = f"{cp / 1024:>22.1f} {csh:>6.1f}%"
        print(f"{mib:>4}Mi | {rss / 1024:>14.1f} | {bp:>15.0f} {bt:>8.0f} {bsh:>6.2f}% | {fp:>14.0f} {ft:>8.0f} "
              f"{fsh:>6.2f}% | {crow}")
    for mib, e in results["sizes"].items():
        if "criu_error" in e:
            print(f"CRIU at {mib} MiB failed: {e['criu_error']}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
