"""The ``soak`` bench runner (iop/bench/_soak.py): its stream classifier and
slopes on their own, and a one-minute soak through the real CLI (``iop bench
run --smoke``) on real processes (Valkey, ``iop sim``, an edge with a ledger,
a sim node and a node running llama.cpp itself), with its faults, asserting
the invariants the soak exists for: every request ended with exactly one
terminal and none hung, the ledger equals what the clients received, no
process died but the ones killed on purpose, and every process has a slope.
Never a timing: the box is shared.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop.bench._soak_report import slope, slopes
from iop.bench._soak_traffic import SURFACES, Options, _Stream
from iop.cli import main

SCENARIO = Path(__file__).resolve().parents[1] / "configs" / "bench" / "soak.toml"
ROLES = {"valkey", "sim", "edge", "node-sim", "node-llama", "llama-server"}


def test_the_scenario_is_thirty_minutes_of_the_soak_runner() -> None:
    scenario = tomllib.loads(SCENARIO.read_text())
    assert scenario["runner"] == "soak"
    opts = msgspec.convert(scenario["args"], Options)  # an unknown key would raise
    assert opts.duration_s == 1800
    assert opts.reloads == 10


# --------------------------------------------------------------------------- sans-IO parts


def feed(surface: str, events: list[Any]) -> _Stream:
    s = _Stream(surface)
    for e in events:
        s.feed(e if isinstance(e, str) else json.dumps(e))
    return s


def test_a_chat_stream_has_one_terminal_its_done() -> None:
    chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}
    finish = {"choices": [{"delta": {}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    done = feed("chat", [chunk, finish, usage, "[DONE]"])
    assert (done.terminals, done.usage, done.output) == (["complete"], (5, 1, 0), True)
    failed = feed("chat", [chunk, {"error": {"code": "backend_lost"}}, "[DONE]"])
    assert failed.terminals == ["error"]
    assert feed("chat", [chunk]).terminals == []  # cut: no terminal
    twice = feed("completions", [finish, "[DONE]", "[DONE]"])
    assert twice.terminals == ["complete", "complete"]


def test_responses_and_messages_terminals_and_usage() -> None:
    completed = {
        "type": "response.completed",
        "response": {
            "usage": {
                "input_tokens": 9,
                "output_tokens": 3,
                "input_tokens_details": {"cached_tokens": 4},
            }
        },
    }
    r = feed("responses", [{"type": "response.output_text.delta"}, completed])
    assert (r.terminals, r.usage) == (["complete"], (9, 3, 4))
    late = feed("responses", [completed, {"type": "response.output_text.delta"}])
    assert late.after_terminal == 1
    assert feed("responses", [{"type": "response.failed"}]).terminals == ["error"]
    m = feed(
        "messages",
        [
            {"type": "message_start", "message": {"usage": {"input_tokens": 0}}},
            {"type": "content_block_start", "content_block": {"type": "tool_use"}},
            {
                "type": "message_delta",
                # Anthropic's input_tokens leaves the cache reads out.
                "usage": {"input_tokens": 6, "cache_read_input_tokens": 2, "output_tokens": 7},
            },
            {"type": "message_stop"},
        ],
    )
    assert (m.terminals, m.usage, m.tool_call) == (["complete"], (8, 7, 2), True)
    assert feed("messages", [{"type": "error"}]).terminals == ["error"]


def test_slopes_follow_each_process_s_last_incarnation() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(0, 1), (1, 3)]) is None
    samples = []
    for i in range(10):
        t = 60.0 * i
        # The node is restarted at minute 5 with a new pid: the old one's
        # memory is not the new one's slope.
        node = {"pid": 1 if i < 5 else 2, "rss_kb": 100 * i if i < 5 else 50, "fds": 9}
        edge = {"pid": 3, "rss_kb": 1000 + 10 * i, "fds": 10 + i, "cpu_s": float(i)}
        samples.append({"t": t, "procs": {"node": node | {"cpu_s": 0.0}, "edge": edge}})
    got = slopes(samples, warmup_s=60.0)
    assert got["edge"]["rss_kib_per_min"] == pytest.approx(10.0)
    assert got["edge"]["fds_per_min"] == pytest.approx(1.0)
    assert got["edge"]["cpu_s"] == 9.0
    assert got["node"]["incarnations"] == 2
    assert got["node"]["rss_kib_per_min"] == 0.0
    assert got["node"]["from_s"] == 360.0  # its first minute is its warm-up


# --------------------------------------------------------------------------- one minute


@pytest.mark.slow
@pytest.mark.real_backend
@pytest.mark.timeout(600)
def test_a_one_minute_soak_keeps_its_invariants(tmp_path: Path) -> None:
    # Lean: two workers with pauses, one minute (--smoke caps a run at two).
    path = tmp_path / "soak-smoke.toml"
    path.write_text(
        'runner = "soak"\ndescription = "one minute"\n[args]\n'
        "duration_s = 60.0\nconcurrency = 2\nthink_s = 0.25\nsample_s = 2.0\n"
        "warmup_s = 10.0\nreloads = 10\n"
    )
    out = tmp_path / "out"
    assert main(["bench", "run", "--smoke", "--out", str(out), str(path)]) == 0
    (result_file,) = out.glob("bench-*.json")
    doc = json.loads(result_file.read_text())
    (rep,) = doc["scenarios"]["soak-smoke"]["repeats"]
    res = rep["result"]

    # Every request ended with exactly one terminal, none hung.
    o = res["outcomes"]
    assert o["requests"] > 0
    assert o["anomaly_count"] == 0, o["anomalies"]
    assert o["single_terminal"] == o["requests"]
    assert o["counts"]["complete"] > 0
    assert o["counts"]["cancelled"] > 0
    assert o["tool_calls"] > 0
    for surface in SURFACES:
        assert o["by_surface"][f"{surface} stream"].get("complete", 0) > 0, surface
        assert o["by_surface"][f"{surface} whole"].get("complete", 0) > 0, surface

    # The ledger (after a graceful stop) against the clients and the edge.
    book = res["ledger"]
    assert book["client_tokens"] == book["complete_tokens"]
    assert book["by_outcome"]["complete"] == book["client_complete"] == o["counts"]["complete"]
    assert book["records"] == res["edge_runs_total"] == book["usage_cli"]["runs"]
    assert res["idle_at_end"]

    # Only what the faults killed died; every fault was recovered from.
    assert res["deaths"] == []
    assert res["edge_exit"] == 0
    assert all(rc == 0 for rc in res["exit_codes"].values()), res["exit_codes"]
    kinds = [f["kind"] for f in res["faults"]]
    assert sorted(set(kinds)) == [
        "llama-kill",
        "node-kill",
        "reload-post",
        "reload-sighup",
        "valkey-restart",
    ]
    assert sum(k.startswith("reload") for k in kinds) == 10
    assert all(f["recovered_s"] is not None for f in res["faults"])
    assert {f["detail"] for f in res["faults"] if f["kind"].startswith("reload")} == {"applied"}

    # A slope for every process, over samples of its last incarnation.
    s = res["slopes"]
    assert set(s) == ROLES
    for role in ROLES:
        assert s[role]["rss_kib_per_min"] is not None, role
        assert s[role]["fds_per_min"] is not None, role
    restarted = {"node-sim", "valkey", "llama-server"}
    assert {r: s[r]["incarnations"] for r in ROLES} == {
        r: 2 if r in restarted else 1 for r in ROLES
    }

    # The report: the marked block and the plot.
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "p.md").write_text("<!-- bench:soak-smoke -->\n<!-- /bench:soak-smoke -->\n")
    img = tmp_path / "img"
    report = ["bench", "report", "--docs", str(docs), "--img-dir", str(img), str(result_file)]
    assert main(report) == 0
    text = (docs / "p.md").read_text()
    assert "| edge | 1 |" in text
    assert (img / "bench_soak-smoke.png").stat().st_size > 0
