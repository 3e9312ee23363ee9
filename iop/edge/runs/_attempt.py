"""One attempt of a run on a node, as the edge holds it: its events' way in, and how it ended.

The link reader delivers the node's events straight into the run's consumer
channel (``RemoteRun.deliver``, through the run's sink, never waiting:
credit keeps the channel from filling), and wakes the run's executor, which
only waits on ``ended``, once the attempt is over. Every attempt ends one
way (``AttemptEnd``), set in one place (``RemoteRun._end``):

=====================  ==============================================  =========================
end                    what happened                                   what the executor does
=====================  ==============================================  =========================
``COMPLETED``          its terminal event went to the consumer         nothing more: the run ran
``REFUSED``            before any output, the node refused it or       fails over (another node
                       never ran it (a retryable ``Error`` or           may), else reports the
                       ``Cancelled``, kept in ``refusal``)             refusal
``FAILED``             before any output, its backend failed: died,    fails over to another
                       broke its stream or answered a 5xx              instance, else reports the
                       (``backend_fails_over``, kept in ``refusal``)   error
``VIOLATION``          the node broke the event grammar (the sink      502 ``bad_node_events``
                       refused an event; also after a terminal in the
                       same frame, which it overrides)
``LOST``               the node's link died before any output          fails over
``LOST_AFTER_OUTPUT``  the node's link died after output reached the   ``Cancelled(node_lost)``
                       consumer
``PREEMPTED``          before any output, the scheduler took its slot  cancels it on the node and
                       for a run of a higher objective priority        places the run again
                       (``preempt``)
=====================  ==============================================  =========================

"Output" is content, reasoning, another output event or a terminal that
reached the consumer; a Start is none. What a surface sends before the
first content (the SSE head, chat's role chunk, Responses'
``response.created``, Messages' ``message_start``, keep-alives) is the
edge's own and says nothing of the attempt (the encoders ignore
``Start.target``), so an attempt may fail over behind it. A run's attempts
share one ``RunStart``: a failover attempt's own Start is not forwarded
again (the consumer has had one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import trio

from iop._secrets import SecretMasker, mask_event
from iop.errors import (
    RETRYABLE_CANCEL_REASONS,
    RETRYABLE_CODES,
    InvariantError,
    backend_fails_over,
)
from iop.events import Cancelled, Error, RuntimeEvent, Start, is_terminal
from iop.runtime import RunSink
from iop.timeline import NodeTimeline, Timeline

__all__ = ["AttemptEnd", "RemoteRun", "RunStart", "keep_node_timeline"]


class AttemptEnd(enum.Enum):
    """How one attempt of a run on a node ended (module docstring)."""

    COMPLETED = "completed"
    REFUSED = "refused"
    FAILED = "failed"
    VIOLATION = "violation"
    LOST = "lost"
    LOST_AFTER_OUTPUT = "lost_after_output"
    PREEMPTED = "preempted"


@dataclass(slots=True)
class RunStart:
    """Shared by a run's attempts: whether a Start reached the consumer."""

    forwarded: bool = False


class RemoteRun:
    """The edge's end of one attempt of a run on a node."""

    __slots__ = (
        "_output",
        "assigned_at",
        "detail",
        "end",
        "ended",
        "masker",
        "refusal",
        "run_id",
        "sink",
        "start",
    )

    def __init__(
        self,
        run_id: str,
        sink: RunSink,
        masker: SecretMasker,
        start: RunStart,
        assigned_at: float = 0.0,
    ) -> None:
        self.run_id = run_id
        self.sink = sink
        # When the Assign went out (edge clock): the start of the round trip
        # the node's timeline is set against (NodeTimeline.on_edge_clock).
        self.assigned_at = assigned_at
        self.masker = masker
        self.start = start
        self.ended = trio.Event()
        self.end: AttemptEnd | None = None
        # What the end says: the refusal's, the violation's or the loss's message.
        self.detail = ""
        self.refusal: Error | Cancelled | None = None  # with REFUSED and FAILED
        self._output = False  # content, reasoning or a terminal reached the consumer

    def _end(
        self, how: AttemptEnd, detail: str = "", refusal: Error | Cancelled | None = None
    ) -> None:
        self.end, self.detail, self.refusal = how, detail, refusal
        self.ended.set()

    def deliver(self, events: list[RuntimeEvent]) -> int:
        """Hand the node's events to the run; return the credit to give back at once.

        A Start that is not forwarded (a failover attempt's) is not consumed
        by anyone, so its credit is returned here.
        """
        if self.end is not None:
            return 0
        unconsumed = 0
        for ev in events:
            back = self.take(ev)
            if back is None:
                break
            unconsumed += back
        return unconsumed

    def take(self, ev: RuntimeEvent) -> int | None:
        """Hand one event to the run: the credit to give back at once (1 for a
        Start not forwarded, else 0), or None when the attempt ended on it
        (refused, or a grammar violation) and the rest is not for the consumer."""
        if isinstance(ev, Start):
            if self.start.forwarded:
                return 1
            self.start.forwarded = True
        elif not self._output and (
            (isinstance(ev, Error) and ev.code in RETRYABLE_CODES)
            or (isinstance(ev, Cancelled) and ev.reason in RETRYABLE_CANCEL_REASONS)
        ):
            # The node refused or never ran it: another node may.
            self._end(AttemptEnd.REFUSED, ev.message, ev)
            return None
        elif not self._output and isinstance(ev, Error) and backend_fails_over(ev.code, ev.status):
            # The backend failed before its first token: another instance
            # may answer (the client has seen nothing of this attempt).
            self._end(AttemptEnd.FAILED, ev.message, ev)
            return None
        else:
            self._output = True
            # What a node sends is masked with the edge's secrets before
            # a client (or the admin views) can see it: a node or its
            # backend may echo one.
            ev = mask_event(ev, self.masker)
        try:
            self.sink.push_nowait(ev)
        except InvariantError as exc:
            self._end(AttemptEnd.VIOLATION, exc.message)
            return None
        if is_terminal(ev):
            self._end(AttemptEnd.COMPLETED)
        return 0

    def node_timeline(self, node: NodeTimeline, now: float) -> None:
        """The node's side of the attempt arrived (with its terminal)."""
        keep_node_timeline(self.sink.timeline, self.assigned_at, node, now)

    def preempt(self) -> bool:
        """End the attempt for a run of a higher priority, if it sent no
        output yet (``iop.edge.scheduler._leases``); whether it did end it."""
        if self.end is not None or self._output:
            return False
        self._end(AttemptEnd.PREEMPTED, "preempted for a run of a higher priority")
        return True

    def lose(self, message: str) -> None:
        """The node's link is gone."""
        if self.end is None:
            how = AttemptEnd.LOST_AFTER_OUTPUT if self._output else AttemptEnd.LOST
            self._end(how, message)


def keep_node_timeline(
    timeline: Timeline, assigned_at: float, node: NodeTimeline, now: float
) -> None:
    """Keep ``node`` in the run's ``timeline``, in the edge's clock."""
    moved = node.on_edge_clock(assigned_at, now, timeline.max_stalls)
    if moved is not None:
        timeline.node = moved
