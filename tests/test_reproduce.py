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
from sim._reproduce import _measure, _quick
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
        if field.name not in ("name", "description", "page_cache_image", "sources"):
            assert cal.engines["microvm"].sources[field.name]
    assert load_calibration(name) == cal


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
    assert "| figure | seed | simulator | error |" in text
    assert len(rows) >= 14
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
    assert by["WebArena total memory (working set x time), bunshin vs microvm: saving"].sim > 0
    # caching (Full) and speculation (Spec) lower the epoch time
    assert by["OSWorld epoch, Full vs Base: saving"].sim > 0
    assert by["OSWorld epoch, Spec vs Base: saving"].sim >= 0
    # private copies need more memory than sharing; under a cap criu runs longer
    assert next(r for r in rows if r.figure.startswith("peak memory, criu / bunshin")).sim > 1
    assert by["WebArena under the memory cap: criu epoch / bunshin epoch"].sim > 1


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
