"""`bunshin reproduce`: the calibrated parameter files, the report end to end (quick), and the
direction of every effect."""

from __future__ import annotations

import msgspec
import pytest

from bunshin_async._cli import main
from sim import (
    CALIBRATIONS,
    AccuracySelector,
    generate,
    load_calibration,
    reproduce,
    run_calibrated,
    shareable_after,
)
from sim._reproduce import (
    _TOTAL,
    Comparison,
    _holding,
    _measure,
    _one_group,
    _peak_time,
    _peak_with,
    _per_rollout_cost_for,
    _quick,
    _Run,
    _samples,
    _subtrace,
    _total_savings,
    _why,
)
from bunshin_async._exceptions import ConfigError


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    seen = []
    rows = reproduce(out, quick=True, progress=lambda what, done, total: seen.append((done, total)))
    return out, rows, seen


@pytest.mark.parametrize("name", CALIBRATIONS)
def test_parameter_files_load_with_a_source_for_every_override(name):
    cal = load_calibration(name)
    assert cal.workload.workload == name
    for key in ("memory.image_bytes", "memory.runtime_bytes", "think_time", "tasks", "group_size"):
        assert cal.workload.sources[key]
    for key in cal.scheduler:
        assert cal.scheduler_sources[key]
    for field in msgspec.structs.fields(cal.engines["microvm"]):
        if field.name not in ("name", "description", "page_cache_image", "checkpoint_in_memory", "sources"):
            assert cal.engines["microvm"].sources[field.name]
    # the seed's CRIU baseline restores each fork from disk
    assert not cal.engines["criu"].checkpoint_in_memory
    assert "from disk" in cal.engines["criu"].sources["checkpoint_in_memory"]
    assert load_calibration(name) == cal


def test_an_engine_override_needs_a_source(tmp_path):
    bad = tmp_path / "nosource.toml"
    base = (load_calibration.__globals__["PARAMS_DIR"] / "osworld.toml").read_text()
    bad.write_text(base.replace('checkpoint_in_memory = "seed:', 'other = "seed:'))
    with pytest.raises(ConfigError, match=r"\[engines.criu\]: no source for checkpoint_in_memory"):
        load_calibration(bad)


