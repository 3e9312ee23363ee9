"""The ``routing`` runner (``iop.bench._routing``): a smoke run on real
processes reports every cell with the figures it promises, its scenario
file decodes, and its tables and plot come out of a result.

Shapes only: timings on a shared machine at smoke sizes mean nothing
(docs/benchmarks.md, "Placement: prefix-aware against least-loaded").
"""

from __future__ import annotations

import itertools
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop.bench._routing import Options, run
from iop.bench._routing_report import plots, tables
from iop.bench._runner import RUNNERS, RunContext

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "routing.toml"


def test_a_smoke_run_measures_every_cell(tmp_path: Path) -> None:
    opts = Options(workloads=["shared", "unique"], placements=["prefix"])
    result = run(opts, RunContext(python=sys.executable, workdir=tmp_path, smoke=True))
    json.dumps(result)  # JSON-able as it is
    assert [(c["workload"], c["placement"]) for c in result["cells"]] == [
        ("shared", "prefix"),
        ("unique", "prefix"),
    ]
    smoke_requests = result["options"]["requests"]
    for cell in result["cells"]:
        assert cell["errors"] == {}
        assert cell["requests"] == smoke_requests
        assert set(cell["ttft_ms"]) >= {"p50", "p90", "p99"}
        assert cell["ttft_ms"]["p90"] is not None
        assert cell["throughput_tok_s"] > 0
        # Every run's placement came back from the edge's exported timelines.
        assert cell["timelines_found"] == smoke_requests
        assert sum(cell["per_instance"].values()) == smoke_requests
        assert set(cell["rules"]) <= {"prefix", "least-loaded (balance)"}
        assert set(cell["cpu_s"]) >= {"edge", "node", "sim0", "sim1", "client"}
    shared, unique = result["cells"]
    # Each tenant's prompt came again after the warm-up: the sims found
    # cached blocks; unique prompts never share one.
    assert shared["hit_rate"] > 0
    assert unique["hit_rate"] == 0
    # The prefix index as the edge's admin view showed it at the cell's end.
    assert shared["prefix_index"]["entries"] > 0
    assert {"homes", "replicas", "replicas_made", "replicas_dropped"} <= set(shared["prefix_index"])
    assert unique["instances_per_tenant"] is None
    # Every process was stopped.
    assert not any(p.alive for p in _procs_of(tmp_path))


def _procs_of(workdir: Path) -> list[Any]:
    from iop.testing import Proc

    return [p for p in Proc.ALL if p.stdout_path.parent == workdir]


def test_the_scenario_file_names_the_runner_and_its_options() -> None:
    data = tomllib.loads(SCENARIO.read_text())
    assert data["runner"] == "routing" in RUNNERS
    opts = msgspec.convert(data["args"], Options)
    assert opts.workloads == ["shared", "unique"]
    assert opts.placements == ["random", "least_loaded", "affinity", "prefix"]
    # The scenario's shape (docs/benchmarks.md, "Placement: prefix-aware against
    # least-loaded"): 32 tenants, 2k-token prefixes, 4 instances; each cache
    # too small for every tenant's prefix.
    assert (opts.tenants, opts.prefix_tokens, opts.instances) == (32, 2048, 4)
    assert opts.kv_cache_blocks * opts.kv_block_tokens < opts.tenants * opts.prefix_tokens
    with pytest.raises(msgspec.ValidationError, match="rqeuests"):
        msgspec.convert({**data["args"], "rqeuests": 1}, Options)


def _cell(workload: str, placement: str, p90: float, tok_s: float) -> dict[str, Any]:
    return {
        "workload": workload,
        "placement": placement,
        "errors": {},
        "ttft_ms": {"p50": p90 / 2, "p90": p90},
        "throughput_tok_s": tok_s,
        "answers_per_s": tok_s / 32,
        "hit_rate": 0.5,
        "instances_per_tenant": 1.5,
        "foreign_cpu_pct": 10.0,
    }


