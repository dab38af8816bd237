"""Cost models of the five fork engines the simulator compares.

Each :class:`EngineModel` holds the numbers one engine's costs are computed from, and for every
number where it comes from (its ``sources``): a sentence of the seed texts, a public measurement,
a measurement made on this project's machines, or an assumption with its reasoning. The table in
``docs/engines.md`` lists them all.

Measurements made here ran under QEMU's TCG (no KVM on the project's machines), which runs
kernel code several times slower than native. Where a figure measured under TCG stands for a
native cost it is divided by :data:`TCG_SLOWDOWN`, itself an assumption (see there).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bunshin_async._exceptions import ConfigError

__all__ = ["EngineModel", "ENGINES", "ENGINE_NAMES", "engine_model", "TCG_SLOWDOWN", "GIB", "MIB"]

MIB = 1 << 20
"""Bytes in a mebibyte."""
GIB = 1 << 30
"""Bytes in a gibibyte."""

EngineName = Literal["bunshin", "criu", "microvm", "restart", "cold"]

ENGINE_NAMES: tuple[str, ...] = ("bunshin", "criu", "microvm", "restart", "cold")
"""The engines, in the order reports list them."""

TCG_SLOWDOWN = 4.0
"""How many times slower QEMU's TCG runs the kernel's memory-bound paths than native hardware.

