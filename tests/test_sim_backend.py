"""The simulated backend: engine memory behaviour, costs in virtual time, the outcome oracle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import pytest
import trio.testing

from bunshin_async._backend import CallContext, ColdSnapshot, Workspace
from bunshin_async._exceptions import BackendError, ConfigError, WorkspaceReleasedError
from bunshin_async._trace import (
    MemoryProfile,
    Rollout,
    RolloutKey,
    Step,
    Task,
    ToolCall,
    Trace,
    call_key,
    observation_digest,
)
from sim._backend import SimBackend, SimStatistics, ToolModel
from sim._engines import ENGINE_NAMES, ENGINES, GIB, MIB, EngineModel, engine_model

PS = 1 << 20
IMAGE = 64 * MIB
RUNTIME = 192 * MIB
BOOT = 20.0
TASK = Task(id="t", memory=MemoryProfile(image_bytes=IMAGE, runtime_bytes=RUNTIME, boot_time=BOOT))
OTHER = Task(id="u", memory=MemoryProfile(image_bytes=IMAGE, runtime_bytes=RUNTIME, boot_time=BOOT))


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=args)


def step(c: ToolCall, exec_time: float, digest: str, dirtied: int = 0, size: int = 10) -> Step:
    return Step(
        think_time=1.0,
        call=c,
        exec_time=exec_time,
        observation_digest=digest,
        observation_size=size,
        dirtied_bytes=dirtied,
    )


A = call("shell", cmd="ls")
B = call("shell", cmd="cat a")
C = call("click", x=1)
D = call("type", text="hi")

TRACE = Trace(
    version=1,
    name="unit",
    tasks=[TASK, OTHER],
    rollouts=[
        Rollout(
            epoch=0, task="t", group=0, sample=0, reward=1.0,
            steps=[step(A, 2.0, "sha256:a0", 8 * MIB), step(B, 3.0, "sha256:b0", 4 * MIB, 100)],
        ),
        Rollout(
            epoch=0, task="t", group=0, sample=1, reward=0.0,
            steps=[step(A, 2.5, "sha256:a1", 8 * MIB), step(B, 4.0, "sha256:b1", 2 * MIB, 300)],
        ),
        Rollout(
            epoch=0, task="t", group=0, sample=2, reward=0.0,
            steps=[step(B, 9.0, "sha256:b2", 6 * MIB, 500), step(C, 5.0, "sha256:c2", 1 * MIB, 7)],
        ),
        Rollout(
            epoch=0, task="u", group=0, sample=0, reward=0.0,
            steps=[step(D, 7.0, "sha256:d", 3 * MIB, 11)],
        ),
    ],
)
R0 = RolloutKey(0, "t", 0, 0)
R1 = RolloutKey(0, "t", 0, 1)
R9 = RolloutKey(5, "t", 0, 9)  # not in the trace


def ctx(rollout: RolloutKey = R9, i: int = 0) -> CallContext:
    return CallContext(rollout=rollout, step=i)


def run_virtual(fn: Callable[[], Awaitable[None]]) -> None:
    """Run *fn* under trio with a virtual clock that jumps whenever everything sleeps."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    anyio.run(fn, backend="trio", backend_options={"clock": clock})


def backend(engine: str | EngineModel, seed: int = 0) -> SimBackend:
    return SimBackend(engine, ToolModel(TRACE), page_size=PS, seed=seed)


def pt(eng: str, nbytes: int = IMAGE + RUNTIME) -> int:
    return ENGINES[eng].overhead_bytes(nbytes)


# -- engines ---------------------------------------------------------------------------------


def test_every_numeric_parameter_has_a_source() -> None:
    assert set(ENGINES) == set(ENGINE_NAMES) == {"bunshin", "criu", "microvm", "restart", "cold"}
    for name, model in ENGINES.items():
        assert model.name == name
        numeric = [
            f for f in msgspec.structs.fields(model)
            if isinstance(getattr(model, f.name), (int, float)) and not isinstance(getattr(model, f.name), bool)
        ]
        assert len(numeric) >= 15
        for f in numeric:
            assert model.sources.get(f.name, "").strip(), f"{name}.{f.name} has no source"
            assert getattr(model, f.name) >= 0


def test_engine_model_names_the_valid_engines() -> None:
    assert engine_model("criu") is ENGINES["criu"]
    with pytest.raises(ConfigError, match="bunshin, criu, microvm, restart, cold"):
        engine_model("docker")
    with pytest.raises(ConfigError):
        backend("docker")


