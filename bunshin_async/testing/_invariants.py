"""The invariants every scheduling policy must keep, as reusable checks.

Each check runs the simulator (virtual time, so a run takes milliseconds) with the policies of a
:class:`PolicySet` in their slots and raises :class:`InvariantViolation` saying what broke. A
policy that breaks its own contract (:class:`~bunshin_async.PolicyError`) fails every check
that runs it. Use them from a hypothesis test::

    from hypothesis import given
    from bunshin_async.testing import PolicySet, check_transparency, configs, traces

    @given(trace=traces(), cfg=configs())
    def test_my_eviction_is_transparent(trace, cfg):
        check_transparency(trace, cfg, PolicySet(eviction=MyEviction))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from .._exceptions import BunshinError, PolicyError, exception_leaves
from .._plugins import CacheabilityPolicy, EvictionPolicy, SpeculationPolicy
from .._scheduler import RunResult, SchedulerConfig
from .._selector import SpecToolSelector
from .._trace import Trace

__all__ = [
    "PolicySet",
    "InvariantViolation",
    "INVARIANTS",
    "run_policies",
    "check_transparency",
    "check_budgets",
    "check_finishes_once",
    "check_determinism",
    "check_engine_order",
]

Factory = Callable[[], Any]


class InvariantViolation(AssertionError):
    """An invariant did not hold; the message says which and how."""


class PolicySet(msgspec.Struct, frozen=True):
    """The policies of a run, as factories (a class, or a function making a fresh policy);
    None keeps the built-in default of that slot."""

    cacheability: Callable[[], CacheabilityPolicy] | None = None
    eviction: Callable[[], EvictionPolicy] | None = None
    speculation: Callable[[], SpeculationPolicy] | None = None
    selector: Callable[[], SpecToolSelector] | None = None

    def make(self) -> dict[str, Any]:
        """Fresh instances, as keyword arguments of :func:`sim.build_simulation`."""
        out: dict[str, Any] = {}
        for name in ("cacheability", "eviction", "speculation", "selector"):
            f = getattr(self, name)
            if f is not None:
                out[name] = f()
        return out


def run_policies(
    trace: Trace,
    cfg: dict[str, Any],
    policies: PolicySet,
    *,
    engine: str = "bunshin",
    preset: str = "full",
    seed: int = 0,
    cancels: Sequence[tuple[float, int]] = (),
) -> tuple[RunResult, Any]:
    """Replay *trace* in the simulator with *policies* and the scheduler options *cfg* under
    *preset* (``full``: caching and speculation on); return the result and the
    :class:`sim.Simulation` (its backend and plan). Observations are compared by the checks,
    not by the replaying policy."""
    from sim import build_simulation, run_virtual

    sim = build_simulation(
        trace, engine=engine, config=SchedulerConfig.preset(preset, seed=seed, **cfg),
        check=False, seed=seed, cancels=cancels, **policies.make(),
    )
    return run_virtual(sim.run), sim


def _run(trace: Trace, cfg: dict[str, Any], policies: PolicySet, **kw: Any) -> tuple[RunResult, Any]:
    try:
        return run_policies(trace, cfg, policies, **kw)
    except (BunshinError, BaseExceptionGroup) as exc:
        leaves = exception_leaves(exc)
        for leaf in leaves:
            if isinstance(leaf, PolicyError):
                raise InvariantViolation(f"the policy broke its contract: {leaf}") from None
        for leaf in leaves:
            if isinstance(leaf, BunshinError):
                raise InvariantViolation(f"the run failed: {type(leaf).__name__}: {leaf}") from None
        if len(leaves) == 1 and leaves[0] is not exc and isinstance(leaves[0], Exception):
            raise leaves[0] from None  # a policy's own bug: its exception, not the group's
        raise


def _seen(r: RunResult) -> dict[Any, tuple[str, list[str], float | None]]:
    return {x.key: (x.status, x.observations, x.reward) for x in r.rollouts}


def check_transparency(trace: Trace, cfg: dict[str, Any], policies: PolicySet, *, engine: str = "bunshin", seed: int = 0) -> None:
    """Semantic transparency: with caching and speculation on, every sample sees exactly the
    observations, and earns exactly the reward, it does with both off (and as recorded)."""
    on, _ = _run(trace, cfg, policies, engine=engine, seed=seed)
    off, _ = _run(trace, cfg, PolicySet(), engine=engine, seed=seed, preset="base")
    recorded = {r.key: ([s.observation_digest for s in r.steps], r.reward) for r in trace.rollouts}
    a, b = _seen(on), _seen(off)
    for key, (status, obs, reward) in sorted(a.items()):
        want_obs, want_reward = recorded[key]
        if status != "done":
            raise InvariantViolation(f"rollout {key} ended {status!r} with caching and speculation on")
        for i, (got, want) in enumerate(zip(obs, want_obs)):
            if got != want:
                call = trace_call(trace, key, i)
                raise InvariantViolation(
                    f"rollout {key} step {i} ({call}): observed {got} with caching and speculation on, "
                    f"{b[key][1][i] if i < len(b[key][1]) else '-'} with both off, recorded {want}"
                )
        if len(obs) != len(want_obs) or reward != want_reward:
            raise InvariantViolation(
                f"rollout {key}: {len(obs)} observations and reward {reward} with caching and speculation on, "
                f"recorded {len(want_obs)} and {want_reward}"
            )


def trace_call(trace: Trace, key: Any, step: int) -> str:
    """A short text for the call of *key*'s step *step* in *trace*."""
    for r in trace.rollouts:
        if r.key == key and step < len(r.steps):
            c = r.steps[step].call
            return f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
    return "?"


