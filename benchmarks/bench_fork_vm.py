"""Bunshin fork vs plain fork() vs CRIU dump+restore, side by side, in the lab VM (issue 5, Performance).

    python benchmarks/bench_fork_vm.py [--sizes 64,256,1024] [--repeats 15] [--criu-repeats 5] [--mem 4G]

Boots the lab VM (``bunshin_async._vm.run_vm``, module built and loaded, TCG) and runs
``benchmarks/vm_fork_bench.py`` there with this interpreter; the guest prints the tables, which
are streamed here. CRIU is Debian's ``criu`` of the host (the guest sees the host root):
``apt-get install -y criu``; without it the CRIU columns say ``absent`` and why.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bunshin_async._vm import VMError, run_vm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--criu-repeats", type=int, default=5)
    ap.add_argument("--no-criu", action="store_true")
    ap.add_argument("--mem", default="4G", help="guest memory (default 4G)")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", help="copy the raw JSON figures here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_fork_vm.py needs root (the lab VM's 9p root uses security_model=passthrough)", file=sys.stderr)
        return 2
    if not (shutil.which("criu") or os.path.exists("/usr/sbin/criu")) and not a.no_criu:
        print("note: criu is not installed on the host (apt-get install -y criu): CRIU will be absent", flush=True)
    python = os.path.realpath(sys.executable)
    share = tempfile.mkdtemp(prefix="bench-fork-vm.")
    try:
        argv = [python, str(ROOT / "benchmarks" / "vm_fork_bench.py"), "--sizes", a.sizes,
                "--repeats", str(a.repeats), "--criu-repeats", str(a.criu_repeats),
                "--out", os.path.join(share, "result.json")] + (["--no-criu"] if a.no_criu else [])
        print(f"guest command: {' '.join(argv)} (mem {a.mem}, {a.cpus} CPUs)", flush=True)

        def out(b: bytes) -> None:
            sys.stdout.write(b.decode(errors="replace"))
            sys.stdout.flush()

        def err(b: bytes) -> None:
            sys.stderr.write(b.decode(errors="replace"))
            sys.stderr.flush()

        try:
            r = run_vm(argv, mem=a.mem, cpus=a.cpus, timeout=a.timeout, shares=[share], load_module=True,
                       cwd=str(ROOT), on_stdout=out, on_stderr=err)
        except VMError as e:
            print(f"lab VM failed: {e}", file=sys.stderr)
            return 2
        print(f"(VM: exit status {r.status}, boot {r.boot_seconds:.1f} s, whole run {r.wall_seconds:.1f} s)")
        if a.out and os.path.exists(os.path.join(share, "result.json")):
            shutil.copy(os.path.join(share, "result.json"), a.out)
        return r.status
    finally:
        shutil.rmtree(share, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