def test_cost_formulas() -> None:
    b = ENGINES["bunshin"]
    assert b.fork_time(4 * GIB) == pytest.approx(b.fork_base + 4 * b.fork_per_gib)
    assert b.overhead_bytes(4 * GIB) == 8 * MIB  # 8 bytes per 4 KiB
    v = ENGINES["microvm"]
    assert v.overhead_bytes(4 * GIB) == 16 * MIB + v.guest_kernel_bytes + v.vmm_bytes
    c = ENGINES["criu"]
    assert c.dump_time(256 * MIB) == pytest.approx(0.5)  # 2 s under TCG / 4
    assert c.restore_time(256 * MIB) == pytest.approx(0.25)  # 1 s under TCG / 4


# -- memory behaviour ------------------------------------------------------------------------


def test_bunshin_forks_share_everything_until_written() -> None:
    async def main() -> None:
        be = backend("bunshin")
        root = await be.freeze(await be.create(TASK))
        forks = [await be.fork(root) for _ in range(4)]
        total = IMAGE + RUNTIME
        # one copy of the pages; page tables per fork and for the frozen tree
        assert be.working_set() == total + 5 * pt("bunshin")
        mem = be.workspace_memory(forks[0])
        assert mem.shared_bytes == total
        assert mem.private_bytes == pt("bunshin")
        await be.execute(forks[0], A, ctx(R0, 0))  # dirties 8 MiB
        assert be.workspace_memory(forks[0]).private_bytes == 8 * MIB + pt("bunshin")
        assert be.working_set() == total + 8 * MIB + 5 * pt("bunshin")
        assert be.workspace_memory(forks[1]).private_bytes == pt("bunshin")

    run_virtual(main)


def test_criu_forks_are_private_copies() -> None:
    async def main() -> None:
        be = backend("criu")
        root = await be.freeze(await be.create(TASK))
        # the frozen workspace is an image in tmpfs: its anonymous memory
        assert be.working_set() == RUNTIME
        assert be.workspace_memory(root).private_bytes == RUNTIME
        forks = [await be.fork(root) for _ in range(3)]
        assert be.working_set() == RUNTIME + IMAGE + 3 * RUNTIME + 3 * pt("criu")
        mem = be.workspace_memory(forks[0])
        assert mem.shared_bytes == IMAGE  # file-backed pages through the page cache
        assert mem.private_bytes == RUNTIME + pt("criu")
        # a fork of a live workspace is a private copy too (the transient image is freed)
        before = be.working_set()
        await be.fork(forks[0])
        assert be.working_set() == before + RUNTIME + pt("criu")

    run_virtual(main)


def test_microvm_shares_snapshot_memory_but_pays_a_kernel_per_vm() -> None:
    async def main() -> None:
        be = backend("microvm")
        m = ENGINES["microvm"]
        total = IMAGE + RUNTIME
        a = await be.create(TASK)
        b = await be.create(TASK)
        # a booted VM has its own guest page cache: nothing shared with another VM
        assert be.workspace_memory(a).shared_bytes == 0
        assert be.working_set() == 2 * total + 2 * pt("microvm")
        await be.release(b)
        snap = await be.snapshot(a)
        fork = await be.fork(snap)
        mem = be.workspace_memory(fork)
        assert mem.shared_bytes == total
        overhead = m.guest_kernel_bytes + m.vmm_bytes + total // 4096 * 16
        assert mem.private_bytes == overhead == pt("microvm")
        assert be.workspace_memory(snap).private_bytes == 0  # a memory file: no VM overhead
        assert be.working_set() == total + 2 * overhead

    run_virtual(main)


@pytest.mark.parametrize("engine", ["restart", "cold"])
def test_restart_and_cold_snapshots_hold_no_memory(engine: str) -> None:
    async def main() -> None:
        be = backend(engine)
        ws = await be.create(TASK)
        assert be.working_set() == IMAGE + RUNTIME + pt(engine)
        snap = await be.snapshot(ws)
        assert be.workspace_memory(snap).private_bytes == 0
        assert be.workspace_memory(snap).shared_bytes == 0
        assert be.working_set() == IMAGE + RUNTIME + pt(engine)
        await be.release(ws)
        assert be.working_set() == 0
        fork = await be.fork(snap)
        # rebuilt runtime pages are private; image pages come from the page cache
        other = await be.fork(snap)
        assert be.workspace_memory(fork).shared_bytes == IMAGE
        assert be.working_set() == IMAGE + 2 * RUNTIME + 2 * pt(engine)
        frozen = await be.freeze(other)
        assert be.workspace_memory(frozen) .private_bytes == 0
        assert be.working_set() == IMAGE + RUNTIME + pt(engine)
        del fork

    run_virtual(main)


