"""The exceptions of :mod:`bunshin_async`, one flat list.

Foreign errors (msgspec's decode errors, ``OSError`` from the file system) are translated
into these at the boundary, with the file and field named.
"""

from __future__ import annotations

__all__ = [
    "BunshinError",
    "TraceError",
    "ConfigError",
    "BackendError",
    "WorkspaceReleasedError",
    "TransparencyError",
    "VMError",
    "ModelError",
    "PolicyError",
    "NotFoundError",
    "StateConflictError",
    "CapacityError",
]


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside *exc*, exception groups flattened (*exc* itself if it is none)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in exception_leaves(e)]
    return [exc]


class BunshinError(Exception):
    """Base class of every error Bunshin raises on purpose."""


class TraceError(BunshinError):
    """Raised when a trace file cannot be read or is not a valid trace.

    The message names the file, the path to the bad field (``$.rollouts[3].steps[0].call``)
    and what was expected there. A truncated file or one with an unknown version is this
    error, never a partial load.
    """


class ConfigError(BunshinError):
    """Raised when a run is configured with values that cannot work together.

    For example a batch size of zero, a group size larger than the trace provides, or a
    speculation budget below zero. The message names the option and the accepted range.
    """


class BackendError(BunshinError):
    """Raised when a backend cannot carry out an operation on a workspace.

    Backends translate their own failures (a failed fork, a tool that could not be started)
    into this error so the scheduler can release what the failing sample holds.
    """


class WorkspaceReleasedError(BackendError):
    """Raised when an operation names a workspace or snapshot that was already released."""


class TransparencyError(BunshinError):
    """Raised when a sample is shown an observation that differs from the one it would see
    with caching and speculation off.

    A :class:`~bunshin_async.TracePolicy` raises it when a replayed step's observation does
    not match the recorded one: that means a tool marked cacheable is not deterministic.
    """


class VMError(BunshinError):
    """Raised when the lab VM cannot be prepared or run.

    For example: qemu, busybox-static or apt are missing, a kernel version apt does not know,
    the module does not build, the guest fails to mount its root, or the run times out. The
    message says which step failed and, for a failed boot, ends with the guest console's tail.
    """


class ModelError(BunshinError):
    """Raised when the model a policy calls cannot produce a usable next step.

    For example: the endpoint timed out or refused the request after every retry, or it
    answered with something that is not a chat completion, a tool call naming no known tool,
    or arguments that are not a JSON object. The scheduler fails only the rollout whose
    policy raised it; the rest of the batch goes on.
    """


class PolicyError(BunshinError):
    """Raised when a scheduling policy breaks its contract.

    For example an eviction policy choosing a snapshot that is still in use, a speculation
    policy starting a branch beyond its budget or guessing a call it was not offered, or a
    predictor giving a confidence outside 0 to 1. The message names the policy (its
    ``module:class``) and what it did. It stops the run: a policy that breaks its contract
    cannot be trusted with a training run (``bunshin check-policy`` finds these first).
    """


class NotFoundError(BunshinError):
    """Raised by the rollout service (``bunshin serve``) when an id names no registered task,
    open group or session; the HTTP API answers 404."""


class StateConflictError(BunshinError):
    """Raised by the rollout service when a request does not fit the state of what it names:
    a step or close on a session that is closed, failed, expired or already stepping, a task
    registered twice, a task deleted while it has open groups. The HTTP API answers 409."""


class CapacityError(BunshinError):
    """Raised by the rollout service when a group cannot be opened within the wait the request
    allows because a limit is reached; the HTTP API answers 429 (``max_workspaces``) or 503
    (``max_bytes``, or the service shutting down) with a ``Retry-After`` header.

    Attributes:
        limit: The limit reached: ``max_workspaces``, ``max_bytes`` or ``shutdown``.
        in_use: How much of it is in use (sessions, or bytes).
        maximum: The limit's value.
        retry_after: Seconds after which a retry may succeed.
    """

    def __init__(self, message: str, *, limit: str, in_use: int, maximum: int, retry_after: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.in_use = in_use
        self.maximum = maximum
        self.retry_after = retry_after
