"""Properties of the scheduler core over the generated workloads (hypothesis), checked with the
invariants of :mod:`bunshin_async.testing` that users run on their own policies.

- semantic transparency: caching and speculation change when a sample sees an observation,
  never what it sees, nor its reward;
- every rollout finishes exactly once, and afterwards nothing is left alive, also when
  samples are cancelled midway;
- on the same trace, engine ``bunshin`` never peaks above ``criu``; the hot tier never
  exceeds its budget;
- the same trace and seed give identical results.
"""

from __future__ import annotations

import functools
import random

import anyio
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshin_async.testing import (
    PolicySet,
    check_budgets,
    check_determinism,
    check_engine_order,
    check_finishes_once,
    check_transparency,
)
from sim import StepCount, build_simulation, generate, run_virtual, simulate, workload_params

MiB = 1 << 20
GiB = 1 << 30


@functools.lru_cache(maxsize=64)
def small_trace(workload: str, seed: int, tasks: int, group: int, epochs: int):
    params = workload_params(
        workload,
        tasks=tasks,
        group_size=group,
        epochs=epochs,
        steps=StepCount(low=2, mode=5, high=8, jitter=1.0),
    )
    return generate(params, seed=seed)


def trace_strategy(min_group: int = 1):
    return st.builds(
        small_trace,
        workload=st.sampled_from(["osworld", "webarena"]),
        seed=st.integers(0, 2**16),
        tasks=st.integers(1, 4),
        group=st.integers(min_group, 4),
        epochs=st.integers(1, 2),
    )


traces = trace_strategy()

configs = st.fixed_dictionaries(
    {
        "batch_tasks": st.integers(1, 4),
        "mode": st.sampled_from(["sync", "async"]),
        "staleness": st.integers(0, 2),
        # small budgets force demotion to the cold tier, drops and replays
        "hot_budget": st.sampled_from([0, 64 * MiB, 512 * MiB, 8 * GiB]),
        "cold_budget": st.sampled_from([0, 256 * MiB, 64 * GiB]),
        "spec_tail": st.sampled_from([0.25, 1.0]),
        "spec_min_confidence": st.sampled_from([0.0, 0.3]),
        "spec_budget": st.integers(0, 8),
    }
)

ENGINES = ["bunshin", "criu", "microvm", "restart", "cold"]
PROPS = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
DEFAULTS = PolicySet()  # the built-in policies; bunshin_async.testing checks user ones the same way


def run_with_cancellations(trace, engine: str, policy: str, cfg: dict, seed: int, cancels: list[tuple[float, int]]):
    """Run *trace* and cancel rollout number i (of the plan) at virtual time t for each
    (t, i) in *cancels*; return the result, the backend and the plan's keys."""
    sim = build_simulation(trace, engine=engine, policy=policy, seed=seed, cancels=cancels, **cfg)
    return run_virtual(sim.run), sim.backend, sim.plan_keys()


@PROPS
@given(trace=traces, cfg=configs, engine=st.sampled_from(ENGINES), seed=st.integers(0, 100))
def test_semantic_transparency(trace, cfg, engine, seed) -> None:
    check_transparency(trace, cfg, DEFAULTS, engine=engine, seed=seed)


@PROPS
@given(
    trace=traces,
    cfg=configs,
    engine=st.sampled_from(ENGINES),
    cancels=st.lists(st.tuples(st.floats(0, 3000), st.integers(0, 63)), max_size=6),
)
def test_every_rollout_finishes_once_and_nothing_is_left(trace, cfg, engine, cancels) -> None:
    check_finishes_once(trace, cfg, DEFAULTS, engine=engine, cancels=cancels)


shared_traces = trace_strategy(min_group=2)


# Groups of one sample share nothing; see check_engine_order for why caching is off there.
@PROPS
@given(trace=shared_traces, cfg=configs, seed=st.integers(0, 100))
def test_bunshin_never_peaks_above_criu(trace, cfg, seed) -> None:
    check_engine_order(trace, cfg, DEFAULTS, seed=seed)


@PROPS
@given(trace=shared_traces, cfg=configs, policy=st.sampled_from(["base", "spec", "full"]), seed=st.integers(0, 100))
def test_bunshin_never_peaks_above_criu_with_the_generated_workloads(trace, cfg, policy, seed) -> None:
    # the generated workloads' tasks hold more runtime memory than image, so here the order
    # holds with caching on too (see check_engine_order for when it does not)
    b = simulate(trace, engine="bunshin", policy=policy, seed=seed, **cfg)
    c = simulate(trace, engine="criu", policy=policy, seed=seed, **cfg)
    assert b.memory.peak_bytes <= c.memory.peak_bytes


@PROPS
@given(trace=traces, cfg=configs, engine=st.sampled_from(ENGINES))
def test_budgets_hold(trace, cfg, engine) -> None:
    check_budgets(trace, cfg, DEFAULTS, engine=engine)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces, cfg=configs, engine=st.sampled_from(ENGINES))
def test_same_trace_and_seed_same_result(trace, cfg, engine) -> None:
    check_determinism(trace, cfg, DEFAULTS, engine=engine, seed=7)


def test_cancellation_releases_forks_of_a_running_sample() -> None:
    # a deterministic instance of the cancellation property, with speculation and caching on
    trace = small_trace("osworld", 3, 2, 4, 2)
    rng = random.Random(1)
    cancels = [(rng.uniform(10, 400), i) for i in range(0, 16, 3)]
    result, backend, keys = run_with_cancellations(trace, "bunshin", "full", {"spec_tail": 1.0, "spec_min_confidence": 0.0}, 0, cancels)
    assert sum(r.status == "cancelled" for r in result.rollouts) >= 1
    assert backend.live_handles() == 0 and backend.working_set() == 0


def test_same_result_across_processes(tmp_path) -> None:
    # no result may depend on Python's per-process hash randomisation
    import os
    import subprocess
    import sys

    from bunshin_async import dump_trace

    path = tmp_path / "t.json"
    dump_trace(small_trace("webarena", 5, 3, 3, 2), path)
    outs = []
    for hashseed in ("1", "2"):
        out = tmp_path / f"r{hashseed}.json"
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        subprocess.run(
            [sys.executable, "-m", "bunshin_async._cli", "replay", str(path), "--policy", "full",
             "--spec-tail", "1.0", "--hot-budget", "256MiB", "--json", str(out)],
            check=True, env=env, capture_output=True,
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
