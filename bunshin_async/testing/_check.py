"""``check_policy``: every invariant, and the state machine, against one user policy.

Each invariant is a hypothesis property over generated traces and configurations. On a failure
hypothesis shrinks the example; the shrunk trace is written as a trace file with the exact
``bunshin`` command that replays it.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from .._plugins import load_policy
from .._trace import Trace, dump_trace
from ._invariants import INVARIANTS, InvariantViolation, PolicySet
from ._machine import policy_machine
from ._strategies import cancellations, configs, traces

__all__ = ["CheckResult", "check_policy", "CHECKS", "ENGINES", "DEFAULT_EXAMPLES"]

ENGINES = ("bunshin", "criu", "microvm", "restart", "cold")
"""The simulated engines the invariants are checked on."""

DEFAULT_EXAMPLES = 100
"""Examples per check unless told otherwise."""

CHECKS = (*INVARIANTS, "state-machine")
"""What ``check_policy`` runs, in order."""

_OPTION = {
    "batch_tasks": "--batch-tasks", "mode": "--mode", "staleness": "--staleness",
    "hot_budget": "--hot-budget", "cold_budget": "--cold-budget", "spec_budget": "--spec-budget",
    "spec_tail": "--spec-tail", "spec_min_confidence": "--spec-min-confidence", "spec_rule": "--spec-rule",
}


class CheckResult(msgspec.Struct, frozen=True):
    """The outcome of one check."""

    check: str
    """The invariant's name (:data:`CHECKS`)."""
    passed: bool
    """True if no example broke it."""
    examples: int
    """Examples run (including shrinking)."""
    seconds: float
    """Wall time the check took."""
    error: str | None = None
    """What broke, for the shrunk example."""
    counterexample: str | None = None
    """The shrunk trace, written as a trace file."""
    replay: str | None = None
    """The command that replays the counterexample."""
    size: dict[str, int] | None = None
    """The shrunk trace's size: tasks, rollouts, steps (state machine: steps of the program)."""
    program: str | None = None
    """For the state machine: the shrunk sequence of operations, as hypothesis prints it."""


def _size(trace: Trace) -> dict[str, int]:
    return {"tasks": len(trace.tasks), "rollouts": len(trace.rollouts), "steps": sum(len(r.steps) for r in trace.rollouts)}


def _command(name: str, spec: str, kind: str, path: str, ex: dict[str, Any]) -> str:
    from .._scheduler import SchedulerConfig

    opts = [f"--{kind}", spec, "--seed", str(ex["seed"])]
    default = SchedulerConfig()
    for k, v in ex["cfg"].items():
        if k == "coalesce":
            opts += [] if v else ["--no-coalesce"]
        elif v != getattr(default, k):
            opts += [_OPTION[k], _bytes(v) if k.endswith("_budget") and k != "spec_budget" else str(v)]
    for t, i in ex.get("cancels", ()):
        opts += ["--cancel", f"{t:g}:{i}"]
    if name == "engine-order":
        cmd = ["bunshin", "compare", path, "--engines", "bunshin,criu", "--policies", "spec"]
    else:
        cmd = ["bunshin", "replay", path, "--engine", ex["engine"], "--policy", "full"]
        if name == "determinism":
            cmd += ["--json", "run.json"]
    return shlex.join(cmd + opts)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def check_policy(
    spec: str,
    *,
    kind: str | None = None,
    examples: int = DEFAULT_EXAMPLES,
    seed: int = 0,
    out_dir: str = "counterexamples",
    only: tuple[str, ...] = CHECKS,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> list[CheckResult]:
    """Run the checks of *only* against the policy *spec* (``module:attribute`` or a built-in
    name), *examples* examples each, reproducibly for *seed*.

    Counterexamples are written to *out_dir* (created when needed) as ``CHECK.json`` trace
    files. *on_progress* is called with ``(check, examples so far, examples)``.

    Raises:
        ConfigError: *spec* does not name a policy, or *only* names an unknown check.
    """
    from .._exceptions import ConfigError

    bad = [c for c in only if c not in CHECKS]
    if bad:
        raise ConfigError(f"unknown check(s) {', '.join(bad)}; expected some of {', '.join(CHECKS)}")
    if examples < 1:
        raise ConfigError(f"examples={examples} is invalid; expected at least 1")
    kind, factory = load_policy(spec, kind)
    policies = PolicySet(**{kind: factory})
    results = []
    for name in only:
        results.append(_run_check(name, spec, kind, policies, examples, seed, out_dir, on_progress))
    return results


def _settings(examples: int, **kw: Any) -> settings:
    return settings(
        max_examples=examples, database=None, deadline=None, print_blob=False,
        suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink), **kw,
    )


