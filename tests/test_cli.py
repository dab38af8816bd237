"""Tests of the ``bunshin`` command line (``bunshin_async._cli``), run in-process via ``main``.

Every replay runs on a tiny trace (2 tasks x 2 samples x 1 epoch) written once per module by
``bunshin generate``; only the default-workload test replays a full-size (512 rollout) trace.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import msgspec
import pytest

from bunshin_async._cli import ENGINE_NAMES, main, parse_bytes
from bunshin_async._scheduler import POLICIES, RunResult
from bunshin_async._trace import TRACE_VERSION, load_trace

GiB = 1 << 30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--tasks", "2", "--group-size", "2", "--epochs", "1"]


# ---------------------------------------------------------------------------------------------
# helpers


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``bunshin *argv`` in-process; return (exit status, stdout, stderr)."""
    capsys.readouterr()  # drop anything printed before
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def summary_rows(out: str) -> dict[str, str]:
    """The metric -> value rows of a ``replay`` summary table."""
    rows: dict[str, str] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if line.lstrip().startswith("│") and len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def table_rows(out: str) -> tuple[list[str], list[list[str]]]:
    """(header, body rows) of the ``compare`` table."""
    header: list[str] = []
    body: list[list[str]] = []
    for line in out.splitlines():
        s = line.strip()
        if s.startswith("┃"):
            header = [c.strip() for c in s.strip("┃").split("┃")]
        elif s.startswith("│"):
            body.append([c.strip() for c in s.strip("│").split("│")])
    return header, body


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny OSWorld-like trace written by ``bunshin generate``."""
    path = tmp_path_factory.mktemp("trace") / "tiny.json"
    assert main(["generate", "osworld", str(path), *TINY]) == 0
    return path


# ---------------------------------------------------------------------------------------------
# 1. generate


@pytest.mark.parametrize("suffix", [".json", ".msgpack"])
def test_generate_writes_a_valid_trace_and_prints_counts(tmp_path, capsys, suffix):
    out_path = tmp_path / f"t{suffix}"
    rc, out, err = run(capsys, "generate", "osworld", out_path, *TINY)
    assert rc == 0, err
    trace = load_trace(out_path)
    assert trace.version == TRACE_VERSION
    data = out_path.read_bytes()
    if suffix == ".json":
        assert msgspec.json.decode(data)["version"] == TRACE_VERSION
    else:
        assert data[:1] not in (b"{", b"[")  # really msgpack, not JSON under another name
        assert msgspec.msgpack.decode(data)["version"] == TRACE_VERSION
    steps = sum(len(r.steps) for r in trace.rollouts)
    assert len(trace.tasks) == 2 and len(trace.rollouts) == 4
    assert f"wrote {out_path}: 2 tasks, 4 rollouts, {steps} steps" in out
    assert not list(tmp_path.glob("*.tmp-*"))  # the atomic write left nothing behind


def test_generate_same_seed_same_bytes_other_seed_differs(tmp_path, capsys):
    paths = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        paths[name] = tmp_path / f"{name}.msgpack"
        rc, _, err = run(capsys, "generate", "webarena", paths[name], "--seed", seed, *TINY)
        assert rc == 0, err
    assert paths["a"].read_bytes() == paths["b"].read_bytes()
    assert paths["a"].read_bytes() != paths["c"].read_bytes()


def test_generate_honours_tasks_group_size_epochs(tmp_path, capsys):
    from sim import generate, workload_params

    path = tmp_path / "t.json"
    rc, out, err = run(capsys, "generate", "osworld", path, "--tasks", 3, "--group-size", 3,
                       "--epochs", 2, "--seed", 4)
    assert rc == 0, err
    trace = load_trace(path)
    assert len(trace.tasks) == 3
    assert len(trace.rollouts) == 3 * 3 * 2
    assert sorted({r.epoch for r in trace.rollouts}) == [0, 1]
    assert all(len(g) == 3 for g in trace.groups())
    assert "3 tasks, 18 rollouts" in out
    # the CLI passes its options and seed straight to the generator
    expected = generate(workload_params("osworld", tasks=3, group_size=3, epochs=2), seed=4)
    assert path.read_bytes() == msgspec.json.encode(expected)


def test_generate_bad_override_is_a_clean_error(tmp_path, capsys):
    rc, out, err = run(capsys, "generate", "osworld", tmp_path / "t.json", "--tasks", 0)
    assert rc == 2
    assert "bunshin: error:" in err and "tasks" in err
    assert not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------------------------------------
# 2. replay


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_replay_every_engine_and_policy(trace_file, capsys, engine, policy):
    rc, out, err = run(capsys, "replay", trace_file, "--engine", engine, "--policy", policy)
    assert rc == 0, err
    assert f"engine {engine}, policy {policy}" in out
    rows = summary_rows(out)
    assert rows["rollouts"] == "4 (4 done)"
    assert re.fullmatch(r"[0-9.]+ min", rows["epoch 0 time"])
    assert re.fullmatch(r"[0-9.]+ min", rows["makespan"])
    assert re.fullmatch(r"[0-9.,]+ GiB", rows["peak memory"])
    assert re.fullmatch(r"[0-9.,]+ GiB·h", rows["total memory"])
    assert re.fullmatch(r"\d+ \(\d+ cacheable\)", rows["calls"])
    assert ("cache hit rate" in rows) == (policy == "full")
    assert ("prefix tree" in rows) == (policy == "full")
    for key in ("speculation", "speculation wasted work", "speculation hidden work"):
        assert (key in rows) == (policy in ("spec", "full")), key


def test_replay_json_matches_the_summary(trace_file, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc, out, err = run(capsys, "replay", trace_file, "--engine", "criu", "--policy", "full",
                       "--json", out_json)
    assert rc == 0, err
    assert f"wrote {out_json}" in out
    r = msgspec.json.decode(out_json.read_bytes(), type=RunResult)
    rows = summary_rows(out)
    assert rows["makespan"] == f"{r.makespan / 60:.2f} min"
    assert rows["peak memory"] == f"{r.memory.peak_bytes / GiB:,.1f} GiB"
    assert rows["calls"] == f"{r.calls} ({r.cacheable_calls} cacheable)"
    assert r.makespan > 0
    assert len(r.rollouts) == 4
    assert r.config.caching and r.config.speculation


def test_replay_json_is_deterministic(trace_file, tmp_path, capsys):
    blobs = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        rc, _, err = run(capsys, "replay", trace_file, "--engine", "bunshin", "--policy", "full",
                         "--seed", 3, "--json", path)
        assert rc == 0, err
        blobs.append(path.read_bytes())
    assert blobs[0] == blobs[1]
    assert json.loads(blobs[0])["config"]["seed"] == 3


def test_replay_scheduling_options_reach_the_run(trace_file, tmp_path, capsys):
    path = tmp_path / "r.json"
    rc, out, err = run(capsys, "replay", trace_file, "--policy", "full", "--batch-tasks", 1,
                       "--hot-budget", "1GiB", "--cold-budget", "2GB", "--mode", "async",
                       "--staleness", 0, "--json", path)
    assert rc == 0, err
    r = msgspec.json.decode(path.read_bytes(), type=RunResult)
    assert r.config.batch_tasks == 1
    assert r.config.hot_budget == GiB
    assert r.config.cold_budget == 2 * 10**9
    assert r.config.mode == "async" and r.config.staleness == 0
    assert len(r.steps) == 2  # 2 tasks, one per step
    # the row is labelled "steps" or "training steps"
    steps = [v for k, v in summary_rows(out).items() if k.split()[-1] == "steps"]
    assert steps == ["2"]


def test_replay_unknown_engine_is_an_argparse_error(trace_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_file), "--engine", "qemu"])
    assert exc.value.code == 2
    assert "qemu" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 3. --plot


def _assert_pngs(outdir: Path, out: str) -> None:
    for name in ("working_set.png", "running.png"):
        p = outdir / name
        assert p.is_file(), name
        data = p.read_bytes()
        assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE), name
        assert f"wrote {p}" in out


def test_replay_plot_writes_pngs(trace_file, tmp_path, capsys):
    outdir = tmp_path / "figs" / "nested"  # created if missing
    rc, out, err = run(capsys, "replay", trace_file, "--policy", "base", "--plot", outdir)
    assert rc == 0, err
    _assert_pngs(outdir, out)


def test_compare_plot_writes_pngs(trace_file, tmp_path, capsys):
    outdir = tmp_path / "figs"
    rc, out, err = run(capsys, "compare", trace_file, "--engines", "criu,bunshin",
                       "--policies", "base", "--plot", outdir)
    assert rc == 0, err
    _assert_pngs(outdir, out)


# ---------------------------------------------------------------------------------------------
# 4. compare


def test_compare_rows_and_ratios(trace_file, tmp_path, capsys):
    rc, out, err = run(capsys, "compare", trace_file, "--engines", "criu,bunshin",
                       "--policies", "base,full")
    assert rc == 0, err
    assert "ratio to criu/base" in out
    header, body = table_rows(out)
    assert header[0] == "engine/policy"
    assert header[-3:] == ["peak ×", "total ×", "time ×"]
    assert [row[0] for row in body] == ["criu/base", "criu/full", "bunshin/base", "bunshin/full"]
    assert all(len(row) == len(header) for row in body)
    assert body[0][-3:] == ["1.00", "1.00", "1.00"]
    # cache hit only for full, spec columns for spec/full
    col = {name: i for i, name in enumerate(header)}
    assert body[0][col["cache hit"]] == "-" and body[1][col["cache hit"]].endswith("%")
    assert body[0][col["spec hit/miss"]] == "-" and "/" in body[1][col["spec hit/miss"]]

    # the ratios agree with single replays of the same pairs
    runs = {}
    for engine, policy in (("criu", "base"), ("bunshin", "full")):
        path = tmp_path / f"{engine}-{policy}.json"
        assert run(capsys, "replay", trace_file, "--engine", engine, "--policy", policy,
                   "--json", path)[0] == 0
        runs[engine, policy] = msgspec.json.decode(path.read_bytes(), type=RunResult)
    base, other = runs["criu", "base"], runs["bunshin", "full"]
    assert body[3][-3:] == [
        f"{other.memory.peak_bytes / base.memory.peak_bytes:.2f}",
        f"{other.memory.total_byte_seconds / base.memory.total_byte_seconds:.2f}",
        f"{other.makespan / base.makespan:.2f}",
    ]


@pytest.mark.parametrize(
    "option, value, bad, choices",
    [
        ("--engines", "criu,qemu", "qemu", ENGINE_NAMES),
        ("--policies", "base,turbo", "turbo", POLICIES),
    ],
)
def test_compare_unknown_engine_or_policy(trace_file, capsys, option, value, bad, choices):
    rc, out, err = run(capsys, "compare", trace_file, option, value)
    assert rc == 2
    assert err.startswith("bunshin: error:")
    assert repr(bad) in err and option in err
    for c in choices:
        assert c in err
    assert "engine/policy" not in out  # no table, nothing ran


# ---------------------------------------------------------------------------------------------
# 5. errors


def _truncated(trace_file: Path, tmp_path: Path) -> tuple[Path, str]:
    p = tmp_path / "cut.json"
    data = trace_file.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return p, "truncated"


def _truncated_msgpack(trace_file: Path, tmp_path: Path) -> tuple[Path, str]:
    p = tmp_path / "cut.msgpack"
    data = msgspec.msgpack.encode(msgspec.json.decode(trace_file.read_bytes()))
    p.write_bytes(data[: len(data) // 2])
    return p, "truncated"


def _missing(trace_file: Path, tmp_path: Path) -> tuple[Path, str]:
    return tmp_path / "nope.json", "cannot read the trace"


def _version(trace_file: Path, tmp_path: Path) -> tuple[Path, str]:
    p = tmp_path / "v2.json"
    doc = json.loads(trace_file.read_text())
    doc["version"] = 2
    p.write_text(json.dumps(doc))
    return p, "unknown trace version 2"


BAD_FILES = [_missing, _truncated, _truncated_msgpack, _version]


@pytest.mark.parametrize("make", BAD_FILES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("command", ["replay", "compare"])
def test_bad_trace_file_is_a_clean_error(trace_file, tmp_path, capsys, make, command):
    path, reason = make(trace_file, tmp_path)
    rc, out, err = run(capsys, command, path)
    assert rc == 2
    assert err.startswith("bunshin: error:")
    assert str(path) in err
    assert reason in err
    assert "Traceback" not in err


def test_bad_size_is_an_argparse_error(trace_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_file), "--hot-budget", "12XB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--hot-budget" in err and "'12XB'" in err


@pytest.mark.parametrize(
    "option, value, name",
    [("--batch-tasks", "0", "batch_tasks"), ("--max-concurrent", "0", "max_concurrent"),
     ("--spec-tail", "1.5", "spec_tail")],
)
def test_bad_scheduler_option_is_a_clean_error(trace_file, capsys, option, value, name):
    rc, out, err = run(capsys, "replay", trace_file, option, value)
    assert rc == 2
    assert err.startswith("bunshin: error:")
    assert name in err
    assert "rollouts" not in out  # no summary


def test_group_size_larger_than_the_trace_is_a_clean_error(trace_file, capsys):
    rc, _, err = run(capsys, "replay", trace_file, "--group-size", 5)
    assert rc == 2
    assert "bunshin: error:" in err and "group_size" in err


# ---------------------------------------------------------------------------------------------
# 6. parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("32GiB", 32 * GiB), ("512M", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
     ("1 KiB", 1024), ("2kb", 2000), ("0.5TiB", 1 << 39), ("7B", 7)],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1G", "", "12XB", "1.5.2G", "G"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_bytes(text)


# ---------------------------------------------------------------------------------------------
# 7. trace validate


def test_validate_good_file(trace_file, capsys):
    steps = sum(len(r.steps) for r in load_trace(trace_file).rollouts)
    rc, out, _ = run(capsys, "trace", "validate", trace_file)
    assert rc == 0
    assert f"{trace_file}: ok, version 1, 2 tasks, 4 rollouts, {steps} steps, 0 warnings" in out


@pytest.mark.parametrize("make", BAD_FILES, ids=lambda f: f.__name__.strip("_"))
def test_validate_bad_file(trace_file, tmp_path, capsys, make):
    path, reason = make(trace_file, tmp_path)
    rc, out, _ = run(capsys, "trace", "validate", trace_file, path)
    assert rc == 1
    assert f"{trace_file}: ok" in out  # the good file is still reported
    assert "error" in out and str(path) in out and reason in out
    assert f"{path}: ok" not in out


def test_validate_warns_on_inconsistent_cacheable_call(trace_file, tmp_path, capsys):
    doc = json.loads(trace_file.read_text())
    first, second = doc["rollouts"][0], doc["rollouts"][1]
    assert first["task"] == second["task"]
    second["steps"][0] = dict(first["steps"][0], observation_digest="sha256:ffffffffffffffff")
    path = tmp_path / "warn.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run(capsys, "trace", "validate", path)
    assert rc == 0  # warnings do not fail validation
    assert "mark the tool non-cacheable" in out
    assert f"{path}: ok" in out and "1 warnings" in out


# ---------------------------------------------------------------------------------------------
# 8. the default workload (no TRACE)


def test_replay_default_webarena_workload(tmp_path, capsys):
    generated = tmp_path / "webarena.json"
    assert run(capsys, "generate", "webarena", generated, "--seed", 1)[0] == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    rc, out, err = run(capsys, "replay", "--workload", "webarena", "--seed", 1,
                       "--policy", "base", "--json", a)
    assert rc == 0, err
    assert "webarena: engine bunshin, policy base" in out
    n = len(load_trace(generated).rollouts)
    assert summary_rows(out)["rollouts"] == f"{n} ({n} done)"
    # the in-memory default workload is the one `generate` writes with the same seed
    assert run(capsys, "replay", generated, "--seed", 1, "--policy", "base", "--json", b)[0] == 0
    assert a.read_bytes() == b.read_bytes()


# ---------------------------------------------------------------------------------------------
# bugs found and fixed: brackets in file names, page size 0, unwritable outputs, repeats


@pytest.mark.parametrize("name", ["trace[old].json", "x[/a].json"])
@pytest.mark.parametrize("command", ["replay", "validate"])
def test_error_keeps_brackets_in_file_name(tmp_path, capsys, name, command):
    path = tmp_path / name
    argv = ["trace", "validate", path] if command == "validate" else ["replay", path]
    rc, out, err = run(capsys, *argv)
    assert rc in (1, 2)
    assert name in out + err


@pytest.mark.parametrize("size", ["0", "0.5"])
def test_zero_page_size_is_a_clean_error(trace_file, capsys, size):
    try:
        rc = main(["replay", str(trace_file), "--page-size", size])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert "page" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["generate", "json", "plot"])
def test_unwritable_output_is_a_clean_error(trace_file, tmp_path, capsys, what):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    missing = tmp_path / "no-such-dir" / "out.json"
    if what == "generate":
        argv, target = ["generate", "osworld", missing, *TINY], missing
    elif what == "json":
        argv, target = ["replay", trace_file, "--json", missing], missing
    else:
        argv, target = ["replay", trace_file, "--plot", blocker], blocker
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith("bunshin: error:") and str(target) in err


def test_compare_repeated_engine_is_shown_or_rejected(trace_file, capsys):
    rc, out, err = run(capsys, "compare", trace_file, "--engines", "criu,criu", "--policies", "base")
    if rc == 2:
        assert "criu" in err
    else:
        assert rc == 0
        assert len(table_rows(out)[1]) == 2
