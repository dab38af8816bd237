"""Workspace specs: loading, every kind of bad input, and rendering tool calls."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from bunshin_async import ConfigError, ToolCall, WorkspaceSpec, load_spec, render_call

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "workspace.toml"


def write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "ws.toml"
    path.write_text(text)
    return path


def test_bundled_example_loads():
    spec = load_spec(EXAMPLE)
    assert isinstance(spec, WorkspaceSpec)
    assert spec.root == "host" and spec.root_dir == "/"
    assert spec.limits.memory == 1 << 30 and spec.limits.output == 256 << 10
    assert spec.tools["shell"].shell == "main" and spec.tools["shell"].stateful
    assert spec.tools["cat"].cacheable and not spec.tools["write_file"].cacheable
    assert spec.environment["PYTHONDONTWRITEBYTECODE"] == "1" and "PATH" in spec.environment
    assert spec.path == str(EXAMPLE)


def test_minimal_spec_and_defaults(tmp_path):
    spec = load_spec(write(tmp_path, ""))
    assert spec.name == "ws" and spec.tools == {} and spec.limits.memory is None
    assert spec.empty_dirs == ("/tmp", "/var/tmp", "/run")


def test_relative_root_resolves_against_the_file(tmp_path):
    (tmp_path / "rootfs").mkdir()
    spec = load_spec(write(tmp_path, 'root = "rootfs"'))
    assert spec.root == str(tmp_path / "rootfs")


@pytest.mark.parametrize(
    "text, message",
    [
        ("name = ", "not valid TOML"),
        ("nmae = 'x'", "nmae: unknown key (did you mean 'name'?)"),
        ("[limits]\nmemroy = '1GiB'", "limits.memroy: unknown key (did you mean 'memory'?)"),
        ("[tools.a]\ncommand = 'x'\ntimeot = 3", "tools.a.timeot: unknown key (did you mean 'timeout'?)"),
        ("[tools.a]\ncommand = 'x'\ntimeout = 'soon'", "tools.a.timeout: expected `float`, got `str`"),
        ("[tools.a]\ncommand = 'x'\ntimeout = -1", "tools.a.timeout: expected `float` > 0.0"),
        ("[tools.a]\ncacheable = true", "tools.a.command: missing required key"),
        ("[tools.a]\ncommand = ''", "tools.a.command: expected a non-empty command template"),
        ("[tools.a]\ncommand = []", "tools.a.command: expected a non-empty argv list"),
        ("[tools.a]\ncommand = 'cat {0}'", "tools.a.command: bad template: placeholder {0} is not an argument name"),
        ("[tools.a]\ncommand = 'cat {path'", "tools.a.command: bad template"),
        ("[tools.a]\ncommand = 'cat {p}'\ndefaults = {q = 1}", "tools.a.defaults: 'q' is not an argument"),
        ("[tools.a]\ncommand = 'cat {p}'\nraw = ['q']", "tools.a.raw: 'q' is not an argument"),
        ("[tools.'bad name']\ncommand = 'x'", "tools.bad name: a tool name is letters"),
        ("[limits]\nmemory = 'lots'", "limits.memory: invalid size 'lots'"),
        ("[limits]\nmemory = 0", "limits.memory: expected `int` >= 1"),
        ("[limits]\npids = 1.5", "limits.pids: expected `int`, got `float`"),
        ("[network]\nveth = true\naddress = '10.0.0.300/24'", "network.address: expected a CIDR address"),
        ("[network]\naddress = '10.0.0.2/24'", "network: bridge, address, peer_address and gateway need veth = true"),
        ("hostname = ''", "hostname: expected `str` of length >= 1"),
        ("cwd = 'relative'", "cwd: expected an absolute path"),
        ("init = []", "init: expected a non-empty argv list"),
        ("env = {A = 1}", "env.A: expected a string, got int"),
        ("path = '/x'", "path: unknown key"),
    ],
)
def test_bad_specs_name_file_key_and_expectation(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_root_directory_is_named(tmp_path):
    path = write(tmp_path, 'root = "/no/such/rootfs"')
    with pytest.raises(ConfigError, match=r"root: the root directory /no/such/rootfs does not exist"):
        load_spec(path)


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the workspace spec"):
        load_spec(tmp_path / "missing.toml")


def test_render_quotes_arguments_in_shell_templates():
    spec = load_spec(EXAMPLE)
    r = render_call(spec, ToolCall("cat", {"path": "a b; rm -rf /"}))
    assert r.argv is None and r.session is None and r.timeout == 10
    assert shlex.split(r.command) == ["cat", "--", "a b; rm -rf /"]
    r = render_call(spec, ToolCall("ls"))  # the default argument
    assert shlex.split(r.command) == ["ls", "-la", "--", "."]
    r = render_call(spec, ToolCall("shell", {"command": "cd /tmp && ls"}))
    assert (r.command, r.session) == ("cd /tmp && ls", "main")
    r = render_call(spec, ToolCall("python", {"code": "print({1: 2})"}))
    assert r.argv == ("python3", "-c", "print({1: 2})") and r.command is None
    r = render_call(spec, ToolCall("write_file", {"path": "/tmp/x", "content": 3}))
    assert "'3'" in r.command or " 3 " in r.command


def test_render_errors():
    spec = load_spec(EXAMPLE)
    with pytest.raises(ConfigError, match=r"tool 'sehll' is not declared .*did you mean 'shell'"):
        render_call(spec, ToolCall("sehll", {"command": "ls"}))
    with pytest.raises(ConfigError, match="missing argument 'path'; it takes path"):
        render_call(spec, ToolCall("cat"))
    with pytest.raises(ConfigError, match="unexpected argument 'mode'"):
        render_call(spec, ToolCall("cat", {"path": "x", "mode": "r"}))
    with pytest.raises(ConfigError, match="must be a string, number or boolean"):
        render_call(spec, ToolCall("cat", {"path": ["x"]}))