def test_bunshin_demote_and_promote_move_only_the_delta() -> None:
    async def main() -> None:
        be = backend("bunshin")
        m = ENGINES["bunshin"]
        root = await be.freeze(await be.create(TASK))
        ws = await be.fork(root)
        await be.execute(ws, A, ctx(R0, 0))  # 8 MiB
        child = await be.freeze(ws)
        before = be.working_set()
        t0 = anyio.current_time()
        cold = await be.demote(child, root)
        assert anyio.current_time() - t0 == pytest.approx(8 * MIB / m.disk_write_bandwidth)
        assert cold.stored_bytes == 8 * MIB
        assert child.released
        assert be.working_set() == before - 8 * MIB - pt("bunshin")
        t0 = anyio.current_time()
        back = await be.promote(cold, root)
        expected = m.fork_time(IMAGE + RUNTIME) + 8 * MIB / m.disk_read_bandwidth
        assert anyio.current_time() - t0 == pytest.approx(expected)
        assert be.working_set() == before
        assert be.workspace_memory(back).private_bytes == 8 * MIB + pt("bunshin")
        # the promoted snapshot's forks continue where the demoted one was
        fork = await be.fork(back)
        result = await be.execute(fork, B, ctx(R0, 1))
        assert result.observation_digest == "sha256:b0"
        # against nothing, the whole state is the delta
        root_cold = await be.demote(await be.snapshot(fork), None)
        assert root_cold.stored_bytes == IMAGE + RUNTIME
        same = await be.demote(await be.snapshot(fork), root_cold)
        assert same.stored_bytes == 0
        await be.execute(fork, C, ctx(R9, 2))  # modelled: the task's one click dirtied 1 MiB
        on_cold = await be.demote(await be.snapshot(fork), root_cold)
        assert on_cold.stored_bytes == 1 * MIB

    run_virtual(main)


def test_criu_checkpoints_on_disk_are_outside_the_working_set() -> None:
    on_disk = msgspec.structs.replace(ENGINES["criu"], checkpoint_in_memory=False)

    async def main() -> None:
        be = backend(on_disk)
        ws = await be.create(TASK)
        # the snapshot charge of a checkpoint on disk is no memory; in tmpfs it is the image
        assert be.snapshot_charge(ws, 8 * MIB) == 0
        tmpfs = backend("criu")
        assert tmpfs.snapshot_charge(await tmpfs.create(TASK), 8 * MIB) == RUNTIME
        root = await be.freeze(ws)
        assert be.working_set() == 0  # the dump is on disk, the process is gone
        assert be.workspace_memory(root).private_bytes == 0
        forks = [await be.fork(root) for _ in range(3)]
        # the restores are private copies all the same
        assert be.working_set() == IMAGE + 3 * RUNTIME + 3 * pt("criu")
        await be.execute(forks[0], A, ctx(R0, 0))
        snap = await be.freeze(forks[0])
        assert be.working_set() == IMAGE + 2 * RUNTIME + 2 * pt("criu")
        cold = await be.demote(snap, root)
        assert cold.stored_bytes == 8 * MIB  # the delta against the root's image, as in tmpfs
        back = await be.promote(cold, root)
        assert be.workspace_memory(back).private_bytes == 0

    run_virtual(main)


def test_criu_checkpoints_on_disk_go_no_faster_than_the_disk() -> None:
    tmpfs = ENGINES["criu"]
    slow_disk = msgspec.structs.replace(tmpfs, checkpoint_in_memory=False, disk_write_bandwidth=64.0 * MIB,
                                        disk_read_bandwidth=128.0 * MIB)
    fast_disk = msgspec.structs.replace(tmpfs, checkpoint_in_memory=False)
    # a fast disk leaves CRIU's own rates (measured on tmpfs) as the limit
    assert fast_disk.dump_time(256 * MIB) == pytest.approx(tmpfs.dump_time(256 * MIB))
    assert fast_disk.restore_time(256 * MIB) == pytest.approx(tmpfs.restore_time(256 * MIB))
    # a slow one is the limit
    assert slow_disk.dump_time(256 * MIB) == pytest.approx(tmpfs.dump_base + 4.0)
    assert slow_disk.restore_time(256 * MIB) == pytest.approx(tmpfs.restore_base + 2.0)
    assert ENGINES["criu"].checkpoint_in_memory  # the default: tmpfs (DESIGN.md)


