"""A gymnasium environment over ``bunshin serve``: one episode is one session.

:class:`BunshinEnv` is a synchronous client of the service's environment API (see
``docs/serve.md``), so the sharing, prefix caching and speculation of the service work under
it unchanged. Spaces are text, as in text-based agent environments:

- an *action* is a tool call as JSON, ``{"name": "cat", "arguments": {"path": "/etc/hostname"}}``;
  the call named ``finish_tool`` (default ``"finish"``) ends the episode, its
  ``arguments["reward"]`` (a number) is the episode's reward, passed to the service with the
  close. An action that is not such JSON is not sent: the observation says what is wrong and
  the episode goes on (``info["error"]``);
- an *observation* is the text the call returned (``reset`` returns the task's description and
  what its set-up calls returned). Characters outside :data:`CHARSET` become ``?`` and text
  beyond ``max_text`` is cut, so every observation is in the observation space;
- the *reward* is 0 for every step but the finishing one; a step the service refuses or fails
  ends the episode (``terminated``, ``info["error"]``); ``max_steps`` steps truncate it.

``reset`` opens a group of one session, or attaches to a session of a group the trainer opened
(``options={"session": ID}``; :func:`open_env_group` opens one), which is how G environments of a
GRPO group share one fork of the task's workspace.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import string
from collections.abc import Callable
from typing import Any

import gymnasium
import httpx
from gymnasium import spaces

from ._exceptions import BackendError, ConfigError

__all__ = ["BunshinEnv", "CHARSET", "SkyRLTextEnv", "open_env_group"]

CHARSET = string.printable
"""The characters of the text spaces (ASCII letters, digits, punctuation and whitespace)."""


def _text(s: str, limit: int) -> str:
    allowed = set(CHARSET)
    return "".join(c if c in allowed else "?" for c in s[:limit])


def _check(r: httpx.Response, what: str) -> dict[str, Any]:
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise BackendError(f"{what}: the service answered {r.status_code}: {detail}")
    return r.json()


def open_env_group(base_url: str, task: str, size: int, *, wait: float = 60.0, timeout: float = 600.0) -> list[str]:
    """Open a group of *size* sessions of *task* on the service at *base_url* (``.../v1``)
    and return their ids, for ``env.reset(options={"session": id})``.

    Raises:
        BackendError: The service refused (no room within *wait*, unknown task, ...).
    """
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        body = _check(client.post(f"/tasks/{task}/groups", json={"size": size, "wait": wait}), f"opening a group of {task!r}")
    return list(body["sessions"])


class BunshinEnv(gymnasium.Env):
    """One session of the service at *base_url* per episode (see the module docstring).

    Args:
        base_url: The API root, e.g. ``http://127.0.0.1:8765/v1``.
        task: A task registered with the service.
        max_steps: Steps before an episode is truncated.
        max_text: The longest action and observation text.
        finish_tool: The action name that ends the episode (None: no action does; the
            caller ends it with :meth:`end_episode`).
        timeout: Seconds an HTTP request may take (a step waits for its tool).
    """

    metadata = {"render_modes": []}

    def __init__(self, base_url: str, task: str, *, max_steps: int = 50, max_text: int = 65536,
                 finish_tool: str | None = "finish", timeout: float = 600.0) -> None:
        if max_steps < 1 or max_text < 1:
            raise ConfigError(f"max_steps={max_steps} and max_text={max_text} must both be at least 1")
        self.task = task
        self.max_steps = max_steps
        self.max_text = max_text
        self.finish_tool = finish_tool
        self.action_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self.observation_space = spaces.Text(max_length=max_text, charset=CHARSET)
        self._client = httpx.Client(base_url=base_url, timeout=timeout)
        self._session: str | None = None
        self._steps = 0
        self._initial: str | None = None

    # -- gymnasium ---------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.end_episode(None)
        session = (options or {}).get("session")
        if session is None:
            body = _check(self._client.post(f"/tasks/{self.task}/groups", json={"size": 1}), f"opening a session of {self.task!r}")
            session = body["sessions"][0]
        self._session = str(session)
        self._steps = 0
        text, setup = self._first()
        return text, {"session": self._session, "setup": setup}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._session is None:
            raise gymnasium.error.ResetNeeded("call reset() before step(), and again after an episode ends")
        try:
            call = self._parse(action)
        except ValueError as exc:
            return _text(f"invalid action: {exc}", self.max_text), 0.0, False, False, {"error": str(exc)}
        if call["name"] == self.finish_tool:
            reward = float(call["arguments"]["reward"])
            info = {"session": self._session, "steps": self._steps}
            self.end_episode(reward)
            return "", reward, True, False, info
        self._steps += 1
        r = self._client.post(f"/sessions/{self._session}/step", json={"call": call})
        if r.status_code >= 400:
            error = f"the service answered {r.status_code}: {_detail(r)}"
            info = {"session": self._session, "error": error}
            self.end_episode(None)
            return _text(error, self.max_text), 0.0, True, False, info
        body = r.json()
        obs = body["observation"]
        text = obs["output"] if obs.get("output") is not None else f"[observation {obs['digest']}, {obs['size']} bytes]"
        info = {"session": self._session, "served_by": body["served_by"], "timings": body["timings"]}
        truncated = self._steps >= self.max_steps
        if truncated:
            self.end_episode(None)
        return _text(text, self.max_text), 0.0, False, truncated, info

    def close(self) -> None:
        self.end_episode(None)
        self._client.close()
        super().close()

    # -- internals ---------------------------------------------------------------------------

    def _first(self) -> tuple[str, list[str]]:
        """The first observation, and the set-up calls' outputs on their own."""
        task = _check(self._client.get(f"/tasks/{self.task}"), f"reading task {self.task!r}")
        setup = [_text(o["output"], self.max_text) for o in task.get("setup_observations") or [] if o.get("output")]
        parts = [task.get("description") or "", *setup]
        return _text("\n".join(p for p in parts if p), self.max_text), setup

    def _parse(self, action: str) -> dict[str, Any]:
        try:
            call = json.loads(action)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not JSON ({exc}); expected {{\"name\": TOOL, \"arguments\": {{...}}}}") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ValueError('expected {"name": TOOL, "arguments": {...}}')
        args = call.get("arguments", {})
        if not isinstance(args, dict) or set(call) - {"name", "arguments"}:
            raise ValueError('expected {"name": TOOL, "arguments": {...}} and nothing else')
        if self.finish_tool is not None and call["name"] == self.finish_tool:
            reward = args.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
                raise ValueError(f'{self.finish_tool} needs {{"reward": NUMBER}} in its arguments')
        return {"name": call["name"], "arguments": args}

    def end_episode(self, reward: float | None) -> None:
        """Close the episode's session, with *reward* if given (nothing if none is open)."""
        session, self._session = self._session, None
        if session is None:
            return
        body = {} if reward is None else {"reward": reward}
        r = self._client.post(f"/sessions/{session}/close", json=body)
        if r.status_code >= 400 and r.status_code != 409:  # 409: it had ended already
            raise BackendError(f"closing session {session}: the service answered {r.status_code}: {_detail(r)}")


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class SkyRLTextEnv:
    """A text environment with the shape of SkyRL-gym's ``BaseTextEnv`` over ``bunshin serve``.

    SkyRL-gym itself is not a dependency (nor installable from PyPI); this class has the same
    three methods, so a SkyRL trainer's generator can drive it as one of its environments:

    - ``init(prompt)`` opens a session (or attaches to ``session``) and returns the prompt, with
      the task's set-up observations appended as a user message when there are any, and
      ``{"session": id}``;
    - ``step(action)`` takes the model's whole response. A tool call in it, as
      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes and Qwen
      format) or as the bare JSON object, runs in the session and its output comes back as one
      ``{"role": "user", "content": ...}`` message, with reward 0 and ``done`` False. A response
      with no tool call is the final answer: *reward* (the environment's verifier: a plain
      function called with the answer and the list of ``(call, output)`` pairs) gives the
      reward, the session is closed with it, and ``done`` is True;
    - ``close()`` closes the session if it is still open.

    The returned dict has SkyRL's keys: ``observations``, ``reward``, ``done``, ``metadata``
    (``served_by`` of the step, or the error) and ``postprocessed_action``.

    Args:
        base_url: The service's API root, e.g. ``http://127.0.0.1:8765/v1``.
        task: A task registered with the service.
        reward: The verifier: ``reward(answer, history) -> float``.
        session: A session of a group the trainer opened (:func:`open_env_group`); by default
            ``init`` opens a group of one.
        max_turns: Tool calls before the episode ends without a reward (``done``; metadata says so).
    """

    def __init__(self, base_url: str, task: str, reward: Callable[[str, list[tuple[dict[str, Any], str]]], float], *,
                 session: str | None = None, max_turns: int = 50, timeout: float = 600.0) -> None:
        if inspect.iscoroutinefunction(reward):
            raise ConfigError("reward must be a plain function returning a number (SkyRL environments are synchronous)")
        self._env = BunshinEnv(base_url, task, max_steps=max_turns, timeout=timeout, finish_tool=None)
        self._reward = reward
        self._session = session
        self._history: list[tuple[dict[str, Any], str]] = []

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        _, info = self._env.reset(options={"session": self._session} if self._session else None)
        self._history = []
        setup = "\n".join(info["setup"])
        messages = list(prompt) + ([{"role": "user", "content": setup}] if setup else [])
        return messages, {"session": info["session"]}

    def step(self, action: str) -> dict[str, Any]:
        call = _find_call(action)
        if call is None:
            value = float(self._reward(action, list(self._history)))
            if not math.isfinite(value):
                raise ConfigError(f"the reward function returned {value!r}; it must return a finite number")
            self._env.end_episode(value)
            return {"observations": [], "reward": value, "done": True, "metadata": {"turns": len(self._history)},
                    "postprocessed_action": action}
        obs, _, terminated, truncated, info = self._env.step(json.dumps(call))
        if "error" in info and not terminated:  # not a call the environment can send
            return {"observations": [{"role": "user", "content": obs}], "reward": 0.0, "done": False,
                    "metadata": {"error": info["error"]}, "postprocessed_action": action}
        self._history.append((call, obs))
        meta = {k: info[k] for k in ("served_by", "error") if k in info}
        if truncated:
            meta["truncated"] = True
        return {"observations": [{"role": "user", "content": obs}], "reward": 0.0, "done": terminated or truncated,
                "metadata": meta, "postprocessed_action": action}

    def close(self) -> None:
        self._env.close()


def _find_call(text: str) -> dict[str, Any] | None:
    """The tool call in a model's response: the first ``<tool_call>`` block, else the whole
    response if it is a JSON object with a ``name``; None if there is none."""
    m = _TOOL_CALL.search(text)
    candidate = m.group(1) if m else text.strip()
    try:
        obj = json.loads(candidate)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return {"name": obj["name"], "arguments": obj.get("arguments", {})}
    return None
