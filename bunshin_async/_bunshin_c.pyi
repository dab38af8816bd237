"""Linux syscalls the live backend needs, and an exact page scanner.

Built from ``cext/`` by meson. Every wrapper raises the :class:`OSError` subclass
that matches errno (``ESRCH`` -> :class:`ProcessLookupError`, ``EPERM`` ->
:class:`PermissionError`, ``ENOENT`` -> :class:`FileNotFoundError`, ...); its
``strerror`` names the syscall, so the message reads
``[Errno 3] pidfd_open: No such process`` or, for path arguments,
``[Errno 2] mount: No such file or directory: '/missing'``.
"""

import os
import signal
from collections.abc import Sequence
from typing import Final, final

StrOrBytesPath = str | bytes | os.PathLike[str] | os.PathLike[bytes]

CLONE_NEWNS: Final[int]
CLONE_NEWPID: Final[int]
CLONE_NEWNET: Final[int]
CLONE_NEWUTS: Final[int]
CLONE_NEWIPC: Final[int]
CLONE_NEWCGROUP: Final[int]
CLONE_NEWTIME: Final[int]
CLONE_NEWUSER: Final[int]
CLONE_INTO_CGROUP: Final[int]
CLONE_PIDFD: Final[int]
CLONE_CLEAR_SIGHAND: Final[int]
CLONE_PARENT: Final[int]
CLONE_FILES: Final[int]
CLONE_FS: Final[int]
CLONE_SYSVSEM: Final[int]

MS_RDONLY: Final[int]
MS_NOSUID: Final[int]
MS_NODEV: Final[int]
MS_NOEXEC: Final[int]
MS_BIND: Final[int]
MS_REC: Final[int]
MS_PRIVATE: Final[int]
MS_SLAVE: Final[int]
MS_SHARED: Final[int]
MS_UNBINDABLE: Final[int]
MS_REMOUNT: Final[int]
MS_MOVE: Final[int]
MS_NOATIME: Final[int]
MS_NODIRATIME: Final[int]
MS_STRICTATIME: Final[int]
MS_RELATIME: Final[int]

MNT_DETACH: Final[int]
MNT_FORCE: Final[int]
MNT_EXPIRE: Final[int]
UMOUNT_NOFOLLOW: Final[int]

PIDFD_NONBLOCK: Final[int]

def clone3(
    flags: int,
    *,
    cgroup_fd: int = -1,
    set_tid: Sequence[int] = (),
    exit_signal: int = signal.SIGCHLD,
) -> tuple[int, int]:
    """Create a child process with clone3(2), fork-like.

    Runs ``PyOS_BeforeFork()`` before the syscall and ``PyOS_AfterFork_Parent()``
    or ``PyOS_AfterFork_Child()`` after it, exactly as :func:`os.fork`, so the
    child may run Python (set up mounts, then :func:`os.execve` or
    :func:`os._exit`). As with :func:`os.fork`, the GIL is not released.

    Args:
        flags: ``CLONE_*`` flags. Flags that are not fork-like (``CLONE_VM``,
            ``CLONE_THREAD``, ``CLONE_SIGHAND``, ``CLONE_VFORK``, ``CLONE_SETTLS``,
            ``CLONE_*_SETTID``, ``CLONE_CHILD_CLEARTID``) raise
            :class:`ValueError`.
        cgroup_fd: With ``CLONE_INTO_CGROUP`` (and only with it), an fd of a
            cgroup v2 directory the child starts in.
        set_tid: The child's pid in each pid namespace level, innermost first
            (at most 32 entries, each > 0; needs ``CAP_CHECKPOINT_RESTORE``).
        exit_signal: Signal sent to the parent when the child exits.

    Returns:
        ``(child_pid, pidfd)`` in the parent (``pidfd`` is a close-on-exec fd
        with ``CLONE_PIDFD``, else -1); ``(0, -1)`` in the child.

    Raises:
        OSError: The subclass for errno; the message names ``clone3``.
    """

