"""Scheduling policies: the plug-in API for what to cache, what to evict and when to speculate.

Four decisions of the scheduler core are made by objects a user can replace:

- :class:`CacheabilityPolicy`: which calls may be served from the prefix tree (and run
  speculatively). A wrong answer changes what the agent observes.
- :class:`EvictionPolicy`: which snapshots leave the hot tier (to the cold tier) and which
  deltas leave the cold tier (to evicted) when a budget is short.
- :class:`SpeculationPolicy`: whether to run one of the predicted next calls in a fork while the
  model thinks, and which.
- the predictor, a :class:`~bunshin_async.SpecToolSelector`.

The built-in policies implement the same interfaces (:class:`LRUEviction`,
:class:`RecordedCacheability`, :class:`CacheableTools`, :class:`TailBenefitSpeculation`). Each
interface has a contract the core checks as it uses the answer; a broken promise is a
:class:`~bunshin_async.PolicyError` naming the policy and what it did, never silent damage.
``bunshin check-policy`` (:mod:`bunshin_async.testing`) tests a policy against every invariant
before it touches a training run.

On the command line a policy is named as ``module:attribute`` (``mypkg.policies:CostAware``)
or by a built-in name (:data:`BUILTIN_POLICIES`); the attribute is a class or a function that
returns a fresh policy when called without arguments, so every run gets its own state.
"""

from __future__ import annotations

import abc
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ._exceptions import ConfigError
from ._trace import RolloutKey, Task, ToolCall, Trace, call_key

if TYPE_CHECKING:
    from ._policy import Observation
    from ._scheduler import SchedulerConfig
    from ._selector import Prediction

__all__ = [
    "CacheabilityPolicy",
    "EvictionPolicy",
    "SpeculationPolicy",
    "SnapshotInfo",
    "SpecContext",
    "LRUEviction",
    "RecordedCacheability",
    "CacheableTools",
    "TailBenefitSpeculation",
    "POLICY_KINDS",
    "BUILTIN_POLICIES",
    "load_policy",
    "policy_kind",
    "policy_name",
    "predict_checked",
]


def policy_name(policy: object) -> str:
    """How errors and reports name *policy*: its class's ``module:qualname``."""
    cls = type(policy)
    return f"{cls.__module__}:{cls.__qualname__}"


# -- cacheability ------------------------------------------------------------------------------


class CacheabilityPolicy(abc.ABC):
    """Says which calls may be served from the prefix tree or run ahead speculatively.

    Only a call whose observation depends on nothing but the workspace state before it (not the
    clock, the network, randomness) may be cacheable: a cached observation is shown to every
    later sample that makes the same calls.
    """

    def fit(self, trace: Trace) -> None:  # noqa: B027 (optional hook)
        """Learn from a recorded trace before it is replayed. The default does nothing; live
        runs have no trace and never call it."""

    @abc.abstractmethod
    def cacheable(self, task: Task, call: ToolCall) -> bool:
        """True if *call*, made in a workspace of *task*, may be cached."""


class RecordedCacheability(CacheabilityPolicy):
    """The marks of the recorded trace (the default for replays): a call is cacheable when
    every recorded occurrence of it is marked cacheable; a call the trace never made is
    cacheable when its tool was recorded and every recorded call of that tool was. Before
    :meth:`fit` nothing is cacheable.

    Args:
        trace: Fit to this trace at once (same as calling :meth:`fit`).
    """

    def __init__(self, trace: Trace | None = None) -> None:
        self._by_call: dict[bytes, bool] = {}
        self._by_tool: dict[str, bool] = {}
        if trace is not None:
            self.fit(trace)

    def fit(self, trace: Trace) -> None:
        by_call: dict[bytes, bool] = {}
        by_tool: dict[str, bool] = {}
        for r in trace.rollouts:
            for s in r.steps:
                k = call_key(s.call)
                by_call[k] = by_call.get(k, True) and s.cacheable
                by_tool[s.call.name] = by_tool.get(s.call.name, True) and s.cacheable
        self._by_call, self._by_tool = by_call, by_tool

    def cacheable(self, task: Task, call: ToolCall) -> bool:
        v = self._by_call.get(call_key(call))
        return v if v is not None else self._by_tool.get(call.name, False)


class CacheableTools(CacheabilityPolicy):
    """Calls of the named tools are cacheable, all others not (a live workspace spec's
    ``cacheable`` marks, for example). With no names nothing is cacheable."""

    def __init__(self, tools: Iterable[str] = ()) -> None:
        self.tools = frozenset(tools)

    def cacheable(self, task: Task, call: ToolCall) -> bool:
        return call.name in self.tools


