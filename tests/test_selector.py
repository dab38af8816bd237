"""The blend Spec Tool Selector, its evaluation (leave-one-trial-out, no leakage), and the
benefit rule that decides when a prediction runs."""

from __future__ import annotations

import json
import pathlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from bunshin_async import (
    BlendSelector,
    ConfigError,
    ContextMessage,
    FrequencySelector,
    MemoryProfile,
    NameBigramSelector,
    Observation,
    Prediction,
    Rollout,
    SchedulerConfig,
    SpecToolSelector,
    Step,
    Task,
    ToolCall,
    Trace,
    evaluate_selectors,
    import_openai,
    loto_folds,
    observation_digest,
    observation_values,
)
from bunshin_async._cli import main
from bunshin_async._importers import OBSERVATION_VALUES_KEY, observation_index
from bunshin_async._selector import accepts_contexts
from sim import simulate

SAMPLE = pathlib.Path("/work/shared/traces/tau-bench-airline-sample.json")
needs_sample = pytest.mark.skipif(not SAMPLE.exists(), reason="the bundled tau-bench sample is not present")


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name, args)


A, B, C = call("f", x="a"), call("f", x="b"), call("g", x="c")


def test_blend_empty_predicts_nothing() -> None:
    sel = BlendSelector()
    assert sel.predict("t", []) == [] and sel.predict("t", [A], k=3) == []
    assert sel.trajectories() == 0 and sel.observed() == 0


def test_blend_learns_a_task_path() -> None:
    sel = BlendSelector()
    for _ in range(3):
        sel.observe("t", [A, B, C])
    (p,) = sel.predict("t", [])
    assert p.call == A and 0.5 < p.confidence <= 1.0
    preds = sel.predict("t", [A, B], k=3)
    assert preds[0].call == C
    assert all(0.0 <= q.confidence <= 1.0 for q in preds)
    assert [q.confidence for q in preds] == sorted((q.confidence for q in preds), reverse=True)


def test_blend_copies_an_id_from_an_observation() -> None:
    """An id a lookup returned is passed to the next call, in a task never seen before."""
    sel = BlendSelector()
    for user, rid in (("u_1", "AB12CD"), ("u_2", "EF34GH"), ("u_3", "JK56LM")):
        out = json.dumps({"user": user, "reservations": [rid, "ZZ00ZZ"]}).encode()
        obs = [Observation(observation_digest(out), len(out), out), None]
        sel.observe(f"task-{user}", [call("get_user", user_id=user), call("get_res", reservation_id=rid)],
                    observations=obs)
    out = json.dumps({"user": "u_9", "reservations": ["QQ77RR", "ZZ00ZZ"]}).encode()
    preds = sel.predict("task-new", [call("get_user", user_id="u_9")], k=1,
                        observations=[Observation(observation_digest(out), len(out), out)])
    assert preds[0].call == call("get_res", reservation_id="QQ77RR")
    # the same through a digest and the observation-values index
    sel.add_observation_values({"sha256:feed": observation_values(out)})
    preds = sel.predict("task-new", [call("get_user", user_id="u_9")], observations=["sha256:feed"])
    assert preds[0].call == call("get_res", reservation_id="QQ77RR")


def test_blend_copies_an_argument_from_an_earlier_call() -> None:
    sel = BlendSelector()
    for rid in ("r1x", "r2x", "r3x"):
        sel.observe(f"t-{rid}", [call("show", reservation_id=rid), call("cancel", reservation_id=rid)])
    (p,) = sel.predict("t-new", [call("show", reservation_id="r9x")])
    assert p.call == call("cancel", reservation_id="r9x")


def user(text: str) -> ContextMessage:
    return ContextMessage("user", text)


def agent(text: str) -> ContextMessage:
    return ContextMessage("assistant", text)


