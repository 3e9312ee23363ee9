"""The link protocol, sans-IO: codec round trips, sessions, credit and liveness."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.capabilities import Capabilities
from iop.errors import InvariantError, LinkAuthError, LinkProtocolError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    ReasoningDelta,
    Start,
    ToolCall,
    Usage,
)
from iop.protocol import (
    PROTOCOL_VERSION,
    Assign,
    AssignReceived,
    CancelReceived,
    CapabilitiesChanged,
    CreditReceived,
    EdgeSession,
    Hello,
    LinkState,
    NodeDraining,
    NodeJoined,
    NodeSession,
    PingReceived,
    RunEvents,
    RunEventsReceived,
    Welcomed,
    decode_edge_message,
    decode_node_message,
    encode,
)
from iop.spec import ChatRequest, ExecutionSpec, Message

SPEC = ExecutionSpec(
    run_id="r1", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))


def pair(now: float = 0.0, token: str = "t0k") -> tuple[EdgeSession, NodeSession]:
    edge = EdgeSession(
        tokens=["other", "t0k"], heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5, now=now
    )
    node = NodeSession(node_id="n1", token=token, now=now)
    return edge, node


def open_pair() -> tuple[EdgeSession, NodeSession]:
    edge, node = pair()
    event, welcome = edge.receive(node.hello([CAPS]), now=0.0)
    assert isinstance(event, NodeJoined)
    assert event.hello.instances == [CAPS]
    assert welcome is not None
    assert isinstance(node.receive(welcome, now=0.0), Welcomed)
    return edge, node


def test_handshake() -> None:
    edge, node = open_pair()
    assert edge.state is LinkState.OPEN
    assert node.state is LinkState.OPEN
    assert edge.node_id == "n1"
    assert node.heartbeat_timeout_s == 1.5


def test_bad_token_is_refused() -> None:
    edge, node = pair(token="wrong")
    with pytest.raises(LinkAuthError, match="bad token"):
        edge.receive(node.hello([]), now=0.0)
    assert edge.state is LinkState.AWAIT_HELLO


def test_protocol_version_mismatch_is_refused() -> None:
    edge, _ = pair()
    frame = encode(Hello(protocol_version=PROTOCOL_VERSION + 1, node_id="n", token="t0k"))
    with pytest.raises(LinkAuthError, match="protocol"):
        edge.receive(frame, now=0.0)


def test_first_frame_must_be_hello() -> None:
    edge, _ = pair()
    frame = encode(RunEvents(run_id="r", seq=0, events=[]))
    with pytest.raises(LinkProtocolError, match="expected hello"):
        edge.receive(frame, now=0.0)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xff\xff",
        b"\x81\xa1t\xa5nope!",
        encode(Assign(run_id="r", instance="i", spec=SPEC, credit=1)),
    ],
)
def test_garbage_frames_are_protocol_errors(garbage: bytes) -> None:
    edge, _ = open_pair()
    with pytest.raises(LinkProtocolError):
        edge.receive(garbage, now=1.0)


def test_run_flow_with_credit() -> None:
    edge, node = open_pair()
    frame = edge.assign("r1", "sim", SPEC, credit=2)
    ev = node.receive(frame, now=0.1)
    assert isinstance(ev, AssignReceived)
    assert ev.assign.spec == SPEC
    assert node.credit("r1") == 2
    # Start and one delta use the whole credit.
    got, _ = edge.receive(node.run_events("r1", [Start(), Delta("a")]), now=0.2)
    assert got == RunEventsReceived("r1", [Start(), Delta("a")], finished=False)
    assert node.credit("r1") == 0
    with pytest.raises(InvariantError, match="credit"):
        node.run_events("r1", [Delta("b")])
    grant = edge.grant("r1", 2)
    assert grant is not None
    assert node.receive(grant, now=0.3) == CreditReceived("r1", 2)
    # The terminal event needs no credit.
    got, _ = edge.receive(node.run_events("r1", [Delta("b"), Delta("c"), Complete()]), now=0.4)
    assert got == RunEventsReceived("r1", [Delta("b"), Delta("c"), Complete()], finished=True)
    assert edge.runs == frozenset()
    assert edge.grant("r1", 5) is None


def test_terminal_needs_no_credit() -> None:
    edge, node = open_pair()
    node.receive(edge.assign("r1", "sim", SPEC, credit=0), now=0)
    cancelled = Cancelled(reason=CancelReason.IDLE_TIMEOUT)
    got, _ = edge.receive(node.run_events("r1", [cancelled]), now=0)
    assert got == RunEventsReceived("r1", [cancelled], finished=True)


def test_node_exceeding_credit_is_a_protocol_error() -> None:
    edge, _ = open_pair()
    edge.assign("r1", "sim", SPEC, credit=1)
    frame = encode(RunEvents(run_id="r1", seq=0, events=[Start(), Delta("x")]))
    with pytest.raises(LinkProtocolError, match="2 events sent with 1 credit"):
        edge.receive(frame, now=0)


def test_events_after_terminal_and_bad_seq_are_protocol_errors() -> None:
    edge, _ = open_pair()
    edge.assign("r1", "sim", SPEC, credit=9)
    with pytest.raises(LinkProtocolError, match="after the terminal"):
        edge.receive(encode(RunEvents(run_id="r1", seq=0, events=[Complete(), Delta("x")])), now=0)
    edge.assign("r2", "sim", SPEC, credit=9)
    with pytest.raises(LinkProtocolError, match="expected 0"):
        edge.receive(encode(RunEvents(run_id="r2", seq=3, events=[Start()])), now=0)


def test_events_of_a_cancelled_run_are_dropped() -> None:
    edge, node = open_pair()
    node.receive(edge.assign("r1", "sim", SPEC, credit=4), now=0)
    cancel = edge.cancel("r1", CancelReason.CLIENT_DISCONNECT, "gone")
    assert cancel is not None
    ev = node.receive(cancel, now=0)
    assert isinstance(ev, CancelReceived)
    assert ev.cancel.reason is CancelReason.CLIENT_DISCONNECT
    got, _ = edge.receive(
        node.run_events("r1", [Start(), Cancelled(reason=CancelReason.CLIENT_DISCONNECT)]), now=0
    )
    assert got == RunEventsReceived("r1", [], finished=True)
    assert edge.cancel("r1", CancelReason.EXPLICIT) is None


def test_ping_pong_and_liveness() -> None:
    edge, node = open_pair()
    assert edge.liveness_deadline == 1.5
    ev = node.receive(edge.ping(), now=1.0)
    assert isinstance(ev, PingReceived)
    got, reply = edge.receive(ev.reply, now=1.2)
    assert got is None
    assert reply is None
    assert edge.liveness_deadline == pytest.approx(2.7)
    assert node.liveness_deadline == pytest.approx(2.5)


def test_capabilities_update_and_goodbye() -> None:
    edge, node = open_pair()
    got, _ = edge.receive(node.capabilities([CAPS]), now=0)
    assert got == CapabilitiesChanged([CAPS])
    got, _ = edge.receive(node.goodbye("draining"), now=0)
    assert got == NodeDraining("draining")


def test_close_returns_runs_in_flight() -> None:
    edge, node = open_pair()
    edge.assign("r1", "sim", SPEC)
    edge.assign("r2", "sim", SPEC)
    assert edge.close() == frozenset({"r1", "r2"})
    with pytest.raises(LinkProtocolError):
        edge.receive(node.goodbye(), now=0)
    with pytest.raises(InvariantError):
        edge.assign("r3", "sim", SPEC)


def test_node_rejects_bad_edge_frames() -> None:
    _, node = pair()
    with pytest.raises(LinkProtocolError, match="expected welcome"):
        node.receive(encode(Assign(run_id="r", instance="i", spec=SPEC, credit=1)), now=0)
    edge, node = open_pair()
    frame = edge.assign("r1", "sim", SPEC)
    node.receive(frame, now=0)
    with pytest.raises(LinkProtocolError, match="assigned twice"):
        node.receive(frame, now=0)
    with pytest.raises(LinkProtocolError):
        node.receive(node.hello([]), now=0)  # a node message sent to a node


# --- codec properties -------------------------------------------------------------

texts = st.text(max_size=40)
usage = st.builds(
    Usage,
    input_tokens=st.integers(0, 10**6),
    output_tokens=st.integers(0, 10**6),
    estimated=st.booleans(),
)
events = st.one_of(
    st.builds(Start, target=texts),
    st.builds(Delta, texts),
    st.builds(ReasoningDelta, texts),
    st.builds(
        Complete,
        usage=usage,
        tool_calls=st.lists(
            st.builds(ToolCall, id=texts, name=texts, arguments=texts), max_size=3
        ).map(tuple),
        text_tool_fallback=st.booleans(),
    ),
    st.builds(Error, message=texts, status=st.integers(400, 599), code=texts),
    st.builds(Cancelled, reason=st.sampled_from(list(CancelReason)), message=texts, usage=usage),
)


@settings(max_examples=300, deadline=None)
@given(run_id=texts, seq=st.integers(0, 2**31), evs=st.lists(events, max_size=10))
def test_run_events_round_trip(run_id: str, seq: int, evs: list[object]) -> None:
    msg = RunEvents(run_id=run_id, seq=seq, events=evs)  # type: ignore[arg-type]
    assert decode_node_message(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=300))
def test_arbitrary_frames_never_crash_either_side(frame: bytes) -> None:
    for decode in (decode_node_message, decode_edge_message):
        with contextlib.suppress(LinkProtocolError):
            decode(frame)
    edge, node = open_pair()
    with contextlib.suppress(LinkProtocolError):
        edge.receive(frame, now=1)
    with contextlib.suppress(LinkProtocolError):
        node.receive(frame, now=1)


def test_frame_is_msgpack_with_a_tag() -> None:
    raw = msgspec.msgpack.decode(encode(RunEvents(run_id="r", seq=0, events=[Delta("x")])))
    assert raw == {
        "t": "events",
        "run_id": "r",
        "seq": 0,
        "events": [{"type": "delta", "text": "x"}],
    }


@settings(max_examples=200, deadline=None)
@given(
    plan=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=20),
    window=st.integers(0, 8),
)
def test_credit_never_exceeded_by_a_well_behaved_node(
    plan: list[tuple[int, int]], window: int
) -> None:
    """A node that sends min(wanted, credit) events and an edge that grants what
    its consumer took never trip the protocol, and the edge's buffer never holds
    more than the window."""
    edge, node = open_pair()
    node.receive(edge.assign("r1", "sim", SPEC, credit=window), now=0)
    buffered = 0
    for want, take in plan:
        n = min(want, node.credit("r1"))
        if n:
            got, _ = edge.receive(node.run_events("r1", [Delta("x")] * n), now=0)
            assert isinstance(got, RunEventsReceived)
            buffered += n
        assert buffered <= window
        took = min(take, buffered)
        buffered -= took
        grant = edge.grant("r1", took)
        if grant is not None:
            node.receive(grant, now=0)
