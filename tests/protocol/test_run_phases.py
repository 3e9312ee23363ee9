"""A run's link phases: the one table (``RUN_TRANSITIONS``), its diagram, and both ends.

``iop.protocol._session`` keeps a run's ``RunPhase`` in one table, applied
by ``RunLink.advance`` (as h11's ``_state.py`` does for a connection). Here:

* **Every pair.** Each (phase, trigger) pair gets the table's answer: the
  next phase, or the refusal (``InvariantError``, or the error the caller
  names), which moves nothing. ``EXPECTED`` spells the table out a second
  time, from docs/protocol.md ("A run's states on the link").
* **The diagram.** The module docstring's drawing of the phases, read arrow
  by arrow, is the table; and every ``iop.…`` name the docstring cites exists.
* **Both ends.** Random sequences of triggers (the edge cancels, the node
  produces events or ends the run, frames cross in either order) drive a
  real ``EdgeSession``/``NodeSession`` pair; after each step each end's
  phase of each run is what ``EXPECTED`` makes of the triggers that end saw,
  and a trigger the table refuses is refused the way each end refuses it.
"""

from __future__ import annotations

import importlib
import re
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import iop.protocol._session as session_module
from iop.errors import InvariantError, LinkProtocolError
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, RuntimeEvent, is_terminal
from iop.protocol import (
    RUN_TRANSITIONS,
    Cancel,
    RunEvents,
    RunLink,
    RunPhase,
    RunTrigger,
    decode_edge_batch,
    decode_node_batch,
    encode,
    encode_batch,
)
from tests.protocol.test_session_fuzz import SPEC, _open_model

A, S, E, D = RunPhase.ASSIGNED, RunPhase.STREAMING, RunPhase.ENDING, RunPhase.DONE
EVENTS, TERMINAL, CANCEL = RunTrigger.EVENTS, RunTrigger.TERMINAL, RunTrigger.CANCEL

EXPECTED: dict[tuple[RunPhase, RunTrigger], RunPhase] = {
    (A, EVENTS): S,
    (A, TERMINAL): D,  # a rejection, or a first message that ends the run
    (A, CANCEL): E,
    (S, EVENTS): S,
    (S, TERMINAL): D,
    (S, CANCEL): E,
    (E, EVENTS): E,  # late events, sent before the cancel reached the node
    (E, TERMINAL): D,
    # Refused: a second cancel, and anything after the terminal.
}
PAIRS = [(phase, trigger) for phase in RunPhase for trigger in RunTrigger]


def _run_in(phase: RunPhase) -> RunLink:
    """A run brought to ``phase`` through the table itself."""
    run = RunLink(4)
    path = {A: [], S: [EVENTS], E: [CANCEL], D: [TERMINAL]}[phase]
    for trigger in path:
        run.advance(trigger, "r1")
    assert run.phase is phase
    return run


@pytest.mark.parametrize(("phase", "trigger"), PAIRS, ids=lambda x: x.value)
def test_the_table_answers_every_pair(phase: RunPhase, trigger: RunTrigger) -> None:
    expected = EXPECTED.get((phase, trigger))
    assert RUN_TRANSITIONS.get((phase, trigger)) is expected
    run = _run_in(phase)
    assert run.can(trigger) is (expected is not None)
    if expected is None:
        refusal = f"run r1: {trigger.value} in phase {phase.value}"
        with pytest.raises(InvariantError, match=refusal):
            run.advance(trigger, "r1")
        with pytest.raises(LinkProtocolError, match=refusal):
            run.advance(trigger, "r1", refused=LinkProtocolError)
        assert run.phase is phase  # a refusal moves nothing
    else:
        assert run.advance(trigger, "r1") is expected
        assert run.phase is expected


def test_every_phase_is_reached_and_every_run_can_end() -> None:
    """Every phase is reachable from ASSIGNED, DONE from every phase (the
    terminal needs no credit), and nothing leaves DONE."""
    reached = {A}
    while True:
        more = {
            RUN_TRANSITIONS[(p, t)]
            for p in reached
            for t in RunTrigger
            if (p, t) in RUN_TRANSITIONS
        }
        if more <= reached:
            break
        reached |= more
    assert reached == set(RunPhase)
    for phase in RunPhase:
        assert phase is D or RUN_TRANSITIONS[(phase, TERMINAL)] is D
    assert not [pair for pair in RUN_TRANSITIONS if pair[0] is D]


