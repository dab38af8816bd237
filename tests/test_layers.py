"""Overlay layers: capture, flatten and archive keep what an overlay mount shows."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin_async._layers import LayerStore

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1) to mount overlays"
)

# Mounts an overlay in a private mount namespace and prints the merged tree as JSON.
VIEW = r"""
import json, os, subprocess, sys
lower, mnt = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "-t", "overlay", "overlay", "-o", "lowerdir=" + lower, mnt], check=True)
tree = {}
for d, dirs, files in os.walk(mnt):
    rel = os.path.relpath(d, mnt)
    tree[rel + "/"] = None
    for f in files:
        p = os.path.join(d, f)
        tree[os.path.normpath(os.path.join(rel, f))] = os.readlink(p) if os.path.islink(p) else open(p).read()
print(json.dumps(tree, sort_keys=True))
"""


def view(tmp: Path, dirs: list[Path]) -> dict:
    mnt = tmp / "mnt"
    mnt.mkdir(exist_ok=True)
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", VIEW, ":".join(map(str, dirs)), str(mnt)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout)


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, 0)


@pytest.fixture
def world(tmp_path: Path):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "a").write_text("root a")
    (root / "c").write_text("root c")
    (root / "d" / "w").write_text("root w")
    (root / "e").mkdir()
    (root / "e" / "keep").write_text("root keep")
    upper1 = tmp_path / "u1"
    (upper1 / "d").mkdir(parents=True)
    (upper1 / "d" / "x").write_text("x1")
    (upper1 / "a").write_text("a1")
    (upper1 / "ln").symlink_to("a")
    upper2 = tmp_path / "u2"
    (upper2 / "d").mkdir(parents=True)
    os.setxattr(upper2 / "d", "trusted.overlay.opaque", b"y")
    (upper2 / "d" / "z").write_text("z2")
    whiteout(upper2 / "a")
    whiteout(upper2 / "c")
    (upper2 / "b").write_text("b2")
    (upper2 / "e").mkdir()
    (upper2 / "e" / "new").write_text("e2")
    return tmp_path, root, upper1, upper2


def test_capture_and_flatten_keep_the_merged_view(world) -> None:
    tmp, root, upper1, upper2 = world
    store = LayerStore(tmp / "store", flatten_depth=8)
    s1 = store.capture(upper1, ())
    s2 = store.capture(upper2, s1)
    assert len(s2) == 2
    expected = view(tmp, [p.path for p in s2] + [root])
    assert expected == view(tmp, [upper2, upper1, root])
    assert "a" not in expected and "c" not in expected and "d/w" not in expected  # whiteouts, opacity
    assert expected["d/z"] == "z2" and expected["e/keep"] == "root keep" and expected["b"] == "b2"
    flat = store.flatten(s2)
    assert len(flat) == 1
    assert view(tmp, [flat[0].path, root]) == expected
    for stack in (s1, s2, flat):
        store.drop(stack)
    assert not list((tmp / "store" / "layers").iterdir())


def test_deep_stacks_are_flattened(world) -> None:
    tmp, root, upper1, upper2 = world
    store = LayerStore(tmp / "store", flatten_depth=2)
    upper3 = tmp / "u3"
    shutil.copytree(upper1, upper3, symlinks=True)
    (upper3 / "a").write_text("a3")
    stack = store.capture(upper1, ())
    stack2 = store.capture(upper2, stack)
    stack3 = store.capture(upper3, stack2)  # 3 > 2: merged into one
    assert len(stack3) == 1 and store.flattens == 1
    merged = view(tmp, [stack3[0].path, root])
    assert merged == view(tmp, [upper3, upper2, upper1, root])
    assert merged["a"] == "a3" and "c" not in merged
    for s in (stack, stack2, stack3):
        store.drop(s)
    assert not list((tmp / "store" / "layers").iterdir())


def test_archive_round_trip_keeps_whiteouts_and_opacity(world) -> None:
    tmp, root, _upper1, upper2 = world
    store = LayerStore(tmp / "store")
    (layer,) = store.capture(upper2, ())
    archive, size = store.archive(layer)
    assert size > 0
    back = store.restore(archive)
    assert view(tmp, [back.path, root]) == view(tmp, [layer.path, root])
    st = os.lstat(back.path / "a")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(back.path / "d", "trusted.overlay.opaque") == b"y"
