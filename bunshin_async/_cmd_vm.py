"""``bunshin vm``: the lab VM, for hosts that cannot load the kernel module.

``bunshin vm run -- CMD...``   boot Debian's kernel under qemu with this host's root file system
                               shared read-only as its root, run CMD there and return its
                               output and exit status;
``bunshin vm prepare``         download the kernel, build the initramfs and the module, no boot;
``bunshin vm test``            run the in-VM module test suite (tests/vm/) of a source checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Self

from rich.console import Console

from ._cli import _say
from ._exceptions import ConfigError

__all__ = ["register"]


class _Steps:
    """Shows each preparation step on stderr: a spinner on a terminal, one line per step."""

    def __init__(self, quiet: bool) -> None:
        self.console = Console(stderr=True)
        self.quiet = quiet
        self.status: Any = None
        self.current: str | None = None
        self.since = time.monotonic()

    def __enter__(self) -> Self:
        if not self.quiet and self.console.is_terminal:
            self.status = self.console.status("preparing the lab VM")
            self.status.start()
        return self

    def finish(self) -> None:
        if self.current is not None and not self.quiet:
            _say(self.console, f"vm: {self.current} ({time.monotonic() - self.since:.1f} s)", "dim")
        self.current = None

    def __call__(self, text: str) -> None:
        self.finish()
        self.current, self.since = text, time.monotonic()
        if text.startswith("running the command"):
            self.stop()  # the command's own output follows
            self.current = None
        elif self.status is not None:
            self.status.update(text)

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write(stream: Any) -> Any:
    def sink(chunk: bytes) -> None:
        stream.buffer.write(chunk)
        stream.buffer.flush()

    return sink


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def _run_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"kernel_version": args.kernel_version, "mem": args.mem, "cpus": args.cpus, "timeout": args.timeout,
                "accel": args.accel, "cache_dir": args.cache_dir,
                "module": False if args.no_module else (args.module_dir or True)}


def cmd_vm_run(args: argparse.Namespace, console: Console) -> int:
    """``bunshin vm run``: one command in the lab VM; exits with the command's status."""
    from ._vm import run_vm

    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("no command given; usage: bunshin vm run [OPTIONS] -- CMD [ARGS...]")
    with _Steps(args.quiet) as steps:
        result = run_vm(argv, shares=args.share, env=_env(args.env), cwd=args.cwd, load_module=args.load_module,
                        step=steps, on_stdout=_write(sys.stdout), on_stderr=_write(sys.stderr), **_run_args(args))
    if not args.quiet:
        _say(Console(stderr=True), f"vm: exit status {result.status}; guest boot {result.boot_seconds:.2f} s, "
                                   f"whole VM {result.wall_seconds:.2f} s", "dim")
    if args.console:
        _say(Console(stderr=True), result.console)
    return result.status


def cmd_vm_prepare(args: argparse.Namespace, console: Console) -> int:
    """``bunshin vm prepare``: fill the cache (kernel, initramfs, module) without booting."""
    from ._vm import (
        build_initramfs,
        build_module,
        default_kernel_version,
        ensure_kernel,
        kmod_source_dir,
    )

    with _Steps(args.quiet) as steps:
        version = args.kernel_version or default_kernel_version(args.cache_dir)
        tree = ensure_kernel(version, args.cache_dir, steps)
        initrd = build_initramfs(tree, args.cache_dir, steps)
        src = None if args.no_module else (args.module_dir or kmod_source_dir())
        ko = build_module(tree, src, args.cache_dir, steps) if src else None
        steps.finish()
    _say(console, f"kernel  {tree.vmlinuz}")
    _say(console, f"headers {tree.headers_dir}")
    _say(console, f"initrd  {initrd}")
    _say(console, f"module  {ko or '(not built)'}")
    return 0


def vm_suite_argv(python: str, root: str, junit: str | None = None, extra: list[str] | None = None) -> list[str]:
    """The command that runs the in-VM suite (tests/vm/) of the checkout at *root*."""
    argv = ["/usr/bin/env", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", python, "-m", "pytest",
            "-c", os.path.join(root, "tests", "vm", "pytest.ini"), "--rootdir", os.path.join(root, "tests", "vm"),
            "-v", os.path.join(root, "tests", "vm")]
    if junit:
        argv.append(f"--junitxml={junit}")
    return argv + (extra or [])


