"""The Spec Tool Selector: predicts a sample's next tool call so it can run ahead.

:class:`SpecToolSelector` is the interface the scheduler uses. Two predictors learn from
trajectories that have already finished (earlier epochs of the same trace, and samples of the
run that completed before the prediction is made), so nothing they predict with was produced
after the moment of prediction:

- :class:`HistorySelector`, the first one: counts of what followed the same context, backing
  off from the whole prefix to bigrams;
- :class:`BlendSelector`: a blend of a conversation model (what followed similar
  conversation in the task), exact-prefix, task-bigram and a generative name model with
  argument filling (copying values from earlier calls, observations and the conversation),
  with a confidence calibrated on its own past predictions (see its docstring and
  ``docs/traces.md``).

Two baselines for evaluation are here too: :class:`FrequencySelector` (the most frequent
call) and :class:`NameBigramSelector` (the name that most often followed the last name).
"""

from __future__ import annotations

import abc
import functools
import heapq
import inspect
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from ._policy import Observation
from ._trace import ContextMessage, ToolCall, Trace, call_key

__all__ = [
    "BlendSelector",
    "FrequencySelector",
    "HistorySelector",
    "NameBigramSelector",
    "Prediction",
    "SpecToolSelector",
]

ObservationLike = Observation | str | None
"""What a selector is told about an observation: the :class:`Observation` itself, its digest,
or nothing."""

Conversation = Sequence[ContextMessage]
"""The conversation that reached the policy before one call (:attr:`~bunshin_async.Step.context`)."""


def accepts_contexts(selector: Any, method: str = "predict") -> bool:
    """Whether *selector*'s *method* (``predict`` or ``observe``) takes the ``contexts``
    keyword (selectors written before it existed do not, and are called without it)."""
    try:
        params = inspect.signature(getattr(selector, method)).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "contexts" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class Prediction(msgspec.Struct, frozen=True):
    """A predicted next call."""

    call: ToolCall
    """The call, with arguments."""
    confidence: float
    """Estimated probability that the policy's next call is exactly this one (0 to 1)."""


class SpecToolSelector(abc.ABC):
    """Predicts a sample's next call from its task and the calls it made so far."""

    @abc.abstractmethod
    def predict(
        self, task: str, calls: Sequence[ToolCall], k: int = 1, *,
        observations: Sequence[ObservationLike] | None = None,
        contexts: Sequence[Conversation] | None = None,
    ) -> list[Prediction]:
        """Return up to *k* predictions for the call after *calls*, most likely first.

        *observations*, when given, are what each of *calls* returned (an
        :class:`~bunshin_async.Observation`, a digest string, or None); a selector may copy
        values from them into the predicted arguments. *contexts*, when given, are the
        conversation before each call (:attr:`~bunshin_async.Step.context`): one entry per
        call in *calls* and, when present, one more for the call being predicted (what
        reached the policy since its last call). Callers that predate *contexts* omit it, and
        selectors that do not declare it are not given it.
        """

    @abc.abstractmethod
    def observe(
        self, task: str, calls: Sequence[ToolCall], *,
        observations: Sequence[ObservationLike] | None = None,
        contexts: Sequence[Conversation] | None = None,
    ) -> None:
        """Learn from a finished trajectory of *task* that made *calls* (and observed
        *observations*, and heard *contexts* before each call, when given)."""


