"""``scripts/trace_cancel.py`` reads a cancel's path from a perf trace.

The trace is written by hand in ``perf script``'s format: a client's close,
an edge that waits for a CPU a foreign process holds, the Cancel frame, a
node that closes the backend's socket, the backend's EOF. What the script
says about it is what docs/benchmarks.md ("Cancellation, second pass")
rests on: the milestones, and how long the path waited for a CPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_cancel.py"
BENCH, EDGE, NODE, OTHER = 100, 200, 300, 999
PIDS = {"edge": EDGE, "node": NODE, "bench": BENCH}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trace_cancel", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_cancel"] = module
    spec.loader.exec_module(module)
    return module


def _line(t_ms: float, cpu: int, pid: int, event: str, rest: str) -> str:
    comm = "swapper" if pid == 0 else "python"
    return f"  {comm} {pid}/{pid} [{cpu:03d}] {1000 + t_ms / 1000:.6f}: {event}: {rest}"


def _switch(t_ms: float, cpu: int, prev: int, state: str, nxt: int) -> str:
    return _line(
        t_ms,
        cpu,
        prev,
        "sched:sched_switch",
        f"prev_comm=python prev_pid={prev} prev_prio=120 prev_state={state} ==> "
        f"next_comm=python next_pid={nxt} next_prio=120",
    )


def _wakeup(t_ms: float, cpu: int, waker: int, target: int) -> str:
    return _line(
        t_ms,
        cpu,
        waker,
        "sched:sched_wakeup",
        f"comm=python pid={target} prio=120 target_cpu={cpu:03d}",
    )


# One CPU. The bench closes at 0 ms and wakes the edge, which a foreign
# process keeps off the CPU until 5 ms; the edge reads the EOF and wakes the
# node at 6 ms; the node gets the CPU at 6.1 and closes the backend's socket
# at 7 ms; the bench waits 1.4 ms for the CPU and reads its EOF at 9 ms.
TRACE = "\n".join(
    [
        _switch(-10, 0, 0, "R", BENCH),
        _line(0, 0, BENCH, "syscalls:sys_enter_close", "fd: 0x0000000c"),
        _wakeup(0.1, 0, BENCH, EDGE),
        _switch(0.2, 0, BENCH, "S", OTHER),
        _switch(5.0, 0, OTHER, "R", EDGE),
        _line(5.5, 0, EDGE, "syscalls:sys_exit_recvfrom", "0x0"),
        _line(5.9, 0, EDGE, "syscalls:sys_enter_write", "fd: 0x0000000a, buf: 0x1, count: 0x6f"),
        _wakeup(6.0, 0, EDGE, NODE),
        _switch(6.1, 0, EDGE, "S", NODE),
        _line(6.5, 0, NODE, "syscalls:sys_exit_recvfrom", "0x6f"),
        _line(7.0, 0, NODE, "syscalls:sys_enter_close", "fd: 0x00000008"),
        _wakeup(7.1, 0, NODE, BENCH),
        _switch(7.5, 0, NODE, "S", OTHER),
        _switch(8.5, 0, OTHER, "R", BENCH),
        _line(9.0, 0, BENCH, "syscalls:sys_exit_recvfrom", "0x0"),
        _switch(9.5, 0, BENCH, "S", 0),
    ]
)
TRIAL = {"trial": "mid-stream-1", "window": "mid-stream", "ms": 9.0, "t_close": 1000.0}


def test_the_path_and_its_waits_for_a_cpu() -> None:
    tc = _script()
    events = tc.parse(TRACE + "\nnot a perf line\n")
    assert len(events) == 16
    trial = tc.read_trial(events, {**TRIAL, "t_end": 1000.009}, PIDS)
    ms = {k: round(1000 * (v - 1000.0), 3) for k, v in trial.milestones.items()}
    assert ms == {
        "close": 0.0,
        "end": 9.0,
        "edge_eof": 5.5,
        "edge_wakes_node": 6.0,
        "node_closes": 7.0,
        "backend_eof": 9.0,
    }
    # The edge: woken at 0.1, on the CPU at 5.0; the node: woken at 6.0, on at
    # 6.1; the bench: woken at 7.1, on at 8.5.
    assert 1000 * tc.critical_wait(trial) == pytest.approx(4.9 + 0.1 + 1.4)
    # The foreign process held the CPU 0.2-5.0 and 7.5-8.5.
    assert 1000 * trial.foreign_s == pytest.approx(4.8 + 1.0)
    assert 1000 * tc.overlap(trial.states["node"], 1000.0, 1000.009, "running") == (
        pytest.approx(1.4)
    )


def test_a_queued_trial_waits_on_the_edge_alone() -> None:
    tc = _script()
    events = tc.parse(TRACE)
    trial = tc.read_trial(events, {**TRIAL, "window": "queued", "t_end": 1000.0055}, PIDS)
    assert "edge_wakes_node" not in trial.milestones
    assert 1000 * tc.critical_wait(trial) == pytest.approx(4.9)
