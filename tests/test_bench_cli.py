"""``iop bench``: scenario files checked against their runner, the docs'
marked blocks rewritten byte for byte, and one smoke run of real processes.

The smoke run checks the result's shape only: its numbers, on a shared
machine and at smoke sizes, mean nothing (docs/bench.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop.bench import RunContext, _platform, register
from iop.bench._cancel_report import print_cancel
from iop.bench._cli import SCENARIOS, discover
from iop.bench._memory import print_memory
from iop.bench._results import median_tree, rewrite_markers
from iop.bench._scenario import ScenarioError, load_scenario
from iop.cli import main

discover()


class _NoOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    fail: str = "error"


@register("test-fails", _NoOptions, "fails at once (tests/test_bench_cli.py)")
def _fails(opts: _NoOptions, ctx: RunContext) -> dict[str, Any]:
    if opts.fail == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError("this runner always fails")


def scenario(tmp_path: Path, text: str, name: str = "s") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- scenarios


def test_every_shipped_scenario_loads() -> None:
    files = sorted(SCENARIOS.glob("*.toml"))
    assert {f.stem for f in files} >= {"platform", "cancel", "research-cancel", "memory"}
    for f in files:
        sc = load_scenario(f)
        assert sc.description, f


def test_unknown_runner_is_an_error_listing_the_known_ones(tmp_path: Path) -> None:
    path = scenario(tmp_path, 'runner = "no-such-runner"\n')
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "unknown runner 'no-such-runner'" in msg
    for known in ("cancel", "platform", "memory", "overload", "idle-nodes"):
        assert known in msg


def test_unknown_key_in_args_names_it_and_the_valid_keys(tmp_path: Path) -> None:
    path = scenario(tmp_path, 'runner = "cancel"\n[args]\ntrials = 3\ntrails = 4\n')
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = str(info.value)
    assert "'trails' is not an option of runner 'cancel'" in msg
    assert "trials, windows, settle_ms" in msg


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    path = scenario(tmp_path, 'runner = "memory"\n[args]\nstreams = "many"\n')
    with pytest.raises(ScenarioError, match=r"\[args\] streams: Expected `int`, got `str`"):
        load_scenario(path)


def test_unknown_top_level_key_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="unknown field `runer`"):
        load_scenario(scenario(tmp_path, 'runer = "cancel"\n'))
    with pytest.raises(ScenarioError, match=r"s\.toml"):
        load_scenario(scenario(tmp_path, "runner = \n"))


def test_options_are_typed_with_defaults(tmp_path: Path) -> None:
    sc = load_scenario(scenario(tmp_path, 'runner = "cancel"\n[args]\ntrials = 3\n'))
    assert sc.options.trials == 3  # type: ignore[attr-defined]
    assert sc.options.mid_chunks == 8  # type: ignore[attr-defined]


def test_a_bad_scenario_exits_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = scenario(tmp_path, 'runner = "cancel"\n[args]\nbogus = 1\n')
    out = tmp_path / "out"
    assert main(["bench", "run", "--out", str(out), str(bad)]) == 2
    assert "'bogus' is not an option" in capsys.readouterr().err
    assert not out.exists()


def test_list_shows_scenarios_and_runner_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    assert "research-cancel" in out
    assert "litellm_eof_s = 2.0" in out
    assert "sweep_chunks = [1, 16, 64, 256]" in out


# --------------------------------------------------------------------------- results


def test_median_tree() -> None:
    runs: list[Any] = [
        {"a": 1, "b": {"c": 1.0, "d": None}, "l": [1, 2], "s": "x", "v": [1]},
        {"a": 3, "b": {"c": 2.0, "d": 4}, "l": [3, 4], "s": "y", "v": [1, 2]},
        {"a": 2, "b": {"c": 9.0}, "l": [5, 6], "s": "z", "v": [1, 2, 3], "only": True},
    ]
    assert median_tree(runs) == {
        "a": 2,
        "b": {"c": 2.0, "d": 4},
        "l": [3, 4],
        "s": "x",
        "v": [1],
        "only": True,
    }
    assert median_tree([]) is None
    assert median_tree([1, 2]) == 1.5


DOC = """# Page