# -- eviction ----------------------------------------------------------------------------------


class SnapshotInfo(msgspec.Struct, frozen=True):
    """What an eviction policy sees of one prefix-tree node holding state in a tier."""

    id: int
    """Unique among the run's nodes; stable while the node lives."""
    task: str
    """The task whose tree holds it."""
    depth: int
    """Calls from the task's root (0 is the root, the initialised workspace)."""
    call: ToolCall | None
    """The call that made this state (None for a root)."""
    tier: Literal["hot", "cold"]
    """Where its state is: a snapshot in memory, or a delta out of memory."""
    bytes: int
    """What it holds in its tier: the hot charge, or the cold delta's stored bytes."""
    hits: int
    """Times a sample was served from it."""
    last_used: int
    """Logical time it (or a descendant) was last used; larger is more recent."""
    created: int
    """Logical time it was made."""
    in_use: bool
    """Pinned: a running group forks from it, or a fork from it is in progress."""
    children_here: int
    """Its children whose state is in this tier or a hotter one."""
    evictable: bool
    """May be chosen: not in use and no child in this tier or a hotter one (tiers never
    get hotter down the tree, so only such leaves of the tier may leave it)."""


class EvictionPolicy(abc.ABC):
    """Chooses which snapshots leave a tier when its budget is short.

    Contract (checked): every snapshot returned is one of *snapshots* and has ``evictable``
    set, and none is returned twice. The tree takes the victims in the order given until the
    room is made; returning fewer (or none) is allowed: the new state is then not admitted to
    the tier (a hot node is stored evicted; a delta that does not fit is dropped).
    """

    @abc.abstractmethod
    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        """Return the victims among *snapshots* (every node of one tier, see
        :class:`SnapshotInfo`), in the order to evict them, to free *need* bytes."""


class LRUEviction(EvictionPolicy):
    """Least recently used evictable leaves first (the default)."""

    def victims(self, snapshots: Sequence[SnapshotInfo], need: int) -> Iterable[SnapshotInfo]:
        return sorted((s for s in snapshots if s.evictable), key=lambda s: (s.last_used, s.id))


# -- speculation -------------------------------------------------------------------------------


class SpecContext:
    """What a speculation policy knows when a sample's model starts thinking.

    Attributes:
        rollout: The sample.
        task: Its task.
        calls: The calls it made so far.
        observations: What each returned.
        predictions: The predictor's guesses for the next call, most likely first; only those
            the cacheability policy allows and the prefix tree does not answer already. The
            predictor runs when this is first read, so a policy that declines for other
            reasons first costs no prediction.
        step_size: Rollouts in the sample's training step.
        unfinished: Of those, the ones still running (this one included).
        active: Speculative branches running now, over all samples.
        budget: The most branches that may run at once (``config.spec_budget``).
        config: The run's :class:`~bunshin_async.SchedulerConfig` (its ``spec_*`` fields are
            the built-in policy's parameters; a user policy may read or ignore them).
    """

    __slots__ = ("rollout", "task", "calls", "observations", "step_size", "unfinished",
                 "active", "budget", "config", "_exec", "_fork", "_predict", "_predictions")

    def __init__(
        self,
        *,
        rollout: RolloutKey,
        task: Task,
        calls: Sequence[ToolCall],
        observations: Sequence[Observation],
        predict: Callable[[], Sequence[Prediction]],
        step_size: int,
        unfinished: int,
        active: int,
        budget: int,
        config: SchedulerConfig,
        exec_seen: Mapping[str, Sequence[float]],
        fork_seen: Sequence[float],
    ) -> None:
        self.rollout = rollout
        self.task = task
        self.calls = calls
        self.observations = observations
        self._predict = predict
        self._predictions: Sequence[Prediction] | None = None
        self.step_size = step_size
        self.unfinished = unfinished
        self.active = active
        self.budget = budget
        self.config = config
        self._exec = exec_seen
        self._fork = fork_seen

    @property
    def predictions(self) -> Sequence[Prediction]:
        """See the class docstring."""
        if self._predictions is None:
            self._predictions = tuple(self._predict())
        return self._predictions

    def offered(self, prediction: object) -> bool:
        """True if *prediction* is one of :attr:`predictions` (and they were read)."""
        return self._predictions is not None and any(prediction is p for p in self._predictions)

    def check_choice(self, policy: SpeculationPolicy, choice: Prediction) -> Prediction:
        """Return *choice* if it keeps the contract of :class:`SpeculationPolicy` (one of
        :attr:`predictions`, and a branch free within the budget); else raise
        :class:`~bunshin_async.PolicyError` naming *policy* and what it did."""
        from ._exceptions import PolicyError

        where = f"{self.rollout} step {len(self.calls)}"
        if not self.offered(choice):
            raise PolicyError(
                f"speculation policy {policy_name(policy)} chose {choice!r}, which is not one of "
                f"the prediction(s) it was offered for {where}"
            )
        if self.active >= self.budget:
            raise PolicyError(
                f"speculation policy {policy_name(policy)} started a branch for {where} while "
                f"{self.active} ran, over its budget of {self.budget}"
            )
        return choice

    def expected_exec(self, tool: str, prior: float) -> float:
        """Mean execution time of *tool* in this run so far; of all tools if it has not run;
        *prior* before any call has run."""
        seen = self._exec.get(tool)
        if seen and seen[1]:
            return seen[0] / seen[1]
        total = sum(v[0] for v in self._exec.values())
        n = sum(v[1] for v in self._exec.values())
        return total / n if n else prior

    @property
    def fork_mean(self) -> float | None:
        """Mean seconds a speculative fork has taken in this run; None before the first."""
        return self._fork[0] / self._fork[1] if self._fork[1] else None


