"""Workspace specs: what a live workspace is made of, read from a TOML file.

A spec names the root file system (the host's own root, read-only, or a directory), the
environment, an optional init service, resource limits, networking and the tools a policy may
call, each a command template::

    name = "default"
    root = "host"

    [limits]
    memory = "1GiB"

    [tools.cat]
    command = "cat -- {path}"      # each {argument} is shell-quoted when substituted
    cacheable = true

    [tools.shell]
    command = "{command}"
    shell = "main"                 # runs in the persistent shell session "main"
    stateful = true

:func:`load_spec` checks the whole file and raises :class:`ConfigError` naming the file, the
key path (``tools.cat.timeout``) and what was expected; :func:`render_call` turns a
:class:`ToolCall` into the command to run.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import shlex
import string
import tomllib
from typing import Annotated, Any

import msgspec

from ._exceptions import ConfigError
from ._trace import ToolCall

__all__ = ["Limits", "NetworkSpec", "RenderedCall", "ToolSpec", "WorkspaceSpec", "load_spec", "render_call"]

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
"""The environment every workspace starts from; :attr:`WorkspaceSpec.env` is laid over it."""

PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
_NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=_NAME_RE)]
AbsPath = Annotated[str, msgspec.Meta(pattern=r"^/")]


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tool a policy may call, and how to run it."""

    command: str | tuple[str, ...]
    """A shell command template (each ``{argument}`` is replaced by the argument's value,
    shell-quoted), or an argv list whose items are templates (substituted as they are, no
    shell involved)."""
    cacheable: bool = False
    """Whether the call's result depends only on the workspace state before it, so the prefix
    tree may serve it again (a tool that reads the clock or the network is not)."""
    timeout: PosFloat = 60.0
    """Seconds the call may run; then its whole process group is killed and the result says
    ``timed_out``."""
    shell: Name | None = None
    """Run the command in this persistent shell session (created at first use; ``cd`` and
    variables persist between calls) instead of a fresh process. Needs a string command."""
    stateful: bool = False
    """The call's effect lives in process state (a shell session, a server's memory), not only
    in files, so a workspace rebuilt from a file-system snapshot must replay it."""
    defaults: dict[str, str | int | float | bool] = {}
    """Values of optional arguments, used when a call leaves them out."""
    raw: tuple[str, ...] = ()
    """Arguments substituted as they are, not shell-quoted: for a tool whose argument is
    itself a shell command (``command = "{command}"``, ``raw = ["command"]``)."""
    description: str = ""
    """What the tool does, for the policy's tool list."""


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource limits of each workspace (its cgroup)."""

    memory: PosInt | None = None
    """Memory limit in bytes (the file may write ``"512MiB"``); past it the kernel OOM-kills a
    process of the workspace and the call fails with :class:`BackendError`."""
    pids: PosInt | None = None
    """Most processes and threads at once."""
    output: PosInt = 1 << 20
    """Bytes of stdout and of stderr kept per call (``"1MiB"``); the rest is dropped and the
    result says ``truncated``."""


class NetworkSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Networking of each workspace. It always has its own network namespace with loopback up."""

    veth: bool = False
    """Add a veth pair: ``eth0`` inside, its peer in the host's namespace."""
    bridge: str | None = None
    """Attach the host end to this existing bridge."""
    address: str | None = None
    """CIDR address of ``eth0`` inside, e.g. ``"10.200.0.2/24"``."""
    peer_address: str | None = None
    """CIDR address of the host end (when it is not on a bridge)."""
    gateway: str | None = None
    """Default route inside the workspace, e.g. the host end's address."""


class WorkspaceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A workspace: root file system, environment, init service, limits, network and tools."""

    name: Name
    """The spec's name; workspaces are named after it."""
    root: str = "host"
    """``"host"``: the host's own root, read-only, as the lowest layer; or an absolute path
    (relative paths are relative to the spec file) to a root file system directory."""
    hostname: Name = "bunshin"
    """Host name inside the workspace."""
    cwd: AbsPath = "/root"
    """Working directory of every command and shell session."""
    env: dict[str, str] = {}
    """Environment variables, laid over :data:`DEFAULT_ENV`."""
    init: tuple[str, ...] | None = None
    """A command (argv) started in the background when the workspace boots, such as a server
    the tools talk to."""
    shell: AbsPath = "/bin/bash"
    """The program of persistent shell sessions (``/bin/sh`` when it is missing)."""
    empty_dirs: tuple[AbsPath, ...] = ("/tmp", "/var/tmp", "/run")
    """Directories that start empty (the root's content there is hidden). They stay in the
    writable layer, so snapshots include them."""
    limits: Limits = Limits()
    """Resource limits."""
    network: NetworkSpec = NetworkSpec()
    """Networking."""
    tools: dict[Name, ToolSpec] = {}
    """The tools, by name."""
    path: str | None = None
    """The file the spec was read from (set by :func:`load_spec`)."""

    @property
    def environment(self) -> dict[str, str]:
        """The full environment of commands: :data:`DEFAULT_ENV` with :attr:`env` over it."""
        return {**DEFAULT_ENV, **self.env}

    @property
    def root_dir(self) -> str:
        """The root file system's directory on the host (``/`` for ``"host"``)."""
        return "/" if self.root == "host" else self.root


