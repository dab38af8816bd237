"""The tool-prefix tree: per task, workspace snapshots keyed by the calls that made them.

One root per task (the initialised workspace). An edge is a canonical tool call; a node holds
the observation that call returned and the workspace state after it, in one of three tiers:

- ``hot``: a snapshot in memory (a frozen fork), forked in milliseconds;
- ``cold``: the pages and files the call changed, relative to the parent, out of memory;
  brought back by promoting it on top of its parent;
- ``evicted``: only the call and its observation; the state is rebuilt by forking the nearest
  cached ancestor and replaying the calls in between.

Tiers never increase down the tree (a hot node's parent is hot, a cold node's parent is hot or
cold), so a cold delta always has its parent to be applied to. The hot tier has a byte budget:
a node is charged what the backend says its snapshot can hold beyond its hot parent
(:meth:`Backend.snapshot_charge`: the pages its call dirtied for a copy-on-write engine, a
whole image for a checkpointing one); a root is charged its whole memory, except while a
running group pins it, because then it is the base every sample of the group forks. A node is admitted hot only when its charge fits; otherwise
the least recently used unpinned hot leaves are demoted to the cold tier (in the background,
still charged until they are out of memory), and if the charge still does not fit the node is
stored evicted. So the charged hot bytes never exceed the budget. The cold tier has a byte
budget too; beyond it the least recently used cold leaves are dropped to evicted.

A call being run from a node is in flight until its child is inserted (:meth:`PrefixTree.running`):
a sample that reaches the same node with the same call meanwhile (the samples of a GRPO group
issue the same opening calls at about the same moment) waits for it
(:meth:`PrefixTree.wait_running`) and then finds the child, instead of running the call again.

Which snapshots leave a tier is the eviction policy's choice (:class:`~bunshin_async.EvictionPolicy`,
least recently used by default); the tree checks each victim it is given is an evictable leaf
of that tier (:class:`~bunshin_async.PolicyError` otherwise), so a policy can only choose, never
break the tiers or the budgets.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import anyio
import msgspec
from anyio.abc import TaskGroup

from ._backend import Backend, CallContext, ColdSnapshot, ToolResult, Workspace
from ._exceptions import BunshinError, PolicyError
from ._plugins import EvictionPolicy, LRUEviction, SnapshotInfo, policy_name
from ._policy import Observation
from ._trace import RolloutKey, Task, ToolCall, call_key

__all__ = ["PrefixTree", "Node", "Tier", "TreeStatistics", "open_prefix_tree"]


class Tier(enum.Enum):
    """Where a node's workspace state lives."""

    HOT = "hot"
    DEMOTING = "demoting"
    COLD = "cold"
    EVICTED = "evicted"


