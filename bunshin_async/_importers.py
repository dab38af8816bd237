"""Importers: public agent-trajectory formats into Bunshin's trace format.

Three formats are read (the field-by-field mapping is in ``docs/traces.md``):

- ``openai``: OpenAI chat-message trajectories with tool calls, in the tau-bench layout (a
  JSON list of ``{task_id, trial, reward, info, traj}``); see :func:`import_openai`;
- ``swe-agent``: SWE-agent ``.traj`` files, one per rollout; see :func:`import_swe_agent`;
- ``asciinema``: asciinema v2 recordings (``.cast``) of shell sessions; see
  :func:`import_asciinema`.

None of these formats records everything a trace holds. What is missing is filled from a
stated model (:class:`ImportModel`) and the field is named in :attr:`Step.modelled`. Every
importer also keeps a small index of the id-like values each observation contained (see
:func:`observation_values`), in ``trace.meta["observation_values"]``, so a Spec Tool Selector
can learn that an id returned by one call is passed to the next even though the trace keeps
only observation digests.

Bad or truncated input is a :class:`TraceError` naming the file, the record (index or line
number) and the field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from ._exceptions import TraceError
from ._trace import (
    TRACE_VERSION,
    ContextMessage,
    MemoryProfile,
    Rollout,
    Step,
    Task,
    ToolCall,
    Trace,
    observation_digest,
)

__all__ = [
    "IMPORT_FORMATS",
    "ImportModel",
    "import_asciinema",
    "import_openai",
    "import_swe_agent",
    "import_trace",
    "observation_index",
    "observation_values",
]

MiB = 1 << 20
GiB = 1 << 30

IMPORT_FORMATS = ("openai", "swe-agent", "asciinema")
"""The formats :func:`import_trace` reads."""

OBSERVATION_VALUES_KEY = "observation_values"

# Tool names (or name prefixes) that only read the workspace. Used for the dirtied-bytes model.
_READ_ONLY_PREFIXES = ("get_", "search_", "list_", "find_", "read_", "lookup_", "view_", "check_")
_READ_ONLY_NAMES = frozenset({
    "calculate", "think", "open", "goto", "scroll_up", "scroll_down", "search_dir", "search_file",
    "find_file", "ls", "cat", "head", "tail", "grep", "find", "pwd", "echo", "wc", "less", "more",
    "which", "file", "stat", "du", "df", "tree", "diff",
})
# Shell programs whose output depends on more than the workspace (clock, network, processes,
# randomness): their calls are not cacheable.
_NONDETERMINISTIC_PROGRAMS = frozenset({
    "date", "time", "curl", "wget", "ping", "ssh", "scp", "rsync", "nc", "apt", "apt-get", "pip",
    "pip3", "npm", "yarn", "top", "htop", "ps", "uptime", "sleep", "watch", "free", "uuidgen",
    "shuf", "mktemp", "random", "kill", "pkill", "jobs",
})
_NONDETERMINISTIC_GIT = frozenset({"fetch", "pull", "push", "clone", "ls-remote"})
# SWE-agent's own commands (its tools); any other action is a shell command (tool ``bash``).
SWE_AGENT_COMMANDS = frozenset({
    "open", "goto", "scroll_up", "scroll_down", "create", "edit", "insert", "append", "search_dir",
    "search_file", "find_file", "submit", "str_replace_editor", "filemap", "view", "exit_forfeit",
})


class ImportModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model that fills what a format does not record (see ``docs/traces.md``).

    The defaults were chosen from public figures before looking at any imported result, and
    are stated here so an import is reproducible; every value an importer takes from this
    model is listed in the step's ``modelled`` field.
    """

    tokens_per_second: float = 50.0
    """Decode speed of the policy model, output tokens per second (a served 7-70B model on
    one GPU decodes about 30-100 tokens/s)."""
    first_token_seconds: float = 0.5
    """Latency before the first token of each model message (prefill and queueing)."""
    chars_per_token: float = 4.0
    """Characters per token, for counting tokens without a tokenizer (English text and JSON
    average close to 4 with GPT-style BPE tokenizers)."""
    default_exec_time: float = 1.0
    """Seconds a tool call runs when the format records no time: a round trip to a tool
    server in a containerised workspace."""
    exec_times: dict[str, float] = {}
    """Per-tool overrides of ``default_exec_time``."""
    read_only_dirtied_bytes: int = 4096
    """Bytes a read-only call dirties (a page of logs and caches)."""
    write_dirtied_bytes: int = 256 * 1024
    """Bytes a call that changes the workspace dirties."""
    non_cacheable: tuple[str, ...] = ()
    """Tool names to mark non-cacheable in addition to the format's rule."""
    image_bytes: int | None = None
    """The tasks' file-backed memory; None takes the format's default."""
    runtime_bytes: int | None = None
    """The tasks' anonymous memory; None takes the format's default."""
    boot_time: float | None = None
    """Seconds to boot a task's workspace; None takes the format's default."""
    max_values: int = 64
    """Most values kept per observation in the observation-values index."""

    def tokens(self, text: str) -> int:
        """Tokens in *text*, estimated from its length."""
        return max(1, round(len(text) / self.chars_per_token)) if text else 0

    def think(self, texts: Iterable[str]) -> float:
        """Seconds to generate each of *texts* as one model message."""
        return sum(self.first_token_seconds + self.tokens(t) / self.tokens_per_second for t in texts)

    def exec_time(self, tool: str) -> float:
        """Seconds *tool* runs, from the model."""
        return self.exec_times.get(tool, self.default_exec_time)

    def dirtied(self, tool: str) -> int:
        """Bytes *tool* dirties, from the model."""
        return self.read_only_dirtied_bytes if is_read_only(tool) else self.write_dirtied_bytes

    def memory(self, image: int, runtime: int, boot: float) -> MemoryProfile:
        """The tasks' memory profile: the model's values where set, else the format's."""
        return MemoryProfile(
            image_bytes=self.image_bytes if self.image_bytes is not None else image,
            runtime_bytes=self.runtime_bytes if self.runtime_bytes is not None else runtime,
            boot_time=self.boot_time if self.boot_time is not None else boot,
        )

    def check(self) -> None:
        """Raise :class:`TraceError` if a value is out of range."""
        for name in ("tokens_per_second", "chars_per_token"):
            if not getattr(self, name) > 0:
                raise TraceError(f"import model: {name} must be > 0, not {getattr(self, name)!r}")
        for name in ("first_token_seconds", "default_exec_time", "read_only_dirtied_bytes", "write_dirtied_bytes"):
            if getattr(self, name) < 0:
                raise TraceError(f"import model: {name} must be >= 0, not {getattr(self, name)!r}")


