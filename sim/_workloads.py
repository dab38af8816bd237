"""Synthetic workload generators: Bunshin traces of OSWorld-like and WebArena-like training.

A workload is described by a :class:`WorkloadParams` record (every knob, each with the place
its value comes from in :attr:`WorkloadParams.sources`); :func:`generate` turns it and a seed
into a :class:`~bunshin_async._trace.Trace` whose rollouts are in the order a GRPO trainer
issues them: epoch by epoch, task by task, one group of ``group_size`` samples per task.

Each task has a latent *solution tree*: at every prefix of calls, a ranked list of candidate
next calls in which one (the popular call) dominates. Samples draw from it, following the
popular call with a probability that decays with depth, so the samples of a group agree on
their opening calls and diverge gradually. Samples of later epochs also replay the opening of
a well-rewarded trajectory of the epoch before, so opening calls recur across epochs.

Everything a cacheable call returns (observation digest and size, execution time, bytes
dirtied) is a function of the seed, the task and the whole call path so far only, drawn from
a random stream seeded by a hash of those; so the same call after the same prefix costs and
shows the same wherever it runs, and :func:`~bunshin_async._trace.check_trace` finds nothing
to warn about. A non-cacheable call (a tool that waits or reads the clock or the live web)
gets a digest and costs that also depend on the rollout. Everything else (think times, which
call a sample picks, trajectory lengths) comes from one ``random.Random(seed)`` consumed in
trainer order, so the same parameters and seed give byte-identical traces.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from bunshin_async._exceptions import ConfigError
from bunshin_async._trace import (
    TRACE_VERSION,
    MemoryProfile,
    Rollout,
    Step,
    Task,
    ToolCall,
    Trace,
    call_key,
    observation_digest,
)

__all__ = [
    "LogNormal",
    "LongTail",
    "StepCount",
    "ToolSpec",
    "MemorySpec",
    "RewardModel",
    "WorkloadParams",
    "WORKLOADS",
    "ARGUMENT_KINDS",
    "workload_params",
    "generate",
]

GENERATOR = "sim._workloads.generate"
"""The name :func:`generate` records in a trace's ``meta["generator"]``."""
GENERATOR_VERSION = 1
"""Bumped whenever :func:`generate` would produce different bytes for the same inputs."""

