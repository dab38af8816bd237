"""The scheduling-policy plug-in API, its contracts, and ``check-policy`` (bunshin_async.testing)."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from collections.abc import Iterable, Sequence

import anyio
import pytest
from hypothesis import given, settings

from bunshin_async import (
    BUILTIN_POLICIES,
    CacheableTools,
    ConfigError,
    EvictionPolicy,
    HistorySelector,
    LRUEviction,
    PolicyError,
    Prediction,
    SnapshotInfo,
    SpecContext,
    SpeculationPolicy,
    SpecToolSelector,
    TailBenefitSpeculation,
    load_policy,
    load_trace,
)
from bunshin_async._cli import main
from bunshin_async.testing import (
    CHECKS,
    InvariantViolation,
    PolicySet,
    check_policy,
    check_transparency,
    configs,
    traces,
)
from bunshin_async.testing.examples import CacheEverything, CostAwareEviction
from sim import run_virtual, simulate

from test_scheduler import TIER_TRACE, by_key, recorded

MiB = 1 << 20
EXAMPLES = "bunshin_async.testing.examples"


# -- naming policies ---------------------------------------------------------------------------


def test_builtin_names_resolve_to_their_kind() -> None:
    for kind, table in BUILTIN_POLICIES.items():
        for name, factory in table.items():
            got, f = load_policy(name, kind)
            assert (got, f) == (kind, factory)
    assert load_policy("lru") == ("eviction", LRUEviction)


def test_module_attribute_resolves_from_the_current_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "mypolicies.py").write_text(textwrap.dedent("""
        from bunshin_async import EvictionPolicy, LRUEviction

        class Newest(EvictionPolicy):
            def victims(self, snapshots, need):
                return sorted((s for s in snapshots if s.evictable), key=lambda s: -s.last_used)

        def make():
            return LRUEviction()

        instance = LRUEviction()
        number = 3
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mypolicies", raising=False)
    kind, factory = load_policy("mypolicies:Newest")
    assert kind == "eviction" and factory.__name__ == "Newest"
    assert load_policy("mypolicies:make", "eviction")[0] == "eviction"
    with pytest.raises(ConfigError, match="is an instance; name its class"):
        load_policy("mypolicies:instance")
    with pytest.raises(ConfigError, match="not a policy class"):
        load_policy("mypolicies:number")
    with pytest.raises(ConfigError, match="is a eviction policy, not a speculation policy"):
        load_policy("mypolicies:Newest", "speculation")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        load_policy("mypolicies:Missing")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.policies'"):
        load_policy("no_such_pkg.policies:X")
    with pytest.raises(ConfigError, match="neither a built-in eviction"):
        load_policy("fifo", "eviction")
    with pytest.raises(ConfigError, match="expected module:attribute"):
        load_policy(":X")
    assert str(tmp_path) not in sys.path


# -- contracts ---------------------------------------------------------------------------------


class Pinned(EvictionPolicy):
    """Wrong on purpose: picks snapshots that are in use first."""

    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        return sorted(snapshots, key=lambda s: not s.in_use)


class Twice(EvictionPolicy):
    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        ok = [s for s in snapshots if s.evictable]
        return ok[:1] * 2


class Forged(EvictionPolicy):
    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        return [s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "id": 10**9}) for s in snapshots]


class Recorder(EvictionPolicy):
    def __init__(self) -> None:
        self.seen: list[tuple[int, list[SnapshotInfo]]] = []

    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        self.seen.append((need, list(snapshots)))
        return LRUEviction().victims(snapshots, need)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [x for e in exc.exceptions for x in _leaves(e)]
    return [exc]


def _policy_error(**kw) -> PolicyError:
    with pytest.raises(BaseException) as info:
        simulate(TIER_TRACE, policy="full", hot_budget=6 * MiB, cold_budget=1 << 30, **kw)
    errors = [e for e in _leaves(info.value) if isinstance(e, PolicyError)]
    assert errors, info.value
    return errors[0]


def test_the_eviction_policy_is_asked_with_every_snapshot_of_the_tier() -> None:
    rec = Recorder()
    r = simulate(TIER_TRACE, policy="full", hot_budget=6 * MiB, cold_budget=1 << 30, eviction=rec)
    assert r.tree is not None and r.tree.demotions >= 1
    assert rec.seen
    for need, infos in rec.seen:
        assert need > 0
        for s in infos:
            assert s.tier in ("hot", "cold")
            assert s.evictable == (not s.in_use and s.children_here == 0)
    # same result as the built-in it delegates to
    assert by_key(r) == by_key(simulate(TIER_TRACE, policy="full", hot_budget=6 * MiB, cold_budget=1 << 30))


