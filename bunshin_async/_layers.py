"""Overlay layers: the file-system half of a workspace snapshot.

A snapshot of a workspace's files is its overlay upper directory, copied into a read-only
*layer*; a fork stacks a fresh upper directory on the snapshot's layers (topmost first) above
the root. Layers are shared by every snapshot and fork that stacks them, and removed when the
last one lets go (:class:`LayerStore` counts references).

Overlayfs bounds a stack (the ``lowerdir=`` option must fit in one page, and the kernel
allows at most 500 lower layers), so a stack deeper than ``flatten_depth`` is merged into one
layer: the layers are applied bottom-up, a whiteout (a 0/0 character device) deletes what is
below it and stays, so it still hides the file in the root; an opaque directory
(``trusted.overlay.opaque=y``) replaces what is below it and stays opaque.

A layer leaves memory for the prefix tree's cold tier as a tar archive (GNU tar, with xattrs,
so whiteouts and opaque markers survive) and comes back by extraction.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._exceptions import BackendError

__all__ = ["Layer", "LayerStore"]

_OPAQUE = "trusted.overlay.opaque"


class Layer:
    """A read-only directory in a layer stack, shared by reference count.

    Attributes:
        path: The directory.
        refs: How many stacks hold it.
    """

    __slots__ = ("path", "refs")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refs = 0

    def __repr__(self) -> str:
        return f"<layer {self.path.name} refs={self.refs}>"


class LayerStore:
    """Makes, shares, flattens, archives and removes layers under *root*.

    Args:
        root: Directory for layer directories and archives (created if missing).
        flatten_depth: Deepest stack kept as it is; deeper stacks are merged into one layer.
    """

    def __init__(self, root: Path, *, flatten_depth: int = 32) -> None:
        if flatten_depth < 1:
            raise ValueError(f"flatten_depth must be >= 1, got {flatten_depth}")
        self.root = Path(root)
        (self.root / "layers").mkdir(parents=True, exist_ok=True)
        (self.root / "archives").mkdir(parents=True, exist_ok=True)
        self.flatten_depth = flatten_depth
        self._n = 0
        self.flattens = 0

    def _new_dir(self, kind: str) -> Path:
        self._n += 1
        path = self.root / "layers" / f"{kind}-{os.getpid()}-{self._n}"
        path.mkdir()
        return path

    def hold(self, stack: Sequence[Layer]) -> tuple[Layer, ...]:
        """Take a reference on every layer of *stack* and return it as a tuple."""
        for layer in stack:
            layer.refs += 1
        return tuple(stack)

    def drop(self, stack: Sequence[Layer]) -> None:
        """Let go of *stack*; layers nobody holds any more are removed."""
        for layer in stack:
            layer.refs -= 1
            if layer.refs <= 0:
                _rmtree(layer.path)

    def adopt(self, path: Path, below: Sequence[Layer]) -> tuple[Layer, ...]:
        """Move the directory *path* (a kept upper directory) into the store as a new layer
        and return the held stack ``(new,) + below`` (flattened if too deep)."""
        dest = self.root / "layers" / f"kept-{os.getpid()}-{self._n + 1}"
        self._n += 1
        os.rename(path, dest)
        return self._stack(Layer(dest), below)

    def _stack(self, layer: Layer, below: Sequence[Layer]) -> tuple[Layer, ...]:
        stack = (layer, *below)
        if len(stack) > self.flatten_depth:
            merged = self.flatten(stack)
            if layer.refs == 0:
                _rmtree(layer.path)
            return merged
        return self.hold(stack)

    def capture(self, upper: Path, below: Sequence[Layer]) -> tuple[Layer, ...]:
        """Copy the upper directory *upper* into a new layer and return the held stack
        ``(new,) + below`` (flattened if deeper than ``flatten_depth``)."""
        path = self._new_dir("snap")
        try:
            _copy_tree(upper, path)
        except BaseException:
            _rmtree(path)
            raise
        return self._stack(Layer(path), below)

    def flatten(self, stack: Sequence[Layer]) -> tuple[Layer, ...]:
        """Merge *stack* (topmost first) into one new layer; return it, held."""
        path = self._new_dir("flat")
        try:
            for layer in reversed(stack):
                _apply_layer(layer.path, path)
        except BaseException:
            _rmtree(path)
            raise
        self.flattens += 1
        return self.hold([Layer(path)])

    def archive(self, layer: Layer) -> tuple[Path, int]:
        """Write *layer* to a tar archive; return its path and size in bytes."""
        self._n += 1
        out = self.root / "archives" / f"{layer.path.name}-{self._n}.tar"
        _run(["tar", "--xattrs", "--xattrs-include=*", "--acls", "-C", str(layer.path), "-cf", str(out), "."])
        return out, out.stat().st_size

    def restore(self, archive: Path) -> Layer:
        """Extract *archive* into a new layer (not yet held) and return it."""
        path = self._new_dir("cold")
        try:
            _run(["tar", "--xattrs", "--xattrs-include=*", "--acls", "-C", str(path), "-xpf", str(archive)])
        except BaseException:
            _rmtree(path)
            raise
        return Layer(path)

    @staticmethod
    def bytes_of(layer: Layer) -> int:
        """Bytes of file data in *layer*."""
        total = 0
        for dirpath, _dirs, files in os.walk(layer.path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:
                    pass
        return total


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        raise BackendError(f"{' '.join(argv[:1])} failed (exit {proc.returncode}): {proc.stderr.strip()}")


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy *src*'s contents into the existing *dst*, keeping owners, modes, times, xattrs
    (whiteouts and opaque markers) and hard links; reflinks where the file system can."""
    _run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)])


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _apply_layer(src: Path, dst: Path) -> None:
    """Apply layer *src* on top of the merged directory *dst* (overlay semantics)."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else dst / rel
        if rel != "." and _is_opaque(dirpath):
            _remove(str(target_dir))  # an opaque directory hides everything below it
        if not target_dir.exists():
            target_dir.mkdir()
            shutil.copystat(dirpath, target_dir, follow_symlinks=False)
            _copy_xattrs(dirpath, str(target_dir))
        elif rel != ".":
            shutil.copystat(dirpath, target_dir, follow_symlinks=False)
            _copy_xattrs(dirpath, str(target_dir))
        for name in list(dirnames):
            s = os.path.join(dirpath, name)
            t = os.path.join(target_dir, name)
            if os.path.islink(s):  # a symlink to a directory is a file here
                dirnames.remove(name)
                filenames.append(name)
                continue
            if os.path.lexists(t) and not os.path.isdir(t):
                os.unlink(t)
        for name in filenames:
            s = os.path.join(dirpath, name)
            t = os.path.join(target_dir, name)
            _remove(t)
            _copy_entry(s, t, os.lstat(s))


def _copy_entry(src: str, dst: str, st: os.stat_result) -> None:
    """Copy one non-directory entry with its owner, mode, times and xattrs (hard links
    between files are not kept)."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        os.mknod(dst, mode, st.st_rdev)  # a 0/0 character device is a whiteout: it keeps hiding
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dst, stat.S_IMODE(mode))
    else:  # a socket: nothing to copy
        return
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(mode):
        os.chmod(dst, stat.S_IMODE(mode))
        _copy_xattrs(src, dst)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_xattrs(src: str, dst: str) -> None:
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        return
    for n in names:
        os.setxattr(dst, n, os.getxattr(src, n, follow_symlinks=False), follow_symlinks=False)
