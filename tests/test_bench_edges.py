"""The ``edges`` bench runner (iop/bench/_edges.py) runs on real processes and
reports what it promises; its scenario file names only its options."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from iop.bench import RUNNERS, ReportInput, RunContext
from iop.bench._edges import Options, tables

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "edges.toml"


def test_the_scenario_names_the_runner_and_only_its_options() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "edges"
    msgspec.convert(scenario["args"], Options)  # an unknown key would raise


@pytest.mark.slow
def test_the_edges_runner_measures_both_setups_and_the_limit(tmp_path: Path) -> None:
    runner = RUNNERS["edges"]
    result = runner.run(
        Options(limit=30), RunContext(python=sys.executable, workdir=tmp_path, smoke=True)
    )
    local, one, two = result["throughput"]
    assert (local["edges"], one["edges"], two["edges"]) == ("1, no Valkey", 1, 2)
    assert "valkey" in local["cpu_ms_per_answer"]  # it runs, unused
    assert one["ok"] > 0
    assert two["ok"] > 0
    assert {"edge-a", "edge-b", "valkey"} <= two["cpu_ms_per_answer"].keys()
    lim = result["limit"]
    assert lim["sent"] == 90
    assert lim["non_429_refusals"] == []
    assert len(lim["admitted_per_edge"]) == 2
    assert "| 2 |" in tables(result)
    # What `iop bench report` writes between <!-- bench:edges --> markers.
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario="edges",
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "img",
            footer="_footer_",
        )
    )
    assert reported == {"edges": f"{tables(result)}\n\n_footer_"}