# --- the module docstring's diagram ------------------------------------------------

# Box drawing: where each corner turns a line, given the way it moves (row, col).
_CORNERS = {
    "┐": {(0, 1): (1, 0), (-1, 0): (0, -1)},
    "┌": {(0, -1): (1, 0), (-1, 0): (0, 1)},
    "└": {(1, 0): (0, 1), (0, -1): (-1, 0)},
    "┘": {(1, 0): (0, -1), (0, 1): (-1, 0)},
}
_HEADS = {"►": (0, 1), "◄": (0, -1), "▲": (-1, 0), "▼": (1, 0)}


def _diagram() -> list[str]:
    """The literal block that draws the phases in the module docstring."""
    doc = session_module.__doc__ or ""
    start = doc.index("::\n\n", doc.index("A run's link state")) + 4
    lines: list[str] = []
    for line in doc[start:].splitlines():
        if line and not line.startswith(" "):
            break
        lines.append(line)
    while not lines[-1].strip():
        lines.pop()
    width = max(map(len, lines)) + 2
    return [line.ljust(width) for line in lines]


def _diagram_arrows(grid: list[str]) -> set[tuple[RunPhase, RunTrigger, RunPhase]]:
    """Every arrow of the drawing as (from, label, to): a line leaves a phase's
    name (after one space to the right, or straight above or below it),
    turns at corners, crosses at ``┼`` and ends in an arrowhead at a phase's
    name. Its label is written in the line, or one space to the right of a
    vertical stretch or a corner of it."""
    names: dict[tuple[int, int], RunPhase] = {}
    for r, line in enumerate(grid):
        for m in re.finditer(r"[A-Z]+", line):
            for c in range(m.start(), m.end()):
                names[(r, c)] = RunPhase[m.group()]
    arrows: set[tuple[RunPhase, RunTrigger, RunPhase]] = set()
    for (r, c), source in names.items():
        starts = [((r - 1, c), (-1, 0)), ((r + 1, c), (1, 0))]
        if (r, c + 1) not in names:
            starts.append(((r, c + 2), (0, 1)))
        for (r0, c0), way in starts:
            if grid[r0][c0] in "─│" and (grid[r0][c0] == "│") == (way[0] != 0):
                arrows.add(_follow(grid, names, source, (r0, c0), way))
    return arrows


def _follow(
    grid: list[str],
    names: dict[tuple[int, int], RunPhase],
    source: RunPhase,
    at: tuple[int, int],
    way: tuple[int, int],
) -> tuple[RunPhase, RunTrigger, RunPhase]:
    (r, c), (dr, dc) = at, way
    labels: list[str] = []
    while True:
        ch = grid[r][c]
        if ch in "│" + "".join(_CORNERS):
            beside = re.match(r" ([a-z]+)", grid[r][c + 1 :])
            if beside:
                labels.append(beside.group(1))
        if ch in _HEADS:
            assert _HEADS[ch] == (dr, dc), f"arrowhead {ch} against the line at {r},{c}"
            target = names.get((r + dr, c + dc)) or names.get((r + 2 * dr, c + 2 * dc))
            assert target is not None, f"the arrow at {r},{c} points at no phase"
            assert len(labels) == 1, f"{source.name} to {target.name}: labels {labels}"
            return source, RunTrigger(labels[0]), target
        if ch in _CORNERS:
            assert (dr, dc) in _CORNERS[ch], f"the line runs into {ch} at {r},{c}"
            dr, dc = _CORNERS[ch][(dr, dc)]
        elif ch.islower() and dr == 0:
            word = re.match(r"[a-z]+", grid[r][c:] if dc > 0 else grid[r][c::-1])
            assert word is not None
            labels.append(word.group() if dc > 0 else word.group()[::-1])
            c += dc * (len(word.group()) - 1)
        elif not (ch == "┼" or (ch == "─" and dr == 0) or (ch == "│" and dc == 0)):
            pytest.fail(f"the line from {source.name} breaks at {r},{c}: {ch!r}")
        r, c = r + dr, c + dc


