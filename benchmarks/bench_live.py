"""Live workspaces: start, fork and memory, side by side with baselines measured in the same run.

1. Workspace start latency: from the request to a workspace that has run its first command
   (``true``), then its teardown, alternately (so drift hits every system alike) for

   a. Bunshin: ``open_container(spec)`` + ``exec(["true"])``, then ``destroy()``;
   b. ``unshare --fork --pid --mount --uts --ipc --net --cgroup --mount-proc sh -c 'mount -t
      overlay ... && exec chroot rootfs true'``: the same namespaces and the same overlay as
      Bunshin (``lowerdir=/`` and fresh upper/work directories next to Bunshin's, given
      relative to the data directory as Bunshin does), minus cgroups, /dev, /sys and the agent;
   c. ``crun run`` of an OCI bundle whose rootfs is the same overlay (mounted on the host
      before, unmounted after), process ``true``, the same namespaces and memory/pids limits:
      with cgroups (``--cgroup-manager=cgroupfs``) where crun accepts the host's cgroup layout,
      and with ``--cgroup-manager=disabled``.

   ``unshare`` and ``crun run`` return once ``true`` has exited and (crun) the container is
   deleted, so their "start" includes part of their teardown; "total" is the fair comparison.
   Target (issue 4): Bunshin's start within 1.5x of (b) and faster than (c).
2. Fork latency on the live backend (``restart`` engine): ``snapshot`` + ``fork`` of a workspace
   that has run a few calls (one of them a stateful shell call, replayed in the fork) against
   ``create`` of a fresh workspace (and ``create`` + re-running the calls).
3. N (64) concurrent workspaces of one task, each having run the same calls (the persistent
   shell started ``python3`` holding HOLD MiB of written memory): host memory of the N together
   (the page scanner over all their pids: resident unique pages; and the sum of their memory
   cgroups' usage) against N x the same measurement of one workspace alone, in the same run.

Everything is removed at the end, on error and on Ctrl-C (workspaces destroyed, then ``gc`` of
the benchmark's own state directory). Needs root, ``crun`` and ``unshare`` (util-linux).

    python benchmarks/bench_live.py [--repeats 20] [--concurrent 64] [--quick]
        [--crun-hybrid-fix] [--parts 1,2,3]

On a hybrid cgroup host whose v2 hierarchy still offers a controller (this project's machines:
``hugetlb``), crun 1.8 refuses cgroups ("cgroups in hybrid mode not supported"); with
``--crun-hybrid-fix`` the benchmark mounts such controllers as v1 hierarchies for the run (under
/sys/fs/cgroup/NAME) and unmounts them at the end, which gives them back to v2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from bunshin_async import (
    CallContext,
    Container,
    MemoryProfile,
    RolloutKey,
    StateDir,
    Task,
    ToolCall,
    gc,
    open_container,
)
from bunshin_async._bunshin_c import MNT_DETACH, mount, scan_pages, umount2
from bunshin_async._cgroup import layout
from bunshin_async._live import LiveBackend
from bunshin_async._spec import WorkspaceSpec, spec_from_dict

MIB = 1 << 20
DEFAULT_STATE = "/run/bunshin-bench"
CRUN_PARENT = "bunshin-bench"

# Like examples/workspace.toml, minimal: the host root, its limits, and the tools parts 2-3 call.
SPEC: dict[str, Any] = {
    "name": "bench",
    "root": "host",
    "hostname": "workspace",
    "limits": {"memory": "1GiB", "pids": 512},
    "tools": {
        "shell": {"command": "{command}", "raw": ["command"], "shell": "main", "stateful": True, "timeout": 120},
        "ls": {"command": "ls -la -- {path}", "cacheable": True},
        "cat": {"command": "cat -- {path}", "cacheable": True},
        "write_file": {"command": "mkdir -p -- \"$(dirname -- {path})\" && printf '%s' {content} > {path}"},
    },
}


# --- statistics and formatting -----------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p90(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def mib(x: float) -> str:
    return f"{x / MIB:,.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


# --- cleanup registry --------------------------------------------------------------------------


class Cleanup:
    """Everything the run made that must go, even on Ctrl-C."""

    def __init__(self, state: StateDir, base: str) -> None:
        self.state = state
        self.base = base  # baselines' directories
        self.containers: set[Container] = set()
        self.backends: list[LiveBackend] = []
        self.mounts: list[str] = []  # host mounts (crun rootfs overlays)
        self.crun_ids: set[str] = set()
        self.v1_mounts: list[str] = []  # controllers mounted by --crun-hybrid-fix
        self.crun_parents_made: list[str] = []

    async def containers_down(self) -> None:
        with anyio.CancelScope(shield=True):
            for c in list(self.containers):
                with contextlib.suppress(Exception):
                    await c.destroy()
                self.containers.discard(c)
            for b in self.backends:
                with contextlib.suppress(Exception):
                    await b.aclose()
            self.backends.clear()

    def sync(self) -> list[str]:
        """Remove the rest (synchronous, so it also runs after a second Ctrl-C)."""
        problems: list[str] = []
        for cid in list(self.crun_ids):
            subprocess.run(["crun", "delete", "-f", cid], capture_output=True, check=False)
            self.crun_ids.discard(cid)
        for m in reversed(self.mounts):
            with contextlib.suppress(OSError):
                umount2(m, MNT_DETACH)
        self.mounts.clear()
        shutil.rmtree(self.base, ignore_errors=True)
        for parent in self.crun_parents_made:
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        for path in list(self.v1_mounts):
            try:
                give_back_v1(path)
            except OSError as exc:
                problems.append(f"cannot unmount {path}: {exc}")
            self.v1_mounts.remove(path)
        rep = gc(self.state, include_alive=True)  # the benchmark's own state directory
        problems += list(rep.errors)
        return problems


def v1_hierarchy(ctrl: str) -> tuple[int, int]:
    """(hierarchy id, number of cgroups) of *ctrl* in /proc/cgroups (hierarchy 0: v2)."""
    with open("/proc/cgroups") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0] == ctrl:
                return int(parts[1]), int(parts[2])
    return 0, 0


def give_back_v1(path: str) -> None:
    """Unmount a v1 hierarchy mounted by --crun-hybrid-fix so its controller returns to v2.

    The kernel destroys an unmounted v1 hierarchy only if it had no child cgroups at unmount
    time, and removed cgroups are freed asynchronously: wait for them to be gone first, and if
    the hierarchy still lingers after the unmount, mount and unmount it once more."""
    ctrl = os.path.basename(path)
    for attempt in range(2):
        if attempt:
            mount("cgroup", path, "cgroup", 0, ctrl)
        deadline = time.monotonic() + 10
        while v1_hierarchy(ctrl)[1] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        umount2(path)
        deadline = time.monotonic() + 5
        while v1_hierarchy(ctrl)[0] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if v1_hierarchy(ctrl)[0] == 0:
            break
    os.rmdir(path)
    if v1_hierarchy(ctrl)[0] != 0:
        raise OSError(f"the {ctrl} controller did not return to cgroup v2 (see /proc/cgroups)")


# --- part 1: start latency ---------------------------------------------------------------------


def crun_blocked_controllers() -> list[str]:
    """Controllers that make crun refuse cgroups on a hybrid host (v2 still offers them)."""
    lay = layout()
    if not lay.v1 or lay.v2 is None or lay.v2 == "/sys/fs/cgroup":
        return []
    return sorted(lay.v2_controllers)


def hybrid_fix(clean: Cleanup, console: Console) -> bool:
    lay = layout()
    assert lay.v2 is not None
    with open(os.path.join(lay.v2, "cgroup.subtree_control")) as f:
        enabled = set(f.read().split())
    for ctrl in crun_blocked_controllers():
        path = f"/sys/fs/cgroup/{ctrl}"
        if ctrl in enabled or os.path.exists(path):
            console.print(f"[yellow]--crun-hybrid-fix: cannot move {ctrl} to v1 ({path} exists or v2 uses it)")
            return False
        os.mkdir(path)
        try:
            mount("cgroup", path, "cgroup", 0, ctrl)
        except OSError as exc:
            os.rmdir(path)
            console.print(f"[yellow]--crun-hybrid-fix: mounting {ctrl} as v1 failed: {exc}")
            return False
        clean.v1_mounts.append(path)
        console.print(f"--crun-hybrid-fix: mounted the {ctrl} controller as a v1 hierarchy at {path} for this run")
    return True


def crun_config(cgroups: bool, cid: str) -> dict[str, Any]:
    ns = [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")]
    linux: dict[str, Any] = {
        "namespaces": ns,
        "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    }
    if cgroups:
        linux["cgroupsPath"] = f"/{CRUN_PARENT}/{cid}"
        linux["resources"] = {"devices": [{"allow": False, "access": "rwm"}],
                              "memory": {"limit": 1 << 30}, "pids": {"limit": 512}}
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["true"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=dumb"],
            "cwd": "/root",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted", "ambient")},
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": "workspace",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": linux,
    }


UNSHARE = ["unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--net", "--cgroup", "--mount-proc",
           "sh", "-c", "mount -t overlay overlay -o lowerdir=/,upperdir=upper,workdir=work rootfs && exec chroot rootfs true"]


class Start:
    """The systems of part 1; each method returns (start s, teardown s[, sub-phases])."""

    def __init__(self, spec: WorkspaceSpec, state: StateDir, clean: Cleanup) -> None:
        self.spec, self.state, self.clean = spec, state, clean
        self.n = 0

    def _dir(self, kind: str) -> str:
        self.n += 1
        return os.path.join(self.clean.base, f"{kind}-{self.n}")

    async def bunshin(self) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        c = await open_container(self.spec, state=self.state)
        self.clean.containers.add(c)
        t1 = time.perf_counter()
        r = await c.exec(["true"])
        t2 = time.perf_counter()
        await c.destroy()
        t3 = time.perf_counter()
        self.clean.containers.discard(c)
        if r.status != 0:
            raise RuntimeError(f"bunshin: true exited {r.status}: {r.stderr!r}")
        return t2 - t0, t3 - t2, t1 - t0

    def unshare(self) -> tuple[float, float]:
        d = self._dir("unshare")
        t0 = time.perf_counter()
        os.mkdir(d)
        for sub in ("upper", "work", "rootfs"):
            os.mkdir(os.path.join(d, sub))
        r = subprocess.run(UNSHARE, cwd=d, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        t1 = time.perf_counter()
        shutil.rmtree(d)
        t2 = time.perf_counter()
        if r.returncode != 0:
            raise RuntimeError(f"unshare + overlay: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()}")
        return t1 - t0, t2 - t1

    def crun(self, cgroups: bool) -> tuple[float, float]:
        d = self._dir("crun")
        cid = f"bb-{os.getpid()}-{self.n}"
        rootfs = os.path.join(d, "rootfs")
        t0 = time.perf_counter()
        os.mkdir(d)
        for sub in ("upper", "work", "rootfs"):
            os.mkdir(os.path.join(d, sub))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(crun_config(cgroups, cid), f)
        mount("overlay", rootfs, "overlay", 0, f"lowerdir=/,upperdir={d}/upper,workdir={d}/work")
        self.clean.mounts.append(rootfs)
        self.clean.crun_ids.add(cid)
        mgr = "cgroupfs" if cgroups else "disabled"
        r = subprocess.run(["crun", f"--cgroup-manager={mgr}", "run", "--bundle", d, cid],
                           stdin=subprocess.DEVNULL, capture_output=True, check=False)
        t1 = time.perf_counter()
        if r.returncode == 0:
            self.clean.crun_ids.discard(cid)  # crun run deleted it when `true` exited
        umount2(rootfs)
        self.clean.mounts.remove(rootfs)
        shutil.rmtree(d)
        t2 = time.perf_counter()
        if r.returncode != 0:
            raise RuntimeError(f"crun ({mgr}): exit {r.returncode}: {r.stderr.decode(errors='replace').strip()}")
        return t1 - t0, t2 - t1


async def part_start(args: argparse.Namespace, spec: WorkspaceSpec, state: StateDir, clean: Cleanup,
                     console: Console, progress: Progress) -> dict[str, Any]:
    s = Start(spec, state, clean)
    systems: dict[str, Callable[[], Any]] = {"bunshin": s.bunshin, "unshare": s.unshare}
    blocked = crun_blocked_controllers()
    crun_ok = not blocked or (args.crun_hybrid_fix and hybrid_fix(clean, console))
    if crun_ok:
        # crun makes /bunshin-bench/ID in every hierarchy; remember which parents it creates
        for entry in os.listdir("/sys/fs/cgroup"):
            p = os.path.join("/sys/fs/cgroup", entry, CRUN_PARENT)
            if os.path.isdir(os.path.join("/sys/fs/cgroup", entry)) and not os.path.exists(p):
                clean.crun_parents_made.append(p)
        systems["crun_cg"] = lambda: s.crun(True)
        systems["crun_nocg"] = lambda: s.crun(False)
    else:
        console.print(f"[yellow]crun not measured: crun refuses to run at all on this host's hybrid cgroup layout "
                      f"(the v2 hierarchy still offers: {', '.join(blocked)}; 'cgroups in hybrid mode not supported', "
                      "even with --cgroup-manager=disabled). Rerun with --crun-hybrid-fix.")
    times: dict[str, dict[str, list[float]]] = {k: {"start": [], "teardown": [], "sub": []} for k in systems}
    task = progress.add_task("1. start latency", total=(args.warmup + args.repeats) * len(systems))
    for i in range(args.warmup + args.repeats):
        for name, fn in systems.items():  # alternate, so drift affects all alike
            res = fn()
            if hasattr(res, "__await__"):
                res = await res
            if i >= args.warmup:
                times[name]["start"].append(res[0])
                times[name]["teardown"].append(res[1])
                if len(res) > 2:
                    times[name]["sub"].append(res[2])
            progress.advance(task)
            await anyio.lowlevel.checkpoint()  # Ctrl-C lands here
    labels = {
        "bunshin": "a. Bunshin open_container + exec(true) / destroy",
        "unshare": "b. unshare + overlay + chroot true / rm",
        "crun_cg": "c. crun run (cgroupfs, mem+pids limits) / umount + rm",
        "crun_nocg": "c'. crun run (--cgroup-manager=disabled) / umount + rm",
    }
    order = [k for k in ("bunshin", "unshare", "crun_cg", "crun_nocg") if k in times]
    tot = {k: [a + b for a, b in zip(times[k]["start"], times[k]["teardown"], strict=True)] for k in order}
    table = Table(title=f"1. Workspace start latency, ms (median and p90 of {args.repeats}, same run, alternating; "
                        f"{args.warmup} warm-up rounds not counted)")
    for col in ("system", "start med", "start p90", "teardown med", "teardown p90", "total med", "total p90",
                "start / (b)", "total / (b)"):
        table.add_column(col, justify="right" if col != "system" else "left")
    b_start, b_tot = med(times["unshare"]["start"]), med(tot["unshare"])
    for k in order:
        st, td = times[k]["start"], times[k]["teardown"]
        table.add_row(labels[k], ms(med(st)), ms(p90(st)), ms(med(td)), ms(p90(td)), ms(med(tot[k])), ms(p90(tot[k])),
                      ratio(med(st), b_start), ratio(med(tot[k]), b_tot))
        if k == "bunshin":
            sub = times[k]["sub"]
            ex = [a - b for a, b in zip(st, sub, strict=True)]
            table.add_row("   of which open_container", ms(med(sub)), ms(p90(sub)), "", "", "", "", "", "")
            table.add_row("   of which exec([\"true\"])", ms(med(ex)), ms(p90(ex)), "", "", "", "", "", "")
    console.print(table)
    console.print("start: request -> `true` has exited. unshare and `crun run` return only after the namespaces "
                  "are gone and (crun) the container is deleted, so their start includes part of their teardown; "
                  "compare totals for the whole cycle.")
    a_st, a_tot = med(times["bunshin"]["start"]), med(tot["bunshin"])
    verdicts = [("Bunshin start <= 1.5 x (b) unshare start", a_st <= 1.5 * b_start, f"{ms(a_st)} vs 1.5 x {ms(b_start)} = {ms(1.5 * b_start)} ms"),
                ("Bunshin total <= 1.5 x (b) unshare total", a_tot <= 1.5 * b_tot, f"{ms(a_tot)} vs 1.5 x {ms(b_tot)} = {ms(1.5 * b_tot)} ms")]
    for k, what in (("crun_cg", "crun with cgroups"), ("crun_nocg", "crun without cgroups")):
        if k in times:
            c_st, c_tot = med(times[k]["start"]), med(tot[k])
            verdicts.append((f"Bunshin start < (c) {what} start", a_st < c_st, f"{ms(a_st)} vs {ms(c_st)} ms"))
            verdicts.append((f"Bunshin total < (c) {what} total", a_tot < c_tot, f"{ms(a_tot)} vs {ms(c_tot)} ms"))
    if not crun_ok:
        verdicts.append(("Bunshin faster than (c) crun", None,
                         "not measured: crun refuses this host's cgroup layout (rerun with --crun-hybrid-fix)"))
    vt = Table(title="1. Targets (issue 4): start within 1.5x of plain unshare, faster than crun")
    for col in ("target", "holds", "medians"):
        vt.add_column(col)
    for what, ok, detail in verdicts:
        vt.add_row(what, "[yellow]n/a" if ok is None else "[green]yes" if ok else "[red]NO", detail)
    console.print(vt)
    return {"times": times}


# --- part 2: fork latency ----------------------------------------------------------------------


CALLS = [
    ToolCall("ls", {"path": "/etc"}),
    ToolCall("write_file", {"path": "/root/work/notes.txt", "content": "forked state\n"}),
    ToolCall("shell", {"command": "cd /root/work && export COUNT=3 && echo started"}),  # stateful: replayed
    ToolCall("cat", {"path": "/etc/os-release"}),
]


async def part_fork(args: argparse.Namespace, spec: WorkspaceSpec, state: StateDir, clean: Cleanup,
                    console: Console, progress: Progress) -> None:
    backend = LiveBackend(spec, state=state)
    clean.backends.append(backend)
    task = Task("bench-fork", MemoryProfile(0, 0, 0.0))

    async def run_calls(ws: Any) -> None:
        for i, call in enumerate(CALLS):
            r = await backend.execute(ws, call, CallContext(RolloutKey(0, task.id, 0, 0), i))
            if b"[exit status" in (r.output or b"") or b"[timed out]" in (r.output or b""):
                raise RuntimeError(f"{call}: {r.output!r}")

    src = await backend.create(task)
    await run_calls(src)
    keys = ("create", "create_replay", "snapshot", "fork", "snap_fork", "fork_existing", "rel_fork", "rel_create")
    t: dict[str, list[float]] = {k: [] for k in keys}
    ptask = progress.add_task("2. fork latency", total=args.warmup + args.repeats)
    checked = False
    base_snap = await backend.snapshot(src)  # a snapshot kept in the tree, forked again and again
    for i in range(args.warmup + args.repeats):
        keep = i >= args.warmup
        # snapshot + fork of the live workspace
        t0 = time.perf_counter()
        snap = await backend.snapshot(src)
        t1 = time.perf_counter()
        f = await backend.fork(snap)
        t2 = time.perf_counter()
        if not checked:
            out = await backend.execute(f, ToolCall("shell", {"command": "echo $COUNT $(pwd) $(cat notes.txt)"}),
                                        CallContext(RolloutKey(0, task.id, 0, 1), 0))
            if (out.output or b"").strip() != b"3 /root/work forked state":
                raise RuntimeError(f"the fork did not carry the workspace's state: {out.output!r}")
            checked = True
        t3 = time.perf_counter()
        await backend.release(f)
        await backend.release(snap)
        t4 = time.perf_counter()
        # fork of a snapshot that already exists (a prefix-tree node)
        t5 = time.perf_counter()
        f2 = await backend.fork(base_snap)
        t6 = time.perf_counter()
        await backend.release(f2)
        # create a fresh workspace; then run the calls again (what a sample without fork does)
        t7 = time.perf_counter()
        w = await backend.create(task)
        t8 = time.perf_counter()
        await run_calls(w)
        t9 = time.perf_counter()
        await backend.release(w)
        t10 = time.perf_counter()
        if keep:
            t["snapshot"].append(t1 - t0)
            t["fork"].append(t2 - t1)
            t["snap_fork"].append(t2 - t0)
            t["rel_fork"].append(t4 - t3)
            t["fork_existing"].append(t6 - t5)
            t["create"].append(t8 - t7)
            t["create_replay"].append(t9 - t7)
            t["rel_create"].append(t10 - t9)
        progress.advance(ptask)
    await backend.aclose()
    clean.backends.remove(backend)
    stats = backend.statistics()
    table = Table(title=f"2. Fork latency, live backend (restart engine), ms (median and p90 of {args.repeats}, same run)")
    for col in ("operation", "median", "p90", "/ create"):
        table.add_column(col, justify="right" if col != "operation" else "left")
    c = med(t["create"])
    rows = [
        ("create: boot a fresh workspace", "create"),
        (f"create + run the {len(CALLS)} calls again", "create_replay"),
        ("snapshot of the live workspace (freeze, copy upper, thaw)", "snapshot"),
        ("fork of that snapshot (boot on its layers + replay 1 stateful call)", "fork"),
        ("snapshot + fork", "snap_fork"),
        ("fork of an existing snapshot (prefix-tree node)", "fork_existing"),
        ("release fork + snapshot", "rel_fork"),
        ("release a created workspace", "rel_create"),
    ]
    for label, k in rows:
        table.add_row(label, ms(med(t[k])), ms(p90(t[k])), ratio(med(t[k]), c))
    console.print(table)
    console.print(f"the source ran {len(CALLS)} calls ({', '.join(x.name for x in CALLS)}); a fork replays the "
                  f"stateful one (shell). Checked in the first fork: `echo $COUNT $(pwd) $(cat notes.txt)` -> "
                  f"'3 /root/work forked state'. Backend counts: creates {stats.creates}, forks {stats.forks}, "
                  f"snapshots {stats.snapshots}, replayed calls {stats.replayed_calls}.")


# --- part 3: memory of N concurrent workspaces -------------------------------------------------


def holder_calls(hold_mib: int) -> list[tuple[str, Any]]:
    code = (f"x = bytearray({hold_mib} << 20); open('/tmp/holder.ready', 'w').close(); "
            "import time; time.sleep(3600)")
    return [
        ("exec", ["ls", "-la", "/etc"]),
        ("exec", ["cat", "/etc/os-release"]),
        ("call", ToolCall("shell", {"command": "cd /root && export TASK=mem"})),
        ("call", ToolCall("shell", {"command": f"python3 -c \"{code}\" >/dev/null 2>&1 &"})),
        ("call", ToolCall("shell", {"command": "for i in $(seq 3000); do [ -e /tmp/holder.ready ] && break; sleep 0.01; done; "
                                               "[ -e /tmp/holder.ready ]"})),
    ]


async def boot_task_ws(spec: WorkspaceSpec, state: StateDir, clean: Cleanup, hold_mib: int) -> Container:
    c = await open_container(spec, state=state)
    clean.containers.add(c)
    for kind, what in holder_calls(hold_mib):
        r = await (c.exec(what) if kind == "exec" else c.call(what))
        if not r.ok:
            raise RuntimeError(f"workspace {c.id}: {what} -> {r.status} {r.stderr!r}")
    return c


async def measure(cs: list[Container]) -> dict[str, float]:
    """Freeze the workspaces, scan their pages and read their cgroups, thaw them."""
    for c in cs:
        await c.freeze()
    try:
        for _ in range(5):
            pids = [p for c in cs for p in c.pids()]
            try:
                scan = scan_pages(pids)
                break
            except ProcessLookupError:
                continue
        else:
            raise RuntimeError("processes kept exiting during the scan")
        mem = [c.memory() for c in cs]
    finally:
        with anyio.CancelScope(shield=True):
            for c in cs:
                await c.thaw()
    ps = scan.page_size
    return {
        "resident": scan.resident * ps, "private": scan.private * ps, "shared_inside": scan.shared_inside * ps,
        "shared_outside": scan.shared_outside * ps, "current": sum(m.current for m in mem),
        "anon": sum(m.anon for m in mem), "file": sum(m.file for m in mem), "procs": len(pids),
    }


async def destroy_all(cs: list[Container], clean: Cleanup) -> None:
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for c in cs:
                async def down(c: Container = c) -> None:
                    await c.destroy()
                    clean.containers.discard(c)
                tg.start_soon(down)


async def part_memory(args: argparse.Namespace, spec: WorkspaceSpec, state: StateDir, clean: Cleanup,
                      console: Console, progress: Progress) -> None:
    n = args.concurrent
    need = n * (args.hold_mib + 40) * MIB
    avail = meminfo()["MemAvailable"]
    if need > avail // 2:
        console.print(f"[red]3. skipped: {n} x ~{args.hold_mib + 40} MiB = {mib(need)} MiB is over half of "
                      f"MemAvailable ({mib(avail)} MiB)")
        return
    ptask = progress.add_task(f"3. memory: {args.alone} alone, then {n} together", total=args.alone + n)
    alone: list[dict[str, float]] = []
    for _ in range(args.alone):
        c = await boot_task_ws(spec, state, clean, args.hold_mib)
        await anyio.sleep(0.2)
        alone.append(await measure([c]))
        await destroy_all([c], clean)
        progress.advance(ptask)
    cs: list[Container] = []
    limiter = anyio.CapacityLimiter(args.boot_concurrency)
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            async def up() -> None:
                async with limiter:
                    cs.append(await boot_task_ws(spec, state, clean, args.hold_mib))
                progress.advance(ptask)
            tg.start_soon(up)
    up_s = time.perf_counter() - t0
    await anyio.sleep(0.2)
    together = await measure(cs)
    t1 = time.perf_counter()
    await destroy_all(cs, clean)
    down_s = time.perf_counter() - t1
    one = {k: med([a[k] for a in alone]) for k in alone[0]}
    table = Table(title=f"3. Memory of {n} concurrent workspaces of one task vs {n} x one alone, MiB "
                        f"(each: agent, bash session, python3 holding {args.hold_mib} MiB written; frozen while measured; "
                        f"'one alone' is the median of {args.alone}, same run)")
    for col in ("measure", "one alone", f"{n} x one alone", f"{n} together", f"together / ({n} x alone)", "together per workspace"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    rows = [
        ("page scanner: resident unique pages", "resident"),
        ("   private (mapped once, by one process)", "private"),
        ("   shared inside the set only", "shared_inside"),
        ("   shared with processes outside the set", "shared_outside"),
        ("memory cgroups: sum of usage_in_bytes/current", "current"),
        ("   anon (total_rss / anon)", "anon"),
        ("   file (total_cache / file)", "file"),
    ]
    for label, k in rows:
        table.add_row(label, mib(one[k]), mib(n * one[k]), mib(together[k]), ratio(together[k], n * one[k]), mib(together[k] / n))
    table.add_row("processes scanned", f"{one['procs']:.0f}", f"{n * one['procs']:.0f}", f"{together['procs']:.0f}", "", "")
    console.print(table)
    console.print(f"{n} workspaces booted and initialised in {up_s:.1f} s ({args.boot_concurrency} at a time), "
                  f"destroyed in {down_s:.1f} s. The scanner counts each physical page once for the set; a cgroup is "
                  "charged for a page-cache page only if it faulted it in first, so file pages already cached "
                  "(python3, bash, libc) are charged to no workspace.")


# --- machine facts -----------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def machine_facts(state: StateDir) -> Table:
    lay = layout()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    crun = subprocess.run(["crun", "--version"], capture_output=True, text=True, check=False).stdout.splitlines()
    unshare = subprocess.run(["unshare", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    fs = subprocess.run(["findmnt", "-no", "FSTYPE,SOURCE", "-T", state.data], capture_output=True, text=True,
                        check=False).stdout.strip()
    t = Table(title="Machine", show_header=False)
    t.add_column()
    t.add_column()
    t.add_row("kernel", platform.release())
    t.add_row("cpu", f"{os.cpu_count()} x {cpu}")
    t.add_row("memory", f"{mib(meminfo()['MemTotal'])} MiB total, {mib(meminfo()['MemAvailable'])} MiB available")
    t.add_row("load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    t.add_row("cgroups", f"v2 at {lay.v2} (controllers: {', '.join(sorted(lay.v2_controllers)) or 'none'}); "
                         f"v1: {', '.join(f'{k} at {v}' for k, v in sorted(lay.v1.items())) or 'none'}")
    t.add_row("crun", crun[0] if crun else "not found")
    t.add_row("unshare", unshare)
    t.add_row("state / data dir", f"{state.path} / {state.data} ({fs})")
    t.add_row("python", sys.version.split()[0])
    return t


# --- main ----------------------------------------------------------------------------------------

_CLEAN: Cleanup | None = None


async def main_async(args: argparse.Namespace, console: Console) -> None:
    state = StateDir(args.state_dir, data=args.state_dir)
    rep = gc(state)
    if rep.records:
        console.print(f"gc at start removed what an earlier run left: {rep}")
    global _CLEAN
    clean = _CLEAN = Cleanup(state, os.path.join(state.data, "baselines"))
    os.makedirs(clean.base, exist_ok=True)
    spec = spec_from_dict(SPEC)
    console.print(machine_facts(state))
    interrupted = False

    async def on_signal(scope: anyio.CancelScope) -> None:
        nonlocal interrupted
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                if not interrupted:
                    interrupted = True
                    console.print(f"[yellow]{signal.Signals(sig).name}: stopping; removing everything the run made...")
                    scope.cancel()
                else:
                    console.print("[yellow]still cleaning up, please wait")

    async with anyio.create_task_group() as tg:
        work = anyio.CancelScope()
        tg.start_soon(on_signal, work)  # watches for Ctrl-C during the run and the cleanup
        try:
            with work, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=console, transient=True) as progress:
                if 1 in args.parts:
                    await part_start(args, spec, state, clean, console, progress)
                if 2 in args.parts:
                    await part_fork(args, spec, state, clean, console, progress)
                if 3 in args.parts:
                    await part_memory(args, spec, state, clean, console, progress)
        finally:
            with anyio.CancelScope(shield=True):
                await clean.containers_down()
                problems = await anyio.to_thread.run_sync(clean.sync)
            if problems:
                console.print(f"[red]cleanup problems: {problems}")
            tg.cancel_scope.cancel()  # stop the signal watcher
    if interrupted:
        raise KeyboardInterrupt
    console.print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20, help="latency repeats (parts 1 and 2)")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted rounds before the latency repeats")
    ap.add_argument("--concurrent", type=int, default=64, help="workspaces of part 3")
    ap.add_argument("--alone", type=int, default=3, help="workspaces measured alone in part 3 (median)")
    ap.add_argument("--hold-mib", type=int, default=50, help="memory each workspace's python3 holds (part 3)")
    ap.add_argument("--boot-concurrency", type=int, default=4, help="part 3 workspaces booting at once")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 repeats, 1 warm-up, 4 workspaces")
    ap.add_argument("--crun-hybrid-fix", action="store_true",
                    help="on a hybrid cgroup host, mount v2-only controllers as v1 for the run so crun accepts cgroups")
    ap.add_argument("--state-dir", default=DEFAULT_STATE,
                    help=f"the benchmark's own state and data directory (default {DEFAULT_STATE})")
    args = ap.parse_args()
    args.parts = {int(p) for p in args.parts.split(",") if p.strip()}
    if args.quick:
        args.repeats, args.warmup, args.concurrent, args.alone = 3, 1, 4, 1
    console = Console(width=160)
    if os.geteuid() != 0:
        sys.exit("bench_live: needs root (namespaces, mounts, cgroups, pagemap)")
    for tool in ("crun", "unshare"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_live: {tool} not found (apt-get install {'crun' if tool == 'crun' else 'util-linux'})")
    try:
        anyio.run(main_async, args, console)
    except KeyboardInterrupt:
        # a second Ctrl-C may have cut the cleanup short: sweep again (synchronous)
        if _CLEAN is not None:
            _CLEAN.sync()
        console.print("[yellow]interrupted; everything the run made was removed")
        sys.exit(130)


if __name__ == "__main__":
    main()
