"""The one link driver: moves frames between a ``FrameChannel`` and a session.

Both ends of the edge ↔ node link run the same driver over their sans-IO
session (``iop.protocol.EdgeSession`` or ``NodeSession``); what differs
between them is only what the session's events mean to the caller
(``on_events``). Per link there are exactly two tasks:

* the **reader** (the task that calls ``run``): takes a frame, hands it to
  the session, passes the resulting events to ``on_events`` (which must not
  block: it delivers into bounded queues that credit keeps from filling), and
  wakes the writer if the session now has something to say. It reads under
  one cancel scope whose deadline is the earlier of the session's liveness
  deadline and its next tick: at the first the peer is lost (``PeerSilent``,
  a ``LinkClosed`` with ``CLOSE_HEARTBEAT``), at the second the session
  queues a ping, or makes the events it held for collected runs sendable.
* the **writer**: sleeps until woken (``wake``), then sends everything the
  session has queued, for every run, in as few frames as the peer accepts
  (``data_to_send``). Nothing else ever calls ``chan.send``.

So there is no pinger and no watchdog task, and a link that carries traffic
sends no heartbeats at all: the session pings only a peer it has not heard
from (``iop.protocol._session``, "Liveness").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import trio

from iop.errors import LinkError, first_leaf
from iop.protocol import CLOSE_HEARTBEAT, FrameChannel, LinkClosed

__all__ = ["LinkDriver", "LinkSession", "PeerSilent", "Wakeup"]

E = TypeVar("E")


class PeerSilent(LinkClosed):
    """The peer sent nothing for the session's heartbeat timeout: it is lost."""


class LinkSession(Protocol[E]):
    """What the driver needs of ``EdgeSession`` and ``NodeSession``."""

    @property
    def liveness_deadline(self) -> float: ...

    @property
    def next_tick_at(self) -> float: ...

    @property
    def has_data_to_send(self) -> bool: ...

    def receive(self, frame: bytes, now: float) -> list[E]: ...

    def data_to_send(self, now: float) -> list[bytes]: ...

    def tick(self, now: float) -> None: ...


class Wakeup:
    """A re-armable wake-up call: ``set()`` ends the current or next ``wait()``."""

    # The event exists only while a task waits: a node holds one Wakeup per
    # open run, and an Event with its parking lot is 0.4 KiB
    # (docs/benchmarks.md, "Memory", "Second pass").
    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._event: trio.Event | None = None
        self._set = False

    def set(self) -> None:
        if self._event is not None:
            self._event.set()
        else:
            self._set = True

    async def wait(self) -> None:
        """Return once ``set()`` was called since the last ``wait()`` returned."""
        if self._set:
            self._set = False
            await trio.lowlevel.checkpoint()
            return
        self._event = event = trio.Event()
        try:
            await event.wait()
        finally:
            self._event = None


class LinkDriver(Generic[E]):
    """Runs one connected link over its session until it ends.

    Args:
        chan: The connection.
        session: The link's session, past its handshake.
        on_events: Called with each frame's link events; must not block.
        after_send: Called after each round of frames went out (the node
            ends runs the session cut off there).
        peer: Who is at the other end, for the heartbeat message.
    """

    def __init__(
        self,
        chan: FrameChannel,
        session: LinkSession[E],
        on_events: Callable[[list[E]], None],
        *,
        after_send: Callable[[], None] | None = None,
        peer: str = "peer",
    ) -> None:
        self.chan = chan
        self.session = session
        self._on_events = on_events
        self._after_send = after_send
        self._peer = peer
        self._wake = Wakeup()
        # The reader's scope (its deadline: liveness, or the next tick).
        self._scope: trio.CancelScope | None = None

    def wake(self) -> None:
        """The session has something to send, or to do at a tick: the writer
        sends it soon, and the reader's deadline moves up to the session's
        next tick if that came earlier (a collected run began to hold events)."""
        self._wake.set()
        scope = self._scope
        if scope is not None:
            tick = self.session.next_tick_at
            if tick < scope.deadline:
                scope.deadline = tick

    async def run(self) -> None:
        """Read and write until the link ends.

        Raises:
            LinkClosed: The peer closed the link, or was silent past the
                session's liveness deadline (``CLOSE_HEARTBEAT``).
            LinkProtocolError: The peer broke the protocol (a
                ``LinkLimitError`` carries its own close code).
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, name="link writer")
                await self._reader()
                nursery.cancel_scope.cancel()
        except* LinkError as group:
            raise first_leaf(group, LinkError) from None

    async def _reader(self) -> None:
        session, chan = self.session, self.chan
        if session.has_data_to_send:
            self._wake.set()
        while True:
            with trio.CancelScope(
                deadline=min(session.liveness_deadline, session.next_tick_at)
            ) as scope:
                self._scope = scope
                while True:
                    frame = await chan.receive()
                    events = session.receive(frame, trio.current_time())
                    scope.deadline = min(session.liveness_deadline, session.next_tick_at)
                    if events:
                        self._on_events(events)
                    if session.has_data_to_send:
                        self._wake.set()
            if not scope.cancelled_caught:  # pragma: no cover - the loop only ends by cancel
                return
            now = trio.current_time()
            if now >= session.liveness_deadline:
                raise PeerSilent(
                    f"{self._peer} silent past the heartbeat timeout",
                    close_code=CLOSE_HEARTBEAT,
                    reason="heartbeat timeout",
                )
            session.tick(now)
            if session.has_data_to_send:
                self._wake.set()

    async def _writer(self) -> None:
        session, chan = self.session, self.chan
        while True:
            await self._wake.wait()
            for frame in session.data_to_send(trio.current_time()):
                await chan.send(frame)
            if self._after_send is not None:
                self._after_send()