def pidfd_open(pid: int, flags: int = 0) -> int:
    """Return a pidfd (close-on-exec) for ``pid``; ``flags`` may be ``PIDFD_NONBLOCK``.

    Raises:
        ProcessLookupError: No such process (the message names ``pidfd_open``).
    """

def pidfd_send_signal(pidfd: int, sig: int, flags: int = 0) -> None:
    """Send ``sig`` to the process ``pidfd`` refers to.

    Raises:
        ProcessLookupError: The process has exited.
        OSError: ``EBADF`` for an fd that is not a pidfd, ...
    """

def pidfd_getfd(pidfd: int, targetfd: int, flags: int = 0) -> int:
    """Duplicate fd ``targetfd`` of the process ``pidfd`` refers to; return the copy.

    The new fd is close-on-exec. Needs ptrace access to the process.
    """

def setns(fd: int, nstype: int = 0) -> None:
    """Join the namespace ``fd`` refers to (a ``/proc/PID/ns/*`` file, ``nstype``
    0 or its ``CLONE_NEW*`` type), or the namespaces of a pidfd (``nstype`` a mask
    of ``CLONE_NEW*`` flags)."""

def unshare(flags: int) -> None:
    """Move the calling process into new namespaces (``CLONE_NEW*`` flags)."""

def mount(
    source: StrOrBytesPath | None,
    target: StrOrBytesPath,
    fstype: str | bytes | None = None,
    flags: int = 0,
    data: str | bytes | None = None,
) -> None:
    """mount(2); ``source``, ``fstype`` and ``data`` may be None.

    Raises:
        FileNotFoundError: ``target`` does not exist (the message names
            ``mount`` and the target).
    """

def umount2(target: StrOrBytesPath, flags: int = 0) -> None:
    """umount2(2); ``flags``: ``MNT_DETACH``, ``MNT_FORCE``, ``MNT_EXPIRE``,
    ``UMOUNT_NOFOLLOW``."""

def pivot_root(new_root: StrOrBytesPath, put_old: StrOrBytesPath) -> None:
    """pivot_root(2): make ``new_root`` the root mount of this mount namespace
    and move the old root under ``put_old``."""

@final
class PageScan(tuple[int, int, int, int, int, dict[int, tuple[int, int, int, int]]]):
    """Result of :func:`scan_pages`: page counts (multiply by ``page_size`` for bytes).

    ``resident == private + shared_inside + shared_outside``, and the same holds
    for each ``per_pid`` tuple.
    """

    n_fields: Final[int]
    n_sequence_fields: Final[int]
    n_unnamed_fields: Final[int]
    @property
    def page_size(self) -> int:
        """Bytes per page."""
    @property
    def resident(self) -> int:
        """Unique present physical pages mapped by the set (each PFN once)."""
    @property
    def private(self) -> int:
        """Pages mapped once, by one process of the set, and by nothing else."""
    @property
    def shared_inside(self) -> int:
        """Pages mapped more than once, every mapping inside the set."""
    @property
    def shared_outside(self) -> int:
        """Pages also mapped outside the set (kpagecount > mappings in the set)."""
    @property
    def per_pid(self) -> dict[int, tuple[int, int, int, int]]:
        """pid -> ``(resident, private, shared_inside, shared_outside)``.

        For one process: private = mapped by that process only; shared_inside =
        also mapped by another process of the set and by nothing outside;
        shared_outside = also mapped outside the set.
        """

def scan_pages(pids: Sequence[int]) -> PageScan:
    """Count the physical pages a set of processes maps, exactly.

    Reads ``/proc/PID/maps``, ``/proc/PID/pagemap`` and ``/proc/kpagecount``;
    each physical page is counted once for the set. Pages not present
    (swapped out), ``[vsyscall]`` and pages the kernel does not count
    (kpagecount 0: the zero page, raw PFN mappings) are skipped. A pid given
    twice is scanned once. The GIL is released while scanning.

    Raises:
        ProcessLookupError: A pid does not exist or exited during the scan
            (the message names the pid and the /proc file).
        PermissionError: Not root: PFNs read as 0 (names ``/proc/PID/pagemap``)
            or ``/proc/kpagecount`` cannot be opened.
        ValueError: A pid is not positive.
    """

