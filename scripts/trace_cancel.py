"""Where the time of one cancel goes: a timestamped trace across edge, node and backend.

Reads a result of ``python scripts/bench_stress.py --only cancel --perf-trace``
(its JSON names the ``perf record`` data and the PIDs of edge, node and the
benchmark process, which is both the client and the mock backend). Every
sample's close and end are on CLOCK_MONOTONIC, the clock perf recorded with,
so each trial is a window of the trace. For the slowest trial of each window
(or the trials named with ``--trial``) it prints:

* a timeline in milliseconds from the client's close: the syscalls of the
  cancel path (closes, reads with what they returned, writes), each wake-up
  of one of our processes and by whom, and each time one of them gets or
  leaves a CPU;
* milestones: the edge reads the client's EOF, the edge wakes the node (its
  write of the Cancel frame), the node closes the backend's socket, the
  backend reads its EOF;
* for each of edge, node and backend: how long it ran, and how long it was
  runnable but waiting for a CPU; and how much CPU the other processes of
  the machine ("foreign") took meanwhile.

Examples:
  python scripts/bench_stress.py --only cancel --trials 50 --perf-trace
  python scripts/trace_cancel.py bench-results/stress-20261201-200000.json
  python scripts/trace_cancel.py RESULT.json --trial mid-stream-17 --all-events
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

_LINE: Final = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+"
    r"(?P<t>\d+\.\d+):\s+(?P<event>[\w:]+):\s*(?P<rest>.*)$"
)
_SWITCH: Final = re.compile(
    r"prev_pid=(?P<prev>\d+) .*prev_state=(?P<state>\S+) ==> next_comm=.* next_pid=(?P<next>\d+)"
)
_WAKEUP: Final = re.compile(r"pid=(?P<pid>\d+) .*target_cpu=(?P<cpu>\d+)")
_FD: Final = re.compile(r"fd: (0x[0-9a-f]+)")
_LEN: Final = re.compile(r"(?:count|len): (0x[0-9a-f]+)")
# Context shown before the close and after the end.
MARGIN_S: Final = 0.0002
# How far before the close the scheduler's events are read to know who is
# on which CPU, and which of ours is running, when the trial starts.
STATE_FROM_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    cpu: int
    tid: int
    event: str
    rest: str


def load(data: str) -> list[Event]:
    """``perf script`` of ``data``, parsed (perf sorts it by time across CPUs)."""
    text = subprocess.run(
        ["perf", "script", "-i", data, "-F", "comm,pid,tid,cpu,time,event,trace"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse(text)


def parse(text: str) -> list[Event]:
    """The events of ``perf script -F comm,pid,tid,cpu,time,event,trace`` output."""
    events = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            events.append(
                Event(
                    float(m["t"]),
                    int(m["cpu"]),
                    int(m["tid"]),
                    m["event"].split(":")[-1],
                    m["rest"],
                )
            )
    return events


def _syscall(ev: Event) -> str | None:
    """A readable syscall, or None for one not shown."""
    if ev.event == "sys_enter_close":
        return f"close(fd {int(_FD.search(ev.rest)[1], 16)})"  # type: ignore[index]
    if ev.event in ("sys_enter_write", "sys_enter_sendto"):
        fd = int(_FD.search(ev.rest)[1], 16)  # type: ignore[index]
        n = int(_LEN.search(ev.rest)[1], 16)  # type: ignore[index]
        return f"{ev.event[10:]}(fd {fd}, {n} bytes)"
    if ev.event == "sys_exit_recvfrom":
        ret = int(ev.rest.split()[0], 16)
        if ret >= 1 << 63:
            ret -= 1 << 64
        return "recv -> EOF" if ret == 0 else (f"recv -> {ret} bytes" if ret > 0 else None)
    if ev.event == "sys_exit_epoll_wait":
        n = int(ev.rest.split()[0], 16)
        return f"epoll_wait -> {n} ready" if n else None
    return None


@dataclass
class Trial:
    """One trial read from the trace: milestones and each process's states."""

    ms: float
    milestones: dict[str, float]
    # Per process: (from, to, "running" | "waiting" | "asleep"), in order.
    states: dict[str, list[tuple[float, float, str]]]
    passes: dict[str, int]
    foreign_s: float
    cpus: int
    lines: list[str]


