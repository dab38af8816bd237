"""A :class:`Policy` backed by an OpenAI-compatible chat-completions endpoint with tool calling.

This is the client for the servers vLLM and SGLang run (``POST {base_url}/chat/completions``
with ``tools``). Each :meth:`ChatPolicy.act` rebuilds the sample's conversation from its
:class:`SampleView` (so the policy keeps no per-sample state), sends it, and turns the reply
into the next :class:`ToolCall`, or into :class:`Finish` with the reward the environment's
verifier gives the final answer.

Messages, for a sample that made calls ``c_0 .. c_{n-1}`` with observations ``o_0 .. o_{n-1}``:

- ``system``: the system prompt (left out when it is empty);
- ``user``: the task's :attr:`Task.description`;
- per call i, an ``assistant`` message with one ``tool_calls`` entry (id ``call_i``, type
  ``function``, the arguments as a JSON string) and a ``tool`` message answering ``call_i``
  whose content is ``o_i.output`` decoded as UTF-8 (bad bytes replaced), or, where the backend
  kept no output, ``[no output kept: observation <digest>, <size> bytes]``.

Transient failures (connect errors, timeouts, a dropped connection, HTTP 408, 429 and 5xx)
are retried with exponential backoff and full jitter drawn from one seeded
:class:`random.Random`; a ``Retry-After`` header given in seconds replaces the jitter, capped
at :attr:`ChatModel.backoff_cap`. Anything else is a :class:`ModelError` naming the rollout,
the step and what was wrong. All waiting goes through anyio, so the client runs on asyncio
and on trio.
"""

from __future__ import annotations

import inspect
import math
import os
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
import msgspec

from ._exceptions import ConfigError, ModelError
from ._policy import Finish, Policy, SampleView
from ._trace import RolloutKey, Task, ToolCall

__all__ = ["CHAT_API_KEY_ENV", "ChatModel", "ChatPolicy", "ChatStatistics"]

CHAT_API_KEY_ENV = "BUNSHIN_MODEL_API_KEY"
"""The environment variable :class:`ChatPolicy` reads the API key from when
:attr:`ChatModel.api_key` is None. It is not ``OPENAI_API_KEY`` on purpose: a key meant for
OpenAI must not be sent to whatever server ``base_url`` names."""

# request-body fields the client sets itself; ``extra_body`` may not override them
_RESERVED = ("model", "messages", "tools", "temperature", "max_tokens", "stream", "n")
_EXCERPT = 200  # characters of a bad body quoted in an error


class ChatModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the model is served and how to call it.

    Every field is checked on construction (and by :func:`msgspec.convert`); a bad value
    raises :class:`ConfigError` naming the field. The repr hides the API key.
    """

    base_url: str
    """The API root, ending before ``/chat/completions``: ``http://127.0.0.1:8000/v1``."""
    model: str
    """The served model's name (vLLM: the ``--served-model-name``, by default the path)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer <key>``. None reads :data:`CHAT_API_KEY_ENV` when the
    policy is made (no header if that is unset or empty); ``""`` sends no header."""
    temperature: float = 1.0
    """Sampling temperature, 0 to 2 (RL rollouts usually sample at 1)."""
    max_tokens: int | None = None
    """Most tokens per reply; None leaves it to the server."""
    timeout: float = 60.0
    """Seconds one request may take in all (connecting, sending, waiting, reading)."""
    retries: int = 3
    """Attempts after the first, for transient failures only."""
    backoff_base: float = 0.5
    """Seconds; before retry k (from 0) the client sleeps a uniform draw from
    ``[0, min(backoff_cap, backoff_base * 2**k)]``."""
    backoff_cap: float = 30.0
    """Most seconds slept before one retry, ``Retry-After`` included."""
    extra_body: dict[str, Any] = {}
    """More request-body fields, sent as given: ``top_p``, ``seed``, ``tool_choice``,
    ``chat_template_kwargs`` and so on. It may not set the fields the client sets itself
    (``model``, ``messages``, ``tools``, ``temperature``, ``max_tokens``, ``stream``, ``n``)."""

    def __post_init__(self) -> None:
        self.check()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.__rich_repr__())
        return f"ChatModel({fields})"

    def __rich_repr__(self) -> Any:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            yield name, ("***" if name == "api_key" and value else value)

    @property
    def url(self) -> str:
        """The URL requests are posted to."""
        return self.base_url.rstrip("/") + "/chat/completions"

    def check(self) -> None:
        """Raise :class:`ConfigError` if a field is out of range (done on construction)."""

        def bad(name: str, want: str, shown: object = None) -> ConfigError:
            got = getattr(self, name) if shown is None else shown
            return ConfigError(f"ChatModel.{name}={got!r} is invalid; expected {want}")

        def number(name: str) -> float | None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return None
            return float(v)

        if not isinstance(self.base_url, str) or not self.base_url:
            raise bad("base_url", "an http:// or https:// URL such as http://127.0.0.1:8000/v1")
        try:
            url = httpx.URL(self.base_url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise bad("base_url", f"a valid URL ({exc})") from None
        if url.scheme not in ("http", "https") or not url.host or url.query or url.fragment:
            raise bad(
                "base_url", "an http:// or https:// URL with a host and no query, such as http://127.0.0.1:8000/v1"
            )
        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "the served model's name, a non-empty string")
        if self.api_key is not None:
            if not isinstance(self.api_key, str):
                raise bad("api_key", "a string or None", type(self.api_key).__name__)
            if any(c.isspace() or not c.isprintable() for c in self.api_key):
                raise bad("api_key", "no white space or control characters", "***")
        t = number("temperature")
        if t is None or not 0.0 <= t <= 2.0:
            raise bad("temperature", "a number from 0 to 2")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1 or None")
        t = number("timeout")
        if t is None or t <= 0:
            raise bad("timeout", "seconds > 0")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise bad("retries", "an integer >= 0")
        base = number("backoff_base")
        if base is None or base < 0:
            raise bad("backoff_base", "seconds >= 0")
        cap = number("backoff_cap")
        if cap is None or cap < base:
            raise bad("backoff_cap", f"seconds >= backoff_base ({self.backoff_base})")
        if not isinstance(self.extra_body, dict) or not all(isinstance(k, str) for k in self.extra_body):
            raise bad("extra_body", "a JSON object (a dict with string keys)")
        clash = [k for k in _RESERVED if k in self.extra_body]
        if clash:
            raise bad(
                "extra_body",
                f"none of the fields the client sets ({', '.join(_RESERVED)}); set {clash[0]!r} "
                "through its own option or leave it out",
            )
        try:
            msgspec.json.encode(self.extra_body)
        except (TypeError, ValueError, OverflowError) as exc:
            raise bad("extra_body", f"values JSON can encode ({exc})") from None


class ChatStatistics(msgspec.Struct, frozen=True):
    """What a :class:`ChatPolicy` did so far."""

    requests: int
    """HTTP requests sent, retries included."""
    retries: int
    """Requests that were retries of a transient failure."""
    failures: int
    """Calls of :meth:`ChatPolicy.act` that raised :class:`ModelError`."""
    tool_calls: int
    """Tool calls returned."""
    finishes: int
    """Trajectories finished (replies without a tool call)."""
    prompt_tokens: int
    """Prompt tokens, summed over the replies that reported ``usage``."""
    completion_tokens: int
    """Completion tokens, summed likewise."""
    dropped_tool_calls: int
    """Tool calls dropped because a reply held several (only the first is used)."""
    backoff_seconds: float
    """Seconds slept before retries."""


# -- the reply, as far as it is read -------------------------------------------------------------


class _Function(msgspec.Struct):
    name: str
    arguments: str


class _ReplyToolCall(msgspec.Struct):
    function: _Function
    type: str = "function"


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ReplyToolCall] | None = None


class _Choice(msgspec.Struct):
    message: _Message
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Completion(msgspec.Struct):
    choices: list[_Choice]
    usage: _Usage | None = None


_decode_completion = msgspec.json.Decoder(_Completion).decode
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}