def is_read_only(tool: str) -> bool:
    """Whether *tool* only reads the workspace, by name (see ``docs/traces.md``)."""
    return tool in _READ_ONLY_NAMES or tool.startswith(_READ_ONLY_PREFIXES)


def shell_cacheable(command: str) -> bool:
    """Whether a shell command's output depends only on the workspace: False when one of its
    programs reads the clock, the network, processes or randomness."""
    for part in re.split(r"\|\||&&|[;|&]", command):
        words = part.split()
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]  # environment assignments
        if words and words[0] in ("sudo", "env", "nohup", "timeout") and len(words) > 1:
            words = words[1:]
        if not words:
            continue
        prog = os.path.basename(words[0])
        if prog in _NONDETERMINISTIC_PROGRAMS:
            return False
        if prog == "git" and len(words) > 1 and words[1] in _NONDETERMINISTIC_GIT:
            return False
    return True


# -- observation values ------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-./@:]{1,126}[A-Za-z0-9_]")


def _id_like(s: str) -> bool:
    return 3 <= len(s) <= 128 and any(c.isdigit() for c in s) and not any(c.isspace() for c in s)


def observation_values(text: str | bytes, limit: int = 64) -> tuple[str, ...]:
    """The id-like values in an observation, in order of first appearance, at most *limit*.

    A value looks like an id when it has 3 to 128 characters, no white space and at least one
    digit (``"JG7FMM"``, ``"credit_card_4421486"``, ``"2024-05-20"``, ``"1532"``). A JSON
    observation contributes such string leaves, object keys and integers; other text such
    tokens (file names, paths, hashes). These are what a later call may copy into its
    arguments.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out: dict[str, None] = {}
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, (dict, list)):
        stack: list[Any] = [doc]
        while stack and len(out) < limit:
            x = stack.pop()
            if isinstance(x, dict):
                for k, v in reversed(list(x.items())):
                    stack.append(v)
                    stack.append(("key", k))
            elif isinstance(x, list):
                stack.extend(reversed(x))
            elif isinstance(x, tuple):
                if _id_like(x[1]):
                    out.setdefault(x[1])
            elif isinstance(x, str):
                if _id_like(x):
                    out.setdefault(x)
            elif isinstance(x, int) and not isinstance(x, bool):
                out.setdefault(str(x))
    else:
        for m in _TOKEN_RE.finditer(text):
            if len(out) >= limit:
                break
            if _id_like(m.group()):
                out.setdefault(m.group())
    return tuple(list(out)[:limit])


def observation_index(trace: Trace) -> dict[str, tuple[str, ...]]:
    """The observation-values index an importer stored in *trace* (digest to values); empty
    if there is none."""
    raw = trace.meta.get(OBSERVATION_VALUES_KEY)
    if not isinstance(raw, str):
        return {}
    try:
        index = msgspec.json.decode(raw, type=dict[str, list[str]])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(f"`$.meta.{OBSERVATION_VALUES_KEY}` is not an observation-values index: {exc}") from None
    return {k: tuple(v) for k, v in index.items()}


class _Builder:
    """Collects tasks, rollouts and observation values, then builds the trace."""

    def __init__(self, model: ImportModel) -> None:
        model.check()
        self.model = model
        self.tasks: dict[str, Task] = {}
        self.rollouts: dict[str, list[Rollout]] = {}
        self.values: dict[str, list[str]] = {}

    def observe(self, text: str | bytes) -> tuple[str, int]:
        data = text.encode() if isinstance(text, str) else text
        digest = observation_digest(data)
        if digest not in self.values:
            vals = observation_values(data, self.model.max_values)
            if vals:
                self.values[digest] = list(vals)
        return digest, len(data)

    def add(self, task: Task, rollout: Rollout) -> None:
        self.tasks.setdefault(task.id, task)
        self.rollouts.setdefault(task.id, []).append(rollout)

    def build(self, name: str, meta: dict[str, str | int | float | bool]) -> Trace:
        rollouts = [r for rs in self.rollouts.values() for r in sorted(rs, key=lambda r: r.sample)]
        meta = dict(meta)
        m = self.model
        meta.update(
            tokens_per_second=m.tokens_per_second, first_token_seconds=m.first_token_seconds,
            chars_per_token=m.chars_per_token, default_exec_time=m.default_exec_time,
        )
        if self.values:
            meta[OBSERVATION_VALUES_KEY] = msgspec.json.encode(self.values, order="sorted").decode()
        return Trace(version=TRACE_VERSION, name=name, tasks=list(self.tasks.values()), rollouts=rollouts, meta=meta)


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise TraceError(f"{path}: the file is empty")
    try:
        return json.loads(data)
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError) and exc.pos >= len(data.rstrip()):
            raise TraceError(f"{path}: the file is truncated (input ended in the middle of a value)") from None
        raise TraceError(f"{path}: not valid JSON: {exc}") from None


def _want(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise TraceError(f"{where}: {what}")


# -- OpenAI chat messages (tau-bench) ----------------------------------------------------------


def import_openai(
    path: str | os.PathLike[str], *, model: ImportModel | None = None, name: str | None = None
) -> Trace:
    """Import OpenAI chat-message trajectories in the tau-bench layout.

    The file is a JSON list of records ``{task_id, trial, reward, info, traj}``; ``traj`` is a
    list of chat messages. Each task becomes a :class:`Task` and its trials the samples of one
    group (epoch 0, group 0, sample = trial). Each tool call of an assistant message becomes a
    step; the ``tool`` message answering it (matched by ``tool_call_id``) is its observation.
    Think and execution times and dirtied bytes come from *model*; every tool is cacheable
    (tau-bench tools, writes included, are deterministic functions of the task's database)
    unless named in ``model.non_cacheable``. Records are ordered group by group, samples in
    trial order.

    Raises:
        TraceError: If the file is not such a list, naming the record and field.
    """
    model = model or ImportModel()
    path = os.fspath(path)
    doc = _read_json(path)
    _want(isinstance(doc, list), f"{path}: `$`", f"expected a list of trajectory records, got {type(doc).__name__}")
    b = _Builder(model)
    profile = model.memory(256 * MiB, 64 * MiB, 2.0)
    seen: dict[tuple[str, int], int] = {}
    for i, rec in enumerate(doc):
        where = f"{path}: record {i}"
        _want(isinstance(rec, dict), where, f"expected an object, got {type(rec).__name__}")
        for field in ("task_id", "traj"):
            _want(field in rec, where, f"missing field `{field}`")
        tid = rec["task_id"]
        _want(isinstance(tid, (int, str)) and not isinstance(tid, bool) and str(tid) != "",
              f"{where} field `task_id`", f"expected an integer or a non-empty string, got {tid!r}")
        trial = rec.get("trial", 0)
        _want(isinstance(trial, int) and not isinstance(trial, bool) and trial >= 0,
              f"{where} field `trial`", f"expected an integer >= 0, got {trial!r}")
        reward = rec.get("reward", 0.0)
        _want(isinstance(reward, (int, float)) and not isinstance(reward, bool),
              f"{where} field `reward`", f"expected a number, got {reward!r}")
        task_id = str(tid)
        if (task_id, trial) in seen:
            raise TraceError(f"{where}: task {task_id!r} trial {trial} already appears in record {seen[task_id, trial]}")
        seen[task_id, trial] = i
        steps, final = _openai_steps(rec["traj"], model, b, where)
        info = rec.get("info")
        desc = ""
        if isinstance(info, dict) and isinstance(info.get("task"), dict):
            instr = info["task"].get("instruction")
            desc = instr if isinstance(instr, str) else ""
        b.add(Task(id=task_id, memory=profile, description=desc),
              Rollout(epoch=0, task=task_id, group=0, sample=trial, reward=float(reward), steps=steps,
                      final_think_time=final))
    if not doc:
        raise TraceError(f"{path}: `$`: the list holds no trajectory records")
    return b.build(name or os.path.splitext(os.path.basename(path))[0],
                   {"importer": "openai", "source": os.path.basename(path)})


_OPENAI_MODELLED = ("think_time", "exec_time", "dirtied_bytes")


def _openai_steps(traj: Any, model: ImportModel, b: _Builder, where: str) -> tuple[list[Step], float]:
    _want(isinstance(traj, list), f"{where} field `traj`", f"expected a list of messages, got {type(traj).__name__}")
    answers: dict[str, list[tuple[int, str]]] = {}  # call id -> (message index, content)
    for j, msg in enumerate(traj):
        _want(isinstance(msg, dict), f"{where} field `traj[{j}]`", "expected a message object")
        role = msg.get("role")
        _want(isinstance(role, str), f"{where} field `traj[{j}].role`", f"expected a string, got {role!r}")
        if role == "tool":
            cid = msg.get("tool_call_id")
            _want(isinstance(cid, str), f"{where} field `traj[{j}].tool_call_id`", f"expected a string, got {cid!r}")
            content = msg.get("content")
            _want(isinstance(content, str) or content is None, f"{where} field `traj[{j}].content`",
                  f"expected a string, got {type(content).__name__}")
            answers.setdefault(cid, []).append((j, content or ""))
    steps: list[Step] = []
    pending: list[str] = []  # model and user messages since the last observation
    heard: list[ContextMessage] = []  # conversation text since the previous call
    for j, msg in enumerate(traj):
        role = msg["role"]
        content = msg.get("content")
        text = content if isinstance(content, str) else ""
        if role in ("system", "tool"):
            continue
        calls = msg.get("tool_calls") if role == "assistant" else None
        if not calls:
            pending.append(text)
            if text and role in ("user", "assistant"):
                heard.append(ContextMessage(role, text))
            continue
        _want(isinstance(calls, list), f"{where} field `traj[{j}].tool_calls`", "expected a list")
        parsed: list[tuple[ToolCall, str]] = []
        call_text = text
        for k, tc in enumerate(calls):
            f = f"{where} field `traj[{j}].tool_calls[{k}]"
            _want(isinstance(tc, dict), f + "`", "expected an object")
            fn = tc.get("function")
            _want(isinstance(fn, dict), f + ".function`", f"expected an object, got {fn!r}")
            tname = fn.get("name")
            _want(isinstance(tname, str) and tname != "", f + ".function.name`", f"expected a tool name, got {tname!r}")
            raw = fn.get("arguments", "{}")
            if isinstance(raw, str):
                try:
                    args = json.loads(raw) if raw.strip() else {}
                except ValueError as exc:
                    raise TraceError(f"{f}.function.arguments`: not valid JSON: {exc}") from None
                call_text += raw
            else:
                args = raw
                call_text += json.dumps(raw)
            _want(isinstance(args, dict), f + ".function.arguments`", f"expected a JSON object, got {type(args).__name__}")
            cid = tc.get("id")
            _want(isinstance(cid, str), f + ".id`", f"expected a string, got {cid!r}")
            # the first unused `tool` message after this one with the call's id answers it
            # (ids are not unique within a trajectory: some models reuse them)
            queue = answers.get(cid, [])
            while queue and queue[0][0] < j:
                queue.pop(0)
            if not queue:
                raise TraceError(f"{f}.id`: no `tool` message after it answers tool call {cid!r} (truncated trajectory?)")
            parsed.append((ToolCall(tname, args), queue.pop(0)[1]))
        think = model.think([*pending, call_text])
        pending = []
        for k, (call, obs) in enumerate(parsed):
            digest, size = b.observe(obs)
            steps.append(Step(
                think_time=think if k == 0 else 0.0,
                call=call,
                exec_time=model.exec_time(call.name),
                observation_digest=digest,
                observation_size=size,
                dirtied_bytes=model.dirtied(call.name),
                cacheable=call.name not in model.non_cacheable,
                modelled=_OPENAI_MODELLED,
                context=tuple(heard) if k == 0 else (),
            ))
        # the text that came with these calls was written with them, not before them: it
        # belongs to the next call's context
        heard = [ContextMessage(role, text)] if text else []
    return steps, model.think(pending)


# -- SWE-agent ---------------------------------------------------------------------------------


def _traj_files(sources: Sequence[str]) -> list[tuple[str, str]]:
    """``(path, task id)`` of every ``.traj`` file under *sources*."""
    out: list[tuple[str, str]] = []
    for src in sources:
        if os.path.isdir(src):
            found = []
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn.endswith(".traj"):
                        found.append(os.path.join(dirpath, fn))
            if not found:
                raise TraceError(f"{src}: the directory holds no .traj files")
            for p in found:
                parent = os.path.dirname(p)
                task = (os.path.basename(parent) if os.path.normpath(parent) != os.path.normpath(src)
                        else os.path.splitext(os.path.basename(p))[0])
                out.append((p, task))
        elif os.path.exists(src):
            out.append((src, os.path.splitext(os.path.basename(src))[0]))
        else:
            raise TraceError(f"{src}: no such file or directory")
    return out


def import_swe_agent(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
    model: ImportModel | None = None, name: str | None = None,
) -> Trace:
    """Import SWE-agent ``.traj`` files, one rollout per file.

    *sources* are files or directories (searched for ``*.traj``). A file's task is the name of
    the directory holding it when that is below a given directory (SWE-agent writes
    ``RUN/INSTANCE/INSTANCE.traj``, so runs of one instance group together), else the file's
    stem; the files of a task, in path order, are the samples of its group (epoch 0, group
    0). Each entry of ``trajectory`` (or, in older files without it, each assistant message of
    ``history`` carrying an ``action``) is a step: the tool is the action's first word if it
    is a SWE-agent command, else ``bash``; the arguments are ``{"command": action}``; the
    observation is the entry's ``observation``; ``execution_time`` is recorded where present.
    Think time comes from the length of the model's ``response`` (or ``thought`` plus
    ``action``).

    Raises:
        TraceError: On an unreadable or malformed file, naming the file, step and field.
    """
    model = model or ImportModel()
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = [os.fspath(s) for s in sources]
    files = _traj_files(srcs)
    b = _Builder(model)
    profile = model.memory(1536 * MiB, 512 * MiB, 10.0)
    counts: dict[str, int] = {}
    for path, task in files:
        doc = _read_json(path)
        _want(isinstance(doc, dict), f"{path}: `$`", f"expected a .traj object, got {type(doc).__name__}")
        steps = _swe_steps(doc, path, model, b)
        info = doc.get("info") if isinstance(doc.get("info"), dict) else {}
        reward = info.get("reward", 0.0)
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            reward = 0.0
        sample = counts.get(task, 0)
        counts[task] = sample + 1
        b.add(Task(id=task, memory=profile, description=task),
              Rollout(epoch=0, task=task, group=0, sample=sample, reward=float(reward), steps=steps))
    label = name or (os.path.splitext(os.path.basename(os.path.normpath(srcs[0])))[0] if len(srcs) == 1 else "swe-agent")
    return b.build(label, {"importer": "swe-agent", "source": ",".join(os.path.basename(os.path.normpath(s)) for s in srcs)})


def _swe_tool(action: str) -> str:
    words = action.split()
    if words and words[0] in SWE_AGENT_COMMANDS:
        return words[0]
    return "bash"


def _swe_steps(doc: dict[str, Any], path: str, model: ImportModel, b: _Builder) -> list[Step]:
    entries: list[tuple[str, str, str, float | None]] = []  # action, observation, model text, exec
    if "trajectory" in doc:
        traj = doc["trajectory"]
        _want(isinstance(traj, list), f"{path}: field `trajectory`", f"expected a list, got {type(traj).__name__}")
        for i, e in enumerate(traj):
            where = f"{path}: step {i} (`trajectory[{i}]`)"
            _want(isinstance(e, dict), where, "expected an object")
            action = e.get("action")
            _want(isinstance(action, str), f"{where} field `action`", f"expected a string, got {action!r}")
            obs = e.get("observation", "")
            _want(isinstance(obs, str) or obs is None, f"{where} field `observation`", f"expected a string, got {type(obs).__name__}")
            et = e.get("execution_time")
            _want(et is None or (isinstance(et, (int, float)) and not isinstance(et, bool) and et >= 0),
                  f"{where} field `execution_time`", f"expected seconds >= 0, got {et!r}")
            resp = e.get("response")
            text = resp if isinstance(resp, str) else f"{e.get('thought') or ''}{action}"
            entries.append((action, obs or "", text, None if et is None else float(et)))
    elif "history" in doc:
        hist = doc["history"]
        _want(isinstance(hist, list), f"{path}: field `history`", f"expected a list, got {type(hist).__name__}")
        for i, m in enumerate(hist):
            _want(isinstance(m, dict), f"{path}: message {i} (`history[{i}]`)", "expected an object")
            if m.get("role") != "assistant" or "action" not in m:
                continue
            action = m["action"]
            _want(isinstance(action, str), f"{path}: message {i} field `history[{i}].action`", f"expected a string, got {action!r}")
            nxt = hist[i + 1] if i + 1 < len(hist) and isinstance(hist[i + 1], dict) else None
            if nxt is None or nxt.get("role") == "assistant":
                raise TraceError(f"{path}: message {i} (`history[{i}]`): the action has no observation message after it (truncated?)")
            content = nxt.get("content", "")
            obs = content if isinstance(content, str) else json.dumps(content)
            text = m.get("content") if isinstance(m.get("content"), str) else action
            entries.append((action, obs, text, None))
    else:
        raise TraceError(f"{path}: `$`: missing field `trajectory` (or `history`); not a SWE-agent .traj file")
    steps: list[Step] = []
    opening = _swe_opening(doc)
    for action, obs, text, et in entries:
        action = action.strip()
        if not action:
            continue
        tool = _swe_tool(action)
        digest, size = b.observe(obs)
        modelled = ["think_time", "dirtied_bytes"]
        if et is None:
            modelled.insert(1, "exec_time")
        steps.append(Step(
            think_time=model.think([text]),
            call=ToolCall(tool, {"command": action}),
            exec_time=et if et is not None else model.exec_time(tool),
            observation_digest=digest,
            observation_size=size,
            dirtied_bytes=model.dirtied(tool),
            cacheable=tool not in model.non_cacheable and shell_cacheable(action),
            modelled=tuple(modelled),
            context=opening if not steps else (),
        ))
    return steps


def _swe_opening(doc: dict[str, Any]) -> tuple[ContextMessage, ...]:
    """The user messages of ``history`` before its first assistant message (the instance
    prompt with the issue), demonstrations skipped: the first step's context. Later user
    messages are observations, which the steps already record."""
    hist = doc.get("history")
    out: list[ContextMessage] = []
    for m in hist if isinstance(hist, list) else ():
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            break
        if m.get("role") != "user" or m.get("is_demo") or m.get("message_type") == "demonstration":
            continue
        content = m.get("content")
        if isinstance(content, list):  # SWE-agent 1.x: a list of parts
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and isinstance(p.get("text"), str))
        if isinstance(content, str) and content:
            out.append(ContextMessage("user", content))
    return tuple(out)


# -- asciinema ---------------------------------------------------------------------------------

_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|[\x00-\x08\x0b-\x1f\x7f](?<![\n\t])")
DEFAULT_PROMPT = r"^(?:\([^)\n]*\) )?[^\s$#%>]*[$#%>] "
"""The prompt a recording without input events is split on: an optional ``(venv) `` and a
word without spaces ending in ``$``, ``#``, ``%`` or ``>``, then a space, at the start of a
line (``user@host:~/src$ ``)."""


def _strip(text: str) -> str:
    return _ANSI_RE.sub("", text.replace("\r\n", "\n")).replace("\r", "")


def _edit_line(chars: str) -> str:
    """Apply backspaces to typed input and drop escape sequences (arrow keys, ...)."""
    chars = re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1bO.", "", chars)
    out: list[str] = []
    for c in chars:
        if c in "\x7f\b":
            if out:
                out.pop()
        elif c == "\x15":  # ctrl-u: kill the line
            out.clear()
        elif c >= " " or c == "\t":
            out.append(c)
    return "".join(out).strip()


def _cast_events(path: str) -> tuple[dict[str, Any], list[tuple[float, str, str]]]:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").split("\n")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}: line 1: the file is empty; expected an asciinema v2 header")
    try:
        header = json.loads(lines[0])
    except ValueError as exc:
        raise TraceError(f"{path}: line 1: the header is not valid JSON: {exc}") from None
    _want(isinstance(header, dict), f"{path}: line 1", "expected the header object")
    _want(header.get("version") == 2, f"{path}: line 1 field `version`",
          f"expected asciinema version 2, got {header.get('version')!r}")
    events: list[tuple[float, str, str]] = []
    last = 0.0
    n = len(lines)
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except ValueError as exc:
            if i == n or (i == n - 1 and not lines[-1].strip()):
                raise TraceError(f"{path}: line {i}: the file is truncated (the last event is cut off)") from None
            raise TraceError(f"{path}: line {i}: not a JSON event: {exc}") from None
        _want(isinstance(ev, list) and len(ev) == 3, f"{path}: line {i}", "expected an event [time, code, data]")
        t, code, data = ev
        _want(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0,
              f"{path}: line {i} field `time`", f"expected seconds >= 0, got {t!r}")
        _want(isinstance(code, str), f"{path}: line {i} field `code`", f"expected a string, got {code!r}")
        _want(isinstance(data, str), f"{path}: line {i} field `data`", f"expected a string, got {data!r}")
        _want(t >= last, f"{path}: line {i} field `time`", f"event time {t} is before the previous event's {last}")
        last = float(t)
        events.append((float(t), code, data))
    return header, events


def import_asciinema(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
    model: ImportModel | None = None, name: str | None = None, prompt: str = DEFAULT_PROMPT,
) -> Trace:
    """Import asciinema v2 recordings of shell sessions, one rollout per file.

    Tasks are assigned as for :func:`import_swe_agent` (``.cast`` files). Each command typed
    becomes a step ``shell {"command": line}``. With input events (``"i"``) a command is the
    typed line (backspaces applied) up to Enter; its think time runs from the last output
    before typing began (the prompt) to Enter, its execution from Enter to the last output
    before the next typing (or the recording's end), and its observation is that output. A
    recording without input events is split on *prompt* (a regular expression matched at the
    start of each output line): the text after the prompt is the command, think time runs
    from the prompt's appearance to the end of that line, execution to the next prompt.
    Output is compared with ANSI escapes and carriage returns removed. Times are recorded;
    only dirtied bytes are modelled.

    Raises:
        TraceError: On an unreadable or malformed recording, naming the file, line and field.
    """
    model = model or ImportModel()
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = [os.fspath(s) for s in sources]
    files: list[tuple[str, str]] = []
    for src in srcs:
        if os.path.isdir(src):
            found = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(src) for f in fs if f.endswith(".cast"))
            if not found:
                raise TraceError(f"{src}: the directory holds no .cast files")
            for p in found:
                parent = os.path.dirname(p)
                files.append((p, os.path.basename(parent) if os.path.normpath(parent) != os.path.normpath(src)
                              else os.path.splitext(os.path.basename(p))[0]))
        elif os.path.exists(src):
            files.append((src, os.path.splitext(os.path.basename(src))[0]))
        else:
            raise TraceError(f"{src}: no such file or directory")
    try:
        prompt_re = re.compile(prompt)
    except re.error as exc:
        raise TraceError(f"bad prompt pattern {prompt!r}: {exc}") from None
    b = _Builder(model)
    profile = model.memory(64 * MiB, 16 * MiB, 0.5)
    counts: dict[str, int] = {}
    for path, task in files:
        header, events = _cast_events(path)
        if any(code == "i" for _, code, _ in events):
            cmds = _cast_by_input(events)
        else:
            cmds = _cast_by_prompt(events, prompt_re)
        steps = []
        for cmd, think, exec_time, out in cmds:
            digest, size = b.observe(out)
            steps.append(Step(
                think_time=think, call=ToolCall("shell", {"command": cmd}), exec_time=exec_time,
                observation_digest=digest, observation_size=size,
                dirtied_bytes=model.dirtied(cmd.split()[0] if cmd.split() else "shell"),
                cacheable="shell" not in model.non_cacheable and shell_cacheable(cmd),
                modelled=("dirtied_bytes",),
            ))
        sample = counts.get(task, 0)
        counts[task] = sample + 1
        title = header.get("title")
        b.add(Task(id=task, memory=profile, description=title if isinstance(title, str) else task),
              Rollout(epoch=0, task=task, group=0, sample=sample, reward=0.0, steps=steps))
    label = name or (os.path.splitext(os.path.basename(os.path.normpath(srcs[0])))[0] if len(srcs) == 1 else "asciinema")
    return b.build(label, {"importer": "asciinema", "prompt": prompt,
                           "source": ",".join(os.path.basename(os.path.normpath(s)) for s in srcs)})


def _r(x: float) -> float:
    return round(max(0.0, x), 6)


def _cast_by_input(events: list[tuple[float, str, str]]) -> list[tuple[str, float, float, str]]:
    cmds: list[tuple[str, float, float, str]] = []
    typed = ""
    ready = 0.0  # when the shell last printed (its prompt) before typing began
    last_out = 0.0
    current: tuple[str, float, float] | None = None  # command, think time, Enter time
    out: list[str] = []

    def close(end: float) -> None:
        nonlocal current
        if current is not None:
            cmd, think, enter = current
            text = _strip("".join(out))
            text = text[: text.rfind("\n") + 1]  # drop the next prompt (the unfinished last line)
            cmds.append((cmd, think, _r(end - enter), text))
            current = None

    for t, code, data in events:
        if code == "o":
            last_out = t
            if current is not None:
                out.append(data)
        elif code == "i":
            if not typed:  # typing begins: the previous command has finished
                close(last_out)
                ready = last_out
            typed += data
            while (m := re.search(r"[\r\n]", typed)) is not None:
                line, typed = typed[: m.start()], typed[m.end():]
                cmd = _edit_line(line)
                if cmd:
                    close(last_out)
                    current = (cmd, _r(t - ready), t)
                    out = []
                ready = t
    close(last_out)
    return cmds


def _cast_by_prompt(events: list[tuple[float, str, str]], prompt_re: re.Pattern[str]) -> list[tuple[str, float, float, str]]:
    # split the output into lines, each with the times its first character and its end arrived
    lines: list[tuple[str, float, float]] = []
    cur = ""
    start = 0.0
    for t, code, data in events:
        if code != "o":
            continue
        for piece in re.split(r"(\n)", _strip(data)):
            if not piece:
                continue
            if not cur:
                start = t
            if piece == "\n":
                lines.append((cur, start, t))
                cur = ""
            else:
                cur += piece
    if cur:
        lines.append((cur, start, events[-1][0] if events else start))
    cmds: list[tuple[str, float, float, str]] = []
    current: tuple[str, float, float] | None = None
    out: list[str] = []
    for text, t0, t1 in lines:
        m = prompt_re.match(text)
        if m:
            if current is not None:
                cmd, think, enter = current
                cmds.append((cmd, think, _r(t0 - enter), "".join(out)))
                current = None
            cmd = text[m.end():].strip()
            if cmd:
                current = (cmd, _r(t1 - t0), t1)
                out = []
        elif current is not None:
            out.append(text + "\n")
    if current is not None:
        cmd, think, enter = current
        end = events[-1][0] if events else enter
        cmds.append((cmd, think, _r(end - enter), "".join(out)))
    return cmds


# -- dispatch ----------------------------------------------------------------------------------


def import_trace(fmt: str, sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 model: ImportModel | None = None, name: str | None = None) -> Trace:
    """Import *sources* in format *fmt* (one of :data:`IMPORT_FORMATS`).

    Raises:
        TraceError: On an unknown format or bad input.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = [os.fspath(s) for s in sources]
    if not srcs:
        raise TraceError("no input files given")
    if fmt == "openai":
        if len(srcs) != 1:
            raise TraceError(f"the openai importer reads one file; got {len(srcs)}")
        return import_openai(srcs[0], model=model, name=name)
    if fmt == "swe-agent":
        return import_swe_agent(srcs, model=model, name=name)
    if fmt == "asciinema":
        return import_asciinema(srcs, model=model, name=name)
    raise TraceError(f"unknown import format {fmt!r}; expected one of {', '.join(IMPORT_FORMATS)}")