_LABELS: Final = {
    "edge_eof": "the edge reads the client's EOF",
    "edge_wakes_node": "the edge wakes the node (its Cancel frame)",
    "node_closes": "the node closes the backend's socket",
    "backend_eof": "the backend reads its EOF",
}
# Who the critical path waits for between two milestones (close, ..., end).
_SEGMENTS: Final = (
    ("close", "edge_eof", "edge"),
    ("edge_eof", "edge_wakes_node", "edge"),
    ("edge_wakes_node", "node_closes", "node"),
    ("node_closes", "end", "bench"),
)


def read_trial(events: list[Event], trial: dict[str, Any], pids: dict[str, int]) -> Trial:
    t0, t1 = trial["t_close"], trial["t_end"]
    lo, hi = t0 - MARGIN_S, t1 + MARGIN_S
    names = {pid: name for name, pid in pids.items()}
    on_cpu: dict[int, tuple[int, float]] = {}  # cpu -> (tid, since)
    state: dict[int, tuple[str, float]] = {}  # ours: (state, since)
    states: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    milestones: dict[str, float] = {"close": t0, "end": t1}
    passes: dict[str, int] = defaultdict(int)
    lines: list[str] = []
    foreign = 0.0

    def enter(tid: int, st: str, now: float) -> None:
        if tid in state:
            old, since = state[tid]
            states[names[tid]].append((since, now, old))
        state[tid] = (st, now)

    def note(t: float, cpu: int, who: str, text: str) -> None:
        if lo <= t <= hi:
            lines.append(f"{1000 * (t - t0):9.3f}  cpu{cpu}  {who:<6} {text}")

    for ev in events:
        if ev.t < t0 - STATE_FROM_S:
            continue
        if ev.t > hi:
            break
        who = names.get(ev.tid, f"pid {ev.tid}")
        if ev.event == "sched_switch":
            m = _SWITCH.search(ev.rest)
            if m is None:
                continue
            prev, nxt = int(m["prev"]), int(m["next"])
            if ev.cpu in on_cpu:
                occupant, since = on_cpu[ev.cpu]
                if occupant != 0 and occupant not in names:
                    foreign += max(0.0, min(ev.t, t1) - max(since, t0))
            on_cpu[ev.cpu] = (nxt, ev.t)
            if prev in names:
                preempted = m["state"].startswith("R")
                enter(prev, "waiting" if preempted else "asleep", ev.t)
                note(ev.t, ev.cpu, names[prev], "preempted" if preempted else "sleeps")
            if nxt in names:
                enter(nxt, "running", ev.t)
                note(ev.t, ev.cpu, names[nxt], "gets the CPU")
        elif ev.event == "sched_wakeup":
            m = _WAKEUP.search(ev.rest)
            if m is None or int(m["pid"]) not in names:
                continue
            target = int(m["pid"])
            if state.get(target, ("",))[0] != "running":
                enter(target, "waiting", ev.t)
            note(ev.t, ev.cpu, who, f"wakes {names[target]}")
            if who == "edge" and names[target] == "node" and "edge_eof" in milestones:
                milestones.setdefault("edge_wakes_node", ev.t)
        elif ev.tid in names:
            text = _syscall(ev)
            if ev.event == "sys_exit_epoll_wait" and t0 <= ev.t <= t1:
                passes[who] += 1
            if text is None:
                continue
            note(ev.t, ev.cpu, who, text)
            if not t0 <= ev.t <= t1:
                continue
            if text == "recv -> EOF" and who == "edge":
                milestones.setdefault("edge_eof", ev.t)
            elif text == "recv -> EOF" and who == "bench":
                milestones.setdefault("backend_eof", ev.t)
            elif who == "node" and text.startswith("close") and "edge_wakes_node" in milestones:
                milestones.setdefault("node_closes", ev.t)
    for tid, (st, since) in state.items():
        states[names[tid]].append((since, hi, st))
    for occupant, since in on_cpu.values():
        if occupant != 0 and occupant not in names:
            foreign += max(0.0, t1 - max(since, t0))
    return Trial(trial["ms"], milestones, dict(states), dict(passes), foreign, len(on_cpu), lines)