def test_blend_copies_an_id_the_user_typed() -> None:
    """An id the user typed is passed to the call, in a task never seen before; without
    the conversation the selector can only guess a value seen elsewhere."""
    sel = BlendSelector()
    for task, rid in (("a", "AB12CD"), ("b", "EF34GH"), ("c", "JK56LM")):
        sel.observe(task, [call("get_res", reservation_id=rid)],
                    contexts=[[agent("Which reservation? Mine is ZZ99ZZ."), user(f"It is {rid}, thanks.")]])
    said = [[agent("Which reservation?"), user("Please look at QQ77RR and XY12AB"), user("no, only QQ77RR")]]
    (p,) = sel.predict("new", [], contexts=said)
    assert p.call == call("get_res", reservation_id="QQ77RR")
    # the latest mention wins, and a value already used for the argument is skipped
    (p,) = sel.predict("new", [], contexts=[[user("QQ77RR, or rather XY12AB")]])
    assert p.call == call("get_res", reservation_id="XY12AB")
    (p,) = sel.predict("new", [call("get_res", reservation_id="XY12AB")],
                       contexts=[[user("QQ77RR, or rather XY12AB")], [user("Not that one.")]])
    assert p.call == call("get_res", reservation_id="QQ77RR")
    # without the conversation: a value from the training data, never QQ77RR
    (p,) = sel.predict("new", [])
    assert p.call.arguments["reservation_id"] in {"AB12CD", "EF34GH", "JK56LM"}


def test_blend_conversation_chooses_the_call() -> None:
    """Trials of a task that diverge on what the user asked for: the conversation since the
    user spoke picks the call; the call sequence alone cannot."""
    lookup, cancel, change = call("lookup", rid="R1"), call("cancel", rid="R1"), call("change", rid="R1", cabin="economy")
    sel = BlendSelector()
    for i in range(6):
        wants_cancel = i % 2 == 0
        second = cancel if wants_cancel else change
        ask = "Please cancel my trip, I am ill." if wants_cancel else "Please change my cabin to economy."
        sel.observe("t", [lookup, second],
                    contexts=[[user("Hi, my reservation is R1.")], [agent("Found it. What now?"), user(ask)]])
    history = [[user("Hi, my reservation is R1.")]]
    (p,) = sel.predict("t", [lookup], contexts=[*history, [agent("What now?"), user("I want to cancel it.")]])
    assert p.call == cancel and p.confidence > 0.5
    (p,) = sel.predict("t", [lookup], contexts=[*history, [user("Could you change the cabin to economy?")]])
    assert p.call == change and p.confidence > 0.5
    # unknown conversation: the two are a coin flip
    preds = sel.predict("t", [lookup], k=2)
    assert sorted(q.call.name for q in preds) == ["cancel", "change"] and all(q.confidence < 0.75 for q in preds)


def test_contexts_keyword_is_optional_for_selectors() -> None:
    class Old(SpecToolSelector):  # written before `contexts` existed
        def observe(self, task, calls, *, observations=None) -> None:
            pass

        def predict(self, task, calls, k=1, *, observations=None) -> list[Prediction]:
            return []

    class Any_(Old):
        def predict(self, task, calls, k=1, **context) -> list[Prediction]:
            return []

    assert not accepts_contexts(Old()) and accepts_contexts(Any_()) and accepts_contexts(BlendSelector())
    for s in (FrequencySelector(), NameBigramSelector()):  # the baselines take and ignore it
        s.observe("t", [A, B], contexts=[[user("x")], []])
        assert s.predict("t", [A], contexts=[[user("x")], []]) == s.predict("t", [A])


def test_blend_calibration_tracks_its_hit_rate() -> None:
    sel = BlendSelector(prior=1.0)
    rng = random.Random(1)
    for _ in range(40):  # the second call after A is a coin flip between B and C
        sel.observe("t", [A, rng.choice([B, C])])
    hits = sum(h for h, _ in sel.calibration())
    tries = sum(n for _, n in sel.calibration())
    assert tries > 0 and 0 < hits < tries
    (p,) = sel.predict("t", [A])
    assert 0.3 < p.confidence < 0.7


