"""Spec Tool Selector benchmark: prediction quality and latency, and what it brings in the
simulator, side by side with baselines measured in the same run.

Usage: python benchmarks/bench_selector.py [TAU_BENCH_JSON]

1. Leave-one-trial-out on the imported tau-bench sample: most-frequent-call, name-bigram,
   history and blend predictors (top-1/top-3 on name and name+arguments, ECE, latency).
   Target: blend name+arguments top-1 at least 15 points above name-bigram name-only top-1;
   blend p99 latency under 1 ms. Then the ceiling: the share of held-out calls any predictor
   that builds calls from other trials, earlier calls and earlier observations could produce.
2. Simulator: the selectors are fitted on trials 0-1 (recordings of an earlier run) and the
   run replays trials 2-3, policy ``spec`` on the bunshin engine, against ``base``.
"""

from __future__ import annotations

import sys
import time

import msgspec

from bunshin_async import (
    BlendSelector,
    HistorySelector,
    SchedulerConfig,
    evaluate_selectors,
    import_openai,
)
from bunshin_async._cmd_traces import default_factories
from bunshin_async._importers import OBSERVATION_VALUES_KEY, observation_index
from sim import simulate

SAMPLE = sys.argv[1] if len(sys.argv) > 1 else "/work/shared/traces/tau-bench-airline-sample.json"


def split(trace, trials):
    rollouts = [r for r in trace.rollouts if r.sample in trials]
    index = observation_index(trace)
    digests = {s.observation_digest for r in rollouts for s in r.steps}
    meta = dict(trace.meta)
    meta[OBSERVATION_VALUES_KEY] = msgspec.json.encode(
        {d: list(v) for d, v in index.items() if d in digests}, order="sorted").decode()
    return msgspec.structs.replace(trace, rollouts=rollouts, meta=meta)


def ceiling(trace, target: float) -> None:
    """How high any name+arguments top-1 could go on *trace*, leave one trial out: the share
    of held-out calls made exactly in another trial of the task, and of calls whose every
    argument value appeared before (in another trial of the task, an earlier call or an
    earlier observation of the same trial). A value found nowhere came from outside the
    workspace (in tau-bench, the user's messages, which a trace does not record), so no
    predictor that sees calls and observations can produce it."""
    import json

    from bunshin_async import call_key, loto_folds

    index = observation_index(trace)
    n = seen = constructible = 0
    for held, train in loto_folds(trace):
        mates = [r for r in train.rollouts if r.task == held.task]
        known = {call_key(s.call) for r in mates for s in r.steps}
        values = {json.dumps(v, sort_keys=True) for r in mates for s in r.steps for v in s.call.arguments.values()}
        for i, step in enumerate(held.steps):
            n += 1
            if call_key(step.call) in known:
                seen += 1
                constructible += 1
                continue
            before = set(values)
            for c in held.steps[:i]:
                before |= {json.dumps(v, sort_keys=True) for v in c.call.arguments.values()}
                for v in index.get(c.observation_digest, ()):
                    before |= {json.dumps(v, sort_keys=True), str(v)}
            constructible += all(json.dumps(v, sort_keys=True) in before or str(v) in before
                                 for v in step.call.arguments.values())
    print(f"ceiling: {seen / n:.1%} of held-out calls were made exactly in another trial of the task; "
          f"{constructible / n:.1%} have every argument value available before them "
          f"(the most any call@1 could reach here; the target needs {target:.1%})")


def main() -> None:
    trace = import_openai(SAMPLE)
    steps = sum(len(r.steps) for r in trace.rollouts)
    print(f"{trace.name}: {len(trace.tasks)} tasks, {len(trace.rollouts)} rollouts, {steps} calls")
    t0 = time.perf_counter()
    scores = {s.name: s for s in evaluate_selectors(trace, default_factories())}
    print(f"\n1. leave-one-trial-out ({time.perf_counter() - t0:.1f} s)")
    print(f"{'predictor':20} {'name@1':>7} {'name@3':>7} {'call@1':>7} {'call@3':>7} {'ECE':>6} {'p50 us':>7} {'p99 us':>7}")
    for s in scores.values():
        print(f"{s.name:20} {s.top1_name:7.1%} {s.top3_name:7.1%} {s.top1_call:7.1%} {s.top3_call:7.1%} "
              f"{s.ece:6.3f} {s.latency_p50_us:7.0f} {s.latency_p99_us:7.0f}")
    blend, bigram = scores["blend"], scores["name-bigram"]
    gap = 100 * (blend.top1_call - bigram.top1_name)
    print(f"blend call@1 - name-bigram name@1 = {gap:+.1f} points (target >= +15): {'met' if gap >= 15 else 'MISSED'}")
    print(f"blend p99 latency {blend.latency_p99_us:.0f} us (target < 1000 us): "
          f"{'met' if blend.latency_p99_us < 1000 else 'MISSED'}")
    ceiling(trace, bigram.top1_name + 0.15)
    print(f"blend call@1 / history call@1 = {blend.top1_call / max(scores['history'].top1_call, 1e-9):.2f}x")

    print("\n2. simulator: fit on trials 0-1, replay trials 2-3 (engine bunshin)")
    train, run = split(trace, {0, 1}), split(trace, {2, 3})
    full_index = observation_index(run)
    rows = {}
    for tail in (1.0, 0.25):
        base = simulate(run, engine="bunshin", policy="base")
        rows[f"base (tail {tail})"] = base
        for label, make in (("history", lambda: HistorySelector().fit(train)),
                            ("blend", lambda: BlendSelector(observation_values=full_index).fit(train))):
            for rule in ("confidence", "benefit"):
                cfg = SchedulerConfig.preset("spec", spec_tail=tail, spec_rule=rule)
                rows[f"{label}/{rule} (tail {tail})"] = simulate(run, engine="bunshin", config=cfg, selector=make())
    print(f"{'run':32} {'makespan s':>10} {'x base':>7} {'launched':>8} {'hits':>5} {'misses':>6} "
          f"{'hidden s':>8} {'wasted s':>8}")
    for label, r in rows.items():
        tail = label.split("(tail ")[1].rstrip(")")
        b = rows[f"base (tail {tail})"]
        print(f"{label:32} {r.makespan:10.1f} {r.makespan / b.makespan:7.3f} {r.spec.launched:8d} {r.spec.hits:5d} "
              f"{r.spec.misses:6d} {r.spec.hidden_exec_seconds:8.1f} {r.spec.wasted_exec_seconds:8.1f}")


if __name__ == "__main__":
    main()