def overlap(states: list[tuple[float, float, str]], a: float, b: float, st: str) -> float:
    """Seconds of [a, b] the process spent in state ``st``."""
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e, x in states if x == st)


def critical_wait(tr: Trial) -> float:
    """Seconds the cancel's path waited for a CPU: in each stretch between
    milestones, the time the process it waited on was runnable and not running."""
    m = tr.milestones
    if "edge_wakes_node" not in m:  # queued: the edge alone
        return overlap(tr.states.get("edge", []), m["close"], m["end"], "waiting")
    total = 0.0
    for a, b, who in _SEGMENTS:
        if a in m and b in m:
            total += overlap(tr.states.get(who, []), m[a], m[b], "waiting")
    return total


def print_trial(name: str, tr: Trial) -> None:
    t0, t1 = tr.milestones["close"], tr.milestones["end"]
    print(f"\n=== {name}: {tr.ms:.2f} ms from the client's close to its end")
    print(f"{'ms':>9}  {'cpu':<4} {'who':<6} what")
    print("\n".join(tr.lines))
    print("milestones:")
    for key, label in _LABELS.items():
        if key in tr.milestones:
            print(f"  {1000 * (tr.milestones[key] - t0):8.3f} ms  {label}")
    print("in the trial:")
    for who, states in tr.states.items():
        ran = overlap(states, t0, t1, "running")
        waited = overlap(states, t0, t1, "waiting")
        print(
            f"  {who:<6} ran {1000 * ran:6.3f} ms, runnable without a CPU {1000 * waited:6.3f} ms, "
            f"{tr.passes.get(who, 0)} run-loop passes"
        )
    print(
        f"  the cancel's path waited for a CPU {1000 * critical_wait(tr):.3f} ms; other "
        f"processes ran {1000 * tr.foreign_s:.3f} ms of the {tr.cpus} CPUs' "
        f"{1000 * (t1 - t0) * tr.cpus:.3f} ms"
    )


def _pct(values: list[float], q: float) -> float:
    """Nearest rank, as bench_stress.py's summaries."""
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("result", type=Path, help="a bench_stress.py JSON with a perf trace")
    ap.add_argument("--trial", action="append", help="trial id (default: the slowest per window)")
    args = ap.parse_args()
    res = json.loads(args.result.read_text())["cancel"]
    perf = res.get("perf_trace")
    if perf is None:
        sys.exit("trace_cancel: no perf trace in this result (bench_stress.py --perf-trace)")
    trials = [t for t in res["trials"] if "ms" in t and "t_end" in t]
    if args.trial:
        chosen = [t for t in trials if t["trial"] in args.trial]
    else:
        slowest: dict[str, dict[str, Any]] = {}
        for t in trials:
            if t["window"] not in slowest or t["ms"] > slowest[t["window"]]["ms"]:
                slowest[t["window"]] = t
        chosen = list(slowest.values())
    events = load(perf["data"])
    read = {t["trial"]: (t, read_trial(events, t, perf["pids"])) for t in trials}
    for t in chosen:
        print_trial(t["trial"], read[t["trial"]][1])
    # Every trial: the sample, and the sample less the CPU waits of its path.
    print("\nper window: sample, and sample less the path's waits for a CPU, ms")
    print(f"{'window':<20}{'n':>4}{'p50':>8}{'p99':>8}{'max':>8}   {'p50':>6}{'p99':>8}{'max':>8}")
    for window in dict.fromkeys(t["window"] for t in trials):
        rows = [tr for t, tr in read.values() if t["window"] == window]
        ms = [tr.ms for tr in rows]
        own = [tr.ms - 1000 * critical_wait(tr) for tr in rows]
        print(
            f"{window:<20}{len(ms):>4}{_pct(ms, 50):>8.2f}{_pct(ms, 99):>8.2f}{max(ms):>8.2f}"
            f"   {_pct(own, 50):>6.2f}{_pct(own, 99):>8.2f}{max(own):>8.2f}"
        )


if __name__ == "__main__":
    main()
