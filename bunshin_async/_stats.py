"""How much the samples of a group share, and how well a Spec Tool Selector predicts.

:func:`trace_stats` measures, per task and overall, what prefix caching can exploit in a
trace: the shared prefix between samples of a group, the share of steps a prefix cache would
skip, and how often samples agree on their first call.

:func:`evaluate_selectors` measures predictors with leave-one-trial-out: each rollout in turn
is held out, every predictor is fitted on the other rollouts only (a fresh predictor per
fold), and then asked for each of the held-out rollout's calls given its true prefix. It
reports top-1 and top-3 accuracy on the name and on name plus arguments, calibration
(reliability bins and expected calibration error of the top prediction's confidence) and the
latency of each prediction.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations

import msgspec

from ._importers import OBSERVATION_VALUES_KEY, observation_index
from ._selector import SpecToolSelector, accepts_contexts
from ._trace import Rollout, Trace, call_key

__all__ = [
    "GroupShare",
    "ReliabilityBin",
    "SelectorScore",
    "TraceStats",
    "evaluate_selectors",
    "loto_folds",
    "trace_stats",
]


class GroupShare(msgspec.Struct, frozen=True):
    """What the samples of one task share (all its groups together)."""

    task: str
    """The task id (``"(all)"`` for the whole trace)."""
    groups: int
    """Groups of the task."""
    rollouts: int
    """Rollouts (samples) of the task."""
    steps: int
    """Steps (calls) of those rollouts."""
    mean_steps: float
    """Mean calls per rollout."""
    shared_prefix: float
    """Mean over pairs of samples of a group of their longest common prefix, in calls."""
    shared_prefix_share: float
    """That prefix as a share of the pair's mean length (0 for empty rollouts)."""
    cache_skip_share: float
    """Share of steps a prefix cache would skip: replaying rollouts in trace order, the calls
    that match a path an earlier rollout of the task took (cacheable calls only, up to the
    first non-cacheable call)."""
    first_call_agreement: float
    """Share of pairs of samples of a group whose first calls (name and arguments) are the
    same; pairs where either made no call disagree."""
    first_name_agreement: float
    """The same for the first call's name only."""
    pairs: int
    """Pairs of samples the pairwise figures are means over."""


class TraceStats(msgspec.Struct, frozen=True):
    """:func:`trace_stats`'s result."""

    tasks: list[GroupShare]
    """Per task, in trace order."""
    overall: GroupShare
    """The whole trace (pairwise figures are means over all pairs)."""


