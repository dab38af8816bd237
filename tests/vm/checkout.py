"""Import ``bunshin_async`` from the checkout inside the lab VM, for the in-VM tests and
benchmarks: the package's modules from the source tree, its C extension from the build
directory (the editable install's import hook would try to rebuild on the read-only root),
without the package's ``__init__`` (it imports optional integrations, numpy through gymnasium,
which may die of SIGILL under TCG's CPU model)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def import_checkout():
    """Import the modules the in-VM tests and benchmarks use; return them in a namespace."""
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "MesonpyMetaFinder"]
    # a bare package and only the modules used (see the module docstring)
    pkg = types.ModuleType("bunshin_async")
    pkg.__path__ = [str(ROOT / "bunshin_async")]
    sys.modules["bunshin_async"] = pkg
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    found = sorted((ROOT / "build").glob(f"*/cext/_bunshin_c{suffix}"))
    assert found, f"no _bunshin_c{suffix} under {ROOT}/build: run pip install --no-build-isolation -e . first"
    spec = importlib.util.spec_from_file_location("bunshin_async._bunshin_c", found[-1])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bunshin_async._bunshin_c"] = mod
    spec.loader.exec_module(mod)
    import bunshin_async._backend as backend
    import bunshin_async._exceptions as exceptions
    import bunshin_async._live as live
    import bunshin_async._plugins as plugins
    import bunshin_async._policy as policy
    import bunshin_async._scheduler as scheduler
    import bunshin_async._selector as selector
    import bunshin_async._spec as spec_mod
    import bunshin_async._trace as trace

    ns = types.SimpleNamespace(_live=live, load_spec=spec_mod.load_spec, CallContext=backend.CallContext,
                               RolloutKey=trace.RolloutKey, Task=trace.Task, MemoryProfile=trace.MemoryProfile,
                               ToolCall=trace.ToolCall, BackendError=exceptions.BackendError,
                               ConfigError=exceptions.ConfigError, TracePolicy=policy.TracePolicy,
                               SchedulerConfig=scheduler.SchedulerConfig, Scheduler=scheduler.Scheduler,
                               HistorySelector=selector.HistorySelector, CacheableTools=plugins.CacheableTools)
    return ns