class Node:
    """A prefix-tree node: the state of a task's workspace after a sequence of calls."""

    __slots__ = (
        "task", "parent", "call", "key", "children", "depth", "observation", "result",
        "tier", "snapshot", "cold", "charge", "charged", "pins", "hits", "last_used",
        "demoted", "id", "created", "__weakref__",
    )

    def __init__(
        self, task: Task, parent: Node | None, call: ToolCall | None, result: ToolResult | None, id: int = 0
    ) -> None:
        self.id = id
        self.created = 0
        self.task = task
        self.parent = parent
        self.call = call
        self.key = call_key(call) if call is not None else b""
        self.children: dict[bytes, Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1
        self.result = result
        self.observation = (
            Observation(result.observation_digest, result.observation_size, result.output)
            if result is not None
            else None
        )
        self.tier = Tier.EVICTED
        self.snapshot: Workspace | None = None
        self.cold: ColdSnapshot | None = None
        self.charge = 0
        self.charged = False
        self.demoted: anyio.Event | None = None
        self.pins = 0
        self.hits = 0
        self.last_used = 0

    def __repr__(self) -> str:
        name = self.call.name if self.call else "root"
        return f"<node {self.task.id}@{self.depth} {name} {self.tier.value}>"


class TreeStatistics(msgspec.Struct, frozen=True):
    """What the prefix tree did over a run."""

    lookups: int
    """Cacheable calls looked up."""
    hits: int
    """Lookups answered by an existing node (the call was skipped)."""
    nodes: int
    """Nodes in the tree now, roots included."""
    admitted_hot: int
    """Nodes stored with a hot snapshot when inserted."""
    admitted_evicted: int
    """Nodes stored as a call log only because their charge did not fit."""
    demotions: int
    """Hot snapshots written to the cold tier."""
    promotions: int
    """Cold deltas brought back into memory."""
    drops: int
    """Cold deltas dropped (node left evicted) to stay within the cold budget."""
    replayed_calls: int
    """Calls re-executed to rebuild evicted nodes."""
    hot_bytes: int
    """Bytes charged to the hot tier now."""
    hot_bytes_peak: int
    """Largest hot-tier charge seen; never above ``hot_budget``."""
    hot_budget: int
    """The hot tier's budget in bytes."""
    cold_bytes: int
    """Bytes stored in the cold tier now."""
    cold_bytes_peak: int
    """The most bytes the cold tier stored at once (never above the cold budget)."""
    cold_budget: int
    """The cold tier's budget in bytes."""
    waits: int = 0
    """Lookups that first waited for the same call in flight from the same node (another
    sample was running it) instead of running it again."""


class PrefixTree:
    """The prefix tree of one run; open it with :func:`open_prefix_tree`.

    Args:
        backend: Makes, forks and releases the snapshots.
        task_group: Runs background demotions.
        hot_budget: Bytes the hot tier may be charged.
        cold_budget: Bytes the cold tier may store.
        on_change: Called after every operation that may change memory.
        eviction: Chooses the snapshots that leave a tier (:class:`LRUEviction` by default).
    """

    def __init__(
        self,
        backend: Backend,
        task_group: TaskGroup,
        *,
        hot_budget: int,
        cold_budget: int,
        on_change: Callable[[], None] = lambda: None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self._backend = backend
        self._eviction = eviction if eviction is not None else LRUEviction()
        self._ids = itertools.count(1)
        self._tg = task_group
        self._hot_budget = hot_budget
        self._cold_budget = cold_budget
        self._on_change = on_change
        self._roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self._hot_used = 0
        self._hot_peak = 0
        self._cold_used = 0
        self._cold_peak = 0
        self._n_nodes = 0
        self._lookups = self._hits = 0
        self._adm_hot = self._adm_evicted = 0
        self._demotions = self._promotions = self._drops = self._replayed = 0
        self._root_locks: dict[str, anyio.Lock] = {}
        self._in_flight: dict[tuple[Node, bytes], anyio.Event] = {}
        self._waits = 0
        self._closed = False

    # -- queries ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """Every node, roots first, parents before children."""
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def statistics(self) -> TreeStatistics:
        """Counts and byte totals so far."""
        return TreeStatistics(
            lookups=self._lookups,
            hits=self._hits,
            nodes=self._n_nodes,
            admitted_hot=self._adm_hot,
            admitted_evicted=self._adm_evicted,
            demotions=self._demotions,
            promotions=self._promotions,
            drops=self._drops,
            replayed_calls=self._replayed,
            hot_bytes=self._hot_used,
            hot_bytes_peak=self._hot_peak,
            hot_budget=self._hot_budget,
            cold_bytes=self._cold_used,
            cold_bytes_peak=self._cold_peak,
            cold_budget=self._cold_budget,
            waits=self._waits,
        )

    def lookup(self, node: Node, call: ToolCall) -> Node | None:
        """The child of *node* reached by *call*, counting a hit, or None (a miss)."""
        self._lookups += 1
        child = node.children.get(call_key(call))
        if child is not None:
            self._hits += 1
            child.hits += 1
            self._touch(child)
        return child

    @contextmanager
    def running(self, node: Node, call: ToolCall) -> Iterator[None]:
        """Mark *call* in flight from *node* for the block (run it and insert its child in
        the block): :meth:`wait_running` waits for the block to end. Nested or concurrent
        blocks for the same call and node mark it once, the first."""
        key = (node, call_key(call))
        if key in self._in_flight or key[1] in node.children:
            yield
            return
        done = self._in_flight[key] = anyio.Event()
        try:
            yield
        finally:
            del self._in_flight[key]
            done.set()

    async def wait_running(self, node: Node, call: ToolCall) -> bool:
        """Wait until *call* is no longer in flight from *node* (see :meth:`running`);
        return whether it was. Its child is then in the tree, unless the call failed or was
        cancelled."""
        done = self._in_flight.get((node, call_key(call)))
        if done is None:
            return False
        self._waits += 1
        await done.wait()
        return True

    def _new_node(self, task: Task, parent: Node | None, call: ToolCall | None, result: ToolResult | None) -> Node:
        n = Node(task, parent, call, result, next(self._ids))
        n.created = next(self._clock)
        return n

    def _touch(self, node: Node) -> None:
        t = next(self._clock)
        n: Node | None = node
        while n is not None:
            n.last_used = t
            n = n.parent

    # -- roots -----------------------------------------------------------------------------

    async def acquire_root(self, task: Task) -> Node:
        """Return *task*'s root, hot and pinned (booting or promoting it if needed).

        Every call must be matched by :meth:`release_root`.
        """
        lock = self._root_locks.setdefault(task.id, anyio.Lock())
        async with lock:
            root = self._roots.get(task.id)
            if root is None:
                root = self._new_node(task, None, None, None)
                self._roots[task.id] = root
                self._n_nodes += 1
            if root.tier is Tier.HOT:
                self._uncharge(root)
                root.pins += 1
            else:
                if root.tier is Tier.DEMOTING:
                    await self._wait_demoted(root)
                root.pins += 1
                try:
                    if root.tier is Tier.COLD:
                        assert root.cold is not None
                        snap = await self._backend.promote(root.cold, None)
                        self._promotions += 1
                        await self._release(root.cold)
                        self._cold_used -= root.cold.stored_bytes
                        root.cold = None
                    else:
                        ws = await self._backend.create(task)
                        try:
                            snap = await self._backend.freeze(ws)
                        except BaseException:
                            with anyio.CancelScope(shield=True):
                                await self._backend.release(ws)
                            raise
                except BaseException:
                    root.pins -= 1
                    raise
                root.snapshot = snap
                root.tier = Tier.HOT
                mem = self._backend.workspace_memory(snap)
                root.charge = mem.shared_bytes + mem.private_bytes
                self._on_change()
            self._touch(root)
            return root

    async def release_root(self, root: Node, *, keep: bool = True) -> None:
        """Unpin *root*. Once no group pins it: with *keep*, it stays in the tree, charged to
        the hot tier if it fits and demoted (after its hot subtree) if not; without *keep*,
        its snapshot is released at once and the next :meth:`acquire_root` boots anew."""
        root.pins -= 1
        if root.pins or root.tier is not Tier.HOT:
            return
        if not keep:
            snap, root.snapshot = root.snapshot, None
            root.tier = Tier.EVICTED
            del self._roots[root.task.id]
            self._n_nodes -= 1
            assert snap is not None
            await self._release(snap)
            self._on_change()
            return
        if self._make_room(root.charge, exclude=root):
            self._charge(root)
        else:
            # does not fit: straight out of memory, subtree first
            self._mark_demoting(root)
            self._tg.start_soon(self._demote_subtree, root)

    # -- insertion and materialisation ----------------------------------------------------

    async def insert(self, node: Node, call: ToolCall, result: ToolResult, workspace: Workspace | None) -> Node:
        """Add the child of *node* reached by *call* with *result*.

        *workspace*, when given, is the live workspace in the child's state: it is
        snapshotted if the child is admitted hot. If the child already exists (another
        sample inserted it meanwhile) the existing one is returned.
        """
        key = call_key(call)
        existing = node.children.get(key)
        if existing is not None:
            return existing
        child = self._new_node(node.task, node, call, result)
        if workspace is not None:
            child.charge = self._backend.snapshot_charge(workspace, result.dirtied_bytes)
        node.children[key] = child
        self._n_nodes += 1
        self._touch(child)
        if workspace is None or node.tier is not Tier.HOT or self._closed or not self._make_room(child.charge):
            self._adm_evicted += 1
            return child
        # charged from now on; stays evicted (so nobody forks it) until the snapshot exists,
        # and its parent is pinned meanwhile so it stays hot
        self._charge(child)
        node.pins += 1
        try:
            child.snapshot = await self._backend.snapshot(workspace)
        except BaseException:
            self._uncharge(child)
            raise
        finally:
            node.pins -= 1
        child.tier = Tier.HOT
        self._adm_hot += 1
        self._on_change()
        return child

    async def fork(self, node: Node, rollout: RolloutKey) -> Workspace:
        """Return a new live workspace in *node*'s state, from the nearest cached state.

        The anchor is the deepest node on the way down from the root (which a running group
        keeps hot) reached through hot and cold nodes only. A hot anchor is forked at once;
        a cold one is promoted, with the cold nodes above it, on top of the nearest hot
        ancestor (each kept hot where the budget allows). The calls below the anchor are
        then replayed in the fork.
        """
        while True:
            nodes = [node]
            while nodes[-1].parent is not None:
                nodes.append(nodes[-1].parent)  # type: ignore[arg-type]
            nodes.reverse()
            if nodes[0].tier is not Tier.HOT:
                raise BunshinError(f"{node!r}: its root is not in memory; acquire_root() it first")
            depth = 0
            for i, n in enumerate(nodes):
                if n.tier is Tier.EVICTED:
                    break
                depth = i
            for n in nodes[: depth + 1]:
                n.pins += 1
            try:
                ws = await self._fork_cached(nodes[: depth + 1])
            finally:
                for n in nodes[: depth + 1]:
                    n.pins -= 1
            if ws is not None:
                break
            # a node on the way was dropped from the cold tier meanwhile: look again
        try:
            for n in nodes[depth + 1 :]:
                assert n.call is not None
                await self._backend.execute(ws, n.call, CallContext(rollout, n.depth - 1, "replay"))
                self._replayed += 1
                self._on_change()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._backend.release(ws)
                self._on_change()
            raise
        return ws

    async def _fork_cached(self, chain: list[Node]) -> Workspace | None:
        """Fork the last node of *chain* (root first, all pinned, none evicted); None if one
        of them left the cold tier meanwhile."""
        temps: list[Workspace] = []
        try:
            base: Workspace | None = None
            for c in chain:
                if c.tier is Tier.DEMOTING:
                    await self._wait_demoted(c)
                if c.tier is Tier.HOT:
                    base = c.snapshot
                    continue
                if c.tier is not Tier.COLD:
                    return None
                assert c.cold is not None
                snap = await self._backend.promote(c.cold, base)
                self._promotions += 1
                self._on_change()
                parent_hot = c.parent is None or c.parent.tier is Tier.HOT
                # kept hot only when no other fork is reading the same delta meanwhile
                alone = c.pins == 1
                if parent_hot and alone and c.tier is Tier.COLD and self._make_room(c.charge):
                    self._charge(c)
                    self._cold_used -= c.cold.stored_bytes
                    cold, c.cold = c.cold, None
                    c.snapshot = snap
                    c.tier = Tier.HOT
                    await self._release(cold)
                else:
                    temps.append(snap)
                base = snap
            assert base is not None
            ws = await self._backend.fork(base)
            self._on_change()
            return ws
        finally:
            with anyio.CancelScope(shield=True):
                for t in temps:
                    await self._backend.release(t)
                if temps:
                    self._on_change()

    # -- budget ----------------------------------------------------------------------------

    def _charge(self, node: Node) -> None:
        if node.charged:
            return
        node.charged = True
        self._hot_used += node.charge
        if self._hot_used > self._hot_peak:
            self._hot_peak = self._hot_used

    def _uncharge(self, node: Node) -> None:
        if node.charged:
            node.charged = False
            self._hot_used -= node.charge

    def _mark_demoting(self, node: Node) -> None:
        node.tier = Tier.DEMOTING
        node.demoted = anyio.Event()

    def _make_room(self, need: int, exclude: Node | None = None) -> bool:
        """Start demoting LRU hot leaves until *need* more bytes fit; True if they fit now
        (demotions in flight still count, so this may be False while room is being made)."""
        if need > self._hot_budget:
            return False
        if self._hot_used + need <= self._hot_budget:
            return True
        freeing = 0
        for v in self._victims(Tier.HOT, (Tier.HOT, Tier.DEMOTING), need, exclude):
            if self._hot_used - freeing + need <= self._hot_budget:
                break
            self._mark_demoting(v)
            freeing += v.charge
            self._tg.start_soon(self._demote, v)
        return False

    def _victims(self, tier: Tier, here: tuple[Tier, ...], need: int, exclude: Node | None) -> Iterator[Node]:
        """Ask the eviction policy for the victims among the nodes of *tier* (a child in one
        of the tiers *here* keeps its parent in place) and check each as it is taken."""
        nodes: dict[int, Node] = {}
        infos: list[SnapshotInfo] = []
        for n in self.nodes():
            if n.tier is not tier or n is exclude:
                continue
            kids = sum(c.tier in here for c in n.children.values())
            in_use = n.pins > 0
            held = n.charge if tier is Tier.HOT else (n.cold.stored_bytes if n.cold is not None else 0)
            nodes[n.id] = n
            infos.append(SnapshotInfo(
                id=n.id, task=n.task.id, depth=n.depth, call=n.call, tier=tier.value,  # type: ignore[arg-type]
                bytes=held, hits=n.hits, last_used=n.last_used, created=n.created,
                in_use=in_use, children_here=kids, evictable=not in_use and kids == 0,
            ))
        if not infos:
            return
        taken: set[int] = set()
        who = policy_name(self._eviction)
        for info in self._eviction.victims(infos, need):
            node = nodes.get(info.id) if isinstance(info, SnapshotInfo) else None
            if node is None:
                raise PolicyError(
                    f"eviction policy {who} chose {info!r}, which is not one of the {tier.value} snapshots it was offered"
                )
            if info.id in taken:
                raise PolicyError(f"eviction policy {who} chose {node!r} twice")
            if not info.evictable:
                why = "in use (pinned by a running group or a fork)" if info.in_use else f"the parent of {info.children_here} snapshot(s) at least as hot"
                raise PolicyError(
                    f"eviction policy {who} chose {node!r}, which is {why}: only snapshots marked "
                    "evictable may leave their tier"
                )
            taken.add(info.id)
            yield node

    async def _demote_subtree(self, node: Node) -> None:
        """Demote *node* (already marked demoting) after its hot descendants."""
        for c in list(node.children.values()):
            if c.tier is Tier.HOT:
                self._mark_demoting(c)
                await self._demote_subtree(c)
            elif c.tier is Tier.DEMOTING:
                await self._wait_demoted(c)
        await self._demote(node)

    async def _demote(self, node: Node) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._demote_now(node)
            finally:
                # also when the backend or the eviction policy failed midway: nobody may wait
                # for this node forever (the run is failing; aclose() releases what it holds)
                if node.demoted is not None:
                    node.demoted.set()
                    node.demoted = None

    async def _demote_now(self, node: Node) -> None:
        snap = node.snapshot
        assert snap is not None
        parent = node.parent
        keep_cold = (
            not self._closed
            and (parent is None or parent.tier in (Tier.HOT, Tier.COLD, Tier.DEMOTING))
            and self._cold_room(node.charge)
        )
        cold: ColdSnapshot | None = None
        if keep_cold:
            base = None if parent is None else (parent.snapshot or parent.cold)
            cold = await self._backend.demote(snap, base)  # consumes the snapshot
            # the charge was an estimate: admit the delta for what it really stores
            if not self._cold_room(cold.stored_bytes):
                await self._backend.release(cold)
                cold = None
        if cold is not None:
            node.cold = cold
            self._cold_used += cold.stored_bytes
            self._cold_peak = max(self._cold_peak, self._cold_used)
            node.tier = Tier.COLD
            self._demotions += 1
        else:
            if not keep_cold:
                await self._backend.release(snap)
            node.tier = Tier.EVICTED
            await self._drop_cold_below(node)
        node.snapshot = None
        self._uncharge(node)
        self._on_change()

    def _cold_room(self, need: int) -> bool:
        if need > self._cold_budget:
            return False
        if self._cold_used + need <= self._cold_budget:
            return True
        for v in self._victims(Tier.COLD, (Tier.HOT, Tier.DEMOTING, Tier.COLD), need, None):
            if self._cold_used + need <= self._cold_budget:
                break
            assert v.cold is not None
            self._cold_used -= v.cold.stored_bytes
            self._tg.start_soon(self._release, v.cold)
            v.cold = None
            v.tier = Tier.EVICTED
            self._drops += 1
        return self._cold_used + need <= self._cold_budget

    async def _drop_cold_below(self, node: Node) -> None:
        """Drop the cold deltas under an evicted *node*: nothing can be applied to them now.
        A delta being promoted (pinned) is left to its user and dropped later."""
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tier is Tier.COLD and not n.pins and n.cold is not None:
                cold, n.cold = n.cold, None
                n.tier = Tier.EVICTED
                self._cold_used -= cold.stored_bytes
                self._drops += 1
                await self._release(cold)

    async def _wait_demoted(self, node: Node) -> None:
        if node.tier is Tier.DEMOTING and node.demoted is not None:
            await node.demoted.wait()

    async def _release(self, handle: Workspace | ColdSnapshot) -> None:
        with anyio.CancelScope(shield=True):
            await self._backend.release(handle)

    async def forget(self, task_id: str) -> bool:
        """Remove *task_id*'s subtree, releasing every snapshot and cold delta in it.

        Returns False, and changes nothing, while a running group pins the task's root; True
        otherwise (also when the tree holds nothing of the task). The next
        :meth:`acquire_root` of the task boots it anew.
        """
        root = self._roots.get(task_id)
        if root is None:
            return True
        if root.pins:
            return False
        # detached first, so that no eviction picks one of its nodes meanwhile
        del self._roots[task_id]
        self._root_locks.pop(task_id, None)
        stack, nodes = [root], []
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        self._n_nodes -= len(nodes)
        with anyio.CancelScope(shield=True):
            for n in nodes:
                await self._wait_demoted(n)
            for n in reversed(nodes):
                if n.snapshot is not None:
                    snap, n.snapshot = n.snapshot, None
                    self._uncharge(n)
                    await self._backend.release(snap)
                if n.cold is not None:
                    cold, n.cold = n.cold, None
                    self._cold_used -= cold.stored_bytes
                    await self._backend.release(cold)
                n.tier = Tier.EVICTED
            self._on_change()
        return True

    async def aclose(self) -> None:
        """Release every snapshot and cold delta the tree holds."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for n in list(self.nodes()):
                await self._wait_demoted(n)
            for n in reversed(list(self.nodes())):
                if n.snapshot is not None:
                    await self._backend.release(n.snapshot)
                    n.snapshot = None
                    self._uncharge(n)
                if n.cold is not None:
                    await self._backend.release(n.cold)
                    self._cold_used -= n.cold.stored_bytes
                    n.cold = None
                n.tier = Tier.EVICTED
            self._on_change()


@asynccontextmanager
async def open_prefix_tree(
    backend: Backend,
    *,
    hot_budget: int,
    cold_budget: int,
    on_change: Callable[[], None] = lambda: None,
    eviction: EvictionPolicy | None = None,
) -> AsyncIterator[PrefixTree]:
    """Open a :class:`PrefixTree`; on exit every snapshot it holds is released."""
    async with anyio.create_task_group() as tg:
        tree = PrefixTree(
            backend, tg, hot_budget=hot_budget, cold_budget=cold_budget, on_change=on_change, eviction=eviction
        )
        try:
            yield tree
        finally:
            await tree.aclose()
