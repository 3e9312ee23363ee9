"""The ``objectives`` runner (``iop.bench._objectives``): a smoke run on real
processes reports every phase with the figures it promises, and its scenario
file decodes. Shapes only: timings at smoke sizes on a shared machine mean
nothing (docs/benchmarks.md, "Objectives under overload")."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import msgspec

from iop.bench._objectives import Options, run, tables
from iop.bench._runner import RUNNERS, RunContext

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "objectives.toml"


def test_the_scenario_decodes_and_the_runner_is_registered() -> None:
    raw = tomllib.loads(SCENARIO.read_text())
    assert raw["runner"] == "objectives"
    opts = msgspec.convert(raw["args"], Options)
    assert RUNNERS["objectives"].options is Options
    assert opts.capacity > 0


def test_a_smoke_run_measures_every_phase(tmp_path: Path) -> None:
    result = run(Options(), RunContext(python=sys.executable, workdir=tmp_path, smoke=True))
    json.dumps(result)
    phases = result["phases"]
    assert set(phases) == {
        "unloaded",
        "queue_only",
        "loaded",
        "reserved",
        "engine_priority",
        "no_objectives",
    }
    counts = {"preempted", "overflowed", "engine_preempted"}
    assert set(phases["unloaded"]) == {"interactive", *counts}
    for phase in ("queue_only", "loaded", "reserved", "engine_priority", "no_objectives"):
        assert set(phases[phase]) == {"interactive", "batch", *counts}
    # Without preemption the edge preempts nothing; without engine priority
    # no run overflows and the sims (priority 0 for every request) preempt none.
    assert phases["queue_only"]["preempted"] == 0
    for phase in ("unloaded", "queue_only", "loaded", "reserved", "no_objectives"):
        assert phases[phase]["overflowed"] == 0
        assert phases[phase]["engine_preempted"] == 0
    for got in phases.values():
        for kind in ("interactive", "batch"):
            c = got.get(kind)
            if c is None:
                continue
            assert c["failed_5xx"] == 0
            assert set(c["ttft_ms"]) == {"p50", "p90", "p99"}
    assert phases["unloaded"]["interactive"]["answered"] > 0
    table = tables(result)
    assert table.startswith("| phase | class |")
    assert "| loaded | batch |" in table
    assert "| reserved | batch |" in table
    assert "| engine_priority | batch |" in table
