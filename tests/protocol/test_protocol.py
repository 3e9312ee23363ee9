"""The link protocol, sans-IO: codec and batch framing, handshake, limits, run phases,
credit and backpressure, batching into frames, heartbeats (``iop.protocol._session``)."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.capabilities import Capabilities
from iop.errors import (
    InvariantError,
    LinkAuthError,
    LinkLimitError,
    LinkProtocolError,
    RequestError,
)
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    EmbeddingData,
    Error,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    ToolCall,
    Usage,
    is_terminal,
)
from iop.protocol import (
    CLOSE_RATE,
    CLOSE_TOO_BIG,
    LEGACY_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    RELEASED_RUNS_REMEMBERED,
    Assign,
    AssignReceived,
    Cancel,
    CancelReceived,
    CapabilitiesChanged,
    CapabilitiesUpdate,
    Credit,
    CreditReceived,
    EdgeSession,
    Goodbye,
    Hello,
    LinkState,
    NodeDraining,
    NodeJoined,
    NodeSession,
    Ping,
    RunEvents,
    RunEventsReceived,
    RunLink,
    RunPhase,
    Welcome,
    Welcomed,
    decode_edge_batch,
    decode_edge_message,
    decode_node_batch,
    decode_node_message,
    encode,
    encode_batch,
)
from iop.protocol._messages import array_header
from iop.protocol._session import (
    COLLECT_FLUSH_S,
    COLLECT_MERGE_CHARS,
    EDGE_SILENCE_FACTOR,
    MIN_PEER_FRAME_BYTES,
    EdgeLinkEvent,
    NodeLinkEvent,
)
from iop.spec import ChatRequest, ExecutionSpec, Message

SPEC = ExecutionSpec(
    run_id="r1", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))
BYE = Cancelled(reason=CancelReason.CLIENT_DISCONNECT)


def pair(now: float = 0.0, token: str = "t0k", **edge_kw: Any) -> tuple[EdgeSession, NodeSession]:
    edge = EdgeSession(
        tokens=["other", "t0k"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=now,
        **edge_kw,
    )
    node = NodeSession(node_id="n1", token=token, now=now)
    return edge, node


def open_pair(
    edge: EdgeSession | None = None, node: NodeSession | None = None
) -> tuple[EdgeSession, NodeSession]:
    if edge is None or node is None:
        edge, node = pair()
    [joined] = edge.receive(node.hello([CAPS]), now=0.0)
    assert isinstance(joined, NodeJoined)
    assert joined.hello.instances == [CAPS]
    [welcomed] = node.receive(edge.welcome(), now=0.0)
    assert isinstance(welcomed, Welcomed)
    return edge, node


def to_node(edge: EdgeSession, node: NodeSession, now: float = 0.0) -> list[NodeLinkEvent]:
    got: list[NodeLinkEvent] = []
    for frame in edge.data_to_send(now):
        got += node.receive(frame, now)
    return got


def to_edge(node: NodeSession, edge: EdgeSession, now: float = 0.0) -> list[EdgeLinkEvent]:
    got: list[EdgeLinkEvent] = []
    for frame in node.data_to_send(now):
        got += edge.receive(frame, now)
    return got


def assigned(credit: int = 4, run_id: str = "r1") -> tuple[EdgeSession, NodeSession]:
    edge, node = open_pair()
    edge.assign(run_id, "sim", SPEC, credit=credit)
    [ev] = to_node(edge, node)
    assert isinstance(ev, AssignReceived)
    return edge, node


def events_frame(run_id: str, seq: int, events: list[RuntimeEvent]) -> bytes:
    return encode_batch([encode(RunEvents(run_id=run_id, seq=seq, events=events))])


def phase(link: RunLink | None) -> RunPhase | None:
    return None if link is None else link.phase


# --- handshake ------------------------------------------------------------------------


def test_handshake() -> None:
    edge, node = open_pair()
    assert edge.state is LinkState.OPEN
    assert node.state is LinkState.OPEN
    assert edge.node_id == "n1"
    # The edge pings every timeout of its silence; the node forgives two late pings.
    assert node.heartbeat_timeout_s == 1.5 * EDGE_SILENCE_FACTOR
    assert node.heartbeat_interval_s == 0.5
    assert PROTOCOL_VERSION == 3


def test_bad_token_is_refused() -> None:
    edge, node = pair(token="wrong")
    with pytest.raises(LinkAuthError, match="bad token"):
        edge.receive(node.hello([]), now=0.0)
    assert edge.state is LinkState.AWAIT_HELLO


def test_protocol_version_mismatch_is_refused() -> None:
    edge, _ = pair()
    for version in (PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1):
        frame = encode(Hello(protocol_version=version, node_id="n", token="t0k"))
        with pytest.raises(LinkAuthError, match="protocol"):
            edge.receive(frame, now=0.0)


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (Hello(protocol_version=PROTOCOL_VERSION, node_id="", token="t0k"), "node id"),
        (
            Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t0k", max_frame_bytes=-1),
            "max_frame_bytes",
        ),
    ],
)
def test_a_malformed_hello_is_refused(hello: Hello, match: str) -> None:
    edge, _ = pair()
    with pytest.raises(LinkProtocolError, match=match):
        edge.receive(encode(hello), now=0.0)


def test_first_frame_must_be_hello() -> None:
    edge, _ = pair()
    with pytest.raises(LinkProtocolError, match="expected hello"):
        edge.receive(encode(Goodbye()), now=0.0)


def test_welcome_before_the_hello_is_a_bug() -> None:
    edge, _ = pair()
    with pytest.raises(InvariantError):
        edge.welcome()


@pytest.mark.parametrize(
    "welcome",
    [
        Welcome(protocol_version=3, node_id="n1", heartbeat_interval_s=0.5, heartbeat_timeout_s=-1),
        Welcome(protocol_version=3, node_id="n1", heartbeat_interval_s=2, heartbeat_timeout_s=1),
        Welcome(protocol_version=3, node_id="n1", heartbeat_interval_s=0, heartbeat_timeout_s=1),
        Welcome(
            protocol_version=3,
            node_id="n1",
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=1,
            max_frame_bytes=-1,
        ),
    ],
)
def test_a_malformed_welcome_is_refused(welcome: Welcome) -> None:
    node = NodeSession(node_id="n1", token="t0k", now=0)
    with pytest.raises(LinkProtocolError, match="negative"):
        node.receive(encode(welcome), now=0)


def test_node_first_frame_must_be_welcome() -> None:
    node = NodeSession(node_id="n1", token="t0k", now=0)
    with pytest.raises(LinkProtocolError, match="expected welcome"):
        node.receive(encode(Assign(run_id="r", instance="i", spec=SPEC, credit=1)), now=0)


def test_a_handshake_frame_sent_as_an_array_is_refused() -> None:
    edge, node = pair()
    with pytest.raises(LinkProtocolError):
        edge.receive(encode_batch([node.hello([CAPS])]), now=0)
    assert edge.state is LinkState.AWAIT_HELLO
    edge.receive(node.hello([CAPS]), now=0)
    with pytest.raises(LinkProtocolError):
        node.receive(encode_batch([edge.welcome()]), now=0)
    assert node.state is LinkState.AWAIT_WELCOME


def test_a_handshake_message_after_the_handshake_is_a_protocol_error() -> None:
    edge, node = open_pair()
    with pytest.raises(LinkProtocolError, match="unexpected Hello"):
        edge.receive(encode_batch([node.hello([])]), now=0)
    with pytest.raises(LinkProtocolError, match="unexpected Welcome"):
        node.receive(encode_batch([edge.welcome()]), now=0)
    with pytest.raises(LinkProtocolError):
        node.receive(encode_batch([node.hello([])]), now=0)  # a node message sent to a node


def test_frames_after_close_are_protocol_errors() -> None:
    edge, node = open_pair()
    edge.assign("r1", "sim", SPEC)
    edge.assign("r2", "sim", SPEC)
    to_node(edge, node)
    assert edge.close() == frozenset({"r1", "r2"})
    assert node.close() == frozenset({"r1", "r2"})
    node2 = NodeSession(node_id="n1", token="t0k", now=0)
    with pytest.raises(LinkProtocolError, match="after close"):
        edge.receive(encode_batch([encode(Goodbye())]), now=0)
    with pytest.raises(LinkProtocolError, match="after close"):
        node.receive(encode_batch([encode(Ping(nonce=1))]), now=0)
    with pytest.raises(InvariantError):
        edge.assign("r3", "sim", SPEC)
    assert node2.state is LinkState.AWAIT_WELCOME
    assert edge.data_to_send(1.0) == []
    assert not edge.cancel("r1", CancelReason.EXPLICIT)


# --- codec and batch framing ---------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "header"),
    [
        (1, b"\x91"),
        (15, b"\x9f"),
        (16, b"\xdc\x00\x10"),
        (65535, b"\xdc\xff\xff"),
        (65536, b"\xdd\x00\x01\x00\x00"),
    ],
)
def test_batch_array_header_forms(n: int, header: bytes) -> None:
    assert array_header(n) == header
    ping = encode(Ping(nonce=1))
    frame = encode_batch([ping] * n)
    assert frame == header + ping * n
    assert msgspec.msgpack.decode(frame) == [{"t": "ping", "nonce": 1}] * n
    assert decode_node_batch(frame) == [Ping(nonce=1)] * n
    assert decode_edge_batch(frame) == [Ping(nonce=1)] * n


def test_data_to_send_frames_are_arrays_of_messages() -> None:
    _, node = assigned()
    node.push("r1", Delta("x"))
    node.capabilities([CAPS])
    [frame] = node.data_to_send(0)
    assert frame[0] == 0x92
    assert msgspec.msgpack.decode(frame) == [
        {"t": "caps", "instances": [msgspec.msgpack.decode(msgspec.msgpack.encode(CAPS))]},
        {"t": "events", "run_id": "r1", "seq": 0, "events": [{"type": "delta", "text": "x"}]},
    ]


@pytest.mark.parametrize("frame", [b"\x90", b"\xdc\x00\x00", b"\xdd\x00\x00\x00\x00"])
def test_an_empty_array_after_the_handshake_is_a_protocol_error(frame: bytes) -> None:
    edge, node = open_pair()
    with pytest.raises(LinkProtocolError, match="no messages"):
        edge.receive(frame, now=0)
    with pytest.raises(LinkProtocolError, match="no messages"):
        node.receive(frame, now=0)
    for decode in (decode_node_batch, decode_edge_batch):
        with pytest.raises(LinkProtocolError, match="no messages"):
            decode(frame)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xff",
        b"\x81\xa1t\xa5nope!",
        encode(Ping(nonce=1)),
        encode(RunEvents(run_id="r", seq=0, events=[Delta("x")])),
        encode(Goodbye(reason="bare")),
        b"\x91\x81\xa1t\xa5nope!",
        b"\x92" + encode(Ping(nonce=1)),  # an array shorter than its header says
    ],
)
def test_a_non_array_or_malformed_frame_after_the_handshake_is_a_protocol_error(
    frame: bytes,
) -> None:
    edge, node = open_pair()
    with pytest.raises(LinkProtocolError):
        edge.receive(frame, now=1.0)
    with pytest.raises(LinkProtocolError):
        node.receive(frame, now=1.0)


def test_a_bad_frame_does_not_prove_liveness() -> None:
    edge, node = open_pair()
    with pytest.raises(LinkProtocolError):
        edge.receive(b"\x90", now=1.0)
    with pytest.raises(LinkProtocolError):
        node.receive(b"\xc1", now=1.0)
    assert edge.last_seen == 0.0
    assert node.last_seen == 0.0


def test_frame_is_msgpack_with_a_tag() -> None:
    raw = msgspec.msgpack.decode(encode(RunEvents(run_id="r", seq=0, events=[Delta("x")])))
    assert raw == {
        "t": "events",
        "run_id": "r",
        "seq": 0,
        "events": [{"type": "delta", "text": "x"}],
    }


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
def test_run_events_round_trip(run_id: str, seq: int, evs: list[RuntimeEvent]) -> None:
    msg = RunEvents(run_id=run_id, seq=seq, events=evs)
    assert decode_node_message(encode(msg)) == msg
    assert decode_node_batch(encode_batch([encode(msg), encode(msg)])) == [msg, msg]


@settings(max_examples=100, deadline=None)
@given(
    msgs=st.lists(
        st.one_of(
            st.builds(Credit, run_id=texts, credit=st.integers(1, 2**31)),
            st.builds(Cancel, run_id=texts, reason=st.sampled_from(list(CancelReason))),
            st.builds(Ping, nonce=st.integers(0, 2**63)),
            st.builds(Assign, run_id=texts, instance=texts, spec=st.just(SPEC), credit=st.just(3)),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_edge_batches_round_trip(msgs: list[Credit | Cancel | Ping | Assign]) -> None:
    assert decode_edge_batch(encode_batch([encode(m) for m in msgs])) == msgs


@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=300))
def test_arbitrary_frames_never_crash_either_side(frame: bytes) -> None:
    for decode in (decode_node_message, decode_edge_message, decode_node_batch, decode_edge_batch):
        with contextlib.suppress(LinkProtocolError):
            decode(frame)
    edge, node = open_pair()
    with contextlib.suppress(LinkProtocolError):
        edge.receive(frame, now=1)
    with contextlib.suppress(LinkProtocolError):
        node.receive(frame, now=1)


# --- limits --------------------------------------------------------------------------


def test_frame_limits_before_and_after_the_hello() -> None:
    edge = EdgeSession(
        tokens=["t0k"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0,
        max_hello_bytes=300,
        max_frame_bytes=1000,
    )
    node = NodeSession(node_id="n1", token="t0k", now=0, max_frame_bytes=800)
    assert edge.frame_limit == 300
    with pytest.raises(LinkLimitError, match="before its hello") as exc:
        edge.receive(b"\x00" * 301, now=0)
    assert exc.value.close_code == CLOSE_TOO_BIG
    open_pair(edge, node)
    assert edge.frame_limit == 1000
    assert edge.peer_max_frame_bytes == 800
    assert node.peer_max_frame_bytes == 1000
    # A frame of exactly the limit is read (and here found malformed).
    with pytest.raises(LinkProtocolError) as exc2:
        edge.receive(b"\x00" * 1000, now=0)
    assert not isinstance(exc2.value, LinkLimitError)
    with pytest.raises(LinkLimitError, match="open link") as exc:
        edge.receive(b"\x00" * 1001, now=0)
    assert exc.value.close_code == CLOSE_TOO_BIG
    with pytest.raises(LinkLimitError) as exc:
        node.receive(b"\x00" * 801, now=0)
    assert exc.value.close_code == CLOSE_TOO_BIG


def test_a_peer_that_states_no_limit_gets_the_legacy_one() -> None:
    edge, node = pair()
    edge.receive(encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t0k")), 0)
    assert edge.peer_max_frame_bytes == LEGACY_MAX_FRAME_BYTES
    welcome = Welcome(
        protocol_version=3, node_id="n1", heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5
    )
    node.receive(encode(welcome), now=0)
    assert node.peer_max_frame_bytes == LEGACY_MAX_FRAME_BYTES


def test_control_messages_draw_from_a_token_bucket() -> None:
    edge, node = pair(control_rate_per_s=2.0, control_burst=3)
    open_pair(edge, node)
    edge.assign("r1", "sim", SPEC, credit=100)
    to_node(edge, node)
    ping = encode(Ping(nonce=1))
    edge.receive(encode_batch([ping, ping]), now=0)
    # Events cost credit, not control tokens.
    for seq in range(20):
        edge.receive(events_frame("r1", seq, [Delta("x")]), now=0)
    edge.receive(encode_batch([encode(CapabilitiesUpdate(instances=[]))]), now=0)
    with pytest.raises(LinkLimitError, match="message rate") as exc:
        edge.receive(encode_batch([encode(Goodbye())]), now=0)
    assert exc.value.close_code == CLOSE_RATE
    # Tokens come back at the rate: one after half a second.
    edge2, node2 = pair(control_rate_per_s=2.0, control_burst=1)
    open_pair(edge2, node2)
    edge2.receive(encode_batch([ping]), now=0)
    edge2.receive(encode_batch([ping]), now=0.5)
    with pytest.raises(LinkLimitError):
        edge2.receive(encode_batch([ping]), now=0.6)


def test_a_flood_in_one_frame_is_cut_off() -> None:
    edge, node = pair(control_burst=10)
    open_pair(edge, node)
    with pytest.raises(LinkLimitError) as exc:
        edge.receive(encode_batch([encode(Ping(nonce=i)) for i in range(11)]), now=0)
    assert exc.value.close_code == CLOSE_RATE


def test_an_assign_too_large_for_the_node_is_a_413_for_that_run_alone() -> None:
    edge, _ = pair()
    node = NodeSession(node_id="n1", token="t0k", now=0, max_frame_bytes=2000)
    open_pair(edge, node)
    big = ExecutionSpec(
        run_id="big",
        request=ChatRequest(model="m", messages=[Message(role="user", content="x" * 2000)]),
    )
    with pytest.raises(RequestError) as exc:
        edge.assign("big", "sim", big)
    assert exc.value.status == 413
    assert exc.value.code == "request_too_large"
    assert edge.run("big") is None
    assert not edge.has_data_to_send
    assert edge.state is LinkState.OPEN
    edge.assign("r1", "sim", SPEC)
    [ev] = to_node(edge, node)
    assert isinstance(ev, AssignReceived)


# --- run phases: the edge ------------------------------------------------------------


def test_edge_run_is_assigned_on_assign() -> None:
    edge, _ = open_pair()
    assert edge.run("r1") is None
    edge.assign("r1", "sim", SPEC, credit=3)
    run = edge.run("r1")
    assert run is not None
    assert run.phase is RunPhase.ASSIGNED
    assert (run.credit, run.window, run.seq) == (3, 3, 0)
    assert edge.runs == frozenset({"r1"})


def test_edge_assigned_to_streaming_on_the_first_event() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Start(), Delta("a")], finished=False)]
    run = edge.run("r1")
    assert run is not None
    assert run.phase is RunPhase.STREAMING
    assert (run.credit, run.seq) == (2, 1)


def test_edge_streaming_to_done_on_the_terminal() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    to_edge(node, edge)
    run = edge.run("r1")
    assert run is not None
    node.push("r1", Complete())
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Complete()], finished=True)]
    assert run.phase is RunPhase.DONE
    assert edge.run("r1") is None
    assert edge.runs == frozenset()


def test_edge_assigned_to_done_on_a_rejection() -> None:
    edge, node = assigned()
    run = edge.run("r1")
    assert run is not None
    error = Error(message="no such model", status=404, code="model_not_found")
    node.reject("r1", error)
    assert to_edge(node, edge) == [RunEventsReceived("r1", [error], finished=True)]
    assert run.phase is RunPhase.DONE
    assert edge.run("r1") is None


def test_edge_assigned_to_ending_on_cancel() -> None:
    edge, _ = assigned()
    assert edge.cancel("r1", CancelReason.CLIENT_DISCONNECT, "gone")
    run = edge.run("r1")
    assert run is not None
    assert run.phase is RunPhase.ENDING
    assert edge.runs == frozenset()
    [frame] = edge.data_to_send(0)
    assert decode_edge_batch(frame) == [
        Cancel(run_id="r1", reason=CancelReason.CLIENT_DISCONNECT, message="gone")
    ]


def test_edge_streaming_to_ending_on_cancel() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    to_edge(node, edge)
    assert edge.cancel("r1", CancelReason.EXPLICIT)
    assert phase(edge.run("r1")) is RunPhase.ENDING
    # Cancelling again, or after the end, says nothing.
    assert not edge.cancel("r1", CancelReason.EXPLICIT)


def test_edge_ending_to_done_on_the_late_terminal_whose_events_are_dropped() -> None:
    edge, node = assigned(credit=4)
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    late = node.data_to_send(0)  # on the way when the edge cancels
    edge.cancel("r1", CancelReason.CLIENT_DISCONNECT)
    run = edge.run("r1")
    assert run is not None
    for frame in late:
        assert edge.receive(frame, now=0) == []
    assert run.phase is RunPhase.ENDING
    assert (run.seq, run.credit) == (1, 2)  # late events are still checked
    [ev] = to_node(edge, node)
    assert isinstance(ev, CancelReceived)
    assert ev.cancel.reason is CancelReason.CLIENT_DISCONNECT
    node.push("r1", BYE)
    assert to_edge(node, edge) == []
    assert run.phase is RunPhase.DONE
    assert edge.run("r1") is None


# --- run phases: the node ------------------------------------------------------------


def test_node_run_is_assigned_on_assign() -> None:
    _, node = assigned(credit=2)
    run = node.run("r1")
    assert run is not None
    assert run.phase is RunPhase.ASSIGNED
    assert node.credit("r1") == 2


def test_node_assigned_to_streaming_when_the_first_event_goes() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    # A Start alone is held for the first output (NodeSession.push).
    assert not node.has_data_to_send
    assert to_edge(node, edge) == []
    node.push("r1", Delta("a"))
    assert phase(node.run("r1")) is RunPhase.ASSIGNED  # queued, not sent
    assert node.has_data_to_send
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Start(), Delta("a")], finished=False)]
    assert phase(node.run("r1")) is RunPhase.STREAMING


def test_a_held_start_goes_with_the_first_output_within_a_credit_of_one() -> None:
    edge, node = assigned(credit=1)
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Start()], finished=False)]


def test_a_held_start_goes_with_a_terminal() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    node.push("r1", Error(message="backend down"))
    assert to_edge(node, edge) == [
        RunEventsReceived("r1", [Start(), Error(message="backend down")], finished=True)
    ]


def test_node_streaming_to_done_when_the_terminal_goes() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    to_edge(node, edge)
    run = node.run("r1")
    assert run is not None
    node.push("r1", Complete())
    assert run.phase is RunPhase.STREAMING
    to_edge(node, edge)
    assert run.phase is RunPhase.DONE
    assert node.run("r1") is None
    with pytest.raises(InvariantError, match="not on this link"):
        node.push("r1", Delta("late"))


def test_node_assigned_to_done_on_reject() -> None:
    edge, node = assigned()
    run = node.run("r1")
    assert run is not None
    node.reject("r1", Error(message="x"))
    to_edge(node, edge)
    assert run.phase is RunPhase.DONE
    assert node.run("r1") is None


def test_node_assigned_to_ending_on_cancel() -> None:
    edge, node = assigned()
    edge.cancel("r1", CancelReason.EXPLICIT)
    to_node(edge, node)
    assert phase(node.run("r1")) is RunPhase.ENDING


def test_node_streaming_to_ending_on_cancel() -> None:
    edge, node = assigned()
    node.push("r1", Start())
    to_edge(node, edge)
    edge.cancel("r1", CancelReason.EXPLICIT)
    to_node(edge, node)
    assert phase(node.run("r1")) is RunPhase.ENDING
    # An ENDING run's non-terminal events are dropped.
    node.push("r1", Delta("dropped"))
    assert not node.has_data_to_send
    assert node.data_to_send(0) == []


def test_node_ending_to_done_when_the_terminal_goes() -> None:
    edge, node = assigned()
    edge.cancel("r1", CancelReason.EXPLICIT)
    to_node(edge, node)
    run = node.run("r1")
    assert run is not None
    node.push("r1", Cancelled(reason=CancelReason.EXPLICIT))
    [frame] = node.data_to_send(0)
    assert decode_node_batch(frame) == [
        RunEvents(run_id="r1", seq=0, events=[Cancelled(reason=CancelReason.EXPLICIT)])
    ]
    assert run.phase is RunPhase.DONE
    assert node.run("r1") is None
    assert edge.receive(frame, now=0) == []
    assert edge.run("r1") is None


def test_a_cancel_for_a_run_the_node_ended_meanwhile_is_late_not_wrong() -> None:
    edge, node = assigned()
    node.push("r1", Complete())
    late = node.data_to_send(0)
    edge.cancel("r1", CancelReason.EXPLICIT)
    [ev] = to_node(edge, node)
    assert isinstance(ev, CancelReceived)
    assert node.run("r1") is None
    for frame in late:
        assert edge.receive(frame, now=0) == []
    assert edge.run("r1") is None
    # The id is free again on both ends.
    edge.assign("r1", "sim", SPEC)
    [again] = to_node(edge, node)
    assert isinstance(again, AssignReceived)


# --- violations ----------------------------------------------------------------------


def test_events_after_the_terminal_in_one_message_are_a_protocol_error() -> None:
    edge, _ = assigned()
    with pytest.raises(LinkProtocolError, match="after the terminal"):
        edge.receive(events_frame("r1", 0, [Complete(), Delta("x")]), now=0)


def test_events_after_the_run_is_done_are_a_protocol_error() -> None:
    edge, _ = assigned()
    edge.receive(events_frame("r1", 0, [Complete()]), now=0)
    with pytest.raises(LinkProtocolError, match="not assigned"):
        edge.receive(events_frame("r1", 1, [Delta("x")]), now=0)


def test_events_after_a_cancelled_run_ended_are_a_protocol_error() -> None:
    edge, _ = assigned()
    edge.cancel("r1", CancelReason.EXPLICIT)
    edge.receive(events_frame("r1", 0, [BYE]), now=0)
    with pytest.raises(LinkProtocolError, match="not assigned"):
        edge.receive(events_frame("r1", 1, [BYE]), now=0)


def test_events_beyond_credit_are_a_protocol_error() -> None:
    edge, _ = assigned(credit=1)
    with pytest.raises(LinkProtocolError, match="2 events sent with 1 credit"):
        edge.receive(events_frame("r1", 0, [Start(), Delta("x")]), now=0)


def test_late_events_beyond_credit_are_a_protocol_error_too() -> None:
    edge, _ = assigned(credit=1)
    edge.cancel("r1", CancelReason.EXPLICIT)
    with pytest.raises(LinkProtocolError, match="credit"):
        edge.receive(events_frame("r1", 0, [Start(), Delta("x"), BYE]), now=0)


def test_events_for_a_run_never_assigned_are_a_protocol_error() -> None:
    edge, _ = open_pair()
    with pytest.raises(LinkProtocolError, match="not assigned"):
        edge.receive(events_frame("ghost", 0, [Start()]), now=0)


def test_an_events_message_out_of_sequence_is_a_protocol_error() -> None:
    edge, _ = assigned(credit=9)
    edge.receive(events_frame("r1", 0, [Start()]), now=0)
    with pytest.raises(LinkProtocolError, match="message 0, expected 1"):
        edge.receive(events_frame("r1", 0, [Delta("again")]), now=0)


def test_an_events_message_with_no_events_is_a_protocol_error() -> None:
    edge, _ = assigned()
    with pytest.raises(LinkProtocolError, match="no events"):
        edge.receive(events_frame("r1", 0, []), now=0)


def test_a_second_assign_is_refused_on_both_ends() -> None:
    edge, node = assigned()
    with pytest.raises(InvariantError, match="already assigned"):
        edge.assign("r1", "sim", SPEC)
    edge.cancel("r1", CancelReason.EXPLICIT)
    with pytest.raises(InvariantError, match="already assigned"):
        edge.assign("r1", "sim", SPEC)  # ENDING: its late events are still expected
    frame = encode_batch([encode(Assign(run_id="r1", instance="sim", spec=SPEC, credit=1))])
    with pytest.raises(LinkProtocolError, match="assigned twice"):
        node.receive(frame, now=0)


@pytest.mark.parametrize("credit", [0, -1])
def test_credit_of_zero_or_less_is_a_protocol_error(credit: int) -> None:
    _, node = assigned()
    with pytest.raises(LinkProtocolError, match="credit"):
        node.receive(encode_batch([encode(Credit(run_id="r1", credit=credit))]), now=0)


def test_an_assign_with_negative_credit_is_a_protocol_error() -> None:
    _, node = open_pair()
    frame = encode_batch([encode(Assign(run_id="r1", instance="sim", spec=SPEC, credit=-1))])
    with pytest.raises(LinkProtocolError, match="negative credit"):
        node.receive(frame, now=0)


def test_credit_for_a_run_that_ended_is_late_not_wrong() -> None:
    _, node = open_pair()
    assert node.receive(encode_batch([encode(Credit(run_id="gone", credit=3))]), now=0) == [
        CreditReceived("gone", 3)
    ]
    assert node.credit("gone") == 0


def test_the_node_driver_cannot_push_after_the_terminal() -> None:
    _, node = assigned()
    node.push("r1", Complete())
    with pytest.raises(InvariantError, match="after its terminal"):
        node.push("r1", Delta("x"))
    with pytest.raises(InvariantError, match="after its terminal"):
        node.push("r1", BYE)
    with pytest.raises(InvariantError, match="not on this link"):
        node.push("never", Start())


def test_the_edge_remembers_a_bounded_number_of_ending_runs() -> None:
    edge, _ = open_pair()
    for i in range(RELEASED_RUNS_REMEMBERED + 1):
        edge.assign(f"r{i}", "sim", SPEC, credit=1)
        edge.cancel(f"r{i}", CancelReason.EXPLICIT)
    assert edge.run("r0") is None
    assert phase(edge.run("r1")) is RunPhase.ENDING
    assert edge.receive(events_frame("r1", 0, [BYE]), now=0) == []
    with pytest.raises(LinkProtocolError, match="not assigned"):
        edge.receive(events_frame("r0", 0, [BYE]), now=0)


# --- credit and backpressure ---------------------------------------------------------


def test_run_flow_with_credit() -> None:
    edge, node = assigned(credit=2)
    for ev in (Start(), Delta("a"), Delta("b"), Delta("c")):
        node.push("r1", ev)
    assert node.credit("r1") == 2
    assert node.backlog("r1") == 2
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Start(), Delta("a")], False)]
    assert node.credit("r1") == 0
    assert node.backlog("r1") == 2
    assert node.data_to_send(0) == []  # nothing sendable without credit
    assert edge.consumed("r1", 2)
    assert to_node(edge, node) == [CreditReceived("r1", 2)]
    assert node.credit("r1") == 2
    node.push("r1", Complete())  # the terminal needs no credit
    assert to_edge(node, edge) == [
        RunEventsReceived("r1", [Delta("b"), Delta("c"), Complete()], finished=True)
    ]
    assert edge.runs == frozenset()
    assert not edge.consumed("r1", 5)


def test_backlog_grows_past_credit() -> None:
    _, node = assigned(credit=3)
    for i in range(10):
        node.push("r1", Delta(str(i)))
        assert node.backlog("r1") == max(0, i + 1 - 3)
    node.data_to_send(0)
    assert node.backlog("r1") == 7
    assert node.credit("r1") == 0
    assert node.backlog("never") == 0


def test_credit_makes_queued_events_sendable() -> None:
    edge, node = assigned(credit=2)
    for i in range(5):
        node.push("r1", Delta(str(i)))
    to_edge(node, edge)
    assert not node.has_data_to_send
    assert edge.consumed("r1", 2)
    assert to_node(edge, node) == [CreditReceived("r1", 2)]
    assert node.has_data_to_send
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Delta("2"), Delta("3")], False)]
    assert node.backlog("r1") == 1


def test_credit_returns_at_half_a_window_consumed() -> None:
    edge, node = assigned(credit=8)
    for _ in range(8):
        node.push("r1", Delta("x"))
    to_edge(node, edge)
    assert not edge.consumed("r1", 3)
    assert not edge.consumed("r1", 0)
    assert not edge.has_data_to_send
    assert edge.consumed("r1", 1)
    assert edge.consumed("r1", 4)
    [frame] = edge.data_to_send(0)
    assert decode_edge_batch(frame) == [
        Credit(run_id="r1", credit=4),
        Credit(run_id="r1", credit=4),
    ]
    run = edge.run("r1")
    assert run is not None
    assert run.credit == 8


def test_a_terminal_cancelled_drops_events_its_credit_does_not_cover() -> None:
    edge, node = assigned(credit=2)
    for i in range(5):
        node.push("r1", Delta(str(i)))
    node.push("r1", Cancelled(reason=CancelReason.IDLE_TIMEOUT))
    assert node.backlog("r1") == 1  # the two covered and the terminal
    assert to_edge(node, edge) == [
        RunEventsReceived(
            "r1", [Delta("0"), Delta("1"), Cancelled(reason=CancelReason.IDLE_TIMEOUT)], True
        )
    ]
    assert node.run("r1") is None


def test_other_terminals_wait_for_credit_behind_their_events() -> None:
    edge, node = assigned(credit=1)
    for ev in (Delta("0"), Delta("1"), Complete()):
        node.push("r1", ev)
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Delta("0")], False)]
    edge.consumed("r1", 1)
    to_node(edge, node)
    assert to_edge(node, edge) == [RunEventsReceived("r1", [Delta("1"), Complete()], True)]


def test_cancel_drops_queued_non_terminals_but_keeps_the_terminal() -> None:
    edge, node = assigned(credit=1)
    node.push("r1", Delta("0"))
    node.push("r1", Delta("1"))
    node.push("r1", Error(message="boom"))
    edge.cancel("r1", CancelReason.EXPLICIT)
    to_node(edge, node)
    run = node.run("r1")
    assert run is not None
    assert list(run.queued) == [Error(message="boom")]
    [frame] = node.data_to_send(0)
    assert decode_node_batch(frame) == [
        RunEvents(run_id="r1", seq=0, events=[Error(message="boom")])
    ]
    assert edge.receive(frame, now=0) == []


def test_a_terminal_waiting_for_credit_goes_once_cancel_drops_the_events_before_it() -> None:
    """The node ended the run while its last events waited for credit; the
    cancel drops those events, so the terminal is next and must go out (or
    the run is never DONE on either end)."""
    edge, node = assigned(credit=1)
    for ev in (Start(), Delta("waits for credit"), Complete()):
        node.push("r1", ev)
    to_edge(node, edge)
    edge.cancel("r1", CancelReason.CLIENT_DISCONNECT)
    to_node(edge, node)
    assert node.has_data_to_send
    [frame] = node.data_to_send(0)
    assert decode_node_batch(frame) == [RunEvents(run_id="r1", seq=1, events=[Complete()])]
    assert node.run("r1") is None
    assert edge.receive(frame, now=0) == []
    assert edge.run("r1") is None


def test_cancel_drops_queued_events_beyond_credit_too() -> None:
    edge, node = assigned(credit=0)
    node.push("r1", Start())
    edge.cancel("r1", CancelReason.EXPLICIT)
    to_node(edge, node)
    assert node.backlog("r1") == 0
    assert not node.data_to_send(0)


def test_the_terminal_needs_no_credit() -> None:
    edge, node = assigned(credit=0)
    node.push("r1", Start())
    assert node.data_to_send(0) == []
    cancelled = Cancelled(reason=CancelReason.IDLE_TIMEOUT)
    node.push("r1", cancelled)
    assert to_edge(node, edge) == [RunEventsReceived("r1", [cancelled], finished=True)]


@settings(max_examples=200, deadline=None)
@given(
    plan=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=20),
    window=st.integers(0, 8),
)
def test_credit_never_exceeded_by_a_well_behaved_node(
    plan: list[tuple[int, int]], window: int
) -> None:
    """A node that pushes any number of events and an edge that returns what its
    consumer took never trip the protocol, the edge's buffer never holds more
    than the window, and the node's queue holds exactly what did not go."""
    edge, node = assigned(credit=window)
    buffered = pushed = received = 0
    for push, take in plan:
        for _ in range(push):
            node.push("r1", Delta("x"))
        pushed += push
        for ev in to_edge(node, edge):
            assert isinstance(ev, RunEventsReceived)
            buffered += len(ev.events)
            received += len(ev.events)
        assert buffered <= window
        assert node.backlog("r1") == pushed - received
        assert node.credit("r1") == 0 or pushed == received
        took = min(take, buffered)
        buffered -= took
        edge.consumed("r1", took)
        to_node(edge, node)


