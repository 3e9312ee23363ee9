"""The two ends of a link as sans-IO state machines.

``EdgeSession`` is the edge's view of one node connection, ``NodeSession``
the node's view of its connection to an edge. They take frames (bytes) and the
current time, and return typed link events; they produce the frames to send.
They do no I/O and never sleep: the drivers in ``iop.edge`` and ``iop.node``
own the WebSocket and the clock.

Flow control
------------
Each run has a credit window counted in *non-terminal* events. ``Assign``
carries the initial credit; the edge returns credit with ``Credit`` as the
run's consumer takes events. A node must not send more non-terminal events
than it holds credit for (the edge treats it as a protocol error), so the edge
can buffer a run's events in a fixed-size queue (window + 1 for the terminal
event, which needs no credit: a cancelled run must always be able to end).
A slow client therefore stops only its own run's credit; the link, and every
other run on it, keep flowing: no head-of-line blocking.

Liveness
--------
Any frame proves the peer alive. The edge pings every
``heartbeat_interval_s``; a peer silent for ``heartbeat_timeout_s`` is lost
(``liveness_deadline``), which detects frozen or partitioned peers that TCP
alone would not report for minutes.

States::

    EdgeSession:  AWAIT_HELLO --Hello ok--> OPEN --close()--> CLOSED
    NodeSession:  AWAIT_WELCOME --Welcome--> OPEN --close()--> CLOSED
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable
from typing import Final

import msgspec

from iop.capabilities import Capabilities
from iop.errors import InvariantError, LinkAuthError, LinkProtocolError
from iop.events import CancelReason, RuntimeEvent, is_terminal
from iop.protocol._messages import (
    PROTOCOL_VERSION,
    Assign,
    Cancel,
    CapabilitiesUpdate,
    Credit,
    Goodbye,
    Hello,
    Ping,
    Pong,
    RunEvents,
    Welcome,
    decode_edge_message,
    decode_node_message,
    encode,
)
from iop.spec import ExecutionSpec

__all__ = [
    "DEFAULT_RUN_WINDOW",
    "AssignReceived",
    "CancelReceived",
    "CapabilitiesChanged",
    "CreditReceived",
    "EdgeSession",
    "LinkState",
    "NodeDraining",
    "NodeJoined",
    "NodeSession",
    "PingReceived",
    "RunEventsReceived",
    "Welcomed",
]

# Events a run may have in flight between node and edge. Big enough that a
# fast stream never waits for a credit round trip on loopback or LAN (the
# edge returns credit every half window), small enough to bound a run's memory
# on the edge: at most this many events are buffered per run.
DEFAULT_RUN_WINDOW: Final = 64


class LinkState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    CLOSED = "closed"


# --- link events ----------------------------------------------------------------


class NodeJoined(msgspec.Struct, frozen=True):
    hello: Hello


class CapabilitiesChanged(msgspec.Struct, frozen=True):
    instances: list[Capabilities]


class RunEventsReceived(msgspec.Struct, frozen=True):
    run_id: str
    events: list[RuntimeEvent]
    finished: bool


class NodeDraining(msgspec.Struct, frozen=True):
    reason: str


class Welcomed(msgspec.Struct, frozen=True):
    welcome: Welcome


class AssignReceived(msgspec.Struct, frozen=True):
    assign: Assign


class CreditReceived(msgspec.Struct, frozen=True):
    run_id: str
    credit: int


class CancelReceived(msgspec.Struct, frozen=True):
    cancel: Cancel


class PingReceived(msgspec.Struct, frozen=True):
    reply: bytes


EdgeLinkEvent = NodeJoined | CapabilitiesChanged | RunEventsReceived | NodeDraining
NodeLinkEvent = Welcomed | AssignReceived | CreditReceived | CancelReceived | PingReceived


class _EdgeRun:
    __slots__ = ("credit", "seq")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        self.seq = 0


class EdgeSession:
    """The edge's end of one node link.

    Args:
        tokens: Node tokens accepted (compared in constant time).
        heartbeat_interval_s: How often the edge pings.
        heartbeat_timeout_s: Silence after which the node is lost.
        now: The current time.
    """

    def __init__(
        self,
        *,
        tokens: Iterable[str],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        now: float,
    ) -> None:
        self._tokens = [t.encode() for t in tokens]
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state = LinkState.AWAIT_HELLO
        self.node_id = ""
        self.last_seen = now
        self._runs: dict[str, _EdgeRun] = {}
        self._nonce = 0

    @property
    def liveness_deadline(self) -> float:
        return self.last_seen + self.heartbeat_timeout_s

    @property
    def runs(self) -> frozenset[str]:
        return frozenset(self._runs)

    def receive(self, frame: bytes, now: float) -> tuple[EdgeLinkEvent | None, bytes | None]:
        """Process one frame; return the link event and a frame to send back.

        Raises:
            LinkAuthError: Bad token or protocol version (close the link).
            LinkProtocolError: The node broke the protocol (close the link).
        """
        if self.state is LinkState.CLOSED:
            raise LinkProtocolError("frame after close")
        msg = decode_node_message(frame)
        self.last_seen = now
        if self.state is LinkState.AWAIT_HELLO:
            if not isinstance(msg, Hello):
                raise LinkProtocolError(f"expected hello, got {type(msg).__name__}")
            return NodeJoined(self._accept(msg)), encode(
                Welcome(
                    protocol_version=PROTOCOL_VERSION,
                    node_id=msg.node_id,
                    heartbeat_interval_s=self.heartbeat_interval_s,
                    heartbeat_timeout_s=self.heartbeat_timeout_s,
                )
            )
        if isinstance(msg, RunEvents):
            return self._run_events(msg), None
        if isinstance(msg, Pong):
            return None, None
        if isinstance(msg, CapabilitiesUpdate):
            return CapabilitiesChanged(msg.instances), None
        if isinstance(msg, Goodbye):
            return NodeDraining(msg.reason), None
        raise LinkProtocolError(f"unexpected {type(msg).__name__} on an open link")

    def _accept(self, hello: Hello) -> Hello:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise LinkAuthError(
                f"node {hello.node_id!r} speaks protocol {hello.protocol_version}, "
                f"this edge speaks {PROTOCOL_VERSION}"
            )
        token = hello.token.encode()
        # Compare against every token, always, so timing reveals nothing.
        ok = False
        for t in self._tokens:
            ok |= hmac.compare_digest(token, t)
        if not ok:
            raise LinkAuthError(f"node {hello.node_id!r} presented a bad token")
        if not hello.node_id:
            raise LinkProtocolError("hello without a node id")
        self.node_id = hello.node_id
        self.state = LinkState.OPEN
        return hello

    def _run_events(self, msg: RunEvents) -> RunEventsReceived:
        run = self._runs.get(msg.run_id)
        if run is None:
            # A run the edge already let go of (cancelled): its late events
            # are dropped, but they must still respect the protocol.
            return RunEventsReceived(msg.run_id, [], finished=True)
        if msg.seq != run.seq:
            raise LinkProtocolError(f"run {msg.run_id}: frame {msg.seq}, expected {run.seq}")
        run.seq += 1
        finished = False
        used = 0
        for i, ev in enumerate(msg.events):
            if is_terminal(ev):
                if i != len(msg.events) - 1:
                    raise LinkProtocolError(f"run {msg.run_id}: events after the terminal event")
                finished = True
            else:
                used += 1
        if used > run.credit:
            raise LinkProtocolError(
                f"run {msg.run_id}: {used} events sent with {run.credit} credit"
            )
        run.credit -= used
        if finished:
            del self._runs[msg.run_id]
        return RunEventsReceived(msg.run_id, msg.events, finished)

    def assign(
        self, run_id: str, instance: str, spec: ExecutionSpec, credit: int = DEFAULT_RUN_WINDOW
    ) -> bytes:
        """The frame that assigns a run to the node."""
        self._require_open()
        if run_id in self._runs:
            raise InvariantError(f"run {run_id} is already assigned on this link")
        self._runs[run_id] = _EdgeRun(credit)
        return encode(Assign(run_id=run_id, instance=instance, spec=spec, credit=credit))

    def grant(self, run_id: str, credit: int) -> bytes | None:
        """The frame that returns ``credit`` to a run (None if the run is over)."""
        run = self._runs.get(run_id)
        if run is None or credit <= 0:
            return None
        run.credit += credit
        return encode(Credit(run_id=run_id, credit=credit))

    def cancel(self, run_id: str, reason: CancelReason, message: str = "") -> bytes | None:
        """The frame that cancels a run; the edge stops tracking it."""
        if self._runs.pop(run_id, None) is None or self.state is not LinkState.OPEN:
            return None
        return encode(Cancel(run_id=run_id, reason=reason, message=message))

    def ping(self) -> bytes:
        self._nonce += 1
        return encode(Ping(nonce=self._nonce))

    def close(self) -> frozenset[str]:
        """Mark the link closed; return the runs that were still on it."""
        self.state = LinkState.CLOSED
        lost = frozenset(self._runs)
        self._runs.clear()
        return lost

    def _require_open(self) -> None:
        if self.state is not LinkState.OPEN:
            raise InvariantError(f"link is {self.state.value}")


class _NodeRun:
    __slots__ = ("credit", "seq")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        self.seq = 0


class NodeSession:
    """The node's end of its link to one edge.

    Args:
        node_id: This node's id.
        token: The edge's node token.
        now: The current time.
        heartbeat_timeout_s: Silence after which the edge is considered lost
            (replaced by the edge's value once welcomed).
    """

    def __init__(
        self, *, node_id: str, token: str, now: float, heartbeat_timeout_s: float = 5.0
    ) -> None:
        self.node_id = node_id
        self._token = token
        self.state = LinkState.AWAIT_WELCOME
        self.last_seen = now
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._runs: dict[str, _NodeRun] = {}

    @property
    def liveness_deadline(self) -> float:
        return self.last_seen + self.heartbeat_timeout_s

    def hello(self, instances: list[Capabilities], software: str = "") -> bytes:
        return encode(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                node_id=self.node_id,
                token=self._token,
                instances=instances,
                software=software,
            )
        )

    def receive(self, frame: bytes, now: float) -> NodeLinkEvent:
        """Process one frame from the edge.

        Raises:
            LinkProtocolError: The edge broke the protocol.
        """
        if self.state is LinkState.CLOSED:
            raise LinkProtocolError("frame after close")
        msg = decode_edge_message(frame)
        self.last_seen = now
        if self.state is LinkState.AWAIT_WELCOME:
            if not isinstance(msg, Welcome):
                raise LinkProtocolError(f"expected welcome, got {type(msg).__name__}")
            self.state = LinkState.OPEN
            self.heartbeat_timeout_s = msg.heartbeat_timeout_s
            return Welcomed(msg)
        if isinstance(msg, Ping):
            return PingReceived(encode(Pong(nonce=msg.nonce)))
        if isinstance(msg, Assign):
            if msg.run_id in self._runs:
                raise LinkProtocolError(f"run {msg.run_id} assigned twice")
            if msg.credit < 0:
                raise LinkProtocolError(f"run {msg.run_id}: negative credit")
            self._runs[msg.run_id] = _NodeRun(msg.credit)
            return AssignReceived(msg)
        if isinstance(msg, Credit):
            run = self._runs.get(msg.run_id)
            if msg.credit <= 0:
                raise LinkProtocolError(f"run {msg.run_id}: credit {msg.credit}")
            if run is not None:
                run.credit += msg.credit
            return CreditReceived(msg.run_id, msg.credit)
        if isinstance(msg, Cancel):
            return CancelReceived(msg)
        raise LinkProtocolError(f"unexpected {type(msg).__name__} on an open link")

    def credit(self, run_id: str) -> int:
        """Non-terminal events the run may send now."""
        run = self._runs.get(run_id)
        return 0 if run is None else run.credit

    def run_events(self, run_id: str, events: list[RuntimeEvent]) -> bytes:
        """The frame carrying ``events``; consumes credit.

        Raises:
            InvariantError: More non-terminal events than credit, or an
                unknown run (a bug in the node's forwarder).
        """
        run = self._runs.get(run_id)
        if run is None:
            raise InvariantError(f"run {run_id} is not on this link")
        used = sum(1 for e in events if not is_terminal(e))
        if used > run.credit:
            raise InvariantError(f"run {run_id}: {used} events with {run.credit} credit")
        run.credit -= used
        frame = encode(RunEvents(run_id=run_id, seq=run.seq, events=events))
        run.seq += 1
        if events and is_terminal(events[-1]):
            del self._runs[run_id]
        return frame

    def capabilities(self, instances: list[Capabilities]) -> bytes:
        return encode(CapabilitiesUpdate(instances=instances))

    def goodbye(self, reason: str = "") -> bytes:
        return encode(Goodbye(reason=reason))

    def close(self) -> frozenset[str]:
        self.state = LinkState.CLOSED
        runs = frozenset(self._runs)
        self._runs.clear()
        return runs