def test_an_eviction_policy_choosing_a_snapshot_in_use_is_refused() -> None:
    err = _policy_error(eviction=Pinned())
    assert "test_policies:Pinned chose <node t@0 root hot>, which is in use" in str(err)
    assert "only snapshots marked evictable" in str(err)


def test_an_eviction_policy_choosing_twice_or_forging_a_snapshot_is_refused() -> None:
    assert "twice" in str(_policy_error(eviction=Twice()))
    assert "not one of the" in str(_policy_error(eviction=Forged()))


class Stranger(SpeculationPolicy):
    def choose(self, ctx: SpecContext) -> Prediction | None:
        return Prediction(ctx.predictions[0].call, 0.5) if ctx.predictions else None


class Overconfident(SpecToolSelector):
    def predict(self, task, calls, k=1, *, observations=None):
        return [Prediction(calls[-1], 1.5)] if calls else []

    def observe(self, task, calls, *, observations=None) -> None:
        pass


def test_a_speculation_policy_must_choose_an_offered_prediction_within_budget() -> None:
    sel = HistorySelector()
    for r in TIER_TRACE.rollouts:
        sel.observe(r.task, [s.call for s in r.steps])
    err = _policy_error(speculation=Stranger(), selector=sel, spec_tail=1.0)
    assert "not one of the prediction(s) it was offered" in str(err)
    sel = HistorySelector()
    for r in TIER_TRACE.rollouts:
        sel.observe(r.task, [s.call for s in r.steps])
    from bunshin_async.testing.examples import EagerSpeculation

    err = _policy_error(speculation=EagerSpeculation(), selector=sel, spec_budget=0)
    assert "over its budget of 0" in str(err)


def test_a_selector_confidence_outside_zero_to_one_is_refused() -> None:
    err = _policy_error(selector=Overconfident(), spec_tail=1.0, spec_min_confidence=0.0)
    assert "confidences between 0 and 1" in str(err)


def test_the_default_speculation_policy_reads_no_prediction_it_does_not_need() -> None:
    calls = []

    def predict():
        calls.append(1)
        return []

    from bunshin_async import RolloutKey, SchedulerConfig

    cfg = SchedulerConfig.preset("spec", spec_tail=0.25)
    ctx = SpecContext(
        rollout=RolloutKey(0, "t", 0, 0), task=TIER_TRACE.tasks[0], calls=(), observations=(), predict=predict,
        step_size=8, unfinished=8, active=0, budget=4, config=cfg, exec_seen={}, fork_seen=(0.0, 0),
    )
    assert TailBenefitSpeculation().choose(ctx) is None
    assert calls == []  # not in the tail: the predictor never ran
    assert not ctx.offered(Prediction(TIER_TRACE.rollouts[0].steps[0].call, 1.0))


def test_cacheable_tools_policy() -> None:
    task = TIER_TRACE.tasks[0]
    call = TIER_TRACE.rollouts[0].steps[0].call
    assert CacheableTools([call.name]).cacheable(task, call)
    assert not CacheableTools().cacheable(task, call)


def test_a_user_eviction_policy_keeps_observations() -> None:
    r = simulate(TIER_TRACE, policy="full", hot_budget=6 * MiB, cold_budget=1 << 30, eviction=CostAwareEviction())
    assert {k: v.observations for k, v in by_key(r).items()} == recorded(TIER_TRACE)


# -- the invariants and check-policy -------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(trace=traces(), cfg=configs())
def test_strategies_draw_consistent_traces(trace, cfg) -> None:
    # a cacheable call's observation depends only on the task and the calls before it
    seen: dict[tuple, str] = {}
    for r in trace.rollouts:
        hist: tuple = (r.task,)
        for s in r.steps:
            hist = hist + ((s.call.name, s.call.arguments["x"]),)
            if s.cacheable:
                assert seen.setdefault(hist, s.observation_digest) == s.observation_digest
    check_transparency(trace, cfg, PolicySet())


def test_check_transparency_bites() -> None:
    # two samples of one task read the clock: caching it shows the second the first's time
    from test_scheduler import call, make_task, make_trace, rollout, step

    clock = call("clock")
    trace = make_trace([make_task("t")], [
        rollout("t", [step(clock, 1, 1, obs="09:00", cacheable=False)], sample=0),
        rollout("t", [step(clock, 5, 1, obs="09:05", cacheable=False)], sample=1),
    ])
    check_transparency(trace, {}, PolicySet())
    with pytest.raises(InvariantViolation, match=r"step 0 \(clock\(\)\)"):
        check_transparency(trace, {}, PolicySet(cacheability=CacheEverything))


