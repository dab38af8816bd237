"""A page-level memory model: exact sharing counts for simulated workspaces.

Memory is counted in *model pages* of ``page_size`` bytes (1 MiB by default). The page size is
the model's resolution, not the kernel's: a model page stands for ``page_size / 4096`` kernel
pages that are always shared or copied together. A smaller page size is more exact and slower.

Each physical model page is a *version*, a small integer. Every live workspace or snapshot is a
*mapping*: an int64 array holding, for each model page it maps, the version it maps there, first
its task's image pages, then its runtime (anonymous) pages. A refcount array counts how many
mappings map each version, and the number of physical pages (versions mapped at least once) is
kept up to date as mappings are made, written and dropped, so every query is cheap.

Besides its version, each physical page carries a *content label*: two pages hold the same data
exactly when their labels are equal. Labels survive a page being copied (a CRIU restore, a cold
snapshot brought back from disk) and change when a page is written, so the delta between two
states is the set of positions where their labels differ, even when one of them is no longer in
memory.

Invariant: one mapping never maps the same version twice, so ``refcount[versions] += 1`` is exact
without ``np.add.at``.
"""

from __future__ import annotations

from collections.abc import Hashable

import msgspec
import numpy as np

__all__ = ["PageModel", "PageUsage"]

_INITIAL_CAPACITY = 1024


class PageUsage(msgspec.Struct, frozen=True):
    """How one mapping's pages are shared, in bytes."""

    shared_bytes: int
    """Bytes of pages this mapping maps together with at least one other mapping."""
    private_bytes: int
    """Bytes of pages only this mapping maps."""


class _Mapping:
    __slots__ = ("versions", "image_pages", "cache_key")

    def __init__(self, versions: np.ndarray, image_pages: int, cache_key: Hashable | None) -> None:
        self.versions = versions
        self.image_pages = image_pages
        # The task whose page-cache versions this mapping holds in its image part, if any.
        self.cache_key = cache_key