@final
class BunshinVersion(tuple[int, int, int]):
    """Result of :func:`bunshin_version`: what the ``/dev/bunshin`` module is."""

    n_fields: Final[int]
    n_sequence_fields: Final[int]
    n_unnamed_fields: Final[int]
    @property
    def abi_version(self) -> int:
        """``BUNSHIN_ABI_VERSION`` of the running module."""
    @property
    def features(self) -> int:
        """``BUNSHIN_FEATURE_*`` bits: what the module can do."""
    @property
    def kernel_version(self) -> int:
        """``LINUX_VERSION_CODE`` the module was built for."""

def bunshin_version(fd: int) -> BunshinVersion:
    """``BUNSHIN_IOC_VERSION`` on ``fd``, an open ``/dev/bunshin``.

    Raises:
        OSError: The subclass for errno; the message names
            ``ioctl BUNSHIN_IOC_VERSION`` (``ENOTTY`` for an fd that is not
            ``/dev/bunshin``, ``EPERM`` without ``CAP_SYS_ADMIN`` or
            ``CAP_CHECKPOINT_RESTORE``).
    """

BUNSHIN_FORK_CGROUP: Final[int]
"""``bunshin_fork`` flag: the child is born in a cgroup v2 directory (set by ``cgroup_fd``)."""
BUNSHIN_FORK_SETSID: Final[int]
"""``bunshin_fork`` flag: the child leads a new session and process group, without a tty."""
BUNSHIN_FORK_JOIN_GROUP: Final[int]
"""``bunshin_fork`` flag: the child joins a target process's session and group (set by ``group_pidfd``)."""
BUNSHIN_FORK_REOPEN_FILES: Final[int]
"""``bunshin_fork`` flag: the child's fds are the source's files reopened in the target's root."""

def bunshin_fork(
    fd: int,
    source_pid: int,
    target_pidfd: int,
    *,
    cgroup_fd: int = -1,
    flags: int = 0,
    group_pidfd: int = -1,
) -> int:
    """``BUNSHIN_IOC_FORK`` on ``fd``, an open ``/dev/bunshin``; the GIL is released.

    Forks the single-threaded process ``source_pid`` (a pid in the caller's pid
    namespace; its cgroup must be frozen with the cgroup v2 freezer) into the
    pid, mount, network, UTS, IPC, cgroup and time namespaces, root and working
    directory of the process ``target_pidfd`` refers to. The child's parent is
    the init of the target's pid namespace; it shares the source's memory
    copy-on-write and resumes where the source was frozen.

    With the defaults it stays in the source's cgroup (frozen until it thaws),
    session and process group, and keeps a copy of the source's fd table.
    ``cgroup_fd`` (an fd of a cgroup v2 directory, ``O_PATH`` is enough; sets
    ``BUNSHIN_FORK_CGROUP``): the child is born in that cgroup, frozen if it is.
    ``flags`` may add ``BUNSHIN_FORK_SETSID`` (a new session and process group,
    no controlling tty) and ``BUNSHIN_FORK_REOPEN_FILES`` (every fd reopened in
    the target's root: regular files and directories at the same path, offset
    and flags, and ``/dev/null``, ``/dev/zero``, ``/dev/random``,
    ``/dev/urandom``; any other kind fails the fork with ``EINVAL`` and the
    kernel log names the fd and its kind). ``group_pidfd`` (sets
    ``BUNSHIN_FORK_JOIN_GROUP``, not with ``BUNSHIN_FORK_SETSID``): the child
    joins the session and process group of that process of the target.

    Returns:
        The child's pid in the caller's pid namespace.

    Raises:
        ProcessLookupError: No such source, target or group process (``ESRCH``).
        BlockingIOError: The source has a signal pending (``EAGAIN``).
        PermissionError: The caller lacks ``CAP_SYS_ADMIN`` (``EPERM``), or the
            source's credentials may not move a task into ``cgroup_fd``
            (``EACCES``).
        OSError: ``EBUSY`` (the source is not frozen), ``EINVAL`` (a
            multi-threaded source or an fd ``BUNSHIN_FORK_REOPEN_FILES`` cannot
            reopen: the kernel log names them; unknown flags), ``EBADF``
            (``target_pidfd`` or ``group_pidfd`` is not a pidfd, ``cgroup_fd``
            not a cgroup v2 directory), ``ETIMEDOUT``, ``EOPNOTSUPP``, or what
            reopening a file fails with; the message names
            ``ioctl BUNSHIN_IOC_FORK``.
    """