def test_baselines() -> None:
    f, nb = FrequencySelector(), NameBigramSelector()
    for s in (f, nb):
        s.observe("t", [A, B, A])
        s.observe("u", [A, C])
    assert f.predict("t", [])[0] == Prediction(A, 3 / 5)
    assert [p.call.name for p in nb.predict("t", [A], k=2)] == ["f", "g"]
    assert nb.predict("t", [C]) == []


# -- evaluation --------------------------------------------------------------------------------

def small_trace() -> Trace:
    mem = MemoryProfile(image_bytes=0, runtime_bytes=0, boot_time=0.0)

    def st(c: ToolCall) -> Step:
        return Step(think_time=1.0, call=c, exec_time=1.0, observation_digest=observation_digest(str(c)),
                    observation_size=1, dirtied_bytes=0)

    rollouts = [Rollout(epoch=0, task=t, group=0, sample=s, reward=0.0, steps=[st(c) for c in calls])
                for t, s, calls in (("t", 0, [A, B]), ("t", 1, [A, B]), ("t", 2, [A, C]), ("u", 0, [C, A]), ("u", 1, [C]))]
    return Trace(version=1, name="small", tasks=[Task(id="t", memory=mem), Task(id="u", memory=mem)], rollouts=rollouts)


class Recording(SpecToolSelector):
    """Records every trajectory it is fitted with (and predicts nothing)."""

    def __init__(self, log: list[set], trace: Trace) -> None:
        self.keys = {r.key for r in trace.rollouts}
        log.append(self.keys)

    def observe(self, task: str, calls: Sequence[ToolCall], *, observations=None) -> None:
        raise AssertionError("not used")

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *, observations=None) -> list[Prediction]:
        return []


def test_no_leakage_the_held_out_trial_is_never_trained_on() -> None:
    trace = small_trace()
    log: list[set] = []
    evaluate_selectors(trace, {"rec": lambda tr: Recording(log, tr)})
    assert len(log) == len(trace.rollouts)
    for held, keys in zip(trace.rollouts, log):
        assert held.key not in keys
        assert keys == {r.key for r in trace.rollouts} - {held.key}


class Listening(SpecToolSelector):
    """Records the conversation it is given when asked to predict."""

    def __init__(self, log: list, trace: Trace) -> None:
        self.log = log
        self.trained = {s.context for r in trace.rollouts for s in r.steps if s.context}

    def observe(self, task: str, calls: Sequence[ToolCall], *, observations=None, contexts=None) -> None:
        raise AssertionError("not used")

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *, observations=None,
                contexts=None) -> list[Prediction]:
        self.log.append((task, len(calls), tuple(contexts), self.trained))
        return []


def test_no_leakage_of_the_conversation() -> None:
    """Predicting call i of the held-out trial, a selector hears that trial's conversation up
    to call i (what had reached the policy when it began the call), never later, and its
    training trace holds no message of the held-out trial."""
    base = small_trace()
    rollouts = []
    for n, r in enumerate(base.rollouts):
        steps = [msgspec.structs.replace(s, context=(user(f"r{n} s{j}"),)) for j, s in enumerate(r.steps)]
        rollouts.append(msgspec.structs.replace(r, steps=steps))
    trace = msgspec.structs.replace(base, rollouts=rollouts)
    log: list = []
    evaluate_selectors(trace, {"listen": lambda tr: Listening(log, tr)})
    it = iter(log)
    for n, held in enumerate(trace.rollouts):
        for i in range(len(held.steps)):
            task, ncalls, heard, trained = next(it)
            assert (task, ncalls) == (held.task, i)
            assert heard == tuple(s.context for s in held.steps[: i + 1])
            assert not any(m.text.startswith(f"r{n} ") for ctx in trained for m in ctx)
            assert len(trained) == sum(len(r.steps) for r in trace.rollouts) - len(held.steps)
    assert next(it, None) is None


