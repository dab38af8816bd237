from __future__ import annotations

import os
import sys

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", derandomize=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# --- live workspaces: nothing may leak ---------------------------------------------------------
# A test using `leak_check` (tests/test_container.py uses it for every test) fails if, after it,
# the host has a mount, a workspace cgroup, a child process, a network interface or a state
# directory entry that it did not have before. The `state` fixture gives a fresh state directory.

import pytest


def _host_snapshot(state_path: str | None) -> dict[str, set[str]]:
    snap: dict[str, set[str]] = {}
    with open("/proc/self/mountinfo") as f:
        snap["mounts"] = {line.split()[4] for line in f}
    groups: set[str] = set()
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        parent = os.path.join(root, "bunshin")
        if os.path.isdir(parent):
            groups |= {os.path.join(parent, d) for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))}
    snap["cgroups"] = groups
    children: set[str] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children |= set(f.read().split())
        except FileNotFoundError:
            pass
    # the workspace zygote (bunshin_async._zygote) is started once per process, on first use
    zygote = sys.modules.get("bunshin_async._zygote")
    pid = zygote.running_pid() if zygote is not None else None
    snap["children"] = children - {str(pid)}
    snap["links"] = set(os.listdir("/sys/class/net"))
    entries: set[str] = set()
    for base in filter(None, (state_path, "/run/bunshin", "/var/lib/bunshin")):
        for sub in ("records", "containers", "layers"):
            d = os.path.join(base, sub)
            if os.path.isdir(d):
                entries |= {os.path.join(d, e) for e in os.listdir(d)}
    snap["state"] = entries
    return snap


@pytest.fixture
def state(tmp_path):
    """A fresh workspace state directory (records and workspace directories) for one test."""
    from bunshin_async._state import StateDir

    return StateDir(tmp_path / "state")


@pytest.fixture
def leak_check(state):
    """Fail the test if it leaves a mount, cgroup, child process, interface or state entry."""
    import time

    before = _host_snapshot(state.path)
    yield
    after = _host_snapshot(state.path)
    for _ in range(200):  # processes killed at destroy may take a moment to be reaped
        if after["children"] <= before["children"]:
            break
        time.sleep(0.01)
        after = _host_snapshot(state.path)
    leaked = {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}
    if leaked:
        from bunshin_async._state import gc

        gc(state, include_alive=True)
        pytest.fail(f"the test left behind: {leaked}")