BUNSHIN_TREE_MAX: Final[int]
"""The most processes one :func:`bunshin_fork_tree` call may fork."""
BUNSHIN_TREE_SUBST_MAX: Final[int]
"""The most fd substitutions one :func:`bunshin_fork_tree` call may carry."""
BUNSHIN_FEATURE_FORK_TREE: Final[int]
"""Feature bit of :func:`bunshin_version`: ``BUNSHIN_IOC_FORK_TREE`` works."""
BUNSHIN_FEATURE_TREE_SUBST: Final[int]
"""Feature bit of :func:`bunshin_version`: :func:`bunshin_fork_tree` takes ``subst`` (ABI 4)."""

def bunshin_fork_tree(fd: int, source_pids: Sequence[int], target_pidfd: int, cgroup_fd: int, *,
                      subst: Sequence[tuple[int, int, int]] = ()) -> list[int]:
    """``BUNSHIN_IOC_FORK_TREE`` on ``fd``, an open ``/dev/bunshin``; the GIL is released.

    Forks a whole frozen process tree into a sibling container. ``source_pids``
    are pids in the caller's pid namespace, each one's parent before it (the
    first is the root of the tree); all must be single-threaded, in the root's
    pid namespace and frozen with the cgroup v2 freezer. The clones get the
    mount, network, UTS, IPC, cgroup and time namespaces, root and working
    directory of the process ``target_pidfd`` refers to, and the pid namespace
    its children get: if that is its own, the root clone is a child of its
    init; if it is a new, empty one, the root clone becomes its init (pid 1), a
    child of the target. Every clone is born in the cgroup v2 directory
    ``cgroup_fd`` (frozen if it is), keeps its source's pid where that is free
    in the target, is a child of the clone of its source's parent, in the
    clones' session and process group, without a controlling tty; it shares
    its source's memory copy-on-write and resumes where it was frozen. Regular
    files, directories and memory devices are reopened in the target's root;
    pipes and unix socket pairs with every end in the tree are made again,
    FIFOs reopened at their path in the target, all with their buffered bytes.
    Nothing runs before every clone is made; on an error none is left.

    ``subst`` (``BUNSHIN_TREE_SUBST``, ABI 4) is a sequence of ``(index, fd,
    caller_fd)``: the clone of ``source_pids[index]`` holds the caller's open
    file ``caller_fd`` (shared) at ``fd`` instead of a copy of its source's.
    This is how a controller gives a cloned agent a new channel: the source's
    end of its socket pair, whose peer is the controller's, would be refused.

    Returns:
        The clones' pids in the caller's pid namespace, in the order of
        ``source_pids``.

    Raises:
        ValueError: ``source_pids`` is empty, longer than
            :data:`BUNSHIN_TREE_MAX` or holds a value that is not a pid;
            ``subst`` is longer than :data:`BUNSHIN_TREE_SUBST_MAX`.
        TypeError: A ``subst`` entry is not ``(index, fd, caller_fd)``.
        ProcessLookupError: No such source or target, or it exited (``ESRCH``).
        PermissionError: The caller lacks ``CAP_SYS_ADMIN`` (``EPERM``), or a
            source's credentials may not move a task into ``cgroup_fd``
            (``EACCES``).
        OSError: ``EBUSY`` (a source is not frozen), ``EINVAL`` (a
            multi-threaded source, a parent not named before its child, an fd
            that is not carried over, a pipe or socket with an end outside the
            tree: the kernel log names the process, fd and kind), ``EBADF``,
            ``ETIMEDOUT``, ``EOPNOTSUPP``; the message names
            ``ioctl BUNSHIN_IOC_FORK_TREE``.
    """