@needs_sample
def test_no_leakage_of_observation_values_on_the_sample() -> None:
    trace = import_openai(SAMPLE)
    full = observation_index(trace)
    for held, train in loto_folds(trace):
        assert held.key not in {r.key for r in train.rollouts}
        kept = set(observation_index(train))
        own = {s.observation_digest for r in train.rollouts for s in r.steps}
        assert kept <= own and kept == own & set(full)
        assert OBSERVATION_VALUES_KEY in train.meta


def test_evaluation_scores() -> None:
    scores = {s.name: s for s in evaluate_selectors(small_trace(), {
        "blend": lambda tr: BlendSelector().fit(tr),
        "freq": lambda tr: _fit(FrequencySelector(), tr),
    })}
    b = scores["blend"]
    assert b.calls == 9
    assert 0 <= b.top1_call <= b.top3_call <= 1 and b.top1_call <= b.top1_name
    assert sum(x.count for x in b.reliability) == 9
    assert 0 <= b.ece <= 1 and b.latency_p50_us <= b.latency_p99_us


def _fit(sel: SpecToolSelector, tr: Trace) -> SpecToolSelector:
    for r in tr.rollouts:
        sel.observe(r.task, [s.call for s in r.steps])
    return sel


@needs_sample
def test_blend_on_the_sample_beats_the_baselines_and_is_fast() -> None:
    trace = import_openai(SAMPLE)
    scores = {s.name: s for s in evaluate_selectors(trace, {
        "blend": lambda tr: BlendSelector().fit(tr),
        "name-bigram": lambda tr: _fit(NameBigramSelector(), tr),
    })}
    blend, bigram = scores["blend"], scores["name-bigram"]
    assert blend.top1_call > bigram.top1_call
    assert blend.top1_name >= bigram.top1_name
    assert blend.ece < 0.15
    assert 0 < blend.latency_p50_us <= blend.latency_p99_us  # measured; bench_selector.py checks the 1 ms target
    # the same without the steps' conversation: it helps (the README gives the figures)
    deaf = msgspec.structs.replace(trace, rollouts=[
        msgspec.structs.replace(r, steps=[msgspec.structs.replace(s, context=()) for s in r.steps])
        for r in trace.rollouts])
    (without,) = evaluate_selectors(deaf, {"blend": lambda tr: BlendSelector().fit(tr)})
    assert blend.top3_call > without.top3_call and blend.top1_call >= without.top1_call


@needs_sample
def test_cli_predict_eval(tmp_path: pathlib.Path, capsys) -> None:
    out = tmp_path / "tau.json"
    assert main(["trace", "import", "openai", str(SAMPLE), str(out)]) == 0
    assert main(["predict", "eval", str(out), "--predictors", "name-bigram,blend"]) == 0
    text = capsys.readouterr().out
    assert "name-bigram" in text and "blend" in text and "reliability" in text
    assert main(["predict", "eval", str(out), "--predictors", "oracle"]) == 2


# -- the benefit rule --------------------------------------------------------------------------

def spec_trace() -> Trace:
    mem = MemoryProfile(image_bytes=0, runtime_bytes=1 << 20, boot_time=0.0)

    def st(c: ToolCall) -> Step:
        return Step(think_time=2.0, call=c, exec_time=1.0, observation_digest=observation_digest(str(c)),
                    observation_size=1, dirtied_bytes=4096)

    rollouts = [Rollout(epoch=e, task="t", group=0, sample=0, reward=0.0, steps=[st(A), st(B)]) for e in (0, 1)]
    return Trace(version=1, name="spec", tasks=[Task(id="t", memory=mem)], rollouts=rollouts)


class Fixed(SpecToolSelector):
    """Always predicts the recorded next call with a fixed confidence."""

    def __init__(self, confidence: float) -> None:
        self.confidence = confidence

    def observe(self, task: str, calls: Sequence[ToolCall], *, observations=None) -> None:
        pass

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *, observations=None) -> list[Prediction]:
        return [Prediction(B if calls else A, self.confidence)] if len(calls) < 2 else []


