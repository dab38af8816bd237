"""The kernel module, checked inside the lab VM (run by tests/test_vm.py through ``bunshin vm run``).

Not collected on the host (the name does not match ``test_*.py``): it loads a kernel module.
In the VM it runs as root with the module's path in ``$BUNSHIN_KO``::

    bunshin vm run -- python3 -m pytest -p no:cacheprovider tests/vm/vm_module.py

The ioctl numbers and layouts are read from the uapi header, the one contract with user space.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
UAPI = ROOT / "kmod" / "include" / "uapi" / "linux" / "bunshin.h"
DEVICE = "/dev/bunshin"
MODULE = "bunshin"

pytestmark = pytest.mark.skipif(os.environ.get("BUNSHIN_VM") != "1" or os.geteuid() != 0,
                                reason="runs only as root inside the lab VM (bunshin vm run)")

# --- the uapi header ---------------------------------------------------------------------------


def _defines() -> dict[str, str]:
    return dict(re.findall(r"^#define\s+(\w+)\s+(.+?)\s*$", UAPI.read_text(), re.MULTILINE))


_D = _defines()
ABI_VERSION = int(_D["BUNSHIN_ABI_VERSION"], 0)
MAGIC = int(_D["BUNSHIN_IOC_MAGIC"], 0)
FEATURE_VERSION = 1 << 0
FEATURE_FORK_SYMBOLS = 1 << 1
assert _D["BUNSHIN_FEATURE_VERSION"] == "(1ULL << 0)" and _D["BUNSHIN_FEATURE_FORK_SYMBOLS"] == "(1ULL << 1)"

# struct bunshin_version: flags, abi_version (u32); features (u64); kernel_version, reserved0 (u32);
# reserved[5] (u64).
VERSION_FMT = "=IIQII5Q"
VERSION_SIZE = struct.calcsize(VERSION_FMT)
assert VERSION_SIZE == 64


def _ioc(direction: int, nr: int, size: int, magic: int = MAGIC) -> int:
    return (direction << 30) | (size << 16) | (magic << 8) | nr


_IOC_WRITE, _IOC_READ = 1, 2
IOC_VERSION = _ioc(_IOC_READ | _IOC_WRITE, 0x00, VERSION_SIZE)
assert "_IOWR(BUNSHIN_IOC_MAGIC, 0x00, struct bunshin_version)" in _D["BUNSHIN_IOC_VERSION"]

# --- syscalls ----------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_finit_module, SYS_delete_module, SYS_capget, SYS_capset = 313, 176, 125, 126
CAP_SYS_ADMIN, CAP_CHECKPOINT_RESTORE = 21, 40


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def load_module(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.syscall(SYS_finit_module, fd, b"", 0), f"finit_module {path}")
    finally:
        os.close(fd)


def unload_module(name: str = MODULE) -> None:
    _check(_libc.syscall(SYS_delete_module, name.encode(), os.O_NONBLOCK), f"delete_module {name}")


def module_loaded(name: str = MODULE) -> bool:
    return os.path.exists(f"/sys/module/{name}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_effective_caps(caps: set[int]) -> None:
    """Make *caps* the calling thread's effective set (kept permitted, so it can be undone)."""
    hdr = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.syscall(SYS_capget, ctypes.byref(hdr), data), "capget")
    eff = [0, 0]
    for c in caps:
        eff[c // 32] |= 1 << (c % 32)
    for i in range(2):
        data[i].effective = eff[i] & data[i].permitted
    _check(_libc.syscall(SYS_capset, ctypes.byref(hdr), data), "capset")


def in_child(fn) -> int:
    """Run *fn* in a forked child; return its exit status (fn's return value, 99 on an exception)."""
    pid = os.fork()
    if pid == 0:
        try:
            code = fn()
        except BaseException:  # noqa: BLE001 - report through the exit status
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def errno_of(fn) -> int:
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return 0


# --- fixtures ----------------------------------------------------------------------------------

_BAD_KERNEL_LOG = re.compile(r"WARNING:|BUG:|Oops|Call Trace|general protection|refcount_t:|list_(add|del) corruption"
                             r"|kernel BUG|UBSAN|KASAN|\bleak")


def kernel_log() -> str:
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    lines = []
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:  # EPIPE: the ring buffer overwrote a record we had not read
                if exc.errno == errno.EPIPE:
                    continue
                raise
            lines.append(rec.decode(errors="replace").split(";", 1)[-1].rstrip("\n"))
    finally:
        os.close(fd)
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def loaded_module():
    ko = os.environ.get("BUNSHIN_KO")
    assert ko and os.path.exists(ko), "BUNSHIN_KO must name the built bunshin.ko (bunshin vm run sets it)"
    if module_loaded():
        unload_module()
    load_module(ko)
    for _ in range(100):  # devtmpfs creates the node asynchronously
        if os.path.exists(DEVICE):
            break
        time.sleep(0.01)
    yield ko
    if module_loaded():
        unload_module()


@pytest.fixture
def dev():
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def version(fd: int, buf: bytes | None = None) -> tuple[int, ...]:
    arg = bytearray(buf if buf is not None else bytes(VERSION_SIZE))
    fcntl.ioctl(fd, IOC_VERSION, arg)  # the module writes the answer into arg
    return struct.unpack(VERSION_FMT, arg)


# --- the tests ---------------------------------------------------------------------------------


def test_device_node() -> None:
    st = os.stat(DEVICE)
    assert stat.S_ISCHR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert os.major(st.st_rdev) == 10  # a misc device
    misc = Path("/sys/class/misc/bunshin/dev").read_text().strip()
    assert misc == f"10:{os.minor(st.st_rdev)}"


def test_module_metadata() -> None:
    assert Path("/sys/module/bunshin/initstate").read_text().strip() == "live"
    taint = Path("/sys/module/bunshin/taint").read_text().strip()
    assert "O" in taint  # out of tree; never "P" (proprietary): the module is GPL


def test_version(dev: int) -> None:
    flags, abi, features, kver, reserved0, *reserved = version(dev)
    assert (flags, abi, reserved0, reserved) == (0, ABI_VERSION, 0, [0] * 5)
    assert features & FEATURE_VERSION
    # 1 << 2 to 1 << 5: FORK and its flags (vm_fork.py)
    assert features & ~(FEATURE_VERSION | FEATURE_FORK_SYMBOLS | (0x3F << 2)) == 0
    major, minor, _patch = (int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", Path("/proc/sys/kernel/osrelease")
                                                     .read_text()).groups())
    assert kver >> 16 == major and (kver >> 8) & 0xFF == minor


