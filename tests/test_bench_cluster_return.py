"""The ``cluster-return`` bench runner (iop/bench/_cluster_return.py) pauses a
real ``valkey-server`` under a real edge's shared limits and reports every
trial; its scenario file names only its options."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import msgspec

from iop.bench import RUNNERS, ReportInput, RunContext
from iop.bench._cli import discover
from iop.bench._cluster_return import Options, tables

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "cluster-return.toml"

discover()


def test_the_scenario_names_the_runner_and_only_its_options() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "cluster-return"
    msgspec.convert(scenario["args"], Options)  # an unknown key would raise


def test_the_runner_times_every_trial_and_reports_them(tmp_path: Path) -> None:
    runner = RUNNERS["cluster-return"]
    opts = Options(trials=2, retry_interval_s=0.2, max_pause_s=0.05)
    result = runner.run(opts, RunContext(python=sys.executable, workdir=tmp_path))
    assert len(result["back_s"]) == 2
    assert all(t >= 0 for t in result["back_s"])
    assert result["min_s"] <= result["median_s"] <= result["max_s"]
    assert (tmp_path / "valkey.stdout").exists()  # the server ran, its log in the run's dir
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario="cluster-return",
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "img",
            footer="_footer_",
        )
    )
    assert reported == {"cluster-return": f"{tables(result)}\n\n_footer_"}
    assert "| 0.2 | 2 |" in tables(result)
