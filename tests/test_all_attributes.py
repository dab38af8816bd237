"""Every public name is exported, and every Python file is installed by meson."""

from __future__ import annotations

import pathlib
import re

import pytest

import bunshin_async
import bunshin_async.testing
import sim

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", [bunshin_async, bunshin_async.testing, sim])
def test_all_is_complete(module) -> None:
    public = {n for n in dir(module) if not n.startswith("_") and not isinstance(getattr(module, n), type(pytest))}
    assert set(module.__all__) == public
    for name in module.__all__:
        obj = getattr(module, name)
        if hasattr(obj, "__module__") and callable(obj):
            assert obj.__module__.startswith(module.__name__), name


@pytest.mark.parametrize("package", ["bunshin_async", "bunshin_async/testing", "sim"])
def test_meson_installs_every_python_file(package: str) -> None:
    listed = set(re.findall(r"'([^']+\.py)'", (ROOT / package / "meson.build").read_text()))
    present = {p.name for p in (ROOT / package).glob("*.py")}
    assert present
    assert listed == present