def test_fork_symbols_resolved(dev: int) -> None:
    """DESIGN.md: kallsyms_lookup_name via a kprobe finds the fork internals on Debian's 6.1."""
    features = version(dev)[2]
    assert features & FEATURE_FORK_SYMBOLS, kernel_log()[-2000:]


def test_version_overwrites_every_output_byte(dev: int) -> None:
    """Output fields the caller filled with garbage come back as the module's values: no stale or
    uninitialised byte is copied out."""
    garbage = struct.pack(VERSION_FMT, 0, 0xDEADBEEF, 0xFFFF_FFFF_FFFF_FFFF, 0xDEADBEEF, 0, 0, 0, 0, 0, 0)
    got = version(dev, garbage)
    assert got == version(dev)
    assert got[1] == ABI_VERSION and got[3] != 0xDEADBEEF


@pytest.mark.parametrize("field", ["flags", "reserved0", "reserved[0]", "reserved[4]"])
def test_version_rejects_nonzero_inputs(dev: int, field: str) -> None:
    values = [0] * 10
    values[{"flags": 0, "reserved0": 4, "reserved[0]": 5, "reserved[4]": 9}[field]] = 1
    buf = bytearray(struct.pack(VERSION_FMT, *values))
    assert errno_of(lambda: fcntl.ioctl(dev, IOC_VERSION, buf)) == errno.EINVAL


@pytest.mark.parametrize("cmd", [
    pytest.param(_ioc(3, 0x7F, VERSION_SIZE), id="unknown-nr"),
    pytest.param(_ioc(3, 0x00, VERSION_SIZE, magic=0xBC), id="other-magic"),
    pytest.param(_ioc(3, 0x00, VERSION_SIZE - 8), id="short-size"),
    pytest.param(_ioc(3, 0x00, VERSION_SIZE + 8), id="long-size"),
    pytest.param(_ioc(_IOC_READ, 0x00, VERSION_SIZE), id="read-only-direction"),
    pytest.param(0, id="zero"),
    pytest.param(0x5401, id="TCGETS"),
])
def test_unknown_command_is_enotty(dev: int, cmd: int) -> None:
    buf = bytearray(VERSION_SIZE + 8)
    assert errno_of(lambda: fcntl.ioctl(dev, cmd, buf)) == errno.ENOTTY