def _run_check(
    name: str, spec: str, kind: str, policies: PolicySet, examples: int, seed: int, out_dir: str,
    on_progress: Callable[[str, int, int], None] | None,
) -> CheckResult:
    count = 0
    last: dict[str, Any] = {}
    t0 = time.perf_counter()

    def tick() -> None:
        nonlocal count
        count += 1
        if on_progress is not None:
            on_progress(name, min(count, examples), examples)

    if name == "state-machine":
        def started(trace: Trace) -> None:
            tick()
            last["trace"] = trace

        machine = hypothesis_seed(seed)(policy_machine(policies, on_start=started))
        try:
            run_state_machine_as_test(machine, settings=_settings(examples, stateful_step_count=25))
        except Exception as exc:
            notes = "\n".join(getattr(exc, "__notes__", []))
            return CheckResult(
                check=name, passed=False, examples=count, seconds=time.perf_counter() - t0,
                error=_describe(exc), program=notes or None,
                size={"steps": _program_steps(notes)} if notes else None,
            )
        return CheckResult(check=name, passed=True, examples=count, seconds=time.perf_counter() - t0)

    fn = INVARIANTS[name]
    engines = st.just("bunshin") if name == "engine-order" else st.sampled_from(ENGINES)
    cancel = cancellations() if name == "finishes-once" else st.just([])

    def check(trace: Trace, ex: dict[str, Any]) -> None:
        """Run the invariant on *trace* with the example *ex*'s other draws."""
        kw: dict[str, Any] = {"seed": ex["seed"]}
        if name != "engine-order":
            kw["engine"] = ex["engine"]
        if name == "finishes-once":
            kw["cancels"] = ex["cancels"]
        fn(trace, ex["cfg"], policies, **kw)

    @hypothesis_seed(seed)
    @_settings(examples)
    @given(
        trace=traces(min_group=2 if name == "engine-order" else 1),
        cfg=configs(),
        engine=engines,
        cancels=cancel,
        run_seed=st.integers(0, 3),
    )
    def prop(trace: Trace, cfg: dict[str, Any], engine: str, cancels: list[tuple[float, int]], run_seed: int) -> None:
        tick()
        last.clear()
        last.update(trace=trace, cfg=cfg, engine=engine, cancels=cancels, seed=run_seed)
        check(trace, last)

    try:
        prop()
    except Exception as exc:
        trace, exc = _reduce(last["trace"], exc, lambda t: check(t, last))
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}.json")
        command = _command(name, spec, kind, path, last)
        meta = dict(trace.meta, check=name, error=_describe(exc), replay=command)
        dump_trace(msgspec.structs.replace(trace, name=f"counterexample: {name}", meta=meta), path)
        return CheckResult(
            check=name, passed=False, examples=count, seconds=time.perf_counter() - t0,
            error=_describe(exc), counterexample=path, replay=command, size=_size(trace),
        )
    return CheckResult(check=name, passed=True, examples=count, seconds=time.perf_counter() - t0)


def _reduce(trace: Trace, exc: Exception, check: Callable[[Trace], None]) -> tuple[Trace, Exception]:
    """Make the failing *trace* smaller while *check* still fails on it with an exception of
    *exc*'s type: drop whole tasks, then single rollouts, then rollouts' last steps (so every
    call keeps the calls before it), each while it keeps failing. Hypothesis's shrinking
    finds a small example, but which one depends on the path its search took; this pass makes
    the result minimal in those three ways whatever the path. Returns the trace and its
    failure."""

    def fails(t: Trace) -> Exception | None:
        try:
            check(t)
        except Exception as e:
            return e if type(e) is type(exc) else None
        return None

    def attempt(t: Trace) -> bool:
        nonlocal trace, exc
        if not t.rollouts:
            return False
        e = fails(t)
        if e is None:
            return False
        trace, exc = t, e
        return True

    for task in list(trace.tasks):
        attempt(msgspec.structs.replace(
            trace, tasks=[x for x in trace.tasks if x.id != task.id],
            rollouts=[r for r in trace.rollouts if r.task != task.id]))
    i = 0
    while i < len(trace.rollouts):
        if not attempt(msgspec.structs.replace(trace, rollouts=trace.rollouts[:i] + trace.rollouts[i + 1:])):
            i += 1
    for i in range(len(trace.rollouts)):
        while len(trace.rollouts[i].steps) > 1:
            r = trace.rollouts[i]
            cut = msgspec.structs.replace(r, steps=r.steps[:-1])
            if not attempt(msgspec.structs.replace(trace, rollouts=[*trace.rollouts[:i], cut, *trace.rollouts[i + 1:]])):
                break
    return trace, exc


def _program_steps(program: str) -> int:
    """Operations in a printed state-machine program (set-up and rules, not invariant checks)."""
    return sum(
        1 for line in program.splitlines()
        if line.startswith("state.") and not line.startswith("state.tree_is_consistent")
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, InvariantViolation):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