def _lcp(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trace_stats(trace: Trace) -> TraceStats:
    """Measure how much the samples of each group share (see :class:`GroupShare`)."""
    keys = {id(r): [call_key(s.call) for s in r.steps] for r in trace.rollouts}
    # prefix-cache replay in trainer order, one cache per task
    cache: dict[str, set[bytes]] = {}
    skipped: dict[str, int] = Counter()
    for r in trace.rollouts:
        seen = cache.setdefault(r.task, set())
        h = hashlib.blake2b(digest_size=16)
        on_path = True
        for s, k in zip(r.steps, keys[id(r)]):
            if not s.cacheable:
                break
            h.update(len(k).to_bytes(4, "little") + k)
            d = h.copy().digest()
            if on_path and d in seen:
                skipped[r.task] += 1
            else:
                on_path = False
                seen.add(d)
    per: dict[str, dict[str, float]] = {}
    order: list[str] = []
    for group in trace.groups():
        t = group[0].task
        if t not in per:
            order.append(t)
            per[t] = dict(groups=0, rollouts=0, steps=0, pairs=0, lcp=0.0, lcp_share=0.0, first=0.0, first_name=0.0)
        acc = per[t]
        acc["groups"] += 1
        acc["rollouts"] += len(group)
        acc["steps"] += sum(len(r.steps) for r in group)
        for a, b in combinations(group, 2):
            ka, kb = keys[id(a)], keys[id(b)]
            n = _lcp(ka, kb)
            acc["pairs"] += 1
            acc["lcp"] += n
            mean_len = (len(ka) + len(kb)) / 2
            acc["lcp_share"] += n / mean_len if mean_len else 0.0
            acc["first"] += bool(ka and kb and ka[0] == kb[0])
            acc["first_name"] += bool(a.steps and b.steps and a.steps[0].call.name == b.steps[0].call.name)

    def row(task: str, acc: dict[str, float], skip: int) -> GroupShare:
        pairs = int(acc["pairs"])
        steps = int(acc["steps"])
        return GroupShare(
            task=task, groups=int(acc["groups"]), rollouts=int(acc["rollouts"]), steps=steps,
            mean_steps=steps / acc["rollouts"] if acc["rollouts"] else 0.0,
            shared_prefix=acc["lcp"] / pairs if pairs else 0.0,
            shared_prefix_share=acc["lcp_share"] / pairs if pairs else 0.0,
            cache_skip_share=skip / steps if steps else 0.0,
            first_call_agreement=acc["first"] / pairs if pairs else 0.0,
            first_name_agreement=acc["first_name"] / pairs if pairs else 0.0,
            pairs=pairs,
        )

    rows = [row(t, per[t], skipped[t]) for t in order]
    total: dict[str, float] = Counter()
    for t in order:
        for k, v in per[t].items():
            total[k] += v
    return TraceStats(tasks=rows, overall=row("(all)", total, sum(skipped.values())))


# -- predictor evaluation ----------------------------------------------------------------------


class ReliabilityBin(msgspec.Struct, frozen=True):
    """Top predictions whose confidence fell in ``[low, high)``."""

    low: float
    high: float
    count: int
    """Predictions in the bin."""
    confidence: float
    """Their mean confidence."""
    accuracy: float
    """Share of them that were exactly right (name and arguments)."""


class SelectorScore(msgspec.Struct, frozen=True):
    """How one predictor did over all held-out calls."""

    name: str
    """The predictor's label."""
    calls: int
    """Held-out calls predicted."""
    top1_name: float
    """Share whose top prediction had the right tool name."""
    top3_name: float
    """Share with the right name among the top three (distinct names counted once)."""
    top1_call: float
    """Share whose top prediction was exactly right (name and arguments)."""
    top3_call: float
    """Share with the exact call among the top three."""
    ece: float
    """Expected calibration error of the top prediction's confidence (exact-call
    correctness), over ``bins`` equal-width bins."""
    reliability: list[ReliabilityBin]
    """The bins, empty ones left out."""
    mean_confidence: float
    """Mean confidence of the top prediction (0 when none was made)."""
    latency_p50_us: float
    """Median microseconds per prediction."""
    latency_p99_us: float
    """99th percentile microseconds per prediction."""


def loto_folds(trace: Trace) -> list[tuple[Rollout, Trace]]:
    """Leave-one-trial-out folds: for each rollout, the trace of every *other* rollout.

    The training trace keeps only the observation-values entries of its own rollouts'
    observations, so nothing of the held-out rollout reaches the predictor through it.
    """
    index = observation_index(trace)
    folds = []
    for i, held in enumerate(trace.rollouts):
        train = [r for j, r in enumerate(trace.rollouts) if j != i]
        meta = dict(trace.meta)
        if index:
            digests = {s.observation_digest for r in train for s in r.steps}
            meta[OBSERVATION_VALUES_KEY] = msgspec.json.encode(
                {d: list(v) for d, v in index.items() if d in digests}, order="sorted").decode()
        assert held.key not in {r.key for r in train}
        folds.append((held, msgspec.structs.replace(trace, rollouts=train, meta=meta)))
    return folds


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


def evaluate_selectors(
    trace: Trace,
    factories: Mapping[str, Callable[[Trace], SpecToolSelector]],
    *,
    bins: int = 10,
    on_fold: Callable[[int, int], None] | None = None,
) -> list[SelectorScore]:
    """Score predictors with leave-one-trial-out on *trace* (see the module docstring).

    Args:
        trace: The rollouts.
        factories: Label to a function that builds a predictor fitted on a training trace
            (it must learn only from that trace).
        bins: Reliability bins.
        on_fold: Called with ``(done, total)`` after each fold.

    Each held-out call is predicted from the calls before it and their observations (given
    as digests; a predictor with ``add_observation_values`` is told the values of each
    observation of the held-out rollout once that observation has happened) and, for a
    predictor whose ``predict`` takes ``contexts``, the held-out rollout's conversation up
    to that call (the steps' :attr:`~bunshin_async.Step.context` up to and including its
    own: what had reached the policy when it began the call).
    """
    index = observation_index(trace)
    folds = loto_folds(trace)
    tallies = {name: dict(n=0, n1=0, n3=0, c1=0, c3=0, lat=[], conf=[]) for name in factories}
    for f, (held, train) in enumerate(folds):
        calls = [s.call for s in held.steps]
        digests = [s.observation_digest for s in held.steps]
        contexts = [s.context for s in held.steps]
        for name, factory in factories.items():
            sel = factory(train)
            add = getattr(sel, "add_observation_values", None)
            heard = accepts_contexts(sel)
            tl = tallies[name]
            for i, call in enumerate(calls):
                if add is not None and i and digests[i - 1] in index:
                    add({digests[i - 1]: index[digests[i - 1]]})
                t0 = time.perf_counter_ns()
                if heard:  # the conversation up to the moment the policy began this call
                    preds = sel.predict(held.task, calls[:i], 3, observations=digests[:i],
                                        contexts=contexts[: i + 1])
                else:
                    preds = sel.predict(held.task, calls[:i], 3, observations=digests[:i])
                tl["lat"].append((time.perf_counter_ns() - t0) / 1000)
                key = call_key(call)
                tl["n"] += 1
                names = list(dict.fromkeys(p.call.name for p in preds))
                tl["n1"] += bool(names) and names[0] == call.name
                tl["n3"] += call.name in names[:3]
                pkeys = [call_key(p.call) for p in preds]
                hit = bool(pkeys) and pkeys[0] == key
                tl["c1"] += hit
                tl["c3"] += key in pkeys[:3]
                tl["conf"].append((preds[0].confidence if preds else 0.0, hit))
        if on_fold is not None:
            on_fold(f + 1, len(folds))
    scores = []
    for name, tl in tallies.items():
        n = tl["n"] or 1
        rel = []
        ece = 0.0
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            inside = [(c, h) for c, h in tl["conf"] if lo <= c < hi or (b == bins - 1 and c >= hi)]
            if not inside:
                continue
            conf = sum(c for c, _ in inside) / len(inside)
            acc = sum(h for _, h in inside) / len(inside)
            ece += len(inside) / n * abs(acc - conf)
            rel.append(ReliabilityBin(lo, hi, len(inside), conf, acc))
        scores.append(SelectorScore(
            name=name, calls=tl["n"], top1_name=tl["n1"] / n, top3_name=tl["n3"] / n,
            top1_call=tl["c1"] / n, top3_call=tl["c3"] / n, ece=ece, reliability=rel,
            mean_confidence=sum(c for c, _ in tl["conf"]) / n,
            latency_p50_us=_percentile(tl["lat"], 0.5), latency_p99_us=_percentile(tl["lat"], 0.99),
        ))
    return scores