class HistorySelector(SpecToolSelector):
    """Predicts by counting what followed the same context in finished trajectories.

    Contexts, tried in order: the task and the whole prefix; the task and the last call; the
    last call in any task. The first context seen at least ``min_support`` times answers;
    confidence is the share of that context's continuations that were the predicted call,
    multiplied by ``backoff`` for each context skipped.

    Args:
        min_support: Observations a context needs before it is used.
        backoff: Confidence discount per fallback level (0 to 1).
    """

    def __init__(self, *, min_support: int = 1, backoff: float = 0.5) -> None:
        self._min = max(1, min_support)
        self._backoff = backoff
        self._calls: dict[bytes, ToolCall] = {}
        self._prefix: dict[tuple, Counter[bytes]] = {}
        self._task_bigram: dict[tuple, Counter[bytes]] = {}
        self._bigram: dict[bytes | None, Counter[bytes]] = {}

    def fit(self, trace: Trace, *, before_epoch: int | None = None) -> HistorySelector:
        """Learn from every rollout of *trace* (only those of epochs before *before_epoch*
        when given) and return self."""
        for r in trace.rollouts:
            if before_epoch is None or r.epoch < before_epoch:
                self.observe(r.task, [s.call for s in r.steps])
        return self

    def observe(
        self, task: str, calls: Sequence[ToolCall], *,
        observations: Sequence[ObservationLike] | None = None,
        contexts: Sequence[Conversation] | None = None,
    ) -> None:
        prefix: tuple[bytes, ...] = ()
        last: bytes | None = None
        for call in calls:
            k = call_key(call)
            self._calls.setdefault(k, call)
            self._prefix.setdefault((task, prefix), Counter())[k] += 1
            self._task_bigram.setdefault((task, last), Counter())[k] += 1
            self._bigram.setdefault(last, Counter())[k] += 1
            prefix = prefix + (k,)
            last = k

    def predict(
        self, task: str, calls: Sequence[ToolCall], k: int = 1, *,
        observations: Sequence[ObservationLike] | None = None,
        contexts: Sequence[Conversation] | None = None,
    ) -> list[Prediction]:
        keys = tuple(call_key(c) for c in calls)
        last = keys[-1] if keys else None
        scale = 1.0
        for table, ctx in (
            (self._prefix, (task, keys)),
            (self._task_bigram, (task, last)),
            (self._bigram, last),
        ):
            counts = table.get(ctx)
            if counts is not None:
                n = sum(counts.values())
                if n >= self._min:
                    return [
                        Prediction(self._calls[key], scale * c / n) for key, c in counts.most_common(k)
                    ]
            scale *= self._backoff
        return []

    def observed(self) -> int:
        """How many distinct calls the selector has seen."""
        return len(self._calls)




# -- baselines ---------------------------------------------------------------------------------