def check_budgets(trace: Trace, cfg: dict[str, Any], policies: PolicySet, *, engine: str = "bunshin", seed: int = 0) -> None:
    """Budgets are never exceeded: the hot tier's charged bytes, the cold tier's stored bytes,
    and the speculative branches running at once; all released by the end."""
    r, _ = _run(trace, cfg, policies, engine=engine, seed=seed)
    config = r.config
    t = r.tree
    if t is not None:
        if t.hot_bytes_peak > config.hot_budget:
            raise InvariantViolation(f"the hot tier peaked at {t.hot_bytes_peak} bytes, over its budget of {config.hot_budget}")
        if t.cold_bytes_peak > config.cold_budget:
            raise InvariantViolation(f"the cold tier peaked at {t.cold_bytes_peak} bytes, over its budget of {config.cold_budget}")
        if t.hot_bytes or t.cold_bytes:
            raise InvariantViolation(f"the tree still holds {t.hot_bytes} hot and {t.cold_bytes} cold bytes after the run")
    if r.spec.peak_active > config.spec_budget:
        raise InvariantViolation(f"{r.spec.peak_active} speculative branches ran at once, over the budget of {config.spec_budget}")


def check_finishes_once(
    trace: Trace, cfg: dict[str, Any], policies: PolicySet, *, engine: str = "bunshin", seed: int = 0,
    cancels: Sequence[tuple[float, int]] = (),
) -> None:
    """Every rollout of the plan finishes exactly once (done, or cancelled if it was among
    *cancels*), every served call is accounted for, and nothing is left alive afterwards: no
    workspace, snapshot or delta, no memory."""
    r, sim = _run(trace, cfg, policies, engine=engine, seed=seed, cancels=cancels)
    backend = sim.backend
    keys = [x.key for x in trace.rollouts]
    got = [x.key for x in r.rollouts]
    if sorted(got) != sorted(keys):
        missing = sorted(set(keys) - set(got))
        extra = [k for k in set(got) if got.count(k) > 1]
        raise InvariantViolation(f"rollouts finished: missing {missing[:5]}, twice {extra[:5]}")
    plan = sim.plan_keys()
    cancelled = {plan[i % len(plan)] for _, i in cancels}
    for x in r.rollouts:
        if x.status == "cancelled" and x.key not in cancelled:
            raise InvariantViolation(f"rollout {x.key} was cancelled but nobody cancelled it")
        if x.status == "failed":
            raise InvariantViolation(f"rollout {x.key} failed: {x.error}")
        if x.status == "done" and x.reward is None:
            raise InvariantViolation(f"rollout {x.key} is done without a reward")
        sources = [s.source for s in x.steps]
        if sources.count("cache") != x.cache_hits or sources.count("speculation") != x.spec_hits:
            raise InvariantViolation(f"rollout {x.key}: served calls do not add up ({sources})")
    if backend.live_handles():
        raise InvariantViolation(f"{backend.live_handles()} workspace, snapshot or delta handle(s) left alive after the run")
    if backend.working_set():
        raise InvariantViolation(f"{backend.working_set()} bytes of workspace memory left after the run")


def check_determinism(trace: Trace, cfg: dict[str, Any], policies: PolicySet, *, engine: str = "bunshin", seed: int = 0) -> None:
    """The same trace, options and seed give byte-identical results."""
    a, _ = _run(trace, cfg, policies, engine=engine, seed=seed)
    b, _ = _run(trace, cfg, policies, engine=engine, seed=seed)
    ja, jb = msgspec.json.encode(a), msgspec.json.encode(b)
    if ja != jb:
        da, db = msgspec.to_builtins(a), msgspec.to_builtins(b)
        diff = [k for k in da if da[k] != db[k]]
        raise InvariantViolation(f"two runs with seed {seed} differ in {', '.join(diff)}")


def check_engine_order(trace: Trace, cfg: dict[str, Any], policies: PolicySet, *, seed: int = 0) -> None:
    """A sharing engine never peaks above a private-copy one: with the same policies, engine
    ``bunshin``'s peak memory is at most ``criu``'s.

    Checked with speculation on and prefix caching off (preset ``spec``), and meaningful for
    groups of two or more samples (a group of one shares nothing). With caching on the claim
    does not hold in general, and not because of a policy: the tree keeps a task's root between
    its groups, and what it keeps differs by engine. A frozen ``bunshin`` root still maps its
    task's image in the page cache, while a CRIU image holds only anonymous memory, so a task
    whose image outweighs its runtime memory costs more to keep under ``bunshin``
    (``check-policy`` found this on the built-in ``none`` cacheability policy).

    "At most" allows the page tables a frozen ``bunshin`` snapshot keeps (the engine model's
    ``page_table_bytes`` per 4 KiB mapped, 0.2%): when the samples rewrite all of their memory,
    sharing saves nothing and those tables are all ``bunshin`` adds.
    """
    from sim import engine_model

    b, _ = _run(trace, cfg, policies, engine="bunshin", seed=seed, preset="spec")
    c, _ = _run(trace, cfg, policies, engine="criu", seed=seed, preset="spec")
    slack = engine_model("bunshin").page_table_bytes / 4096
    if b.memory.peak_bytes > c.memory.peak_bytes * (1 + slack):
        raise InvariantViolation(
            f"engine bunshin peaked at {b.memory.peak_bytes} bytes, above criu's {c.memory.peak_bytes} "
            f"(by more than the {slack:.2%} its snapshots' page tables may add)"
        )


INVARIANTS: dict[str, Callable[..., None]] = {
    "transparency": check_transparency,
    "budgets": check_budgets,
    "finishes-once": check_finishes_once,
    "determinism": check_determinism,
    "engine-order": check_engine_order,
}
"""The invariant checks by name, in the order ``bunshin check-policy`` runs them."""