@pytest.mark.parametrize("kind,name", [(k, n) for k in BUILTIN_POLICIES for n in BUILTIN_POLICIES[k]])
def test_every_builtin_policy_passes_check_policy(kind, name, tmp_path) -> None:
    results = check_policy(name, kind=kind, examples=25, out_dir=str(tmp_path))
    assert [r.check for r in results] == list(CHECKS)
    assert [(r.check, r.error) for r in results if not r.passed] == []
    assert not list(tmp_path.iterdir())  # no counterexample written


def test_cache_everything_fails_transparency_with_a_minimal_counterexample(tmp_path) -> None:
    (r,) = check_policy(f"{EXAMPLES}:CacheEverything", examples=100, out_dir=str(tmp_path), only=("transparency",))
    assert not r.passed
    assert "clock" in (r.error or "")
    # shrunk: one task, the clock read twice (once per sample or epoch)
    assert r.size == {"tasks": 1, "rollouts": 2, "steps": 2}
    trace = load_trace(r.counterexample)
    assert [s.call.name for x in trace.rollouts for s in x.steps] == ["clock", "clock"]
    assert trace.meta["check"] == "transparency" and trace.meta["replay"] == r.replay
    # the printed command replays it and fails the same way
    assert r.replay is not None and r.replay.startswith("bunshin replay ")
    assert main(shlex.split(r.replay)[1:]) == 2


def test_eager_speculation_fails_budgets_with_a_minimal_counterexample(tmp_path) -> None:
    (r,) = check_policy(f"{EXAMPLES}:EagerSpeculation", examples=100, out_dir=str(tmp_path), only=("budgets",))
    assert not r.passed
    assert "over its budget" in (r.error or "")
    assert r.size is not None and r.size["rollouts"] <= 2 and r.size["steps"] <= 2


def test_largest_first_fails_its_contract(tmp_path) -> None:
    (r,) = check_policy(f"{EXAMPLES}:LargestFirstEviction", examples=100, out_dir=str(tmp_path), only=("finishes-once",))
    assert not r.passed
    assert "broke its contract" in (r.error or "") and "evictable" in (r.error or "")
    assert r.size is not None and r.size["rollouts"] <= 4


def test_the_state_machine_catches_speculation_over_budget(tmp_path) -> None:
    (r,) = check_policy(f"{EXAMPLES}:EagerSpeculation", examples=100, out_dir=str(tmp_path), only=("state-machine",), seed=1)
    assert not r.passed
    assert "over its budget" in (r.error or "")
    assert r.program and "state.setup(" in r.program and "state.think(" in r.program
    assert r.size is not None and r.size["steps"] <= 20


def test_check_policy_command(tmp_path, capsys) -> None:
    out = tmp_path / "cx"
    assert main(["check-policy", "lru", "--examples", "5", "--out", str(out)]) == 0
    assert "passes every check" in capsys.readouterr().out
    assert main(["check-policy", f"{EXAMPLES}:CacheEverything", "--examples", "50", "--only", "transparency",
                 "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "bunshin replay" in text and (out / "transparency.json").exists()
    assert main(["check-policy", "nope:Nothing"]) == 2
    assert "cannot import module 'nope'" in capsys.readouterr().err
    assert main(["check-policy", "lru", "--only", "speed"]) == 2
    assert "unknown check(s) speed" in capsys.readouterr().err


def test_replay_takes_policies_and_cancellations(tmp_path, capsys) -> None:
    path = tmp_path / "t.json"
    from bunshin_async import dump_trace

    dump_trace(TIER_TRACE, path)
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--eviction", f"{EXAMPLES}:CostAwareEviction", "--hot-budget", "6MiB",
                 "--cancel", "1:1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert sorted(x["status"] for x in r["rollouts"]) == ["cancelled", "done"]
    assert main(["replay", str(path), "--eviction", "tail-benefit"]) == 2
    assert "neither a built-in eviction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(path), "--cancel", "soon"])


def test_virtual_clock_runs_timers_far_into_virtual_time() -> None:
    # past ~10**7 s a float's spacing exceeds asyncio's clock resolution; the loop must not spin
    async def main_() -> float:
        await anyio.sleep(1e9)
        for _ in range(100):
            await anyio.sleep(0.001)
        return anyio.current_time()

    assert run_virtual(main_) == pytest.approx(1e9 + 0.1, abs=1e-3)