def predict_checked(
    selector: Any, task: str, calls: Sequence[ToolCall], k: int, observations: Sequence[Observation],
    contexts: Sequence[Sequence[Any]] | None = None,
) -> list[Prediction]:
    """*selector*'s up to *k* predictions after *calls*, checked against its contract (a list
    of at most *k* :class:`~bunshin_async.Prediction`, confidences from 0 to 1). *contexts*
    (the conversation before each call and before the one predicted) reach selectors whose
    ``predict`` takes them, and only when one is not empty."""
    from ._exceptions import PolicyError
    from ._selector import Prediction, accepts_contexts

    if contexts is not None and any(contexts) and accepts_contexts(selector):
        preds = selector.predict(task, calls, k, observations=observations, contexts=contexts)
    else:
        preds = selector.predict(task, calls, k, observations=observations)
    if (
        not isinstance(preds, list)
        or len(preds) > k
        or any(not isinstance(p, Prediction) or not 0.0 <= p.confidence <= 1.0 for p in preds)
    ):
        raise PolicyError(
            f"selector {policy_name(selector)} answered {preds!r} when asked for a list of up to {k} "
            "Prediction(s) with confidences between 0 and 1"
        )
    return preds


class SpeculationPolicy(abc.ABC):
    """Decides, each time a sample's model starts thinking, whether to run a predicted call
    ahead in a fork, and which.

    Contract (checked): the answer is None or one of ``ctx.predictions``, and a branch is
    started only while ``ctx.active < ctx.budget``.
    """

    top_k: int = 1
    """How many predictions to ask the predictor for."""

    @abc.abstractmethod
    def choose(self, ctx: SpecContext) -> Prediction | None:
        """The prediction to run now, or None."""


class TailBenefitSpeculation(SpeculationPolicy):
    """The default: speculate for the tail of a step, on a confident, worthwhile guess.

    Reads its parameters from ``ctx.config``: only when at most ``spec_tail`` of the step's
    rollouts still run (the tail that decides when the step ends), a branch slot is free, and
    the top prediction is at least ``spec_min_confidence`` confident; with ``spec_rule``
    ``"benefit"`` also only when its expected saving beats its cost,
    ``c * E > spec_waste_weight * (1 - c) * E + F`` (see
    :class:`~bunshin_async.SchedulerConfig`).
    """

    def choose(self, ctx: SpecContext) -> Prediction | None:
        cfg = ctx.config
        if ctx.active >= ctx.budget:
            return None
        if ctx.unfinished > int(cfg.spec_tail * ctx.step_size + 1e-9):
            return None
        if not ctx.predictions:
            return None
        top = ctx.predictions[0]
        if top.confidence < cfg.spec_min_confidence:
            return None
        if cfg.spec_rule == "benefit":
            e = ctx.expected_exec(top.call.name, cfg.spec_exec_prior)
            fork = cfg.spec_fork_cost if cfg.spec_fork_cost is not None else (ctx.fork_mean or 0.0)
            c = top.confidence
            if not c * e > cfg.spec_waste_weight * (1.0 - c) * e + fork:
                return None
        return top


# -- naming policies ---------------------------------------------------------------------------


def _selector_base() -> type:
    from ._selector import SpecToolSelector

    return SpecToolSelector


POLICY_KINDS = ("cacheability", "eviction", "speculation", "selector")
"""The four kinds of pluggable policy, as the command line names them."""


