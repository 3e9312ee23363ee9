"""A run's timeline: what happened to it and when, on the edge and on its node.

Every run records its life in one typed record (``Timeline``), with the
times of the trio clock (``trio.current_time()``, monotonic seconds) of the
process that saw each moment:

=====================  =========================================  ==========
field                  the moment                                 recorded by
=====================  =========================================  ==========
``received``           the run was created (request parsed)       edge
``admitted``           a slot was free at once                    scheduler
``queued`` + ``why``   it had to wait, and for what               scheduler
``dequeued``           the wait ended with a slot                 scheduler
``home_wait_ms``       how long it was held for the instances     scheduler
                       that hold its prompt's prefix (ms)
``model_load``         it waited for a node to load its model:    scheduler
                       where, from when to when, how it ended
``placements``         each attempt: node, instance, when, result executor
``first_output``       the first output event reached the run     runtime
``stalls``             credit stalls (the consumer held a whole   runtime,
                       window) and client write stalls (a write   edge HTTP
                       the client's socket did not take whole)
``cancel_requested``   the first cancel, and its cause            runtime
``cancel_sent``        the Cancel went to the node                executor
``terminal``           the outcome was decided, and which         runtime
``node``               the node's side of the last attempt        node
=====================  =========================================  ==========

The node keeps its own part (``NodeTimeline``: its run's start, the backend
request sent, the backend's first byte, the first token, the cancel it
received, the backend socket closed, its terminal) and sends it with the
run's terminal event, its times already converted to the edge's clock with
the offset its link measured (``docs/protocol.md``, "Clocks").

Bounded: at most ``max_stalls`` stalls are kept per run (then only counted,
``stalls_dropped``), and the edge keeps the timelines of the last
``[timelines] recent`` finished runs (``TimelineRing``).

Recording is attribute assignment on a ``msgspec.Struct``: no allocation but
the stalls', no lock (one trio thread), cheap enough for every run
(``docs/benchmarks.md``).

A module of its own, beside ``iop.events``: the runtime, the edge, the node
and the link protocol all use it.
"""

from __future__ import annotations

import contextvars
import enum
import math
from collections import deque
from collections.abc import Iterator
from typing import Final

import msgspec

from iop.events import Cancelled, CancelReason, Complete, Error, TerminalEvent

__all__ = [
    "DEFAULT_MAX_STALLS",
    "ModelLoad",
    "NodeTimeline",
    "Placement",
    "Stall",
    "StallKind",
    "Timeline",
    "TimelineRing",
    "current_timeline",
    "outcome_label",
]

DEFAULT_MAX_STALLS: Final = 32

# Float rounding in a round trip computed from four times (a microsecond).
_CLOCK_SLACK_S: Final = 1e-6


_CURRENT: Final = contextvars.ContextVar["Timeline | None"]("iop_run_timeline", default=None)


def current_timeline() -> Timeline | None:
    """The timeline of the run whose task this is (None outside a run).

    The runtime sets it in each run's task (``iop.runtime._run``), so an
    adapter marks its backend's moments without the timeline in its
    signature: ``if (t := current_timeline()) is not None: t.backend_sent = ...``.
    """
    return _CURRENT.get()


def set_current_timeline(timeline: Timeline) -> contextvars.Token[Timeline | None]:
    """Make ``timeline`` the current task's (the runtime, once per run task)."""
    return _CURRENT.set(timeline)


class StallKind(enum.Enum):
    """What a run waited on while its producer had output to give."""

    CREDIT = "credit"
    """The consumer held a whole window: the producer was out of credit."""
    CLIENT_WRITE = "client_write"
    """A write to the client's socket that the kernel did not take whole."""


class Stall(msgspec.Struct, kw_only=True):
    kind: StallKind
    start: float
    end: float | None = None
    # Credit: the window the producer had used up (events). Client write:
    # the bytes of the write still to go when it blocked.
    size: int = 0