def test_criu_demote_frees_the_image() -> None:
    async def main() -> None:
        be = backend("criu")
        root = await be.freeze(await be.create(TASK))
        ws = await be.fork(root)
        await be.execute(ws, A, ctx(R0, 0))
        snap = await be.freeze(ws)
        before = be.working_set()
        cold = await be.demote(snap, root)
        assert cold.stored_bytes == 8 * MIB  # the restored copy has the same content as root
        assert be.working_set() == before - RUNTIME
        back = await be.promote(cold, root)
        assert be.workspace_memory(back).private_bytes == RUNTIME
        assert be.working_set() == before

    run_virtual(main)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_everything_released_leaves_nothing(engine: str) -> None:
    async def main() -> None:
        be = backend(engine)
        handles: list[Workspace | ColdSnapshot] = []
        root = await be.freeze(await be.create(TASK))
        ws = [await be.fork(root) for _ in range(3)]
        for i, w in enumerate(ws):
            await be.execute(w, A, ctx(RolloutKey(0, "t", 0, i), 0))
        snap = await be.snapshot(ws[0])
        cold = await be.demote(snap, root)
        promoted = await be.promote(cold, root)
        handles += [root, *ws, cold, promoted]
        assert be.live_handles() == len(handles)
        assert be.working_set() > 0
        for h in handles:
            await be.release(h)
        assert be.live_handles() == 0
        assert be.working_set() == 0
        assert be.pages.live_mappings == 0
        stats = be.statistics()
        assert stats.releases == len(handles)
        assert stats.peak_working_set > 0

    run_virtual(main)


# -- costs in virtual time -------------------------------------------------------------------


async def _timed(op: Awaitable[Any]) -> tuple[Any, float]:
    t0 = anyio.current_time()
    value = await op
    return value, anyio.current_time() - t0


def test_costs_are_charged_in_virtual_time() -> None:
    total = IMAGE + RUNTIME

    async def main() -> None:
        seen: dict[str, dict[str, float]] = {}
        for name in ENGINE_NAMES:
            m = ENGINES[name]
            be = backend(name)
            t: dict[str, float] = {}
            ws, t["create"] = await _timed(be.create(TASK))
            _, t["exec"] = await _timed(be.execute(ws, A, ctx(R0, 0)))
            _, t["exec2"] = await _timed(be.execute(ws, B, ctx(R0, 1)))
            snap, t["snapshot"] = await _timed(be.snapshot(ws))
            _, t["fork_snapshot"] = await _timed(be.fork(snap))
            _, t["fork_live"] = await _timed(be.fork(ws))
            _, t["freeze"] = await _timed(be.freeze(ws))
            seen[name] = t
            stats = be.statistics()
            charged = sum(getattr(stats, f) for f in SimStatistics.__struct_fields__ if f.endswith("_seconds"))
            assert charged == pytest.approx(sum(t.values()))
            assert stats.execution_seconds == pytest.approx(5.0)
            assert t["exec"] == 2.0 and t["exec2"] == 3.0
            assert t["create"] == pytest.approx(BOOT + m.vm_boot_time)
        replay = 2.0 + 3.0
        b, c, v, r, k = (ENGINES[n] for n in ENGINE_NAMES)
        assert seen["bunshin"]["snapshot"] == pytest.approx(b.fork_time(total))
        assert seen["bunshin"]["fork_snapshot"] == pytest.approx(b.fork_time(total))
        assert seen["bunshin"]["fork_live"] == pytest.approx(b.fork_time(total))
        assert seen["bunshin"]["freeze"] == pytest.approx(b.freeze_time)
        assert seen["criu"]["snapshot"] == pytest.approx(c.dump_time(RUNTIME))
        assert seen["criu"]["fork_snapshot"] == pytest.approx(c.restore_time(RUNTIME))
        assert seen["criu"]["fork_live"] == pytest.approx(c.dump_time(RUNTIME) + c.restore_time(RUNTIME))
        assert seen["criu"]["freeze"] == pytest.approx(c.dump_time(RUNTIME))
        assert seen["microvm"]["snapshot"] == pytest.approx(v.freeze_time + total / v.snapshot_bandwidth)
        assert seen["microvm"]["fork_snapshot"] == pytest.approx(v.restore_base)
        assert seen["restart"]["fork_snapshot"] == pytest.approx(r.fork_base + BOOT * r.restart_boot_factor + replay)
        assert seen["restart"]["snapshot"] == pytest.approx(r.freeze_time)
        assert seen["cold"]["fork_snapshot"] == pytest.approx(BOOT + replay)
        assert seen["cold"]["fork_live"] == pytest.approx(BOOT + replay)
        # who is fastest to fork a snapshot: bunshin beats the copies and the replays
        assert seen["bunshin"]["fork_snapshot"] < seen["criu"]["fork_snapshot"] < seen["restart"]["fork_snapshot"]
        assert seen["restart"]["fork_snapshot"] < seen["cold"]["fork_snapshot"]

    run_virtual(main)


