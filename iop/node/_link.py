"""One link of the node to an edge, and the node's end of each run on it.

``NodeLink`` pairs the sans-IO ``NodeSession`` with the one link driver
(``iop.runtime.LinkDriver``: a reader and a writer task, nothing else). A run
assigned on the link is started in the agent's supervisor with a
``NodeRun`` as its **outlet**: every event the adapter produces is queued in
the session (``NodeSession.push``) and the writer is woken; the writer sends
everything queued, for every run, in one frame. There is no forwarder task
per run and no outbox: one token costs the adapter's task and the writer's
wake-up, and a burst across runs costs one frame.

Backpressure: a run whose credit is spent queues up to ``node.run_backlog``
(``RUN_BACKLOG``, 16) events in the session; the next ``send`` waits
(``NodeRun.space``) until ``Credit`` arrives, so the adapter stops reading
its backend's socket. An edge with per-run credit off grants more credit
than a run uses (``UNLIMITED_CREDIT``): then a run may have at most
``node.run_backlog`` events queued that the writer has not sent, and waits
for the writer's next round (``NodeLink.unsent_waiters``), which waits for
the link's TCP window: the node's memory stays bounded either way. A
cancel from the edge drops what is queued (``RunPhase.ENDING``) and wakes it.

Every way a run ends produces exactly one terminal event on the link:

==========================  =================================================
``Cancel`` from the edge    ``run.cancel(reason)``; queued events are dropped
                            (the edge forgot the run) and the ``Cancelled``
                            goes without credit
link lost                   each run on it is cancelled with ``node_lost``
                            (the adapter stops at once); its outlet is broken
drain                       new assigns get ``Error`` 503 ``node_draining``;
                            in-flight runs may finish until the timeout, then
                            are cancelled with ``shutdown``
an event too large          the run alone ends with ``Error``
                            ``event_too_large`` (``NodeSession.take_cut_off``)
==========================  =================================================
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from iop._secrets import SecretMasker, mask_event
from iop.config import NodeEdge
from iop.errors import LinkError, LinkProtocolError
from iop.events import CancelReason, Error, RuntimeEvent, Start, is_terminal
from iop.protocol import (
    CLOSE_NORMAL,
    RUN_BACKLOG,
    AssignReceived,
    CancelReceived,
    ControlModel,
    CreditReceived,
    FrameChannel,
    LoadModel,
    LoadModelReceived,
    ModelControlReceived,
    NodeLinkEvent,
    NodeSession,
    Welcomed,
    close_reason,
)
from iop.runtime import LinkDriver, Run, Wakeup
from iop.timeline import NodeTimeline
from iop.tracing import NodeRunTrace

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["NodeLink", "NodeRun"]

log = logging.getLogger("iop.node")


class NodeRun:
    """A run as its link sees it, and the runtime's ``Outlet`` of its events."""

    __slots__ = (
        "assigned_at",
        "flowing",
        "instance",
        "link",
        "run",
        "run_id",
        "space",
        "trace",
    )

    def __init__(self, link: NodeLink, run_id: str, instance: str) -> None:
        self.link = link
        self.run_id = run_id
        self.instance = instance
        self.assigned_at = trio.current_time()
        # Set when the run may queue again: credit came, or it was cancelled.
        self.space = Wakeup()
        self.run: Run | None = None
        self.trace: NodeRunTrace | None = None  # when the node traces (iop.tracing)
        # The run's first output was queued: its later ones may wait for the
        # link's frame interval (``NodeSection.frame_interval_ms``).
        self.flowing = False

    def send_nowait(self, event: RuntimeEvent) -> None:
        link = self.link
        session = link.session
        if link.closed or session.run(self.run_id) is None:
            # The link is gone, or the session ended the run (cut off).
            raise trio.BrokenResourceError
        if is_terminal(event):
            # The node is the only process that knows its instances' header
            # values: whatever a backend echoed is masked before it leaves.
            event = mask_event(event, link.masker)
            timeline = None
            if self.run is not None:
                # The node's side of the run goes with its terminal event.
                timeline = NodeTimeline.of(
                    self.run.timeline, session.node_id, self.assigned_at, trio.current_time()
                )
            session.push(self.run_id, event, timeline)
            link.driver.wake()
            return
        if session.backlog(self.run_id) >= link.run_backlog:
            # Out of credit: what is queued within it goes now, not after
            # the frame interval, so that the edge can read it and give more.
            link.driver.wake()
            raise trio.WouldBlock
        if session.unsent(self.run_id) >= link.run_backlog:
            # No per-run credit: the writer (and the link's TCP window) holds
            # it; the writer's round goes now, not after the frame interval
            # (which would cap a fast run at its backlog per interval).
            link.unsent_waiters[self.run_id] = self
            link.driver.wake()
            raise trio.WouldBlock
        session.push(self.run_id, event)
        if self.flowing:
            link.driver.wake(urgent=False)
            return
        # A Start, or the run's first output: the client waits for its first
        # token, which does not wait for the frame interval.
        self.flowing = not isinstance(event, Start)
        link.driver.wake()

    async def send(self, event: RuntimeEvent) -> None:
        while True:
            try:
                self.send_nowait(event)
            except trio.WouldBlock:
                await self.space.wait()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
                return

    def close(self) -> None:
        """The run is over (the runtime closes its outlet last)."""
        self.link.run_closed(self)

    def cut_off(self, reason: CancelReason, message: str) -> None:
        """Cancel the run; only its terminal event will still be sent."""
        if self.run is not None:
            self.run.cancel(reason, message)
        self.space.set()


