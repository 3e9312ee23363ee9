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

Limits
------
A peer that has not said hello may send one frame of at most
``max_hello_bytes``; after the hello, frames up to ``max_frame_bytes``. A
frame above the limit raises ``LinkLimitError`` with ``CLOSE_TOO_BIG``
(1009). Each side tells the other what it accepts (``Hello.max_frame_bytes``,
``Welcome.max_frame_bytes``), and neither sends a bigger frame: the edge
refuses a run whose ``Assign`` would not fit with a 413 for that run alone.

Event frames are bounded by credit and terminal frames by assigns, so the
only messages a node could flood the edge with are the ones that cost no
credit (``pong``, ``caps``, ``bye``): those draw from a token bucket
(``control_rate_per_s``, ``control_burst``) and an empty bucket raises
``LinkLimitError`` with ``CLOSE_RATE``. Events for a run that was never
assigned on the link are a protocol error; events for a run the edge
cancelled recently are late, legitimate, and dropped (the session remembers
the last ``RELEASED_RUNS_REMEMBERED`` released runs, with their credit).

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
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

import msgspec

from iop.capabilities import Capabilities
from iop.errors import (
    ErrorCode,
    InvariantError,
    LinkAuthError,
    LinkLimitError,
    LinkProtocolError,
    RequestError,
)
from iop.events import CancelReason, RuntimeEvent, is_terminal
from iop.protocol._messages import (
    PROTOCOL_VERSION,
    Assign,
    Cancel,
    CapabilitiesUpdate,
    Credit,
    Goodbye,
    Hello,
    NodeMessage,
    Ping,
    Pong,
    RunEvents,
    Welcome,
    decode_edge_message,
    decode_node_message,
    encode,
)
from iop.protocol._transport import CLOSE_RATE, CLOSE_TOO_BIG
from iop.spec import ExecutionSpec

