"""The live backend's fork engines side by side in the lab VM: ``bunshin`` vs ``criu`` and ``restart``.

    python benchmarks/bench_engines_vm.py [--repeats 5]

Boots the lab VM (module built and loaded, TCG) and runs ``benchmarks/vm_engines_bench.py``
there with this interpreter; its table is streamed here. Needs root.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bunshin_async._vm import DEFAULT_CACHE_DIR, VMError, run_vm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default="bunshin,criu,restart")
    ap.add_argument("--mem", default="2G")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--cache-dir", default=os.environ.get("BUNSHIN_VM_CACHE", DEFAULT_CACHE_DIR),
                    help="the lab VM's cache (kernel, module build): give each checkout its own")
    a = ap.parse_args()
    argv = [os.path.realpath(sys.executable), str(ROOT / "benchmarks" / "vm_engines_bench.py"), "--repeats", str(a.repeats),
            "--engines", a.engines]
    try:
        r = run_vm(argv, mem=a.mem, timeout=a.timeout, load_module=True, cwd=str(ROOT), cache_dir=a.cache_dir,
                   module=str(ROOT / "kmod"),
                   on_stdout=lambda b: (sys.stdout.write(b.decode(errors="replace")), sys.stdout.flush()),
                   on_stderr=lambda b: (sys.stderr.write(b.decode(errors="replace")), sys.stderr.flush()))
    except VMError as e:
        print(f"lab VM failed: {e}", file=sys.stderr)
        return 2
    print(f"(VM: exit status {r.status}, boot {r.boot_seconds:.1f} s, whole run {r.wall_seconds:.1f} s)")
    return r.status


if __name__ == "__main__":
    sys.exit(main())