# the failures worth another attempt: the server or the path to it may recover
_TRANSIENT_STATUS = frozenset({408, 429})
_TRANSIENT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


def _excerpt(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    if len(text) > _EXCERPT:
        text = text[:_EXCERPT] + f"... ({len(body)} bytes)"
    return repr(text) if text else "(empty body)"


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header; None when absent or an HTTP date."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _check_tools(tools: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) or not tools:
        raise ConfigError(
            "tools must be a non-empty list of OpenAI function tools "
            '({"type": "function", "function": {"name": ..., "parameters": {...}}})'
        )
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ConfigError(f"{where} is a {type(tool).__name__}; expected an object")
        if tool.get("type") != "function":
            raise ConfigError(f"{where} has type {tool.get('type')!r}; only \"function\" tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ConfigError(f"{where} has no \"function\" object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.function.name is {name!r}; expected a non-empty string")
        if name in names:
            raise ConfigError(f"{where}.function.name {name!r} repeats tools[{names.index(name)}]")
        names.append(name)
    try:
        copy = msgspec.json.decode(msgspec.json.encode(list(tools)))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"tools cannot be encoded as JSON: {exc}") from None
    return copy, tuple(names)


class ChatPolicy(Policy):
    """A policy that asks an OpenAI-compatible chat endpoint for each next tool call.

    Use it as an async context manager, which closes its HTTP client::

        async with ChatPolicy(model, tools, tasks, reward=verify, group_size=8) as policy:
            result = await run_rollouts(backend, policy, SchedulerConfig(batch_tasks=4))

    :meth:`planned` gives, per epoch, per task, *group_size* samples of group 0 (one group
    per task and epoch, as the trace generators and importers number them).

    A reply with several tool calls is served by its first; the others are counted in
    :attr:`ChatStatistics.dropped_tool_calls`. A reply with none finishes the trajectory:
    its text content (``""`` if it has none) goes to *reward*. The text the model writes next
    to a tool call is not fed back on later turns (the trajectory keeps calls, not text).

    Args:
        model: The endpoint and sampling settings.
        tools: OpenAI function-tool definitions, sent with every request; a reply may only
            call these.
        tasks: The tasks to plan, each with a non-empty ``description`` (the user message).
        reward: ``reward(sample, final_text)``: the environment verifier's reward for the
            finished *sample*, a float or an awaitable of one. Required: rewards come from
            the environment, never from this client.
        group_size: Samples per task and epoch (G).
        epochs: Times the plan visits every task.
        system_prompt: The system message; left out when empty.
        seed: Seeds the random stream of the retry jitter.

    Raises:
        ConfigError: If an argument is invalid; the message names it.
    """

    def __init__(
        self,
        model: ChatModel,
        tools: Sequence[Mapping[str, Any]],
        tasks: Sequence[Task],
        *,
        reward: Callable[[SampleView, str], float | Awaitable[float]],
        group_size: int = 1,
        epochs: int = 1,
        system_prompt: str = "",
        seed: int = 0,
    ) -> None:
        if not isinstance(model, ChatModel):
            raise ConfigError(f"model must be a ChatModel, got {type(model).__name__}")
        self._tools, self._names = _check_tools(tools)
        tasks = list(tasks)
        if not callable(reward):
            raise ConfigError(f"reward must be callable as reward(sample, final_text), got {reward!r}")
        for name, v in (("group_size", group_size), ("epochs", epochs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} is invalid; expected an integer >= 1")
        if not isinstance(system_prompt, str):
            raise ConfigError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
        seen: set[str] = set()
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise ConfigError(f"tasks[{i}] is a {type(task).__name__}; expected a Task")
            if task.id in seen:
                raise ConfigError(f"tasks[{i}]: task id {task.id!r} appears twice")
            if not task.description.strip():
                raise ConfigError(
                    f"tasks[{i}] ({task.id!r}) has an empty description; it is the user message, "
                    "so give the instruction there"
                )
            seen.add(task.id)
        if not seen:
            raise ConfigError("tasks is empty; give at least one Task to plan")
        self._model = model
        self._reward = reward
        self._system = system_prompt
        self._plan = [
            (RolloutKey(epoch, task.id, 0, sample), task)
            for epoch in range(epochs)
            for task in tasks
            for sample in range(group_size)
        ]
        self._rng = random.Random(seed)
        key = model.api_key if model.api_key is not None else os.environ.get(CHAT_API_KEY_ENV, "")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ConfigError(f"${CHAT_API_KEY_ENV} holds white space or control characters; fix the key")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(model.timeout),
            # one connection per request in flight; the scheduler bounds how many there are
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._closed = False
        self._stats = dict.fromkeys(ChatStatistics.__struct_fields__, 0)
        self._stats["backoff_seconds"] = 0.0

    # -- life cycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client; closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._client.aclose()

    # -- Policy ----------------------------------------------------------------------------

    @property
    def model(self) -> ChatModel:
        """The endpoint and sampling settings."""
        return self._model

    def planned(self) -> Sequence[tuple[RolloutKey, Task]]:
        return list(self._plan)

    def statistics(self) -> ChatStatistics:
        """Counts so far."""
        return ChatStatistics(**self._stats)

    def messages(self, sample: SampleView) -> list[dict[str, Any]]:
        """The chat messages sent for *sample*'s next step (see the module docstring)."""
        out: list[dict[str, Any]] = []
        if self._system:
            out.append({"role": "system", "content": self._system})
        out.append({"role": "user", "content": sample.task.description})
        for i, (call, obs) in enumerate(zip(sample.calls, sample.observations, strict=True)):
            call_id = f"call_{i}"
            out.append({
                "role": "assistant",
                "content": None,
                "tool_calls": [{
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": msgspec.json.encode(call.arguments).decode()},
                }],
            })
            if obs.output is not None:
                content = obs.output.decode("utf-8", errors="replace")
            else:
                content = f"[no output kept: observation {obs.digest}, {obs.size} bytes]"
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        return out

    async def act(self, sample: SampleView) -> ToolCall | Finish:
        """Ask the model for *sample*'s next call.

        Raises:
            ModelError: If no usable reply came (see the module docstring); the message
                names the rollout, the step and what was wrong.
            anyio.ClosedResourceError: If the policy was closed.
        """
        if self._closed:
            raise anyio.ClosedResourceError("the ChatPolicy is closed; use it inside `async with ChatPolicy(...)`")
        where = f"rollout {sample.rollout} step {len(sample.calls)}"
        try:
            body = await self._post(self._body(sample), where)
            action = self._read(body, where)
        except ModelError:
            self._stats["failures"] += 1
            raise
        if isinstance(action, ToolCall):
            self._stats["tool_calls"] += 1
            return action
        reward = await self._score(sample, action)
        self._stats["finishes"] += 1
        return Finish(reward)

    # -- internals ---------------------------------------------------------------------------

    def _body(self, sample: SampleView) -> bytes:
        m = self._model
        body: dict[str, Any] = {"tool_choice": "auto"}
        body.update(m.extra_body)
        body.update(model=m.model, messages=self.messages(sample), tools=self._tools, temperature=m.temperature)
        if m.max_tokens is not None:
            body["max_tokens"] = m.max_tokens
        return msgspec.json.encode(body)

    def _backoff(self, retry: int, retry_after: float | None) -> float:
        m = self._model
        if retry_after is not None:
            return min(retry_after, m.backoff_cap)
        return self._rng.uniform(0.0, min(m.backoff_cap, m.backoff_base * 2.0 ** min(retry, 60)))

    async def _post(self, body: bytes, where: str) -> bytes:
        """The body of the first successful response, retrying transient failures."""
        m = self._model
        url = m.url
        attempts = m.retries + 1
        last = ""
        last_exc: BaseException | None = None
        retry_after: float | None = None
        for attempt in range(attempts):
            if attempt:
                delay = self._backoff(attempt - 1, retry_after)
                self._stats["retries"] += 1
                self._stats["backoff_seconds"] += delay
                await anyio.sleep(delay)
            retry_after = None
            self._stats["requests"] += 1
            try:
                with anyio.fail_after(m.timeout):
                    resp = await self._client.post(url, content=body)
            except (TimeoutError, httpx.TimeoutException) as exc:
                last, last_exc = f"no reply within timeout={m.timeout} s ({type(exc).__name__})", exc
                continue
            except _TRANSIENT_ERRORS as exc:
                last, last_exc = f"{type(exc).__name__}: {exc or 'connection failed'}", exc
                continue
            except httpx.HTTPError as exc:
                raise ModelError(f"{where}: the request to {url} failed: {type(exc).__name__}: {exc}") from exc
            status = resp.status_code
            if 200 <= status < 300:
                return resp.content
            if status in _TRANSIENT_STATUS or status >= 500:
                last, last_exc = f"HTTP {status}: {_excerpt(resp.content)}", None
                retry_after = _retry_after(resp.headers.get("retry-after"))
                continue
            raise ModelError(f"{where}: {url} answered HTTP {status}: {_excerpt(resp.content)}{_hint(status)}")
        raise ModelError(
            f"{where}: no usable reply from {url} after {attempts} attempts (1 + retries={m.retries}); "
            f"last error: {last}"
        ) from last_exc

    def _read(self, body: bytes, where: str) -> ToolCall | str:
        """The call a reply makes, or its final text."""
        try:
            reply = _decode_completion(body)
        except msgspec.ValidationError as exc:
            raise ModelError(f"{where}: the reply is not a chat completion ({exc}): {_excerpt(body)}") from None
        except msgspec.DecodeError as exc:
            raise ModelError(f"{where}: the reply is not valid JSON ({exc}): {_excerpt(body)}") from None
        if reply.usage is not None:
            self._stats["prompt_tokens"] += reply.usage.prompt_tokens
            self._stats["completion_tokens"] += reply.usage.completion_tokens
        if not reply.choices:
            raise ModelError(f"{where}: the reply has no choices: {_excerpt(body)}")
        choice = reply.choices[0]
        calls = choice.message.tool_calls
        if not calls:
            return choice.message.content or ""
        self._stats["dropped_tool_calls"] += len(calls) - 1
        first = calls[0]
        if first.type != "function":
            raise ModelError(f"{where}: the model made a tool call of type {first.type!r}; only function tools exist")
        name = first.function.name
        if name not in self._names:
            raise ModelError(
                f"{where}: the model called unknown tool {name!r}; the tools are {', '.join(self._names)}"
            )
        text = first.function.arguments
        cut = " (the reply was cut at max_tokens; raise max_tokens)" if choice.finish_reason == "length" else ""
        if not text.strip():
            arguments: Any = {}  # some models send "" for a tool without parameters
        else:
            try:
                arguments = msgspec.json.decode(text)
            except msgspec.DecodeError as exc:
                raise ModelError(
                    f"{where}: the arguments of {name!r} are not valid JSON ({exc}){cut}: {_excerpt(text.encode())}"
                ) from None
        if not isinstance(arguments, dict):
            kind = _JSON_KINDS.get(type(arguments), type(arguments).__name__)
            raise ModelError(
                f"{where}: the arguments of {name!r} are a JSON {kind}, expected an object: {_excerpt(text.encode())}"
            )
        return ToolCall(name=name, arguments=arguments)

    async def _score(self, sample: SampleView, text: str) -> float:
        value = self._reward(sample, text)
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(
                f"rollout {sample.rollout}: the reward function returned {value!r}; expected a finite float"
            )
        return float(value)


def _hint(status: int) -> str:
    if status in (401, 403):
        return f" (check ChatModel.api_key or ${CHAT_API_KEY_ENV})"
    if status == 404:
        return " (check ChatModel.base_url, which should end in /v1, and ChatModel.model)"
    if status == 400:
        return (
            " (the server rejected the request: a prompt longer than the model's context, or, for "
            "vLLM, tool calling not enabled: serve with --enable-auto-tool-choice --tool-call-parser)"
        )
    return ""