Prose before.

<!-- bench:one -->
| old | table |
<!-- /bench:one -->

Prose between, with `<!-- bench:two -->` quoted: a marker is a line of its own.

<!-- bench:two -->
kept as it was
<!-- /bench:two -->
"""


def test_rewrite_markers_is_byte_exact() -> None:
    new, done = rewrite_markers(DOC, {"one": "| new |\n| --- |\n", "absent": "x"})
    assert done == ["one"]
    assert new == DOC.replace("| old | table |\n", "| new |\n| --- |\n")
    both, done = rewrite_markers(DOC, {"one": "1", "two": "2"})
    assert done == ["one", "two"]
    assert both == (DOC.replace("| old | table |\n", "1\n").replace("kept as it was\n", "2\n"))
    again, _ = rewrite_markers(new, {"one": "| new |\n| --- |"})
    assert again == new  # idempotent, whatever the trailing newlines
    with pytest.raises(ValueError, match="no <!-- /bench:one -->"):
        rewrite_markers("<!-- bench:one -->\nno end\n", {"one": "x"})


# --------------------------------------------------------------------------- smoke


def test_smoke_run_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two tiny scenarios through the command line (in this process, so that
    coverage sees the runners), real edge, node and sims; then the report."""
    platform = scenario(
        tmp_path,
        'runner = "platform"\ndescription = "smoke"\n[args]\nshapes = ["direct", "split"]\n',
        "platform-smoke",
    )
    cancel = scenario(tmp_path, 'runner = "cancel"\ndescription = "smoke"\n', "cancel-smoke")
    memory = scenario(tmp_path, 'runner = "memory"\n', "memory-smoke")
    out = tmp_path / "out"
    files = [str(f) for f in (cancel, platform, memory)]
    code = main(["bench", "run", "--smoke", "--out", str(out), *files])
    assert code == 0, capsys.readouterr().err
    (path,) = out.glob("bench-*.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == 1
    assert doc["smoke"] is True
    assert list(doc["scenarios"]) == ["cancel-smoke", "platform-smoke", "memory-smoke"]
    for entry in doc["scenarios"].values():
        (rep,) = entry["repeats"]
        assert set(rep) >= {"repeat", "result", "wall_s", "own_cpu_s", "foreign_cpu_pct"}
        assert isinstance(rep["foreign_cpu_pct"], float)
        assert entry["median"] is not None
    cancel_median = doc["scenarios"]["cancel-smoke"]["median"]
    assert set(cancel_median["windows"]) == {
        "queued",
        "before-headers",
        "before-first-token",
        "mid-stream",
        "non-streaming",
    }
    assert "litellm" not in cancel_median  # no --litellm: IOP alone
    plat = doc["scenarios"]["platform-smoke"]["median"]
    assert plat["shapes"] == ["direct", "split"]
    assert plat["failed_requests"] == 0
    assert {"paced-c2", "paced-c1", "fast-1ch", "fast-4ch", "nonstream"} <= set(plat["cells"])
    (rnd,) = doc["scenarios"]["memory-smoke"]["median"]["rounds"]
    assert rnd["opened"] == 5
    assert set(rnd["rss_kb"]) == {"before", "open", "after"}
    # The scripts' printed tables take the same results.
    print_cancel(cancel_median)
    print_memory(doc["scenarios"]["memory-smoke"]["median"])
    _platform.print_tables(plat)

    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "page.md"
    page.write_text(
        "intro\n\n<!-- bench:cancel-smoke -->\n<!-- /bench:cancel-smoke -->\n\n"
        "<!-- bench:platform-smoke -->\nold\n<!-- /bench:platform-smoke -->\n"
        "<!-- bench:not-run -->\nstays\n<!-- /bench:not-run -->\n"
    )
    assert main(["bench", "report", "--docs", str(docs), str(path)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n\n<!-- bench:cancel-smoke -->\n| window |")
    assert "| figure | edge + node |" in text
    assert "<!-- bench:not-run -->\nstays\n<!-- /bench:not-run -->\n" in text
    assert "not-run --> has no result" in capsys.readouterr().out
    assert (docs / "img" / "bench_cpu_per_request.png").stat().st_size > 0


def test_report_of_a_full_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every shipped runner's tables and plots, from a (trimmed) result of
    ``iop bench --all --litellm PATH`` on the 2-core box."""
    result = Path(__file__).parent / "data" / "bench-result.json"
    keys = json.loads(result.read_text())["scenarios"]
    assert set(keys) <= {p.stem for p in SCENARIOS.glob("*.toml")}  # others may add theirs
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "all.md"
    page.write_text("".join(f"<!-- bench:{k} -->\n<!-- /bench:{k} -->\n" for k in keys))
    assert main(["bench", "report", "--docs", str(docs), str(result)]) == 0
    text = page.read_text()
    heads = {
        "platform": "| figure | iop up | edge + node | LiteLLM |",
        "cancel": "| window | IOP p50 ms | p99 ms | max ms |\n",
        "research-cancel": "| LiteLLM p50 ms | p99 ms | LiteLLM never closed |",
        "memory": "| round | streams open |",
        "overload": "| level | saturated req/s |",
        "idle-nodes": "| **edge, 100 idle nodes** |",
    }
    for key, head in heads.items():
        block = text.split(f"<!-- bench:{key} -->\n")[1].split(f"<!-- /bench:{key} -->")[0]
        assert head in block, key
        assert f"iop bench run configs/bench/{key}.toml" in block
    assert "| queued | 1.1 | 7.0 | 7.0 | n/a (no queue) |" in text
    for png in ("bench_cpu_per_request", "bench_latency", "bench_research-cancel"):
        assert (docs / "img" / f"{png}.png").stat().st_size > 0
    assert "rewrote cancel, idle-nodes, memory, overload, platform, research-cancel" in (
        capsys.readouterr().out
    )


def test_a_failed_run_is_recorded_and_the_command_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = scenario(tmp_path, 'runner = "test-fails"\n', "fails")
    out = tmp_path / "out"
    # An option before the subcommand counts as after it.
    assert main(["bench", "--repeat", "2", "run", "--out", str(out), str(bad)]) == 1
    (path,) = out.glob("bench-*.json")
    entry = json.loads(path.read_text())["scenarios"]["fails"]
    assert [r["error"] for r in entry["repeats"]] == [
        "RuntimeError('this runner always fails')"
    ] * 2
    assert entry["median"] is None
    docs = tmp_path / "docs"
    docs.mkdir()
    assert main(["bench", "report", "--docs", str(docs), str(path)]) == 0
    assert "fails has no successful run" in capsys.readouterr().err


def test_an_interrupt_keeps_the_partial_results(tmp_path: Path) -> None:
    stop = scenario(tmp_path, 'runner = "test-fails"\n[args]\nfail = "interrupt"\n', "stop")
    out = tmp_path / "out"
    assert main(["bench", "run", "--out", str(out), str(stop)]) == 130
    (path,) = out.glob("bench-*.json")
    assert json.loads(path.read_text())["interrupted"] is True


def test_all_skips_what_needs_litellm_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    scenario(scenarios, 'runner = "cancel"\nrequires_litellm = true\n', "needs-litellm")
    docs = tmp_path / "docs"
    docs.mkdir()
    argv = ["bench", "--all", "--scenarios", str(scenarios), "--out", str(tmp_path / "out")]
    assert main([*argv, "--docs", str(docs)]) == 0
    assert "skipping needs-litellm: it needs --litellm PATH" in capsys.readouterr().err
    assert main([*argv, "--litellm", str(tmp_path / "no-litellm")]) == 2
    assert "no LiteLLM at" in capsys.readouterr().err
    assert main(["bench", "--all", "--scenarios", str(docs)]) == 2
    assert main(["bench"]) == 2


# --------------------------------------------------------------------------- bad input


def iop_bench(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command line, as a user runs it: a process of its own in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "iop", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command refused with exit 2 (no traceback)."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("iop bench: ")
    return line


@pytest.mark.timeout(120)
def test_a_relative_out_dir_holds_the_results_and_the_runs_logs(tmp_path: Path) -> None:
    """The runners start processes in the run's work dir: a relative --out
    (and scenario path) must not be read from there."""
    scenario(tmp_path, 'runner = "cancel"\ndescription = "smoke"\n', "rel")
    done = iop_bench(tmp_path, "run", "--smoke", "--out", "rel-out", "rel.toml")
    assert done.returncode == 0, done.stderr
    (path,) = (tmp_path / "rel-out").glob("bench-*.json")
    entry = json.loads(path.read_text())["scenarios"]["rel"]
    assert entry["median"] is not None, entry["repeats"]
    assert list((tmp_path / "rel-out").glob("bench-*/rel-0/edge.toml"))
    # The summary table, not only the path of the JSON.
    rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, done.stdout  # header, rule, a row
    assert any("mid-stream" in row for row in rows), done.stdout


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json at all\n", "not a result of `iop bench run`"),
        ("[1, 2]\n", "not a result of `iop bench run`"),
        ('{"format": 1, "scenarios": {"x": {}}}\n', "not a result of `iop bench run`"),
        ('{"format": 99, "scenarios": {}}\n', "format 99"),
    ],
    ids=["not-json", "a-list", "no-runner", "another-format"],
)
def test_report_of_a_file_that_is_not_a_result_is_one_line(
    tmp_path: Path, content: str, says: str
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "bad.json").write_text(content)
    line = one_line_error(iop_bench(tmp_path, "report", "--docs", "docs", "bad.json"))
    assert "bad.json" in line
    assert says in line


def test_report_of_a_result_whose_median_is_not_its_runners_is_one_line(tmp_path: Path) -> None:
    """A result edited by hand (or from another version) whose median lacks
    what its runner's tables read."""
    doc = json.loads((Path(__file__).parent / "data" / "bench-result.json").read_text())
    doc["scenarios"] = {"cancel": doc["scenarios"]["cancel"]}
    doc["scenarios"]["cancel"]["median"] = {"unexpected": 1}
    (tmp_path / "docs").mkdir()
    (tmp_path / "odd.json").write_text(json.dumps(doc))
    line = one_line_error(iop_bench(tmp_path, "report", "--docs", "docs", "odd.json"))
    assert "odd.json: cancel:" in line


def test_a_page_with_a_marker_left_open_is_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    result = Path(__file__).parent / "data" / "bench-result.json"
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("<!-- bench:cancel -->\nno end marker\n")
    line = one_line_error(iop_bench(tmp_path, "report", "--docs", "docs", str(result)))
    assert "page.md" in line
    assert "has no <!-- /bench:cancel -->" in line
    assert page.read_text() == "<!-- bench:cancel -->\nno end marker\n"


def test_other_bad_input_is_one_line(tmp_path: Path) -> None:
    scenario(tmp_path, 'runner = "cancel"\n', "ok")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "result.json").write_text('{"format": 1}')
    for args, says in [
        (["run", "missing.toml"], "missing.toml"),
        (["run", "--out", "a-file", "ok.toml"], "a-file"),
        (["report", "--docs", "docs", "missing.json"], "missing.json"),
        (["report", "--docs", "docs", "docs"], "docs"),
        (["report", "--docs", "no-docs", "result.json"], "no-docs"),
    ]:
        line = one_line_error(iop_bench(tmp_path, *args))
        assert says in line, (args, line)
    assert not list(tmp_path.glob("a-file/*"))