class FrequencySelector(SpecToolSelector):
    """Baseline: always the most frequent calls seen (over all tasks); confidence is their
    share of all calls seen."""

    def __init__(self) -> None:
        self._calls: dict[bytes, ToolCall] = {}
        self._counts: Counter[bytes] = Counter()

    def observe(self, task: str, calls: Sequence[ToolCall], *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> None:
        for c in calls:
            k = call_key(c)
            self._calls.setdefault(k, c)
            self._counts[k] += 1

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> list[Prediction]:
        n = sum(self._counts.values())
        return [Prediction(self._calls[key], c / n) for key, c in self._counts.most_common(k)]


class NameBigramSelector(SpecToolSelector):
    """Baseline: the tool names that most often followed the last call's name (over all
    tasks; at the start, the most frequent first names), each with the arguments it was most
    often called with. Confidence is the name's share of that context."""

    def __init__(self) -> None:
        self._next: dict[str | None, Counter[str]] = {}
        self._args: dict[str, Counter[bytes]] = {}
        self._calls: dict[bytes, ToolCall] = {}

    def observe(self, task: str, calls: Sequence[ToolCall], *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> None:
        last: str | None = None
        for c in calls:
            key = call_key(c)
            self._calls.setdefault(key, c)
            self._next.setdefault(last, Counter())[c.name] += 1
            self._args.setdefault(c.name, Counter())[key] += 1
            last = c.name

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> list[Prediction]:
        counts = self._next.get(calls[-1].name if calls else None)
        if not counts:
            return []
        n = sum(counts.values())
        return [Prediction(self._calls[self._args[name].most_common(1)[0][0]], c / n)
                for name, c in counts.most_common(k)]


# -- the blend ---------------------------------------------------------------------------------

_START = "\x00start"
_WORD_RE = re.compile(r"[^\W_]+")  # a word: letters and digits


@functools.lru_cache(maxsize=1 << 16)
def _shape(value: str) -> str:
    """The shape of an id-like *value*: its length and its classes of characters (letters
    and digits by case, other characters as themselves), so ``JG7FMM`` and ``Z7GOZK`` share
    the shape ``6:9A`` and ``credit_card_4421486`` has ``19:9_a``."""
    classes = {"A" if ch.isupper() else "a" if ch.islower() else "9" if ch.isdigit() else ch for ch in value}
    return f"{len(value)}:{''.join(sorted(classes))}"


Said = tuple[str, tuple[str, ...]]
"""A message's role and the id-like values it contained."""
Talk = tuple[int, frozenset[str]]
"""The dialogue state before a call: the index of the latest call before which the user
spoke, and the words of the conversation from there on."""


class _Context:
    """What a prediction needs about a prefix, computed once per prediction."""

    __slots__ = ("calls", "keys", "last_value", "names", "obs_of", "said", "since", "task", "used", "words")

    def __init__(self, task: str, calls: Sequence[ToolCall], values: Sequence[tuple[str, ...]],
                 said: Sequence[Said] = (), talk: Talk | None = None) -> None:
        self.task = task
        self.calls = calls
        self.keys = [call_key(c) for c in calls]
        self.names = [c.name for c in calls]
        # the latest value of each argument name, and the latest observation values per tool
        self.last_value: dict[str, Any] = {}
        self.obs_of: dict[str, tuple[str, ...]] = {}
        self.used: dict[tuple[str, str], set[str]] = {}  # (tool, arg) -> string values used
        for i, c in enumerate(calls):
            for a, v in c.arguments.items():
                self.last_value[a] = v
                if isinstance(v, str):
                    self.used.setdefault((c.name, a), set()).add(v)
            if i < len(values) and values[i]:
                self.obs_of[c.name] = values[i]
        # the id-like values said in the conversation so far, per role, latest mention last
        self.said: dict[str, dict[str, None]] = {}
        for role, vals in said:
            by_role = self.said.setdefault(role, {})
            for v in vals:
                by_role.pop(v, None)
                by_role[v] = None
        # the dialogue state (see Talk); since -1 and no words before the user spoke
        self.since, self.words = talk if talk is not None else (-1, None)

    def rule_value(self, rule: tuple, name: str, arg: str) -> Any:
        """The value *rule* produces for argument *arg* of tool *name*, or ``_NONE``."""
        kind = rule[0]
        if kind == "same":
            return self.last_value.get(arg, _NONE)
        if kind == "obs" or kind == "said":
            _, source, shape = rule
            used = self.used.get((name, arg), ())
            vals = self.obs_of.get(source, ()) if kind == "obs" else reversed(self.said.get(source, {}))
            for v in vals:
                if v not in used and _shape(v) == shape:
                    return v
            return _NONE
        return _NONE


_NONE = object()


class BlendSelector(SpecToolSelector):
    """Predicts the next call by blending five models, with a calibrated confidence.

    Models, from the most to the least specific:

    1. conversation (when the steps' conversation is known): the calls of the same task
       that followed the same calls since the user last spoke, each counted by the cosine
       similarity of what was said since then with what has been said now (TF-IDF over
       words, binary term frequency, IDF over every such call learnt);
    2. exact prefix: the calls that followed the same task and the same whole prefix;
    3. task bigram: the calls that followed the same last call in the same task;
    4. generative: a tool name from a name model (same task and last name; then over all
       tasks: last two names, last name, no context), with arguments filled by the most
       reliable rule for each: copy the latest value of the same argument name from the
       prefix; copy the first unused value of the right shape from the latest observation
       of a given tool (an id returned by one call passed to the next); copy the
       latest-mentioned unused value of the right shape said by a given role in the
       conversation so far (a reservation id the user typed); or a constant (the value most
       often used for it in the task, then anywhere). A rule's reliability is its success
       rate in the trajectories seen, ``successes / (applications + 1)``.

    The models are interpolated with Witten-Bell weights (a context seen ``n`` times with
    ``u`` distinct continuations gets weight ``n / (n + u)``; the rest goes to the next
    model), which needs no tuned parameter; in the conversation model ``n`` is the sum of
    the similarities, so an identical conversation counts as one observation and an
    unrelated one as none. The blended probability is then calibrated on the selector's own
    past: before a trajectory is learnt, each of its calls is predicted and the outcome
    recorded in one of ``bins`` equal-width bins of the raw probability; the confidence is
    ``(hits + prior * raw) / (predictions + prior)`` of the raw probability's bin, so it
    starts at the raw probability and moves to the observed hit rate as evidence
    accumulates.

    Observation values (for the copy rule) come from :class:`Observation` outputs when the
    backend has them, otherwise from an index of digests to values (an importer stores one
    in the trace; :meth:`fit` reads it, or pass ``observation_values``). Conversation values
    are the id-like values of each message's text, as
    :func:`~bunshin_async.observation_values` finds them.

    Args:
        observation_values: Digest to values of observations (see
            :func:`~bunshin_async.observation_values`).
        bins: Calibration bins.
        prior: Weight, in predictions, of the raw probability in each bin.
        calibrate: Record predictions for calibration as trajectories are observed.
    """

    def __init__(
        self, *, observation_values: Mapping[str, Sequence[str]] | None = None,
        bins: int = 10, prior: float = 5.0, calibrate: bool = True,
    ) -> None:
        self._index: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (observation_values or {}).items()}
        self._bins = max(1, bins)
        self._prior = prior
        self._calibrate = calibrate
        self._hits = [0] * self._bins
        self._tries = [0] * self._bins
        self._calls: dict[bytes, ToolCall] = {}
        self._prefix: dict[tuple[str, int], Counter[bytes]] = {}
        self._tbigram: dict[tuple[str, bytes | None], Counter[bytes]] = {}
        self._name_task: dict[tuple[str, str], Counter[str]] = {}
        self._name_tri: dict[tuple[str, str], Counter[str]] = {}
        self._name_bi: dict[str, Counter[str]] = {}
        self._name_uni: Counter[str] = Counter()
        self._keysets: dict[str, Counter[tuple[str, ...]]] = {}
        # (tool, arg) -> rule -> [successes, applications]
        self._rules: dict[tuple[str, str], dict[tuple, list[int]]] = {}
        self._const_task: dict[tuple[str, str, str], Counter[bytes]] = {}
        self._const: dict[tuple[str, str], Counter[bytes]] = {}
        self._values: dict[bytes, Any] = {}
        self._trajectories = 0
        self._obs_cache: dict[str, tuple[str, ...]] = {}
        # the conversation model: every call learnt after the user spoke, as (words said
        # since, call key), filed under its task and the calls made since the user spoke
        self._docs: list[tuple[frozenset[str], bytes]] = []
        self._by_talk: dict[tuple[str, tuple[bytes, ...]], list[int]] = {}
        self._df: Counter[str] = Counter()  # in how many docs each word is
        self._idf2: dict[str, float] = {}  # each word's squared IDF
        self._norms: list[float] = []  # each doc's TF-IDF norm
        self._text_cache: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {}

    # -- learning ------------------------------------------------------------------------------

    def fit(self, trace: Trace, *, rollouts: Iterable[Any] | None = None,
            before_epoch: int | None = None) -> BlendSelector:
        """Learn from the rollouts of *trace* (or only *rollouts*, or only those of epochs
        before *before_epoch*), with the trace's observation-values index and the steps'
        conversation; return self."""
        from ._importers import observation_index

        self._index.update(observation_index(trace))
        for r in (trace.rollouts if rollouts is None else rollouts):
            if before_epoch is None or r.epoch < before_epoch:
                self.observe(r.task, [s.call for s in r.steps],
                             observations=[s.observation_digest for s in r.steps],
                             contexts=[s.context for s in r.steps])
        return self

    def add_observation_values(self, index: Mapping[str, Sequence[str]]) -> None:
        """Add digest-to-values entries to the observation index."""
        for k, v in index.items():
            self._index[k] = tuple(v)

    def trajectories(self) -> int:
        """How many trajectories the selector has learnt from."""
        return self._trajectories

    def observed(self) -> int:
        """How many distinct calls the selector has seen."""
        return len(self._calls)

    def _obs_values(self, observations: Sequence[ObservationLike] | None, n: int) -> list[tuple[str, ...]]:
        if not observations:
            return []
        from ._importers import observation_values

        out: list[tuple[str, ...]] = []
        for o in observations[:n]:
            if o is None:
                out.append(())
            elif isinstance(o, str):
                out.append(self._index.get(o, ()))
            elif o.output is not None:
                vals = self._obs_cache.get(o.digest)
                if vals is None:
                    if len(self._obs_cache) > 4096:
                        self._obs_cache.clear()
                    vals = self._obs_cache[o.digest] = observation_values(o.output)
                out.append(vals)
            else:
                out.append(self._index.get(o.digest, ()))
        return out

    def _text(self, text: str) -> tuple[tuple[str, ...], frozenset[str]]:
        """The id-like values and the words (lower case) of a message's *text*."""
        got = self._text_cache.get(text)
        if got is None:
            from ._importers import observation_values

            if len(self._text_cache) > 4096:
                self._text_cache.clear()
            got = self._text_cache[text] = (observation_values(text),
                                            frozenset(_WORD_RE.findall(text.lower())))
        return got

    def _said(self, contexts: Sequence[Conversation] | None, n: int) -> list[Said]:
        """Role and id-like values of each message in the first *n* of *contexts*."""
        out = []
        for conv in (contexts or ())[:n]:
            for m in conv:
                vals = self._text(m.text)[0]
                if vals:
                    out.append((m.role, vals))
        return out

    def _talk(self, contexts: Sequence[Conversation] | None, i: int) -> Talk | None:
        """The dialogue state before call *i* (see :data:`Talk`): None if the user has not
        spoken, or the conversation is not known."""
        if not contexts:
            return None
        last = min(i, len(contexts) - 1)
        u = last
        while u >= 0 and not any(m.role == "user" for m in contexts[u]):
            u -= 1
        if u < 0:
            return None
        words: set[str] = set()
        for conv in contexts[u: last + 1]:
            for m in conv:
                words |= self._text(m.text)[1]
        return u, frozenset(words)

    def _ctx(self, task: str, calls: Sequence[ToolCall], values: Sequence[tuple[str, ...]],
             contexts: Sequence[Conversation] | None) -> _Context:
        """The context for predicting the call after *calls* (the conversation up to it)."""
        n = len(calls)
        return _Context(task, calls, values, self._said(contexts, n + 1), self._talk(contexts, n))

    def observe(self, task: str, calls: Sequence[ToolCall], *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> None:
        values = self._obs_values(observations, len(calls))
        if self._calibrate and self._trajectories:
            for i, call in enumerate(calls):
                raw = self._raw(self._ctx(task, calls[:i], values[:i], contexts), 1)
                if raw:
                    b = min(self._bins - 1, int(raw[0][1] * self._bins))
                    self._tries[b] += 1
                    self._hits[b] += raw[0][0] == call_key(call)
        self._trajectories += 1
        h = 0
        last_key: bytes | None = None
        prev2, prev = _START, _START
        for i, call in enumerate(calls):
            key = call_key(call)
            self._calls.setdefault(key, call)
            self._prefix.setdefault((task, h), Counter())[key] += 1
            self._tbigram.setdefault((task, last_key), Counter())[key] += 1
            name = call.name
            self._name_task.setdefault((task, prev), Counter())[name] += 1
            self._name_tri.setdefault((prev2, prev), Counter())[name] += 1
            self._name_bi.setdefault(prev, Counter())[name] += 1
            self._name_uni[name] += 1
            self._keysets.setdefault(name, Counter())[tuple(sorted(call.arguments))] += 1
            ctx = self._ctx(task, calls[:i], values[:i], contexts)
            if ctx.words is not None:
                self._by_talk.setdefault((task, tuple(ctx.keys[ctx.since:])), []).append(len(self._docs))
                self._docs.append((ctx.words, key))
                self._df.update(ctx.words)
            for a, v in call.arguments.items():
                vk = msgspec.json.encode(v, order="sorted")
                self._values.setdefault(vk, v)
                self._const_task.setdefault((task, name, a), Counter())[vk] += 1
                self._const.setdefault((name, a), Counter())[vk] += 1
                rules = self._rules.setdefault((name, a), {})
                for rule, tally in rules.items():  # applications and successes of known rules
                    got = ctx.rule_value(rule, name, a)
                    if got is not _NONE:
                        tally[1] += 1
                        tally[0] += got == v
                for rule in self._new_rules(ctx, name, a, v):
                    if rule not in rules:
                        rules[rule] = [1, 1]
            h = hash((h, key))
            last_key = key
            prev2, prev = prev, name
        if self._docs:  # the word weights change with every conversation learnt
            n = len(self._docs)
            self._idf2 = idf2 = {w: math.log(n / c) ** 2 for w, c in self._df.items()}
            self._norms = [math.sqrt(sum(map(idf2.__getitem__, words))) for words, _ in self._docs]

    @staticmethod
    def _new_rules(ctx: _Context, name: str, arg: str, value: Any) -> list[tuple]:
        """Rules that would have produced *value* here and are not known yet."""
        found = []
        if ctx.last_value.get(arg, _NONE) == value:
            found.append(("same",))
        if isinstance(value, str):
            shape = _shape(value)
            for kind, sources in (("obs", ctx.obs_of), ("said", ctx.said)):
                for source, vals in sources.items():
                    if value in vals:
                        rule = (kind, source, shape)
                        if ctx.rule_value(rule, name, arg) == value:
                            found.append(rule)
        return found

    # -- predicting ----------------------------------------------------------------------------

    def predict(self, task: str, calls: Sequence[ToolCall], k: int = 1, *,
                observations: Sequence[ObservationLike] | None = None,
                contexts: Sequence[Conversation] | None = None) -> list[Prediction]:
        ctx = self._ctx(task, calls, self._obs_values(observations, len(calls)), contexts)
        out = []
        for key, p in self._raw(ctx, k):
            out.append(Prediction(self._call_of(key), self.calibrated(p)))
        return out

    def calibrated(self, raw: float) -> float:
        """The confidence for a raw blended probability (see the class docstring)."""
        b = min(self._bins - 1, int(raw * self._bins))
        return (self._hits[b] + self._prior * raw) / (self._tries[b] + self._prior)

    def calibration(self) -> list[tuple[int, int]]:
        """``(hits, predictions)`` per calibration bin."""
        return list(zip(self._hits, self._tries))

    def _call_of(self, key: bytes) -> ToolCall:
        call = self._calls.get(key)
        if call is None:
            name, args = msgspec.json.decode(key)
            call = ToolCall(name, args)
        return call

    def _raw(self, ctx: _Context, k: int) -> list[tuple[bytes, float]]:
        if not self._trajectories:
            return []
        task = ctx.task
        h = 0
        for key in ctx.keys:
            h = hash((h, key))
        levels: list[Mapping[bytes, float] | None] = [
            self._conversation(ctx),
            self._prefix.get((task, h)),
            self._tbigram.get((task, ctx.keys[-1] if ctx.keys else None)),
        ]
        weights: list[float] = []
        totals: list[float] = []
        rest = 1.0
        for counts in levels:
            n = sum(counts.values()) if counts else 0.0
            lam = n / (n + len(counts)) if counts else 0.0
            totals.append(n)
            weights.append(rest * lam)
            rest *= 1.0 - lam
        # candidates: the counted continuations and the generative model's best calls
        names = self._name_dist(ctx)
        gen = self._generate(ctx, names, max(k, 2) + 1)
        cands: dict[bytes, float] = {}
        for key in gen:
            cands[key] = 0.0
        for counts in levels:
            if counts:
                for key in heapq.nlargest(k + 2, counts, key=counts.__getitem__):
                    cands[key] = 0.0
        scored = []
        for key in cands:
            p = 0.0
            for counts, w, n in zip(levels, weights, totals):
                if counts and w:
                    p += w * counts.get(key, 0) / n
            if rest:
                g = gen.get(key)
                if g is None:
                    g = self._gen_prob(ctx, names, key)
                p += rest * g
            scored.append((p, key))
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [(key, min(1.0, p)) for p, key in scored[:k] if p > 0.0]

    def _conversation(self, ctx: _Context) -> dict[bytes, float] | None:
        """The conversation model's counts (see the class docstring): the calls of the task
        that followed the same calls since the user spoke, each counted by the cosine
        similarity of the words said since with the current ones; None if none is similar."""
        q = ctx.words
        docs = self._by_talk.get((ctx.task, tuple(ctx.keys[ctx.since:]))) if q else None
        if not docs:
            return None
        assert q is not None
        idf2, norms, all_docs = self._idf2, self._norms, self._docs
        qn = math.sqrt(sum(idf2.get(w, 0.0) for w in q))
        if not qn:
            return None
        weight = idf2.__getitem__
        counts: dict[bytes, float] = {}
        for d in docs:
            words, key = all_docs[d]
            dot = sum(map(weight, q & words))
            if dot > 0.0:
                counts[key] = counts.get(key, 0.0) + dot / (qn * norms[d])
        return counts or None

    def _name_dist(self, ctx: _Context) -> dict[str, float]:
        prev = ctx.names[-1] if ctx.names else _START
        prev2 = ctx.names[-2] if len(ctx.names) > 1 else _START
        dist: dict[str, float] = {}
        rest = 1.0
        for counts in (self._name_task.get((ctx.task, prev)), self._name_tri.get((prev2, prev)),
                       self._name_bi.get(prev), self._name_uni):
            if not counts:
                continue
            n = sum(counts.values())
            lam = n / (n + len(counts)) if counts is not self._name_uni else 1.0
            for name, c in counts.items():
                dist[name] = dist.get(name, 0.0) + rest * lam * c / n
            rest *= 1.0 - lam
        return dist

    def _arg_options(self, ctx: _Context, name: str, arg: str) -> list[tuple[float, bytes]]:
        """Candidate values of *arg* for *name*, ``(probability, encoded value)``, best first."""
        best: dict[bytes, float] = {}
        for rule, (succ, apps) in self._rules.get((name, arg), {}).items():
            got = ctx.rule_value(rule, name, arg)
            if got is _NONE:
                continue
            p = succ / (apps + 1)
            vk = msgspec.json.encode(got, order="sorted")
            if p > best.get(vk, 0.0):
                best[vk] = p
                self._values.setdefault(vk, got)
        for counts in (self._const_task.get((ctx.task, name, arg)), self._const.get((name, arg))):
            if counts:
                n = sum(counts.values())
                for vk, c in counts.most_common(2):
                    p = c / (n + 1)
                    if p > best.get(vk, 0.0):
                        best[vk] = p
                break  # the task's constants, else the global ones
        return sorted(((p, vk) for vk, p in best.items()), key=lambda x: (-x[0], x[1]))

    def _generate(self, ctx: _Context, names: dict[str, float], n: int) -> dict[bytes, float]:
        """The generative model's most likely calls, key to probability."""
        out: dict[bytes, float] = {}
        top = sorted(names.items(), key=lambda x: (-x[1], x[0]))[:n]
        for name, pn in top:
            keysets = self._keysets.get(name)
            if not keysets:
                continue
            total = sum(keysets.values())
            keyset, kc = keysets.most_common(1)[0]
            p = pn * kc / (total + 1)
            args: dict[str, Any] = {}
            alts: list[tuple[float, str, bytes]] = []
            for a in keyset:
                opts = self._arg_options(ctx, name, a)
                if not opts:
                    p = 0.0
                    break
                p *= opts[0][0]
                args[a] = self._values[opts[0][1]]
                if len(opts) > 1:
                    alts.append((opts[1][0] / opts[0][0], a, opts[1][1]))
            if p <= 0.0:
                continue
            out[call_key(ToolCall(name, args))] = p
            if alts:  # the runner-up value of the least certain argument
                ratio, a, vk = max(alts)
                alt = dict(args)
                alt[a] = self._values[vk]
                out.setdefault(call_key(ToolCall(name, alt)), p * ratio)
        return out

    def _gen_prob(self, ctx: _Context, names: dict[str, float], key: bytes) -> float:
        """The generative model's probability of the call *key*."""
        call = self._call_of(key)
        pn = names.get(call.name, 0.0)
        keysets = self._keysets.get(call.name)
        if not pn or not keysets:
            return 0.0
        p = pn * keysets.get(tuple(sorted(call.arguments)), 0) / (sum(keysets.values()) + 1)
        for a, v in call.arguments.items():
            if not p:
                break
            vk = msgspec.json.encode(v, order="sorted")
            p *= next((q for q, x in self._arg_options(ctx, call.name, a) if x == vk), 0.0)
        return p