class Placement(msgspec.Struct, kw_only=True):
    """One attempt of a run on a node."""

    attempt: int
    node: str
    instance: str
    at: float
    # None while it runs; then "ran" (the node ended the run), or why the
    # edge left it: "retry: ..." (failed before output, failed over),
    # "lost: ..." (its link went away), "cancelled".
    result: str | None = None
    # Why this instance (the scheduler's rule), and each candidate's score
    # when placement scored them ("node/instance" -> score).
    why: str = ""
    scores: dict[str, float] = {}
    # The instances with a free slot it was chosen from (drained, draining,
    # excluded and full ones are none): (node, instance, in flight, slots)
    # just before the choice; the JSON has "node/instance" -> load.
    candidates: list[tuple[str, str, int, int]] = []

    def loads(self) -> dict[str, float]:
        """Each candidate's load (in flight over slots) by ``"node/instance"``."""
        return {
            f"{node}/{instance}": round(in_flight / max(slots, 1), 4)
            for node, instance, in_flight, slots in self.candidates
        }


class ModelLoad(msgspec.Struct, kw_only=True):
    """A run's wait for a node to load its on-demand model
    (``iop.edge.scheduler._ondemand``): the load it asked for or joined."""

    node: str
    model: str  # the node's model (the instance named after it)
    started: float
    ended: float | None = None
    # None while it loads; then "ready", or why not ("failed: ...").
    result: str | None = None


