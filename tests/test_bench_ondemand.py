"""The ``ondemand`` runner (``iop.bench._ondemand``): its plan, its figures'
arithmetic, its scenario file, and a smoke run on real processes that reports
both modes with the figures it promises. Shapes only: timings at smoke sizes
on a shared machine mean nothing (docs/benchmarks.md, "Models on demand")."""

from __future__ import annotations

import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from iop.bench._ondemand import Options, memory_seconds, metric_sums, plan, run, zipf_weights
from iop.bench._ondemand_report import plots, tables
from iop.bench._runner import RUNNERS, RunContext

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "ondemand.toml"


def test_the_scenario_decodes_and_the_runner_is_registered() -> None:
    raw = tomllib.loads(SCENARIO.read_text())
    assert raw["runner"] == "ondemand"
    opts = msgspec.convert(raw["args"], Options)
    assert RUNNERS["ondemand"].options is Options
    # The brief's shape: 6 models, room for 2 per node, 3 nodes.
    assert (opts.models, opts.per_node, opts.nodes) == (6, 2, 3)


def test_zipf_weights_fall_with_rank_and_sum_to_one() -> None:
    w = zipf_weights(6, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert w == sorted(w, reverse=True)
    assert w[0] / w[1] == pytest.approx(2**1.1)
    assert zipf_weights(4, 0.0) == [0.25] * 4


def test_the_plan_is_seeded_skewed_and_rotates_each_phase() -> None:
    opts = Options(duration_s=600.0, rate_per_s=20.0, phase_s=300.0, rotate=2)
    arrivals = plan(opts)
    assert arrivals == plan(opts)
    assert arrivals != plan(msgspec.structs.replace(opts, seed=2))
    assert all(0 < a.at_s < 600.0 for a in arrivals)
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    # About rate * duration arrivals (Poisson: within a few standard deviations).
    assert abs(len(arrivals) - 12000) < 5 * 12000**0.5
    first = Counter(a.model for a in arrivals if a.at_s < 300.0)
    second = Counter(a.model for a in arrivals if a.at_s >= 300.0)
    # Rank 1 is m0 first, then m2 (rotated by two); the coldest, m5, then m1.
    assert first.most_common(1)[0][0] == "m0"
    assert second.most_common(1)[0][0] == "m2"
    assert first["m0"] > 3 * first["m5"]
    assert second["m2"] > 3 * second["m1"]


def test_options_refuse_what_cannot_run() -> None:
    with pytest.raises(msgspec.ValidationError, match="per_node"):
        msgspec.convert({"models": 2, "per_node": 3}, Options)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"modles": 2}, Options)


def test_memory_seconds_integrates_a_step_function_over_the_window() -> None:
    samples = [(0.5, 1000.0), (2.0, 2000.0), (5.0, 0.0)]
    # From 1 to 2 at 1000 (the first sample holds from the start), 2..5 at 2000, then 0.
    assert memory_seconds(samples, 1.0, 6.0) == pytest.approx(1000 + 6000)
    assert memory_seconds(samples, 3.0, 4.0) == pytest.approx(2000)
    assert memory_seconds([], 0.0, 1.0) == 0.0
    assert memory_seconds(samples, 2.0, 2.0) == 0.0


def test_metric_sums_add_each_counter_over_models() -> None:
    text = (
        "# HELP iop_model_loads_total x\n"
        'iop_model_loads_total{model="m0"} 3.0\n'
        'iop_model_loads_total{model="m1"} 2.0\n'
        'iop_model_cold_starts_total{model="m1"} 7.0\n'
        'iop_model_load_seconds_count{model="m0"} 3.0\n'
        'iop_runs_total{model="m0",outcome="complete",reason="stop"} 9.0\n'
    )
    assert metric_sums(text) == {"loads": 5.0, "cold_starts": 7.0}


@pytest.mark.slow
def test_a_smoke_run_measures_both_modes(tmp_path: Path) -> None:
    result = run(Options(), RunContext(python=sys.executable, workdir=tmp_path, smoke=True))
    json.dumps(result)
    modes = result["modes"]
    assert set(modes) == {"on_demand", "all_loaded"}
    for m in modes.values():
        assert m["errors"] == {}, m["errors"]
        assert m["answered"] == m["sent"] == result["requests"]
        assert set(m["ttft_ms"]) == {"p50", "p90", "p99"}
        assert m["memory_series"]
    loaded, demand = modes["all_loaded"], modes["on_demand"]
    # Every model pinned and ready before the first request: no load, no cold start.
    assert (loaded["loads"], loaded["cold_starts"], loaded["evictions"]) == (0, 0, 0)
    assert loaded["memory_share"] == pytest.approx(1.0, abs=0.05)
    # On demand, the nodes load what is asked for, and hold less than everything.
    assert demand["loads"] > 0
    # A run is a cold start at most once, however many attempts it took.
    assert 0 < demand["cold_starts"] <= demand["sent"]
    assert demand["memory_share"] < 1.0
    text = tables(result)
    assert text.startswith("| mode | answered |")
    assert "every model loaded everywhere" in text
    [png] = plots(result, tmp_path / "img")
    assert png.name == "bench_ondemand.png"
    assert png.stat().st_size > 0