def test_concurrent_costs_overlap_in_virtual_time() -> None:
    async def main() -> None:
        be = backend("cold")
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(be.create, TASK)
        assert anyio.current_time() - t0 == pytest.approx(BOOT)
        assert be.statistics().create_seconds == pytest.approx(5 * BOOT)

    run_virtual(main)


# -- the outcome oracle ----------------------------------------------------------------------


def test_tool_model_lookup_order() -> None:
    tm = ToolModel(TRACE)
    a = call_key(A)
    # 1. the rollout's own step, when its recorded prefix matches
    assert tm.outcome("t", (), A, ctx(R0)).observation_digest == "sha256:a0"
    assert tm.outcome("t", (), A, ctx(R1)).observation_digest == "sha256:a1"
    assert tm.outcome("t", (a,), B, ctx(R1, 1)).observation_digest == "sha256:b1"
    # 2. else the first rollout that made the call after exactly this history
    assert tm.outcome("t", (a,), B, ctx(R9, 1)).observation_digest == "sha256:b0"
    r2 = RolloutKey(0, "t", 0, 2)  # its own step 1 is C after B, not B after A
    assert tm.outcome("t", (a,), B, ctx(r2, 1)).observation_digest == "sha256:b0"
    assert tm.outcome("t", (), B, ctx(R0, 0)).observation_digest == "sha256:b2"
    out = tm.outcome_at("t", tm.path_of("t", ()), 0, B, ctx(R0, 0))
    assert out.source == "prefix"
    # 3. else modelled: medians of the tool in the task, a digest of the path
    res = tm.outcome("t", (a, a), B, ctx(R0, 2))
    # the task's shell steps: exec 2.0, 3.0, 2.5, 4.0, 9.0; dirtied 8, 4, 8, 2, 6 MiB
    assert res.exec_time == 3.0
    assert res.dirtied_bytes == 6 * MIB
    assert res.observation_size == 100
    expected_path = tm.extend(tm.path_of("t", (a, a)), call_key(B))
    assert res.observation_digest == observation_digest(expected_path)
    assert tm.outcome_at("t", tm.path_of("t", (a, a)), 2, B, ctx(R0, 2)).source == "model"
    # ... the whole trace's medians for a tool the task never used
    res = tm.outcome("t", (), D, ctx(R0))
    assert (res.exec_time, res.dirtied_bytes, res.observation_size) == (7.0, 3 * MIB, 11)
    # ... and defaults for an unknown tool
    res = tm.outcome("t", (), call("scroll"), ctx(R0))
    assert (res.exec_time, res.dirtied_bytes) == (1.0, 0)
    # modelled digests are deterministic and depend on the path
    again = ToolModel(TRACE).outcome("t", (), call("scroll"), ctx(R0))
    assert again == res
    assert tm.outcome("t", (a,), call("scroll"), ctx(R0)).observation_digest != res.observation_digest
    # the same call in another task does not match this task's recordings
    assert tm.outcome("u", (), A, ctx(R9)).observation_digest.startswith("sha256:")
    assert tm.outcome("u", (), A, ctx(R9)).observation_digest not in {"sha256:a0", "sha256:a1"}


