"""The two ends of a link as sans-IO state machines.

``EdgeSession`` is the edge's view of one node connection, ``NodeSession``
the node's view of its connection to an edge. They take frames (bytes) and
the current time and return typed link events; whatever they have to say
they queue, and ``data_to_send`` packs it into frames. They do no I/O and
never sleep: the one link driver (``iop.runtime.LinkDriver``, in
``iop/runtime/_link.py``) owns the socket and the clock, for both sides.

A run's link state lives here and only here, in one ``RunPhase`` per run
(``RunLink``), on both ends. It changes only by ``RunLink.advance``, which
looks up ``RUN_TRANSITIONS`` (the way h11's ``_state.py`` keeps a
connection's states). Its triggers (``RunTrigger``) are the same on both
ends, each applied where the message crosses the link: ``events`` and
``terminal`` when an events message without or with the run's terminal
event goes out (node) or comes in (edge), ``cancel`` when the edge cancels
the run and when its ``Cancel`` arrives::

                                ┌──┐ events
                                ▼  │
    ASSIGNED ─────events─────► STREAMING ────────terminal────────► DONE (forgotten)
     │  │                         │                                ▲ ▲
     │  └────────terminal─────────┼────────────────────────────────┘ │
     │                            │                                  │
     │             ┌──┐ events    │                                  │
     │             ▼  │           │                                  │
     └──cancel──► ENDING ◄─cancel─┘                                  │
                    │                                                │
                    └──────────────────terminal──────────────────────┘

Every other pair is refused: nothing moves a DONE run (it is forgotten, so
a later event for it is a protocol error at the edge and a bug at the
node), and a second cancel of an ENDING run is ignored by the node (the
edge never sends one). tests/protocol/test_run_phases.py checks this
diagram against the table.

============  ======================================================================
phase         what holds
============  ======================================================================
ASSIGNED      The edge sent ``Assign`` with ``credit``; nothing came back yet.
              A retryable error now may fail over to another node.
STREAMING     Events flow. The node sends at most ``credit`` non-terminal events
              (the edge checks, and a node that sends more broke the protocol);
              the edge returns credit with ``Credit`` as the run's consumer takes
              events, half a window at a time.
ENDING        The edge sent ``Cancel``. The node drops the run's queued and
              future non-terminal events and sends the terminal event without
              credit; the edge still checks ``seq`` and credit of the late events
              already on the way, and drops them. The edge remembers the last
              ``RELEASED_RUNS_REMEMBERED`` ending runs.
DONE          The terminal event went (node) or came (edge): exactly one per
              run. Any event for the run after it is a protocol error.
============  ======================================================================

The terminal event never needs credit, so a cancelled or failed run can
always end. A node that has no credit left for a run queues its events
(``NodeSession.backlog``; the driver stops the run's producer at
``RUN_BACKLOG`` events), which is the end-to-end backpressure: a slow client
stops only its own run's credit, and every other run on the link keeps
flowing (no head-of-line blocking).

Batching
--------
Frames after the handshake are arrays of messages (``encode_batch``).
``data_to_send`` takes everything queued, for every run, and packs it into as
few frames as ``peer_max_frame_bytes`` allows: a burst of tokens across many
runs costs one WebSocket frame, one server message and one reader wake-up.

Limits
------
A peer that has not said hello may send one frame of at most
``max_hello_bytes``; after the hello, frames up to ``max_frame_bytes``. A
frame above the limit raises ``LinkLimitError`` with ``CLOSE_TOO_BIG``
(1009). Each side tells the other what it accepts (``Hello.max_frame_bytes``,
``Welcome.max_frame_bytes``), and neither sends a bigger frame: the edge
refuses a run whose ``Assign`` would not fit with a 413 for that run alone,
and the node ends a run whose single event would not fit with ``Error``
``event_too_large`` (``NodeSession.take_cut_off``).

Event messages are bounded by credit and terminal ones by assigns, so the
only messages a node could flood the edge with are the ones that cost no
credit (``ping``, ``caps``, ``bye``, ``load``): those draw from a token bucket
(``control_rate_per_s``, ``control_burst``) and an empty bucket raises
``LinkLimitError`` with ``CLOSE_RATE``.

Load reports
------------
The edge's welcome says how many load reports a second it takes
(``load_reports_per_s``; 0 from an edge that predates them, which then gets
none) and when it ignores one as stale (``load_stale_s``). The node sends at
the lower of that rate and its own: a change (``NodeSession.load_changed``)
goes at once when the last report is at least an interval old, else the
changes of the interval are coalesced into one report at its end, built
from the figures then (``load_source``), so the last state always goes. A
node with nothing changing repeats its report every
``LOAD_REFRESH_FRACTION`` of ``load_stale_s``, so a quiet node's report is
never stale at the edge while the node is alive; a heartbeat due before
then carries the report instead of a ping, so an idle link sends no more
frames for it.

Liveness
--------
Any frame proves the peer alive, and only a link that carried nothing
recently pays for heartbeats: each side sends a ``Ping`` when it has sent
nothing else for its interval (a ping is "I am alive", not a question).
The node's interval is ``heartbeat_interval_s`` and the edge loses a node
silent for ``heartbeat_timeout_s`` (``liveness_deadline``), which detects
frozen or partitioned nodes that TCP alone would not report for minutes.
The edge pings in sweeps over all its links at once, every
``heartbeat_timeout_s`` (``EdgeSession.sweep``, run by
``iop.runtime.LinkClock``; ``tick`` is the same for one link on its own
deadline), and the node loses an edge silent for ``EDGE_SILENCE_FACTOR``
times that. The node gets in step with the sweeps (``NodeSession._answer``:
it answers a ping, or pings next an interval after it), so the frames of
many nodes reach the edge together. An idle link costs the edge one frame
received per ``heartbeat_interval_s`` and one sent per
``heartbeat_timeout_s``, and a busy one nothing.

Link states::

    EdgeSession:  AWAIT_HELLO --Hello ok--> OPEN --close()--> CLOSED
    NodeSession:  AWAIT_WELCOME --Welcome--> OPEN --close()--> CLOSED
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
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
from iop.events import (
    Cancelled,
    CancelReason,
    Delta,
    Error,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    is_terminal,
)
from iop.protocol._credentials import NodeCredential, NodeCredentials
from iop.protocol._messages import (
    PROTOCOL_VERSION,
    Assign,
    Cancel,
    CapabilitiesUpdate,
    ControlModel,
    Credit,
    Goodbye,
    Hello,
    InstanceLoad,
    LoadModel,
    LoadReport,
    ModelAction,
    ModelControlResult,
    ModelLoadResult,
    ModelOffer,
    Ping,
    RunEvents,
    Welcome,
    array_header,
    decode_edge_batch,
    decode_edge_message,
    decode_node_batch,
    decode_node_message,
    encode,
)
from iop.protocol._transport import CLOSE_RATE, CLOSE_TOO_BIG
from iop.spec import ExecutionSpec
from iop.timeline import NodeTimeline

__all__ = [
    "COLLECT_FLUSH_S",
    "COLLECT_MERGE_CHARS",
    "DEFAULT_CONTROL_BURST",
    "DEFAULT_CONTROL_RATE_PER_S",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_HELLO_BYTES",
    "DEFAULT_RUN_WINDOW",
    "EDGE_SILENCE_FACTOR",
    "LEGACY_MAX_FRAME_BYTES",
    "LOAD_REFRESH_FRACTION",
    "MIN_PEER_FRAME_BYTES",
    "RELEASED_RUNS_REMEMBERED",
    "RUN_BACKLOG",
    "RUN_TRANSITIONS",
    "UNLIMITED_CREDIT",
    "AssignReceived",
    "CancelReceived",
    "CapabilitiesChanged",
    "CreditReceived",
    "EdgeLinkEvent",
    "EdgeSession",
    "LinkState",
    "LoadModelReceived",
    "LoadReported",
    "ModelControlAnswered",
    "ModelControlReceived",
    "ModelLoadAnswered",
    "NodeDraining",
    "NodeJoined",
    "NodeLinkEvent",
    "NodeSession",
    "RunEventsReceived",
    "RunLink",
    "RunPhase",
    "RunTrigger",
    "Welcomed",
]

# Events a run may have in flight between node and edge. Big enough that a
# fast stream never waits for a credit round trip on loopback or LAN (the
# edge returns credit every half window), small enough to bound a run's memory
# on the edge: at most this many events are buffered per run.
DEFAULT_RUN_WINDOW: Final = 64
# The credit an edge with per-run credit turned off (``link.run_window = 0``,
# for research: docs/research.md, section 3) grants each run: more events
# than any run sends, so the node never waits for credit and the edge never
# returns any. Only the link's own flow control (TCP, and the edge's reader
# holding the link while a run's channel is full) holds a node back. An
# older node needs nothing new for it: it is an ordinary, large credit.
UNLIMITED_CREDIT: Final = 2**62
# Events a node queues for a run beyond its credit before the run's producer
# (the adapter) is made to wait, which stops it reading its backend.
RUN_BACKLOG: Final = 16
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
# Messages that cost no credit (ping, caps, bye) a node may send. A node
# sends at most one ping per heartbeat interval, a caps update at most once
# per probe (10 s) and one bye: 50/s is 50x that at the default interval,
# and a burst of 1000 absorbs the heartbeats of a link that stalled for
# minutes. A flood of 100,000 such messages is cut off after ~1000.
DEFAULT_CONTROL_RATE_PER_S: Final = 50.0
DEFAULT_CONTROL_BURST: Final = 1000
# Runs the edge cancelled whose late events are still accepted (and
# dropped). Late events arrive within a round trip of the cancel; 4096 covers
# a drain that cancels thousands of runs at once, at ~100 bytes an entry.
RELEASED_RUNS_REMEMBERED: Final = 4096
# The node loses an edge silent for this many times the edge's ping interval
# (``heartbeat_timeout_s``): the edge pings only a node it sent nothing to
# for that long, and a ping may be a whole interval late on a loaded edge.
# The edge's own detection of a lost node is the tight one (2 s); a frozen
# edge is noticed by its nodes within 4 s at the defaults.
EDGE_SILENCE_FACTOR: Final = 2.0
# The smallest frame limit a peer may announce (0 means "the legacy 16 MiB"):
# below the edge's own config minimum (``link.max_hello_bytes`` >= 1024),
# with room for the ``event_too_large`` error (~250 bytes with its envelope)
# that ends a run whose event would not fit.
MIN_PEER_FRAME_BYTES: Final = 512
# How long a node holds a collected run's events (``Assign.collect``) before
# it sends what it has: between one and two of these. Well below the edge's
# first-token and idle deadlines, which must still see the run progress.
COLLECT_FLUSH_S: Final = 1.0
# A collected run's consecutive text deltas are merged up to this many
# characters per event (a bound on the copying each merge costs).
COLLECT_MERGE_CHARS: Final = 2048
# A node repeats an unchanged load report after this share of the edge's
# ``load_stale_s``: three chances before the edge would ignore it.
LOAD_REFRESH_FRACTION: Final = 1 / 3
# The largest msgpack array header (``array_header``): a frame's bytes are
# this plus its messages'.
_BATCH_HEADER_MAX: Final = 5


class LinkState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    OPEN = "open"
    CLOSED = "closed"


class RunPhase(enum.Enum):
    """Where a run is on the link (the module's table says what each allows)."""

    ASSIGNED = "assigned"
    STREAMING = "streaming"
    ENDING = "ending"
    DONE = "done"

    # ``RunLink.advance`` looks a (phase, trigger) pair up for every events
    # message, and ``Enum.__hash__`` hashes the member's name in Python;
    # members are singletons compared by identity, so their identity hashes.
    __hash__ = object.__hash__


class RunTrigger(enum.Enum):
    """What moves a run from one ``RunPhase`` to another (``RUN_TRANSITIONS``)."""

    EVENTS = "events"  # an events message without the run's terminal event
    TERMINAL = "terminal"  # the events message with it
    CANCEL = "cancel"  # the edge's ``Cancel``

    __hash__ = object.__hash__  # as ``RunPhase``'s


# Every transition a run may take, (phase, trigger) -> next phase; a pair
# not here is refused (``RunLink.advance``). The module docstring draws it.
RUN_TRANSITIONS: Final[Mapping[tuple[RunPhase, RunTrigger], RunPhase]] = {
    (RunPhase.ASSIGNED, RunTrigger.EVENTS): RunPhase.STREAMING,
    (RunPhase.ASSIGNED, RunTrigger.TERMINAL): RunPhase.DONE,
    (RunPhase.ASSIGNED, RunTrigger.CANCEL): RunPhase.ENDING,
    (RunPhase.STREAMING, RunTrigger.EVENTS): RunPhase.STREAMING,
    (RunPhase.STREAMING, RunTrigger.TERMINAL): RunPhase.DONE,
    (RunPhase.STREAMING, RunTrigger.CANCEL): RunPhase.ENDING,
    # Late events: the node sent them before the cancel reached it.
    (RunPhase.ENDING, RunTrigger.EVENTS): RunPhase.ENDING,
    (RunPhase.ENDING, RunTrigger.TERMINAL): RunPhase.DONE,
}
# The trigger of an events message, indexed by whether it ends the run. The
# per-message paths index this rather than name a member: on Python 3.11 a
# member lookup (``RunTrigger.EVENTS``) costs ~70 ns, as ``EnumType`` has a
# ``__getattr__``, more than the transition itself.
_EVENTS_TRIGGER: Final = (RunTrigger.EVENTS, RunTrigger.TERMINAL)


class RunLink:
    """One run's link state, on either end.

    Attributes:
        phase: Where the run is (changed only by ``advance``).
        credit: Non-terminal events the node may still send.
        window: The credit the run was assigned with.
        seq: Event messages of the run so far (sent by the node, or
            received by the edge); each carries its number.
        queued: (node) Events not sent yet, in order.
        consumed: (edge) Events the consumer took that were not yet
            returned as credit.
        collect: The run's events are collected, not streamed
            (``Assign.collect``): the node holds and merges them.
        output_seen: (node) A collected run's first output was queued (it
            goes at once; what follows is held).
        timeline: (node) The run's timeline, sent with its terminal event.
    """

    __slots__ = (
        "collect",
        "consumed",
        "credit",
        "output_seen",
        "phase",
        "queued",
        "seq",
        "timeline",
        "window",
    )

    def __init__(self, credit: int, *, collect: bool = False) -> None:
        self.phase = RunPhase.ASSIGNED  # where RUN_TRANSITIONS starts
        self.credit = credit
        self.window = credit
        self.seq = 0
        # A list, not a deque: an empty deque is 760 bytes, and an edge or a
        # node holds one RunLink per open stream (docs/benchmarks.md,
        # "Memory", "Second pass"); the queue is at most a window long.
        self.queued: list[RuntimeEvent] = []
        self.consumed = 0
        self.collect = collect
        self.output_seen = False
        self.timeline: NodeTimeline | None = None

    def can(self, trigger: RunTrigger) -> bool:
        """Whether ``RUN_TRANSITIONS`` takes ``trigger`` in the run's phase."""
        return (self.phase, trigger) in RUN_TRANSITIONS

    def advance(
        self,
        trigger: RunTrigger,
        run_id: str,
        refused: type[InvariantError] | type[LinkProtocolError] = InvariantError,
    ) -> RunPhase:
        """Move the run as ``RUN_TRANSITIONS`` says: the one place ``phase`` changes.

        Args:
            trigger: What happened to the run.
            run_id: The run's id, for the error.
            refused: What a transition the table does not have is: a bug
                here (the default), or the peer's fault (``LinkProtocolError``
                for what the edge received).

        Returns:
            The run's new phase.

        Raises:
            InvariantError: (or ``refused``) The table has no such transition.
        """
        phase = RUN_TRANSITIONS.get((self.phase, trigger))
        if phase is None:
            raise refused(f"run {run_id}: {trigger.value} in phase {self.phase.value}")
        self.phase = phase
        return phase


def _without_timeline(run: RunLink) -> RunLink:
    run.timeline = None
    return run


# --- link events ----------------------------------------------------------------


class NodeJoined(msgspec.Struct, frozen=True):
    hello: Hello


class CapabilitiesChanged(msgspec.Struct, frozen=True):
    instances: list[Capabilities]
    # The node's on-demand models (None: it sent none).
    models: list[ModelOffer] | None = None


class RunEventsReceived(msgspec.Struct, frozen=True):
    """Events of a run the edge still wants (``finished``: the last is its terminal).

    ``timeline``: the node's side of the run, with its terminal. A run the
    edge already gave up on (ENDING) yields only this: no events, its
    timeline.
    """

    run_id: str
    events: list[RuntimeEvent]
    finished: bool
    timeline: NodeTimeline | None = None


class NodeDraining(msgspec.Struct, frozen=True):
    reason: str


class LoadReported(msgspec.Struct, frozen=True):
    """The node's instances' live load (``LoadReport``), received at ``at``."""

    instances: list[InstanceLoad]
    at: float


class ModelLoadAnswered(msgspec.Struct, frozen=True):
    """The node's answer to the edge's ``LoadModel`` (``EdgeSession.load_model``)."""

    result: ModelLoadResult


class ModelControlAnswered(msgspec.Struct, frozen=True):
    """The node's answer to the edge's ``ControlModel`` (``EdgeSession.control_model``)."""

    result: ModelControlResult


class Welcomed(msgspec.Struct, frozen=True):
    welcome: Welcome


class AssignReceived(msgspec.Struct, frozen=True):
    assign: Assign


class CreditReceived(msgspec.Struct, frozen=True):
    run_id: str
    credit: int


class CancelReceived(msgspec.Struct, frozen=True):
    cancel: Cancel


class LoadModelReceived(msgspec.Struct, frozen=True):
    """The edge asks the node to load an on-demand model (answer with
    ``NodeSession.model_load_result``)."""

    request: LoadModel


class ModelControlReceived(msgspec.Struct, frozen=True):
    """An operator's action on an on-demand model (answer with
    ``NodeSession.model_control_result``)."""

    request: ControlModel


EdgeLinkEvent = (
    NodeJoined
    | CapabilitiesChanged
    | RunEventsReceived
    | NodeDraining
    | LoadReported
    | ModelLoadAnswered
    | ModelControlAnswered
)
NodeLinkEvent = (
    Welcomed
    | AssignReceived
    | CreditReceived
    | CancelReceived
    | LoadModelReceived
    | ModelControlReceived
)


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


class _Outgoing:
    """Encoded messages waiting for the next frame, and when a frame last went."""

    __slots__ = ("last_sent", "messages")

    def __init__(self, now: float) -> None:
        self.messages: list[bytes] = []
        self.last_sent = now

    def frames(self, limit: int, now: float) -> list[bytes]:
        """Everything queued, packed into frames of at most ``limit`` bytes."""
        messages = self.messages
        if not messages:
            return []
        self.messages = []
        self.last_sent = now
        room = limit - _BATCH_HEADER_MAX
        frames: list[bytes] = []
        current: list[bytes] = []
        used = 0
        for m in messages:
            if current and used + len(m) > room:
                frames.append(array_header(len(current)) + b"".join(current))
                current, used = [], 0
            current.append(m)
            used += len(m)
        frames.append(array_header(len(current)) + b"".join(current))
        return frames


class EdgeSession:
    """The edge's end of one node link.

    Args:
        tokens: Node tokens accepted: shared tokens in clear, or the edge's
            ``NodeCredentials`` (compared in constant time either way).
        heartbeat_interval_s: How long the node may send nothing before it
            pings (told to it in the welcome).
        heartbeat_timeout_s: Silence after which the node is lost; also how
            long the edge sends nothing to the node before it pings.
        now: The current time.
        max_hello_bytes: Largest frame before the hello is accepted.
        max_frame_bytes: Largest frame after it (sent to the node in the welcome).
        control_rate_per_s: Sustained rate of messages that cost no credit.
        control_burst: Of those, how many may come at once.
        load_reports_per_s: Load reports a second the node may send (told
            to it in the welcome; 0: none); they draw from the same bucket.
        load_stale_s: Age past which the edge ignores a load report (told
            to the node, which repeats its report before then).
    """

    def __init__(
        self,
        *,
        tokens: Iterable[str] | NodeCredentials,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        now: float,
        max_hello_bytes: int = DEFAULT_MAX_HELLO_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        control_rate_per_s: float = DEFAULT_CONTROL_RATE_PER_S,
        control_burst: int = DEFAULT_CONTROL_BURST,
        load_reports_per_s: float = 0.0,
        load_stale_s: float = 0.0,
    ) -> None:
        self.load_reports_per_s = load_reports_per_s
        self.load_stale_s = load_stale_s
        self._credentials = (
            tokens if isinstance(tokens, NodeCredentials) else NodeCredentials(shared=tokens)
        )
        # The credential the accepted hello presented (None before).
        self.credential: NodeCredential | None = None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_hello_bytes = max_hello_bytes
        self.max_frame_bytes = max_frame_bytes
        # What the node accepts (from its hello).
        self.peer_max_frame_bytes = LEGACY_MAX_FRAME_BYTES
        self.state = LinkState.AWAIT_HELLO
        self.node_id = ""
        self.last_seen = now
        # Runs the edge still wants (ASSIGNED, STREAMING), and the ENDING
        # ones whose late events are still expected, oldest first.
        self._runs: dict[str, RunLink] = {}
        self._ending: OrderedDict[str, RunLink] = OrderedDict()
        self._control = _TokenBucket(control_rate_per_s, control_burst, now)
        self._out = _Outgoing(now)
        self._nonce = 0
        # LoadModel requests sent and not answered yet.
        self._model_loads: set[str] = set()
        # ControlModel requests sent and not answered yet; whether the
        # node's hello said it takes them.
        self._model_controls: set[str] = set()
        self.peer_model_controls = False

    # --- state --------------------------------------------------------------

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
    def next_ping_at(self) -> float:
        """When ``tick`` will next queue a ping (if nothing is sent meanwhile)."""
        return self._out.last_sent + self.heartbeat_timeout_s

    @property
    def next_tick_at(self) -> float:
        """When ``tick`` next has something to do."""
        return self.next_ping_at

    @property
    def runs(self) -> frozenset[str]:
        """Runs the edge still wants (assigned or streaming)."""
        return frozenset(self._runs)

    def run(self, run_id: str) -> RunLink | None:
        """A run's link state (None: not on the link, or done)."""
        return self._runs.get(run_id) or self._ending.get(run_id)

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out.messages)

    # --- input --------------------------------------------------------------

    def receive(self, frame: bytes, now: float) -> list[EdgeLinkEvent]:
        """Process one frame; return its link events (possibly none).

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
        if self.state is LinkState.AWAIT_HELLO:
            hello = decode_node_message(frame)
            self.last_seen = now
            if not isinstance(hello, Hello):
                raise LinkProtocolError(f"expected hello, got {type(hello).__name__}")
            return [NodeJoined(self._accept(hello))]
        batch = decode_node_batch(frame)
        self.last_seen = now
        events: list[EdgeLinkEvent] = []
        for msg in batch:
            if isinstance(msg, RunEvents):
                received = self._run_events(msg)
                if received is not None:
                    events.append(received)
                continue
            if not self._control.take(now):
                raise LinkLimitError(
                    f"node {self.node_id!r} exceeds the link's message rate "
                    f"({type(msg).__name__} after the burst was spent)",
                    close_code=CLOSE_RATE,
                )
            if isinstance(msg, Ping):
                continue
            if isinstance(msg, CapabilitiesUpdate):
                events.append(CapabilitiesChanged(msg.instances, msg.models))
            elif isinstance(msg, LoadReport):
                events.append(LoadReported(msg.instances, now))
            elif isinstance(msg, Goodbye):
                events.append(NodeDraining(msg.reason))
            elif isinstance(msg, ModelLoadResult):
                if msg.request_id not in self._model_loads:
                    raise LinkProtocolError(f"model_load answers no load_model {msg.request_id!r}")
                self._model_loads.discard(msg.request_id)
                events.append(ModelLoadAnswered(msg))
            elif isinstance(msg, ModelControlResult):
                if msg.request_id not in self._model_controls:
                    raise LinkProtocolError(
                        f"model_control answers no control_model {msg.request_id!r}"
                    )
                self._model_controls.discard(msg.request_id)
                events.append(ModelControlAnswered(msg))
            else:
                raise LinkProtocolError(f"unexpected {type(msg).__name__} on an open link")
        return events

    def _accept(self, hello: Hello) -> Hello:
        if hello.protocol_version != PROTOCOL_VERSION:
            raise LinkAuthError(
                f"node {hello.node_id!r} speaks protocol {hello.protocol_version}, "
                f"this edge speaks {PROTOCOL_VERSION}"
            )
        self.credential = self._credentials.check(hello.token, hello.node_id)
        if not hello.node_id:
            raise LinkProtocolError("hello without a node id")
        if hello.max_frame_bytes < 0 or 0 < hello.max_frame_bytes < MIN_PEER_FRAME_BYTES:
            raise LinkProtocolError(f"hello with max_frame_bytes {hello.max_frame_bytes}")
        self.node_id = hello.node_id
        self.peer_model_controls = hello.model_controls
        if hello.max_frame_bytes:
            self.peer_max_frame_bytes = hello.max_frame_bytes
        self.state = LinkState.OPEN
        return hello

    def welcome(self) -> bytes:
        """The welcome frame answering the accepted hello."""
        if self.state is not LinkState.OPEN:
            raise InvariantError(f"welcome on a link that is {self.state.value}")
        return encode(
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                node_id=self.node_id,
                heartbeat_interval_s=self.heartbeat_interval_s,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                max_frame_bytes=self.max_frame_bytes,
                load_reports_per_s=self.load_reports_per_s,
                load_stale_s=self.load_stale_s,
            )
        )

    def _run_events(self, msg: RunEvents) -> RunEventsReceived | None:
        run_id = msg.run_id
        if not msg.events:
            raise LinkProtocolError(f"run {run_id}: an events message with no events")
        run = self._runs.get(run_id)
        ending = run is None
        if run is None:
            run = self._ending.get(run_id)
            if run is None:
                raise LinkProtocolError(
                    f"events for run {run_id!r}, which is not assigned on this link"
                )
        if msg.seq != run.seq:
            raise LinkProtocolError(f"run {run_id}: message {msg.seq}, expected {run.seq}")
        run.seq += 1
        finished = False
        used = 0
        last = len(msg.events) - 1
        for i, ev in enumerate(msg.events):
            if is_terminal(ev):
                if i != last:
                    raise LinkProtocolError(f"run {run_id}: events after the terminal event")
                finished = True
            else:
                used += 1
        if used > run.credit:
            raise LinkProtocolError(f"run {run_id}: {used} events sent with {run.credit} credit")
        run.credit -= used
        # The lookups above already refuse a run the edge forgot (DONE).
        run.advance(_EVENTS_TRIGGER[finished], run_id, refused=LinkProtocolError)
        if finished:
            if ending:
                del self._ending[run_id]
            else:
                del self._runs[run_id]
        if ending:
            # Late events of a cancelled run: checked, and dropped; its
            # timeline still says how the node ended it.
            if finished and msg.timeline is not None:
                return RunEventsReceived(run_id, [], True, msg.timeline)
            return None
        return RunEventsReceived(run_id, msg.events, finished, msg.timeline if finished else None)

    # --- output -------------------------------------------------------------

    def assign(
        self,
        run_id: str,
        instance: str,
        spec: ExecutionSpec,
        credit: int = DEFAULT_RUN_WINDOW,
        *,
        collect: bool = False,
        collect_flush_s: float = 0.0,
    ) -> None:
        """Queue the assignment of a run to the node.

        Raises:
            RequestError: 413: the message is larger than the node accepts
                (the run is not assigned; the link is untouched).
        """
        self._require_open()
        if run_id in self._runs or run_id in self._ending:
            raise InvariantError(f"run {run_id} is already assigned on this link")
        if credit < 0:
            # The node would close the link under every run on it.
            raise InvariantError(f"run {run_id}: negative credit {credit}")
        message = encode(
            Assign(
                run_id=run_id,
                instance=instance,
                spec=spec,
                credit=credit,
                collect=collect,
                collect_flush_s=collect_flush_s,
            )
        )
        if len(message) + _BATCH_HEADER_MAX > self.peer_max_frame_bytes:
            raise RequestError(
                f"the request is too large for node {self.node_id!r}: it takes "
                f"{len(message)} bytes on the node link, the node accepts "
                f"{self.peer_max_frame_bytes}",
                status=413,
                code=ErrorCode.REQUEST_TOO_LARGE,
            )
        self._runs[run_id] = RunLink(credit, collect=collect)
        self._out.messages.append(message)

    def consumed(self, run_id: str, events: int) -> bool:
        """The run's consumer took ``events`` non-terminal events.

        Credit goes back to the node half a window at a time (one ``Credit``
        per half window, in the next frame). Returns whether a message was
        queued.
        """
        run = self._runs.get(run_id)
        if run is None or events <= 0 or self.state is not LinkState.OPEN:
            return False
        run.consumed += events
        if run.consumed * 2 < run.window:
            return False
        credit, run.consumed = run.consumed, 0
        run.credit += credit
        self._out.messages.append(encode(Credit(run_id=run_id, credit=credit)))
        return True

    def load_model(self, request_id: str, model: str) -> None:
        """Ask the node to load its on-demand ``model`` (one its hello or
        capabilities offered: an older node, which offers none, would close
        the link on the unknown message); the answer is a ``ModelLoadAnswered``."""
        self._require_open()
        self._model_loads.add(request_id)
        self._out.messages.append(encode(LoadModel(request_id=request_id, model=model)))

    def control_model(self, request_id: str, model: str, action: ModelAction, by: str = "") -> None:
        """Ask the node for an operator's ``action`` on its on-demand ``model``;
        the answer is a ``ModelControlAnswered``.

        Raises:
            InvariantError: The node's hello did not say it takes them
                (``peer_model_controls``): an older node would close the link.
        """
        self._require_open()
        if not self.peer_model_controls:
            raise InvariantError(f"node {self.node_id!r} takes no control_model")
        self._model_controls.add(request_id)
        self._out.messages.append(
            encode(ControlModel(request_id=request_id, model=model, action=action, by=by))
        )

    def cancel(self, run_id: str, reason: CancelReason, message: str = "") -> bool:
        """Queue the cancel of a run: it is ENDING, its late events are dropped.

        Returns whether a message was queued (not for a run that is over).
        """
        run = self._runs.pop(run_id, None)
        if run is None or self.state is not LinkState.OPEN:
            return False
        run.advance(RunTrigger.CANCEL, run_id)  # _runs holds ASSIGNED and STREAMING runs
        self._ending[run_id] = run
        while len(self._ending) > RELEASED_RUNS_REMEMBERED:
            self._ending.popitem(last=False)
        self._out.messages.append(encode(Cancel(run_id=run_id, reason=reason, message=message)))
        return True

    def tick(self, now: float) -> None:
        """Queue a ping if nothing went to the node for ``heartbeat_timeout_s``."""
        if self.state is LinkState.OPEN and now >= self.next_ping_at and not self._out.messages:
            self._nonce += 1
            self._out.messages.append(encode(Ping(nonce=self._nonce)))

    def sweep(self, now: float) -> None:
        """One of the edge's ping sweeps, every ``heartbeat_timeout_s`` over all
        its links at once (``iop.runtime.LinkClock``): queue a ping if nothing
        went to the node for half that. A link the previous sweep pinged is
        pinged again (its ping left a little after that sweep); the node hears
        from the edge at least every 1.5 timeouts, inside its 2."""
        if (
            self.state is LinkState.OPEN
            and now - self._out.last_sent >= self.heartbeat_timeout_s / 2
            and not self._out.messages
        ):
            self._nonce += 1
            self._out.messages.append(encode(Ping(nonce=self._nonce)))

    def data_to_send(self, now: float) -> list[bytes]:
        """Everything queued, in as few frames as the node accepts."""
        return self._out.frames(self.peer_max_frame_bytes, now)

    def close(self) -> frozenset[str]:
        """Mark the link closed; return the runs the edge still wanted."""
        self.state = LinkState.CLOSED
        lost = frozenset(self._runs)
        self._runs.clear()
        self._ending.clear()
        self._out.messages.clear()
        return lost

    def _require_open(self) -> None:
        if self.state is not LinkState.OPEN:
            raise InvariantError(f"link is {self.state.value}")


# msgpack envelope of an events message besides its events and run id (tag,
# keys, seq, array header), generously.
_EVENTS_MESSAGE_OVERHEAD: Final = 64
_EVENT_ENCODER: Final = msgspec.msgpack.Encoder()


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
        load_reports_per_s: Most load reports a second (the edge's welcome
            may lower it; 0: none).
        load_source: The instances' load right now, for a report that is
            due (called by the session, at most once per report).
    """

    def __init__(
        self,
        *,
        node_id: str,
        token: str,
        now: float,
        heartbeat_timeout_s: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        load_reports_per_s: float = 0.0,
        load_source: Callable[[], list[InstanceLoad]] | None = None,
    ) -> None:
        self._load_rate = load_reports_per_s
        self._load_source = load_source
        # Off until a welcome that asks for reports (``_start_load``).
        self._load_every = math.inf
        self._load_refresh_every = math.inf
        self._load_dirty = False
        self._load_sent_at = -math.inf
        # The last load report queued (``_load_queued``: is it still waiting?).
        self._load_msg: bytes | None = None
        self.node_id = node_id
        self.max_frame_bytes = max_frame_bytes
        # What the edge accepts (from its welcome; until then, what an edge
        # from before Welcome.max_frame_bytes accepted).
        self.peer_max_frame_bytes = LEGACY_MAX_FRAME_BYTES
        self._token = token
        self.state = LinkState.AWAIT_WELCOME
        self.last_seen = now
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_timeout_s / 2
        self._runs: dict[str, RunLink] = {}
        # Runs with events to send, in the order they became ready.
        self._ready: dict[str, None] = {}
        # Collected runs holding events: since before the last flush check
        # (sent at the next), and since it.
        self._held_old: dict[str, None] = {}
        self._held_new: dict[str, None] = {}
        self._flush_check_at = now
        self._flush_every = COLLECT_FLUSH_S
        self._cut_off: list[str] = []
        self._out = _Outgoing(now)
        # The edge's last ping that the node did not answer (``_answer``).
        self._in_step_at = -math.inf
        self._nonce = 0

    # --- state --------------------------------------------------------------

    @property
    def liveness_deadline(self) -> float:
        return self.last_seen + self.heartbeat_timeout_s

    @property
    def next_ping_at(self) -> float:
        """When ``tick`` will next queue a ping (if nothing is sent meanwhile):
        an interval after the last frame, or after the edge's last ping if
        that came later and was not answered (``_answer``)."""
        return max(self._out.last_sent, self._in_step_at) + self.heartbeat_interval_s

    @property
    def next_tick_at(self) -> float:
        """When ``tick`` next has something to do: a ping, held events to
        flush, or a load report to send.

        No ping while something is queued for the writer: it goes out when
        the writer can send, and says as much. (A writer held up by the
        link's flow control leaves ``last_sent`` behind: a deadline taken
        from it would be in the past, and the reader would wake to ``tick``
        without pause, a core spent doing nothing.) Likewise no new load
        report while the last one still waits for the writer: at most one is
        queued, however long the link is held up.
        """
        at = math.inf if self.has_data_to_send else self.next_ping_at
        if self._held_old or self._held_new:
            at = min(at, self._flush_check_at)
        if self._load_queued:
            return at
        return min(at, self.next_load_at)

    @property
    def _load_queued(self) -> bool:
        """Whether the last load report is still among the queued messages."""
        msg = self._load_msg
        return msg is not None and any(m is msg for m in self._out.messages)

    @property
    def next_load_at(self) -> float:
        """When the next load report goes (inf: none planned)."""
        if self._load_every == math.inf:
            return math.inf
        last = self._load_sent_at
        if self._load_dirty:
            return last + self._load_every
        return last + self._load_refresh_every

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out.messages) or bool(self._ready)

    def run(self, run_id: str) -> RunLink | None:
        """A run's link state (None: not on the link, or done)."""
        return self._runs.get(run_id)

    def credit(self, run_id: str) -> int:
        """Non-terminal events the run may send now."""
        run = self._runs.get(run_id)
        return 0 if run is None else run.credit

    def unsent(self, run_id: str) -> int:
        """Events queued for a run without per-run credit (assigned with
        ``UNLIMITED_CREDIT``) that did not go out yet; 0 for any other run,
        whose credit bounds them."""
        run = self._runs.get(run_id)
        return 0 if run is None or run.window < UNLIMITED_CREDIT else len(run.queued)

    def backlog(self, run_id: str) -> int:
        """Events queued for the run beyond what its credit lets go out."""
        run = self._runs.get(run_id)
        return 0 if run is None else max(0, len(run.queued) - run.credit)

    # --- input --------------------------------------------------------------

    def hello(
        self,
        instances: list[Capabilities],
        software: str = "",
        *,
        models: list[ModelOffer] | None = None,
        memory_mib: int = 0,
        model_controls: bool = False,
    ) -> bytes:
        return encode(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                node_id=self.node_id,
                token=self._token,
                instances=instances,
                software=software,
                max_frame_bytes=self.max_frame_bytes,
                models=models or [],
                memory_mib=memory_mib,
                model_controls=model_controls,
            )
        )

    def receive(self, frame: bytes, now: float) -> list[NodeLinkEvent]:
        """Process one frame from the edge; return its link events.

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
        if self.state is LinkState.AWAIT_WELCOME:
            welcome = decode_edge_message(frame)
            self.last_seen = now
            if not isinstance(welcome, Welcome):
                raise LinkProtocolError(f"expected welcome, got {type(welcome).__name__}")
            if (
                welcome.max_frame_bytes < 0
                or 0 < welcome.max_frame_bytes < MIN_PEER_FRAME_BYTES
                or not welcome.heartbeat_timeout_s > 0
                or not 0 < welcome.heartbeat_interval_s < welcome.heartbeat_timeout_s
            ):
                raise LinkProtocolError("welcome with a negative limit or timeout")
            self.state = LinkState.OPEN
            # The edge pings every heartbeat_timeout_s of its own silence.
            self.heartbeat_timeout_s = welcome.heartbeat_timeout_s * EDGE_SILENCE_FACTOR
            self.heartbeat_interval_s = welcome.heartbeat_interval_s
            if welcome.max_frame_bytes:
                self.peer_max_frame_bytes = welcome.max_frame_bytes
            self._start_load(welcome, now)
            return [Welcomed(welcome)]
        batch = decode_edge_batch(frame)
        self.last_seen = now
        events: list[NodeLinkEvent] = []
        for msg in batch:
            if isinstance(msg, Credit):
                events.append(self._credit(msg))
            elif isinstance(msg, Assign):
                events.append(self._assign(msg))
            elif isinstance(msg, Cancel):
                self._cancel(msg.run_id)
                events.append(CancelReceived(msg))
            elif isinstance(msg, Ping):
                self._answer(now)
            elif isinstance(msg, LoadModel):
                events.append(LoadModelReceived(msg))
            elif isinstance(msg, ControlModel):
                events.append(ModelControlReceived(msg))
            else:
                raise LinkProtocolError(f"unexpected {type(msg).__name__} on an open link")
        return events

    def _start_load(self, welcome: Welcome, now: float) -> None:
        """Load reports at the lower of the edge's rate and ours; the first one now."""
        rate = min(self._load_rate, welcome.load_reports_per_s)
        if self._load_source is None or not rate > 0 or not math.isfinite(rate):
            return
        self._load_every = 1.0 / rate
        if welcome.load_stale_s > 0 and math.isfinite(welcome.load_stale_s):
            self._load_refresh_every = max(
                welcome.load_stale_s * LOAD_REFRESH_FRACTION, self._load_every
            )
        self._load_dirty = True
        self._queue_load(now)

    def load_changed(self, now: float) -> bool:
        """The load changed: a report goes now if the last is an interval old,
        else at the end of the interval (``tick``), with the figures then.

        Returns:
            Whether the driver must be woken: a report was queued, or one is
            now due at a tick (``next_tick_at`` moved up). False while a
            report is pending already, so a burst of changes costs no wake-ups.
        """
        if self._load_every == math.inf or self.state is not LinkState.OPEN:
            return False
        if self._load_queued:
            # The last report still waits for the writer (a link held up):
            # the next one follows it, with the figures of then.
            self._load_dirty = True
            return False
        if now >= self._load_sent_at + self._load_every:
            self._queue_load(now)
            return True
        if self._load_dirty:
            return False
        self._load_dirty = True
        return True

    def _queue_load(self, now: float) -> None:
        assert self._load_source is not None
        self._load_msg = encode(LoadReport(instances=self._load_source()))
        self._out.messages.append(self._load_msg)
        self._load_dirty = False
        self._load_sent_at = now

    def _answer(self, now: float) -> None:
        """An edge ping: get in step with it. The edge pings all its quiet
        links in one sweep (``EdgeSession.sweep``); if each node's frames
        follow the sweep, the edge wakes once for many of them.

        The node pings back at once if it sent nothing for a quarter of its
        interval (so its own next ping comes one interval after the sweep);
        if it did, that frame already proved it alive, and its next ping
        comes one interval after the edge's instead of after its own (the
        longest silence is then 1.25 intervals, once). Something queued
        goes out anyway and says as much as a ping."""
        if self.has_data_to_send:
            return
        if now - self._out.last_sent >= self.heartbeat_interval_s / 4:
            self._heartbeat(now)
        else:
            self._in_step_at = now

    def _heartbeat(self, now: float) -> None:
        """A ping; or the load report, when its refresh would be due before the
        next heartbeat: it says as much, and an idle link then sends no more
        frames for its reports than it did for its pings."""
        refresh = self._load_refresh_every
        if refresh != math.inf and now + self.heartbeat_interval_s >= self._load_sent_at + refresh:
            self._queue_load(now)
            return
        self._nonce += 1
        self._out.messages.append(encode(Ping(nonce=self._nonce)))

    def _assign(self, msg: Assign) -> AssignReceived:
        if msg.run_id in self._runs:
            raise LinkProtocolError(f"run {msg.run_id} assigned twice")
        if msg.credit < 0:
            raise LinkProtocolError(f"run {msg.run_id}: negative credit")
        self._runs[msg.run_id] = RunLink(msg.credit, collect=msg.collect)
        if msg.collect and 0 < msg.collect_flush_s < self._flush_every:
            # The edge's deadlines are shorter than the default hold.
            self._flush_every = msg.collect_flush_s
        return AssignReceived(msg)

    def _credit(self, msg: Credit) -> CreditReceived:
        if msg.credit <= 0:
            raise LinkProtocolError(f"run {msg.run_id}: credit {msg.credit}")
        run = self._runs.get(msg.run_id)
        if run is not None:
            # Credit for a run that ended here meanwhile is late, not wrong.
            run.credit += msg.credit
            if run.queued:
                self._ready[msg.run_id] = None
        return CreditReceived(msg.run_id, msg.credit)

    def _cancel(self, run_id: str) -> None:
        run = self._runs.get(run_id)
        if run is None or not run.can(RunTrigger.CANCEL):
            return  # ended here meanwhile, or ENDING already: its terminal is on the way
        run.advance(RunTrigger.CANCEL, run_id)
        kept = [ev for ev in run.queued if is_terminal(ev)]
        run.queued = kept
        if kept:
            # It may have waited for credit behind the events just dropped.
            self._ready[run_id] = None

    # --- output -------------------------------------------------------------

    def push(self, run_id: str, event: RuntimeEvent, timeline: NodeTimeline | None = None) -> None:
        """Queue one of the run's events for the edge (a terminal one with
        the run's ``timeline``, when the node keeps one).

        An ENDING run's non-terminal events are dropped. A terminal
        ``Cancelled`` drops the run's events its credit does not cover: the
        run was cancelled, nobody waits for them, and the terminal must not
        wait for credit behind them.

        Raises:
            InvariantError: The run is not on the link, or its terminal
                event was queued already (a bug in the node's driver).
        """
        run = self._runs.get(run_id)
        if run is None:
            raise InvariantError(f"run {run_id} is not on this link")
        queued = run.queued
        if queued and is_terminal(queued[-1]):
            raise InvariantError(f"run {run_id}: {type(event).__name__} after its terminal")
        if is_terminal(event):
            if isinstance(event, Cancelled) and len(queued) > run.credit:
                del queued[run.credit :]
            queued.append(event)
            run.timeline = timeline
            self._ready[run_id] = None
            return
        if run.phase is RunPhase.ENDING:
            return
        if run.collect:
            self._hold(run_id, run, event)
            return
        queued.append(event)
        if isinstance(event, Start):
            # Held for the run's first output or terminal: the edge needs
            # nothing from a Start alone (its consumer waits for output), and
            # a frame of its own costs both processes a send, a read and a
            # wake-up while the backend computes the first token, on this
            # 2-core path (docs/benchmarks.md, "Fixed cost and the first
            # chunk at c=1 (second pass)").
            return
        if run.credit >= len(queued) or (run.credit and isinstance(queued[0], Start)):
            # Within credit (with a held Start: at least the Start is).
            self._ready[run_id] = None

    def _hold(self, run_id: str, run: RunLink, event: RuntimeEvent) -> None:
        """Queue a collected run's event, merged into the text before it when it can be."""
        queued = run.queued
        if not run.output_seen and not isinstance(event, Start):
            # The first output goes at once: the edge's first-token deadline
            # measures the backend, not this hold.
            run.output_seen = True
            queued.append(event)
            self._ready[run_id] = None
            return
        last = queued[-1] if queued else None
        if (
            isinstance(event, Delta | ReasoningDelta)
            and type(last) is type(event)
            and len(last.text) < COLLECT_MERGE_CHARS
        ):
            queued[-1] = type(event)(last.text + event.text)
        else:
            queued.append(event)
        if len(queued) >= run.credit:
            self._ready[run_id] = None  # as much as its credit: send it
        elif run_id not in self._held_old:
            self._held_new[run_id] = None

    def reject(self, run_id: str, error: Error) -> None:
        """End an assigned run that never started, with ``error``."""
        self.push(run_id, error)

    def capabilities(
        self, instances: list[Capabilities], models: list[ModelOffer] | None = None
    ) -> None:
        self._out.messages.append(encode(CapabilitiesUpdate(instances=instances, models=models)))

    def model_load_result(self, result: ModelLoadResult) -> None:
        """Answer the edge's ``LoadModel``."""
        if self.state is LinkState.OPEN:
            self._out.messages.append(encode(result))

    def model_control_result(self, result: ModelControlResult) -> None:
        """Answer the edge's ``ControlModel``."""
        if self.state is LinkState.OPEN:
            self._out.messages.append(encode(result))

    def goodbye(self, reason: str = "") -> None:
        self._out.messages.append(encode(Goodbye(reason=reason)))

    def tick(self, now: float) -> None:
        """Queue a ping if nothing went to the edge for ``heartbeat_interval_s``;
        make the events collected runs held since before the last check sendable."""
        if self.state is not LinkState.OPEN:
            return
        if now >= self.next_load_at and not self._load_queued:
            self._queue_load(now)  # also says the node is alive: no ping
        if now >= self.next_ping_at and not self.has_data_to_send:
            self._heartbeat(now)
        if now >= self._flush_check_at:
            for run_id in self._held_old:
                run = self._runs.get(run_id)
                if run is not None and run.queued:
                    self._ready[run_id] = None
            self._held_old, self._held_new = self._held_new, {}
            self._flush_check_at = now + self._flush_every

    def take_cut_off(self) -> list[str]:
        """Runs ended with ``event_too_large`` by ``data_to_send`` since the last call."""
        cut, self._cut_off = self._cut_off, []
        return cut

    def data_to_send(self, now: float) -> list[bytes]:
        """Every run's sendable events and the queued messages, in few frames.

        A run sends what its credit covers, and its terminal event whenever
        it is next. A run whose terminal went out is DONE and forgotten.
        """
        limit = self.peer_max_frame_bytes
        ready, self._ready = self._ready, {}
        out = self._out.messages
        done = RunPhase.DONE
        for run_id in ready:
            run = self._runs.get(run_id)
            if run is None:
                continue
            batch = self._take(run)
            if not batch:
                continue
            out.extend(self._messages(run_id, run, batch, limit))
            phase = run.phase
            if phase is not done:  # else ``_messages`` cut the run off
                phase = run.advance(_EVENTS_TRIGGER[is_terminal(batch[-1])], run_id)
            if phase is done:
                del self._runs[run_id]
        return self._out.frames(limit, now)

    @staticmethod
    def _take(run: RunLink) -> list[RuntimeEvent]:
        queued = run.queued
        credit = run.credit
        taken = 0
        for ev in queued:
            if not is_terminal(ev):
                if credit == 0:
                    break
                credit -= 1
            taken += 1
        run.credit = credit
        if taken == len(queued):
            run.queued = []
            return queued
        batch = queued[:taken]
        del queued[:taken]
        return batch

    def _messages(
        self, run_id: str, run: RunLink, batch: list[RuntimeEvent], limit: int
    ) -> list[bytes]:
        """``batch`` as events messages, each fitting a frame of ``limit`` bytes."""
        timeline = run.timeline if batch and is_terminal(batch[-1]) else None
        try:
            message = encode(RunEvents(run_id=run_id, seq=run.seq, events=batch, timeline=timeline))
        except OverflowError:
            # An integer msgpack cannot carry (a backend's usage of 2**70
            # tokens): found event by event below.
            message = b""
        if message and len(message) + _BATCH_HEADER_MAX <= limit:
            run.seq += 1
            return [message]
        if timeline is not None:
            # Never the reason a terminal does not fit: it goes without.
            return self._messages(run_id, _without_timeline(run), batch, limit)
        # Rare: cut the batch by its events' sizes.
        room = limit - _BATCH_HEADER_MAX - _EVENTS_MESSAGE_OVERHEAD - len(run_id.encode())
        messages: list[bytes] = []
        current: list[RuntimeEvent] = []
        used = 0
        for ev in batch:
            error: Error | None = None
            try:
                size = len(_EVENT_ENCODER.encode(ev))
            except OverflowError:
                size = 0
                error = Error(
                    message=f"run {run_id}: the backend sent an integer outside -2**63 .. "
                    "2**64-1, which the link cannot carry",
                    status=502,
                    code=ErrorCode.BACKEND_PROTOCOL_ERROR,
                )
            if size > room:
                error = Error(
                    message=f"run {run_id}: the backend produced an event larger than the "
                    f"edge accepts on the link ({limit} bytes)",
                    status=502,
                    code=ErrorCode.EVENT_TOO_LARGE,
                )
            if error is not None:
                # One event the edge cannot take: sending it would close the
                # link under every other run. This run alone ends.
                if current:
                    messages.append(self._events_message(run_id, run, current))
                messages.append(self._events_message(run_id, run, [error]))
                run.queued.clear()
                run.advance(RunTrigger.TERMINAL, run_id)  # the error just queued
                self._cut_off.append(run_id)
                return messages
            if current and used + size > room:
                messages.append(self._events_message(run_id, run, current))
                current, used = [], 0
            current.append(ev)
            used += size
        messages.append(self._events_message(run_id, run, current))
        return messages

    @staticmethod
    def _events_message(run_id: str, run: RunLink, events: list[RuntimeEvent]) -> bytes:
        """One events message (the rare cut batch: without the timeline)."""
        message = encode(RunEvents(run_id=run_id, seq=run.seq, events=events))
        run.seq += 1
        return message

    def close(self) -> frozenset[str]:
        self.state = LinkState.CLOSED
        runs = frozenset(self._runs)
        self._runs.clear()
        self._ready.clear()
        self._out.messages.clear()
        return runs