def test_the_docstring_diagram_is_the_table() -> None:
    drawn = _diagram_arrows(_diagram())
    assert drawn == {(p, t, n) for (p, t), n in RUN_TRANSITIONS.items()}


@pytest.mark.parametrize(
    "dotted", sorted(set(re.findall(r"``(iop(?:\.\w+)+)``", session_module.__doc__ or "")))
)
def test_the_session_docstring_names_what_exists(dotted: str) -> None:
    """Each ``iop.…`` name the module docstring cites can be opened (it once
    cited an ``iop.runtime.drive_link`` that did not exist)."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            assert hasattr(obj, name), f"{dotted}: no {name}"
            obj = getattr(obj, name)
        return
    pytest.fail(f"{dotted}: no such module")  # pragma: no cover


def test_the_diagram_reader_sees_a_wrong_drawing() -> None:
    """The reader is no rubber stamp: a relabelled arrow or a broken line shows."""
    grid = _diagram()
    relabelled = [line.replace("─cancel─┘", "─events─┘") for line in grid]
    assert (S, EVENTS, E) in _diagram_arrows(relabelled)
    broken = [line.replace("──► STREAMING", "─ ► STREAMING") for line in grid]
    with pytest.raises(pytest.fail.Exception, match="breaks"):
        _diagram_arrows(broken)


def test_the_node_ignores_a_cancel_the_table_refuses() -> None:
    """A second cancel of an ENDING run, or one of a run that ended, is late at
    the node, not wrong: the table refuses it and the node lets it be."""
    m = _open_model()
    edge, node = m.edge, m.node
    edge.assign("r1", "sim", SPEC, credit=4)
    edge.assign("r2", "sim", SPEC, credit=4)
    edge.cancel("r1", CancelReason.EXPLICIT)
    [assigns_and_cancel] = edge.data_to_send(0.0)
    node.receive(assigns_and_cancel, now=0.0)
    run = node.run("r1")
    assert run is not None
    assert run.phase is E
    node.push("r1", Cancelled(reason=CancelReason.EXPLICIT))
    node.push("r2", Complete())
    [ended] = node.data_to_send(0.0)
    assert _carried(ended) == [("r1", TERMINAL), ("r2", TERMINAL)]
    assert run.phase is D
    again = encode_batch(
        [encode(Cancel(run_id=r, reason=CancelReason.EXPLICIT)) for r in ("r1", "r2")]
    )
    assert len(node.receive(again, now=0.0)) == 2  # CancelReceived each, nothing else
    assert node.data_to_send(0.0) == []
    # And a second cancel while the run is ENDING, its terminal still queued.
    edge.assign("r3", "sim", SPEC, credit=4)
    edge.cancel("r3", CancelReason.EXPLICIT)
    node.receive(edge.data_to_send(0.0)[0], now=0.0)
    node.push("r3", Cancelled(reason=CancelReason.EXPLICIT))
    third = node.run("r3")
    assert third is not None
    node.receive(encode_batch([encode(Cancel(run_id="r3", reason=CancelReason.EXPLICIT))]), 0.0)
    assert third.phase is E
    assert third.queued == [Cancelled(reason=CancelReason.EXPLICIT)]
    [frame] = node.data_to_send(0.0)
    assert _carried(frame) == [("r3", TERMINAL)]
    assert third.phase is D


# --- both ends, driven by random triggers ------------------------------------------

RUNS = ["r0", "r1", "r2"]
TERMINALS: list[RuntimeEvent] = [
    Complete(),
    Error(message="boom"),
    Cancelled(reason=CancelReason.IDLE_TIMEOUT),
]


def _phase(link: RunLink | None) -> RunPhase:
    assert link is not None
    return link.phase


def _fold(phase: RunPhase, triggers: list[RunTrigger]) -> RunPhase:
    for trigger in triggers:
        nxt = EXPECTED.get((phase, trigger))
        assert nxt is not None, f"an honest peer sent {trigger.value} in {phase.value}"
        phase = nxt
    return phase


def _carried(frame: bytes) -> list[tuple[str, RunTrigger]]:
    """The (run, trigger) of each events message of a node frame, in order."""
    return [
        (msg.run_id, TERMINAL if is_terminal(msg.events[-1]) else EVENTS)
        for msg in decode_node_batch(frame)
        if isinstance(msg, RunEvents)
    ]


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["cancel", "events", "terminal", "node_sends", "to_node", "to_edge"]),
            st.sampled_from(RUNS),
            st.integers(0, 99),
        ),
        min_size=10,
        max_size=80,
    )
)
def test_random_triggers_move_both_ends_as_the_table_says(
    steps: list[tuple[str, str, int]],
) -> None:
    m = _open_model()  # small frames: a batch may go as several events messages
    edge, node = m.edge, m.node
    for run_id in RUNS:
        edge.assign(run_id, "sim", SPEC, credit=1000)
    for frame in edge.data_to_send(0.0):
        node.receive(frame, now=0.0)
    # Each end's RunLink of each run, held past the moment the session
    # forgets it, so its last phase can be read.
    edge_links = {rid: edge.run(rid) for rid in RUNS}
    node_links = {rid: node.run(rid) for rid in RUNS}
    at_edge = dict.fromkeys(RUNS, A)
    at_node = dict.fromkeys(RUNS, A)
    # What the node queued and did not send yet, per run: EVENTS or TERMINAL.
    pending: dict[str, RunTrigger] = {}
    to_node: deque[bytes] = deque()
    to_edge: deque[bytes] = deque()
    for action, run_id, pick in steps:
        if action == "cancel":
            # The edge applies CANCEL as it cancels; a refusal queues nothing.
            allowed = (at_edge[run_id], CANCEL) in EXPECTED
            assert edge.cancel(run_id, CancelReason.EXPLICIT) is allowed
            at_edge[run_id] = _fold(at_edge[run_id], [CANCEL]) if allowed else at_edge[run_id]
            to_node.extend(edge.data_to_send(0.0))
        elif action in ("events", "terminal"):
            event = Delta("t" * pick) if action == "events" else TERMINALS[pick % 3]
            if at_node[run_id] is D or pending.get(run_id) is TERMINAL:
                # Nothing follows the terminal: a bug in the node's driver.
                with pytest.raises(InvariantError):
                    node.push(run_id, event)
            else:
                node.push(run_id, event)
                if action == "terminal":
                    pending[run_id] = TERMINAL
                elif at_node[run_id] is not E:  # an ENDING run's events are dropped
                    pending[run_id] = EVENTS
        elif action == "node_sends":
            frames = node.data_to_send(0.0)
            sent = [pair for frame in frames for pair in _carried(frame)]
            for rid in RUNS:
                triggers = [t for r, t in sent if r == rid]
                if rid not in pending:
                    assert triggers == []
                    continue
                # A batch cut into several messages: all but the last are events.
                assert triggers[-1] is pending.pop(rid)
                assert set(triggers[:-1]) <= {EVENTS}
                at_node[rid] = _fold(at_node[rid], triggers)
            to_edge.extend(frames)
        elif action == "to_node" and to_node:
            frame = to_node.popleft()
            node.receive(frame, now=0.0)
            for msg in decode_edge_batch(frame):
                assert isinstance(msg, Cancel)
                rid = msg.run_id
                # The node ignores a cancel the table refuses (the run ended
                # here meanwhile); one it takes drops the run's queued events.
                if (at_node[rid], CANCEL) in EXPECTED:
                    at_node[rid] = _fold(at_node[rid], [CANCEL])
                    if pending.get(rid) is EVENTS:
                        del pending[rid]
        elif action == "to_edge" and to_edge:
            frame = to_edge.popleft()
            edge.receive(frame, now=0.0)
            for rid, trigger in _carried(frame):
                at_edge[rid] = _fold(at_edge[rid], [trigger])
        for rid in RUNS:
            assert _phase(edge_links[rid]) is at_edge[rid], f"edge, {rid}"
            assert _phase(node_links[rid]) is at_node[rid], f"node, {rid}"
            # Both ends forget a run exactly as it is DONE.
            assert (edge.run(rid) is None) is (at_edge[rid] is D), f"edge, {rid}"
            assert (node.run(rid) is None) is (at_node[rid] is D), f"node, {rid}"
