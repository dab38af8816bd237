"""Tests of the synthetic workload generators (sim/_workloads.py)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from functools import cache
from itertools import combinations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bunshin_async._exceptions import ConfigError
from bunshin_async._trace import (
    TRACE_VERSION,
    Trace,
    call_key,
    check_trace,
    decode_trace,
    encode_trace,
)
from sim._workloads import (
    ARGUMENT_KINDS,
    WORKLOADS,
    LogNormal,
    RewardModel,
    StepCount,
    WorkloadParams,
    generate,
    workload_params,
)

NAMES = sorted(WORKLOADS)


@cache
def _trace(name: str, seed: int = 0, **overrides: object) -> Trace:
    params = workload_params(name, **overrides) if overrides else WORKLOADS[name]
    return generate(params, seed=seed)


def _pair_agreement(keys: list[object]) -> float:
    pairs = list(combinations(keys, 2))
    return sum(a == b for a, b in pairs) / len(pairs)


def _prefix(rollout, depth: int) -> tuple[bytes, ...]:
    return tuple(call_key(s.call) for s in rollout.steps[:depth])


def _group_agreement(trace: Trace, depth: int, epoch: int = 0) -> float:
    """Mean over groups of the share of sample pairs whose first *depth* calls are equal."""
    return statistics.mean(
        _pair_agreement([_prefix(r, depth) for r in group]) for group in trace.groups(epoch)
    )


def _epoch_recurrence(trace: Trace, depth: int) -> float:
    """Share of epoch-1 rollouts whose first *depth* calls some epoch-0 rollout of the task made."""
    seen = {(r.task, _prefix(r, depth)) for r in trace.rollouts if r.epoch == 0}
    later = [r for r in trace.rollouts if r.epoch == 1]
    return sum((r.task, _prefix(r, depth)) in seen for r in later) / len(later)


# --- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_same_seed_gives_identical_bytes(name: str, fmt: str) -> None:
    a = generate(WORKLOADS[name], seed=7)
    b = generate(WORKLOADS[name], seed=7)
    assert encode_trace(a, fmt) == encode_trace(b, fmt)


@pytest.mark.parametrize("name", NAMES)
def test_different_seed_gives_a_different_trace(name: str) -> None:
    a, b = _trace(name, 0), _trace(name, 1)
    assert encode_trace(a) != encode_trace(b)
    assert [r.steps for r in a.rollouts] != [r.steps for r in b.rollouts]


def test_generation_does_not_mutate_the_defaults() -> None:
    before = msgspec.json.encode(WORKLOADS["osworld"])
    workload_params("osworld", tasks=2)
    generate(WORKLOADS["osworld"], seed=3)
    assert msgspec.json.encode(WORKLOADS["osworld"]) == before


# --- validity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_round_trips_through_the_trace_codec(name: str, fmt: str) -> None:
    trace = _trace(name)
    data = encode_trace(trace, fmt)
    again = decode_trace(data, source=f"{name}.{fmt}", fmt=fmt)
    assert again == trace
    assert encode_trace(again, fmt) == data


@pytest.mark.parametrize("name", NAMES)
def test_check_trace_finds_nothing(name: str) -> None:
    assert check_trace(_trace(name)) == []
    assert check_trace(_trace(name, 5)) == []


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(NAMES),
    tasks=st.integers(1, 3),
    group_size=st.integers(1, 5),
    epochs=st.integers(1, 3),
    agreement=st.floats(0.0, 1.0),
    novelty=st.floats(0.0, 1.0),
    alternatives=st.integers(0, 4),
    noncacheable_share=st.floats(0.0, 1.0),
    seed=st.integers(-(2**40), 2**40),
)
def test_any_small_workload_is_valid_and_deterministic(
    name, tasks, group_size, epochs, agreement, novelty, alternatives, noncacheable_share, seed
) -> None:
    params = workload_params(
        name, tasks=tasks, group_size=group_size, epochs=epochs, agreement=agreement,
        novelty=novelty, alternatives=alternatives, noncacheable_share=noncacheable_share,
    )
    trace = generate(params, seed=seed)
    assert len(trace.rollouts) == tasks * group_size * epochs
    assert check_trace(trace) == []
    data = encode_trace(trace, "msgpack")
    assert decode_trace(data, fmt="msgpack") == trace
    assert encode_trace(generate(params, seed=seed), "msgpack") == data


# --- structure ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_rollouts_are_in_trainer_order(name: str) -> None:
    params = WORKLOADS[name]
    trace = _trace(name)
    t, g = params.tasks, params.group_size
    assert len(trace.tasks) == t
    assert [task.id for task in trace.tasks] == [f"{params.workload}-{i:03d}" for i in range(t)]
    assert len(trace.rollouts) == params.epochs * t * g
    for i, r in enumerate(trace.rollouts):
        assert r.epoch == i // (t * g)
        assert r.task == trace.tasks[(i // g) % t].id
        assert r.group == 0
        assert r.sample == i % g
    assert trace.epochs() == list(range(params.epochs))
    for group in trace.groups():
        assert [r.sample for r in group] == list(range(g))


def test_an_osworld_epoch_is_256_rollouts_of_ten_to_twenty_steps() -> None:
    trace = _trace("osworld")
    epoch0 = [r for r in trace.rollouts if r.epoch == 0]
    assert len(epoch0) == 256
    lengths = [len(r.steps) for r in epoch0]
    assert 10 <= statistics.mean(lengths) <= 20
    assert max(lengths) <= WORKLOADS["osworld"].steps.high
    assert min(lengths) >= WORKLOADS["osworld"].steps.low


@pytest.mark.parametrize("name", NAMES)
def test_values_are_in_range(name: str) -> None:
    params = WORKLOADS[name]
    trace = _trace(name)
    tools = {t.name: t for t in params.tools}
    tasks = trace.task_map()
    for task in trace.tasks:
        assert task.memory.image_bytes == params.memory.image_bytes
        assert task.memory.runtime_bytes > 0 and task.memory.boot_time > 0
    for r in trace.rollouts:
        assert 0.0 <= r.reward <= 1.0
        assert r.final_think_time > 0
        runtime = tasks[r.task].memory.runtime_bytes
        for s in r.steps:
            assert s.call.name in tools
            assert s.think_time > 0 and s.exec_time > 0
            assert s.exec_time <= tools[s.call.name].exec_time.high + 10
            assert 0 <= s.dirtied_bytes <= runtime and s.dirtied_bytes % 4096 == 0
            assert s.observation_size > 0
            assert s.observation_digest.startswith("sha256:")
            if not tools[s.call.name].cacheable:
                assert not s.cacheable
    rewards = [r.reward for r in trace.rollouts]
    assert 0.0 < statistics.mean(rewards) < 1.0


def test_meta_records_generator_workload_seed_and_params() -> None:
    trace = _trace("webarena", 3)
    assert trace.version == TRACE_VERSION
    assert trace.name == "webarena"
    assert trace.meta["generator"] == "sim._workloads.generate"
    assert trace.meta["workload"] == "webarena"
    assert trace.meta["params"] == "webarena"
    assert trace.meta["seed"] == 3
    other = generate(workload_params("webarena", tasks=2), seed=3)
    assert other.meta["params_digest"] != trace.meta["params_digest"]


def test_arguments_are_small_realistic_json_objects() -> None:
    seen: dict[str, list[dict]] = defaultdict(list)
    for name in NAMES:
        for r in _trace(name).rollouts:
            for s in r.steps:
                seen[f"{name}.{s.call.name}"].append(s.call.arguments)
                assert len(msgspec.json.encode(s.call.arguments)) < 200
    for args in seen["osworld.click"]:
        assert set(args) == {"x", "y"} and 0 <= args["x"] < 1920 and 0 <= args["y"] < 1080
    assert all(isinstance(a["text"], str) and a["text"] for a in seen["osworld.type"])
    assert all(isinstance(a["command"], str) for a in seen["osworld.shell"])
    assert all(a["url"].startswith("http://") for a in seen["webarena.goto"])
    assert all(a == {} for a in seen["webarena.go_back"])


@pytest.mark.parametrize("name", NAMES)
def test_arguments_come_from_a_small_vocabulary(name: str) -> None:
    per_task: dict[tuple[str, str], set[bytes]] = defaultdict(set)
    for r in _trace(name).rollouts:
        for s in r.steps:
            per_task[(r.task, s.call.name)].add(call_key(s.call))
    sizes = {t.name: t.vocab_size for t in WORKLOADS[name].tools}
    for (_, tool), keys in per_task.items():
        assert len(keys) <= sizes[tool]


# --- caching semantics -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_cacheable_call_after_the_same_prefix_costs_and_shows_the_same(name: str) -> None:
    outcomes: dict[tuple[str, tuple[bytes, ...]], tuple] = {}
    repeats = 0
    for r in _trace(name).rollouts:
        for j, s in enumerate(r.steps):
            if not s.cacheable:
                continue
            key = (r.task, _prefix(r, j + 1))
            got = (s.observation_digest, s.observation_size, s.exec_time, s.dirtied_bytes)
            if key in outcomes:
                repeats += 1
                assert outcomes[key] == got
            else:
                outcomes[key] = got
    assert repeats > 1000


@pytest.mark.parametrize("name", NAMES)
def test_non_cacheable_calls_see_rollout_specific_observations(name: str) -> None:
    trace = _trace(name, noncacheable_share=0.3)
    digests: dict[tuple[str, tuple[bytes, ...]], set[str]] = defaultdict(set)
    counts: dict[tuple[str, tuple[bytes, ...]], int] = defaultdict(int)
    for r in trace.rollouts:
        for j, s in enumerate(r.steps):
            if not s.cacheable:
                key = (r.task, _prefix(r, j + 1))
                digests[key].add(s.observation_digest)
                counts[key] += 1
    shared = [k for k, n in counts.items() if n > 1]
    assert shared
    assert all(len(digests[k]) == counts[k] for k in shared)
    assert check_trace(trace) == []


def test_cacheability_is_a_property_of_the_call() -> None:
    trace = _trace("osworld", noncacheable_share=0.3)
    flags: dict[tuple[str, bytes], set[bool]] = defaultdict(set)
    for r in trace.rollouts:
        for s in r.steps:
            flags[(r.task, call_key(s.call))].add(s.cacheable)
    assert all(len(v) == 1 for v in flags.values())
    share = statistics.mean(not s.cacheable for r in trace.rollouts for s in r.steps)
    assert 0.2 < share < 0.5


def test_noncacheable_share_zero_leaves_only_non_cacheable_tools() -> None:
    trace = _trace("webarena", noncacheable_share=0.0)
    assert all(s.cacheable for r in trace.rollouts for s in r.steps)


# --- recurrence and divergence -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_first_calls_agree_within_a_group_far_more_than_chance(name: str) -> None:
    agree = _group_agreement(_trace(name), 1)
    chance = _group_agreement(
        _trace(name, agreement=0.0, agreement_floor=0.0, novelty=1.0, epoch_repeat=0.0), 1
    )
    assert agree > 0.6
    assert agree > 3 * chance


@pytest.mark.parametrize("name", NAMES)
def test_samples_of_a_group_diverge_gradually(name: str) -> None:
    trace = _trace(name)
    curve = [_group_agreement(trace, d) for d in (1, 2, 4, 8)]
    assert curve == sorted(curve, reverse=True)
    assert curve[0] > curve[-1] + 0.3
    assert curve[2] > 0.1  # still shared after a few steps, not a cliff


@pytest.mark.parametrize("name", NAMES)
def test_later_epochs_repeat_earlier_opening_calls(name: str) -> None:
    trace = _trace(name)
    assert _epoch_recurrence(trace, 1) > 0.9
    assert _epoch_recurrence(trace, 3) > 0.7
    no_repeat = _trace(name, epoch_repeat=0.0)
    assert _epoch_recurrence(trace, 3) > _epoch_recurrence(no_repeat, 3) + 0.05
    chance = _trace(name, agreement=0.0, agreement_floor=0.0, novelty=1.0, epoch_repeat=0.0)
    assert _epoch_recurrence(trace, 3) > 3 * _epoch_recurrence(chance, 3)


def test_agreement_is_the_knob_that_makes_groups_agree() -> None:
    hi = _group_agreement(_trace("osworld", agreement=1.0, agreement_decay=1.0), 4)
    lo = _group_agreement(_trace("osworld", agreement=0.3, agreement_floor=0.0), 4)
    assert hi > 0.5 > lo


# --- long tails --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_exec_times_are_long_tailed(name: str) -> None:
    times = sorted(s.exec_time for r in _trace(name).rollouts for s in r.steps)
    median = statistics.median(times)
    assert times[-1] > 20 * median
    assert times[int(0.99 * len(times))] > 4 * median


def test_without_a_tail_share_the_tail_disappears() -> None:
    params = WORKLOADS["osworld"]
    tools = [
        msgspec.structs.replace(
            t, exec_time=msgspec.structs.replace(t.exec_time, tail_share=0.0)
        )
        for t in params.tools
    ]
    tailless = [
        s.exec_time for r in generate(workload_params("osworld", tools=tools)).rollouts
        for s in r.steps
    ]
    default = [s.exec_time for r in _trace("osworld").rollouts for s in r.steps]
    assert 3 * max(tailless) < max(default)
    assert statistics.mean(tailless) < statistics.mean(default)


# --- parameters, overrides and errors ----------------------------------------------------------


def _numeric_paths(value: object, path: str = "") -> list[str]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _numeric_paths(v, f"{path}.{k}".lstrip("."))]
    raise AssertionError(f"unexpected {type(value)} at {path}")


def _params_tree(params: WorkloadParams) -> dict:
    raw = msgspec.to_builtins(params)
    raw.pop("sources")
    raw["tools"] = {t.pop("name"): t for t in raw["tools"]}
    return raw


@pytest.mark.parametrize("name", NAMES)
def test_every_numeric_parameter_has_a_source(name: str) -> None:
    params = WORKLOADS[name]
    paths = _numeric_paths(_params_tree(params))
    assert len(paths) > 50
    for path in paths:
        parts = path.split(".")
        covering = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        assert any(c in params.sources for c in covering), f"{name}: no source for {path}"
    for key, text in params.sources.items():
        assert text.strip(), key
        assert any(p == key or p.startswith(key + ".") for p in paths), f"stale source {key}"


def test_overrides_replace_fields_and_mark_their_source() -> None:
    params = workload_params(
        "osworld", tasks=4, group_size=3, epochs=3, steps=StepCount(2, 3, 4, 0)
    )
    assert (params.tasks, params.group_size, params.epochs) == (4, 3, 3)
    assert params.think_time == WORKLOADS["osworld"].think_time
    assert params.sources["tasks"].startswith("override")
    assert params.sources["steps"].startswith("override")
    trace = generate(params)
    assert len(trace.rollouts) == 4 * 3 * 3
    assert all(2 <= len(r.steps) <= 4 for r in trace.rollouts)
    assert workload_params("osworld") is WORKLOADS["osworld"]


def test_nested_overrides_may_be_plain_dicts() -> None:
    params = workload_params("webarena", think_time={"median": 3.0, "sigma": 0.0})
    assert params.think_time == LogNormal(3.0, 0.0)
    trace = generate(workload_params("webarena", tasks=1, think_time={"median": 3.0, "sigma": 0.0}))
    assert {s.think_time for r in trace.rollouts for s in r.steps} == {3.0}


def test_reward_model_thresholds_rewards() -> None:
    always = _trace("osworld", reward=RewardModel(0.0, 0.0))
    never = _trace("osworld", reward=RewardModel(1.0, 0.5), agreement=0.5, agreement_floor=0.0)
    assert {r.reward for r in always.rollouts} == {1.0}
    assert max(r.reward for r in never.rollouts) <= 1.0
    assert any(0.0 < r.reward < 0.5 for r in never.rollouts)


def test_unknown_workload_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"'swebench'.*osworld, webarena"):
        workload_params("swebench")


def test_unknown_override_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"'task_count'.*tasks.*group_size"):
        workload_params("osworld", task_count=4)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"tasks": 0}, "tasks"),
        ({"group_size": -1}, "group_size"),
        ({"agreement": 1.5}, "agreement"),
        ({"noncacheable_share": -0.1}, "noncacheable_share"),
        ({"epochs": "two"}, "epochs"),
        ({"steps": StepCount(10, 5, 20, 1.0)}, "low <= mode <= high"),
        ({"tools": []}, "at least one tool"),
        ({"think_time": LogNormal(1.0, 0.5, 5.0, 2.0)}, "think_time"),
    ],
)
def test_bad_override_values_are_config_errors(override: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        workload_params("osworld", **override)


def test_unknown_argument_kind_is_a_config_error_listing_the_kinds() -> None:
    tools = [msgspec.structs.replace(WORKLOADS["osworld"].tools[0], arguments="telepathy")]
    with pytest.raises(ConfigError, match=r"'telepathy'.*" + sorted(ARGUMENT_KINDS)[0]):
        workload_params("osworld", tools=tools)


def test_generate_checks_params_built_by_hand() -> None:
    bad = msgspec.structs.replace(WORKLOADS["webarena"], group_size=0)
    with pytest.raises(ConfigError, match="group_size"):
        generate(bad)
    with pytest.raises(ConfigError, match="seed"):
        generate(WORKLOADS["webarena"], seed="0")  # type: ignore[arg-type]
