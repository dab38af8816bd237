"""The lab VM: Debian's kernel under qemu, with this host's root file system shared read-only.

The host this project runs on cannot load kernel modules, so the module (``kmod/``) is built
against Debian's ``linux-headers`` and tested in a small VM:

- the kernel image and headers come from apt (``apt-get download``) into a cache directory and
  are unpacked there (``dpkg-deb -x``): nothing is installed on the host, its boot is untouched;
- the initramfs is busybox (Debian's ``busybox-static``) with the modules the kernel needs to
  mount a 9p root; its ``/init`` mounts the host root read-only over 9p, writable tmpfs on
  ``/tmp``, ``/run`` and ``/dev/shm``, the writable shares, and ``switch_root``\\ s into the
  host root (which becomes the root of the mount namespace, as on a booted system) to run one
  command;
- the command's output and exit status are written to files on a writable 9p share (never
  through a pipe a background process could keep open), and the VM always powers off; the host
  kills qemu after a timeout.

:func:`run_vm` is the entry point; ``bunshin vm run`` (``_cmd_vm.py``) is its command line.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Self

import msgspec

from ._exceptions import VMError

__all__ = [
    "DEFAULT_CACHE_DIR",
    "KernelTree",
    "VMResult",
    "build_initramfs",
    "build_module",
    "default_kernel_version",
    "ensure_kernel",
    "kvm_usable",
    "normalize_kernel_version",
    "qemu_path",
    "run_vm",
]

DEFAULT_CACHE_DIR = "/var/cache/bunshin/vm"
FLAVOUR = "amd64"

# The modules Debian's kernel needs to mount a 9p root over virtio-pci, in load order (all =m in
# Debian's config). Their dependencies are resolved by busybox's modprobe from modules.dep.
ROOT_MODULES = (
    "virtio", "virtio_ring", "virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci",
    "netfs", "fscache", "9pnet", "9pnet_virtio", "9p",
)

# Where the init script says it stopped, written to the console when something fails.
_INIT_FAIL = "bunshin-init: FAILED:"

# The guest's /init (busybox ash). The run directory (a writable 9p share, tag "results") holds
# `job.sh` (the command), `shares` (one writable share path per line: tags share0, share1, ...),
# and receives `stdout`, `stderr`, `status` and `boot` (the guest's uptime when the job starts).
#
# Stage 1 (in the initramfs) mounts the 9p host root on /host and everything the command sees
# inside it, moves the initramfs's /proc, /sys and /dev there, and hands over with
# `switch_root`: the host root is moved onto / (the initramfs is emptied), pid 1 and the kernel's
# own threads (module requests) now see it as their root, and a mount namespace made later has
# it as its root mount (a chroot would leave the initramfs there, which CRIU refuses to dump).
# Stage 2 runs there with the host's static busybox (the one the initramfs was built from) and
# the run directory's paths as they are on the host.
_INIT = r"""#!/bin/busybox sh
export PATH=/bin
/bin/busybox --install -s /bin
fail() { echo "bunshin-init: FAILED: $*"; sync; poweroff -f; sleep 60; }
mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
exec </dev/console >/dev/console 2>&1
echo /bin/modprobe > /proc/sys/kernel/modprobe
for m in @ROOT_MODULES@; do modprobe "$m" || fail "modprobe $m"; done
RUN=
MODROOT=
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    bunshin.run=*) RUN="${arg#bunshin.run=}" ;;
    bunshin.modroot=*) MODROOT="${arg#bunshin.modroot=}" ;;
  esac
done
[ -n "$RUN" ] || fail "no bunshin.run= on the kernel command line"
H=/host
mkdir -p $H
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot $H \
  || fail "mount the host root (9p tag hostroot)"
