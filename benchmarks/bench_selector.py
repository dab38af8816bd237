"""Spec Tool Selector benchmark: prediction quality and latency, and what it brings in the
simulator, side by side with baselines measured in the same run.

Usage: python benchmarks/bench_selector.py [TAU_BENCH_JSON]

1. Leave-one-trial-out on the imported tau-bench sample: most-frequent-call, name-bigram,
   history and blend predictors (top-1/top-3 on name and name+arguments, ECE, latency), and
   the blend again on the same trace with the steps' conversation removed, and the blend's
   thread CPU time per prediction (wall-clock latency also counts waiting for a core).
   Target: blend name+arguments top-1 at least 15 points above name-bigram name-only top-1;
   blend p99 latency under 1 ms. Then the ceiling: the share of held-out calls any predictor
   that builds calls from other trials, earlier calls, earlier observations and the
   conversation so far could produce, and the share of held-out calls among the blend's top 10
   or the task's other trials' calls (the most a re-ranker of those candidates could reach).
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
    earlier observation of the same trial), then also counting values said in the
    conversation so far (the steps' ``context``): as an id-like value (what the selector's
    copy rule takes) or as any word. A value found nowhere came from the policy itself
    (free text such as ``think``/``calculate`` arguments, or a value it derived), so no
    predictor that copies or recalls values can produce it."""
    import json
    import re

    from bunshin_async import call_key, loto_folds, observation_values

    def enc(v) -> str:
        return json.dumps(v, sort_keys=True)

    def have(v, pool: set[str]) -> bool:
        return enc(v) in pool or str(v) in pool

    index = observation_index(trace)
    n = seen = constructible = with_ids = with_words = 0
    for held, train in loto_folds(trace):
        mates = [r for r in train.rollouts if r.task == held.task]
        known = {call_key(s.call) for r in mates for s in r.steps}
        values = {enc(v) for r in mates for s in r.steps for v in s.call.arguments.values()}
        said: set[str] = set()
        words: set[str] = set()
        for i, step in enumerate(held.steps):
            for m in step.context:  # what reached the policy before this call
                said.update(observation_values(m.text))
                words.update(re.findall(r"[^\W_]+|[A-Za-z0-9_][A-Za-z0-9_\-./@:]*[A-Za-z0-9_]", m.text))
            n += 1
            if call_key(step.call) in known:
                seen += 1
                constructible += 1
                with_ids += 1
                with_words += 1
                continue
            before = set(values)
            for c in held.steps[:i]:
                before |= {enc(v) for v in c.call.arguments.values()}
                for v in index.get(c.observation_digest, ()):
                    before |= {enc(v), str(v)}
            args = step.call.arguments.values()
            constructible += all(have(v, before) for v in args)
            with_ids += all(have(v, before) or str(v) in said for v in args)
            with_words += all(have(v, before) or str(v) in said or str(v) in words for v in args)
    print(f"ceiling: {seen / n:.1%} of held-out calls were made exactly in another trial of the task; "
          f"{constructible / n:.1%} have every argument value available before them from other trials, "
          f"earlier calls and observations; {with_ids / n:.1%} counting the id-like values said in the "
          f"conversation, {with_words / n:.1%} counting any word said (the most any call@1 could "
          f"reach here; the target needs {target:.1%})")


def held_out_steps(trace):
    """Leave one trial out, as in the evaluation: for each held-out call, ``(known, call,
    predict)``: the keys of the calls the task's other trials made, the call, and
    ``predict(k)``, the top *k* predictions of a blend fitted on the other trials (and told the
    values of the held-out observations so far) from what came before the call."""
    from bunshin_async import call_key, loto_folds

    index = observation_index(trace)
    for held, train in loto_folds(trace):
        sel = BlendSelector().fit(train)
        known = {call_key(s.call) for r in train.rollouts if r.task == held.task for s in r.steps}
        calls = [s.call for s in held.steps]
        digests = [s.observation_digest for s in held.steps]
        contexts = [s.context for s in held.steps]
        for i, call in enumerate(calls):
            if i and digests[i - 1] in index:
                sel.add_observation_values({digests[i - 1]: index[digests[i - 1]]})
            yield known, call, lambda k, i=i: sel.predict(
                held.task, calls[:i], k, observations=digests[:i], contexts=contexts[: i + 1])


