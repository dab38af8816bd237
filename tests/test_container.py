"""Live workspaces on this host: isolation, tools, limits, cleanup and recovery.

These tests need root (namespaces, cgroups, overlayfs) and the C extension. Each test must
leave nothing behind (the ``leak_check`` fixture in conftest.py). Time is used only for the
agent's timeouts; no test asserts a duration.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import anyio
import pytest

from bunshin_async import BackendError, ConfigError, ToolCall
from bunshin_async._spec import spec_from_dict
from bunshin_async._state import gc

try:
    from bunshin_async import _bunshin_c  # noqa: F401

    HAVE_CEXT = True
except ImportError:  # pragma: no cover
    HAVE_CEXT = False

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="live workspaces need root"),
    pytest.mark.skipif(not HAVE_CEXT, reason="the C extension is not built"),
    pytest.mark.usefixtures("leak_check"),
]

from bunshin_async._container import open_container

# A Python the workspace can see: /tmp, /var/tmp and /run are emptied inside it, so an
# interpreter living there (a venv in /tmp) is not; the system one always is.
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def make_spec(**over):
    doc = {
        "name": "t",
        "tools": {
            "sh": {"command": "{command}", "raw": ["command"], "shell": "main", "stateful": True},
            "cat": {"command": "cat -- {path}", "cacheable": True, "timeout": 5},
            "echo": {"command": ["echo", "{text}"]},
            "spin": {"command": "while :; do :; done", "timeout": 0.3},
        },
    }
    doc.update(over)
    return spec_from_dict(doc)


def run(fn, *args):
    return anyio.run(fn, *args)


def test_exec_results_and_failures(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            r = await c.exec("echo out; echo err >&2; exit 3")
            assert (r.status, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, b"out\n", b"err\n", False, False)
            r = await c.exec(["printf", "%s", "a b"])
            assert r.ok and r.stdout == b"a b"
            r = await c.exec("cat", stdin=b"fed")
            assert r.stdout == b"fed"
            r = await c.exec("head -c 5000 /dev/zero", output_limit=100)
            assert r.truncated and len(r.stdout) == 100
            r = await c.exec("no-such-command-here")
            assert r.status == 127
            with pytest.raises(BackendError, match="cannot run /no/such/program"):
                await c.exec(["/no/such/program"])
            assert (await c.exec("echo $BUNSHIN_X", env={"BUNSHIN_X": "1"})).stdout == b"1\n"
            assert (await c.exec("pwd")).stdout == b"/root\n"

    run(main)


def test_processes_hostname_and_pid1(state):
    async def main():
        async with open_container(make_spec(hostname="box"), state=state) as c:
            r = await c.exec(["sh", "-c", "hostname; ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '"])
            name, pids = r.stdout.decode().split("\n", 1)
            assert name == "box"
            seen = [int(p) for p in pids.split()]
            assert seen[0] == 1 and len(seen) <= 6  # agent, sh, ls, grep, sort, tr at most
            assert str(os.getpid()).encode() not in r.stdout
            cmdline = (await c.exec("cat /proc/1/cmdline")).stdout.split(b"\0")[0]
            assert os.path.basename(cmdline).startswith(b"python")
            assert c.pids() == [c.init_pid]

    run(main)


def test_files_are_isolated_between_workspaces_and_host(state, tmp_path):
    marker = f"/root/bunshin-test-{os.getpid()}"

    async def main():
        async with open_container(make_spec(), state=state) as a, open_container(make_spec(), state=state) as b:
            assert (await a.exec(f"echo secret > {marker} && cat {marker}")).stdout == b"secret\n"
            assert (await b.exec(f"test -e {marker}")).status == 1
            assert not os.path.exists(marker)
            assert os.path.exists(a.upper + marker)
            # the state directory and the other workspace's layers are hidden
            assert (await b.exec(f"ls -A {state.path}")).stdout == b""
            assert (await b.exec(f"test -e {a.upper}")).status == 1
            assert (await a.exec("ls -A /tmp")).stdout == b""

    run(main)


def test_network_is_loopback_only_and_private(state):
    server = textwrap.dedent("""
        import socket
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 8765)); s.listen()
        while True:
            conn, _ = s.accept(); conn.sendall(b"hello"); conn.close()
    """)
    client = textwrap.dedent("""
        import socket, sys, time
        for _ in range(200):
            try:
                print(socket.create_connection(("127.0.0.1", 8765), timeout=2).recv(5).decode()); break
            except ConnectionRefusedError:
                if sys.argv[1] == "once": print("refused"); break
                time.sleep(0.02)
    """)

    async def main():
        async with open_container(make_spec(init=[PY, "-c", server]), state=state) as a, \
                open_container(make_spec(), state=state) as b:
            assert (await a.exec(["ls", "/sys/class/net"])).stdout == b"lo\n"
            assert (await a.exec([PY, "-c", client, "retry"], timeout=30)).stdout == b"hello\n"
            assert (await b.exec([PY, "-c", client, "once"], timeout=30)).stdout == b"refused\n"
            assert (await a.ping()).init_status is None

    run(main)


def test_timeout_kills_the_process_group_and_the_workspace_goes_on(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            r = await c.exec("sleep 1000 & sleep 1000; echo never", timeout=0.3)
            assert r.timed_out and r.status == -signal.SIGKILL and r.stdout == b""
            r = await c.call(ToolCall("spin"))
            assert r.timed_out
            assert (await c.exec("echo fine")).stdout == b"fine\n"
            assert c.pids() == [c.init_pid]
            r = await c.shell("sleep 1000", timeout=0.3)
            assert r.timed_out
            assert (await c.shell("echo new session")).stdout == b"new session\n"

    run(main)


def test_persistent_shell_keeps_cwd_and_variables(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            assert (await c.call(ToolCall("sh", {"command": "cd /etc && X=42 && f() { echo f$1; }"}))).ok
            r = await c.call(ToolCall("sh", {"command": "pwd; echo $X; f 1; printf 'no newline'"}))
            assert r.stdout == b"/etc\n42\nf1\nno newline"
            r = await c.shell("echo err >&2; false")
            assert (r.status, r.stdout, r.stderr) == (1, b"", b"err\n")
            assert (await c.shell("if then")).status == 2  # a syntax error is a status
            assert (await c.shell("echo $X")).stdout == b"42\n"
            assert (await c.shell("echo other", session="two")).stdout == b"other\n"
            r = await c.shell("exit 7")
            assert r.status == 7
            assert (await c.shell("echo ${X:-unset}")).stdout == b"unset\n"
            assert sorted((await c.ping()).sessions) == ["main", "two"]

    run(main)


def test_tool_calls_render_through_the_spec(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            await c.exec("printf 'a b' > '/tmp/x y'")
            assert (await c.call(ToolCall("cat", {"path": "/tmp/x y"}))).stdout == b"a b"
            assert (await c.call(ToolCall("echo", {"text": "$HOME; ls"}))).stdout == b"$HOME; ls\n"
            with pytest.raises(ConfigError, match="not declared"):
                await c.call(ToolCall("nope"))
            with pytest.raises(ConfigError, match="missing argument 'path'"):
                await c.call(ToolCall("cat"))

    run(main)


def test_memory_limit_oom_is_reported(state):
    async def main():
        spec = make_spec(limits={"memory": "256MiB"})
        async with open_container(spec, state=state) as c:
            with pytest.raises(BackendError, match="out of memory"):
                await c.exec([PY, "-c", "a = b'x' * (1 << 30)"], timeout=60)
            assert (await c.exec("echo alive")).stdout == b"alive\n"
            mem = c.memory()
            assert 0 < mem.current <= 256 << 20

    run(main)


def test_freeze_thaw_kill_and_dead_agent(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            await c.freeze()
            assert c.cgroups.is_frozen()
            with pytest.raises(BackendError, match="frozen"):
                await c.exec("true")
            await c.thaw()
            assert (await c.exec("echo ok")).ok
            await c.kill()
            with pytest.raises(BackendError, match="agent"):
                await c.exec("true")
            await c.destroy()
            await c.destroy()  # idempotent
            with pytest.raises(BackendError, match="destroyed"):
                await c.exec("true")

    run(main)


def test_layers_kept_from_one_workspace_stack_under_another(state):
    async def main():
        async with open_container(make_spec(), state=state) as a:
            await a.exec("mkdir -p /srv/t && echo v1 > /srv/t/f && rm -f /etc/hostname")
            layer = await a.destroy(keep_upper=True)
        assert layer is not None and os.path.isfile(layer + "/srv/t/f")
        try:
            async with open_container(make_spec(), layers=[layer], state=state) as b:
                assert (await b.exec("cat /srv/t/f")).stdout == b"v1\n"
                assert (await b.exec("test -e /etc/hostname")).status == 1  # the whiteout holds
                await b.exec("echo v2 > /srv/t/f")
                assert (await b.exec("cat /srv/t/f")).stdout == b"v2\n"
            assert await anyio.Path(layer + "/srv/t/f").read_text() == "v1\n"
        finally:
            state.drop_layer(layer)

    run(main)


def test_cancelled_open_leaves_nothing(state):
    async def main():
        with anyio.move_on_after(0):
            await open_container(make_spec(), state=state)

    run(main)


def test_bad_layer_and_duplicate_name(state):
    async def main():
        with pytest.raises(ConfigError, match="not a directory"):
            await open_container(make_spec(), layers=["/no/such/layer"], state=state)
        async with open_container(make_spec(), name="same", state=state):
            with pytest.raises(ConfigError, match="already exists"):
                await open_container(make_spec(), name="same", state=state)

    run(main)


def test_veth_pair(state):
    pytest.importorskip("pyroute2")
    spec = make_spec(network={"veth": True, "address": "127.254.254.2/30"})  # loopback range only

    async def main():
        async with open_container(spec, state=state) as c:
            assert c.veth in os.listdir("/sys/class/net")
            r = await c.exec([PY, "-c", "import socket, os; print(sorted(os.listdir('/sys/class/net')))"])
            assert r.stdout == b"['eth0', 'lo']\n"
            r = await c.exec(["cat", "/proc/net/fib_trie"])
            assert b"127.254.254.2" in r.stdout
            name = c.veth
        assert name not in os.listdir("/sys/class/net")

    run(main)


# --- recovery: a controller killed at any point leaves nothing after gc -----------------------

CONTROLLER = textwrap.dedent("""
    import os, signal, sys, anyio
    from bunshin_async import _container
    from bunshin_async._spec import spec_from_dict
    from bunshin_async._state import StateDir

    state, stage = StateDir(sys.argv[1]), sys.argv[2]
    spec = spec_from_dict({"name": "crash", "limits": {"memory": "256MiB"}, "init": ["sleep", "1000"]})

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if stage == "cgroups":
        create = _container.Cgroups.create
        def create_then_die(self, **kw):
            create(self, **kw)
            die()
        _container.Cgroups.create = create_then_die
    elif stage == "booted":
        boot = _container._boot
        def boot_then_die(sock, msg):
            reply = boot(sock, msg)
            print("booted", flush=True)  # the mounts exist in the workspace now
            die()
        _container._boot = boot_then_die

    async def main():
        a = await _container.open_container(spec, state=state)
        b = await _container.open_container(spec, state=state)
        await b.freeze()  # a frozen agent never sees its socket close
        await a.exec("sleep 1000 &")
        print("running", flush=True)
        await anyio.sleep(1000)

    anyio.run(main)