# --- batching into frames ------------------------------------------------------------


def test_one_frame_carries_every_run_and_control_message() -> None:
    edge, node = open_pair()
    for r in ("a", "b", "c"):
        edge.assign(r, "sim", SPEC, credit=8)
    edge.tick(10.0)  # nothing sent for heartbeat_timeout_s, but three assigns queued
    [frame] = edge.data_to_send(0)
    msgs = decode_edge_batch(frame)
    assert [type(m) for m in msgs] == [Assign, Assign, Assign]
    to_node_events: list[NodeLinkEvent] = node.receive(frame, now=0)
    assert [ev.assign.run_id for ev in to_node_events if isinstance(ev, AssignReceived)] == [
        "a",
        "b",
        "c",
    ]
    # The node queues events of three runs, interleaved, and control messages.
    node.push("a", Start())
    node.push("b", Start())
    node.push("a", Delta("a1"))
    node.capabilities([CAPS])
    node.push("c", Error(message="no"))
    node.push("b", Delta("b1"))
    node.push("a", Complete())
    node.goodbye("draining")
    frames = node.data_to_send(0)
    assert len(frames) == 1
    got = edge.receive(frames[0], now=0)
    assert CapabilitiesChanged([CAPS]) in got
    assert NodeDraining("draining") in got
    # Sorted: they come in the order each run had something to send (b's Start
    # waited for b1).
    runs = sorted((ev for ev in got if isinstance(ev, RunEventsReceived)), key=lambda e: e.run_id)
    assert runs == [
        RunEventsReceived("a", [Start(), Delta("a1"), Complete()], True),
        RunEventsReceived("b", [Start(), Delta("b1")], False),
        RunEventsReceived("c", [Error(message="no")], True),
    ]
    assert edge.runs == frozenset({"b"})
    assert node.data_to_send(0) == []


