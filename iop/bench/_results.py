"""Results of ``iop bench``: medians over repeats, the machine's foreign CPU,
the docs' marked blocks, and the statistics every runner takes of its samples.

A result file (``bench-results/bench-<stamp>.json``) holds, per scenario,
every repeat's result as its runner returned it and the median of them
(``median_tree``). ``rewrite_markers`` replaces the text between
``<!-- bench:KEY -->`` and ``<!-- /bench:KEY -->`` in a Markdown page and
leaves every other byte as it was.

``read_result`` reads a result file back for ``iop bench report`` as typed
data (``ResultFile``): a file that is not one (not JSON, another shape, a
format this version does not write) is a ``ResultError`` naming the file
and what is wrong, never a traceback.
"""

from __future__ import annotations

import math
import re
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from iop.bench._procs import machine_cpu_s

__all__ = [
    "CpuMeter",
    "Repeat",
    "ResultError",
    "ResultFile",
    "ScenarioResult",
    "counter_delta",
    "least_squares",
    "marker_keys",
    "median",
    "median_tree",
    "pct",
    "pct_ms",
    "read_result",
    "rewrite_markers",
    "summary",
]


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (NaN left out; NaN of nothing)."""
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    return vals[max(0, min(len(vals) - 1, math.ceil(p / 100 * len(vals)) - 1))]


def pct_ms(values: list[float], p: float) -> float | None:
    """``pct`` of seconds, in milliseconds to 0.1 ms; None of nothing (JSON has no NaN)."""
    v = pct(values, p)
    return None if math.isnan(v) else round(v * 1000, 1)


def summary(values: list[float]) -> dict[str, float | int]:
    """How many, p50, p99 and max of ``values`` (NaN left out)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "p50": round(pct(vals, 50), 2),
        "p99": round(pct(vals, 99), 2),
        "max": round(max(vals), 2),
    }


def least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The line ``y = intercept + slope * x`` nearest ``points`` (least squares):
    (intercept, slope); the slope is 0 when every x is the same."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def counter_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The counters that moved from ``before`` to ``after``, by how much."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v != before.get(k, 0)}


def median(values: list[float]) -> float | None:
    """The median of ``values`` (NaN left out); None of nothing."""
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def median_tree(values: list[Any]) -> Any:
    """The median of every number over ``values``, which share one shape.

    Dicts are merged key by key (a key some values lack is the median of those
    that have it); lists of one length element by element; numbers (None
    left out) by their median; anything else (strings, lists of different
    lengths) is taken from the first value.
    """
    if not values:
        return None
    if all(isinstance(v, dict) for v in values):
        keys: dict[str, None] = {}
        for v in values:
            keys.update(dict.fromkeys(v))
        return {k: median_tree([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [median_tree([v[i] for v in values]) for i in range(len(values[0]))]
    numbers = [v for v in values if _is_number(v)]
    if numbers and all(_is_number(v) or v is None for v in values):
        m = statistics.median(numbers)
        if all(isinstance(v, int) for v in numbers) and float(m).is_integer():
            return int(m)
        return round(m, 4) if isinstance(m, float) else m
    return values[0]


def _machine_busy_s() -> float:
    return machine_cpu_s()[0]


def _own_cpu_s() -> float:
    """CPU of this process and of every descendant it (or they) waited for."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuMeter:
    """The machine's *foreign* CPU over one run: busy CPU that neither this
    process nor its reaped descendants used, in % of one core.

    A runner stops (and so reaps) every process it starts before it
    returns, so their CPU is in ``RUSAGE_CHILDREN`` by then; a grandchild
    reaped by its parent is in its parent's.
    """

    wall0: float = 0.0
    busy0: float = 0.0
    own0: float = 0.0

    @classmethod
    def start(cls) -> CpuMeter:
        return cls(time.monotonic(), _machine_busy_s(), _own_cpu_s())

    def stop(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.wall0, 1e-9)
        own = _own_cpu_s() - self.own0
        foreign = max(0.0, _machine_busy_s() - self.busy0 - own)
        return {
            "wall_s": round(wall, 2),
            "own_cpu_s": round(own, 2),
            "foreign_cpu_pct": round(100 * foreign / wall, 1),
        }


def _marker_re(key: str) -> re.Pattern[str]:
    k = re.escape(key)
    return re.compile(rf"^(<!-- bench:{k} -->\n)(.*?)^(<!-- /bench:{k} -->)$", re.DOTALL | re.M)


# A marker is a line of its own: one quoted in a sentence or in `code` is not.
_OPEN = re.compile(r"^<!-- bench:([A-Za-z0-9][\w.:-]*) -->$", re.M)


def marker_keys(text: str) -> list[str]:
    """The keys of every ``<!-- bench:KEY -->`` marker in ``text``, in order."""
    return _OPEN.findall(text)


def rewrite_markers(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with the body of every marked block in ``blocks`` replaced.

    A marker is a line of its own. The body is everything between the
    opening marker's line and the closing marker's; it becomes ``blocks[key]`` followed by one newline.
    Returns the new text and the keys it rewrote. A key without a closing
    marker raises ValueError (a half-marked page would lose its rest).
    """
    done: list[str] = []
    for key in marker_keys(text):
        if key not in blocks:
            continue
        m = _marker_re(key).search(text)
        if m is None:
            raise ValueError(f"<!-- bench:{key} --> has no <!-- /bench:{key} --> after it")
        body = blocks[key].rstrip("\n") + "\n"
        text = text[: m.start()] + m[1] + body + m[3] + text[m.end() :]
        done.append(key)
    return text, done


# --------------------------------------------------------------------------- reading back


class ResultError(Exception):
    """A file ``iop bench report`` cannot use (the message names it and says why)."""


class Repeat(msgspec.Struct, kw_only=True):
    """One repeat of one scenario: its runner's result (None when it failed)."""

    repeat: int
    foreign_cpu_pct: float
    result: dict[str, Any] | None = None
    error: str | None = None


class ScenarioResult(msgspec.Struct, kw_only=True):
    """One scenario's repeats and their median (None when no repeat succeeded)."""

    file: str
    runner: str
    repeats: list[Repeat]
    median: dict[str, Any] | None = None
    foreign_cpu_pct: dict[str, float] | None = None  # {"min": ..., "max": ...}


class ResultFile(msgspec.Struct, kw_only=True):
    """What ``iop bench report`` reads of a result file (it holds more)."""

    format: int
    started: str
    commit: str
    loadavg_start: list[float]
    scenarios: dict[str, ScenarioResult]
    litellm: str | None = None
    smoke: bool = False


def read_result(path: Path, expected_format: int) -> ResultFile:
    """The result file at ``path``, checked.

    Raises:
        ResultError: it cannot be read, is not JSON, is of another format
            than ``expected_format``, or has not a result's shape.
    """
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise ResultError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise ResultError(f"{path}: not a result of `iop bench run` (not JSON: {exc})") from None
    found = raw.get("format") if isinstance(raw, dict) else None
    if isinstance(found, int) and found != expected_format:
        raise ResultError(
            f"{path}: a result of format {found}; this version reads "
            f"format {expected_format} (run the scenarios again)"
        )
    try:
        return msgspec.convert(raw, ResultFile)
    except msgspec.ValidationError as exc:
        raise ResultError(f"{path}: not a result of `iop bench run` ({exc})") from None