def test_backend_tracks_each_workspace_path() -> None:
    async def main() -> None:
        be = backend("bunshin")
        root = await be.freeze(await be.create(TASK))
        w0 = await be.fork(root)
        w9 = await be.fork(root)
        assert (await be.execute(w0, A, ctx(R0, 0))).observation_digest == "sha256:a0"
        assert (await be.execute(w9, A, ctx(R1, 0))).observation_digest == "sha256:a1"
        # a fork of w0 carries w0's history
        f = await be.fork(w0)
        assert (await be.execute(f, B, ctx(R9, 1))).observation_digest == "sha256:b0"
        assert (await be.execute(f, B, ctx(R9, 2))).exec_time == 3.0  # modelled: the median
        stats = be.statistics()
        assert (stats.recorded_outcomes, stats.modelled_outcomes) == (3, 1)

    run_virtual(main)


# -- errors ----------------------------------------------------------------------------------


def test_released_handles_raise() -> None:
    async def main() -> None:
        be = backend("bunshin")
        ws = await be.create(TASK)
        snap = await be.freeze(ws)
        assert ws.released and not snap.released
        with pytest.raises(WorkspaceReleasedError, match=f"workspace {ws.id} of task 't'"):
            await be.execute(ws, A, ctx())
        with pytest.raises(WorkspaceReleasedError):
            await be.fork(ws)
        with pytest.raises(WorkspaceReleasedError):
            be.workspace_memory(ws)
        with pytest.raises(WorkspaceReleasedError):
            await be.release(ws)
        cold = await be.demote(snap, None)
        with pytest.raises(WorkspaceReleasedError, match=f"snapshot {snap.id}"):
            await be.fork(snap)
        await be.release(cold)
        with pytest.raises(WorkspaceReleasedError, match="cold snapshot"):
            await be.release(cold)
        with pytest.raises(WorkspaceReleasedError):
            await be.promote(cold, None)
        assert be.live_handles() == 0

    run_virtual(main)


def test_misuse_raises_backend_error() -> None:
    async def main() -> None:
        be = backend("bunshin")
        ws = await be.create(TASK)
        snap = await be.snapshot(ws)
        with pytest.raises(BackendError, match="frozen snapshot") as info:
            await be.execute(snap, A, ctx())
        assert not isinstance(info.value, WorkspaceReleasedError)
        with pytest.raises(BackendError):
            await be.freeze(snap)
        with pytest.raises(BackendError, match="only a frozen snapshot"):
            await be.demote(ws, None)
        other = await be.freeze(await be.create(OTHER))
        with pytest.raises(BackendError, match="different tasks"):
            await be.demote(snap, other)
        with pytest.raises(BackendError, match="not made by this backend"):
            await backend("bunshin").fork(snap)

    run_virtual(main)


def test_release_completes_under_cancellation() -> None:
    slow = msgspec.structs.replace(ENGINES["bunshin"], release_time=5.0)

    async def main() -> None:
        be = backend(slow)
        ws = await be.create(TASK)
        with anyio.move_on_after(1.0):
            await be.release(ws)
        assert ws.released
        assert be.live_handles() == 0 and be.working_set() == 0

    run_virtual(main)


# -- determinism -----------------------------------------------------------------------------


def _script(engine: str, seed: int) -> list[Any]:
    record: list[Any] = []

    async def main() -> None:
        be = backend(engine, seed)
        root = await be.freeze(await be.create(TASK))
        ws = [await be.fork(root) for _ in range(4)]
        for i, w in enumerate(ws):
            await be.execute(w, A, ctx(RolloutKey(0, "t", 0, i % 2), 0))
            await be.execute(w, C, ctx(RolloutKey(0, "t", 0, i % 2), 1))
            record.append(be.workspace_memory(w))
        record.append(be.statistics())
        record.append([be.pages.versions(be._states[w.id].mapping).tolist() for w in ws])  # type: ignore[arg-type]
        record.append(anyio.current_time())

    run_virtual(main)
    return record


def test_same_seed_same_results() -> None:
    assert _script("bunshin", 7) == _script("bunshin", 7)
    assert _script("bunshin", 7)[-2] != _script("bunshin", 8)[-2]  # which pages are dirtied


def test_asyncio_backend_runs_too() -> None:
    async def main() -> None:
        be = backend("bunshin", 0)
        ws = await be.create(msgspec.structs.replace(TASK, memory=MemoryProfile(IMAGE, RUNTIME, 0.0)))
        await be.release(ws)
        assert be.live_handles() == 0

    anyio.run(main, backend="asyncio")
