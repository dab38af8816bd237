"""The trace format: recorded rollouts, versioned, in JSON or msgpack.

A trace holds tasks (each with the memory profile of its workspace) and rollouts (one per
sample of a GRPO group in an epoch), each a list of steps: the model's think time, the tool
call, how long the call ran, a digest and size of its observation, how many bytes of the
workspace it dirtied, whether its result may be cached and, where the source records it,
the conversation that reached the model before the call.

Every loader goes through :func:`load_trace`, which checks the version first, decodes the
whole file strictly (no unknown fields, no missing ones) and then checks the cross references
(rollouts name known tasks, no rollout twice). Any failure is a :class:`TraceError` naming the
file, the path to the field and what was expected.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

from ._exceptions import TraceError

__all__ = [
    "TRACE_VERSION",
    "ToolCall",
    "ContextMessage",
    "Step",
    "Rollout",
    "RolloutKey",
    "MemoryProfile",
    "Task",
    "Trace",
    "call_key",
    "observation_digest",
    "load_trace",
    "dump_trace",
    "decode_trace",
    "encode_trace",
    "check_trace",
]

TRACE_VERSION = 1
"""The version of the trace schema this Bunshin reads and writes."""

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tool call as the policy emits it."""

    name: Name
    """The tool's name, for example ``"shell"`` or ``"click"``."""
    arguments: dict[str, Any] = {}
    """The call's arguments, a JSON object; :func:`call_key` gives the call's canonical form."""


def call_key(call: ToolCall) -> bytes:
    """Return the canonical bytes of *call*; two calls are the same exactly when these are."""
    return msgspec.json.encode((call.name, call.arguments), order="sorted")


def observation_digest(data: bytes | str) -> str:
    """Return the digest Bunshin records for an observation (``sha256:`` and 16 hex digits)."""
    if isinstance(data, str):
        data = data.encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


class ContextMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A conversation message the policy saw before a call (see :attr:`Step.context`)."""

    role: Name
    """Who wrote it, as the source names it: ``"user"`` (a person or a simulated user, or
    the task statement) or ``"assistant"`` (the policy's own text)."""
    text: str
    """The message's text."""


class Step(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One step of a rollout: the model thinks, emits a call, the workspace runs it.

    Fields left at their defaults are not written: a step without :attr:`context` encodes
    to what every reader of schema version 1 accepts, including those that predate the field
    (which is why adding it kept :data:`TRACE_VERSION` at 1).
    """

    think_time: NonNegFloat
    """Seconds the model reasoned before emitting this call."""
    call: ToolCall
    """The call the model emitted."""
    exec_time: NonNegFloat
    """Seconds the call ran in the workspace."""
    observation_digest: Name
    """Digest of the observation the call returned (see :func:`observation_digest`)."""
    observation_size: NonNegInt
    """Size of that observation in bytes."""
    dirtied_bytes: NonNegInt
    """Bytes of workspace memory the call wrote (pages it made private)."""
    cacheable: bool = True
    """Whether the call's result depends only on the workspace state before it (a tool that
    reads the clock or the network is not cacheable)."""
    modelled: tuple[str, ...] = ()
    """Names of the fields above whose values come from a model, not a recording."""
    context: tuple[ContextMessage, ...] = ()
    """The conversation text that reached the policy after it emitted the previous call and
    before this one (user messages, the policy's own text messages, the text that came with
    the previous call), in order; tool outputs are not here (see
    :attr:`observation_digest`), nor the text emitted together with this call. Joined over
    the steps so far it is the conversation the policy had seen when it made this call.
    Empty when the source records no conversation."""


class RolloutKey(msgspec.Struct, frozen=True, order=True):
    """Identifies one rollout: the epoch, the task, the GRPO group and the sample in it."""

    epoch: int
    task: str
    group: int
    sample: int

    def __str__(self) -> str:
        return f"e{self.epoch}/{self.task}/g{self.group}/s{self.sample}"


class Rollout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sample's trajectory in one epoch."""

    epoch: NonNegInt
    """Training epoch (each epoch revisits every task)."""
    task: Name
    """The id of the task (see :class:`Task`)."""
    group: NonNegInt
    """The GRPO group within the epoch; the samples of one group share a task."""
    sample: NonNegInt
    """Index of the sample within its group."""
    reward: float
    """The reward the trajectory earned."""
    steps: list[Step]
    """The steps, in order."""
    final_think_time: NonNegFloat = 0.0
    """Seconds the model reasoned after the last observation before ending."""

    @property
    def key(self) -> RolloutKey:
        """The rollout's :class:`RolloutKey`."""
        return RolloutKey(self.epoch, self.task, self.group, self.sample)


class MemoryProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a task's workspace holds in memory once initialised."""

    image_bytes: NonNegInt
    """File-backed memory (binaries, libraries, read-only data of the image): shared by all of
    the task's workspaces through the page cache, whatever the engine."""
    runtime_bytes: NonNegInt
    """Anonymous memory built up while initialising (heap, shared memory, caches): shareable
    between workspaces only by forking a live one."""
    boot_time: NonNegFloat
    """Seconds to create and initialise a fresh workspace."""


class Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A task the policy is trained on; its workspace is the root of its prefix tree."""

    id: Name
    """Unique id, referenced by :attr:`Rollout.task`."""
    memory: MemoryProfile
    """The initialised workspace's memory profile."""
    description: str = ""
    """Free text (the instruction, the benchmark's task id)."""


class Trace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A recorded or generated set of rollouts (see the module docstring)."""

    version: Literal[1]
    """Schema version; always :data:`TRACE_VERSION` when written by this Bunshin."""
    name: str
    """A label for the workload."""
    tasks: list[Task]
    """The tasks, each once."""
    rollouts: list[Rollout]
    """The rollouts, in the order the trainer issues them."""
    meta: dict[str, str | int | float | bool] = {}
    """Where the trace comes from: generator and seed, importer and source file, and so on."""

    def task_map(self) -> dict[str, Task]:
        """Map each task id to its :class:`Task`."""
        return {t.id: t for t in self.tasks}

    def epochs(self) -> list[int]:
        """The epochs present, in increasing order."""
        return sorted({r.epoch for r in self.rollouts})

    def groups(self, epoch: int | None = None) -> Iterator[list[Rollout]]:
        """Yield each group's rollouts (sorted by sample) in trace order, optionally of one
        epoch only."""
        seen: dict[tuple[int, str, int], list[Rollout]] = {}
        for r in self.rollouts:
            if epoch is not None and r.epoch != epoch:
                continue
            seen.setdefault((r.epoch, r.task, r.group), []).append(r)
        for members in seen.values():
            yield sorted(members, key=lambda r: r.sample)


class _Header(msgspec.Struct):
    version: Any = msgspec.UNSET


def _fmt_of(path: str, data: bytes) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        return "json"
    if ext in (".msgpack", ".mpk", ".msgp"):
        return "msgpack"
    return "json" if data.lstrip()[:1] in (b"{", b"[") else "msgpack"


def decode_trace(data: bytes, *, source: str = "<bytes>", fmt: str | None = None) -> Trace:
    """Decode and check a trace from *data* (JSON or msgpack).

    Args:
        data: The encoded trace.
        source: The name to use in error messages (a file path).
        fmt: ``"json"`` or ``"msgpack"``; guessed from *source*'s extension or the first
            byte when ``None``.

    Raises:
        TraceError: On a truncated or malformed document, an unknown version, a field of the
            wrong type or range, or a broken cross reference.
    """
    fmt = fmt or _fmt_of(source, data)
    if fmt == "json":
        decode = msgspec.json.decode
    elif fmt == "msgpack":
        decode = msgspec.msgpack.decode
    else:
        raise TraceError(f"{source}: unknown trace format {fmt!r}; expected 'json' or 'msgpack'")
    if not data.strip():
        raise TraceError(f"{source}: the file is empty; expected a {fmt} trace object")
    try:
        header = decode(data, type=_Header)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        raise TraceError(f"{source}: {_explain(exc)}; a trace is an object") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{source}: not a valid {fmt} trace: {_explain(exc)}") from None
    if header.version is msgspec.UNSET:
        raise TraceError(
            f"{source}: missing field `version` at `$`; expected the trace schema version "
            f"(this Bunshin reads version {TRACE_VERSION})"
        )
    if header.version != TRACE_VERSION:
        raise TraceError(
            f"{source}: unknown trace version {header.version!r} at `$.version`; this Bunshin "
            f"reads version {TRACE_VERSION}"
        )
    try:
        trace = decode(data, type=Trace)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(f"{source}: {_explain(exc)}") from None
    problems = check_trace(trace, strict=True)
    if problems:
        raise TraceError(f"{source}: {problems[0]}")
    return trace


def _explain(exc: Exception) -> str:
    msg = str(exc)
    if "truncated" in msg:
        return "the file is truncated (input ended in the middle of a value)"
    return msg


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and check the trace at *path* (see :func:`decode_trace`).

    Raises:
        TraceError: If the file cannot be read or is not a valid trace.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    return decode_trace(data, source=path)


def encode_trace(trace: Trace, fmt: str = "json") -> bytes:
    """Encode *trace* as ``"json"`` or ``"msgpack"``."""
    if fmt == "json":
        return msgspec.json.encode(trace)
    if fmt == "msgpack":
        return msgspec.msgpack.encode(trace)
    raise ValueError(f"unknown trace format {fmt!r}; expected 'json' or 'msgpack'")


def dump_trace(trace: Trace, path: str | os.PathLike[str], fmt: str | None = None) -> None:
    """Write *trace* to *path*, atomically (a temporary file renamed into place).

    The format is *fmt*, or guessed from the extension (``.msgpack``/``.mpk`` for msgpack,
    anything else JSON).
    """
    path = os.fspath(path)
    if fmt is None:
        fmt = "msgpack" if os.path.splitext(path)[1].lower() in (".msgpack", ".mpk", ".msgp") else "json"
    data = encode_trace(trace, fmt)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def check_trace(trace: Trace, *, strict: bool = False) -> list[str]:
    """Check what the schema alone cannot: cross references and consistency.

    Errors (always reported): a task id used twice, a rollout naming an unknown task, a
    rollout key used twice. Warnings (reported unless *strict*): two rollouts of a task that
    make the same cacheable call after the same prefix but record different observations,
    so the tool should not be marked cacheable.

    Returns:
        Messages naming the path to the offending field; errors first.
    """
    errors: list[str] = []
    warnings: list[str] = []
    ids: dict[str, int] = {}
    for i, t in enumerate(trace.tasks):
        if t.id in ids:
            errors.append(f"duplicate task id {t.id!r} at `$.tasks[{i}].id` (first at `$.tasks[{ids[t.id]}]`)")
        else:
            ids[t.id] = i
    keys: dict[RolloutKey, int] = {}
    outcomes: dict[tuple[str, bytes], tuple[str, int, int]] = {}
    for i, r in enumerate(trace.rollouts):
        if r.task not in ids:
            errors.append(
                f"unknown task {r.task!r} at `$.rollouts[{i}].task`; expected one of the ids in `$.tasks`"
            )
        k = r.key
        if k in keys:
            errors.append(f"rollout {k} appears twice: `$.rollouts[{keys[k]}]` and `$.rollouts[{i}]`")
        else:
            keys[k] = i
        if strict:
            continue
        h = hashlib.blake2b(r.task.encode(), digest_size=16)
        for j, s in enumerate(r.steps):
            h.update(call_key(s.call))
            if not s.cacheable:
                break
            prefix = h.digest()
            seen = outcomes.get((r.task, prefix))
            if seen is None:
                outcomes[(r.task, prefix)] = (s.observation_digest, i, j)
            elif seen[0] != s.observation_digest:
                warnings.append(
                    f"warning: `$.rollouts[{i}].steps[{j}]` and `$.rollouts[{seen[1]}].steps[{seen[2]}]` "
                    f"make the same cacheable call {s.call.name!r} after the same prefix but observe "
                    "different results; mark the tool non-cacheable"
                )
    return errors + warnings
