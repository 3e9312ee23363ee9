"""Link session fuzzing: hypothesis over the sans-IO ``EdgeSession`` and ``NodeSession``.

Two properties (docs/protocol.md "Session", ``iop.protocol._session``):

* **Hostile frames.** Random bytes, truncated and bit-flipped valid frames
  (handshake messages, batches, bare messages), and valid frames in random
  order fed to either side only ever raise the documented ``LinkError``
  subclasses (``LinkAuthError``, ``LinkProtocolError`` and its
  ``LinkLimitError``), never anything else, and the session's invariants
  hold after every frame it accepted.
* **Honest peers, any interleaving.** An edge and a node that follow the
  protocol (assign, consume and so return credit, cancel at any time; the
  node pushes any pattern of events and ends each run once) with their
  frames in flight in two FIFO queues delivered in any interleaving never
  trip either session; every run ends exactly once on the edge, or is
  cancelled and its late events dropped; and the two ends' ``RunPhase`` of
  each run agree with what is in flight between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.capabilities import Capabilities
from iop.errors import LinkAuthError, LinkError, LinkProtocolError
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    RuntimeEvent,
    Start,
    is_terminal,
)
from iop.protocol import (
    PROTOCOL_VERSION,
    RELEASED_RUNS_REMEMBERED,
    Assign,
    AssignReceived,
    Cancel,
    CancelReceived,
    CapabilitiesUpdate,
    Credit,
    EdgeSession,
    Goodbye,
    Hello,
    LinkState,
    NodeSession,
    Ping,
    RunEvents,
    RunEventsReceived,
    RunPhase,
    Welcome,
    encode,
    encode_batch,
)
from iop.spec import ChatRequest, ExecutionSpec, Message

TOKEN = "t0k"
SPEC = ExecutionSpec(
    run_id="r0", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))
RUN_IDS = ["r0", "r1", "r2"]

_NODE_MESSAGES = [
    encode(CapabilitiesUpdate(instances=[CAPS])),
    encode(Ping(nonce=1)),
    encode(Ping(nonce=2)),
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
# Valid frames of each direction, the raw material of the hostile strategies:
# handshake frames, every message as a batch of one and bare, a few batches
# of several, and an empty batch.
NODE_FRAMES = [
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token=TOKEN, instances=[CAPS])),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token="bad")),
    encode(Hello(protocol_version=PROTOCOL_VERSION - 1, node_id="n1", token=TOKEN)),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="", token=TOKEN)),
    encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token=TOKEN, max_frame_bytes=-1)),
    encode_batch([encode(Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token=TOKEN))]),
    *[encode_batch([m]) for m in _NODE_MESSAGES],
    *_NODE_MESSAGES[:8],
    encode_batch(_NODE_MESSAGES[4:10]),
    encode_batch(_NODE_MESSAGES[::7]),
    encode_batch([]),
]
_EDGE_MESSAGES = [
    *[
        encode(Assign(run_id=r, instance="sim", spec=SPEC, credit=c))
        for r in RUN_IDS
        for c in (0, 3, -1)
    ],
    *[encode(Credit(run_id=r, credit=c)) for r in RUN_IDS for c in (1, 0, -2)],
    *[encode(Cancel(run_id=r, reason=CancelReason.EXPLICIT)) for r in RUN_IDS],
    encode(Ping(nonce=7)),
]
_WELCOME = encode(
    Welcome(
        protocol_version=PROTOCOL_VERSION,
        node_id="n1",
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
    )
)
EDGE_FRAMES = [
    _WELCOME,
    encode(
        Welcome(
            protocol_version=PROTOCOL_VERSION,
            node_id="n1",
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=-1,
        )
    ),
    encode_batch([_WELCOME]),
    *[encode_batch([m]) for m in _EDGE_MESSAGES],
    *_EDGE_MESSAGES[:6],
    encode_batch(_EDGE_MESSAGES[::3]),
    encode_batch(_EDGE_MESSAGES[1::4]),
    encode_batch([]),
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
    assert all(run.credit >= 0 for run in edge._ending.values())
    assert all(run.phase in (RunPhase.ASSIGNED, RunPhase.STREAMING) for run in edge._runs.values())
    assert all(run.phase is RunPhase.ENDING for run in edge._ending.values())
    assert not set(edge._runs) & set(edge._ending)
    assert len(edge._ending) <= RELEASED_RUNS_REMEMBERED


@settings(max_examples=400, deadline=None)
@given(
    frames=st.lists(_mutated(NODE_FRAMES), max_size=25),
    actions=st.lists(
        st.tuples(
            st.sampled_from(["assign", "consumed", "cancel", "tick"]),
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
            if what == "assign" and edge.run(run_id) is None:
                edge.assign(run_id, "sim", SPEC, credit=n)
                finished.discard(run_id)
            elif what == "consumed":
                edge.consumed(run_id, n)
            elif what == "cancel":
                edge.cancel(run_id, CancelReason.EXPLICIT)
            else:
                edge.tick(float(i))
            for out in edge.data_to_send(float(i)):
                assert len(out) <= edge.peer_max_frame_bytes
        try:
            got = edge.receive(frame, now=float(i))
        except (LinkAuthError, LinkProtocolError):
            return  # the driver closes the link: nothing more is read
        _check_edge(edge)
        for event in got:
            if isinstance(event, RunEventsReceived):
                assert event.events
                assert event.run_id not in finished
                assert edge.run(event.run_id) is None or not event.finished
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
        assert 0 < node.heartbeat_interval_s < node.heartbeat_timeout_s
        # Whatever the edge said, the node's own side never breaks.
        for r in RUN_IDS:
            run = node.run(r)
            if run is not None:
                assert run.phase in (RunPhase.ASSIGNED, RunPhase.STREAMING, RunPhase.ENDING)
                node.push(r, Delta("x"))
        node.tick(float(i))
        node.data_to_send(float(i))


# --- honest peers, any interleaving ------------------------------------------------

LIMIT = 700  # small, so batches are split over several frames


@dataclass
class _Model:
    edge: EdgeSession
    node: NodeSession
    to_node: list[bytes] = field(default_factory=list)
    to_edge: list[bytes] = field(default_factory=list)
    next_run: int = 0
    assigned: list[str] = field(default_factory=list)
    # Edge side: runs it still wants and the events it holds unconsumed;
    # runs it cancelled; terminal events it saw per run.
    wanted: dict[str, int] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    ended: dict[str, int] = field(default_factory=dict)
    # Node side: runs it is executing (terminal not pushed yet).
    running: set[str] = field(default_factory=set)
    now: float = 0.0

    @property
    def quiet(self) -> bool:
        return not (
            self.to_node or self.to_edge or self.edge.has_data_to_send or self.node.has_data_to_send
        )


def _open_model() -> _Model:
    edge = EdgeSession(
        tokens=[TOKEN],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        now=0.0,
        max_frame_bytes=LIMIT,
        control_burst=10_000,
    )
    node = NodeSession(node_id="n1", token=TOKEN, now=0.0, max_frame_bytes=LIMIT)
    edge.receive(node.hello([CAPS]), now=0.0)
    node.receive(edge.welcome(), now=0.0)
    return _Model(edge, node)


def _node_receive(m: _Model, frame: bytes) -> None:
    for ev in m.node.receive(frame, now=m.now):
        if isinstance(ev, AssignReceived):
            m.running.add(ev.assign.run_id)
        elif isinstance(ev, CancelReceived):
            run_id = ev.cancel.run_id
            if run_id in m.running:
                m.running.discard(run_id)
                m.node.push(run_id, Cancelled(reason=ev.cancel.reason))


def _edge_receive(m: _Model, frame: bytes) -> None:
    for ev in m.edge.receive(frame, now=m.now):
        if isinstance(ev, RunEventsReceived):
            assert ev.run_id in m.wanted, "events of a run the edge does not want"
            assert ev.run_id not in m.cancelled
            m.wanted[ev.run_id] += sum(not is_terminal(e) for e in ev.events)
            if ev.finished:
                m.ended[ev.run_id] += 1
                del m.wanted[ev.run_id]


def _step(m: _Model, action: str, pick: int) -> None:
    m.now += 0.01
    if action == "assign":
        run_id = f"r{m.next_run}"
        m.next_run += 1
        m.edge.assign(run_id, "sim", SPEC, credit=1 + pick % 5)
        m.assigned.append(run_id)
        m.wanted[run_id] = 0
        m.ended[run_id] = 0
    elif action == "consume" and m.wanted:
        run_id = sorted(m.wanted)[pick % len(m.wanted)]
        took = min(m.wanted[run_id], 1 + pick % 3)
        m.wanted[run_id] -= took
        m.edge.consumed(run_id, took)
    elif action == "cancel" and m.wanted:
        run_id = sorted(m.wanted)[pick % len(m.wanted)]
        del m.wanted[run_id]
        m.cancelled.add(run_id)
        assert m.edge.cancel(run_id, CancelReason.CLIENT_DISCONNECT)
    elif action == "tick":
        m.now += 0.3 * (pick % 4)
        m.edge.tick(m.now)
        m.node.tick(m.now)
    elif action == "caps":
        m.node.capabilities([CAPS])
    elif action == "produce" and m.running:
        run_id = sorted(m.running)[pick % len(m.running)]
        for i in range(1 + pick % 4):
            m.node.push(run_id, Delta("t" * (pick * 5 % 300 + i)))
    elif action == "end" and m.running:
        run_id = sorted(m.running)[pick % len(m.running)]
        m.running.discard(run_id)
        terminal: RuntimeEvent = (
            Complete(),
            Error(message="boom"),
            Cancelled(reason=CancelReason.IDLE_TIMEOUT),
        )[pick % 3]
        m.node.push(run_id, terminal)
    elif action == "edge_sends":
        for frame in m.edge.data_to_send(m.now):
            assert len(frame) <= m.edge.peer_max_frame_bytes
            m.to_node.append(frame)
    elif action == "node_sends":
        for frame in m.node.data_to_send(m.now):
            assert len(frame) <= m.node.peer_max_frame_bytes
            m.to_edge.append(frame)
        assert m.node.take_cut_off() == []
    elif action == "to_node" and m.to_node:
        _node_receive(m, m.to_node.pop(0))
    elif action == "to_edge" and m.to_edge:
        _edge_receive(m, m.to_edge.pop(0))


def _check_phases(m: _Model) -> None:
    """What each end's phase of a run allows the other's to be, given that
    messages are in flight both ways (``None``: not, or no longer, on the link)."""
    a, s, e = RunPhase.ASSIGNED, RunPhase.STREAMING, RunPhase.ENDING
    for run_id in m.assigned:
        er, nr = m.edge.run(run_id), m.node.run(run_id)
        edge = None if er is None else er.phase
        node = None if nr is None else nr.phase
        allowed = {
            None: {None},  # the edge forgets a run only after the node's terminal
            a: {None, a, s},  # assign or events in flight
            s: {None, s},  # the terminal in flight
            e: {None, a, s, e},  # the cancel, or the terminal, in flight
        }[edge]
        assert node in allowed, f"{run_id}: edge {edge}, node {node}"
        if m.quiet:
            assert node == edge, f"{run_id}: edge {edge}, node {node} with nothing in flight"
            if er is not None and nr is not None:
                assert (er.credit, er.seq) == (nr.credit, nr.seq)


def _drain(m: _Model) -> None:
    """Deliver everything, consume everything, end every running run."""
    for _ in range(1000):
        if m.quiet and not m.running and not any(m.wanted.values()):
            return
        for run_id in list(m.running):
            m.running.discard(run_id)
            m.node.push(run_id, Complete())
        for run_id, n in m.wanted.items():
            m.edge.consumed(run_id, n)
            m.wanted[run_id] = 0
        m.to_node += m.edge.data_to_send(m.now)
        m.to_edge += m.node.data_to_send(m.now)
        while m.to_node:
            _node_receive(m, m.to_node.pop(0))
        while m.to_edge:
            _edge_receive(m, m.to_edge.pop(0))
        _check_phases(m)
    pytest.fail("the link never went quiet")  # pragma: no cover


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "assign",
                    "consume",
                    "cancel",
                    "tick",
                    "caps",
                    "produce",
                    "end",
                    "edge_sends",
                    "node_sends",
                    "to_node",
                    "to_edge",
                ]
            ),
            st.integers(0, 99),
        ),
        # Long enough that runs get through every phase (hypothesis favours
        # short lists).
        min_size=30,
        max_size=150,
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
        _check_phases(m)
    _drain(m)
    for run_id in m.assigned:
        if run_id in m.cancelled:
            assert m.ended[run_id] == 0
        else:
            assert m.ended[run_id] == 1, run_id
        assert m.edge.run(run_id) is None
        assert m.node.run(run_id) is None
    assert m.edge.runs == frozenset()
    assert not m.edge._ending
    assert m.edge.state is LinkState.OPEN
    assert m.node.state is LinkState.OPEN