def test_bad_parameter_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no parameter file"):
        load_calibration(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[workload]\nname = 3\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_calibration(bad)


def test_report_is_generated_end_to_end_and_deterministic(quick_report, tmp_path):
    out, rows, seen = quick_report
    text = (out / "report.md").read_text()
    for png in ("osworld_working_set.png", "webarena_working_set.png", "osworld_running.png", "scaling.png",
                "shareable.png", "sensitivity_group.png", "sensitivity_dirty.png", "sensitivity_tail.png",
                "sensitivity_accuracy.png"):
        assert (out / png).stat().st_size > 1000
        assert f"]({png})" in text
    assert "| figure | seed | simulator | error | within | fit | note |" in text
    assert "## The same OSWorld figures over other trace seeds" in text
    assert len(rows) >= 14
    assert any(r.calibrated for r in rows) and any(not r.calibrated for r in rows)
    # every figure the simulator misses says why, measured from the runs
    for r in rows:
        if not r.ok and not r.bound and r.figure in _EXPLAINED:
            assert len(r.note) > 80, r.figure
    assert seen[-1][0] == seen[-1][1]  # progress reaches its total
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    again = tmp_path / "again"
    reproduce(again, quick=True)
    assert (again / "report.md").read_text() == text


def test_direction_of_every_effect(quick_report):
    _, rows, _ = quick_report
    by = {r.figure: r for r in rows}
    # sharing lowers peak memory against private copies and microVMs
    assert by["OSWorld peak memory, bunshin vs criu: saving"].sim > 0
    assert by["OSWorld peak memory, bunshin vs microvm: saving"].sim > 0
    assert by["WebArena peak memory, bunshin vs microvm: saving"].sim > 0
    assert by[_TOTAL].sim > 0
    # caching (Full) and speculation (Spec) lower the epoch time
    assert by["OSWorld epoch, Full vs Base: saving"].sim > 0
    assert by["OSWorld epoch, Spec vs Base: saving"].sim >= 0
    # private copies need more memory than sharing; under a cap criu runs longer
    assert next(r for r in rows if r.figure.startswith("peak memory, criu / bunshin")).sim > 1
    assert by["WebArena under the memory cap: criu epoch / bunshin epoch"].sim > 1


_EXPLAINED = (
    _TOTAL,
    "OSWorld epoch, Full vs Base: saving",
    "OSWorld peak memory, Full vs Base: increase",
)


def _run(total: float, peak: float) -> _Run:
    return _Run(time=1.0, peak=int(peak), total=total, result=None, start=0.0, end=1.0)  # type: ignore[arg-type]


def test_up_to_ranges_over_the_comparisons_the_seed_could_run():
    o = {"bunshin": _run(60, 60), "criu": _run(100, 100), "microvm": _run(80, 80)}
    w = {"bunshin": _run(10, 10), "criu": _run(1000, 1000), "microvm": _run(25, 25)}
    savings = _total_savings(o, w, cap=500)
    assert savings["OSWorld vs criu"] == (40.0, True)
    assert savings["WebArena vs microvm"] == (60.0, True)
    # the baseline's batch does not fit the machine: the seed could not run that comparison
    assert savings["WebArena vs criu"] == (99.0, False)
    best = max(v for v, ok in savings.values() if ok)
    assert best == 60.0


def test_the_concurrency_sweep_forks_one_workspace_and_sharing_pays_more_as_it_grows():
    cal = _quick(load_calibration("osworld"))
    one = _one_group(cal, 32)
    assert len(one.tasks) == 1 and {r.epoch for r in one.rollouts} == {0}
    peaks = {}
    for n in (4, 32):
        sub = _samples(one, n)
        assert len(sub.rollouts) == n
        assert [r.steps for r in sub.rollouts] == [r.steps for r in one.rollouts[:n]]  # nested
        peaks[n] = {e: _measure(run_calibrated(sub, cal, e, "base", batch_tasks=1)).peak for e in ("criu", "bunshin")}
    ratio = {n: p["criu"] / p["bunshin"] for n, p in peaks.items()}
    # memory scales with what trajectories change, not with how many there are
    assert ratio[32] > ratio[4] > 1
    # the training-batch variant keeps whole groups of the calibrated trace
    tr = generate(cal.workload, seed=cal.seed)
    sub = _subtrace(tr, 2)
    assert [t.id for t in sub.tasks] == [t.id for t in tr.tasks[:2]]
    assert len(sub.rollouts) == 2 * cal.workload.group_size * cal.workload.epochs


def test_the_explanations_are_measured_from_the_runs():
    cal = _quick(load_calibration("osworld"))
    tr = generate(cal.workload, seed=cal.seed)
    b = _measure(run_calibrated(tr, cal, "bunshin", "base"))
    f = _measure(run_calibrated(tr, cal, "bunshin", "full"))
    # a per-rollout cost of 0 changes nothing; the cost for a ratio reaches it
    assert _peak_with(b, 0) == b.peak
    x = _per_rollout_cost_for(f, b, 0.5 * f.total / b.total)
    rollout_seconds = sum(r.end - r.start for r in b.result.rollouts if r.key.epoch == max(b.result.epoch_times))
    assert f.total / (b.total + x * rollout_seconds) == pytest.approx(0.5 * f.total / b.total)
    assert _peak_with(b, x) > b.peak
    # who holds a workspace at a time of the measured epoch
    n = cal.workload.tasks * cal.workload.group_size
    assert _holding(b, b.end)["done"] == n
    h = _holding(f, f.start + 1.0)
    assert h["walking"] <= h["running"] <= n
    # the notes name what the runs show
    rows = [Comparison("OSWorld epoch, Full vs Base: saving", 18.3, 1.0, "%"),
            Comparison("OSWorld epoch, Spec vs Base: saving", 7.7, 0.0, "%"),
            Comparison("OSWorld peak memory, Full vs Base: increase", 1.4, -20.0, "%"),
            Comparison("peak memory, criu / bunshin at 32 concurrent rollouts", 1.8, 1.0, "x"),
            Comparison(_TOTAL, 51.0, 1.0, "%")]
    o = {"bunshin": b, "bunshin/full": f, "bunshin/spec": b, "criu": b, "microvm": b}
    savings = {"OSWorld vs criu": (1.0, True)}
    why = _why(o, o, tr, cal, rows, savings, [], [4, 32], {"criu": [2, 4], "bunshin": [1, 2]},
               {"criu": [2, 4], "bunshin": [1, 2]}, _one_group(cal, 32))
    crit = max((r for r in f.result.rollouts if r.key.epoch == max(f.result.epoch_times)), key=lambda r: r.end)
    assert f"{crit.key.task} sample {crit.key.sample}" in why["OSWorld epoch, Full vs Base: saving"]
    assert "Speculation can hide at most" in why["OSWorld epoch, Spec vs Base: saving"]
    assert f"Full has {_holding(f, _peak_time(f))['running']} rollouts running" in why[
        "OSWorld peak memory, Full vs Base: increase"]
    assert "1.43x" in why["peak memory, criu / bunshin at 32 concurrent rollouts"]
    assert "A fixed per-rollout cost" in why[_TOTAL]


def test_cli_quick(tmp_path, capsys):
    assert main(["reproduce", "--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "seed vs simulator" in out and (tmp_path / "report.md").exists()


def test_accuracy_selector_is_right_with_its_probability():
    cal = _quick(load_calibration("osworld"))
    trace = generate(cal.workload, seed=0)
    r = trace.rollouts[0]
    right = AccuracySelector(trace, 1.0)
    wrong = AccuracySelector(trace, 0.0)
    for i, step in enumerate(r.steps):
        (p,) = right.predict(r.task, [s.call for s in r.steps[:i]])
        assert p.confidence == 1.0
        others = [x for x in trace.rollouts if x.task == r.task and len(x.steps) > i
                  and [s.call for s in x.steps[:i]] == [s.call for s in r.steps[:i]]]
        assert p.call in [x.steps[i].call for x in others]
        for q in wrong.predict(r.task, [s.call for s in r.steps[:i]]):
            assert q.call not in [x.steps[i].call for x in others]
    with pytest.raises(ConfigError):
        AccuracySelector(trace, 1.5)


def test_a_perfect_predictor_speculates_better_than_a_wrong_one():
    cal = _quick(load_calibration("osworld"))
    trace = generate(cal.workload, seed=0)
    runs = {p: _measure(run_calibrated(trace, cal, "bunshin", "spec", selector=AccuracySelector(trace, p),
                                       spec_min_confidence=0.0)) for p in (0.0, 1.0)}
    assert runs[1.0].result.spec.hits > 0 and runs[0.0].result.spec.hits == 0
    assert runs[1.0].time <= runs[0.0].time


def test_siblings_share_less_as_they_write():
    cal = _quick(load_calibration("osworld"))
    share = shareable_after(generate(cal.workload, seed=0), 10)
    assert share[0] == 1.0
    assert all(a >= b for a, b in zip(share, share[1:]))
    assert share[10] < 1.0