class RenderedCall(msgspec.Struct, frozen=True):
    """A tool call turned into something to run; exactly one of argv and command is set."""

    tool: str
    """The tool's name."""
    argv: tuple[str, ...] | None
    """Run this program directly (an argv template)."""
    command: str | None
    """Run this shell command (in :attr:`session` if set, else with ``sh -c``)."""
    session: str | None
    """The persistent shell session to run :attr:`command` in, or None."""
    timeout: float
    """Seconds the call may run."""


_BYTE_FIELDS = {("limits", "memory"), ("limits", "output")}


def load_spec(path: str | os.PathLike[str]) -> WorkspaceSpec:
    """Read and check the workspace spec in the TOML file *path*.

    Raises:
        ConfigError: When the file cannot be read, is not valid TOML, has an unknown key, a
            value of the wrong type or range, a bad tool template, or names a root directory
            that does not exist. The message names the file, the key path and what was
            expected.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the workspace spec: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return spec_from_dict(data, source=path)


def spec_from_dict(data: dict[str, Any], *, source: str = "<spec>") -> WorkspaceSpec:
    """Check and convert a parsed spec document (see :func:`load_spec`); *source* names it in
    errors and resolves a relative root."""
    data = dict(data)
    if "path" in data:
        raise ConfigError(f"{source}: path: unknown key (it is set from the file's location)")
    _check_keys(data, WorkspaceSpec, (), source)
    for section, key in _BYTE_FIELDS:
        sect = data.get(section)
        if isinstance(sect, dict) and isinstance(sect.get(key), str):
            data[section] = sect = dict(sect)
            sect[key] = _parse_bytes(sect[key], f"{section}.{key}", source)
    if "name" not in data and source != "<spec>":
        data["name"] = re.sub(r"[^A-Za-z0-9_.-]", "-", os.path.splitext(os.path.basename(source))[0]) or "workspace"
    # Tables keyed by user names are converted one entry at a time, so that an error names the
    # entry (msgspec would say ``tools[...]``).
    if isinstance(data.get("tools"), dict):
        for name in data["tools"]:
            if not re.match(_NAME_RE, name):
                raise ConfigError(f"{source}: tools.{name}: a tool name is letters, digits, '_', '.', '-'")
        data["tools"] = {name: _convert(tool, ToolSpec, f"tools.{name}", source) for name, tool in data["tools"].items()}
    if isinstance(data.get("env"), dict):
        for key, value in data["env"].items():
            if not isinstance(value, str):
                raise ConfigError(f"{source}: env.{key}: expected a string, got {type(value).__name__}")
    spec = _convert(data, WorkspaceSpec, "", source)
    root = spec.root
    if root != "host":
        if not os.path.isabs(root):
            root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(source)), root))
        if not os.path.isdir(root):
            raise ConfigError(f"{source}: root: the root directory {root} does not exist; expected \"host\" or a directory")
    for name, tool in spec.tools.items():
        _check_tool(name, tool, source)
    _check_network(spec.network, source)
    if spec.init is not None and not spec.init:
        raise ConfigError(f"{source}: init: expected a non-empty argv list")
    return msgspec.structs.replace(spec, root=root, path=source if source != "<spec>" else None)


def render_call(spec: WorkspaceSpec, call: ToolCall) -> RenderedCall:
    """Turn *call* into the command its tool's template makes.

    Raises:
        ConfigError: When the tool is not declared in *spec*, an argument the template uses is
            missing, an argument is given that the template does not use, or a value is not a
            string, number or boolean.
    """
    tool = spec.tools.get(call.name)
    if tool is None:
        hint = _did_you_mean(call.name, spec.tools)
        declared = ", ".join(sorted(spec.tools)) or "none"
        raise ConfigError(f"tool {call.name!r} is not declared in the workspace spec {spec.name!r}{hint}; declared: {declared}")
    template = tool.command
    fields = _fields(template)
    args = {**tool.defaults, **call.arguments}
    missing = sorted(fields - set(args))
    extra = sorted(set(args) - fields)
    if missing:
        raise ConfigError(f"tool {call.name!r}: missing argument {', '.join(map(repr, missing))}; it takes {_list(fields)}")
    if extra:
        raise ConfigError(f"tool {call.name!r}: unexpected argument {', '.join(map(repr, extra))}; it takes {_list(fields)}")
    values = {}
    for k, v in args.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif not isinstance(v, (str, int, float)):
            raise ConfigError(f"tool {call.name!r}: argument {k!r} must be a string, number or boolean, got {type(v).__name__}")
        values[k] = str(v)
    if isinstance(template, str):
        command = template.format_map({k: v if k in tool.raw else shlex.quote(v) for k, v in values.items()})
        return RenderedCall(call.name, None, command, tool.shell, tool.timeout)
    argv = tuple(item.format_map(values) for item in template)
    if tool.shell is not None:
        return RenderedCall(call.name, None, shlex.join(argv), tool.shell, tool.timeout)
    return RenderedCall(call.name, argv, None, None, tool.timeout)


# --- checks ---------------------------------------------------------------------------------


def _check_keys(data: Any, cls: type, where: tuple[str, ...], source: str) -> None:
    """Reject unknown keys in *data* (for the struct *cls*), recursing into sub-tables."""
    if not isinstance(data, dict):
        return
    known = cls.__struct_fields__
    for key, value in data.items():
        keypath = ".".join((*where, key))
        if key not in known:
            raise ConfigError(f"{source}: {keypath}: unknown key{_did_you_mean(key, known)}; expected one of {_list(known)}")
        sub = {"limits": Limits, "network": NetworkSpec}.get(key) if cls is WorkspaceSpec else None
        if sub is not None:
            _check_keys(value, sub, (*where, key), source)
        elif cls is WorkspaceSpec and key == "tools" and isinstance(value, dict):
            for name, tool in value.items():
                _check_keys(tool, ToolSpec, (*where, key, name), source)


def _check_tool(name: str, tool: ToolSpec, source: str) -> None:
    where = f"{source}: tools.{name}.command"
    if isinstance(tool.command, str):
        if not tool.command.strip():
            raise ConfigError(f"{where}: expected a non-empty command template")
    elif not tool.command:
        raise ConfigError(f"{where}: expected a non-empty argv list")
    try:
        fields = _fields(tool.command)
    except ValueError as exc:
        raise ConfigError(f"{where}: bad template: {exc}") from None
    for key in ("defaults", "raw"):
        unused = sorted(set(getattr(tool, key)) - fields)
        if unused:
            raise ConfigError(f"{source}: tools.{name}.{key}: {unused[0]!r} is not an argument of the template; it takes {_list(fields)}")


def _check_network(net: NetworkSpec, source: str) -> None:
    for key in ("address", "peer_address"):
        value = getattr(net, key)
        if value is None:
            continue
        try:
            ipaddress.ip_interface(value)
        except ValueError:
            raise ConfigError(f"{source}: network.{key}: expected a CIDR address like \"10.200.0.2/24\", got {value!r}") from None
        if "/" not in value:
            raise ConfigError(f"{source}: network.{key}: expected a prefix length, e.g. {value}/24")
    if net.gateway is not None:
        try:
            ipaddress.ip_address(net.gateway)
        except ValueError:
            raise ConfigError(f"{source}: network.gateway: expected an IP address, got {net.gateway!r}") from None
    if not net.veth and any(v is not None for v in (net.bridge, net.address, net.peer_address, net.gateway)):
        raise ConfigError(f"{source}: network: bridge, address, peer_address and gateway need veth = true")
    if net.bridge is not None and net.peer_address is not None:
        raise ConfigError(f"{source}: network: peer_address is for a host end not on a bridge; give the bridge the address")


def _fields(template: str | tuple[str, ...]) -> set[str]:
    """The placeholder names of *template*; raises ValueError on a bad one."""
    items = [template] if isinstance(template, str) else list(template)
    names: set[str] = set()
    for item in items:
        for _, field, spec, conv in string.Formatter().parse(item):
            if field is None:
                continue
            if not field.isidentifier():
                raise ValueError(f"placeholder {{{field}}} is not an argument name (write {{{{ and }}}} for braces)")
            if spec or conv:
                raise ValueError(f"placeholder {{{field}}} may not have a format spec or conversion")
            names.add(field)
    return names


def _parse_bytes(text: str, keypath: str, source: str) -> int:
    import argparse

    from ._cli import parse_bytes

    try:
        return parse_bytes(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{source}: {keypath}: {exc}") from None


def _convert(data: Any, cls: type, where: str, source: str) -> Any:
    try:
        return msgspec.convert(data, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(exc, where)}") from None


def _explain(exc: msgspec.ValidationError, prefix: str = "") -> str:
    """Turn msgspec's ``Expected `int`, got `str` - at `$.tools.x.timeout``` into
    ``tools.x.timeout: expected `int`, got `str```."""
    msg = str(exc)
    m = re.fullmatch(r"(.*) - at `\$\.?(.*)`", msg, re.DOTALL)
    what, where = m.groups() if m else (msg, "")
    what = what.replace("`str` matching regex '^/'", "an absolute path").replace(
        f"`str` matching regex '{_NAME_RE}'", "a name (letters, digits, '_', '.', '-')")
    where = ".".join(p for p in (prefix, where) if p)
    if what.startswith("Object missing required field"):
        where = ".".join(p for p in (where, what.split("`")[1]) if p)
        what = "missing required key"
    what = what.replace(" | null", "")
    return f"{where or '(top level)'}: {what[:1].lower() + what[1:]}"


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _list(names: Any) -> str:
    names = sorted(names)
    return ", ".join(names) if names else "no arguments"
