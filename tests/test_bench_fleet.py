"""The ``fleet`` bench runner (iop/bench/_fleet.py): what a window counts, the
figures derived from it, and one small run on real processes."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop.bench import RUNNERS, ReportInput, RunContext
from iop.bench._fleet import Options, Recorder, relative, stream_bodies, summarize, tables

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "fleet.toml"


def test_the_scenario_names_the_runner_and_only_its_options() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "fleet"
    opts = msgspec.convert(scenario["args"], Options)  # an unknown key would raise
    assert opts.levels == [256, 1024]
    assert {"split", "up", "direct"} == set(opts.shapes)


def test_only_what_happens_inside_the_window_is_counted() -> None:
    rec = Recorder(opened=10.0, closed=20.0)
    # A stream sent before the window: its tokens inside count, its TTFT does not.
    rec.token(started=9.0, prev=None, t=9.5)  # before: nothing
    rec.token(started=9.0, prev=9.5, t=10.1)  # inside, but the gap began outside
    rec.token(started=9.0, prev=10.1, t=10.3)  # inside, gap inside
    # A stream sent inside: its TTFT counts.
    rec.token(started=11.0, prev=None, t=11.2)
    # After the window: nothing.
    rec.token(started=19.0, prev=19.9, t=20.0)
    rec.ended(15.0, "")
    rec.ended(16.0, "incomplete")
    rec.ended(21.0, "")  # after the window
    assert rec.tokens == 3
    assert rec.gaps_s == [pytest.approx(0.2)]
    assert rec.ttft_s == [pytest.approx(0.2)]
    assert rec.streams == 1
    assert rec.errors == {"incomplete": 1}


def _cpu(cpu_s: dict[str, float], wall: float = 10.0) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "cpu_s": cpu_s,
        "cpu_pct_of_core": {k: round(100 * v / wall, 1) for k, v in cpu_s.items()},
        "foreign_cpu_pct_of_core": 50.0,
        "loadavg": [1.0, 1.0, 1.0],
    }


def test_cpu_per_token_and_tokens_per_core_per_process_and_in_total() -> None:
    rec = Recorder(opened=0.0, closed=10.0, tokens=20_000)
    rec.ttft_s = [0.004, 0.006]
    rec.gaps_s = [0.02] * 99 + [0.05]
    w = summarize(
        rec,
        _cpu({"edge": 9.5, "node": 2.5, "sim0": 1.0, "sim1": 1.0, "client": 3.0}),
        ["edge", "node"],
        tokens=64,
    )
    assert w["tokens_per_s"] == 2000.0
    assert w["procs"]["edge"]["us_per_token"] == 475.0
    assert w["procs"]["edge"]["tokens_per_s_per_core"] == 2105
    assert w["procs"]["edge"]["saturated"] is True  # 95 % of a core
    assert w["procs"]["node"]["saturated"] is False
    assert w["gateway_us_per_token"] == 600.0
    assert w["gateway_ms_per_request"] == 38.4  # 600 µs x 64 tokens
    assert w["gateway_tokens_per_s_per_core"] == round(20_000 / 12)
    assert w["sims_us_per_token"] == 100.0
    assert w["client_us_per_token"] == 150.0


def test_added_latency_and_throughput_are_against_direct_at_the_same_level() -> None:
    def window(tps: float, ttft: tuple[float, float], gap99: float) -> dict[str, Any]:
        return {
            "tokens_per_s": tps,
            "ttft_ms": {"p50": ttft[0], "p99": ttft[1]},
            "gap_ms": {"p50": 20.0, "p99": gap99},
        }

    level = {
        "direct": window(2000.0, (2.0, 6.0), 25.0),
        "split": window(1900.0, (7.5, 30.0), 40.0),
    }
    relative(level)
    assert "added_ttft_ms" not in level["direct"]
    split = level["split"]
    assert split["added_ttft_ms"] == {"p50": 5.5, "p99": 24.0}
    assert split["added_gap_p99_ms"] == 15.0
    assert split["throughput_pct_of_direct"] == 95.0


@pytest.mark.slow
def test_the_fleet_runner_measures_every_shape_on_real_processes(tmp_path: Path) -> None:
    runner = RUNNERS["fleet"]
    result = runner.run(
        Options(profile=False), RunContext(python=sys.executable, workdir=tmp_path, smoke=True)
    )
    assert list(result["levels"]) == ["c8"]
    level = result["levels"]["c8"]
    assert list(level) == ["direct", "split", "up"]
    for shape, procs in (("split", {"edge", "node"}), ("up", {"up"})):
        w = level[shape]
        assert w["errors"] == {}, w["errors"]
        assert w["tokens"] > 0
        assert set(w["procs"]) == procs
        assert w["gateway_us_per_token"] > 0
        assert w["added_ttft_ms"]["p50"] is not None
    assert level["direct"]["procs"] == {}
    assert result["fd_limit"]["now"] >= 3 * 8
    text = tables(result)
    assert "| 8 | split |" in text
    assert "| total |" in text
    # What `iop bench report` writes between <!-- bench:fleet --> markers.
    assert runner.report is not None
    reported = runner.report(
        ReportInput(
            scenario="fleet",
            median=result,
            repeats=[result],
            foreign_cpu_pct=[0.0],
            img_dir=tmp_path / "img",
            footer="_footer_",
        )
    )
    assert reported == {"fleet": f"{text}\n\n_footer_"}
    # The figure beside the table: both panels from the same result.
    (png,) = (tmp_path / "img").glob("*.png")
    assert png.name == "bench_fleet.png"
    assert png.read_bytes().startswith(b"\x89PNG")


def test_every_stream_asks_with_its_own_prompt() -> None:
    # One prompt for all would be placed by its prefix on one instance: one
    # sim would carry the fleet (the first run of the scenario did).
    bodies = stream_bodies(256)
    prompts = {msgspec.json.decode(b)["messages"][0]["content"] for b in bodies}
    assert len(prompts) == 256