class NodeLink:
    """State of one link: its session, driver, runs and how it ended.

    Args:
        edge: The edge at the other end.
        chan: The connected channel.
        session: The link's session.
        masker: Masks the node's secrets in what it sends.
        on_assign: Called with each assign (must not block).
        on_run_closed: Called when a run's outlet closes.
        on_load_model: Called with each ``LoadModel`` (must not block); None:
            the node has no on-demand models, and a request is a protocol error.
        on_control_model: Called with each ``ControlModel`` (must not
            block; None as ``on_load_model``).
    """

    def __init__(
        self,
        edge: NodeEdge,
        chan: FrameChannel,
        session: NodeSession,
        masker: SecretMasker,
        *,
        on_assign: Callable[[NodeLink, AssignReceived], None],
        on_run_closed: Callable[[NodeRun], None],
        run_backlog: int = RUN_BACKLOG,
        frame_interval: float = 0.0,
        on_load_model: Callable[[NodeLink, LoadModel], None] | None = None,
        on_control_model: Callable[[NodeLink, ControlModel], None] | None = None,
    ) -> None:
        self._on_load_model = on_load_model
        self._on_control_model = on_control_model
        self.edge = edge
        self.run_backlog = run_backlog
        # Runs waiting for the writer to send what they queued (not credit).
        self.unsent_waiters: dict[str, NodeRun] = {}
        self.chan = chan
        self.session = session
        self.masker = masker
        self.runs: dict[str, NodeRun] = {}
        self._on_assign = on_assign
        self._on_run_closed = on_run_closed
        self.driver = LinkDriver(
            chan,
            session,
            self._on_events,
            after_send=self._after_send,
            peer=f"edge {edge.url}",
            frame_interval=frame_interval,
        )
        self.scope = trio.CancelScope()
        self.welcomed_at = math.inf
        self.caps_version = 0
        self.closed = False
        # Why the link ended (None: closed by us on drain), and how we close it.
        self.end: LinkError | None = None
        self.close_code = CLOSE_NORMAL
        self.close_reason = ""
        self._close_when_flushed: tuple[int, str] | None = None
        self.ended = trio.Event()

    def fail(self, exc: LinkError | None, code: int | None = None, reason: str = "") -> None:
        """Record why the link ends (first cause wins) and stop its tasks."""
        if self.end is None and exc is not None:
            self.end = exc
        if code is not None and not self.scope.cancel_called:
            self.close_code, self.close_reason = code, close_reason(reason)
        self.scope.cancel()

    def close_when_flushed(self, code: int, reason: str) -> None:
        """Close the link once everything queued before this call is sent."""
        self._close_when_flushed = (code, reason)
        self.driver.wake()

    def reject(self, run_id: str, error: Error) -> None:
        """End an assign that starts no run with ``error``."""
        masked = mask_event(error, self.masker)
        assert isinstance(masked, Error)
        self.session.reject(run_id, masked)
        self.driver.wake()

    def _on_events(self, events: list[NodeLinkEvent]) -> None:
        """A frame's events: never blocks (the reader must not wait on a run)."""
        for event in events:
            if isinstance(event, AssignReceived):
                self._on_assign(self, event)
            elif isinstance(event, CreditReceived):
                nr = self.runs.get(event.run_id)
                if nr is not None:
                    nr.space.set()
            elif isinstance(event, CancelReceived):
                nr = self.runs.get(event.cancel.run_id)
                if nr is not None:
                    nr.cut_off(event.cancel.reason, event.cancel.message)
            elif isinstance(event, LoadModelReceived):
                if self._on_load_model is None:
                    raise LinkProtocolError("load_model to a node that offered no models")
                self._on_load_model(self, event.request)
            elif isinstance(event, ModelControlReceived):
                if self._on_control_model is None:
                    raise LinkProtocolError("control_model to a node that offered no models")
                self._on_control_model(self, event.request)
            elif isinstance(event, Welcomed):
                raise LinkProtocolError("second welcome on an open link")

    def _after_send(self) -> None:
        if self.unsent_waiters:
            waiters, self.unsent_waiters = self.unsent_waiters, {}
            for waiter in waiters.values():
                waiter.space.set()
        for run_id in self.session.take_cut_off():
            nr = self.runs.get(run_id)
            if nr is not None:
                nr.cut_off(CancelReason.EXPLICIT, "event too large for the link")
        if self._close_when_flushed is not None and not self.session.has_data_to_send:
            code, reason = self._close_when_flushed
            self.fail(None, code, reason)

    def run_closed(self, nr: NodeRun) -> None:
        if self.runs.get(nr.run_id) is nr:
            del self.runs[nr.run_id]
        self._on_run_closed(nr)

    def shut(self) -> None:
        """The link is gone: every run still on it stops now."""
        self.closed = True
        for nr in list(self.runs.values()):
            if nr.run is not None:
                nr.run.cancel(CancelReason.NODE_LOST, "link to edge lost")
            nr.space.set()
