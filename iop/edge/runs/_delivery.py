"""How a node's run events reach their runs: per-run credit, or (research only) none.

The choice is made once, from ``link.run_window`` (which a reload cannot
change), by ``delivery_policy``: what each ``Assign`` grants, how many
events a run's channel holds, and which ``LinkDelivery`` each link's reader
uses.

With per-run credit (the default, ``run_window`` >= 1) a node sends a run at
most its window of events ahead of the run's consumer, so the consumer's
channel (``run_window + 2`` events: the window, the terminal and a
failover's Start) never fills and the link's reader never waits
(``iop.edge.runs._nodes.DirectDelivery``).

With ``link.run_window = 0`` there is no credit (``WithoutCredit``, kept
for the research that measured what credit buys: docs/benchmarks.md, the
head-of-line and credit-window studies): a run whose channel holds
``RUN_BUFFER_WITHOUT_CREDIT`` unread events makes the link's reader wait
(``WithoutCredit.release``), and every run on that node waits with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final

import trio

from iop.config import LinkSettings
from iop.edge.runs._attempt import RemoteRun
from iop.edge.runs._nodes import DirectDelivery, LinkDelivery, NodeConnection
from iop.events import RuntimeEvent, is_terminal
from iop.protocol import UNLIMITED_CREDIT, RunEventsReceived
from iop.runtime import Backpressure

__all__ = ["RUN_BUFFER_WITHOUT_CREDIT", "DeliveryPolicy", "WithoutCredit", "delivery_policy"]

# With per-run credit off (``link.run_window = 0``): events a run's consumer
# may leave unread before the link's reader waits for it (and so every run
# on the link does). The default window's size, so that credit on and off
# hold the same per run and differ only in who waits.
RUN_BUFFER_WITHOUT_CREDIT: Final = 64


@dataclass(frozen=True, slots=True)
class DeliveryPolicy:
    """What a run and a link are set up with (``delivery_policy``).

    Attributes:
        credit: What each ``Assign`` grants the node.
        run_buffer: Unread events a run's consumer may have before it is
            behind (the channel holds two more: the terminal and a
            failover's Start).
        for_link: Each new link's ``LinkDelivery``.
    """

    credit: int
    run_buffer: int
    for_link: Callable[[NodeConnection], LinkDelivery]


def delivery_policy(link: LinkSettings) -> DeliveryPolicy:
    """The one place that reads ``link.run_window`` for delivery."""
    if link.run_window:
        return DeliveryPolicy(link.run_window, link.run_window, DirectDelivery)
    return DeliveryPolicy(
        UNLIMITED_CREDIT,
        RUN_BUFFER_WITHOUT_CREDIT,
        partial(WithoutCredit, limit=RUN_BUFFER_WITHOUT_CREDIT),
    )


class WithoutCredit:
    """A link's delivery with per-run credit off (module docstring).

    Nothing keeps a run's channel from filling: ``limit`` is how many events
    its consumer may leave unread. Events past it wait here, in order, with
    every event behind them on the link, and the link's reader waits
    (``Backpressure``) until the run's consumer has room again.
    """

    __slots__ = ("_conn", "_hold", "_holding", "held", "limit")

    def __init__(self, conn: NodeConnection, *, limit: int) -> None:
        self._conn = conn
        self.limit = limit
        # The events the link reader holds, in order, behind a run whose
        # consumer is behind (head-of-line blocking: ``release``).
        self.held: deque[RunEventsReceived] = deque()
        # The reader's wait for one run's consumer (cancelled when the run
        # leaves the link: ``drop``), and which run's.
        self._hold: trio.CancelScope | None = None
        self._holding = ""

    @property
    def backpressure(self) -> Backpressure | None:
        return self

    def on_events(self, events: list[RunEventsReceived]) -> None:
        if self.held:
            self.held.extend(events)
            return
        for i, event in enumerate(events):
            rest = self._deliver(event)
            if rest is not None:
                self.held.append(rest)
                self.held.extend(events[i + 1 :])
                return

    def drop(self, run_id: str) -> None:
        if self._hold is not None and self._holding == run_id:
            self._hold.cancel()

    def _deliver(self, event: RunEventsReceived) -> RunEventsReceived | None:
        """Deliver ``event``; return what its run's consumer has no room for."""
        conn = self._conn
        rr = conn.run_of(event)
        if rr is None:
            return None
        back, rest = self._take(rr, event.events)
        if back:
            conn.consume(event.run_id, back)
        if rest is not None:
            return RunEventsReceived(event.run_id, rest, event.finished)
        return None

    def _take(
        self, rr: RemoteRun, events: list[RuntimeEvent]
    ) -> tuple[int, list[RuntimeEvent] | None]:
        """``RemoteRun.deliver`` that stops where the consumer is ``limit``
        behind: the credit to give back, and the events left over."""
        if rr.end is not None:
            return 0, None
        unconsumed = 0
        for i, ev in enumerate(events):
            if not is_terminal(ev) and rr.sink.unread >= self.limit:
                # No credit held the node back and the consumer is behind:
                # the rest waits, and so does the link.
                return unconsumed, events[i:]
            back = rr.take(ev)
            if back is None:
                break
            unconsumed += back
        return unconsumed, None

    def is_held(self) -> bool:
        """The link reader must wait (``release``) before it reads the next frame."""
        return bool(self.held)

    async def release(self) -> None:
        """Deliver the held events, each run's once its consumer has room.

        A run that leaves the link (its client went away, ``slow_client``, a
        deadline) stops the wait and its held events are dropped; everything
        behind it on the link waits meanwhile: that is the head-of-line
        blocking credit prevents.
        """
        held = self.held
        while held:
            event = held[0]  # still held while the reader waits (``is_held``)
            rr = self._conn.runs.get(event.run_id)
            if rr is not None:
                self._holding = event.run_id
                with trio.CancelScope() as self._hold:
                    await rr.sink.wait_unread_below(self.limit)
                self._hold = None
            held.popleft()
            rest = self._deliver(event)
            if rest is not None:
                held.appendleft(rest)