An assumption, consistent with the one figure measured both ways: bunshin's fork of a 64 MiB
buffer took about 3 ms under TCG (about 47 ms per GiB if all of it were page-table copying),
while Linux ``fork()`` copies page tables at 9 to 13 ms per GB on physical machines (Redis
latency documentation, "Fork time in different systems"), a ratio of 3.6 to 5.2.
"""

_PAGE_TABLE_BYTES = 8.0
_REDIS_FORK = (
    "public measurement: Redis documentation, 'Diagnosing latency issues', table 'Fork time in "
    "different systems': 'Linux running on physical machine (Unknown HW) 6.1GB RSS forked in 80 "
    "milliseconds (13.1 milliseconds per GB)', i.e. 0.0141 s per GiB of page-table copying"
)
_FORK_HERE = (
    "measurement here: a bunshin fork sharing a 64 MiB buffer copy-on-write took about 3 ms under "
    "TCG (DESIGN.md, facts measured here), divided by TCG_SLOWDOWN=4 for native hardware: "
    "0.00075 s; pessimistic, as that 3 ms also covers the 64 MiB page-table copy charged by "
    "fork_per_gib"
)
_PT = (
    "public fact: an x86-64 page-table entry is 8 bytes and maps one 4 KiB page (Intel SDM vol. 3, "
    "4-level paging); upper levels add under 1%"
)
_FREEZE = (
    "assumption: freezing a cgroup v2 (writing cgroup.freeze and waiting for cgroup.events) "
    "signals each task and waits for it to stop, about a millisecond for a desktop's few "
    "hundred tasks"
)
_DISK_W = (
    "assumption: a datacenter NVMe SSD writes sequentially at 2 to 3 GB/s; 2 GiB/s taken, deltas "
    "being written in large sequential extents"
)
_DISK_R = (
    "assumption: a datacenter NVMe SSD reads sequentially at 3 GB/s or more; 3 GiB/s taken"
)
_TIER = (
    "assumption: moving a snapshot that holds no memory to or from the cold tier only renames an "
    "overlay upper directory or a call log, about a millisecond"
)
_UNUSED = "not used by this engine"
_RELEASE = (
    "assumption: destroying a workspace (kill, cgroup removal, unmap) runs in the background; the "
    "caller is not held up"
)
_DUMP_BASE = (
    "assumption: CRIU's fixed work per dump (seizing the tree with ptrace, injecting the parasite, "
    "collecting /proc state, sockets and files) takes about 0.1 s natively for a desktop-sized "
    "process tree"
)
_RESTORE_BASE = (
    "assumption: CRIU's fixed work per restore (recreating the process tree, namespaces, files and "
    "sockets) takes about 0.05 s natively"
)
_DUMP_BW = (
    "measurement here: Debian's CRIU 3.17.1 dumps a 256 MiB process in about 2 s under TCG "
    "(DESIGN.md); divided by TCG_SLOWDOWN=4 that is 0.5 s natively, of which dump_base is 0.1 s, "
    "so 256 MiB / 0.4 s = 640 MiB/s"
)
_RESTORE_BW = (
    "measurement here: the same CRIU restores the 256 MiB process in about 1 s under TCG "
    "(DESIGN.md); divided by TCG_SLOWDOWN=4 that is 0.25 s natively, of which restore_base is "
    "0.05 s, so 256 MiB / 0.2 s = 1280 MiB/s"
)


class EngineModel(msgspec.Struct, frozen=True, kw_only=True):
    """The cost parameters of one fork engine.

    Times are in seconds, sizes in bytes, bandwidths in bytes per second. A parameter an engine
    does not use is 0 and its source says so. Every numeric field has an entry in
    :attr:`sources`.
    """

    name: EngineName
    """The engine: ``bunshin``, ``criu``, ``microvm``, ``restart`` or ``cold``."""
    description: str
    """One line on how the engine forks."""
    page_cache_image: bool
    """Whether a freshly booted workspace maps its image through the host's page cache, shared
    with every other workspace of the task (containers), rather than a private guest page cache
    (a microVM)."""
    checkpoint_in_memory: bool = True
    """Where a checkpoint image (``criu``'s dump of a workspace's anonymous memory) is kept:
    True in tmpfs, counted in the working set for as long as the image lives; False on disk,
    outside the working set, written and read at no more than ``disk_write_bandwidth`` and
    ``disk_read_bandwidth``. Only ``criu`` makes checkpoint images."""
    freeze_time: float
    """Seconds to stop a workspace's processes for a snapshot (cgroup freeze, VM pause, overlay
    freeze); 0 where nothing is frozen."""
    fork_base: float
    """Seconds of fixed cost per fork (bunshin: metadata, namespaces, reparenting; restart: a new
    overlay mount)."""
    fork_per_gib: float
    """Seconds per GiB mapped to copy page tables in a copy-on-write fork."""
    page_table_bytes: float
    """Bytes of private page tables per 4 KiB mapped by a live workspace (8 for one level of
    x86-64 page tables; about 16 for a VM's guest page tables plus EPT)."""
    dump_base: float
    """Seconds of fixed cost per checkpoint dump."""
    dump_bandwidth: float
    """Bytes per second at which a dump copies anonymous memory into the image (tmpfs)."""
    restore_base: float
    """Seconds of fixed cost per restore (CRIU) or snapshot load (microVM)."""
    restore_bandwidth: float
    """Bytes per second at which a CRIU restore copies the image back into memory."""
    snapshot_bandwidth: float
    """Bytes per second at which a microVM snapshot writes guest memory to its memory file."""
    vm_boot_time: float
    """Seconds a microVM boot adds to the task's own boot time (VMM start to guest init)."""
    guest_kernel_bytes: int
    """Bytes of private memory a microVM's guest kernel holds (text, data, slab, per-CPU)."""
    vmm_bytes: int
    """Bytes of private memory the VMM process holds per microVM."""
    restart_boot_factor: float
    """Fraction of the task's boot time a restart on an existing overlay takes (the image is
    already unpacked and in the page cache)."""
    disk_write_bandwidth: float
    """Bytes per second at which a demoted snapshot's delta is written to disk."""
    disk_read_bandwidth: float
    """Bytes per second at which a cold snapshot's delta is read back."""
    tier_time: float
    """Seconds to demote or promote a snapshot that holds no memory (restart, cold)."""
    release_time: float
    """Seconds charged to release a handle."""
    sources: dict[str, str]
    """For every numeric field, where its value comes from."""

    # -- cost formulas ----------------------------------------------------------------------

    def fork_time(self, mapped_bytes: int) -> float:
        """Seconds for a copy-on-write fork of *mapped_bytes* (page-table copy)."""
        return self.fork_base + self.fork_per_gib * mapped_bytes / GIB

    def dump_time(self, anon_bytes: int) -> float:
        """Seconds for a CRIU dump of *anon_bytes* of anonymous memory (to disk: at the slower
        of the dump and disk-write bandwidths)."""
        bw = self.dump_bandwidth
        if not self.checkpoint_in_memory:
            bw = _slower(bw, self.disk_write_bandwidth)
        return self.dump_base + _per(anon_bytes, bw)

    def restore_time(self, anon_bytes: int) -> float:
        """Seconds for a CRIU restore of *anon_bytes* (from disk: at the slower of the restore
        and disk-read bandwidths), or a microVM snapshot load (base only)."""
        bw = self.restore_bandwidth
        if not self.checkpoint_in_memory:
            bw = _slower(bw, self.disk_read_bandwidth)
        return self.restore_base + _per(anon_bytes, bw)

    def vm_snapshot_time(self, guest_bytes: int) -> float:
        """Seconds to pause a microVM and write *guest_bytes* of guest memory to its file."""
        return self.freeze_time + _per(guest_bytes, self.snapshot_bandwidth)

    def overhead_bytes(self, mapped_bytes: int) -> int:
        """Private per-workspace overhead of a live workspace mapping *mapped_bytes*: page
        tables, and for a microVM its guest kernel and VMM."""
        tables = int(mapped_bytes / 4096 * self.page_table_bytes)
        return tables + self.guest_kernel_bytes + self.vmm_bytes

    def disk_write_time(self, nbytes: int) -> float:
        """Seconds to write *nbytes* of delta to the cold tier."""
        return _per(nbytes, self.disk_write_bandwidth)

    def disk_read_time(self, nbytes: int) -> float:
        """Seconds to read *nbytes* of delta back from the cold tier."""
        return _per(nbytes, self.disk_read_bandwidth)


def _per(nbytes: int, bandwidth: float) -> float:
    if nbytes <= 0 or bandwidth <= 0:
        return 0.0
    return nbytes / bandwidth


def _slower(a: float, b: float) -> float:
    """The slower of two bandwidths, where 0 means "not used" (no limit)."""
    if a <= 0:
        return b
    if b <= 0:
        return a
    return min(a, b)


def _common(**overrides: str) -> dict[str, str]:
    base = {
        "disk_write_bandwidth": _DISK_W,
        "disk_read_bandwidth": _DISK_R,
        "release_time": _RELEASE,
    }
    base.update(overrides)
    return base


_DISK = {"disk_write_bandwidth": 2.0 * GIB, "disk_read_bandwidth": 3.0 * GIB, "release_time": 0.0}
_ZERO = {
    "freeze_time": 0.0,
    "fork_base": 0.0,
    "fork_per_gib": 0.0,
    "page_table_bytes": 0.0,
    "dump_base": 0.0,
    "dump_bandwidth": 0.0,
    "restore_base": 0.0,
    "restore_bandwidth": 0.0,
    "snapshot_bandwidth": 0.0,
    "vm_boot_time": 0.0,
    "guest_kernel_bytes": 0,
    "vmm_bytes": 0,
    "restart_boot_factor": 0.0,
    "tier_time": 0.0,
}


def _engine(
    name: EngineName, description: str, page_cache_image: bool, sources: dict[str, str], **values: float
) -> EngineModel:
    params: dict = {**_ZERO, **_DISK, **values}
    src = {k: _UNUSED for k in _ZERO}
    src.update(sources)
    return EngineModel(
        name=name, description=description, page_cache_image=page_cache_image, sources=src, **params
    )


_PT_HOST = _PT + "; the simulator charges 8 bytes per 4 KiB mapped to every live process-based workspace"

ENGINES: dict[str, EngineModel] = {
    "bunshin": _engine(
        "bunshin",
        "live copy-on-write fork of the frozen process tree into a sibling container (kernel module)",
        True,
        _common(
            freeze_time=_FREEZE,
            fork_base=_FORK_HERE,
            fork_per_gib=_REDIS_FORK + "; bunshin's fork copies page tables the way fork() does",
            page_table_bytes=_PT_HOST,
        ),
        freeze_time=0.001,
        fork_base=0.003 / TCG_SLOWDOWN,
        fork_per_gib=0.0141,
        page_table_bytes=_PAGE_TABLE_BYTES,
    ),
    "criu": _engine(
        "criu",
        "CRIU checkpoint to tmpfs and restore into a new container: a private copy per fork",
        True,
        _common(
            page_table_bytes=_PT_HOST,
            dump_base=_DUMP_BASE,
            dump_bandwidth=_DUMP_BW,
            restore_base=_RESTORE_BASE,
            restore_bandwidth=_RESTORE_BW,
        ),
        page_table_bytes=_PAGE_TABLE_BYTES,
        dump_base=0.1,
        dump_bandwidth=640.0 * MIB,
        restore_base=0.05,
        restore_bandwidth=1280.0 * MIB,
    ),
    "microvm": _engine(
        "microvm",
        "Firecracker-style microVM: snapshot memory file mapped MAP_PRIVATE by every fork, a guest "
        "kernel and private page tables per VM",
        False,
        _common(
            freeze_time=(
                "assumption: pausing a microVM's vCPUs (Firecracker PATCH /vm Paused) is a few "
                "ioctls, about a millisecond"
            ),
            page_table_bytes=(
                _PT + "; a VM keeps both guest page tables and the host's EPT for its memory, "
                "about 2 x 8 bytes per 4 KiB (assumption: no huge pages)"
            ),
            restore_base=(
                "public measurement: Firecracker docs/snapshotting/snapshot-support.md, "
                "Performance: 'the baseline for snapshot resume latency target is under 8ms with "
                "5ms p90' (m5d.metal, 2 vCPU, 512 MB); memory is loaded on demand from the "
                "MAP_PRIVATE memory file, so the load does not grow with guest memory"
            ),
            snapshot_bandwidth=(
                "assumption: a full Firecracker snapshot writes all of guest memory to the "
                "memory file synchronously (snapshot-support.md: 'Taking a snapshot of a fresh "
                "microVM ... results in the full contents of guest memory being written'); to a "
                "file in the page cache that is a memory copy plus page-cache insertion, about "
                "2 GiB/s"
            ),
            vm_boot_time=(
                "public measurement: Firecracker SPECIFICATION.md: 'It takes <= 125 ms to go "
                "from receiving the Firecracker InstanceStart API call to the start of the Linux "
                "guest user-space /sbin/init process' (also on firecracker-microvm.github.io: "
                "'initiates user space or application code in as little as 125 ms')"
            ),
            guest_kernel_bytes=(
                "assumption: a Linux guest kernel holds its own text and data (10 to 20 MiB), its "
                "struct page array (64 bytes per 4 KiB of guest memory: 64 MiB for a 4 GiB guest) "
                "and slab caches; 64 MiB is taken, the low end, in the microVM's favour"
            ),
            vmm_bytes=(
                "public measurement: Firecracker SPECIFICATION.md: 'Firecracker's virtual machine "
                "manager threads always have a memory overhead <= 5 MiB'; 5 MiB taken"
            ),
        ),
        freeze_time=0.001,
        page_table_bytes=2 * _PAGE_TABLE_BYTES,
        restore_base=0.008,
        snapshot_bandwidth=2.0 * GIB,
        vm_boot_time=0.125,
        guest_kernel_bytes=64 * MIB,
        vmm_bytes=5 * MIB,
    ),
    "restart": _engine(
        "restart",
        "overlay file-system snapshots only: a fork restarts the processes and replays the call log",
        True,
        _common(
            freeze_time=(
                "assumption: freezing an overlay upper layer (stop the processes, make the upper "
                "directory a lower layer) is a rename and a mount, about 10 ms"
            ),
            fork_base=(
                "assumption: mounting a new overlay on the frozen layers and setting up namespaces "
                "and a cgroup takes about 10 ms"
            ),
            page_table_bytes=_PT_HOST,
            restart_boot_factor=(
                "assumption: restarting on an unpacked overlay with a warm page cache skips "
                "pulling and unpacking the image but redoes the processes' own initialisation "
                "(desktop session, browser, task data): half the task's boot time"
            ),
            tier_time=_TIER,
        ),
        freeze_time=0.01,
        fork_base=0.01,
        page_table_bytes=_PAGE_TABLE_BYTES,
        restart_boot_factor=0.5,
        tier_time=0.001,
    ),
    "cold": _engine(
        "cold",
        "no fork: every sample boots its own workspace and replays the calls before its own",
        True,
        _common(
            freeze_time=(
                "nothing to freeze: a cold engine's snapshot is the call log the scheduler "
                "already holds, so it costs nothing"
            ),
            page_table_bytes=_PT_HOST,
            tier_time=_TIER,
        ),
        page_table_bytes=_PAGE_TABLE_BYTES,
        tier_time=0.001,
    ),
}
"""The five engines, by name."""


def engine_model(name: str) -> EngineModel:
    """Return the :class:`EngineModel` called *name*.

    Raises:
        ConfigError: If *name* is not an engine; the message lists the valid names.
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(
            f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}"
        ) from None
