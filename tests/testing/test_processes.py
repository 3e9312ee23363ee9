"""The shared process runner (``iop.testing.Proc``), on real child processes.

Each child is a few lines of Python (``argv=``), so that every path of the
runner is driven without an ``iop`` command; ``tests/e2e`` runs it on the real
CLIs, whose start-up lines the ``*_READY`` patterns are checked against here.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from iop.cli._edge import describe_edge
from iop.testing import EDGE_READY, NODE_READY, SIM_READY, UP_READY, Proc, poll

# A child that prints a start-up line, then waits for a signal (or stdin that
# never comes: it is /dev/null, so a read returns at once; sleep instead).
_SERVE = """
import os, signal, sys, time
{setup}
print("ready on http://127.0.0.1:1234/v1 cwd=" + os.getcwd() + " x=" + os.environ.get("X", ""))
sys.stderr.write("a log line\\n")
time.sleep(120)
"""


def _child(tmp_path: Path, name: str, setup: str = "", **kwargs: object) -> Proc:
    code = _SERVE.format(setup=setup)
    return Proc(name, [], tmp_path, argv=[sys.executable, "-c", code], **kwargs)  # type: ignore[arg-type]


def test_a_start_up_line_is_parsed_and_sigterm_stops_the_process(tmp_path: Path) -> None:
    setup = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))"
    proc = _child(tmp_path / "logs", "srv", setup, cwd=tmp_path, env={"X": "42"})
    try:
        m = proc.wait_stdout(SIM_READY)
        assert m.group(1) == "http://127.0.0.1:1234"
        assert f"cwd={tmp_path} x=42" in proc.stdout()
        proc.wait_stderr("a log line", timeout=10)
        assert proc.alive
        assert proc in Proc.ALL
    finally:
        rc = proc.stop()
    assert rc == 0
    assert not proc.alive
    assert proc.stopped_at is not None
    assert (tmp_path / "logs" / "srv.stdout").exists()
    assert "--- srv (pid" in proc.logs()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = _child(tmp_path, "stubborn", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    proc.wait_stdout(SIM_READY)
    assert proc.stop(grace=0.2) == -signal.SIGKILL


def test_a_frozen_process_is_still_stopped(tmp_path: Path) -> None:
    proc = _child(tmp_path, "frozen")
    proc.wait_stdout(SIM_READY)
    proc.send(signal.SIGSTOP)
    # SIGCONT first, so the default SIGTERM action ends it.
    assert proc.stop() == -signal.SIGTERM


def test_kill_and_wait(tmp_path: Path) -> None:
    proc = _child(tmp_path, "victim")
    proc.wait_stdout(SIM_READY)
    assert proc.kill() == -signal.SIGKILL
    assert proc.wait(1) == -signal.SIGKILL
    proc.send(signal.SIGTERM)  # a no-op once it is gone


def test_waiting_for_a_line_fails_when_the_process_exits_first(tmp_path: Path) -> None:
    code = "import sys; print('starting'); sys.exit(3)"
    proc = Proc("early", [], tmp_path, argv=[sys.executable, "-c", code])
    with pytest.raises(AssertionError, match=r"early exited \(3\) before printing") as info:
        proc.wait_stdout(SIM_READY)
    assert "starting" in str(info.value)
    assert proc.returncode == 3


def test_waits_fail_after_their_deadline(tmp_path: Path) -> None:
    proc = _child(tmp_path, "quiet")
    try:
        with pytest.raises(AssertionError, match=r"timed out after 0\.1s"):
            proc.wait_stdout("never printed", timeout=0.1)
        with pytest.raises(AssertionError, match=r"still running after 0\.1s"):
            proc.wait(0.1)
    finally:
        proc.stop()
    with pytest.raises(AssertionError, match="timed out after 0s waiting for nothing"):
        poll(lambda: None, timeout=0, what="nothing")


def test_the_default_command_is_python_dash_m_iop(tmp_path: Path) -> None:
    proc = Proc("help", ["--help"], tmp_path)
    assert proc.argv == [sys.executable, "-m", "iop", "--help"]
    assert proc.wait(30) == 0
    assert "usage" in proc.stdout()


class _Handle:
    url = "http://127.0.0.1:8080"
    link_url = "ws://127.0.0.1:8080/v1/link"


def test_the_ready_patterns_match_the_clis_lines() -> None:
    edge_line = describe_edge(_Handle())  # type: ignore[arg-type]
    m = re.search(EDGE_READY, edge_line)
    assert m is not None
    assert m.groups() == (_Handle.url, _Handle.link_url)
    m = re.search(UP_READY, f"{edge_line}\niop up: ready; models: 'iop-sim', 'x'\n")
    assert m is not None
    assert m.groups() == (_Handle.url, "'iop-sim', 'x'")
    assert re.search(
        SIM_READY, "iop sim: serving model 'm' (vLLM wire format) on http://127.0.0.1:9/v1"
    )
    assert re.search(
        NODE_READY, "iop node: node 'n1' dialling ws://127.0.0.1:9/v1/link; instances: ..."
    )