def candidate_recall(trace, k: int = 10) -> float:
    """The share of held-out calls that are among the blend's top *k* predictions or were made
    in another trial of the task: what any re-ranking of the calls the blend and the task's
    history propose could reach at top 1."""
    from bunshin_async import call_key

    n = found = 0
    for known, call, predict in held_out_steps(trace):
        n += 1
        found += call_key(call) in known or any(p.call == call for p in predict(k))
    return found / max(n, 1)


def cpu_latency(trace) -> tuple[float, float]:
    """p50 and p99 microseconds of thread CPU time per blend prediction, leave one trial out
    as in the evaluation: unlike wall time, this excludes waiting for a core, so it shows
    the predictor's own cost on a machine other jobs keep busy."""
    times = []
    for _, _, predict in held_out_steps(trace):
        t0 = time.thread_time_ns()
        predict(3)
        times.append((time.thread_time_ns() - t0) / 1000)
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]


def main() -> None:
    trace = import_openai(SAMPLE)
    steps = sum(len(r.steps) for r in trace.rollouts)
    print(f"{trace.name}: {len(trace.tasks)} tasks, {len(trace.rollouts)} rollouts, {steps} calls")
    heard = sum(bool(s.context) for r in trace.rollouts for s in r.steps)
    print(f"conversation context on {heard} of {steps} steps")
    t0 = time.perf_counter()
    scores = {s.name: s for s in evaluate_selectors(trace, default_factories())}
    # the same blend without the steps' conversation: what the conversation brings
    deaf = msgspec.structs.replace(trace, rollouts=[
        msgspec.structs.replace(r, steps=[msgspec.structs.replace(s, context=()) for s in r.steps])
        for r in trace.rollouts])
    (no_talk,) = evaluate_selectors(deaf, {"blend, no conversation": lambda tr: BlendSelector().fit(tr)})
    scores[no_talk.name] = no_talk
    print(f"\n1. leave-one-trial-out ({time.perf_counter() - t0:.1f} s)")
    print(f"{'predictor':22} {'name@1':>7} {'name@3':>7} {'call@1':>7} {'call@3':>7} {'ECE':>6} {'p50 us':>7} {'p99 us':>7}")
    for s in scores.values():
        print(f"{s.name:22} {s.top1_name:7.1%} {s.top3_name:7.1%} {s.top1_call:7.1%} {s.top3_call:7.1%} "
              f"{s.ece:6.3f} {s.latency_p50_us:7.0f} {s.latency_p99_us:7.0f}")
    blend, bigram = scores["blend"], scores["name-bigram"]
    gap = 100 * (blend.top1_call - bigram.top1_name)
    print(f"blend call@1 - name-bigram name@1 = {gap:+.1f} points (target >= +15): {'met' if gap >= 15 else 'MISSED'}")
    print(f"blend p99 latency {blend.latency_p99_us:.0f} us (target < 1000 us): "
          f"{'met' if blend.latency_p99_us < 1000 else 'MISSED'}")
    p50, p99 = cpu_latency(trace)
    print(f"blend CPU time per prediction (no waiting for a core): p50 {p50:.0f} us, p99 {p99:.0f} us")
    ceiling(trace, bigram.top1_name + 0.15)
    print(f"candidates: the blend's top 10 or a call of the task's other trials in "
          f"{candidate_recall(trace):.1%} of held-out calls (the most a re-ranking of them could reach)")
    print(f"blend call@1 / history call@1 = {blend.top1_call / max(scores['history'].top1_call, 1e-9):.2f}x; "
          f"with / without the conversation: call@1 {blend.top1_call / max(no_talk.top1_call, 1e-9):.2f}x, "
          f"call@3 {blend.top3_call / max(no_talk.top3_call, 1e-9):.2f}x")

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
