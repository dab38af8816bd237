"""Property-based testing for scheduling policies: strategies, invariants and a state machine.

A user who writes a cacheability, eviction or speculation policy, or a predictor (see
:mod:`bunshin_async._plugins`), checks it here before it touches a training run::

    bunshin check-policy mypkg.policies:CostAware

or from their own tests, with the strategies and the invariant checks::

    from hypothesis import given
    from bunshin_async.testing import PolicySet, check_transparency, configs, traces

    @given(trace=traces(), cfg=configs())
    def test_cost_aware_is_transparent(trace, cfg):
        check_transparency(trace, cfg, PolicySet(eviction=CostAware))

:mod:`bunshin_async.testing.examples` holds policies that are deliberately wrong, each caught by
one of the checks.
"""

from ._check import CHECKS, DEFAULT_EXAMPLES, ENGINES, CheckResult, check_policy
from ._invariants import (
    INVARIANTS,
    InvariantViolation,
    PolicySet,
    check_budgets,
    check_determinism,
    check_engine_order,
    check_finishes_once,
    check_transparency,
    run_policies,
)
from ._machine import policy_machine
from ._strategies import CLOCK_TOOL, TOOLS, cancellations, configs, policy_params, traces

__all__ = [
    "CHECKS",
    "CLOCK_TOOL",
    "DEFAULT_EXAMPLES",
    "ENGINES",
    "INVARIANTS",
    "TOOLS",
    "CheckResult",
    "InvariantViolation",
    "PolicySet",
    "cancellations",
    "check_budgets",
    "check_determinism",
    "check_engine_order",
    "check_finishes_once",
    "check_policy",
    "check_transparency",
    "configs",
    "policy_machine",
    "policy_params",
    "run_policies",
    "traces",
]
