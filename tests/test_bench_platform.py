"""``iop/bench/_platform.py``'s arithmetic: what the lead reads the targets from.

The measuring itself needs minutes of real processes (docs/benchmarks.md);
these tests check, on made-up windows, the figures derived from them: added
TTFT and throughput against direct in the same repeat, medians per cell,
the sweep's fit, the targets' verdicts, the level plan and the py-spy summary.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from iop.bench import _platform
from iop.bench._procs import summarize_raw


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _platform


def window(shape: str, req_per_s: float, p50: float, p99: float, cpu: dict[str, float]) -> Any:
    return {
        "shape": shape,
        "level": "paced-c32",
        "requests": 100,
        "ok": 100,
        "errors": {},
        "req_per_s": req_per_s,
        "cpu_ms_per_req": cpu,
        "gateway_cpu_ms_per_req": sum(cpu.values()) if cpu else None,
        "gateway_us_per_chunk": None,
        "sim_cpu_ms_per_req": 1.0,
        "client_cpu_ms_per_req": 1.0,
        "client_reads_per_response": 67.0,
        "foreign_cpu_pct_of_core": 0.0,
        "ttft_ms": {"p50": p50, "p99": p99},
        "total_ms": {"p50": 1300.0, "p99": 1400.0},
        "loadavg_after": [1.0, 1.0, 1.0],
    }


def test_added_ttft_and_throughput_are_against_direct_in_the_same_repeat(
    bench: ModuleType,
) -> None:
    direct = window("direct", 25.0, 2.0, 6.0, {})
    split = window("split", 24.5, 5.0, 30.0, {"edge": 3.0, "node": 4.0})
    bench.relative([direct, split], direct)
    assert direct["throughput_pct_of_direct"] == 100.0
    assert direct["added_ttft_p50_ms"] is None
    assert split["throughput_pct_of_direct"] == 98.0
    assert (split["added_ttft_p50_ms"], split["added_ttft_p99_ms"]) == (3.0, 24.0)
    # Without direct in the run, no relative figure.
    alone = window("up", 24.0, 5.0, 9.0, {"up": 6.0})
    bench.relative([alone], None)
    assert alone["throughput_pct_of_direct"] is None
    assert alone["added_ttft_p99_ms"] is None


def test_every_cell_is_the_median_of_its_repeats(bench: ModuleType) -> None:
    reps = [
        window("split", r, t, 2 * t, {"edge": e, "node": n})
        for r, t, e, n in ((20.0, 4.0, 3.0, 9.0), (30.0, 1.0, 5.0, 4.0), (25.0, 9.0, 4.0, 5.0))
    ]
    cell = bench.merge(reps)
    assert cell["req_per_s"] == 25.0
    assert cell["ttft_ms"] == {"p50": 4.0, "p99": 8.0}
    # Each figure on its own: the median edge and the median node need not be
    # the same repeat's, nor add up to the median total.
    assert cell["cpu_ms_per_req"] == {"edge": 4.0, "node": 5.0}
    assert cell["gateway_cpu_ms_per_req"] == 9.0
    assert cell["gateway_cpu_ms_range"] == [9.0, 12.0]
    assert cell["requests"] == 300
    assert len(cell["repeats"]) == 3


def test_the_sweep_fit_and_the_targets(bench: ModuleType) -> None:
    specs = [
        bench.LevelSpec(f"fast-{k}ch", "fast", bench.MODEL_FAST, 32, 256, 32, chunks=k)
        for k in (1, 16, 64, 256)
    ]

    def cell(edge: float, node: float) -> dict[str, Any]:
        return {
            "cpu_ms_per_req": {"edge": edge, "node": node},
            "gateway_cpu_ms_per_req": edge + node,
        }

    # edge 1 ms + 10 µs/chunk, node 0.5 ms + 30 µs/chunk: exact lines.
    cells: dict[str, dict[str, Any]] = {
        s.name: {"split": cell(1 + 0.01 * s.chunks, 0.5 + 0.03 * s.chunks)} for s in specs
    }
    fits = bench.sweep_fits(cells, specs)
    assert fits["split"]["edge"] == {"fixed_ms": 1.0, "per_chunk_us": 10.0}
    assert fits["split"]["node"] == {"fixed_ms": 0.5, "per_chunk_us": 30.0}
    assert fits["split"]["gateway"] == {"fixed_ms": 1.5, "per_chunk_us": 40.0}
    assert "up" not in fits

    cells["paced-c32"] = {
        "split": {"gateway_cpu_ms_per_req": 8.0, "throughput_pct_of_direct": 98.9},
        "up": {"gateway_cpu_ms_per_req": 8.5, "throughput_pct_of_direct": 99.0},
    }
    t = bench.check_targets(cells, fits)
    assert t["fast_fixed"]["split"] == {"value": 1.5, "met": True}
    assert t["fast_per_chunk"]["split"] == {"value": 40.0, "met": True}  # the bound is met
    assert t["paced_c32_cpu"]["split"]["met"] is True
    assert t["paced_c32_cpu"]["up"]["met"] is False
    assert t["paced_c32_throughput"]["split"]["met"] is False
    assert t["paced_c32_throughput"]["up"]["met"] is True
    assert t["nonstream_cpu"]["split"] == {"value": None, "met": None}  # not measured
    assert t["paced_c32_cpu"]["bound"] == "<= 8 ms/request"


def test_the_default_levels(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.shape_list == ["direct", "up", "split", "litellm"]
    specs = {s.name: s for s in bench.level_specs(args)}
    assert list(specs) == [
        "paced-c32",
        "paced-c1",
        "fast-1ch",
        "fast-16ch",
        "fast-64ch",
        "fast-256ch",
        "nonstream",
    ]
    paced = specs["paced-c32"]
    # 32 starts spread over one 64-chunk stream at 50 tok/s (1.28 s).
    assert paced.stagger_s == pytest.approx(0.04)
    assert (paced.concurrency, paced.chunks, paced.warmup, paced.model) == (
        32,
        64,
        16,
        bench.MODEL_PACED,
    )
    assert specs["paced-c1"].concurrency == 1
    assert math.isinf(specs["paced-c1"].max_s)
    assert not specs["nonstream"].stream
    assert b'"iop_sim":{"output_tokens":256}' in specs["fast-256ch"].body()


@pytest.mark.parametrize(
    "argv",
    [
        ["--shapes", "direct,nginx"],
        ["--shapes", ""],
        ["--repeat", "0"],
        ["--paced-concurrency", "1"],
    ],
)
def test_bad_options_are_refused(bench: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.parse_args(argv)
    assert info.value.code == 2


def test_the_py_spy_summary(bench: ModuleType, tmp_path: Path) -> None:
    site = "/venv/lib/python3.11/site-packages"
    run = f"run ({site}/trio/_core/_run.py:10)"
    raw = tmp_path / "edge.txt"
    raw.write_text(
        f"{run};send_all ({site}/trio/_highlevel_socket.py:5) 6\n"
        f"{run};_sse_body ({bench.REPO}/iop/edge/_app.py:9) 3\n"
        f"{run};encode ({site}/msgspec/json.py:1) 1\n"
        "not a stack line\n"
    )
    s = summarize_raw(raw)
    assert s["samples"] == 10
    assert s["self_pct_top_functions"][:3] == [
        ("send_all (trio)", 60.0),
        ("_sse_body (iop/edge)", 30.0),
        ("encode (msgspec)", 10.0),
    ]
    assert s["self_pct_by_package"][0] == ("trio", 60.0)
    assert ("trio", 100.0) in s["inclusive_pct_by_package"]