__all__ = [
    "DEFAULT_CONTROL_BURST",
    "DEFAULT_CONTROL_RATE_PER_S",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_HELLO_BYTES",
    "DEFAULT_RUN_WINDOW",
    "LEGACY_MAX_FRAME_BYTES",
    "RELEASED_RUNS_REMEMBERED",
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
# The hello is the only frame a peer may send before it is authenticated, so
# this is all an anonymous connection can make the edge hold. A hello lists
# the node's instances: one ``Capabilities`` is ~200 bytes plus its targets,
# so 256 KiB fits e.g. 64 instances of 20 model ids of 100 characters each
# (~150 KiB) with room to spare.
DEFAULT_MAX_HELLO_BYTES: Final = 256 * 1024
# After the hello (the edge derives its own from ``server.max_body_bytes``,
# see ``iop.config.LinkSettings``): an Assign carries a whole request body,
# re-encoded as msgpack, which is at most ~2.25x its JSON (a JSON float like
# ``0.5,`` is 4 bytes, a msgpack float 9), so twice 8 MiB plus 1 MiB.
DEFAULT_MAX_FRAME_BYTES: Final = 17 * 1024 * 1024
# What a peer that sent no limit accepts: trio-websocket's max_message_size
# of nodes before ``Hello.max_frame_bytes`` existed.
LEGACY_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
# Messages that cost no credit (pong, caps, bye) a node may send. A node
# sends one pong per ping (2/s at the default heartbeat), a caps update at
# most once per probe (10 s) and one bye: 50/s is 25x that, and a burst of
# 1000 absorbs the pongs of a link that stalled for minutes. A flood of
# 100,000 such messages is cut off after ~1000.
DEFAULT_CONTROL_RATE_PER_S: Final = 50.0
DEFAULT_CONTROL_BURST: Final = 1000
# Runs the edge cancelled whose late events are still accepted (and
# dropped). Late events arrive within a round trip of the cancel; 4096 covers
# a drain that cancels thousands of runs at once, at ~100 bytes an entry.
RELEASED_RUNS_REMEMBERED: Final = 4096


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


class _TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up."""

    __slots__ = ("_at", "_burst", "_rate", "_tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float) -> bool:
        if now > self._at:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class EdgeSession:
    """The edge's end of one node link.

    Args:
        tokens: Node tokens accepted (compared in constant time).
        heartbeat_interval_s: How often the edge pings.
        heartbeat_timeout_s: Silence after which the node is lost.
        now: The current time.
        max_hello_bytes: Largest frame before the hello is accepted.
        max_frame_bytes: Largest frame after it (sent to the node in the welcome).
        control_rate_per_s: Sustained rate of messages that cost no credit.
        control_burst: Of those, how many may come at once.
    """

    def __init__(
        self,
        *,
        tokens: Iterable[str],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        now: float,
        max_hello_bytes: int = DEFAULT_MAX_HELLO_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        control_rate_per_s: float = DEFAULT_CONTROL_RATE_PER_S,
        control_burst: int = DEFAULT_CONTROL_BURST,
    ) -> None:
        self._tokens = [t.encode() for t in tokens]
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_hello_bytes = max_hello_bytes
        self.max_frame_bytes = max_frame_bytes
        # What the node accepts (from its hello).
        self.peer_max_frame_bytes = LEGACY_MAX_FRAME_BYTES
        self.state = LinkState.AWAIT_HELLO
        self.node_id = ""
        self.last_seen = now
        self._runs: dict[str, _EdgeRun] = {}
        self._released: OrderedDict[str, _EdgeRun] = OrderedDict()
        self._control = _TokenBucket(control_rate_per_s, control_burst, now)
        self._nonce = 0

    @property
    def frame_limit(self) -> int:
        """The largest frame the session accepts now."""
        if self.state is LinkState.AWAIT_HELLO:
            return self.max_hello_bytes
        return self.max_frame_bytes

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
            LinkProtocolError: The node broke the protocol (close the link
                with ``CLOSE_PROTOCOL``); its subclass ``LinkLimitError``
                carries its own close code (frame too big, message rate).
        """
        if self.state is LinkState.CLOSED:
            raise LinkProtocolError("frame after close")
        limit = self.frame_limit
        if len(frame) > limit:
            when = "before its hello" if self.state is LinkState.AWAIT_HELLO else "on an open link"
            raise LinkLimitError(
                f"frame of {len(frame)} bytes {when} (limit {limit})", close_code=CLOSE_TOO_BIG
            )
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
                    max_frame_bytes=self.max_frame_bytes,
                )
            )
        if isinstance(msg, RunEvents):
            return self._run_events(msg), None
        self._spend_control(msg, now)
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
        if hello.max_frame_bytes < 0:
            raise LinkProtocolError(f"hello with max_frame_bytes {hello.max_frame_bytes}")
        self.node_id = hello.node_id
        if hello.max_frame_bytes:
            self.peer_max_frame_bytes = hello.max_frame_bytes
        self.state = LinkState.OPEN
        return hello

    def _spend_control(self, msg: NodeMessage, now: float) -> None:
        if not self._control.take(now):
            raise LinkLimitError(
                f"node {self.node_id!r} exceeds the link's message rate "
                f"({type(msg).__name__} after the burst was spent)",
                close_code=CLOSE_RATE,
            )

    def _run_events(self, msg: RunEvents) -> RunEventsReceived:
        if not msg.events:
            raise LinkProtocolError(f"run {msg.run_id}: an events frame with no events")
        released = False
        run = self._runs.get(msg.run_id)
        if run is None:
            # A run the edge let go of (cancelled) recently: its late events
            # are dropped, but they must still respect the protocol.
            run = self._released.get(msg.run_id)
            if run is None:
                raise LinkProtocolError(
                    f"events for run {msg.run_id!r}, which is not assigned on this link"
                )
            released = True
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
        if released:
            if finished:
                del self._released[msg.run_id]
            return RunEventsReceived(msg.run_id, [], finished=True)
        if finished:
            del self._runs[msg.run_id]
        return RunEventsReceived(msg.run_id, msg.events, finished)

    def assign(
        self, run_id: str, instance: str, spec: ExecutionSpec, credit: int = DEFAULT_RUN_WINDOW
    ) -> bytes:
        """The frame that assigns a run to the node.

        Raises:
            RequestError: 413: the frame is larger than the node accepts
                (the run is not assigned; the link is untouched).
        """
        self._require_open()
        if run_id in self._runs or run_id in self._released:
            raise InvariantError(f"run {run_id} is already assigned on this link")
        frame = encode(Assign(run_id=run_id, instance=instance, spec=spec, credit=credit))
        if len(frame) > self.peer_max_frame_bytes:
            raise RequestError(
                f"the request is too large for node {self.node_id!r}: it takes "
                f"{len(frame)} bytes on the node link, the node accepts "
                f"{self.peer_max_frame_bytes}",
                status=413,
                code=ErrorCode.REQUEST_TOO_LARGE,
            )
        self._runs[run_id] = _EdgeRun(credit)
        return frame

    def grant(self, run_id: str, credit: int) -> bytes | None:
        """The frame that returns ``credit`` to a run (None if the run is over)."""
        run = self._runs.get(run_id)
        if run is None or credit <= 0:
            return None
        run.credit += credit
        return encode(Credit(run_id=run_id, credit=credit))

    def cancel(self, run_id: str, reason: CancelReason, message: str = "") -> bytes | None:
        """The frame that cancels a run; the edge stops tracking it.

        Its late events (already on the way) are still accepted and dropped.
        """
        run = self._runs.pop(run_id, None)
        if run is None or self.state is not LinkState.OPEN:
            return None
        self._released[run_id] = run
        while len(self._released) > RELEASED_RUNS_REMEMBERED:
            self._released.popitem(last=False)
        return encode(Cancel(run_id=run_id, reason=reason, message=message))

    def ping(self) -> bytes:
        self._nonce += 1
        return encode(Ping(nonce=self._nonce))

    def close(self) -> frozenset[str]:
        """Mark the link closed; return the runs that were still on it."""
        self.state = LinkState.CLOSED
        lost = frozenset(self._runs)
        self._runs.clear()
        self._released.clear()
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
        max_frame_bytes: Largest frame the node accepts (told to the edge
            in the hello).
    """

    def __init__(
        self,
        *,
        node_id: str,
        token: str,
        now: float,
        heartbeat_timeout_s: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.node_id = node_id
        self.max_frame_bytes = max_frame_bytes
        # What the edge accepts (from its welcome; until then, what an edge
        # from before Welcome.max_frame_bytes accepted).
        self.peer_max_frame_bytes = LEGACY_MAX_FRAME_BYTES
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
                max_frame_bytes=self.max_frame_bytes,
            )
        )

    def receive(self, frame: bytes, now: float) -> NodeLinkEvent:
        """Process one frame from the edge.

        Raises:
            LinkProtocolError: The edge broke the protocol (``LinkLimitError``:
                a frame above ``max_frame_bytes``).
        """
        if self.state is LinkState.CLOSED:
            raise LinkProtocolError("frame after close")
        if len(frame) > self.max_frame_bytes:
            raise LinkLimitError(
                f"frame of {len(frame)} bytes from the edge (limit {self.max_frame_bytes})",
                close_code=CLOSE_TOO_BIG,
            )
        msg = decode_edge_message(frame)
        self.last_seen = now
        if self.state is LinkState.AWAIT_WELCOME:
            if not isinstance(msg, Welcome):
                raise LinkProtocolError(f"expected welcome, got {type(msg).__name__}")
            if msg.max_frame_bytes < 0 or not msg.heartbeat_timeout_s > 0:
                raise LinkProtocolError("welcome with a negative limit or timeout")
            self.state = LinkState.OPEN
            self.heartbeat_timeout_s = msg.heartbeat_timeout_s
            if msg.max_frame_bytes:
                self.peer_max_frame_bytes = msg.max_frame_bytes
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
