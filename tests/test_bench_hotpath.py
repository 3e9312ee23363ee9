"""The ``hotpath`` bench runner (iop/bench/_hotpath.py) measures every stage it
promises and reports each; its scenario file names only its options."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import msgspec

from iop.bench import RUNNERS, ReportInput, RunContext
from iop.bench._cli import discover
from iop.bench._hotpath import Options, tables

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "hotpath.toml"
STAGES = {"sse", "parser", "runtime", "edge", "edge_tools", "edge_strict"}

discover()


def test_the_scenario_names_the_runner_and_only_its_options() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "hotpath"
    msgspec.convert(scenario["args"], Options)  # an unknown key would raise


def test_the_hotpath_runner_measures_every_stage(tmp_path: Path) -> None:
    runner = RUNNERS["hotpath"]
    result = runner.run(
        Options(chunks=64, repeat=2), RunContext(python=sys.executable, workdir=tmp_path)
    )
    assert set(result["stages"]) == STAGES
    for stage in result["stages"].values():
        assert 0 <= stage["us_per_chunk_min"] <= stage["us_per_chunk_median"]
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario="hotpath",
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "img",
            footer="_footer_",
        )
    )
    assert reported == {"hotpath": f"{tables(result)}\n\n_footer_"}
    assert all(f"| `{name}` |" in tables(result) for name in STAGES)