def test_the_tables_median_the_repeats_and_judge_the_targets(tmp_path: Path) -> None:
    repeats = [
        {
            "cells": [
                _cell("shared", "least_loaded", p90, 300.0),
                _cell("shared", "prefix", p90 / 4, 300.0),
                _cell("unique", "least_loaded", 500.0, tok),
                _cell("unique", "prefix", 500.0, tok * 0.9),
            ]
        }
        for p90, tok in ((400.0, 300.0), (600.0, 320.0), (500.0, 310.0))
    ]
    out = tables(repeats)
    assert set(out) == {"routing", "routing-target"}
    assert "| shared | prefix | 62 | 125 |" in out["routing"]
    assert "Median of 3 repeat(s)" in out["routing"]
    target = out["routing-target"].splitlines()
    assert target[2].endswith("| 500 ms | 125 ms | 4.00x | yes |")
    assert target[3].endswith("| 0.900 | no |")
    pytest.importorskip("matplotlib")
    (png,) = plots(repeats, tmp_path)
    assert png.name == "bench_routing.png"
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_agents_workload_grows_each_sessions_transcript_behind_one_head() -> None:
    from iop.bench._routing_load import requests as _requests

    opts = Options(workloads=["agents"], placements=["session"], tenants=3, requests=12)
    reqs = _requests(opts, "agents", "t")
    heads = {json.dumps(r.messages[:2]) for r in reqs}
    assert len(heads) == 1  # one system prompt and brief: the head key cannot tell them apart
    for session in range(3):
        mine = [r for r in reqs if r.tenant == session]
        lengths = [len(r.messages) for r in mine]
        assert lengths == list(range(2, 2 + 2 * len(mine), 2))
        for before, after in itertools.pairwise(mine):
            assert after.messages[: len(before.messages)] == before.messages  # a growing prefix


def test_the_skewed_scenarios_are_the_workload_of_their_section() -> None:
    """docs/benchmarks.md, "Prefix placement on a skewed workload, caches
    reported": 24 tenants of 1-2k tokens, 14 % down to 2 % of the requests,
    16 closed-loop clients, caches of about 1.4 copies of every prefix."""
    for name, window in (("routing-skewed", 60.0), ("routing-skewed-long", 600.0)):
        data = tomllib.loads((SCENARIO.parent / f"{name}.toml").read_text())
        opts = msgspec.convert(data["args"], Options)
        assert (opts.tenants, opts.prefix_tokens_min, opts.prefix_tokens) == (24, 1024, 2048)
        weights = [(t + 1) ** -opts.zipf_s for t in range(opts.tenants)]
        assert round(weights[0] / sum(weights), 2) == 0.14
        assert round(weights[-1] / sum(weights), 2) == 0.02
        assert (opts.clients, opts.duration_s, opts.max_concurrency) == (16, window, 8)
        copies = opts.instances * opts.kv_cache_blocks * opts.kv_block_tokens / (24 * 1536)
        assert 1.3 < copies < 1.5
        assert opts.kv_events


def test_misses_are_counted_per_window_of_sending_time() -> None:
    from iop.bench._routing_load import Sample as _Sample
    from iop.bench._routing_load import misses_per_window as _misses_per_window

    def sample(at: float, cached: int, measured: bool = True) -> _Sample:
        return _Sample(0, 0, measured, at, prompt_tokens=100, cached_tokens=cached)

    samples = [
        sample(0.0, 0, measured=False),  # the warm-up: not counted
        sample(1.0, 100),
        sample(2.0, 10),  # a miss: less than half cached
        sample(12.0, 60),
        sample(31.0, 0),
    ]
    assert _misses_per_window(samples, 10.0) == [0.5, 0.0, None, 1.0]
    assert _misses_per_window([], 10.0) == []


def test_a_closed_loop_report_has_its_repeats_table_and_misses_plot(tmp_path: Path) -> None:
    from iop.bench._routing_report import misses_plot, repeats_table

    def cell(placement: str, p90: float, hits: float) -> dict[str, Any]:
        return {
            "workload": "shared",
            "placement": placement,
            "ttft_ms": {"p90": p90},
            "throughput_tok_s": 400.0,
            "hit_requests": hits,
            "span_s": 60.0,
            "misses_per_window": [0.1, None, 0.05],
        }

    repeats = [
        {
            "repeat": 0,
            "options": {"window_s": 10.0},
            "cells": [cell("least_loaded", 300, 0.4), cell("prefix", 100, 0.95)],
        }
    ]
    table = repeats_table(repeats).splitlines()
    assert table[2] == "| 0 | 60 | 300 | 100 | 3.00x | 400.0 | 400.0 | 5.0 % | 10.0 % / 5.0 % |"
    pytest.importorskip("matplotlib")
    (png,) = misses_plot(repeats, tmp_path, "skewed")
    assert png.name == "bench_skewed_misses.png"
    assert misses_plot([{"repeat": 0, "options": {}, "cells": []}], tmp_path, "x") == []