_GiB = 1 << 30
_PAGE = 4096

Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]
Pos = Annotated[float, msgspec.Meta(gt=0.0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Label = Annotated[str, msgspec.Meta(min_length=1)]


# ---------------------------------------------------------------------------------------------
# Parameter records


class LogNormal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A lognormal distribution given by its median, clipped to ``[low, high]``."""

    median: Pos
    """The median (``exp(mu)``), in the unit of the quantity drawn."""
    sigma: NonNeg
    """Standard deviation of the logarithm; 0 always draws the median."""
    low: NonNeg = 0.0
    """Draws below this are raised to it."""
    high: float | None = None
    """Draws above this are lowered to it; ``None`` for no cap."""


class LongTail(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A long-tailed duration: a lognormal body plus a Pareto tail taking a share of draws."""

    body: LogNormal
    """The distribution of ordinary draws, in seconds."""
    tail_share: Prob
    """Probability that a draw comes from the Pareto tail instead of the body."""
    tail_scale: Pos
    """The tail's minimum (the Pareto scale ``x_m``), in seconds."""
    tail_alpha: Pos
    """The tail's shape; smaller is heavier (below 2 the variance is infinite)."""
    high: Pos
    """Every draw is capped at this many seconds (a tool-call timeout)."""


class StepCount(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How many tool calls a trajectory makes.

    Each task draws a solution length from a triangular distribution on ``[low, high]``
    peaking at ``mode``; each sample of the task makes that many calls plus rounded Gaussian
    jitter, clipped to ``[low, high]``.
    """

    low: PosInt
    """Fewest calls in a trajectory."""
    mode: PosInt
    """Most likely solution length of a task."""
    high: PosInt
    """Most calls in a trajectory (the agent's step budget)."""
    jitter: NonNeg
    """Standard deviation, in calls, of a sample's length around its task's length."""


ArgumentGenerator = Callable[[random.Random], dict[str, Any]]


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tool the policy can call."""

    name: Label
    """The tool's name as it appears in calls."""
    weight: NonNeg
    """Relative frequency of the tool among the calls drawn for the solution tree."""
    exec_time: LongTail
    """Seconds one call runs in the workspace."""
    dirty_share: LogNormal
    """Bytes one call writes, as a share of the task's runtime memory (clipped to [0, 1])."""
    cacheable: bool
    """Whether the tool's result depends only on the workspace state before the call."""
    arguments: Label
    """The argument generator, a key of :data:`ARGUMENT_KINDS`."""
    vocab_size: PosInt
    """How many distinct argument objects each task offers for this tool (repeats are exact)."""


class MemorySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The memory profile of a task's initialised workspace."""

    image_bytes: NonNegInt
    """File-backed memory of the image (shared through the page cache whatever the engine)."""
    runtime_bytes: NonNegInt
    """Anonymous memory built up while initialising (median over tasks)."""
    boot_time: NonNeg
    """Seconds to create and initialise a fresh workspace (median over tasks)."""
    spread: NonNeg
    """Lognormal sigma of the per-task variation of runtime bytes and boot time."""


class RewardModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a trajectory is scored: by the share of its calls that were the popular ones.

    A trajectory whose share of popular calls (each judged at its own prefix) is at least
    ``threshold`` succeeds with reward 1; otherwise it earns ``partial_credit`` times that
    share. Rewards are always in [0, 1].
    """

    threshold: Prob
    """Share of popular calls at or above which the trajectory succeeds."""
    partial_credit: Prob
    """Reward per unit of popular share for a failed trajectory (0 gives binary rewards)."""


class WorkloadParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every knob of a synthetic workload (see :func:`generate` and ``docs/workloads.md``)."""

    name: Label
    """The parameter set's name; the trace's name and ``meta["params"]``."""
    workload: Label
    """The modelled benchmark; prefixes task ids (``"osworld-007"``), ``meta["workload"]``."""
    description: str
    """One line on what is modelled."""
    tasks: PosInt
    """Number of tasks per epoch (each is one GRPO group)."""
    group_size: PosInt
    """Samples per task per epoch (GRPO's G)."""
    epochs: PosInt
    """Training epochs; each revisits every task."""
    steps: StepCount
    """Tool calls per trajectory."""
    think_time: LogNormal
    """Seconds the model reasons before each call."""
    final_think_time: LogNormal
    """Seconds the model reasons after the last observation before ending."""
    tools: tuple[ToolSpec, ...]
    """The tool set."""
    memory: MemorySpec
    """The workspace's memory profile."""
    observation_size: LogNormal
    """Bytes of one observation (a screenshot, an accessibility tree, command output)."""
    agreement: Prob
    """Probability that a sample's first call is its prefix's popular call."""
    agreement_decay: Prob
    """Per-step factor on ``agreement``: at depth d the probability is
    ``max(agreement_floor, agreement * agreement_decay**d)``."""
    agreement_floor: Prob
    """Lowest probability of following the popular call, however deep."""
    alternatives: NonNegInt
    """Ranked alternative calls per prefix besides the popular one."""
    alternative_skew: NonNeg
    """Zipf exponent over the alternatives (0: uniform; larger: the first dominates)."""
    novelty: Prob
    """Probability that a call off the popular one is a fresh draw from the task's vocabulary
    instead of one of the ranked alternatives."""
    epoch_repeat: Prob
    """In epochs after the first, probability that a sample repeats the first call of a
    well-rewarded trajectory of the previous epoch (while its prefix still matches)."""
    epoch_repeat_decay: Prob
    """Per-step factor on ``epoch_repeat`` along that trajectory."""
    noncacheable_share: Prob
    """Share of the calls of cacheable tools that are nonetheless non-cacheable (they read the
    clock or the live web); decided per task and call, so a call is always one or the other."""
    reward: RewardModel
    """How trajectories are scored."""
    sources: dict[str, str] = {}
    """For each numeric parameter (a dotted path such as ``tools.click.exec_time``, covering the
    numbers under it), where its value comes from: a seed figure, a public measurement, or
    ``"assumption: ..."`` with the reasoning."""


# ---------------------------------------------------------------------------------------------
# Argument generators: each draws one argument object from a task's random stream; a task's
# vocabulary for a tool is ``vocab_size`` such draws, so repeated calls are exact.

_WORDS = (
    "report", "budget", "2023", "invoice", "Alice", "Bob", "quarterly", "summary", "draft",
    "total", "meeting notes", "hello world", "README", "Q3 sales", "project plan", "thanks",
)
_FORMULAS = ("=SUM(B2:B9)", "=AVERAGE(C2:C20)", "=A2*B2", "=COUNTIF(D:D;\"yes\")")
_HOTKEYS = (
    ("ctrl", "s"), ("ctrl", "c"), ("ctrl", "v"), ("ctrl", "z"), ("ctrl", "a"), ("enter",),
    ("tab",), ("esc",), ("ctrl", "shift", "s"), ("alt", "f4"), ("ctrl", "f"), ("ctrl", "l"),
    ("ctrl", "t"), ("ctrl", "h"), ("f2",), ("delete",),
)
_FILES = (
    "notes.txt", "report.docx", "data.csv", "budget.xlsx", "slides.pptx", "script.py",
    "photo.png", "config.json", "todo.md", "export.pdf",
)
_COMMANDS = (
    "ls -la ~/Desktop", "cat ~/{f}", "wc -l ~/{f}", "python3 ~/{f}", "file ~/Documents/{f}",
    "find ~ -name '{f}'", "grep -rn TODO ~/project", "pip install openpyxl",
    "libreoffice --headless --convert-to pdf ~/{f}", "cp ~/{f} ~/Desktop/", "head -n 20 ~/{f}",
    "du -sh ~/Downloads", "unzip -o ~/Downloads/archive.zip -d ~/work",
)
_QUERIES = (
    "wireless headphones", "running shoes", "coffee maker", "phone case", "yoga mat",
    "HDMI cable", "vitamin C", "office chair", "usb-c charger", "green tea", "backpack",
    "bluetooth speaker", "notebook", "face cream",
)
_PAGES = (
    "", "customer/account/", "sales/order/history/", "checkout/cart/", "wishlist/",
    "electronics.html", "home-kitchen.html", "beauty-personal-care.html",
    "health-household.html", "sports-outdoors.html", "review/customer/",
)
_SHOP = "http://localhost:7770/"


def _point(r: random.Random) -> dict[str, Any]:
    return {"x": r.randrange(8, 1912), "y": r.randrange(8, 1072)}


def _drag(r: random.Random) -> dict[str, Any]:
    return {"x1": r.randrange(8, 1912), "y1": r.randrange(8, 1072),
            "x2": r.randrange(8, 1912), "y2": r.randrange(8, 1072)}


def _scroll(r: random.Random) -> dict[str, Any]:
    return {"x": r.randrange(8, 1912), "y": r.randrange(8, 1072),
            "clicks": r.choice((-10, -5, -3, 3, 5, 10))}


def _text(r: random.Random) -> dict[str, Any]:
    if r.random() < 0.2:
        return {"text": r.choice(_FORMULAS)}
    return {"text": " ".join(r.sample(_WORDS, r.randint(1, 3)))}


def _hotkey(r: random.Random) -> dict[str, Any]:
    return {"keys": list(r.choice(_HOTKEYS))}


def _shell(r: random.Random) -> dict[str, Any]:
    return {"command": r.choice(_COMMANDS).format(f=r.choice(_FILES))}


def _duration(r: random.Random) -> dict[str, Any]:
    return {"seconds": r.choice((1, 2, 3, 5))}


def _element(r: random.Random) -> dict[str, Any]:
    return {"element_id": r.randrange(100, 4000)}


def _element_text(r: random.Random) -> dict[str, Any]:
    return {"element_id": r.randrange(100, 4000), "text": r.choice(_QUERIES),
            "press_enter": r.random() < 0.7}


def _url(r: random.Random) -> dict[str, Any]:
    u = r.random()
    if u < 0.4:
        path = r.choice(_PAGES)
    elif u < 0.75:
        path = f"catalog/product/view/id/{r.randrange(1, 2500)}"
    else:
        path = "catalogsearch/result/?q=" + r.choice(_QUERIES).replace(" ", "+")
    return {"url": _SHOP + path}


def _direction(r: random.Random) -> dict[str, Any]:
    return {"direction": r.choice(("down", "up"))}


def _none(r: random.Random) -> dict[str, Any]:
    return {}


ARGUMENT_KINDS: dict[str, ArgumentGenerator] = {
    "point": _point,
    "drag": _drag,
    "scroll": _scroll,
    "text": _text,
    "hotkey": _hotkey,
    "shell": _shell,
    "duration": _duration,
    "element": _element,
    "element_text": _element_text,
    "url": _url,
    "direction": _direction,
    "none": _none,
}
"""Argument generators by name (:attr:`ToolSpec.arguments`). ``"duration"`` is special: a call
runs for its ``seconds`` argument on top of the drawn execution time."""


# ---------------------------------------------------------------------------------------------
# Default workloads

_HEAVY_TAIL_NOTE = (
    "assumption: lognormal body with a Pareto tail for the rare call that starts an app, "
    "saves a large file or waits on the network; the seed says 'A tool call can take seconds "
    "to minutes.'"
)


def _tail(median: float, sigma: float, share: float, scale: float, alpha: float,
          high: float) -> LongTail:
    return LongTail(LogNormal(median, sigma), share, scale, alpha, high)


def _dirty(median: float, sigma: float) -> LogNormal:
    return LogNormal(median, sigma, 0.0, 1.0)


_OSWORLD_TOOLS = (
    ToolSpec("click", 0.36, _tail(2.5, 0.5, 0.03, 8.0, 1.6, 180.0), _dirty(0.015, 1.0),
             True, "point", 14),
    ToolSpec("double_click", 0.06, _tail(3.5, 0.6, 0.12, 10.0, 1.4, 180.0),
             _dirty(0.04, 0.9), True, "point", 6),
    ToolSpec("type", 0.18, _tail(3.0, 0.5, 0.02, 8.0, 1.8, 120.0), _dirty(0.01, 0.8),
             True, "text", 6),
    ToolSpec("hotkey", 0.12, _tail(2.0, 0.5, 0.05, 8.0, 1.5, 120.0), _dirty(0.02, 1.0),
             True, "hotkey", 6),
    ToolSpec("scroll", 0.08, _tail(1.5, 0.4, 0.0, 1.0, 2.0, 60.0), _dirty(0.004, 0.8),
             True, "scroll", 4),
    ToolSpec("drag", 0.03, _tail(2.5, 0.5, 0.02, 8.0, 1.8, 60.0), _dirty(0.01, 0.8),
             True, "drag", 3),
    ToolSpec("shell", 0.10, _tail(3.0, 1.0, 0.15, 20.0, 1.2, 600.0), _dirty(0.04, 1.0),
             True, "shell", 6),
    ToolSpec("wait", 0.05, _tail(1.0, 0.3, 0.0, 1.0, 2.0, 30.0), _dirty(0.005, 0.8),
             False, "duration", 4),
)

_OSWORLD_SOURCES = {
    "tasks": "seed: 'a batch of 256 rollouts' with GRPO groups; 32 tasks x 8 samples = 256",
    "group_size": "assumption: G = 8, a common GRPO group size; 32 x 8 gives the seed's "
    "'a batch of 256 rollouts'",
    "epochs": "assumption: two epochs are the fewest that show recurrence across epochs "
    "(seed: 'Training revisits the same tasks every epoch')",
    "steps": "assumption: 8 to 20 calls, mode 13; OSWorld's reference runner caps episodes "
    "at 15 steps by default, RL setups often allow more; seed: 'over half stays shareable "
    "after ten steps' implies trajectories longer than ten",
    "think_time": "assumption: a VL model (seed: Qwen3-VL-8B) reading a screenshot and writing "
    "a few hundred tokens of reasoning on a shared, batched inference server: ~20 s median; "
    "calibrate against the seed's 'Full finishes the epoch in 17.0 minutes vs. 20.8 for Base'",
    "final_think_time": "assumption: a short final message (declare done), ~8 s median",
    "tools.click.weight": "assumption: clicks dominate GUI trajectories",
    "tools.double_click.weight": "assumption: opening files and apps",
    "tools.type.weight": "assumption: text entry is the second most common GUI action",
    "tools.hotkey.weight": "assumption: saving, copying, confirming",
    "tools.scroll.weight": "assumption",
    "tools.drag.weight": "assumption: rare (selections, resizing)",
    "tools.shell.weight": "assumption: OSWorld's os and multi_apps domains use a terminal",
    "tools.wait.weight": "assumption: agents wait for slow apps a few times per trajectory",
    "tools.click.exec_time": "assumption: action plus settle pause plus screenshot capture "
    "from the VM, ~2.5 s; " + _HEAVY_TAIL_NOTE,
    "tools.double_click.exec_time": "assumption: often launches an app or opens a file, "
    "hence a heavier tail; " + _HEAVY_TAIL_NOTE,
    "tools.type.exec_time": "assumption: keystrokes typed at a fixed interval plus capture",
    "tools.hotkey.exec_time": "assumption: ctrl+s and the like can write a file; "
    + _HEAVY_TAIL_NOTE,
    "tools.scroll.exec_time": "assumption: no tail",
    "tools.drag.exec_time": "assumption",
    "tools.shell.exec_time": "assumption: most commands return in seconds, package installs "
    "and conversions take minutes; " + _HEAVY_TAIL_NOTE,
    "tools.wait.exec_time": "assumption: overhead on top of the requested seconds",
    "tools.click.dirty_share": "assumption: per-call dirtied share ~1-5% of runtime memory so "
    "that after ten calls well under half is private; seed: 'Within a GRPO group, over half "
    "stays shareable after ten steps.'",
    "tools.double_click.dirty_share": "assumption: starting an app allocates; see "
    "tools.click.dirty_share",
    "tools.type.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.hotkey.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.scroll.dirty_share": "assumption: redraws only",
    "tools.drag.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.shell.dirty_share": "assumption: commands spawn processes and fill the page cache",
    "tools.wait.dirty_share": "assumption: background activity while waiting",
    "tools.click.vocab_size": "assumption: a task's screens offer a dozen-odd useful targets",
    "tools.double_click.vocab_size": "assumption",
    "tools.type.vocab_size": "assumption: a task needs a handful of distinct strings",
    "tools.hotkey.vocab_size": "assumption",
    "tools.scroll.vocab_size": "assumption",
    "tools.drag.vocab_size": "assumption",
    "tools.shell.vocab_size": "assumption",
    "tools.wait.vocab_size": "assumption: 1, 2, 3 or 5 seconds",
    "memory.image_bytes": "assumption: ~1 GiB of the 4 GiB is file-backed (kernel, libraries, "
    "application binaries); seed: 'At about 4 GB per sandbox'",
    "memory.runtime_bytes": "seed: 'At about 4 GB per sandbox'; OSWorld's docker provider "
    "(desktop_env/providers/docker/provider.py) runs its VM with RAM_SIZE 4G; 3 GiB anonymous "
    "plus 1 GiB image. Note: the seed's 69-70 GiB peak for a whole OSWorld epoch implies far "
    "fewer resident bytes or fewer concurrent rollouts than 256 x 4 GB; a calibration issue",
    "memory.boot_time": "assumption: booting the desktop VM and resetting the task, ~40 s",
    "memory.spread": "assumption: tasks open different apps, +-15% memory",
    "observation_size": "assumption: a 1920x1080 PNG screenshot (OSWorld's screen size) plus "
    "accessibility tree, ~600 KB median",
    "agreement": "assumption: a sample makes the popular first call 92% of the time; "
    "seed: 'Trajectories in one GRPO group start from the same task and diverge only "
    "gradually.'",
    "agreement_decay": "assumption: agreement falls 2.5% per step, to ~0.7 after ten steps, "
    "so about 40% of pairs of a group still share their first four calls",
    "agreement_floor": "assumption: even deep in a trajectory the popular call is likeliest",
    "alternatives": "assumption: three plausible other calls per prefix",
    "alternative_skew": "assumption: Zipf 1 over those",
    "novelty": "assumption: a quarter of off-path calls are fresh draws (exploration)",
    "epoch_repeat": "assumption: seed: 'Training revisits the same tasks every epoch, so "
    "trajectories often reissue the same opening calls'",
    "epoch_repeat_decay": "assumption: the repetition fades along the trajectory",
    "noncacheable_share": "assumption: OSWorld's Chrome tasks load live web pages, some apps "
    "show the clock; ~5% of calls of cacheable tools",
    "reward.threshold": "assumption: chosen so roughly a third of first-epoch trajectories "
    "succeed, the order of published OSWorld success rates of 7-8B VL agents",
    "reward.partial_credit": "assumption: OSWorld's checkers are mostly binary",
}

_WEBARENA_TOOLS = (
    ToolSpec("click", 0.40, _tail(2.0, 0.6, 0.05, 6.0, 1.5, 120.0), _dirty(0.006, 1.0),
             True, "element", 14),
    ToolSpec("type", 0.18, _tail(2.5, 0.6, 0.08, 6.0, 1.5, 120.0), _dirty(0.008, 1.0),
             True, "element_text", 6),
    ToolSpec("goto", 0.12, _tail(2.5, 0.6, 0.05, 8.0, 1.5, 120.0), _dirty(0.006, 1.0),
             True, "url", 8),
    ToolSpec("scroll", 0.14, _tail(0.5, 0.4, 0.0, 1.0, 2.0, 30.0), _dirty(0.001, 0.8),
             True, "direction", 2),
    ToolSpec("go_back", 0.07, _tail(1.5, 0.5, 0.02, 6.0, 1.8, 60.0), _dirty(0.003, 0.8),
             True, "none", 1),
    ToolSpec("hover", 0.05, _tail(0.5, 0.4, 0.0, 1.0, 2.0, 30.0), _dirty(0.001, 0.8),
             True, "element", 4),
    ToolSpec("press", 0.04, _tail(1.5, 0.5, 0.03, 6.0, 1.8, 60.0), _dirty(0.004, 0.8),
             True, "hotkey", 3),
)

_WEBARENA_SOURCES = {
    "tasks": "assumption: same batch shape as OSWorld (seed: 'a batch of 256 rollouts'); "
    "WebArena has a few hundred shopping tasks to draw from",
    "group_size": "assumption: G = 8, as for OSWorld",
    "epochs": "assumption: two epochs show recurrence across epochs",
    "steps": "assumption: 5 to 20 calls, mode 10; WebArena tasks are shorter than OSWorld's "
    "and its reference runner stops at 30 actions",
    "think_time": "assumption: a model reading an accessibility tree (no image), ~12 s median "
    "on a shared inference server",
    "final_think_time": "assumption: ~6 s to write the answer",
    "tools.click.weight": "assumption: clicks dominate web trajectories",
    "tools.type.weight": "assumption: search boxes and forms",
    "tools.goto.weight": "assumption: direct navigation to known pages",
    "tools.scroll.weight": "assumption: long product lists",
    "tools.go_back.weight": "assumption",
    "tools.hover.weight": "assumption: menus",
    "tools.press.weight": "assumption",
    "tools.click.exec_time": "assumption: an uncached Magento page render plus browser load, "
    "~2 s; " + _HEAVY_TAIL_NOTE,
    "tools.type.exec_time": "assumption: typing plus, usually, a search (Elasticsearch) on "
    "enter; " + _HEAVY_TAIL_NOTE,
    "tools.goto.exec_time": "assumption: a full page load; " + _HEAVY_TAIL_NOTE,
    "tools.scroll.exec_time": "assumption: client-side only, no tail",
    "tools.go_back.exec_time": "assumption: often served from the browser cache",
    "tools.hover.exec_time": "assumption: client-side only, no tail",
    "tools.press.exec_time": "assumption",
    "tools.click.dirty_share": "assumption: a request dirties session, buffer-pool and browser "
    "pages, ~0.5% of runtime memory; seed: 'over half stays shareable after ten steps'",
    "tools.type.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.goto.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.scroll.dirty_share": "assumption: client-side only",
    "tools.go_back.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.hover.dirty_share": "assumption: client-side only",
    "tools.press.dirty_share": "assumption: see tools.click.dirty_share",
    "tools.click.vocab_size": "assumption: a dozen-odd useful links and buttons per task",
    "tools.type.vocab_size": "assumption: a handful of queries and form values",
    "tools.goto.vocab_size": "assumption",
    "tools.scroll.vocab_size": "up or down",
    "tools.go_back.vocab_size": "go_back takes no arguments",
    "tools.hover.vocab_size": "assumption",
    "tools.press.vocab_size": "assumption",
    "memory.image_bytes": "assumption: ~2 GiB file-backed (PHP, MySQL, Elasticsearch's JVM, "
    "the browser)",
    "memory.runtime_bytes": "assumption: ~4 GiB anonymous for Magento's MySQL buffer pool, "
    "Elasticsearch heap, PHP-FPM workers and a browser; consistent with the seed's 'on "
    "WebArena, CRIU must shrink its batch to fit in 256 GB' (256 private copies would need "
    "~1 TiB, 32 shared roots ~128 GiB)",
    "memory.boot_time": "assumption: starting the shop's services and warming caches, ~60 s",
    "memory.spread": "assumption: every task runs the same shop, +-5%",
    "observation_size": "assumption: an accessibility tree of a few thousand tokens, ~20 KB",
    "agreement": "assumption: web tasks start from a fixed page, a sample makes the popular "
    "first call 90% of the time; seed: 'diverge only gradually'",
    "agreement_decay": "assumption: 3% per step",
    "agreement_floor": "assumption",
    "alternatives": "assumption: three plausible other calls per prefix",
    "alternative_skew": "assumption: Zipf 1",
    "novelty": "assumption: a quarter of off-path calls are fresh draws",
    "epoch_repeat": "assumption: seed: 'trajectories often reissue the same opening calls'",
    "epoch_repeat_decay": "assumption",
    "noncacheable_share": "assumption: a self-hosted shop is deterministic except pages that "
    "show the time or recently viewed items, ~2%",
    "reward.threshold": "assumption: roughly a third of trajectories succeed",
    "reward.partial_credit": "assumption: WebArena's evaluators are binary",
}

WORKLOADS: dict[str, WorkloadParams] = {
    "osworld": WorkloadParams(
        name="osworld",
        workload="osworld",
        description="OSWorld-like computer use: a desktop VM, GUI actions and a terminal",
        tasks=32,
        group_size=8,
        epochs=2,
        steps=StepCount(8, 13, 20, 2.0),
        think_time=LogNormal(20.0, 0.5, 2.0, 180.0),
        final_think_time=LogNormal(8.0, 0.5, 1.0, 60.0),
        tools=_OSWORLD_TOOLS,
        memory=MemorySpec(1 * _GiB, 3 * _GiB, 40.0, 0.15),
        observation_size=LogNormal(600_000.0, 0.4, 50_000.0, 4_000_000.0),
        agreement=0.92,
        agreement_decay=0.975,
        agreement_floor=0.5,
        alternatives=3,
        alternative_skew=1.0,
        novelty=0.25,
        epoch_repeat=0.6,
        epoch_repeat_decay=0.9,
        noncacheable_share=0.05,
        reward=RewardModel(0.85, 0.0),
        sources=_OSWORLD_SOURCES,
    ),
    "webarena": WorkloadParams(
        name="webarena",
        workload="webarena",
        description="WebArena-shopping-like web tasks: a Magento shop server and a browser",
        tasks=32,
        group_size=8,
        epochs=2,
        steps=StepCount(5, 10, 20, 2.0),
        think_time=LogNormal(12.0, 0.5, 1.0, 120.0),
        final_think_time=LogNormal(6.0, 0.5, 1.0, 60.0),
        tools=_WEBARENA_TOOLS,
        memory=MemorySpec(2 * _GiB, 4 * _GiB, 60.0, 0.05),
        observation_size=LogNormal(20_000.0, 0.6, 1_000.0, 400_000.0),
        agreement=0.9,
        agreement_decay=0.97,
        agreement_floor=0.5,
        alternatives=3,
        alternative_skew=1.0,
        novelty=0.25,
        epoch_repeat=0.6,
        epoch_repeat_decay=0.9,
        noncacheable_share=0.02,
        reward=RewardModel(0.85, 0.0),
        sources=_WEBARENA_SOURCES,
    ),
}
"""The default workloads by name."""


# ---------------------------------------------------------------------------------------------
# Configuration


def workload_params(name: str, **overrides: Any) -> WorkloadParams:
    """Return the default parameters of workload *name* with *overrides* applied.

    An override replaces a top-level field of :class:`WorkloadParams` (a nested record may be
    given as a record or as a dict); its entries in :attr:`WorkloadParams.sources` become
    ``"override: set by the caller"``.

    Raises:
        ConfigError: If *name* is not a known workload, an override names no field, or the
            result is not a valid workload (a value out of range, an unknown argument kind).
    """
    try:
        base = WORKLOADS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown workload {name!r}; expected one of {', '.join(sorted(WORKLOADS))}"
        ) from None
    if not overrides:
        return base
    fields = set(WorkloadParams.__struct_fields__)
    for key in overrides:
        if key not in fields:
            raise ConfigError(
                f"unknown override {key!r} for workload {name!r}; expected one of "
                f"{', '.join(WorkloadParams.__struct_fields__)}"
            )
    if "sources" not in overrides:
        sources = {
            k: v for k, v in base.sources.items()
            if not any(k == o or k.startswith(o + ".") for o in overrides)
        }
        for key, value in overrides.items():
            if key not in ("name", "workload", "description") and not isinstance(value, str):
                sources[key] = "override: set by the caller"
        overrides["sources"] = sources
    raw = msgspec.to_builtins(base)
    raw.update({k: msgspec.to_builtins(v) for k, v in overrides.items()})
    return _validated(raw, f"workload {name!r}")


def _validated(raw: Any, what: str) -> WorkloadParams:
    try:
        params = msgspec.convert(raw, WorkloadParams)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    problems: list[str] = []
    s = params.steps
    if not s.low <= s.mode <= s.high:
        problems.append(f"steps: expected low <= mode <= high, got {s.low}, {s.mode}, {s.high}")
    if not params.tools:
        problems.append("tools: expected at least one tool")
    names = [t.name for t in params.tools]
    if len(set(names)) != len(names):
        problems.append(f"tools: tool names must be unique, got {names}")
    if params.tools and sum(t.weight for t in params.tools) <= 0:
        problems.append("tools: expected a positive total weight")
    for t in params.tools:
        if t.arguments not in ARGUMENT_KINDS:
            problems.append(
                f"tools.{t.name}.arguments: unknown argument kind {t.arguments!r}; expected "
                f"one of {', '.join(sorted(ARGUMENT_KINDS))}"
            )
    for path, dist in _lognormals(params):
        if dist.high is not None and dist.high < dist.low:
            problems.append(f"{path}: expected low <= high, got {dist.low} > {dist.high}")
    if problems:
        raise ConfigError(f"{what}: " + "; ".join(problems))
    return params


def _lognormals(p: WorkloadParams) -> list[tuple[str, LogNormal]]:
    out = [("think_time", p.think_time), ("final_think_time", p.final_think_time),
           ("observation_size", p.observation_size)]
    for t in p.tools:
        out.append((f"tools.{t.name}.exec_time.body", t.exec_time.body))
        out.append((f"tools.{t.name}.dirty_share", t.dirty_share))
    return out


# ---------------------------------------------------------------------------------------------
# Drawing


def _lognormal(d: LogNormal, r: random.Random) -> float:
    x = d.median * math.exp(d.sigma * r.gauss(0.0, 1.0)) if d.sigma else d.median
    x = max(d.low, x)
    return x if d.high is None else min(d.high, x)


def _long_tail(d: LongTail, r: random.Random) -> float:
    u = r.random()
    if u < d.tail_share:
        x = d.tail_scale * (1.0 - r.random()) ** (-1.0 / d.tail_alpha)
    else:
        x = _lognormal(d.body, r)
    return min(d.high, x)


def _stream(*parts: bytes | str | int) -> random.Random:
    h = hashlib.blake2b(digest_size=32)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return random.Random(h.digest())


class _Call:
    """A candidate call of a task: the call, its tool and whether it is cacheable."""

    __slots__ = ("call", "key", "tool", "cacheable")

    def __init__(self, call: ToolCall, tool: int, cacheable: bool) -> None:
        self.call = call
        self.key = call_key(call)
        self.tool = tool
        self.cacheable = cacheable


class _TaskModel:
    """A task's vocabulary, solution length, memory and latent solution tree."""

    def __init__(self, gen: _Generator, index: int) -> None:
        p = gen.params
        self.id = f"{p.workload}-{index:03d}"
        r = _stream("task", gen.seed, self.id)
        self.vocab: list[list[_Call]] = []
        for ti, tool in enumerate(p.tools):
            arg_gen = ARGUMENT_KINDS[tool.arguments]
            calls: dict[bytes, _Call] = {}
            for _ in range(4 * tool.vocab_size):
                if len(calls) >= tool.vocab_size:
                    break
                call = ToolCall(tool.name, arg_gen(r))
                key = call_key(call)
                if key not in calls:
                    volatile = _stream("volatile", gen.seed, self.id, key).random()
                    cacheable = tool.cacheable and volatile >= p.noncacheable_share
                    calls[key] = _Call(call, ti, cacheable)
            self.vocab.append(list(calls.values()))
        s = p.steps
        self.length = min(s.high, max(s.low, round(r.triangular(s.low, s.high, s.mode))))
        m = p.memory
        runtime = m.runtime_bytes * math.exp(m.spread * r.gauss(0.0, 1.0))
        boot = m.boot_time * math.exp(m.spread * r.gauss(0.0, 1.0))
        self.runtime_bytes = int(runtime) // _PAGE * _PAGE
        self.task = Task(
            id=self.id,
            memory=MemoryProfile(m.image_bytes, self.runtime_bytes, round(boot, 3)),
            description=f"synthetic {p.workload}-like task {index} ({p.name}, seed {gen.seed})",
        )
        self.nodes: dict[bytes, tuple[_Call, list[_Call]]] = {}
        self.costs: dict[bytes, tuple[float, int, int]] = {}


class _Generator:
    def __init__(self, params: WorkloadParams, seed: int) -> None:
        self.params = params
        self.seed = seed
        self.tool_ids = [i for i, t in enumerate(params.tools) if t.weight > 0]
        self.tool_weights = [params.tools[i].weight for i in self.tool_ids]
        k = params.alternatives
        self.alt_weights = [1.0 / (i + 1) ** params.alternative_skew for i in range(k)]

    def draw_call(self, task: _TaskModel, r: random.Random) -> _Call:
        ti = r.choices(self.tool_ids, self.tool_weights)[0]
        return r.choice(task.vocab[ti])

    def node(self, task: _TaskModel, prefix: bytes) -> tuple[_Call, list[_Call]]:
        """The popular call and ranked alternatives after *prefix* (a path digest)."""
        node = task.nodes.get(prefix)
        if node is None:
            r = _stream("node", self.seed, task.id, prefix)
            popular = self.draw_call(task, r)
            alts: list[_Call] = []
            seen = {popular.key}
            for _ in range(4 * self.params.alternatives):
                if len(alts) >= self.params.alternatives:
                    break
                c = self.draw_call(task, r)
                if c.key not in seen:
                    seen.add(c.key)
                    alts.append(c)
            node = task.nodes[prefix] = (popular, alts)
        return node

    def cost(self, tool: ToolSpec, call: ToolCall, runtime: int,
             r: random.Random) -> tuple[float, int, int]:
        p = self.params
        exec_time = _long_tail(tool.exec_time, r)
        if tool.arguments == "duration":
            exec_time += float(call.arguments.get("seconds", 0))
        share = min(1.0, _lognormal(tool.dirty_share, r))
        dirtied = int(share * runtime) // _PAGE * _PAGE
        size = int(_lognormal(p.observation_size, r))
        return round(exec_time, 3), dirtied, size

    def rollout(self, r: random.Random, epoch: int, task: _TaskModel, sample: int,
                reference: list[_Call] | None) -> tuple[Rollout, list[_Call]]:
        p = self.params
        s = p.steps
        length = task.length + (round(r.gauss(0.0, s.jitter)) if s.jitter else 0)
        length = min(s.high, max(s.low, length))
        path = hashlib.blake2b(task.id.encode(), digest_size=16)
        chosen: list[_Call] = []
        steps: list[Step] = []
        popular_hits = 0
        following = reference is not None
        rkey = f"e{epoch}/{task.id}/g0/s{sample}"
        for depth in range(length):
            prefix = path.digest()
            popular, alts = self.node(task, prefix)
            pick: _Call | None = None
            if following and reference is not None and depth < len(reference):
                if r.random() < p.epoch_repeat * p.epoch_repeat_decay**depth:
                    pick = reference[depth]
            else:
                following = False
            if pick is None:
                follow = max(p.agreement_floor, p.agreement * p.agreement_decay**depth)
                if r.random() < follow:
                    pick = popular
                elif alts and r.random() >= p.novelty:
                    pick = r.choices(alts, self.alt_weights[: len(alts)])[0]
                else:
                    pick = self.draw_call(task, r)
            if following and (reference is None or depth >= len(reference)
                              or pick.key != reference[depth].key):
                following = False
            popular_hits += pick.key == popular.key
            chosen.append(pick)
            path.update(pick.key)
            here = path.digest()
            tool = p.tools[pick.tool]
            if pick.cacheable:
                cost = task.costs.get(here)
                if cost is None:
                    cr = _stream("cost", self.seed, task.id, here)
                    cost = task.costs[here] = self.cost(tool, pick.call, task.runtime_bytes, cr)
                digest = observation_digest(f"{self.seed}|{task.id}|{here.hex()}")
            else:
                cost = self.cost(tool, pick.call, task.runtime_bytes, r)
                digest = observation_digest(f"{self.seed}|{task.id}|{here.hex()}|{rkey}|{depth}")
            exec_time, dirtied, size = cost
            steps.append(Step(
                think_time=round(_lognormal(p.think_time, r), 3),
                call=pick.call,
                exec_time=exec_time,
                observation_digest=digest,
                observation_size=size,
                dirtied_bytes=dirtied,
                cacheable=pick.cacheable,
                modelled=_MODELLED,
            ))
        share = popular_hits / length
        rw = p.reward
        reward = 1.0 if share >= rw.threshold else round(rw.partial_credit * share, 4)
        rollout = Rollout(
            epoch=epoch,
            task=task.id,
            group=0,
            sample=sample,
            reward=reward,
            steps=steps,
            final_think_time=round(_lognormal(p.final_think_time, r), 3),
        )
        return rollout, chosen


_MODELLED = (
    "think_time", "call", "exec_time", "observation_digest", "observation_size",
    "dirtied_bytes", "cacheable",
)


def generate(params: WorkloadParams, *, seed: int = 0) -> Trace:
    """Generate the trace of *params*' workload.

    Rollouts come in trainer order: epoch by epoch; within an epoch task by task, each task
    one group (group index 0) of ``params.group_size`` samples numbered from 0. In epochs
    after the first, each sample picks a reference trajectory of its task from the epoch
    before (uniformly among those rewarded at least the group's mean) and repeats its calls,
    each with probability ``epoch_repeat * epoch_repeat_decay**depth``, while its own calls
    still match; otherwise it draws from the task's solution tree.

    Args:
        params: The workload (for example ``WORKLOADS["osworld"]`` or the result of
            :func:`workload_params`).
        seed: The seed; the same parameters and seed give byte-identical traces.

    Raises:
        ConfigError: If *params* is not a valid workload.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed: expected an integer, got {seed!r}")
    params = _validated(msgspec.to_builtins(params), f"workload {getattr(params, 'name', '?')!r}")
    gen = _Generator(params, seed)
    r = random.Random(seed)
    models = [_TaskModel(gen, i) for i in range(params.tasks)]
    rollouts: list[Rollout] = []
    previous: dict[str, list[tuple[float, list[_Call]]]] = {}
    for epoch in range(params.epochs):
        current: dict[str, list[tuple[float, list[_Call]]]] = {}
        for task in models:
            prior = previous.get(task.id)
            good: list[list[_Call]] = []
            if prior:
                mean = sum(rw for rw, _ in prior) / len(prior)
                good = [calls for rw, calls in prior if rw >= mean]
            group: list[tuple[float, list[_Call]]] = []
            for sample in range(params.group_size):
                reference = r.choice(good) if good else None
                rollout, calls = gen.rollout(r, epoch, task, sample, reference)
                rollouts.append(rollout)
                group.append((rollout.reward, calls))
            current[task.id] = group
        previous = current
    digest = hashlib.sha256(msgspec.json.encode(params, order="sorted")).hexdigest()[:16]
    return Trace(
        version=TRACE_VERSION,
        name=params.name,
        tasks=[m.task for m in models],
        rollouts=rollouts,
        meta={
            "generator": GENERATOR,
            "generator_version": GENERATOR_VERSION,
            "workload": params.workload,
            "params": params.name,
            "params_digest": digest,
            "seed": seed,
        },
    )