[ -x $H@BUSYBOX@ ] || fail "the host root has no @BUSYBOX@ (the busybox this initramfs was built from)"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 results $H$RUN || fail "mount $RUN"
for d in /proc /sys /dev; do mount --move $d $H$d || fail "move $d into the host root"; done
mount -t cgroup2 cgroup2 $H/sys/fs/cgroup 2>/dev/null
mkdir -p $H/dev/pts $H/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $H/dev/pts || fail "mount $H/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs $H/dev/shm || fail "mount $H/dev/shm"
for d in /tmp /var/tmp; do mount -t tmpfs -o mode=1777 tmpfs $H$d || fail "mount tmpfs on $d"; done
mount -t tmpfs -o mode=0755 tmpfs $H/run || fail "mount tmpfs on /run"
i=0
while read -r p; do
  [ -n "$p" ] || continue
  mkdir -p "$H$p" 2>/dev/null
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "share$i" "$H$p" || fail "mount share $p"
  i=$((i + 1))
done < $H$RUN/shares
# The kernel's own module requests (CRIU's sock_diag, nf_tables, ...) after the switch: the
# host's modprobe on the image's module tree (the host has no /lib/modules for this kernel).
if [ -n "$MODROOT" ] && [ -d "$H$MODROOT/lib/modules" ]; then
  printf '#!@BUSYBOX@ sh\nexec /sbin/modprobe -d %s "$@"\n' "$MODROOT" > $H$RUN/modprobe \
    && chmod 755 $H$RUN/modprobe || fail "write $RUN/modprobe"
fi
ip link set lo up 2>/dev/null
hostname bunshin-vm
STAGE2='@STAGE2@'
exec switch_root $H @BUSYBOX@ sh -c "$STAGE2" stage2 "$RUN"
"""

# Stage 2 of /init, pid 1 after switch_root ($1: the run directory). Every tool is the host's
# static busybox, by absolute path.
_STAGE2 = r"""B=@BUSYBOX@
RUN=$1
fail() { echo "bunshin-init: FAILED: $*"; $B sync; $B poweroff -f; $B sleep 60; }
if [ -x $RUN/modprobe ]; then echo $RUN/modprobe > /proc/sys/kernel/modprobe; fi
$B cat /proc/uptime > $RUN/boot || fail "write $RUN/boot"
/usr/bin/env -i /bin/sh $RUN/job.sh > $RUN/stdout 2> $RUN/stderr
echo $? > $RUN/status.tmp
$B mv $RUN/status.tmp $RUN/status
$B dmesg > $RUN/dmesg
$B sync
$B poweroff -f
$B sleep 60
"""


class KernelTree(msgspec.Struct, frozen=True):
    """A Debian kernel image and its headers, unpacked in the cache."""

    version: str
    """The kernel release, e.g. ``6.1.0-56-amd64`` (``uname -r`` in the guest)."""
    root: str
    """The directory the packages were unpacked into (holds ``boot/``, ``lib/modules/``, ``usr/src/``)."""

    @property
    def vmlinuz(self) -> str:
        """The kernel image."""
        return os.path.join(self.root, "boot", f"vmlinuz-{self.version}")

    @property
    def modules_dir(self) -> str:
        """The image's modules (``lib/modules/VERSION``), with ``modules.dep``."""
        return os.path.join(self.root, "lib", "modules", self.version)

    @property
    def headers_dir(self) -> str:
        """The build tree to pass to ``make -C`` (``usr/src/linux-headers-VERSION``)."""
        return os.path.join(self.root, "usr", "src", f"linux-headers-{self.version}")


class VMResult(msgspec.Struct, frozen=True):
    """What a run of the lab VM gave back."""

    status: int
    """The command's exit status (128 + N when a signal N killed it)."""
    stdout: bytes
    """Everything the command wrote to its standard output."""
    stderr: bytes
    """Everything the command wrote to its standard error."""
    boot_seconds: float
    """The guest's uptime when the command started (kernel and init)."""
    wall_seconds: float
    """Host wall time from starting qemu until it exited."""
    console: str
    """The guest's serial console (kernel messages and init's)."""
    dmesg: str
    """The guest's kernel log after the command finished."""


