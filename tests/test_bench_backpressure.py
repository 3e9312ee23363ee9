"""Smoke runs of the backpressure runners (docs/research.md, sections 1 and 3).

Each calls its runner directly at smoke sizes, on real processes (sim, edge,
node), and checks the result's shape, its tables and its plot: never a
number, which on a shared machine at these sizes means nothing.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from iop.bench import (
    RUNNERS,
    ReportInput,
    RunContext,
    _channel_capacity,
    _credit_window,
    _hol,
    _slow_reader,
)

pytestmark = pytest.mark.slow


def smoke(module: ModuleType, tmp_path: Path) -> dict[str, Any]:
    ctx = RunContext(python=sys.executable, workdir=tmp_path / "run", smoke=True)
    result: dict[str, Any] = module.run(module.Options(), ctx)
    tables = module.tables(result)
    assert tables
    assert all(text.startswith("|") for text in tables.values())
    (png,) = module.plots(result, tmp_path / "img")
    assert png.stat().st_size > 0
    # What `iop bench report` writes between the markers: the tables, each
    # ended with the run's footer.
    runner = next(r for r in RUNNERS.values() if r.run is module.run)
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario=runner.name,
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "report-img",
            footer="_footer_",
        )
    )
    assert reported == {key: f"{text}\n\n_footer_" for key, text in tables.items()}
    assert (tmp_path / "report-img" / png.name).stat().st_size > 0
    return result


def test_the_scenarios_name_their_runner_and_its_options() -> None:
    root = Path(__file__).resolve().parents[1] / "configs" / "bench"
    for name in ("slow-reader", "credit-window", "channel-capacity", "hol"):
        doc = tomllib.loads((root / f"{name}.toml").read_text())
        runner = RUNNERS[doc["runner"]]
        assert runner.name == name
        assert doc["description"]
        msgspec.convert(doc["args"], runner.options)  # unknown key: an error naming it


def test_the_runners_are_registered() -> None:
    for name, module in (
        ("slow-reader", _slow_reader),
        ("credit-window", _credit_window),
        ("channel-capacity", _channel_capacity),
        ("hol", _hol),
    ):
        assert RUNNERS[name].run is module.run
        assert RUNNERS[name].options is module.Options


def test_slow_reader_smoke(tmp_path: Path) -> None:
    result = smoke(_slow_reader, tmp_path)
    assert set(result["rss_kb"]) == {"before", "connected", "after"}
    assert set(result["rss_kb"]["connected"]) == {"edge", "node", "sim"}
    assert set(result["cpu_after_leaving"]["cpu_pct_of_core"]) >= {"edge", "node", "sim"}
    assert "backend_closed_after_s" in result


def test_credit_window_smoke_with_credit_off(tmp_path: Path) -> None:
    result = smoke(_credit_window, tmp_path)
    (point,) = result["points"]
    assert point["run_window"] == 0
    assert point["throughput"]["completed"] == result["options"]["streams"]
    assert {"edge_kib_per_reader", "node_kib_per_reader"} <= set(point["memory"])


def test_channel_capacity_smoke(tmp_path: Path) -> None:
    result = smoke(_channel_capacity, tmp_path)
    (point,) = result["points"]
    assert point["run_backlog"] == 4
    assert point["throughput"]["completed"] == result["options"]["streams"]


def test_hol_smoke_with_credit_off(tmp_path: Path) -> None:
    result = smoke(_hol, tmp_path)
    (mode,) = result["modes"]
    assert mode["run_window"] == 0
    assert mode["slow"]
    # Every fast run ends (after the stalled client is cut off).
    assert mode["completed"] == result["options"]["fast"]
    assert len(mode["fast"]) == result["options"]["fast"]