@pytest.mark.parametrize(
    ("confidence", "rule", "over", "launched"),
    [
        (0.4, "confidence", {}, 4),  # above spec_min_confidence: runs
        (0.4, "benefit", {}, 0),  # 0.4 E < 0.6 E: expected waste beats the saving
        (0.9, "benefit", {}, 4),
        (0.9, "benefit", {"spec_fork_cost": 100.0}, 0),  # a fork dearer than any saving
        (0.4, "benefit", {"spec_waste_weight": 0.5}, 4),  # 0.4 E > 0.5 * 0.6 E
    ],
)
def test_benefit_rule(confidence: float, rule: str, over: dict, launched: int) -> None:
    r = simulate(spec_trace(), policy="spec", spec_tail=1.0, spec_rule=rule, selector=Fixed(confidence), **over)
    assert r.spec.launched == launched
    assert r.spec.misses == 0 and r.spec.hits == launched
    assert r.spec.wasted_exec_seconds == 0.0


def test_benefit_rule_uses_the_tools_observed_exec_time() -> None:
    # a tool never run before takes spec_exec_prior; a zero prior makes no saving worth a fork
    r = simulate(spec_trace(), policy="spec", spec_tail=1.0, spec_exec_prior=0.0, spec_fork_cost=0.01,
                 selector=Fixed(0.99))
    # epoch 0's first call has no estimate (prior 0: skipped); every later call has 1 s seen
    assert r.spec.launched == 3


@pytest.mark.parametrize("over", [{"spec_waste_weight": -1.0}, {"spec_exec_prior": -1.0}, {"spec_fork_cost": -0.5},
                                  {"spec_rule": "always"}])
def test_benefit_rule_options_are_checked(over: dict) -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig.preset("spec", **over)


class Overhearing(SpecToolSelector):
    """Records what the scheduler lets it hear (and predicts nothing)."""

    def __init__(self) -> None:
        self.predicted: list[tuple[str, int, tuple]] = []
        self.observed: list[tuple[str, int, tuple]] = []

    def observe(self, task: str, calls: Sequence[ToolCall], *, observations=None, contexts=None) -> None:
        self.observed.append((task, len(calls), tuple(contexts or ())))

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *, observations=None,
                contexts=None) -> list[Prediction]:
        self.predicted.append((task, len(calls), tuple(contexts or ())))
        return []


def test_the_scheduler_lets_the_selector_hear_the_conversation() -> None:
    """In a replay, the scheduler asks the policy what reached the model before each call
    (TracePolicy: the recorded Step.context) and passes it to the selector: when predicting
    call i, the conversation before calls 0..i; when the rollout ends, before each call."""
    base = small_trace()
    trace = msgspec.structs.replace(base, rollouts=[
        msgspec.structs.replace(r, steps=[msgspec.structs.replace(s, context=(user(f"{r.task}{r.sample} s{j}"),))
                                          for j, s in enumerate(r.steps)])
        for r in base.rollouts])
    sel = Overhearing()
    simulate(trace, policy="spec", spec_tail=1.0, selector=sel)
    recorded = {(r.task, r.sample): [s.context for s in r.steps] for r in trace.rollouts}
    assert sel.predicted and sel.observed
    for task, ncalls, heard in sel.predicted:  # after the last call, nothing more was said
        assert any(tuple(ctx[: ncalls + 1]) + ((),) * (ncalls + 1 - len(ctx)) == heard
                   for (t, _), ctx in recorded.items() if t == task), (task, ncalls, heard)
    want = [(t, len(ctx), tuple(ctx)) for (t, _), ctx in recorded.items()]
    assert len(sel.observed) == len(want) and all(o in want for o in sel.observed)
    # selectors written before the conversation existed are called as before
    calls: list[str] = []

    class Deaf(SpecToolSelector):
        def observe(self, task: str, calls_: Sequence[ToolCall], *, observations=None) -> None:
            calls.append("observe")

        def predict(self, task: str, calls_: Sequence[ToolCall], k: int = 1, *, observations=None) -> list[Prediction]:
            calls.append("predict")
            return []

    simulate(trace, policy="spec", spec_tail=1.0, selector=Deaf())
    assert "observe" in calls and "predict" in calls
