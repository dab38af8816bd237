"""The Bunshin simulator: the scheduler core in virtual time against modelled engines.

:func:`simulate` replays a trace; :class:`SimBackend` implements the core's Backend with the
engine cost models of :data:`ENGINES` and the page-level :class:`PageModel`; :func:`generate`
writes OSWorld-like and WebArena-like workload traces.
"""

from ._backend import SimBackend, SimStatistics, ToolModel, ToolOutcome
from ._engines import ENGINE_NAMES, ENGINES, EngineModel, engine_model
from ._memory import PageModel, PageUsage
from ._reproduce import (
    CALIBRATIONS,
    AccuracySelector,
    Calibration,
    Comparison,
    load_calibration,
    reproduce,
    run_calibrated,
    shareable_after,
)
from ._runner import Simulation, VirtualTimeLoop, build_simulation, run_virtual, simulate
from ._workloads import (
    ARGUMENT_KINDS,
    WORKLOADS,
    LogNormal,
    LongTail,
    MemorySpec,
    RewardModel,
    StepCount,
    ToolSpec,
    WorkloadParams,
    generate,
    workload_params,
)

__all__ = [
    "AccuracySelector",
    "CALIBRATIONS",
    "Calibration",
    "Comparison",
    "load_calibration",
    "reproduce",
    "run_calibrated",
    "shareable_after",
    "ARGUMENT_KINDS",
    "ENGINES",
    "ENGINE_NAMES",
    "EngineModel",
    "LogNormal",
    "LongTail",
    "MemorySpec",
    "PageModel",
    "PageUsage",
    "RewardModel",
    "SimBackend",
    "SimStatistics",
    "Simulation",
    "StepCount",
    "ToolModel",
    "ToolOutcome",
    "ToolSpec",
    "VirtualTimeLoop",
    "WORKLOADS",
    "WorkloadParams",
    "build_simulation",
    "engine_model",
    "generate",
    "run_virtual",
    "simulate",
    "workload_params",
]