def test_null_argument_is_efault(dev: int) -> None:
    assert errno_of(lambda: raw_ioctl(dev, IOC_VERSION, 0)) == errno.EFAULT


_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
PROT_NONE = 0


def raw_ioctl(fd: int, cmd: int, addr: int) -> None:
    """ioctl(2) with a raw address (fcntl.ioctl passes integers as a C int)."""
    _check(_libc.ioctl(fd, cmd, addr), "ioctl")


@pytest.fixture
def pages():
    """Two anonymous zeroed pages mapped by libc (their raw address), unmapped afterwards."""
    size = 2 * mmap.PAGESIZE
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    yield addr
    _libc.munmap(addr, size)


def test_truncated_argument_is_efault(dev: int, pages: int) -> None:
    """The structure runs into an inaccessible page: copy_from_user fails, nothing is written."""
    page = mmap.PAGESIZE
    assert _libc.mprotect(pages + page, page, PROT_NONE) == 0
    addr = pages + page - VERSION_SIZE // 2  # only half the structure is mapped
    assert errno_of(lambda: raw_ioctl(dev, IOC_VERSION, addr)) == errno.EFAULT
    assert ctypes.string_at(addr, VERSION_SIZE // 2) == bytes(VERSION_SIZE // 2)


def test_read_only_argument_is_efault(dev: int, pages: int) -> None:
    """A valid input in a read-only page: copy_to_user fails with EFAULT."""
    assert _libc.mprotect(pages, 2 * mmap.PAGESIZE, mmap.PROT_READ) == 0
    assert errno_of(lambda: raw_ioctl(dev, IOC_VERSION, pages)) == errno.EFAULT
    assert ctypes.string_at(pages, VERSION_SIZE) == bytes(VERSION_SIZE)


def test_caller_without_cap_sys_admin_is_eperm(dev: int) -> None:
    """An fd opened by root, used after dropping CAP_SYS_ADMIN and CAP_CHECKPOINT_RESTORE."""

    def child() -> int:
        set_effective_caps(set())
        return errno_of(lambda: version(dev))

    assert in_child(child) == errno.EPERM


def test_unprivileged_user_is_eperm(dev: int) -> None:
    """After setuid to nobody (all capabilities gone) the inherited fd is refused, and the node
    (mode 0600) cannot be opened."""

    def child() -> int:
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
        if errno_of(lambda: os.close(os.open(DEVICE, os.O_RDWR))) != errno.EACCES:
            return 98
        return errno_of(lambda: version(dev))

    assert in_child(child) == errno.EPERM


def test_cap_checkpoint_restore_is_enough(dev: int) -> None:
    def child() -> int:
        set_effective_caps({CAP_CHECKPOINT_RESTORE})
        return errno_of(lambda: version(dev))

    assert in_child(child) == 0


def test_unprivileged_unknown_command_is_eperm(dev: int) -> None:
    """Without privilege every command, known or not, is EPERM: nothing is probed."""

    def child() -> int:
        set_effective_caps(set())
        return errno_of(lambda: fcntl.ioctl(dev, _ioc(3, 0x7F, 8), bytearray(8)))

    assert in_child(child) == errno.EPERM


def test_reload_and_unload_leave_no_warning(loaded_module: str) -> None:
    """Unloading fails while an fd is open (the module is busy), works once it is closed, and
    20 load/unload cycles leave no warning, oops or taint beyond out-of-tree."""
    fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
    assert errno_of(unload_module) in (errno.EBUSY, errno.EAGAIN, errno.EWOULDBLOCK)
    os.close(fd)
    for _ in range(20):
        unload_module()
        assert not module_loaded()
        load_module(loaded_module)
        fd = os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC)
        try:
            assert version(fd)[1] == ABI_VERSION
        finally:
            os.close(fd)
    unload_module()
    assert not module_loaded()
    for _ in range(100):
        if not os.path.exists(DEVICE):
            break
        time.sleep(0.01)
    assert not os.path.exists(DEVICE)
    log = kernel_log()
    bad = [ln for ln in log.splitlines() if _BAD_KERNEL_LOG.search(ln)]
    assert not bad, "\n".join(bad)
    tainted = int(Path("/proc/sys/kernel/tainted").read_text())
    assert not tainted & ((1 << 7) | (1 << 9)), f"kernel tainted {tainted:#x} (D: died, W: warning)"
