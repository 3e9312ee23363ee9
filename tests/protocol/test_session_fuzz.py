"""Link session fuzzing: hypothesis over the sans-IO ``EdgeSession`` and ``NodeSession``.

Two properties (docs/protocol.md "Session"):

* **Hostile frames.** Random bytes, truncated and bit-flipped valid frames,
  and valid frames in random order fed to either side only ever raise the
  documented ``LinkError`` subclasses (``LinkAuthError``,
  ``LinkProtocolError`` and its ``LinkLimitError``), never anything else, and
  the session's invariants hold after every frame it accepted.
* **Honest peers, any interleaving.** An edge and a node that follow the
  protocol (assign, grant what was consumed, cancel at any time; send within
  credit, end each run once) with their frames in flight in two FIFO queues
  delivered in any interleaving never trip either session, and every run ends
  exactly once on the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.capabilities import Capabilities
from iop.errors import LinkAuthError, LinkError, LinkProtocolError
from iop.events import Cancelled, CancelReason, Complete, Delta, Start, is_terminal
from iop.protocol import (
    PROTOCOL_VERSION,
    Assign,
    Cancel,
    CapabilitiesUpdate,
    Credit,
    EdgeSession,
    Goodbye,
    Hello,
    LinkState,
    NodeSession,
    Ping,
    Pong,
    RunEvents,
    RunEventsReceived,
    Welcome,
    encode,
)
from iop.protocol._session import RELEASED_RUNS_REMEMBERED
from iop.spec import ChatRequest, ExecutionSpec, Message

TOKEN = "t0k"
SPEC = ExecutionSpec(
    run_id="r0", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))
RUN_IDS = ["r0", "r1", "r2"]

# Valid frames of each direction, the raw material of the hostile strategies.
NODE_FRAMES = [
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token=TOKEN, instances=[CAPS])),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token="bad")),
    encode(Hello(protocol_version=PROTOCOL_VERSION + 1, node_id="n1", token=TOKEN)),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="", token=TOKEN)),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token=TOKEN, max_frame_bytes=-1)),
    encode(CapabilitiesUpdate(instances=[CAPS])),
    encode(Pong(nonce=1)),
    encode(Goodbye(reason="bye")),
    *[
        encode(RunEvents(run_id=r, seq=seq, events=evs))
        for r in RUN_IDS
        for seq in (0, 1, 2)
        for evs in (
            [Start()],
            [Delta("x"), Delta("y")],
            [Complete()],
            [Delta("z"), Cancelled(reason=CancelReason.CLIENT_DISCONNECT)],
            [Complete(), Delta("after")],
            [],
        )
    ],
]
EDGE_FRAMES = [
    encode(
        Welcome(protocol_version=1, node_id="n1", heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5)
    ),
    encode(
        Welcome(protocol_version=1, node_id="n1", heartbeat_interval_s=0.5, heartbeat_timeout_s=-1)
    ),
    *[
        encode(Assign(run_id=r, instance="sim", spec=SPEC, credit=c))
        for r in RUN_IDS
        for c in (0, 3, -1)
    ],
    *[encode(Credit(run_id=r, credit=c)) for r in RUN_IDS for c in (1, 0, -2)],
    *[encode(Cancel(run_id=r, reason=CancelReason.EXPLICIT)) for r in RUN_IDS],
    encode(Ping(nonce=7)),
]


def _mutated(pool: list[bytes]) -> st.SearchStrategy[bytes]:
    valid = st.sampled_from(pool)
    truncated = st.tuples(valid, st.integers(0, 400)).map(lambda t: t[0][: t[1]])
    flipped = st.tuples(valid, st.integers(0, 10_000), st.integers(1, 255)).map(
        lambda t: (
            t[0][: t[1] % len(t[0])]
            + bytes([t[0][t[1] % len(t[0])] ^ t[2]])
            + t[0][t[1] % len(t[0]) + 1 :]
            if t[0]
            else t[0]
        )
    )
    return st.one_of(valid, truncated, flipped, st.binary(max_size=200))


def _edge() -> EdgeSession:
    return EdgeSession(
        tokens=[TOKEN],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0.0,
        max_hello_bytes=2048,
        max_frame_bytes=4096,
    )


def _check_edge(edge: EdgeSession) -> None:
    assert edge.state in (LinkState.AWAIT_HELLO, LinkState.OPEN)
    assert (edge.node_id != "") == (edge.state is LinkState.OPEN)
    assert all(run.credit >= 0 for run in edge._runs.values())
    assert all(run.credit >= 0 for run in edge._released.values())
    assert not set(edge._runs) & set(edge._released)
    assert len(edge._released) <= RELEASED_RUNS_REMEMBERED


@settings(max_examples=400, deadline=None)
@given(
    frames=st.lists(_mutated(NODE_FRAMES), max_size=25),
    actions=st.lists(
        st.tuples(
            st.sampled_from(["assign", "grant", "cancel"]),
            st.sampled_from(RUN_IDS),
            st.integers(0, 4),
        ),
        max_size=10,
    ),
)
def test_hostile_frames_only_raise_link_errors_at_the_edge(
    frames: list[bytes], actions: list[tuple[str, str, int]]
) -> None:
    edge = _edge()
    pending = list(actions)
    finished: set[str] = set()
    for i, frame in enumerate(frames):
        if edge.state is LinkState.OPEN and pending:
            what, run_id, n = pending.pop()
            if what == "assign" and run_id not in edge.runs and run_id not in edge._released:
                edge.assign(run_id, "sim", SPEC, credit=n)
                finished.discard(run_id)
            elif what == "grant":
                edge.grant(run_id, n)
            elif what == "cancel":
                edge.cancel(run_id, CancelReason.EXPLICIT)
        try:
            event, _ = edge.receive(frame, now=float(i))
        except (LinkAuthError, LinkProtocolError):
            return  # the driver closes the link: nothing more is read
        _check_edge(edge)
        if isinstance(event, RunEventsReceived) and event.events:
            assert event.run_id not in finished
            assert sum(is_terminal(e) for e in event.events) <= 1
            if event.finished:
                finished.add(event.run_id)


@settings(max_examples=400, deadline=None)
@given(frames=st.lists(_mutated(EDGE_FRAMES), max_size=25))
def test_hostile_frames_only_raise_link_errors_at_the_node(frames: list[bytes]) -> None:
    node = NodeSession(node_id="n1", token=TOKEN, now=0.0, max_frame_bytes=4096)
    for i, frame in enumerate(frames):
        try:
            node.receive(frame, now=float(i))
        except LinkProtocolError:
            return
        assert all(node.credit(r) >= 0 for r in RUN_IDS)
        assert node.heartbeat_timeout_s > 0


# --- honest peers, any interleaving ------------------------------------------------


@dataclass
class _Model:
    edge: EdgeSession
    node: NodeSession
    to_node: list[bytes] = field(default_factory=list)
    to_edge: list[bytes] = field(default_factory=list)
    next_run: int = 0
    # Edge side: runs it assigned and still wants, events it holds unconsumed.
    wanted: dict[str, int] = field(default_factory=dict)
    ended: dict[str, int] = field(default_factory=dict)
    # Node side: runs it is executing.
    running: set[str] = field(default_factory=set)
    now: float = 0.0


def _open_model() -> _Model:
    edge = EdgeSession(
        tokens=[TOKEN],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0.0,
        control_burst=10_000,
    )
    node = NodeSession(node_id="n1", token=TOKEN, now=0.0)
    _, welcome = edge.receive(node.hello([CAPS]), now=0.0)
    assert welcome is not None
    node.receive(welcome, now=0.0)
    return _Model(edge, node)


def _step(m: _Model, action: str, pick: int) -> None:
    m.now += 0.01
    if action == "assign":
        run_id = f"r{m.next_run}"
        m.next_run += 1
        m.to_node.append(m.edge.assign(run_id, "sim", SPEC, credit=1 + pick % 4))
        m.wanted[run_id] = 0
        m.ended[run_id] = 0
    elif action == "consume" and m.wanted:
        run_id = sorted(m.wanted)[pick % len(m.wanted)]
        took, m.wanted[run_id] = m.wanted[run_id], 0
        grant = m.edge.grant(run_id, took)
        if grant is not None:
            m.to_node.append(grant)
    elif action == "cancel" and m.wanted:
        run_id = sorted(m.wanted)[pick % len(m.wanted)]
        del m.wanted[run_id]
        frame = m.edge.cancel(run_id, CancelReason.CLIENT_DISCONNECT)
        if frame is not None:
            m.to_node.append(frame)
    elif action == "ping":
        m.to_node.append(m.edge.ping())
    elif action == "caps":
        m.to_edge.append(m.node.capabilities([CAPS]))
    elif action == "produce" and m.running:
        run_id = sorted(m.running)[pick % len(m.running)]
        n = min(1 + pick % 3, m.node.credit(run_id))
        events: list[object] = [Delta("t")] * n
        if pick % 5 == 0:
            events.append(Complete())
            m.running.discard(run_id)
        if events:
            m.to_edge.append(m.node.run_events(run_id, events))  # type: ignore[arg-type]
    elif action == "to_node" and m.to_node:
        ev = m.node.receive(m.to_node.pop(0), now=m.now)
        if type(ev).__name__ == "AssignReceived":
            m.running.add(ev.assign.run_id)  # type: ignore[union-attr]
        elif type(ev).__name__ == "CancelReceived":
            run_id = ev.cancel.run_id  # type: ignore[union-attr]
            if run_id in m.running:
                m.running.discard(run_id)
                m.to_edge.append(
                    m.node.run_events(run_id, [Cancelled(reason=CancelReason.CLIENT_DISCONNECT)])
                )
        elif type(ev).__name__ == "PingReceived":
            m.to_edge.append(ev.reply)  # type: ignore[union-attr]
    elif action == "to_edge" and m.to_edge:
        event, _ = m.edge.receive(m.to_edge.pop(0), now=m.now)
        if isinstance(event, RunEventsReceived) and event.events:
            assert event.run_id in m.wanted
            m.wanted[event.run_id] += sum(not is_terminal(e) for e in event.events)
            if event.finished:
                m.ended[event.run_id] += 1
                del m.wanted[event.run_id]


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(
                ["assign", "consume", "cancel", "ping", "caps", "produce", "to_node", "to_edge"]
            ),
            st.integers(0, 99),
        ),
        max_size=80,
    )
)
def test_honest_peers_never_trip_the_sessions(steps: list[tuple[str, int]]) -> None:
    m = _open_model()
    for action, pick in steps:
        try:
            _step(m, action, pick)
        except LinkError as exc:  # pragma: no cover - the property's failure
            pytest.fail(f"{action}: {exc!r}")
        _check_edge(m.edge)
    assert all(n <= 1 for n in m.ended.values())