""")


@pytest.mark.parametrize("stage", ["cgroups", "booted", "running"])
def test_gc_after_controller_sigkill(state, stage):
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, state.path, stage], stdout=subprocess.PIPE, text=True)
    try:
        if stage == "running":
            assert proc.stdout.readline() == "running\n"
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    records = state.list()
    assert records, "the controller recorded nothing"
    report = gc(state)
    assert report.errors == () and report.alive == 0
    assert report.records == len(records)
    assert report.dirs >= 1 and report.cgroups >= 1
    assert state.list() == []
    for rec in records:
        for path in rec.cgroups + rec.dirs:
            assert not os.path.exists(path)


def test_gc_leaves_live_owners_alone(state):
    async def main():
        async with open_container(make_spec(), state=state) as c:
            report = gc(state)
            assert report.alive == 1 and report.records == 0
            assert (await c.exec("echo still here")).ok

    run(main)


def test_same_workspace_id_in_two_state_directories(state, tmp_path):
    # Cgroups are host-wide and data directories may be shared (a state directory on a tmpfs
    # keeps its data under /var/lib/bunshin): two controllers with their own state
    # directories may name a workspace alike without colliding.
    from bunshin_async._state import StateDir

    other = StateDir(tmp_path / "other", data=state.data)

    async def main():
        async with open_container(make_spec(), name="same", state=state) as a, \
                open_container(make_spec(), name="same", state=other) as b:
            assert a.cgroups.v2 != b.cgroups.v2 and a.dir != b.dir
            await a.exec("echo a > /root/f")
            assert (await b.exec("cat /root/f")).status != 0
        with pytest.raises(ConfigError, match="already exists"):
            async with open_container(make_spec(), name="same", state=state):
                async with open_container(make_spec(), name="same", state=state):
                    pass

    run(main)
    assert gc(other).records == 0


def test_agent_shares_no_memory_with_the_controller(state):
    # The agent is cloned from the zygote, not from this process: pages this process writes
    # after the workspace booted never become the agent's private copies.
    import psutil

    from bunshin_async import _zygote
    from bunshin_async._bunshin_c import scan_pages

    heap = bytearray(b"\2" * (32 << 20))  # resident in this process before the workspace exists

    async def main():
        async with open_container(make_spec(), state=state) as c:
            agent = psutil.Process(c.init_pid)
            assert agent.ppid() == os.getpid()  # CLONE_PARENT: still this process's child
            assert c.init_pid != _zygote.running_pid()
            before = scan_pages(c.pids())
            heap[:: 4096] = b"\1" * len(heap[:: 4096])  # write every page of it
            after = scan_pages(c.pids())
            grown = (after.private - before.private) * after.page_size
            assert grown < 4 << 20, f"the agent's private memory grew {grown} bytes"
            assert (await c.exec("echo ok")).stdout == b"ok\n"

    run(main)


def test_a_dead_zygote_is_started_again(state):
    from bunshin_async import _zygote

    async def main():
        async with open_container(make_spec(), state=state) as c:
            assert (await c.exec("echo 1")).ok
        pid = _zygote.running_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        async with open_container(make_spec(), state=state) as c:
            assert (await c.exec("echo 2")).stdout == b"2\n"
        assert _zygote.running_pid() not in (None, pid)

    run(main)


def test_a_forked_controller_gets_a_zygote_of_its_own(state):
    # a process forked from a controller must not send requests down its parent's channel
    from bunshin_async import _zygote

    async def boot(tag):
        async with open_container(make_spec(), state=state) as c:
            return (await c.exec(f"echo {tag}")).stdout

    assert run(boot, "parent") == b"parent\n"
    parent_zygote = _zygote.running_pid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: boot a workspace, report its zygote, exit without clean-up
        code = 1
        try:
            os.close(r)
            out = anyio.run(boot, "child")
            os.write(w, f"{out.decode().strip()} {_zygote.running_pid()}".encode())
            _zygote.stop()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read().split()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0 and said[0] == "child"
    assert int(said[1]) != parent_zygote and _zygote.running_pid() == parent_zygote
    assert run(boot, "again") == b"again\n"  # the parent's zygote still serves it