class PageModel:
    """Counts physical pages shared copy-on-write between mappings, exactly.

    Args:
        page_size: Bytes per model page (the model's resolution, not the kernel's page size).

    Mappings are named by integer ids that this model hands out and never reuses.
    """

    def __init__(self, page_size: int = 1 << 20) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self._refcount = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self._label = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self._free = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)  # stack of freed version ids
        self._free_top = 0
        self._next_version = 0  # versions below this have been handed out at least once
        self._next_label = 1
        self._physical = 0
        self._mappings: dict[int, _Mapping] = {}
        self._next_mapping = 0
        # Per task: the page-cache versions of its image, and how many mappings hold them.
        self._cache: dict[Hashable, np.ndarray] = {}
        self._cache_users: dict[Hashable, int] = {}
        # Per task: the content labels of its image pages (the same for every copy).
        self._image_labels: dict[Hashable, np.ndarray] = {}

    # -- sizes -----------------------------------------------------------------------------

    def pages(self, nbytes: int) -> int:
        """The number of model pages needed to hold *nbytes* (rounded up)."""
        return -(-max(int(nbytes), 0) // self.page_size)

    @property
    def physical_pages(self) -> int:
        """Physical pages in use: versions mapped by at least one mapping."""
        return self._physical

    @property
    def physical_bytes(self) -> int:
        """Physical pages in use, in bytes."""
        return self._physical * self.page_size

    @property
    def live_mappings(self) -> int:
        """How many mappings exist (made and not yet dropped)."""
        return len(self._mappings)

    def mapped_pages(self, mapping: int) -> int:
        """How many model pages *mapping* maps."""
        return len(self._get(mapping).versions)

    def mapped_bytes(self, mapping: int) -> int:
        """How many bytes *mapping* maps."""
        return self.mapped_pages(mapping) * self.page_size

    def image_pages(self, mapping: int) -> int:
        """How many of *mapping*'s pages are image (file-backed) pages; the rest are runtime."""
        return self._get(mapping).image_pages

    def runtime_pages(self, mapping: int) -> int:
        """How many of *mapping*'s pages are runtime (anonymous) pages."""
        m = self._get(mapping)
        return len(m.versions) - m.image_pages

    def usage(self, mapping: int) -> PageUsage:
        """Shared and private bytes of *mapping* now."""
        rc = self._refcount[self._get(mapping).versions]
        private = int(np.count_nonzero(rc == 1))
        return PageUsage(
            shared_bytes=(len(rc) - private) * self.page_size, private_bytes=private * self.page_size
        )

    def versions(self, mapping: int) -> np.ndarray:
        """A copy of *mapping*'s version array (for tests and diagnostics)."""
        return self._get(mapping).versions.copy()

    def labels(self, mapping: int) -> np.ndarray:
        """A copy of the content labels of *mapping*'s pages, position by position."""
        return self._label[self._get(mapping).versions]

    def delta(self, labels: np.ndarray, reference: np.ndarray | None) -> np.ndarray:
        """Positions where the content *labels* differ from *reference* (all when None).

        Both are label arrays as returned by :meth:`labels`.
        """
        if reference is None:
            return np.arange(len(labels), dtype=np.int64)
        if len(reference) != len(labels):
            raise ValueError(f"cannot compare {len(labels)} pages against {len(reference)}")
        return np.flatnonzero(labels != reference).astype(np.int64)

    # -- making mappings --------------------------------------------------------------------

    def create(
        self,
        task: Hashable,
        image_pages: int,
        runtime_pages: int,
        *,
        shared_image: bool = True,
        runtime_labels: np.ndarray | None = None,
    ) -> int:
        """Make a new mapping for *task* and return its id.

        Args:
            task: Identifies the task (its page cache and image labels are per task).
            image_pages: Pages of the task's image (file-backed memory).
            runtime_pages: Pages of anonymous memory.
            shared_image: Map the task-wide page-cache versions of the image (a container on
                the host kernel) rather than fresh private versions (a microVM's own guest
                page cache).
            runtime_labels: Content labels for the runtime pages (a restored copy of some
                state); fresh labels when None (a fresh boot builds its own heap).
        """
        if image_pages < 0 or runtime_pages < 0:
            raise ValueError("page counts must be >= 0")
        img_labels = self._image_labels.get(task)
        if img_labels is None:
            img_labels = self._image_labels[task] = self._new_labels(image_pages)
        elif len(img_labels) != image_pages:
            raise ValueError(f"task {task!r} was mapped with {len(img_labels)} image pages, now {image_pages}")
        if shared_image:
            image = self._cache_versions(task, img_labels)
            cache_key: Hashable | None = task
        else:
            image = self._alloc(image_pages, img_labels)
            cache_key = None
        if runtime_labels is None:
            runtime_labels = self._new_labels(runtime_pages)
        elif len(runtime_labels) != runtime_pages:
            raise ValueError(f"{len(runtime_labels)} runtime labels for {runtime_pages} pages")
        runtime = self._alloc(runtime_pages, runtime_labels)
        return self._add(_Mapping(np.concatenate([image, runtime]), image_pages, cache_key))

    def share(self, mapping: int) -> int:
        """Make a copy-on-write fork of *mapping*: a new mapping of the very same versions."""
        src = self._get(mapping)
        versions = src.versions.copy()
        self._refcount[versions] += 1
        if src.cache_key is not None:
            self._cache_users[src.cache_key] += 1
        return self._add(_Mapping(versions, src.image_pages, src.cache_key))

    def private_copy(self, mapping: int, task: Hashable) -> int:
        """Make a private copy of *mapping* (what a CRIU restore does).

        The image part maps *task*'s page cache; the runtime part is fresh physical pages
        holding the same contents (same labels) as the source's.
        """
        src = self._get(mapping)
        runtime_labels = self._label[src.versions[src.image_pages :]]
        return self.create(task, src.image_pages, len(runtime_labels), runtime_labels=runtime_labels)

    def patch(self, mapping: int, positions: np.ndarray, labels: np.ndarray) -> int:
        """Fork *mapping* copy-on-write, then give the fork fresh private pages at *positions*
        holding content *labels* (a delta read back from disk on top of its parent).

        Only runtime pages can differ between two states of one task, so *positions* must be
        runtime positions.
        """
        src = self._get(mapping)
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and (positions.min() < src.image_pages or positions.max() >= len(src.versions)):
            raise ValueError("a patch replaces runtime pages only")
        new = self.share(mapping)
        m = self._mappings[new]
        if len(positions):
            old = m.versions[positions]
            self._refcount[old] -= 1  # all >= 1 after the share: nothing is freed here
            m.versions[positions] = self._alloc(len(positions), np.asarray(labels, dtype=np.int64))
        return new

    # -- changing mappings ------------------------------------------------------------------

    def write(self, mapping: int, nbytes: int, rng: np.random.Generator) -> int:
        """Dirty ``ceil(nbytes / page_size)`` distinct runtime pages of *mapping*, chosen by *rng*
        (at most all its runtime pages). Returns how many physical pages were allocated."""
        m = self._get(mapping)
        n_runtime = len(m.versions) - m.image_pages
        k = min(self.pages(nbytes), n_runtime)
        if k <= 0:
            return 0
        positions = rng.choice(n_runtime, size=k, replace=False) + m.image_pages
        return self.write_pages(mapping, positions)

    def write_pages(self, mapping: int, positions: np.ndarray) -> int:
        """Write the pages of *mapping* at *positions* (distinct). Returns pages allocated.

        A page whose version only this mapping maps is written in place (as Linux reuses a
        copy-on-write page with a single owner); any other gets a fresh private version.
        """
        m = self._get(mapping)
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) == 0:
            return 0
        if np.any(positions < m.image_pages) or np.any(positions >= len(m.versions)):
            raise ValueError("writes go to runtime pages only")
        v = m.versions[positions]
        shared = self._refcount[v] > 1
        in_place = v[~shared]
        if len(in_place):
            self._label[in_place] = self._new_labels(len(in_place))
        n = int(np.count_nonzero(shared))
        if n:
            self._refcount[v[shared]] -= 1
            m.versions[positions[shared]] = self._alloc(n, self._new_labels(n))
        return n

    def drop(self, mapping: int) -> int:
        """Destroy *mapping*. Returns how many physical pages were freed."""
        m = self._mappings.pop(mapping, None)
        if m is None:
            raise KeyError(f"no mapping {mapping} in this page model")
        v = m.versions
        self._refcount[v] -= 1
        freed = v[self._refcount[v] == 0]
        self._push_free(freed)
        self._physical -= len(freed)
        if m.cache_key is not None:
            left = self._cache_users[m.cache_key] - 1
            if left:
                self._cache_users[m.cache_key] = left
            else:  # its versions were freed with this mapping
                del self._cache_users[m.cache_key]
                del self._cache[m.cache_key]
        return len(freed)

    # -- internals --------------------------------------------------------------------------

    def _get(self, mapping: int) -> _Mapping:
        try:
            return self._mappings[mapping]
        except KeyError:
            raise KeyError(f"no mapping {mapping} in this page model") from None

    def _add(self, m: _Mapping) -> int:
        mid = self._next_mapping
        self._next_mapping += 1
        self._mappings[mid] = m
        return mid

    def _cache_versions(self, task: Hashable, labels: np.ndarray) -> np.ndarray:
        cache = self._cache.get(task)
        if cache is None:
            cache = self._cache[task] = self._alloc(len(labels), labels)
            self._cache_users[task] = 1
        else:
            self._refcount[cache] += 1
            self._cache_users[task] += 1
        return cache.copy()

    def _new_labels(self, n: int) -> np.ndarray:
        first = self._next_label
        self._next_label += n
        return np.arange(first, first + n, dtype=np.int64)

    def _alloc(self, n: int, labels: np.ndarray) -> np.ndarray:
        """Hand out *n* fresh versions with refcount 1 and the given content labels."""
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        take = min(n, self._free_top)
        reused = self._free[self._free_top - take : self._free_top].copy()
        self._free_top -= take
        extra = n - take
        if extra:
            need = self._next_version + extra
            if need > len(self._refcount):
                cap = len(self._refcount)
                while cap < need:
                    cap *= 2
                self._refcount = _grown(self._refcount, cap)
                self._label = _grown(self._label, cap)
            fresh = np.arange(self._next_version, need, dtype=np.int64)
            self._next_version = need
            versions = np.concatenate([reused, fresh]) if take else fresh
        else:
            versions = reused
        self._refcount[versions] = 1
        self._label[versions] = labels
        self._physical += n
        return versions

    def _push_free(self, freed: np.ndarray) -> None:
        n = len(freed)
        if not n:
            return
        need = self._free_top + n
        if need > len(self._free):
            cap = len(self._free)
            while cap < need:
                cap *= 2
            self._free = _grown(self._free, cap)
        self._free[self._free_top : need] = freed
        self._free_top = need


def _grown(a: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros(capacity, dtype=a.dtype)
    out[: len(a)] = a
    return out
