"""The scheduler core on small hand-made traces, in virtual time.

Every trace here is a few tasks of 64 MiB each (no image, booting instantly), so the only
costs besides the recorded think and execution times are the bunshin engine's: 1 ms to
freeze a root and well under a millisecond per fork. Expected times are sums of the recorded
think and execution times, compared with a tolerance of ``SLACK`` seconds that covers those
engine costs and nothing else.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import trio.testing

from bunshin_async import (
    RecordedCacheability,
    ConfigError,
    HistorySelector,
    MemoryAccountant,
    MemoryProfile,
    Rollout,
    RolloutKey,
    RunResult,
    Scheduler,
    SchedulerConfig,
    Step,
    Task,
    ToolCall,
    Trace,
    TracePolicy,
    observation_digest,
    plan_steps,
)
from sim import SimBackend, ToolModel, build_simulation, run_virtual, simulate

MiB = 1 << 20
RUNTIME = 64 * MiB
DIRTY = 4 * MiB
# a bunshin snapshot's hot-tier charge: the pages its call dirtied plus its page tables
# (8 bytes per 4 KiB mapped)
NODE_CHARGE = DIRTY + RUNTIME // 4096 * 8
SLACK = 0.05


# -- trace builders ----------------------------------------------------------------------------


def make_task(tid: str = "t", boot: float = 0.0) -> Task:
    return Task(id=tid, memory=MemoryProfile(image_bytes=0, runtime_bytes=RUNTIME, boot_time=boot))


TASK_T = make_task("t")


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=args)


def step(c: ToolCall, think: float, exec_time: float, *, obs: str | None = None, cacheable: bool = True) -> Step:
    return Step(
        think_time=think,
        call=c,
        exec_time=exec_time,
        observation_digest=observation_digest(obs if obs is not None else f"{c.name}{sorted(c.arguments.items())}"),
        observation_size=10,
        dirtied_bytes=DIRTY,
        cacheable=cacheable,
    )


def rollout(
    task: str, steps: list[Step], *, epoch: int = 0, group: int = 0, sample: int = 0,
    reward: float = 1.0, final: float = 0.0,
) -> Rollout:
    return Rollout(
        epoch=epoch, task=task, group=group, sample=sample, reward=reward, steps=steps, final_think_time=final
    )


def make_trace(tasks: list[Task], rollouts: list[Rollout]) -> Trace:
    return Trace(version=1, name="unit", tasks=tasks, rollouts=rollouts)


def key(task: str = "t", sample: int = 0, epoch: int = 0, group: int = 0) -> RolloutKey:
    return RolloutKey(epoch, task, group, sample)


def by_key(result: RunResult) -> dict[RolloutKey, Any]:
    return {r.key: r for r in result.rollouts}


def recorded(trace: Trace) -> dict[RolloutKey, list[str]]:
    return {r.key: [s.observation_digest for s in r.steps] for r in trace.rollouts}


A = call("shell", cmd="a")
B = call("shell", cmd="b")
C = call("shell", cmd="c")
X = call("shell", cmd="x")
Y = call("shell", cmd="y")
CLOCK = call("clock")


# -- 1. synchronous steps ----------------------------------------------------------------------

# two tasks, one sample each: step 0 thinks 1+3+0.5 and runs 2+4; step 1 thinks 2+1, runs 1
SYNC_TRACE = make_trace(
    [make_task("t1"), make_task("t2")],
    [
        rollout("t1", [step(A, 1.0, 2.0), step(B, 3.0, 4.0)], final=0.5),
        rollout("t2", [step(A, 2.0, 1.0)], final=1.0),
    ],
)
SYNC_DURATIONS = [1.0 + 2.0 + 3.0 + 4.0 + 0.5, 2.0 + 1.0 + 1.0]


def test_sync_step_starts_when_the_previous_one_ended() -> None:
    r = simulate(SYNC_TRACE, policy="base", batch_tasks=1)
    s0, s1 = r.steps
    assert (s0.rollouts, s1.rollouts) == (1, 1)
    assert s0.start == 0.0
    assert s1.start == s0.end
    rollouts = by_key(r)
    assert rollouts[key("t2")].start >= s0.end
    assert rollouts[key("t1")].end <= s1.start
    for s, want in zip(r.steps, SYNC_DURATIONS):
        assert s.end - s.start == pytest.approx(want, abs=SLACK)
    assert r.makespan == pytest.approx(sum(s.end - s.start for s in r.steps), abs=1e-9)
    assert r.makespan == pytest.approx(sum(SYNC_DURATIONS), abs=SLACK)


def test_sync_train_time_is_added_between_steps() -> None:
    r0 = simulate(SYNC_TRACE, policy="base", batch_tasks=1)
    r = simulate(SYNC_TRACE, policy="base", batch_tasks=1, train_time=10.0)
    s0, s1 = r.steps
    assert s1.start == pytest.approx(s0.end + 10.0, abs=1e-9)
    # the step durations do not change; training after the last step is not in the makespan
    assert [s.end - s.start for s in r.steps] == pytest.approx([s.end - s.start for s in r0.steps], abs=1e-9)
    assert r.makespan == pytest.approx(r0.makespan + 10.0, abs=1e-9)


# -- 2. asynchronous steps with bounded staleness ----------------------------------------------

# four tasks, one sample each (one step each with batch_tasks=1): think 1, run 5, 2, 3, 1
ASYNC_EXEC = [5.0, 2.0, 3.0, 1.0]
ASYNC_TRACE = make_trace(
    [make_task(f"t{i}") for i in range(4)],
    [rollout(f"t{i}", [step(A, 1.0, d)]) for i, d in enumerate(ASYNC_EXEC)],
)


def test_async_staleness_one_overlaps_the_previous_step_but_not_the_one_before() -> None:
    r = simulate(ASYNC_TRACE, policy="base", batch_tasks=1, mode="async", staleness=1, max_concurrent=2)
    s = r.steps
    ro = [by_key(r)[key(f"t{i}")] for i in range(4)]
    # step 1 runs while step 0 still runs: slots allow two rollouts at once
    assert s[1].start == 0.0 and s[1].start < s[0].end
    assert ro[1].start < ro[0].end
    # step j waits exactly for step j-2
    assert s[2].start == s[0].end
    assert s[3].start == s[1].end
    for j in range(2, 4):
        assert ro[j].start >= s[j - 2].end
    for j, d in enumerate(ASYNC_EXEC):
        assert s[j].end - s[j].start == pytest.approx(1.0 + d, abs=SLACK)
    # 0..6 step 0, 0..3 step 1, 3..5 step 3, 6..10 step 2
    assert r.makespan == pytest.approx(10.0, abs=SLACK)
    assert max(n for _, n in r.running_timeline) == 2


def test_async_staleness_waits_for_step_j_minus_two_plus_train_time() -> None:
    r = simulate(
        ASYNC_TRACE, policy="base", batch_tasks=1, mode="async", staleness=1, max_concurrent=2, train_time=3.0
    )
    s = r.steps
    assert s[1].start == 0.0
    assert s[2].start == pytest.approx(s[0].end + 3.0, abs=1e-9)
    assert s[3].start == pytest.approx(s[1].end + 3.0, abs=1e-9)


def test_async_rollouts_wait_for_a_slot() -> None:
    # one slot: step 1 may start, but its rollout runs only once step 0's has ended
    r = simulate(ASYNC_TRACE, policy="base", batch_tasks=1, mode="async", staleness=1, max_concurrent=1)
    ro = [by_key(r)[key(f"t{i}")] for i in range(4)]
    for j in range(1, 4):
        assert ro[j].start >= ro[j - 1].end
    assert max(n for _, n in r.running_timeline) == 1
    assert r.makespan == pytest.approx(sum(1.0 + d for d in ASYNC_EXEC), abs=SLACK)


def test_async_staleness_zero_behaves_as_sync() -> None:
    sync = simulate(ASYNC_TRACE, policy="base", batch_tasks=1, mode="sync", max_concurrent=2)
    zero = simulate(ASYNC_TRACE, policy="base", batch_tasks=1, mode="async", staleness=0, max_concurrent=2)
    assert zero.steps == sync.steps
    assert [(x.start, x.end) for x in zero.rollouts] == [(x.start, x.end) for x in sync.rollouts]
    for j in range(1, 4):
        assert zero.steps[j].start == zero.steps[j - 1].end
    assert zero.makespan == pytest.approx(sum(1.0 + d for d in ASYNC_EXEC), abs=SLACK)


# -- 3. epoch times and the running timeline ----------------------------------------------------


def test_epoch_times_span_each_epochs_steps() -> None:
    tasks = [make_task("t1"), make_task("t2")]
    rollouts = [
        rollout(t, [step(A, 1.0, d)], epoch=e)
        for e, ds in ((0, (2.0, 3.0)), (1, (4.0, 1.0)))
        for t, d in zip(("t1", "t2"), ds)
    ]
    trace = make_trace(tasks, rollouts)
    r = simulate(trace, policy="base", batch_tasks=1, train_time=5.0)
    assert [s.epoch for s in r.steps] == [0, 0, 1, 1]
    s = r.steps
    assert r.epoch_times == {0: s[1].end - s[0].start, 1: s[3].end - s[2].start}
    # epoch 0: 3 + train 5 + 4; epoch 1: 5 + train 5 + 2
    assert r.epoch_times[0] == pytest.approx(12.0, abs=SLACK)
    assert r.epoch_times[1] == pytest.approx(12.0, abs=SLACK)
    assert s[2].start == pytest.approx(s[1].end + 5.0, abs=1e-9)
    assert r.makespan == s[3].end


def test_running_timeline_starts_and_ends_at_zero_and_peaks_at_rollouts_in_flight() -> None:
    # one group of three samples of different lengths, then (step 2) a single sample
    tasks = [make_task("t"), make_task("u")]
    rollouts = [rollout("t", [step(A, 1.0, d)], sample=i) for i, d in enumerate((1.0, 3.0, 5.0))]
    rollouts.append(rollout("u", [step(A, 1.0, 1.0)]))
    trace = make_trace(tasks, rollouts)
    r = simulate(trace, policy="base", batch_tasks=1)
    tl = r.running_timeline
    assert tl[0] == (0.0, 0)
    assert tl[-1] == (r.makespan, 0)
    assert all(n >= 0 for _, n in tl)
    assert [t for t, _ in tl] == sorted(t for t, _ in tl)
    assert max(n for _, n in tl) == 3
    counts = [n for _, n in tl]
    # 0 -> 3 running, then one ends at a time, then the second step's one sample
    assert counts == [0, 3, 2, 1, 0, 1, 0]


# -- 4. prefix caching -------------------------------------------------------------------------

# sample 0 makes A and B at 1..6 and 7..12; sample 1 thinks 20 s, so both nodes exist
CACHE_TRACE = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], sample=0),
        rollout("t", [step(A, 20.0, 5.0), step(B, 1.0, 5.0)], sample=1, final=0.5),
    ],
)


def test_prefix_cache_skips_every_call_of_a_repeated_trajectory() -> None:
    full = simulate(CACHE_TRACE, policy="full")
    base = simulate(CACHE_TRACE, policy="base")
    f, b = by_key(full)[key(sample=1)], by_key(base)[key(sample=1)]
    assert (f.cache_hits, f.executed, f.spec_hits) == (2, 0, 0)
    assert f.memory is None  # it never needed a workspace of its own
    assert (b.cache_hits, b.executed) == (0, 2)
    assert by_key(full)[key(sample=0)].cache_hits == 0
    assert f.observations == b.observations == recorded(CACHE_TRACE)[key(sample=1)]
    skipped = sum(s.exec_time for s in CACHE_TRACE.rollouts[1].steps)
    assert b.end - f.end == pytest.approx(skipped, abs=SLACK)
    assert f.end == pytest.approx(20.0 + 1.0 + 0.5, abs=SLACK)
    assert full.spec.launched == 0
    assert full.tree is not None and base.tree is None
    assert (full.tree.lookups, full.tree.hits, full.tree.nodes) == (4, 2, 3)
    assert full.cacheable_calls == 4 and full.calls == 4
    assert full.cache_hit_rate == pytest.approx(0.5)


def test_prefix_cache_a_non_cacheable_call_takes_the_sample_off_the_tree() -> None:
    # sample 1 makes A (a hit), then a clock call, then B: sample 0 inserted B right under
    # A, but sample 1's workspace is no longer in that state, so B must run, not hit
    trace = make_trace(
        [make_task("t")],
        [
            rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], sample=0),
            rollout(
                "t",
                [step(A, 20.0, 5.0), step(CLOCK, 1.0, 1.0, obs="12:00", cacheable=False), step(B, 1.0, 5.0)],
                sample=1,
            ),
        ],
    )
    r = simulate(trace, policy="full")
    s1 = by_key(r)[key(sample=1)]
    assert (s1.cache_hits, s1.executed) == (1, 2)
    assert s1.observations == recorded(trace)[key(sample=1)]
    assert r.tree is not None
    assert (r.tree.lookups, r.tree.hits) == (3, 1)  # sample 1's B was not even looked up
    assert r.cacheable_calls == 4 and r.calls == 5


def test_prefix_cache_never_answers_a_non_cacheable_tool() -> None:
    trace = make_trace(
        [make_task("t")],
        [
            rollout("t", [step(CLOCK, 1.0, 5.0, obs="now", cacheable=False), step(B, 1.0, 5.0)], sample=0),
            rollout("t", [step(CLOCK, 20.0, 5.0, obs="now", cacheable=False), step(B, 1.0, 5.0)], sample=1),
        ],
    )
    r = simulate(trace, policy="full")
    for x in r.rollouts:
        assert (x.cache_hits, x.executed) == (0, 2)
    assert r.tree is not None
    assert (r.tree.lookups, r.tree.hits, r.tree.nodes) == (0, 0, 1)
    assert r.cacheable_calls == 2


# -- 5. tiers ----------------------------------------------------------------------------------

# sample 1 repeats sample 0's A and B (hits) and then makes C, a miss that needs a workspace
# in the state after A and B
TIER_TRACE = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], sample=0),
        rollout("t", [step(A, 20.0, 5.0), step(B, 1.0, 5.0), step(C, 1.0, 2.0)], sample=1),
    ],
)


def test_zero_hot_budget_stores_nodes_evicted_and_replays_them() -> None:
    r = simulate(TIER_TRACE, policy="full", hot_budget=0, cold_budget=1 << 30)
    t = r.tree
    assert t is not None
    assert (t.admitted_hot, t.admitted_evicted) == (0, 3)
    assert t.hot_bytes_peak == 0
    # sample 1's workspace is rebuilt from the root by replaying A and B
    assert t.replayed_calls == 2
    s1 = by_key(r)[key(sample=1)]
    assert (s1.cache_hits, s1.executed) == (2, 1)
    assert s1.observations == recorded(TIER_TRACE)[key(sample=1)]
    # once B hits (21 s) the fork of B's state is prepared in the background, replaying A
    # and B (10 s) while the model thinks about C; C waits for it, then runs 2 s
    assert s1.end == pytest.approx(21.0 + 10.0 + 2.0, abs=SLACK)
    assert r.prepared_used == 1


def test_small_hot_budget_demotes_and_promotes_when_a_cold_node_is_needed() -> None:
    budget = 6 * MiB  # room for one node (NODE_CHARGE), not two
    r = simulate(TIER_TRACE, policy="full", hot_budget=budget, cold_budget=1 << 30)
    t = r.tree
    assert t is not None
    # A fits; B does not, so A is demoted to make room and B is stored evicted; C's parent
    # B is not hot, so C is stored evicted too
    assert (t.admitted_hot, t.admitted_evicted) == (1, 2)
    assert t.demotions >= 1
    # sample 1 sits on A (cold) and then B (evicted under A): A is promoted, B replayed
    assert t.promotions >= 1
    assert t.replayed_calls == 1
    assert t.hot_bytes_peak == NODE_CHARGE
    assert t.hot_bytes_peak <= budget
    assert t.hot_bytes == 0
    s1 = by_key(r)[key(sample=1)]
    assert (s1.cache_hits, s1.executed) == (2, 1)
    assert s1.observations == recorded(TIER_TRACE)[key(sample=1)]
    # the prepared fork of B: A promoted (kept hot) and B replayed (5 s) from 21 s on
    assert s1.end == pytest.approx(21.0 + 5.0 + 2.0, abs=SLACK)


def test_roots_go_cold_between_epochs_and_come_back() -> None:
    trace = make_trace(
        [make_task("t")],
        [
            rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], epoch=0),
            rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], epoch=1),
        ],
    )
    r = simulate(trace, policy="full", hot_budget=16 * MiB, cold_budget=1 << 30)
    t = r.tree
    assert t is not None
    # the root (64 MiB) never fits the hot tier once unpinned: it goes cold after epoch 0
    # and is promoted for epoch 1, where both calls hit
    assert t.demotions >= 1 and t.promotions >= 1
    assert t.hot_bytes_peak <= 16 * MiB
    e1 = by_key(r)[key(epoch=1)]
    assert (e1.cache_hits, e1.executed) == (2, 0)
    assert e1.observations == recorded(trace)[key(epoch=1)]


# -- 6. speculation ----------------------------------------------------------------------------

SPEC_SAME = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 2.0, 1.0), step(B, 3.0, 1.5)], epoch=0, final=0.5),
        rollout("t", [step(A, 2.0, 1.0), step(B, 3.0, 1.5)], epoch=1, final=0.5),
    ],
)
SPEC_DEVIATES = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 2.0, 1.0), step(B, 3.0, 1.5)], epoch=0, final=0.5),
        rollout("t", [step(X, 2.0, 1.0), step(Y, 3.0, 1.5)], epoch=1, final=0.5),
    ],
)


def test_speculation_hides_the_calls_epoch_zero_taught() -> None:
    spec = simulate(SPEC_SAME, policy="spec", spec_tail=1.0)
    base = simulate(SPEC_SAME, policy="base", spec_tail=1.0)
    assert spec.spec.launched == 2
    assert spec.spec.hits == 2 and spec.spec.misses == 0 and spec.spec.errors == 0
    assert spec.spec.hidden_exec_seconds == pytest.approx(1.0 + 1.5)
    assert spec.spec.wasted_exec_seconds == 0.0
    e0, e1 = by_key(spec)[key(epoch=0)], by_key(spec)[key(epoch=1)]
    assert (e0.spec_hits, e0.executed) == (0, 2)  # nothing learnt yet
    assert (e1.spec_hits, e1.executed, e1.cache_hits) == (2, 0, 0)
    assert e1.observations == recorded(SPEC_SAME)[key(epoch=1)]
    assert spec.epoch_times[1] < base.epoch_times[1]
    assert base.epoch_times[1] - spec.epoch_times[1] == pytest.approx(2.5, abs=SLACK)
    assert spec.epoch_times[1] == pytest.approx(2.0 + 3.0 + 0.5, abs=SLACK)
    assert spec.epoch_times[0] == pytest.approx(base.epoch_times[0], abs=1e-9)


def test_speculation_on_a_deviating_epoch_misses_and_wastes() -> None:
    r = simulate(SPEC_DEVIATES, policy="spec", spec_tail=1.0)
    # A is predicted for epoch 1 and runs to completion (1 s) while the model thinks (2 s);
    # the model calls X instead; after X nothing is known, so nothing else is launched
    assert (r.spec.launched, r.spec.hits, r.spec.misses) == (1, 0, 1)
    assert r.spec.wasted_exec_seconds == pytest.approx(1.0)
    assert r.spec.hidden_exec_seconds == 0.0
    e1 = by_key(r)[key(epoch=1)]
    assert (e1.spec_hits, e1.executed) == (0, 2)
    assert e1.observations == recorded(SPEC_DEVIATES)[key(epoch=1)]


def test_speculation_budget_zero_launches_nothing() -> None:
    r = simulate(SPEC_SAME, policy="spec", spec_tail=1.0, spec_budget=0)
    assert (r.spec.launched, r.spec.hits, r.spec.misses) == (0, 0, 0)
    assert r.spec.hidden_exec_seconds == 0.0
    assert all(x.spec_hits == 0 and x.executed == 2 for x in r.rollouts)


def test_speculation_only_for_the_tail() -> None:
    # default spec_tail=0.25 with one sample per step: floor(0.25) = 0 < 1 running
    r = simulate(SPEC_SAME, policy="spec")
    assert r.spec.launched == 0


def test_speculation_tail_counts_rollouts_still_queued() -> None:
    # one slot, four samples per step: only the step's last rollout is in its tail
    # (floor(0.25 * 4) = 1 unfinished), even though each runs alone in its slot
    rollouts = [
        rollout("t", [step(A, 2.0, 1.0), step(B, 3.0, 1.5)], epoch=e, sample=i)
        for e in (0, 1)
        for i in range(4)
    ]
    trace = make_trace([make_task("t")], rollouts)
    r = simulate(trace, policy="spec", max_concurrent=1, spec_min_confidence=0.0)
    spec_samples = {x.key.sample for x in r.rollouts if x.spec_hits}
    assert spec_samples <= {3}
    assert 1 <= r.spec.launched <= 4  # the two calls of sample 3 in each epoch at most


def test_spec_min_confidence_above_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="spec_min_confidence"):
        simulate(SPEC_SAME, policy="spec", spec_min_confidence=1.01)


# -- 7. cancellation ---------------------------------------------------------------------------

CANCEL_TRACE = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 1.0, 10.0), step(B, 1.0, 1.0)], sample=0),
        rollout("t", [step(A, 1.0, 2.0)], sample=1, reward=0.5),
    ],
)


def run_and_cancel(trace: Trace, policy: str, at: float, target: RolloutKey, **overrides: Any):
    sim = build_simulation(trace, engine="bunshin", policy=policy, **overrides)
    sched, backend = sim.scheduler, sim.backend
    answers: list[tuple[str, bool]] = []

    async def canceller() -> None:
        answers.append(("unknown", sched.cancel(key(task="nope"))))
        await anyio.sleep_until(at)
        answers.append(("running", sched.cancel(target)))

    async def main() -> RunResult:
        async with anyio.create_task_group() as tg:
            tg.start_soon(canceller)
            result = await sim.run()
        return result

    result = run_virtual(main)
    answers.append(("finished", sched.cancel(target)))
    answers.append(("other finished", sched.cancel(key(sample=1))))
    return result, backend, dict(answers)


@pytest.mark.parametrize("policy", ["base", "full"])
def test_cancel_a_running_rollout(policy: str) -> None:
    result, backend, answers = run_and_cancel(CANCEL_TRACE, policy, 5.0, key(sample=0))
    assert answers["running"] is True
    assert answers["unknown"] is False
    assert answers["finished"] is False and answers["other finished"] is False
    r0, r1 = by_key(result)[key(sample=0)], by_key(result)[key(sample=1)]
    assert r0.status == "cancelled" and r0.reward is None
    assert r0.end == pytest.approx(5.0)
    assert r0.observations == []  # cancelled while A ran
    assert r1.status == "done" and r1.reward == 0.5
    assert r1.observations == recorded(CANCEL_TRACE)[key(sample=1)]
    assert backend.live_handles() == 0
    assert backend.working_set() == 0
    assert result.running_timeline[-1][1] == 0


def test_cancel_after_the_first_observation_keeps_it() -> None:
    result, backend, answers = run_and_cancel(CANCEL_TRACE, "base", 11.5, key(sample=0))
    assert answers["running"] is True
    r0 = by_key(result)[key(sample=0)]
    assert r0.status == "cancelled" and r0.reward is None
    assert r0.observations == recorded(CANCEL_TRACE)[key(sample=0)][:1]
    assert r0.executed == 1
    assert backend.live_handles() == 0


# Sample 1 sits on the evicted node A (hot_budget=0); while it thinks about C (10 s) the
# scheduler prepares a fork of A in the background (done at about 25 s). At 30.001 s the
# model returns C, a miss, and the sample takes the prepared fork: _take_prep() clears
# s.prep before ``await prep.done.wait()``, which checkpoints even though the event is set,
# so a cancellation delivered at that instant loses the prepared workspace.
PREP_TRACE = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], sample=0),
        rollout("t", [step(A, 20.0, 5.0), step(C, 10.0, 2.0)], sample=1),
    ],
)


@pytest.mark.parametrize("at", [29.0, 30.5])
def test_cancel_around_a_prepared_fork_releases_it(at: float) -> None:
    result, backend, answers = run_and_cancel(PREP_TRACE, "full", at, key(sample=1), hot_budget=0, cold_budget=1 << 30)
    assert answers["running"] is True
    assert by_key(result)[key(sample=1)].status == "cancelled"
    assert result.prepared == 1
    assert backend.live_handles() == 0


def test_cancel_at_the_instant_a_prepared_fork_is_taken_releases_it() -> None:
    at = 0.001 + 20.0 + 10.0  # freeze, think A, think C: the instant the model returns C
    result, backend, answers = run_and_cancel(PREP_TRACE, "full", at, key(sample=1), hot_budget=0, cold_budget=1 << 30)
    assert answers["running"] is True
    assert by_key(result)[key(sample=1)].status == "cancelled"
    assert backend.live_handles() == 0


# -- 8. configuration errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"batch_tasks": 0}, "batch_tasks"),
        ({"staleness": -1}, "staleness"),
        ({"spec_tail": 1.5}, "spec_tail"),
        ({"spec_min_confidence": 1.01}, "spec_min_confidence"),
        ({"group_size": 0}, "group_size"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"train_time": -1.0}, "train_time"),
        ({"hot_budget": -1}, "hot_budget"),
    ],
)
def test_out_of_range_options_are_config_errors(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig.preset("base", **overrides)
    # a config built directly is checked by the Scheduler
    backend = SimBackend("bunshin", ToolModel(SYNC_TRACE))
    with pytest.raises(ConfigError, match=field):
        Scheduler(backend, TracePolicy(SYNC_TRACE), SchedulerConfig(**overrides))


def test_unknown_option_and_wrong_type_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig.preset("base", no_such_option=1)
    with pytest.raises(ConfigError):
        SchedulerConfig.preset("base", mode="sometimes")


def test_speculation_without_a_selector_is_a_config_error() -> None:
    backend = SimBackend("bunshin", ToolModel(SYNC_TRACE))
    cfg = SchedulerConfig.preset("spec")
    with pytest.raises(ConfigError, match="selector"):
        Scheduler(backend, TracePolicy(SYNC_TRACE), cfg)
    Scheduler(backend, TracePolicy(SYNC_TRACE), cfg, selector=HistorySelector())  # fine with one


def test_group_size_above_the_traces_groups_is_a_config_error() -> None:
    planned = TracePolicy(CACHE_TRACE).planned()  # one group of two samples
    with pytest.raises(ConfigError, match="group_size=3"):
        plan_steps(planned, SchedulerConfig(group_size=3))
    with pytest.raises(ConfigError, match="group_size"):
        simulate(CACHE_TRACE, policy="base", group_size=3)


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'turbo'"):
        SchedulerConfig.preset("turbo")
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(SYNC_TRACE, policy="turbo")


def test_presets() -> None:
    assert (SchedulerConfig.preset("base").caching, SchedulerConfig.preset("base").speculation) == (False, False)
    assert (SchedulerConfig.preset("spec").caching, SchedulerConfig.preset("spec").speculation) == (False, True)
    assert (SchedulerConfig.preset("full").caching, SchedulerConfig.preset("full").speculation) == (True, True)
    assert SchedulerConfig.preset("full", caching=False).caching is False


# -- 9. plan_steps -----------------------------------------------------------------------------

T_A, T_B, T_C = make_task("a"), make_task("b"), make_task("c")
TASKS = {"a": T_A, "b": T_B, "c": T_C}


def planned(*keys: tuple[int, str, int, int]) -> list[tuple[RolloutKey, Task]]:
    return [(RolloutKey(e, t, g, s), TASKS[t]) for e, t, g, s in keys]


def shape(plan) -> list[list[list[tuple[int, str, int, int]]]]:
    return [
        [[(k.epoch, k.task, k.group, k.sample) for k, _ in group] for group in step] for step in plan.steps
    ]


def test_plan_groups_in_first_appearance_order_samples_sorted() -> None:
    p = planned((0, "b", 0, 1), (0, "a", 0, 0), (0, "b", 0, 0), (0, "c", 0, 0), (0, "a", 0, 1))
    plan = plan_steps(p, SchedulerConfig(batch_tasks=2))
    assert shape(plan) == [
        [[(0, "b", 0, 0), (0, "b", 0, 1)], [(0, "a", 0, 0), (0, "a", 0, 1)]],
        [[(0, "c", 0, 0)]],
    ]
    assert plan.steps[0][0][0][1] is T_B
    assert [plan.epoch_of(j) for j in range(2)] == [0, 0]


def test_plan_step_never_spans_two_epochs() -> None:
    p = planned((0, "a", 0, 0), (0, "b", 0, 0), (1, "a", 0, 0), (1, "b", 0, 0), (1, "c", 0, 0))
    plan = plan_steps(p, SchedulerConfig(batch_tasks=3))
    assert shape(plan) == [
        [[(0, "a", 0, 0)], [(0, "b", 0, 0)]],
        [[(1, "a", 0, 0)], [(1, "b", 0, 0)], [(1, "c", 0, 0)]],
    ]
    assert [plan.epoch_of(j) for j in range(2)] == [0, 1]


def test_plan_two_groups_of_one_task_are_two_groups() -> None:
    p = planned((0, "a", 0, 0), (0, "a", 1, 0), (0, "a", 0, 1))
    plan = plan_steps(p, SchedulerConfig(batch_tasks=1))
    assert shape(plan) == [[[(0, "a", 0, 0), (0, "a", 0, 1)]], [[(0, "a", 1, 0)]]]


def test_plan_group_size_keeps_the_first_samples() -> None:
    p = planned((0, "a", 0, 2), (0, "a", 0, 0), (0, "a", 0, 1), (0, "b", 0, 1), (0, "b", 0, 0))
    plan = plan_steps(p, SchedulerConfig(batch_tasks=8, group_size=2))
    assert shape(plan) == [[[(0, "a", 0, 0), (0, "a", 0, 1)], [(0, "b", 0, 0), (0, "b", 0, 1)]]]
    # and a simulation with group_size runs only those
    r = simulate(CACHE_TRACE, policy="base", group_size=1)
    assert [x.key for x in r.rollouts] == [key(sample=0)]


def test_plan_of_the_scheduler_follows_the_policy() -> None:
    backend = SimBackend("bunshin", ToolModel(ASYNC_TRACE))
    sched = Scheduler(backend, TracePolicy(ASYNC_TRACE), SchedulerConfig(batch_tasks=3))
    assert [[g[0][0].task for g in s] for s in sched.plan.steps] == [["t0", "t1", "t2"], ["t3"]]


# -- 10. RecordedCacheability ---------------------------------------------------------------------


def test_recorded_cacheability_is_per_call() -> None:
    ls, rm = call("shell", cmd="ls"), call("shell", cmd="rm -rf /tmp/x")
    trace = make_trace(
        [make_task("t")],
        [
            rollout("t", [step(ls, 1, 1), step(rm, 1, 1)], sample=0),
            # the same rm recorded once as non-cacheable makes that call non-cacheable
            rollout("t", [step(ls, 1, 1), step(rm, 1, 1, cacheable=False)], sample=1),
            rollout("t", [step(call("click", x=1), 1, 1)], sample=2),
        ],
    )
    policy = RecordedCacheability(trace)

    def cacheable(c: ToolCall) -> bool:
        return policy.cacheable(TASK_T, c)

    assert cacheable(ls) is True
    assert cacheable(rm) is False
    # a new call of "shell": not every recorded shell call was cacheable
    assert cacheable(call("shell", cmd="pwd")) is False
    # a new call of "click", whose every recorded call was cacheable
    assert cacheable(call("click", x=2)) is True
    assert cacheable(call("click", x=1)) is True
    # a tool the trace never used
    assert cacheable(call("browser", url="x")) is False
    # arguments are compared canonically (key order does not matter)
    two = make_trace([make_task("t")], [rollout("t", [step(call("f", a=1, b=2), 1, 1, cacheable=False)])])
    assert RecordedCacheability(two).cacheable(TASK_T, ToolCall(name="f", arguments={"b": 2, "a": 1})) is False


def test_recorded_cacheability_of_a_fully_cacheable_tool() -> None:
    policy = RecordedCacheability(CACHE_TRACE)

    def cacheable(c: ToolCall) -> bool:
        return policy.cacheable(TASK_T, c)

    assert cacheable(A) is True
    assert cacheable(call("shell", cmd="never recorded")) is True
    assert cacheable(call("clock")) is False


# -- 11. HistorySelector -----------------------------------------------------------------------


def test_selector_empty_predicts_nothing() -> None:
    sel = HistorySelector()
    assert sel.predict("t", []) == []
    assert sel.predict("t", [A], k=3) == []
    assert sel.observed() == 0


def test_selector_exact_prefix_with_share_as_confidence() -> None:
    sel = HistorySelector()
    sel.observe("t", [A, B])
    sel.observe("t", [A, C])
    sel.observe("t", [A, B])
    assert sel.observed() == 3
    (p,) = sel.predict("t", [])
    assert p.call == A and p.confidence == pytest.approx(1.0)
    preds = sel.predict("t", [A], k=2)
    assert [q.call for q in preds] == [B, C]
    assert [q.confidence for q in preds] == pytest.approx([2 / 3, 1 / 3])
    assert len(sel.predict("t", [A], k=1)) == 1


def test_selector_backs_off_to_task_bigram_then_global_bigram() -> None:
    sel = HistorySelector(backoff=0.5)
    sel.observe("t", [A, B])
    sel.observe("t", [A, C])
    sel.observe("t", [A, B])
    sel.observe("u", [X, A, C])
    # prefix (X, A) unseen in t: the task bigram after A in t, one backoff
    preds = sel.predict("t", [X, A], k=2)
    assert [q.call for q in preds] == [B, C]
    assert [q.confidence for q in preds] == pytest.approx([0.5 * 2 / 3, 0.5 * 1 / 3])
    # task v never seen: the global bigram after A (B twice, C twice), two backoffs
    preds = sel.predict("v", [A], k=2)
    assert sorted(q.confidence for q in preds) == pytest.approx([0.25 * 0.5, 0.25 * 0.5])
    assert {q.call.arguments["cmd"] for q in preds} == {"b", "c"}
    # the global bigram at the start of a trajectory: A three times, X once
    (p,) = sel.predict("v", [])
    assert p.call == A and p.confidence == pytest.approx(0.25 * 3 / 4)
    # a different backoff factor
    sel2 = HistorySelector(backoff=0.8)
    sel2.observe("t", [A, B])
    (p,) = sel2.predict("t", [C, A])
    assert p.call == B and p.confidence == pytest.approx(0.8)
    (p,) = sel2.predict("w", [A])
    assert p.call == B and p.confidence == pytest.approx(0.64)
    # nothing ever followed B
    assert sel2.predict("t", [A, B]) == []


def test_selector_min_support_skips_thin_contexts() -> None:
    sel = HistorySelector(min_support=2, backoff=0.5)
    sel.observe("t", [A, B])
    sel.observe("u", [C, B])
    # (t, (A,)) and (t, A) were seen once; the global bigram after A too: nothing
    assert sel.predict("t", [A]) == []
    # at the start: (t, ()) and (t, None) once each; global None twice (A, C)
    preds = sel.predict("t", [], k=2)
    assert [q.confidence for q in preds] == pytest.approx([0.25 * 0.5, 0.25 * 0.5])


def test_selector_fit_before_epoch() -> None:
    sel = HistorySelector().fit(SPEC_DEVIATES, before_epoch=1)
    (p,) = sel.predict("t", [])
    assert p.call == A and p.confidence == 1.0
    assert sel.observed() == 2
    assert HistorySelector().fit(SPEC_DEVIATES).observed() == 4


# -- 12. MemoryAccountant ----------------------------------------------------------------------


def test_memory_accountant_integral_and_peak() -> None:
    acct = MemoryAccountant(0.0)
    acct.sample(0.0, 100)
    acct.sample(2.0, 300)
    acct.sample(5.0, 50)
    acct.sample(6.0, 50)  # no change
    acct.sample(7.0, 300)  # the peak again, later: peak_time stays at its first time
    assert acct.current == 300
    s = acct.statistics(10.0)
    # 100 x 2 + 300 x 3 + 50 x 2 + 300 x 3
    assert s.total_byte_seconds == pytest.approx(200 + 900 + 100 + 900)
    assert s.peak_bytes == 300 and s.peak_time == 2.0
    assert s.duration == 10.0
    assert s.mean_bytes == pytest.approx(2100 / 10)
    assert acct.timeline() == [(0.0, 100), (2.0, 300), (5.0, 50), (7.0, 300)]
    # up to the last sample by default
    assert acct.statistics().total_byte_seconds == pytest.approx(200 + 900 + 100)
    assert acct.statistics().duration == 7.0


def test_memory_accountant_relative_to_its_start() -> None:
    acct = MemoryAccountant(10.0)
    acct.sample(11.0, 64)
    acct.sample(13.0, 0)
    s = acct.statistics(20.0)
    assert s.total_byte_seconds == pytest.approx(128)
    assert (s.peak_bytes, s.peak_time, s.duration) == (64, 1.0, 10.0)
    assert acct.timeline() == [(0.0, 0), (1.0, 64), (3.0, 0)]
    assert MemoryAccountant(0.0).statistics().mean_bytes == 0.0


def test_memory_accountant_rejects_time_going_backwards() -> None:
    acct = MemoryAccountant(0.0)
    acct.sample(5.0, 1)
    with pytest.raises(ValueError, match="backwards"):
        acct.sample(4.999, 2)
    with pytest.raises(ValueError):
        MemoryAccountant(3.0).sample(2.0, 1)


def test_run_memory_timeline_ends_at_zero_and_integrates() -> None:
    r = simulate(CACHE_TRACE, policy="full")
    tl = r.memory_timeline
    assert tl[0][0] == 0.0 and tl[-1][1] == 0
    # the timeline keeps the last value of each instant; the peak may be a value that
    # lasted zero seconds within one instant, so it is at least the timeline's maximum
    assert r.memory.peak_bytes >= max(v for _, v in tl) > 0
    total = sum(v * (t2 - t1) for (t1, v), (t2, _) in zip(tl, tl[1:]))
    assert r.memory.total_byte_seconds == pytest.approx(total)


# -- 13. trio ----------------------------------------------------------------------------------


def trio_trace() -> Trace:
    rollouts = []
    for e in range(2):
        for tid in ("t", "u"):
            for s in range(2):
                steps = [step(A, 1.0 + s, 2.0), step(B, 1.0, 1.5)]
                if s == 1:
                    steps.append(step(C, 0.5, 1.0))
                if tid == "u" and s == 0:
                    steps.insert(1, step(CLOCK, 1.0, 0.5, obs=f"clock {e}", cacheable=False))
                rollouts.append(rollout(tid, steps, epoch=e, sample=s, reward=float(s)))
    return make_trace([make_task("t"), make_task("u", boot=2.0)], rollouts)


def test_scheduler_runs_under_trio() -> None:
    trace = trio_trace()
    backend = SimBackend("bunshin", ToolModel(trace))
    config = SchedulerConfig.preset(
        "full", batch_tasks=1, spec_tail=1.0, spec_min_confidence=0.0, hot_budget=8 * MiB
    )
    sched = Scheduler(
        backend, TracePolicy(trace), config, selector=HistorySelector(), cacheable=RecordedCacheability(trace)
    )

    async def main() -> RunResult:
        return await sched.run()

    clock = trio.testing.MockClock(autojump_threshold=0)
    r = anyio.run(main, backend="trio", backend_options={"clock": clock})
    rec = recorded(trace)
    assert [x.key for x in r.rollouts] == [x.key for x in trace.rollouts]
    assert all(x.status == "done" for x in r.rollouts)
    assert {x.key: x.observations for x in r.rollouts} == rec
    assert {x.key: x.reward for x in r.rollouts} == {x.key: x.reward for x in trace.rollouts}
    assert backend.live_handles() == 0
    assert r.tree is not None and r.tree.hits > 0
    assert r.spec.launched > 0
    assert len(r.steps) == 4
    # the same observations as under asyncio (times may differ in ties)
    a = simulate(
        trace, policy="full", batch_tasks=1, spec_tail=1.0, spec_min_confidence=0.0, hot_budget=8 * MiB
    )
    assert {x.key: x.observations for x in a.rollouts} == rec


# -- transparency of hidden execution -----------------------------------------------------------


def test_hidden_exec_seconds_counts_only_the_overlap_with_thinking() -> None:
    # epoch 1 repeats A (think 1 s, exec 5 s): the branch starts with the thinking and runs
    # 4 s past it, so speculation hides 1 s of the call, not 5
    trace = make_trace(
        [make_task("t")],
        [rollout("t", [step(A, 1.0, 5.0)], epoch=0), rollout("t", [step(A, 1.0, 5.0)], epoch=1)],
    )
    spec = simulate(trace, policy="spec", spec_tail=1.0)
    base = simulate(trace, policy="base")
    assert spec.spec.hits == 1
    saved = base.epoch_times[1] - spec.epoch_times[1]
    assert saved == pytest.approx(1.0, abs=SLACK)
    assert spec.spec.hidden_exec_seconds == pytest.approx(saved, abs=SLACK)


# -- a backend failure fails one rollout, not the batch -------------------------------------------


def test_a_backend_failure_fails_only_its_rollout() -> None:
    from bunshin_async import BackendError, CallContext

    class Failing(SimBackend):
        async def execute(self, workspace, call, context: CallContext):
            if context.rollout.sample == 1 and context.step == 1:
                await anyio.sleep(0.5)
                raise BackendError("workspace w: the agent died (out of memory)")
            return await super().execute(workspace, call, context)

    trace = make_trace(
        [make_task("t")],
        [rollout("t", [step(A, 1.0, 1.0), step(X, 1.0, 1.0), step(Y, 1.0, 1.0)], sample=i) for i in range(3)],
    )
    backend = Failing("bunshin", ToolModel(trace))
    sched = Scheduler(backend, TracePolicy(trace), SchedulerConfig.preset("base"), cacheable=RecordedCacheability(trace))

    async def main():
        return await sched.run()

    result = run_virtual(main)
    status = {r.key.sample: r for r in result.rollouts}
    assert status[1].status == "failed" and status[1].reward is None
    assert "the agent died" in (status[1].error or "") and "BackendError" in status[1].error
    assert len(status[1].observations) == 1  # the first call's observation, then the failure
    assert status[0].status == status[2].status == "done"
    assert status[0].error is None
    assert backend.live_handles() == 0 and backend.working_set() == 0


# -- a call in flight is waited for, not run again ------------------------------------------------

# sample 1 makes A while sample 0's A runs (1 to 6 s), and B while sample 0's B runs (7 to 12 s)
FLIGHT_TRACE = make_trace(
    [make_task("t")],
    [
        rollout("t", [step(A, 1.0, 5.0), step(B, 1.0, 5.0)], sample=0),
        rollout("t", [step(A, 3.0, 5.0), step(B, 2.0, 5.0)], sample=1),
    ],
)


def test_a_call_in_flight_from_the_same_node_is_waited_for_not_run_again() -> None:
    r = simulate(FLIGHT_TRACE, policy="full")
    s0, s1 = by_key(r)[key(sample=0)], by_key(r)[key(sample=1)]
    assert (s0.cache_hits, s0.executed) == (0, 2)
    assert (s1.cache_hits, s1.executed) == (2, 0)
    assert [x.source for x in s1.steps] == ["cache", "cache"]
    assert s1.memory is None  # it never needed a workspace of its own
    assert s1.observations == recorded(FLIGHT_TRACE)[key(sample=1)]
    assert s1.end == pytest.approx(s0.end, abs=SLACK)  # it had both results when sample 0 did
    assert r.tree is not None and (r.tree.waits, r.tree.hits) == (2, 2)
    # without waiting, sample 1 runs both calls itself: 3 + 5 + 2 + 5 s
    off = simulate(FLIGHT_TRACE, policy="full", coalesce=False)
    o1 = by_key(off)[key(sample=1)]
    assert (o1.cache_hits, o1.executed) == (0, 2)
    assert o1.end == pytest.approx(15.0, abs=SLACK) and s1.end < o1.end - 2.0
    assert off.tree is not None and off.tree.waits == 0
    assert o1.observations == s1.observations


def test_a_sample_waiting_on_a_call_that_fails_runs_it_itself() -> None:
    from bunshin_async import BackendError, CallContext

    class Failing(SimBackend):
        async def execute(self, workspace, call, context: CallContext):
            if context.rollout.sample == 0:
                await anyio.sleep(4.0)
                raise BackendError("workspace w: the agent died (out of memory)")
            return await super().execute(workspace, call, context)

    backend = Failing("bunshin", ToolModel(FLIGHT_TRACE))
    sched = Scheduler(backend, TracePolicy(FLIGHT_TRACE), SchedulerConfig.preset("base", caching=True),
                      cacheable=RecordedCacheability(FLIGHT_TRACE))

    async def main():
        return await sched.run()

    result = run_virtual(main)
    status = {x.key.sample: x for x in result.rollouts}
    assert status[0].status == "failed"
    s1 = status[1]
    assert s1.status == "done" and (s1.cache_hits, s1.executed) == (0, 2)
    assert s1.observations == recorded(FLIGHT_TRACE)[key(sample=1)]
    # it waited from 3 s until sample 0's A failed at 5 s (1 + 4), then ran A and B: 5 + 5 + 2 + 5
    assert s1.end == pytest.approx(17.0, abs=SLACK)
    assert result.tree is not None and result.tree.waits == 1
    assert backend.live_handles() == 0 and backend.working_set() == 0