# --- host tools ------------------------------------------------------------------------------


def _which(name: str, package: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)
    if path is None:
        raise VMError(f"{name} not found; install it with: apt-get install --no-install-recommends {package}")
    return path


def qemu_path() -> str | None:
    """The ``qemu-system-x86_64`` binary, or None if it is not installed."""
    return shutil.which("qemu-system-x86_64")


def _run_tool(argv: Sequence[str], what: str, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise VMError(f"{what}: cannot run {argv[0]}: {exc.strerror}") from exc
    if proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise VMError(f"{what}: `{shlex.join(argv)}` exited with status {proc.returncode}:\n{out}")
    return proc.stdout


def kvm_usable() -> bool:
    """Whether ``/dev/kvm`` can create a VM (open, API version 12, KVM_CREATE_VM succeeds).

    This does not prove that a guest runs well under KVM (on some nested hosts it does not):
    :func:`run_vm` uses KVM only when asked (``accel="kvm"``) or, with ``accel="auto"``, when
    this returns True and ``BUNSHIN_VM_KVM=1`` is set.
    """
    kvm_get_api_version, kvm_create_vm = 0xAE00, 0xAE01
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if fcntl.ioctl(fd, kvm_get_api_version) != 12:
            return False
        vm = fcntl.ioctl(fd, kvm_create_vm, 0)
        os.close(vm)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# --- the kernel: resolve, download, unpack ---------------------------------------------------


def normalize_kernel_version(version: str) -> str:
    """``6.1.0-56`` or ``6.1.0-56-amd64`` -> ``6.1.0-56-amd64``; anything else is a VMError."""
    v = version.strip()
    if not v.endswith(f"-{FLAVOUR}"):
        v = f"{v}-{FLAVOUR}"
    if not re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?(-[0-9]+|\+[a-z0-9.]+|-[0-9]+\+[a-z0-9.]+)-" + FLAVOUR, v):
        raise VMError(f"invalid kernel version {version!r}; expected Debian's ABI name, e.g. 6.1.0-56, "
                      "6.1.0-56-amd64 or 6.12.38+deb12")
    return v


def _depends(package: str) -> list[str]:
    out = _run_tool(["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                     "--no-breaks", "--no-replaces", "--no-enhances", package], f"resolving {package}")
    return [m.group(1) for m in re.finditer(r"^\s*\|?Depends:\s*(\S+)\s*$", out, re.MULTILINE)]


def _cached_versions(cache_dir: str) -> list[str]:
    try:
        names = os.listdir(cache_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if os.path.exists(os.path.join(cache_dir, n, ".complete")))


def default_kernel_version(cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The kernel ``linux-image-amd64`` depends on (Debian 12: the newest 6.1 kernel).

    Without apt's package lists (no ``apt-get update`` yet, or offline) the newest kernel
    already in the cache is used.
    """
    try:
        for dep in _depends(f"linux-image-{FLAVOUR}"):
            m = re.fullmatch(r"linux-image-(.+-" + FLAVOUR + ")", dep)
            if m:
                return m.group(1)
    except VMError:
        pass
    cached = _cached_versions(cache_dir)
    if cached:
        return cached[-1]
    raise VMError(f"cannot tell which kernel linux-image-{FLAVOUR} is: run `apt-get update` first, "
                  "or pass --kernel-version (e.g. 6.1.0-56)")


class _Lock:
    """An exclusive flock on a file: one process prepares a cache entry at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> Self:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


Step = Callable[[str], None]


def _no_step(_: str) -> None:
    pass


def ensure_kernel(version: str, cache_dir: str = DEFAULT_CACHE_DIR, step: Step = _no_step) -> KernelTree:
    """Download (once) and unpack Debian's kernel image and headers for *version* into the cache.

    The packages (``linux-image-V``, ``linux-headers-V``, its ``-common`` and ``linux-kbuild``
    packages) are fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into
    ``CACHE/V/root``; nothing is installed on the host. The headers' Makefile is pointed at the
    unpacked ``-common`` tree, and ``depmod -b`` indexes the unpacked modules. A later call
    returns the cached tree at once.
    """
    version = normalize_kernel_version(version)
    base = os.path.join(cache_dir, version)
    tree = KernelTree(version=version, root=os.path.join(base, "root"))
    if os.path.exists(os.path.join(base, ".complete")):
        return tree
    with _Lock(os.path.join(cache_dir, f".{version}.lock")):
        if os.path.exists(os.path.join(base, ".complete")):
            return tree
        image, headers = f"linux-image-{version}", f"linux-headers-{version}"
        step(f"resolving {image} and {headers} with apt")
        try:
            deps = _depends(headers)
        except VMError:
            deps = []
        if not deps:
            raise VMError(f"apt does not know {headers}; run `apt-get update`, or choose a version "
                          f"from `apt-cache search --names-only '^linux-image-6.*-{FLAVOUR}$'`")
        extra = [d for d in deps if d.startswith(("linux-headers-", "linux-kbuild-"))]
        packages = [image, headers, *extra]
        os.makedirs(base, exist_ok=True)
        debs = os.path.join(base, "debs")
        os.makedirs(debs, exist_ok=True)
        step(f"downloading {', '.join(packages)} (about 90 MB, once)")
        _run_tool([_which("apt-get", "apt"), "download", "-q", "-o", "APT::Sandbox::User=root", *packages],
                  f"downloading the kernel {version}", cwd=debs)
        root_tmp = tempfile.mkdtemp(prefix="root.", dir=base)
        step("unpacking the kernel packages")
        dpkg_deb = _which("dpkg-deb", "dpkg")
        for deb in sorted(os.listdir(debs)):
            if deb.endswith(".deb"):
                _run_tool([dpkg_deb, "-x", os.path.join(debs, deb), root_tmp], f"unpacking {deb}")
        root_final = tree.root
        if os.path.exists(root_final):
            shutil.rmtree(root_final)
        os.rename(root_tmp, root_final)
        _fix_headers_makefile(tree)
        step("indexing the kernel modules (depmod -b)")
        _run_tool([_which("depmod", "kmod"), "-b", tree.root, version], "depmod")
        for name in (tree.vmlinuz, tree.modules_dir, os.path.join(tree.headers_dir, "Makefile")):
            if not os.path.exists(name):
                raise VMError(f"the kernel packages for {version} did not provide {name}")
        shutil.rmtree(debs, ignore_errors=True)
        Path(base, ".complete").write_text(" ".join(packages) + "\n")
    return tree


def _fix_headers_makefile(tree: KernelTree) -> None:
    """Debian's headers Makefile includes ``/usr/src/linux-headers-V-common/Makefile`` by
    absolute path: point it at the unpacked copy (its other links are relative)."""
    mk = Path(tree.headers_dir, "Makefile")
    text = mk.read_text()
    src = os.path.join(tree.root, "usr", "src")
    mk.write_text(re.sub(r"^include /usr/src/", f"include {src}/", text, flags=re.MULTILINE))


# --- the initramfs ---------------------------------------------------------------------------


def _is_static_elf(path: str) -> bool:
    """True if *path* is an ELF executable without a program interpreter (statically linked)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit only
            return False
        endian = "<" if head[5] == 1 else ">"
        phoff, = struct.unpack_from(endian + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(endian + "HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from(endian + "I", table, i * phentsize)[0] != 3 for i in range(phnum))


def _busybox() -> str:
    for path in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.exists(path) and _is_static_elf(path):
            return path
    raise VMError("a statically linked busybox is needed for the initramfs; install it with: "
                  "apt-get install --no-install-recommends busybox-static")


class _Cpio:
    """A newc cpio archive (what the kernel unpacks as an initramfs), written in order."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        raw = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0)
        head = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.ino += 1
        self.parts.append(head + raw + b"\0" * (-(len(head) + len(raw)) % 4))
        self.parts.append(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str, perm: int = 0o755) -> None:
        self._entry(name, 0o040000 | perm)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, 0o100000 | perm, data)

    def close(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return b"".join(self.parts)


def _module_closure(modules_dir: str, names: Iterable[str]) -> list[str]:
    """The paths (relative to *modules_dir*) of *names* and everything they depend on."""
    deps: dict[str, list[str]] = {}
    with open(os.path.join(modules_dir, "modules.dep")) as f:
        for line in f:
            path, _, rest = line.partition(":")
            deps[path] = rest.split()
    by_name = {os.path.basename(p).split(".ko")[0].replace("-", "_"): p for p in deps}
    todo = []
    for n in names:
        if n.replace("-", "_") not in by_name:
            raise VMError(f"the kernel has no module {n} (needed for the 9p root) in {modules_dir}")
        todo.append(by_name[n.replace("-", "_")])
    seen: list[str] = []
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo.extend(deps.get(p, []))
    return sorted(seen)


def _init_script(busybox: str) -> str:
    """The initramfs's /init for a host whose static busybox is *busybox*."""
    if "'" in _STAGE2:
        raise AssertionError("stage 2 of /init is passed in single quotes: it must not contain one")
    return (_INIT.replace("@STAGE2@", _STAGE2).replace("@ROOT_MODULES@", " ".join(ROOT_MODULES))
            .replace("@BUSYBOX@", busybox))


def build_initramfs(tree: KernelTree, cache_dir: str = DEFAULT_CACHE_DIR, step: Step = _no_step) -> str:
    """Build (or reuse) the busybox initramfs for *tree*; returns its path.

    It holds the static busybox, ``/init`` and the 9p-root modules with their own
    ``modules.dep`` (``depmod -b`` on a copy). It is rebuilt when the init script, busybox or
    the module set changes.
    """
    busybox = _busybox()
    init = _init_script(busybox)
    rel = _module_closure(tree.modules_dir, ROOT_MODULES)
    key = hashlib.sha256()
    key.update(init.encode())
    key.update(str(os.stat(busybox).st_mtime_ns).encode())
    key.update("\n".join(rel).encode())
    out = os.path.join(cache_dir, tree.version, f"initramfs-{key.hexdigest()[:16]}.cpio")
    if os.path.exists(out):
        return out
    step("building the busybox initramfs")
    with tempfile.TemporaryDirectory(prefix="initramfs.", dir=os.path.join(cache_dir, tree.version)) as tmp:
        mods = os.path.join(tmp, "lib", "modules", tree.version)
        for r in rel:
            os.makedirs(os.path.dirname(os.path.join(mods, r)), exist_ok=True)
            shutil.copy2(os.path.join(tree.modules_dir, r), os.path.join(mods, r))
        for name in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
            src = os.path.join(tree.modules_dir, name)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(mods, name))
        _run_tool([_which("depmod", "kmod"), "-b", tmp, tree.version], "depmod for the initramfs")
        cpio = _Cpio()
        for d in ("bin", "dev", "proc", "sys", "host", "tmp", "lib", "lib/modules"):
            cpio.dir(d)
        with open(busybox, "rb") as f:
            cpio.file("bin/busybox", f.read(), 0o755)
        cpio.file("init", init.encode(), 0o755)
        for dirpath, dirnames, filenames in os.walk(mods):
            dirnames.sort()
            relpath = os.path.relpath(dirpath, tmp)
            if relpath != "lib/modules":
                cpio.dir(relpath)
            for fn in sorted(filenames):
                with open(os.path.join(dirpath, fn), "rb") as f:
                    cpio.file(os.path.join(relpath, fn), f.read())
        data = cpio.close()
    tmp_out = out + ".tmp"
    with open(tmp_out, "wb") as f:
        f.write(data)
    os.rename(tmp_out, out)
    for old in os.listdir(os.path.dirname(out)):  # earlier builds
        if old.startswith("initramfs-") and old.endswith(".cpio") and os.path.join(os.path.dirname(out), old) != out:
            os.unlink(os.path.join(os.path.dirname(out), old))
    return out


# --- the module ------------------------------------------------------------------------------


def kmod_source_dir() -> str | None:
    """``kmod/`` of a source checkout (an editable install), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    d = os.path.join(os.path.dirname(here), "kmod")
    return d if os.path.exists(os.path.join(d, "Kbuild")) else None


def build_module(tree: KernelTree, src_dir: str, cache_dir: str = DEFAULT_CACHE_DIR, step: Step = _no_step) -> str:
    """Build the kernel module in *src_dir* against *tree*'s headers; returns the ``.ko`` path.

    The sources are copied to ``CACHE/VERSION/kmod-HASH``, HASH being a digest of their
    contents, and built there with ``make -C HEADERS M=...``: the source tree is left clean,
    and checkouts with different sources never share a build (file times cannot tell them
    apart: a copy made from another checkout may be newer than this one's edits).
    """
    ignore = shutil.ignore_patterns("*.o", "*.ko", "*.mod*", ".*.cmd", "Module.symvers",
                                    "modules.order", ".tmp_versions")
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(src_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in ignore(dirpath, dirnames))
        for name in sorted(set(filenames) - set(ignore(dirpath, filenames))):
            path = os.path.join(dirpath, name)
            digest.update(os.path.relpath(path, src_dir).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    build = os.path.join(cache_dir, tree.version, f"kmod-{digest.hexdigest()[:12]}")
    step(f"building the module ({src_dir}) for {tree.version}")
    shutil.copytree(src_dir, build, dirs_exist_ok=True, ignore=ignore)
    _run_tool([_which("make", "make"), "-s", "-C", tree.headers_dir, f"M={build}", "modules"],
              "building the module")
    kos = sorted(p for p in os.listdir(build) if p.endswith(".ko"))
    if not kos:
        raise VMError(f"building the module in {build} made no .ko file")
    return os.path.join(build, kos[0])


# --- running ---------------------------------------------------------------------------------


_GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _job_script(argv: Sequence[str], cwd: str, env: dict[str, str], load_module: str | None) -> str:
    lines = ["# written by bunshin vm run: the command, run in the host root", "set -u"]
    for k, v in env.items():
        lines.append(f"export {k}={shlex.quote(v)}")
    lines.append(f"cd {shlex.quote(cwd)} 2>/dev/null || cd /")
    if load_module:
        lines.append(f"/usr/sbin/insmod {shlex.quote(load_module)} || exit 125")
    lines.append("exec " + shlex.join(argv))
    return "\n".join(lines) + "\n"


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


MASKED_IN_GUEST = ("/tmp", "/var/tmp", "/run", "/dev/shm")
"""Host directories the guest covers with its own tmpfs: what lives there is not visible."""


def shares_for(*paths: str) -> list[str]:
    """The directories to share so that *paths* are visible in the guest: each path that lies
    under a directory the guest covers with tmpfs (a checkout or a venv under /tmp, say)."""
    out: list[str] = []
    for p in paths:
        real = os.path.realpath(p)
        if any(real == m or real.startswith(m + "/") for m in MASKED_IN_GUEST) and real not in out:
            out.append(real)
    return out


def run_vm(
    argv: Sequence[str],
    *,
    kernel_version: str | None = None,
    mem: str = "2G",
    cpus: int = 2,
    timeout: float = 600.0,
    shares: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    accel: str = "auto",
    module: bool | str = True,
    load_module: bool = False,
    cache_dir: str = DEFAULT_CACHE_DIR,
    step: Step = _no_step,
    on_stdout: Callable[[bytes], None] | None = None,
    on_stderr: Callable[[bytes], None] | None = None,
) -> VMResult:
    """Run *argv* in the lab VM and return its output and exit status.

    Args:
        argv: the command, run in the host root (read-only, the guest's root after
            ``switch_root``); call programs by absolute path or rely on the standard ``PATH``.
        kernel_version: Debian's kernel ABI name (``6.1.0-56``); default: what
            ``linux-image-amd64`` depends on.
        mem: guest memory (qemu's ``-m``).
        cpus: guest CPUs.
        timeout: seconds before qemu is killed (a :class:`VMError`).
        shares: host directories shared writable at the same path in the guest.
        env: extra environment variables for the command.
        cwd: the command's working directory (default: the caller's; ``/`` if it is missing).
        accel: ``tcg``, ``kvm`` or ``auto`` (TCG unless ``BUNSHIN_VM_KVM=1`` and KVM works).
        module: build the kernel module from a source checkout's ``kmod/`` (True), from the
            given directory (a path), or not at all (False). The command finds the ``.ko``
            in ``$BUNSHIN_KO``.
        load_module: ``insmod`` the module before the command (exit status 125 if it fails).
        cache_dir: where kernels, initramfs images, module builds and run directories live.
        step: called with a description of each preparation step (progress display).
        on_stdout, on_stderr: called with the command's output as it arrives.
    """
    qemu = qemu_path()
    if qemu is None:
        raise VMError("qemu-system-x86_64 not found; install it with: "
                      "apt-get install --no-install-recommends qemu-system-x86")
    if not argv:
        raise VMError("no command given; usage: bunshin vm run -- CMD [ARGS...]")
    if cpus < 1:
        raise VMError(f"--cpus must be at least 1, not {cpus}")
    if accel not in ("auto", "tcg", "kvm"):
        raise VMError(f"--accel must be auto, tcg or kvm, not {accel!r}")
    shares = [os.path.realpath(s) for s in shares]
    for s in shares:
        if not os.path.isdir(s):
            raise VMError(f"--share {s}: not a directory")
        if s == "/":
            raise VMError("--share /: the host root is already shared (read-only); share a directory")
    os.makedirs(cache_dir, exist_ok=True)
    version = normalize_kernel_version(kernel_version) if kernel_version else default_kernel_version(cache_dir)
    tree = ensure_kernel(version, cache_dir, step)
    initrd = build_initramfs(tree, cache_dir, step)
    ko: str | None = None
    if module:
        src = module if isinstance(module, str) else kmod_source_dir()
        if src is None:
            if load_module:
                raise VMError("--load-module: no kmod/ source directory found (run from a source checkout)")
        else:
            ko = build_module(tree, src, cache_dir, step)
    if load_module and ko is None:
        raise VMError("--load-module needs the module to be built (drop --no-module)")

    use_kvm = accel == "kvm" or (accel == "auto" and os.environ.get("BUNSHIN_VM_KVM") == "1" and kvm_usable())
    runs = os.path.join(cache_dir, "runs")
    os.makedirs(runs, exist_ok=True)
    run = tempfile.mkdtemp(prefix="run.", dir=runs)
    try:
        guest_env = {"PATH": _GUEST_PATH, "HOME": "/root", "TERM": os.environ.get("TERM", "dumb"),
                     "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "BUNSHIN_VM": "1",
                     "BUNSHIN_VM_KERNEL": version, "BUNSHIN_VM_MODULES_ROOT": tree.root}
        if ko:
            guest_env["BUNSHIN_KO"] = ko
        guest_env.update(env or {})
        Path(run, "job.sh").write_text(_job_script(argv, cwd or os.getcwd(), guest_env, ko if load_module else None))
        Path(run, "shares").write_text("".join(f"{s}\n" for s in shares))
        cmdline = (f"console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init "
                   f"bunshin.run={run} bunshin.modroot={tree.root}")
        if any(c.isspace() or c == "," for c in run + tree.root):
            raise VMError(f"the cache directory {cache_dir!r} must not contain white space or commas")
        qargs = [
            qemu, "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
            "-machine", "q35", "-m", mem, "-smp", str(cpus),
            "-accel", "kvm" if use_kvm else "tcg",
            "-kernel", tree.vmlinuz, "-initrd", initrd, "-append", cmdline,
            "-serial", f"file:{os.path.join(run, 'console')}", "-monitor", "none",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={run},mount_tag=results,security_model=passthrough,multidevs=remap",
        ]
        if not use_kvm:
            qargs[qargs.index("-accel") + 1] = "tcg,thread=multi" if cpus > 1 else "tcg"
            # every instruction set extension TCG emulates (SSE4, AVX2, ...): the default qemu64
            # model lacks what numpy's wheels need (they die of SIGILL)
            qargs[qargs.index("-machine"):qargs.index("-machine")] = ["-cpu", "max"]
        for i, s in enumerate(shares):
            if "," in s:
                raise VMError(f"--share {s}: qemu cannot share a path with a comma")
            qargs += ["-virtfs", f"local,path={s},mount_tag=share{i},security_model=passthrough,multidevs=remap"]
        return _boot(qargs, run, timeout, step, on_stdout, on_stderr)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _boot(qargs: list[str], run: str, timeout: float, step: Step,
          on_stdout: Callable[[bytes], None] | None, on_stderr: Callable[[bytes], None] | None) -> VMResult:
    step("booting the VM")
    out_pos = {"stdout": 0, "stderr": 0}
    sinks = {"stdout": on_stdout, "stderr": on_stderr}

    def pump() -> None:
        for name, pos in out_pos.items():
            sink = sinks[name]
            path = os.path.join(run, name)
            if sink is None or not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            if chunk:
                out_pos[name] = pos + len(chunk)
                sink(chunk)

    start = time.monotonic()
    proc = subprocess.Popen(qargs, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    announced = False
    timed_out = False
    try:
        while True:
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if not announced and os.path.exists(os.path.join(run, "boot")):
                step("running the command in the VM")
                announced = True
            pump()
            if time.monotonic() - start > timeout:
                timed_out = True
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        qemu_out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        if proc.stdout:
            proc.stdout.close()
    wall = time.monotonic() - start
    pump()

    def read(name: str) -> str:
        try:
            return Path(run, name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    console = read("console")
    if timed_out:
        raise VMError(f"the VM did not finish within {timeout:g} s and was killed; "
                      f"the guest console ended with:\n{_tail(console)}")
    status_text = read("status").strip()
    if not status_text:
        why = next((ln for ln in console.splitlines() if _INIT_FAIL in ln), None)
        detail = why.split(_INIT_FAIL, 1)[1].strip() if why else f"qemu exited with status {proc.returncode}"
        raise VMError(f"the VM stopped before the command finished ({detail}); "
                      f"qemu said: {qemu_out.strip()[-2000:] or '(nothing)'}; "
                      f"the guest console ended with:\n{_tail(console)}")
    try:
        boot = float(read("boot").split()[0])
    except (IndexError, ValueError):
        boot = float("nan")
    return VMResult(
        status=int(status_text),
        stdout=Path(run, "stdout").read_bytes() if os.path.exists(os.path.join(run, "stdout")) else b"",
        stderr=Path(run, "stderr").read_bytes() if os.path.exists(os.path.join(run, "stderr")) else b"",
        boot_seconds=boot,
        wall_seconds=wall,
        console=console,
        dmesg=read("dmesg"),
    )


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m bunshin_async._vm CMD...
    r = run_vm(sys.argv[1:], step=lambda s: print(f"-- {s}", file=sys.stderr),
               on_stdout=sys.stdout.buffer.write, on_stderr=sys.stderr.buffer.write)
    print(f"-- status {r.status}, boot {r.boot_seconds:.2f} s, wall {r.wall_seconds:.2f} s", file=sys.stderr)
    sys.exit(r.status)
