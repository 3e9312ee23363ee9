"""The ``floor`` bench runner (iop/bench/_floor.py) measures every operation it
promises and reports each; its scenario file names only its options."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import msgspec

from iop.bench import RUNNERS, ReportInput, RunContext
from iop.bench._cli import discover
from iop.bench._floor import Options, tables

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "floor.toml"
OPERATIONS = {
    "socket round trip",
    "socket send (writable)",
    "socket receive (ready)",
    "task hop",
    "cancel scope",
    "h11 chunk",
    "h11 chunk read",
    "chat chunk parse",
    "wsproto frame",
    "chunked decoder read",
    "node link frame",
    "node link send (writable)",
    "msgspec batch",
    "wake-up from idle, trio (CPU)",
    "wake-up from idle, bare epoll (CPU)",
    "loopback write that wakes its reader (CPU)",
}

discover()


def test_the_scenario_names_the_runner_and_only_its_options() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "floor"
    msgspec.convert(scenario["args"], Options)  # an unknown key would raise


def test_the_floor_runner_measures_every_operation(tmp_path: Path) -> None:
    runner = RUNNERS["floor"]
    result = runner.run(
        Options(n=50, repeat=1), RunContext(python=sys.executable, workdir=tmp_path)
    )
    assert set(result["us_per_op"]) == OPERATIONS
    assert all(v > 0 for v in result["us_per_op"].values())
    assert result["options"] == {"n": 50, "repeat": 1}
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario="floor",
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "img",
            footer="_footer_",
        )
    )
    assert reported == {"floor": f"{tables(result)}\n\n_footer_"}
    assert all(f"| {name} |" in tables(result) for name in OPERATIONS)
