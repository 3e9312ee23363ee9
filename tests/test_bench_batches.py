"""The ``batches`` runner (``iop.bench._batches``): a smoke run on real
processes reports every phase with the figures it promises, the kill -9
phase answers every line once, and its scenario file decodes. Shapes only:
timings at smoke sizes on a shared machine mean nothing
(docs/benchmarks.md, "Batches on spare capacity")."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import msgspec

from iop.bench._batches import Options, run, tables
from iop.bench._runner import RUNNERS, RunContext

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "batches.toml"


def test_the_scenario_decodes_and_the_runner_is_registered() -> None:
    raw = tomllib.loads(SCENARIO.read_text())
    assert raw["runner"] == "batches"
    opts = msgspec.convert(raw["args"], Options)
    assert RUNNERS["batches"].options is Options
    assert opts.batch_lines == 5000
    assert opts.capacity > 0


def test_a_smoke_run_measures_every_phase(tmp_path: Path) -> None:
    result = run(Options(), RunContext(python=sys.executable, workdir=tmp_path, smoke=True))
    json.dumps(result)
    phases = result["phases"]
    assert set(phases) == {"alone", "with_batch", "idle_batch", "kill9"}
    for phase in ("alone", "with_batch"):
        assert phases[phase]["interactive"]["failed"] == 0
        assert set(phases[phase]["interactive"]["ttft_ms"]) == {"p50", "p90", "p99"}
    assert phases["idle_batch"]["batch"]["status"] == "completed"
    assert phases["idle_batch"]["batch"]["completed"] == 40
    kill = phases["kill9"]["batch"]
    assert kill["status"] == "completed"
    assert (kill["answers"], kill["duplicates"], kill["missing"], kill["ok_200"]) == (40, 0, 0, 40)
    table = tables(result)
    assert table.startswith("| phase | interactive sent |")
    assert "kill -9 at" in table