def _builtins() -> dict[str, dict[str, Callable[[], Any]]]:
    from ._selector import BlendSelector, FrequencySelector, HistorySelector, NameBigramSelector

    return {
        "cacheability": {"recorded": RecordedCacheability, "none": CacheableTools},
        "eviction": {"lru": LRUEviction},
        "speculation": {"tail-benefit": TailBenefitSpeculation},
        "selector": {
            "history": HistorySelector,
            "blend": BlendSelector,
            "frequency": FrequencySelector,
            "bigram": NameBigramSelector,
        },
    }


class _Builtins(Mapping[str, Mapping[str, Callable[[], Any]]]):
    """Read-only view of the built-in policies by kind and name (built on first use)."""

    def __init__(self) -> None:
        self._table: dict[str, dict[str, Callable[[], Any]]] | None = None

    def _t(self) -> dict[str, dict[str, Callable[[], Any]]]:
        if self._table is None:
            self._table = _builtins()
        return self._table

    def __getitem__(self, kind: str) -> Mapping[str, Callable[[], Any]]:
        return self._t()[kind]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._t())

    def __len__(self) -> int:
        return len(self._t())


BUILTIN_POLICIES: Mapping[str, Mapping[str, Callable[[], Any]]] = _Builtins()
"""Built-in policies by kind (:data:`POLICY_KINDS`) and name, e.g.
``BUILTIN_POLICIES["eviction"]["lru"]``; each value makes a fresh policy when called."""


def _bases() -> dict[str, type]:
    return {
        "cacheability": CacheabilityPolicy,
        "eviction": EvictionPolicy,
        "speculation": SpeculationPolicy,
        "selector": _selector_base(),
    }


def policy_kind(obj: object) -> str | None:
    """The kind of policy *obj* is (a class, or an instance), or None if it is none."""
    for kind, base in _bases().items():
        if (isinstance(obj, type) and issubclass(obj, base)) or isinstance(obj, base):
            return kind
    return None


def load_policy(spec: str, kind: str | None = None) -> tuple[str, Callable[[], Any]]:
    """Resolve *spec* to ``(kind, factory)``: a built-in name of *kind*, or
    ``module:attribute`` naming a policy class or a function that returns a fresh policy.

    The current directory is searched for the module first (as ``python -m`` does), so a
    policy in a file next to the user's traces loads without installing it.

    Raises:
        ConfigError: The module cannot be imported, has no such attribute, or the attribute
            is not a policy (of *kind*, when given).
    """
    if kind is not None and kind not in POLICY_KINDS:
        raise ConfigError(f"unknown policy kind {kind!r}; expected one of {', '.join(POLICY_KINDS)}")
    if ":" not in spec:
        kinds = [kind] if kind is not None else list(POLICY_KINDS)
        for k in kinds:
            if spec in BUILTIN_POLICIES[k]:
                return k, BUILTIN_POLICIES[k][spec]
        names = ", ".join(n for k in kinds for n in BUILTIN_POLICIES[k])
        raise ConfigError(
            f"policy {spec!r} is neither a built-in {kind or 'policy'} ({names}) nor "
            "module:attribute (for example mypkg.policies:CostAware)"
        )
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"policy {spec!r}: expected module:attribute, for example mypkg.policies:CostAware")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise ConfigError(
            f"policy {spec!r}: cannot import module {module!r} ({type(exc).__name__}: {exc}); "
            "install its package or run from the directory that holds it"
        ) from None
    finally:
        if added:
            sys.path.remove(cwd)
    obj: Any = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"policy {spec!r}: module {module!r} has no attribute {attr!r}") from None
    return _factory(spec, obj, kind)


def _factory(spec: str, obj: Any, kind: str | None) -> tuple[str, Callable[[], Any]]:
    got = policy_kind(obj)
    if got is not None and not isinstance(obj, type):
        raise ConfigError(
            f"policy {spec!r} is an instance; name its class, or a function returning a fresh "
            "instance, so that every run starts with fresh state"
        )
    if got is None:
        if isinstance(obj, type) or not callable(obj):
            raise ConfigError(
                f"policy {spec!r} is {type(obj).__name__} {obj!r}, not a policy class; expected a "
                f"subclass of one of {', '.join(b.__name__ for b in _bases().values())}"
            )
        # a factory function: call it once to learn what it makes
        try:
            sample = obj()
        except Exception as exc:
            raise ConfigError(f"policy {spec!r}: calling it without arguments failed: {type(exc).__name__}: {exc}") from None
        got = policy_kind(sample)
        if got is None or isinstance(sample, type):
            raise ConfigError(f"policy {spec!r} returned {type(sample).__name__}, not a policy instance")
    if kind is not None and got != kind:
        raise ConfigError(f"policy {spec!r} is a {got} policy, not a {kind} policy")
    return got, obj