def test_edge_control_messages_of_many_runs_share_one_frame() -> None:
    edge, node = open_pair()
    for r in ("a", "b"):
        edge.assign(r, "sim", SPEC, credit=2)
    to_node(edge, node)
    for r in ("a", "b"):
        node.push(r, Start())
        node.push(r, Delta("x"))
    to_edge(node, edge)
    edge.consumed("a", 1)
    edge.cancel("b", CancelReason.EXPLICIT)
    edge.assign("c", "sim", SPEC)
    edge.tick(10.0)  # long silent, but it has something to say: no ping
    [frame] = edge.data_to_send(10.0)
    assert [type(m) for m in decode_edge_batch(frame)] == [Credit, Cancel, Assign]


def test_a_batch_larger_than_a_frame_is_split_in_order() -> None:
    node = NodeSession(node_id="n1", token="t0k", now=0)
    edge = EdgeSession(
        tokens=["t0k"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0,
        max_frame_bytes=600,
    )
    open_pair(edge, node)
    edge.assign("r1", "sim", SPEC, credit=100)
    to_node(edge, node)
    sent = [Delta(f"{i:03}" + "x" * 50) for i in range(40)]
    for ev in sent:
        node.push("r1", ev)
    frames = node.data_to_send(0)
    assert len(frames) > 3
    assert all(len(f) <= 600 for f in frames)
    got: list[RuntimeEvent] = []
    for f in frames:
        for ev in edge.receive(f, now=0):
            assert isinstance(ev, RunEventsReceived)
            got += ev.events
    assert got == sent


def test_an_event_too_large_for_the_edge_ends_its_run_alone() -> None:
    edge = EdgeSession(
        tokens=["t0k"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0,
        max_frame_bytes=1000,
    )
    node = NodeSession(node_id="n1", token="t0k", now=0)
    open_pair(edge, node)
    edge.assign("big", "sim", SPEC, credit=10)
    edge.assign("ok", "sim", SPEC, credit=10)
    to_node(edge, node)
    node.push("big", Start())
    node.push("big", Delta("x" * 2000))
    node.push("big", Delta("never sent"))
    node.push("ok", Delta("fine"))
    frames = node.data_to_send(0)
    assert node.take_cut_off() == ["big"]
    assert node.take_cut_off() == []
    assert node.run("big") is None
    got: list[EdgeLinkEvent] = []
    for f in frames:
        assert len(f) <= 1000
        got += edge.receive(f, now=0)
    big = [ev for ev in got if isinstance(ev, RunEventsReceived) and ev.run_id == "big"]
    events_of_big = [e for ev in big for e in ev.events]
    assert events_of_big[0] == Start()
    last = events_of_big[-1]
    assert isinstance(last, Error)
    assert (last.code, last.status) == ("event_too_large", 502)
    assert big[-1].finished
    assert RunEventsReceived("ok", [Delta("fine")], False) in got
    assert edge.run("big") is None
    assert edge.runs == frozenset({"ok"})
    assert edge.state is LinkState.OPEN


@settings(max_examples=150, deadline=None)
@given(
    limit=st.integers(MIN_PEER_FRAME_BYTES, 5000),
    pushes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1500), st.booleans()), max_size=40),
)
def test_frames_never_exceed_the_peer_limit_and_keep_each_runs_order(
    limit: int, pushes: list[tuple[int, int, bool]]
) -> None:
    """Whatever the event sizes and the edge's limit, every frame fits, each run's
    events arrive in order across frames, and only an event that cannot fit
    ends its run (with ``event_too_large``)."""
    edge = EdgeSession(
        tokens=["t0k"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0,
        max_frame_bytes=limit,
    )
    node = NodeSession(node_id="n1", token="t0k", now=0)
    open_pair(edge, node)
    runs = ["r0", "r1", "r2"]
    for r in runs:
        edge.assign(r, "sim", SPEC, credit=1000)
    to_node(edge, node)
    pushed: dict[str, list[RuntimeEvent]] = {r: [] for r in runs}
    got: dict[str, list[RuntimeEvent]] = {r: [] for r in runs}
    cut: set[str] = set()
    for which, size, flush in pushes:
        r = runs[which]
        if node.run(r) is not None:
            ev = Delta("y" * size)
            node.push(r, ev)
            pushed[r].append(ev)
        if flush:
            node.capabilities([CAPS])
            for f in node.data_to_send(0):
                assert len(f) <= limit
                for ev in edge.receive(f, now=0):
                    if isinstance(ev, RunEventsReceived):
                        got[ev.run_id] += ev.events
            cut.update(node.take_cut_off())
    for r in runs:
        events = got[r]
        if r in cut:
            last = events[-1]
            assert isinstance(last, Error)
            assert last.code == "event_too_large"
            assert pushed[r][: len(events) - 1] == events[:-1]
            big = pushed[r][len(events) - 1]
            # Cut only when it could not fit beside a generous envelope
            # (the session's ``_EVENTS_MESSAGE_OVERHEAD``, 64 bytes).
            assert len(msgspec.msgpack.encode(big)) > limit - 5 - 64 - len(r)
        else:
            assert events == pushed[r][: len(events)]
            assert not any(is_terminal(e) for e in events)


# --- heartbeats and liveness ---------------------------------------------------------


def pings(frames: list[bytes], decode: object = decode_edge_batch) -> list[int]:
    out = []
    for f in frames:
        for m in decode(f):  # type: ignore[operator]
            if isinstance(m, Ping):
                out.append(m.nonce)
    return out


def test_the_edge_pings_only_after_heartbeat_timeout_s_of_sending_nothing() -> None:
    edge, _ = open_pair()
    assert edge.next_ping_at == 1.5
    edge.tick(1.49)
    assert edge.data_to_send(1.49) == []
    edge.tick(1.5)
    assert pings(edge.data_to_send(1.5)) == [1]
    edge.tick(2.9)  # one ping per timeout of silence
    assert edge.data_to_send(2.9) == []
    edge.tick(3.0)
    assert pings(edge.data_to_send(3.0)) == [2]


def test_the_edge_does_not_ping_while_it_sends() -> None:
    """Credit to a streaming node proves the edge alive: no heartbeat."""
    edge, node = open_pair()
    edge.assign("r1", "sim", SPEC, credit=4)
    to_node(edge, node)
    t = 0.0
    for _ in range(50):
        t += 0.3
        node.push("r1", Delta("x"))
        node.push("r1", Delta("y"))
        to_edge(node, edge, now=t)
        assert edge.consumed("r1", 2)
        edge.tick(t)
        assert pings(edge.data_to_send(t)) == []


def test_the_edge_pings_a_node_it_hears_from_but_sends_nothing_to() -> None:
    # A node streaming to a slow client gets no credit: it must still hear
    # from the edge before its own (longer) deadline.
    edge, node = assigned(credit=10_000)
    for step in range(1, 41):
        t = step / 10
        node.push("r1", Delta("x"))
        to_edge(node, edge, now=t)
        edge.tick(t)
        to_node(edge, node, now=t)
        assert t < node.liveness_deadline
    assert node.liveness_deadline - 4.0 > 1.5 * EDGE_SILENCE_FACTOR - 1.5


def test_the_node_pings_after_heartbeat_interval_s_of_sending_nothing() -> None:
    _, node = open_pair()
    assert node.next_ping_at == pytest.approx(0.5)
    node.tick(0.49)
    assert node.data_to_send(0.49) == []
    node.tick(0.5)
    assert pings(node.data_to_send(0.5), decode_node_batch) == [1]
    node.tick(0.9)
    assert node.data_to_send(0.9) == []
    node.tick(1.0)
    assert pings(node.data_to_send(1.0), decode_node_batch) == [2]


def test_the_node_does_not_ping_before_it_is_welcomed() -> None:
    node = NodeSession(node_id="n1", token="t0k", now=0)
    node.tick(100.0)
    assert node.data_to_send(100.0) == []
    edge, _ = pair()
    edge.tick(100.0)
    assert edge.data_to_send(100.0) == []


def test_an_idle_link_costs_one_ping_per_interval_from_the_node_and_per_timeout_from_the_edge() -> (
    None
):
    edge, node = open_pair()
    edge_pings = node_pings = 0
    for step in range(1, 201):
        t = step / 20
        edge.tick(t)
        node.tick(t)
        for f in edge.data_to_send(t):
            edge_pings += len(pings([f]))
            node.receive(f, t)
        for f in node.data_to_send(t):
            node_pings += len(pings([f], decode_node_batch))
            edge.receive(f, t)
        assert edge.liveness_deadline > t
        assert node.liveness_deadline > t
    assert node_pings == 20  # 10 s / heartbeat_interval_s
    assert edge_pings == 6  # 10 s / heartbeat_timeout_s
    assert not edge.has_data_to_send  # a ping is never answered
    assert not node.has_data_to_send


def test_a_ping_proves_its_sender_alive_and_the_edge_never_answers_one() -> None:
    edge, node = open_pair()
    node.tick(0.5)
    [ping] = node.data_to_send(0.5)
    assert decode_node_batch(ping) == [Ping(nonce=1)]
    assert edge.receive(ping, now=0.6) == []
    assert edge.liveness_deadline == pytest.approx(0.6 + 1.5)
    assert not edge.has_data_to_send
    edge.tick(1.5)
    [ping2] = edge.data_to_send(1.5)
    assert decode_edge_batch(ping2) == [Ping(nonce=1)]
    # The node sent its ping 0.1 s ago (less than half its interval): no answer.
    assert node.receive(ping2, now=0.6) == []
    assert node.liveness_deadline == pytest.approx(0.6 + 1.5 * EDGE_SILENCE_FACTOR)
    assert not node.has_data_to_send


def test_the_node_gets_in_step_with_the_edges_pings() -> None:
    """The edge pings all its quiet links in one sweep (``EdgeSession.sweep``).
    A node that sent nothing for a quarter of its interval answers at once,
    one that did pings next an interval after the edge's ping: either way its
    frames follow the sweeps, and so reach the edge together with the other
    nodes'."""
    edge, node = open_pair()
    node.tick(0.5)
    node.data_to_send(0.5)
    edge.sweep(0.75)
    # Sent 0.1 s ago (< 0.125): no answer, but the next ping follows the edge's.
    assert node.receive(edge.data_to_send(0.75)[0], now=0.6) == []
    assert not node.has_data_to_send
    assert node.next_ping_at == pytest.approx(0.6 + 0.5)
    node.tick(1.0)
    assert not node.has_data_to_send
    node.tick(1.1)
    assert pings(node.data_to_send(1.1), decode_node_batch) == [2]
    assert node.next_ping_at == pytest.approx(1.6)


def test_the_node_answers_an_edge_ping_if_it_sent_nothing_for_a_quarter_interval() -> None:
    edge, node = open_pair()
    node.tick(0.5)
    node.data_to_send(0.5)
    edge.sweep(0.8)  # quiet since the welcome at 0
    assert node.receive(edge.data_to_send(0.8)[0], now=0.8) == []
    assert pings(node.data_to_send(0.8), decode_node_batch) == [2]
    assert node.next_ping_at == pytest.approx(0.8 + 0.5)
    # Something queued already proves the node alive: no separate answer.
    edge.sweep(2.0)
    node.capabilities([CAPS])
    node.receive(edge.data_to_send(2.0)[0], now=2.0)
    assert [type(m) for f in node.data_to_send(2.0) for m in decode_node_batch(f)] == [
        CapabilitiesUpdate
    ]
    # Not before the welcome.
    fresh = NodeSession(node_id="n2", token="t0k", now=0.0)
    with pytest.raises(LinkProtocolError):
        fresh.receive(encode_batch([encode(Ping(nonce=1))]), now=1.0)
    assert not fresh.has_data_to_send


def test_an_edge_sweep_pings_a_node_it_sent_nothing_to_for_half_its_timeout() -> None:
    """The sweeps come every ``heartbeat_timeout_s`` (``iop.runtime.LinkClock``):
    a link its previous sweep pinged is pinged again, one that had anything
    else within half the timeout is not (the node has heard from the edge
    within 1.5 timeouts, well inside its 2)."""
    edge, _ = open_pair()
    edge.sweep(0.74)
    assert not edge.has_data_to_send  # the welcome went 0.74 s ago (< 0.75)
    edge.sweep(0.75)
    assert pings(edge.data_to_send(0.76)) == [1]
    edge.sweep(2.25)  # the previous sweep's ping went a whisker less than 1.5 s ago
    assert pings(edge.data_to_send(2.25)) == [2]
    edge.assign("r1", "sim", SPEC)
    edge.sweep(4.0)  # something queued: no ping
    assert [type(m) for f in edge.data_to_send(4.0) for m in decode_edge_batch(f)] == [Assign]
    pending, _ = pair()
    pending.sweep(100.0)  # not before the hello
    assert not pending.has_data_to_send


def test_the_liveness_deadline_moves_with_every_frame() -> None:
    edge, node = assigned(credit=100)
    assert edge.liveness_deadline == 1.5
    assert node.liveness_deadline == 1.5 * EDGE_SILENCE_FACTOR
    for t in (0.4, 1.2, 2.5):
        node.push("r1", Delta("x"))
        to_edge(node, edge, now=t)
        assert edge.liveness_deadline == pytest.approx(t + 1.5)
        assert node.next_ping_at == pytest.approx(t + 0.5)
        edge.consumed("r1", 50)
        to_node(edge, node, now=t + 0.1)
        assert node.liveness_deadline == pytest.approx(t + 0.1 + 1.5 * EDGE_SILENCE_FACTOR)
        assert edge.next_ping_at == pytest.approx(t + 0.1 + 1.5)
    # Control messages count too.
    edge.receive(encode_batch([encode(Ping(nonce=5))]), now=3.0)
    assert edge.liveness_deadline == pytest.approx(4.5)


def test_capabilities_update_and_goodbye() -> None:
    edge, node = open_pair()
    node.capabilities([CAPS])
    assert to_edge(node, edge) == [CapabilitiesChanged([CAPS])]
    node.goodbye("draining")
    assert to_edge(node, edge) == [NodeDraining("draining")]


@settings(max_examples=200, deadline=None)
@given(
    interval=st.floats(0.01, 100.0),
    factor=st.floats(1.001, 10.0),
)
def test_each_side_pings_well_before_the_other_loses_it(interval: float, factor: float) -> None:
    """Whatever valid heartbeat settings: a quiet side's ping is due before the
    peer's deadline for it (the edge's ping by a whole ping interval)."""
    edge = EdgeSession(
        tokens=["t0k"],
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=interval * factor,
        now=0,
    )
    node = NodeSession(node_id="n1", token="t0k", now=0)
    open_pair(edge, node)
    assert node.next_ping_at < edge.liveness_deadline
    assert edge.next_ping_at * 2 <= node.liveness_deadline


@pytest.mark.parametrize("limit", [-1, 1, MIN_PEER_FRAME_BYTES - 1])
def test_a_peer_announcing_a_frame_limit_too_small_to_end_a_run_is_refused(limit: int) -> None:
    """Below ``MIN_PEER_FRAME_BYTES`` not even the ``event_too_large`` error fits."""
    edge = EdgeSession(tokens=["t0k"], heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5, now=0.0)
    node = NodeSession(node_id="n1", token="t0k", now=0.0, max_frame_bytes=limit)
    with pytest.raises(LinkProtocolError, match="max_frame_bytes"):
        edge.receive(node.hello([]), now=0.0)
    node = NodeSession(node_id="n1", token="t0k", now=0.0)
    welcome = Welcome(
        protocol_version=PROTOCOL_VERSION,
        node_id="n1",
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        max_frame_bytes=limit,
    )
    with pytest.raises(LinkProtocolError, match="negative limit"):
        node.receive(encode(welcome), now=0.0)


def test_an_assign_with_negative_credit_is_a_bug_of_the_caller() -> None:
    """The node would close the whole link for it: the edge refuses to send it."""
    edge, _ = open_pair()
    with pytest.raises(InvariantError, match="negative credit"):
        edge.assign("r1", "sim", SPEC, credit=-1)
    assert not edge.has_data_to_send


# --- collected runs (Assign.collect) ----------------------------------------------


def collected(credit: int = 64) -> tuple[EdgeSession, NodeSession]:
    edge, node = open_pair()
    edge.assign("r1", "sim", SPEC, credit=credit, collect=True)
    [ev] = to_node(edge, node)
    assert isinstance(ev, AssignReceived)
    assert ev.assign.collect
    return edge, node


def test_a_collected_run_sends_its_first_output_at_once_and_the_rest_merged_at_its_end() -> None:
    """The first output goes at once (the edge's first-token deadline measures
    the backend); what follows is held and merged until the end."""
    edge, node = collected()
    node.push("r1", Start())
    assert not node.has_data_to_send
    node.push("r1", Delta("t0 "))
    [first] = to_edge(node, edge)
    assert isinstance(first, RunEventsReceived)
    assert first.events == [Start(), Delta("t0 ")]
    for i in range(1, 50):
        node.push("r1", Delta(f"t{i} "))
    assert not node.has_data_to_send  # held: nobody reads it before the end
    node.push("r1", Complete(finish_reason="stop"))
    frames = node.data_to_send(0.0)
    assert len(frames) == 1
    [got] = to_edge_frames(frames, edge)
    assert got.finished
    assert got.events == [
        Delta("".join(f"t{i} " for i in range(1, 50))),
        Complete(finish_reason="stop"),
    ]
    assert node.run("r1") is None
    assert edge.run("r1") is None


def test_a_collected_run_flushes_what_it_holds_between_one_and_two_intervals() -> None:
    """The edge's idle deadline must still see the run progress."""
    edge, node = collected()
    node.tick(0.0)  # a flush check: nothing held yet
    node.push("r1", Start())
    node.push("r1", Delta("a"))  # the first output: at once
    to_edge(node, edge)
    node.push("r1", Delta("b"))
    assert node.next_tick_at == min(node.next_ping_at, COLLECT_FLUSH_S)
    node.tick(COLLECT_FLUSH_S)  # held since after the last check: not yet
    assert run_events(to_edge(node, edge, COLLECT_FLUSH_S)) == []  # (a ping, maybe)
    node.tick(2 * COLLECT_FLUSH_S)
    [got] = run_events(to_edge(node, edge, 2 * COLLECT_FLUSH_S))
    assert got.events == [Delta("b")]
    assert node.next_tick_at == node.next_ping_at  # nothing held any more


def test_the_edge_can_shorten_the_hold_of_a_collected_run() -> None:
    edge, node = open_pair()
    edge.assign("r1", "sim", SPEC, credit=64, collect=True, collect_flush_s=0.125)
    to_node(edge, node)
    node.tick(0.0)
    node.push("r1", Start())
    node.push("r1", Delta("a"))
    to_edge(node, edge)
    node.push("r1", Delta("b"))
    node.tick(0.125)
    node.tick(0.25)
    [got] = run_events(to_edge(node, edge, 0.25))
    assert got.events == [Delta("b")]


def test_collected_text_is_merged_up_to_a_bound_and_never_across_kinds() -> None:
    edge, node = collected()
    node.push("r1", Start())
    node.push("r1", Delta("first"))
    to_edge(node, edge)
    piece = "x" * 1000
    for _ in range(5):
        node.push("r1", Delta(piece))
    node.push("r1", ReasoningDelta("why"))
    node.push("r1", ReasoningDelta(" so"))
    node.push("r1", Delta("end"))
    node.push("r1", Complete())
    [got] = to_edge(node, edge)
    assert isinstance(got, RunEventsReceived)
    deltas = [e for e in got.events if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas[:-1]) == piece * 5
    assert all(len(d.text) < COLLECT_MERGE_CHARS + len(piece) for d in deltas)
    # Merged while under the bound: 3000 chars, then 2000; "end" comes after
    # the reasoning, so it is not merged into the text before it.
    assert [len(d.text) for d in deltas] == [3000, 2000, 3]
    assert [e for e in got.events if isinstance(e, ReasoningDelta)] == [ReasoningDelta("why so")]


def test_a_collected_run_sends_at_once_what_fills_its_credit() -> None:
    """Held events never wait for a flush when they could not all be held
    within the run's credit (embeddings: one event per input)."""
    edge, node = collected(credit=4)
    node.push("r1", Start())
    node.push("r1", EmbeddingData(index=0, vector=b"\0\0\0\0"))  # the first output: at once
    to_edge(node, edge)
    node.push("r1", EmbeddingData(index=1, vector=b"\0\0\0\0"))
    assert not node.has_data_to_send
    node.push("r1", EmbeddingData(index=2, vector=b"\0\0\0\0"))
    [got] = to_edge(node, edge)
    assert isinstance(got, RunEventsReceived)
    assert len(got.events) == 2


def to_edge_frames(frames: list[bytes], edge: EdgeSession) -> list[RunEventsReceived]:
    got: list[RunEventsReceived] = []
    for frame in frames:
        got += [e for e in edge.receive(frame, 0.0) if isinstance(e, RunEventsReceived)]
    return got


def run_events(events: list[EdgeLinkEvent]) -> list[RunEventsReceived]:
    return [e for e in events if isinstance(e, RunEventsReceived)]