class NodeTimeline(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The node's side of one attempt, in the edge's clock (see module doc).

    ``clock_offset_s`` is what was added to the node's times, ``clock_rtt_s``
    the link round trip it was measured over: each time is good to about
    half of it.
    """

    node: str = ""
    clock_offset_s: float = 0.0
    clock_rtt_s: float | None = None
    started: float | None = None
    backend_sent: float | None = None
    backend_first_byte: float | None = None
    first_output: float | None = None
    cancel_received: float | None = None
    backend_closed: float | None = None
    terminal: float | None = None
    stalls: list[Stall] = []
    stalls_dropped: int = 0

    @classmethod
    def of(cls, timeline: Timeline, node: str, started: float, now: float) -> NodeTimeline:
        """The node's side of a run from its run's ``timeline``, ending ``now``.

        ``started`` is when the node received the Assign: with ``now`` (its
        terminal going out) the edge has a round trip of its own clock to
        set the node's times against (``docs/protocol.md``, "Clocks")."""
        return cls(
            node=node,
            started=started,
            backend_sent=timeline.backend_sent,
            backend_first_byte=timeline.backend_first_byte,
            first_output=timeline.first_output,
            cancel_received=timeline.cancel_requested,
            backend_closed=timeline.backend_closed,
            terminal=now,
            stalls=timeline.stalls,
            stalls_dropped=timeline.stalls_dropped,
        )

    def on_edge_clock(
        self, assigned: float, received: float, max_stalls: int
    ) -> NodeTimeline | None:
        """This timeline (node clock) in the edge's clock, or None if it cannot be.

        The Assign went out at ``assigned`` and this came back at
        ``received`` (edge clock); the node got the Assign at ``started``
        and sent this at ``terminal`` (node clock): a round trip like NTP's
        (RFC 5905, section 8), offset ``((assigned - started) + (received -
        terminal)) / 2``, good to half of ``rtt = (received - assigned) -
        (terminal - started)``. A timeline without those two times, with a
        time that is not finite, or whose round trip is negative (a node
        that lies, or whose clock jumped) is dropped; stalls past
        ``max_stalls`` are counted, not kept.
        """
        t2, t3 = self.started, self.terminal
        if t2 is None or t3 is None:
            return None
        times = [
            t2,
            t3,
            self.backend_sent,
            self.backend_first_byte,
            self.first_output,
            self.cancel_received,
            self.backend_closed,
        ]
        kept = self.stalls[:max_stalls]
        times += [s.start for s in kept]
        times += [s.end for s in kept]
        if not all(t is None or math.isfinite(t) for t in times):
            return None
        rtt = (received - assigned) - (t3 - t2)
        if rtt < -_CLOCK_SLACK_S:
            return None
        rtt = max(rtt, 0.0)
        offset = ((assigned - t2) + (received - t3)) / 2
        trimmed = msgspec.structs.replace(
            self,
            stalls=kept,
            stalls_dropped=max(0, self.stalls_dropped) + len(self.stalls) - len(kept),
        )
        return trimmed.shifted(offset, rtt)

    def shifted(self, offset: float, rtt: float | None) -> NodeTimeline:
        """This timeline with every time moved by ``offset`` (node clock -> edge)."""

        def move(t: float | None) -> float | None:
            return None if t is None else t + offset

        return NodeTimeline(
            node=self.node,
            clock_offset_s=offset,
            clock_rtt_s=rtt,
            started=move(self.started),
            backend_sent=move(self.backend_sent),
            backend_first_byte=move(self.backend_first_byte),
            first_output=move(self.first_output),
            cancel_received=move(self.cancel_received),
            backend_closed=move(self.backend_closed),
            terminal=move(self.terminal),
            stalls=[
                Stall(kind=s.kind, start=s.start + offset, end=move(s.end), size=s.size)
                for s in self.stalls
            ],
            stalls_dropped=self.stalls_dropped,
        )


class Timeline(msgspec.Struct, kw_only=True):
    """One run's timeline on the edge (see the module's table)."""

    run_id: str
    model: str = ""
    operation: str = ""
    # The client's tenant (iop.edge.tenancy._tenants): "" where there is none (a node).
    tenant: str = ""
    # Where the run stood in the queue (docs/operations.md, "Sessions and
    # objectives"): its session key and where it came from, its objective.
    session: str = ""
    session_from: str = ""
    objective: str = ""
    stream: bool = True
    received_unix: float = 0.0
    received: float = 0.0
    admitted: float | None = None
    queued: float | None = None
    why_queued: str | None = None
    dequeued: float | None = None
    # How long it was held for its prefix's homes (``[scheduler]
    # prefix_wait_s``), in milliseconds; None: it was not.
    home_wait_ms: float | None = None
    model_load: ModelLoad | None = None
    placements: list[Placement] = []
    first_output: float | None = None
    stalls: list[Stall] = []
    stalls_dropped: int = 0
    max_stalls: int = DEFAULT_MAX_STALLS
    cancel_requested: float | None = None
    cancel_cause: CancelReason | None = None
    cancel_sent: float | None = None
    terminal: float | None = None
    outcome: str | None = None
    node: NodeTimeline | None = None
    # Recorded where a run talks to its backend (the node; ``iop up``'s
    # in-process runs too): None on the edge's record of a remote run.
    backend_sent: float | None = None
    backend_first_byte: float | None = None
    backend_closed: float | None = None
    # The trace context the run's backend request carries (``iop.tracing``).
    traceparent: str = ""

    def stall_began(self, kind: StallKind, at: float, size: int = 0) -> Stall | None:
        """Record a stall's start; None when the run already keeps ``max_stalls``."""
        if len(self.stalls) >= self.max_stalls:
            self.stalls_dropped += 1
            return None
        stall = Stall(kind=kind, start=at, size=size)
        self.stalls.append(stall)
        return stall

    def cancel(self, at: float, cause: CancelReason) -> None:
        """The first cancel of the run (later ones change nothing)."""
        if self.cancel_requested is None:
            self.cancel_requested = at
            self.cancel_cause = cause

    def end(self, at: float, outcome: TerminalEvent) -> None:
        """The run's outcome was decided at ``at``; a stall still open ends there."""
        self.terminal = at
        self.outcome = outcome_label(outcome)
        for stall in self.stalls:
            if stall.end is None:
                stall.end = at

    @property
    def phase(self) -> str:
        """Where a live run is now, in one word."""
        if self.terminal is not None:
            return "done"
        if self.cancel_requested is not None:
            return "cancelling"
        if self.stalls and self.stalls[-1].end is None:
            return "stalled"
        if self.first_output is not None:
            return "streaming"
        if self.placements and self.placements[-1].result is None:
            return "placed"
        load = self.model_load
        if load is not None and load.ended is None:
            return "loading"
        if self.queued is not None and self.dequeued is None:
            return "queued"
        return "received"

    def to_json(self) -> dict[str, object]:
        """The timeline as JSON: every time in ms since ``received``
        (the backend's times only where the run talked to its backend)."""
        t0 = self.received

        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - t0) * 1000.0, 3)

        def stalls(items: list[Stall]) -> list[dict[str, object]]:
            return [
                {"kind": s.kind.value, "start_ms": ms(s.start), "end_ms": ms(s.end), "size": s.size}
                for s in items
            ]

        node: dict[str, object] | None = None
        if self.node is not None:
            n = self.node
            node = {
                "node": n.node,
                "clock_offset_s": n.clock_offset_s,
                "clock_rtt_ms": None if n.clock_rtt_s is None else round(n.clock_rtt_s * 1000, 3),
                "started_ms": ms(n.started),
                "backend_sent_ms": ms(n.backend_sent),
                "backend_first_byte_ms": ms(n.backend_first_byte),
                "first_output_ms": ms(n.first_output),
                "cancel_received_ms": ms(n.cancel_received),
                "backend_closed_ms": ms(n.backend_closed),
                "terminal_ms": ms(n.terminal),
                "stalls": stalls(n.stalls),
                "stalls_dropped": n.stalls_dropped,
            }
        return {
            "run_id": self.run_id,
            "model": self.model,
            "operation": self.operation,
            "tenant": self.tenant,
            "session": self.session,
            "session_from": self.session_from,
            "objective": self.objective,
            "stream": self.stream,
            "phase": self.phase,
            "received_unix": self.received_unix,
            "admitted_ms": ms(self.admitted),
            "queued_ms": ms(self.queued),
            "why_queued": self.why_queued,
            "dequeued_ms": ms(self.dequeued),
            "home_wait_ms": self.home_wait_ms,
            "model_load": None
            if (load := self.model_load) is None
            else {
                "node": load.node,
                "model": load.model,
                "started_ms": ms(load.started),
                "ended_ms": ms(load.ended),
                "elapsed_ms": round(((load.ended or 0.0) - load.started) * 1000.0, 3)
                if load.ended is not None
                else None,
                "result": load.result,
            },
            "placements": [
                {
                    "attempt": p.attempt,
                    "node": p.node,
                    "instance": p.instance,
                    "at_ms": ms(p.at),
                    "result": p.result,
                    "why": p.why,
                    "scores": p.scores,
                    "candidates": p.loads(),
                }
                for p in self.placements
            ],
            "first_output_ms": ms(self.first_output),
            "stalls": stalls(self.stalls),
            "stalls_dropped": self.stalls_dropped,
            "cancel_requested_ms": ms(self.cancel_requested),
            "cancel_cause": None if self.cancel_cause is None else self.cancel_cause.value,
            "cancel_sent_ms": ms(self.cancel_sent),
            "terminal_ms": ms(self.terminal),
            "outcome": self.outcome,
            "trace_id": self.traceparent[3:35] if self.traceparent else None,
            "backend_sent_ms": ms(self.backend_sent),
            "backend_first_byte_ms": ms(self.backend_first_byte),
            "backend_closed_ms": ms(self.backend_closed),
            "node": node,
        }

    def summary(self) -> dict[str, object]:
        """The few fields a list of runs shows."""
        t0 = self.received
        last = self.placements[-1] if self.placements else None
        return {
            "run_id": self.run_id,
            "model": self.model,
            "tenant": self.tenant,
            "session": self.session,
            "objective": self.objective,
            "phase": self.phase,
            "received_unix": self.received_unix,
            "node": None if last is None else last.node,
            "instance": None if last is None else last.instance,
            "attempts": len(self.placements),
            "first_output_ms": None
            if self.first_output is None
            else round((self.first_output - t0) * 1000.0, 3),
            "duration_ms": None
            if self.terminal is None
            else round((self.terminal - t0) * 1000.0, 3),
            "stalls": len(self.stalls) + self.stalls_dropped,
            # How long it waited for its on-demand model's load (None: it did
            # not, or it still waits: its phase says ``loading``).
            "model_load_ms": None
            if (load := self.model_load) is None or load.ended is None
            else round((load.ended - load.started) * 1000.0, 3),
            "outcome": self.outcome,
        }


def outcome_label(outcome: TerminalEvent) -> str:
    """``complete:<finish>``, ``cancelled:<reason>`` or ``error:<code>``."""
    if isinstance(outcome, Complete):
        return f"complete:{outcome.finish_reason}"
    if isinstance(outcome, Cancelled):
        return f"cancelled:{outcome.reason.value}"
    assert isinstance(outcome, Error)
    return f"error:{outcome.code}"


class TimelineRing:
    """The timelines of the last ``capacity`` finished runs, newest last."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[Timeline] = deque(maxlen=capacity)
        self._by_id: dict[str, Timeline] = {}

    def add(self, timeline: Timeline) -> None:
        if self.capacity <= 0:
            return
        if len(self._items) == self.capacity:
            old = self._items[0]
            if self._by_id.get(old.run_id) is old:
                del self._by_id[old.run_id]
        self._items.append(timeline)
        self._by_id[timeline.run_id] = timeline

    def get(self, run_id: str) -> Timeline | None:
        return self._by_id.get(run_id)

    def __len__(self) -> int:
        return len(self._items)

    def newest_first(self) -> Iterator[Timeline]:
        return reversed(self._items)