def cmd_vm_test(args: argparse.Namespace, console: Console) -> int:
    """``bunshin vm test``: the module's in-VM test suite; exits with pytest's status."""
    from ._vm import kmod_source_dir, run_vm, shares_for

    src = kmod_source_dir()
    if src is None:
        raise ConfigError("bunshin vm test needs a source checkout (kmod/ and tests/vm/ beside bunshin_async/)")
    root = os.path.dirname(src)
    with _Steps(args.quiet) as steps:
        extra = [a for i, a in enumerate(args.pytest_args) if i or a != "--"]
        # a checkout or a Python under /tmp (say) is hidden by the guest's tmpfs: share it
        shares = shares_for(root, sys.prefix)
        result = run_vm(vm_suite_argv(sys.executable, root, extra=extra), step=steps, shares=shares,
                        on_stdout=_write(sys.stdout), on_stderr=_write(sys.stderr), **_run_args(args))
    if not args.quiet:
        _say(Console(stderr=True), f"vm: exit status {result.status}; guest boot {result.boot_seconds:.2f} s, "
                                   f"whole VM {result.wall_seconds:.2f} s", "dim")
    return result.status


def _common(p: argparse.ArgumentParser) -> None:
    from ._vm import DEFAULT_CACHE_DIR

    p.add_argument("--kernel-version", metavar="V",
                   help="Debian kernel ABI, e.g. 6.1.0-56 (default: what linux-image-amd64 depends on)")
    p.add_argument("--cache-dir", default=os.environ.get("BUNSHIN_VM_CACHE", DEFAULT_CACHE_DIR),
                   help=f"kernels, initramfs, module builds (default $BUNSHIN_VM_CACHE or {DEFAULT_CACHE_DIR})")
    p.add_argument("--no-module", action="store_true", help="do not build the kernel module")
    p.add_argument("--module-dir", metavar="DIR", help="build the module from DIR (default: the checkout's kmod/)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _boot_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mem", default="2G", help="guest memory (default 2G)")
    p.add_argument("--cpus", type=int, default=2, help="guest CPUs (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="kill the VM after this many seconds (default 600)")
    p.add_argument("--accel", choices=("auto", "tcg", "kvm"), default="auto",
                   help="auto: TCG, or KVM when BUNSHIN_VM_KVM=1 and /dev/kvm works (default auto)")


def register(sub: Any, trace_sub: Any) -> None:
    """Add ``bunshin vm run|prepare|test``."""
    p = sub.add_parser("vm", help="the lab VM: run a command under Debian's kernel (module tests)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vsub = p.add_subparsers(dest="vm_command", required=True, metavar="SUBCOMMAND")

    r = vsub.add_parser("run", help="run CMD in the lab VM; exit with its status",
                        description="Boot the lab VM and run CMD in this host's root (the guest's root, read-only; "
                                    "/tmp, /run, /var/tmp and /dev/shm are tmpfs). The built module's path is "
                                    "in $BUNSHIN_KO.")
    _common(r)
    _boot_options(r)
    r.add_argument("--share", action="append", default=[], metavar="DIR",
                   help="share host directory DIR writable at the same path (repeatable)")
    r.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set a variable (repeatable)")
    r.add_argument("--cwd", help="working directory of CMD (default: the current one)")
    r.add_argument("--load-module", action="store_true", help="insmod the module before CMD")
    r.add_argument("--console", action="store_true", help="print the guest's serial console afterwards")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    r.set_defaults(fn=cmd_vm_run)

    pr = vsub.add_parser("prepare", help="download the kernel, build the initramfs and the module (no boot)")
    _common(pr)
    pr.set_defaults(fn=cmd_vm_prepare)

    t = vsub.add_parser("test", help="run the module's in-VM test suite (tests/vm/) of this checkout")
    _common(t)
    _boot_options(t)
    t.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="-- PYTEST_ARGS", help="extra pytest arguments")
    t.set_defaults(fn=cmd_vm_test)
