"""The node's side of a run's timeline on the link: it rides on the terminal's
events message, reaches the edge for a run it cancelled too, never makes a
terminal too big to send, and is set against the edge's clock by the run's own
round trip (``NodeTimeline.on_edge_clock``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.events import Complete, Delta, Start
from iop.protocol import RunEventsReceived, decode_node_batch
from iop.timeline import NodeTimeline, Stall, StallKind
from tests.protocol.test_protocol import (
    BYE,
    SPEC,
    assigned,
    open_pair,
    pair,
    to_edge,
    to_node,
)

NODE = NodeTimeline(node="n1", started=100.0, backend_sent=100.001, terminal=100.5)


def test_the_timeline_rides_on_the_terminal_message_only() -> None:
    edge, node = assigned(credit=8)
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    first = to_edge(node, edge)
    assert [e.timeline for e in first if isinstance(e, RunEventsReceived)] == [None]
    node.push("r1", Delta("b"))
    node.push("r1", Complete(), NODE)
    frames = node.data_to_send(0)
    (message,) = [m for f in frames for m in decode_node_batch(f)]
    assert message.timeline == NODE  # type: ignore[union-attr]
    got = [e for f in frames for e in edge.receive(f, now=0)]
    (ev,) = got
    assert isinstance(ev, RunEventsReceived)
    assert ev.finished
    assert ev.timeline == NODE


def test_a_cancelled_runs_timeline_still_reaches_the_edge() -> None:
    edge, node = assigned(credit=4)
    node.push("r1", Start())
    to_edge(node, edge)
    edge.cancel("r1", BYE.reason)
    to_node(edge, node)
    node.push("r1", BYE, NODE)
    (ev,) = to_edge(node, edge)
    assert isinstance(ev, RunEventsReceived)
    # Nothing to deliver (the edge gave up on the run), only how the node ended it.
    assert (ev.events, ev.finished, ev.timeline) == ([], True, NODE)


def test_a_timeline_never_keeps_a_terminal_from_fitting() -> None:
    # The edge accepts 4 KiB frames (MIN is 512); the node's timeline alone is bigger.
    edge, node = pair(max_frame_bytes=4096)
    open_pair(edge, node)
    edge.assign("r1", "sim", SPEC, credit=4)
    to_node(edge, node)
    huge = NodeTimeline(
        node="n1",
        started=0.0,
        terminal=1.0,
        stalls=[Stall(kind=StallKind.CREDIT, start=float(i), end=float(i)) for i in range(500)],
    )
    node.push("r1", Start())
    node.push("r1", Complete(), huge)
    frames = node.data_to_send(0)
    assert all(len(f) <= 4096 for f in frames)
    messages = [m for f in frames for m in decode_node_batch(f)]
    assert [getattr(m, "timeline", None) for m in messages] == [None]
    events = [e for f in frames for e in edge.receive(f, now=0)]
    assert [type(x) for e in events if isinstance(e, RunEventsReceived) for x in e.events] == [
        Start,
        Complete,
    ]


def test_the_node_clock_is_set_by_the_runs_round_trip() -> None:
    # Node clock = edge clock + 1000 s; 4 ms each way; the node held the run 0.5 s.
    node = NodeTimeline(
        node="n1",
        started=1000.0 + 10.004,
        backend_sent=1000.0 + 10.010,
        terminal=1000.0 + 10.504,
        stalls=[Stall(kind=StallKind.CREDIT, start=1010.1, end=1010.2)],
    )
    moved = node.on_edge_clock(assigned=10.0, received=10.508, max_stalls=8)
    assert moved is not None
    assert moved.clock_offset_s == pytest.approx(-1000.0)
    assert moved.clock_rtt_s == pytest.approx(0.008)
    assert moved.started == pytest.approx(10.004)
    assert moved.backend_sent == pytest.approx(10.010)
    assert moved.stalls[0].start == pytest.approx(10.1)


def test_a_timeline_that_cannot_be_true_is_dropped() -> None:
    # A round trip shorter than the node says it held the run: a liar or a jump.
    assert NODE.on_edge_clock(assigned=0.0, received=0.1, max_stalls=8) is None
    nan = NodeTimeline(node="n1", started=0.0, terminal=0.1, backend_sent=math.nan)
    assert nan.on_edge_clock(assigned=0.0, received=1.0, max_stalls=8) is None
    assert NodeTimeline(node="n1").on_edge_clock(assigned=0.0, received=1.0, max_stalls=8) is None


def test_stalls_past_the_edges_cap_are_counted() -> None:
    node = NodeTimeline(
        node="n1",
        started=0.0,
        terminal=0.5,
        stalls=[Stall(kind=StallKind.CREDIT, start=0.1, end=0.2) for _ in range(5)],
        stalls_dropped=7,
    )
    moved = node.on_edge_clock(assigned=0.0, received=1.0, max_stalls=2)
    assert moved is not None
    assert len(moved.stalls) == 2
    assert moved.stalls_dropped == 10


@given(
    offset=st.floats(-1e6, 1e6),
    one_way=st.floats(0, 1),
    back=st.floats(0, 1),
    held=st.floats(0, 100),
)
def test_the_error_is_at_most_half_the_round_trip(
    offset: float, one_way: float, back: float, held: float
) -> None:
    assigned = 50.0
    started = assigned + one_way + offset  # node clock
    terminal = started + held
    received = assigned + one_way + held + back
    node = NodeTimeline(node="n", started=started, terminal=terminal)
    moved = node.on_edge_clock(assigned=assigned, received=received, max_stalls=1)
    assert moved is not None
    assert moved.clock_rtt_s is not None
    assert moved.clock_rtt_s == pytest.approx(one_way + back, abs=1e-6)
    true_start = assigned + one_way
    assert moved.started is not None
    assert abs(moved.started - true_start) <= moved.clock_rtt_s / 2 + 1e-6
