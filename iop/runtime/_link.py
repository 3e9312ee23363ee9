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
  A frame that has already arrived behind the one it took (the peer's
  frames of one socket read, queued by the server) it takes at once,
  before any other task runs, up to ``MAX_FRAMES_PER_WAKE`` per wake-up:
  a stream the events wake then finds all of them and writes them in one
  send, however small the frames the peer cut them into
  (docs/benchmarks.md, "Coalescing across frames").
* the **writer**: sleeps until woken (``wake``), then sends everything the
  session has queued, for every run, in as few frames as the peer accepts
  (``data_to_send``). Nothing else ever calls ``chan.send``.

So there is no pinger and no watchdog task, and a link that carries traffic
sends no heartbeats at all: the session pings only a peer it has not heard
from (``iop.protocol._session``, "Liveness").

A reader may be told to wait before its next frame (``Backpressure``: the
edge with per-run credit off, when a run's consumer is behind). It then
reads nothing, the peer's frames wait in the server's queue and the TCP
window, and the peer's writer stops: the link's own flow control, and
head-of-line blocking for every run on it. The peer is not silent
meanwhile, we are not listening: its liveness deadline is suspended while
the reader waits and starts again, with what was left of it, once it reads.

An end with many links (the edge) gives its drivers one ``LinkClock``
instead: their readers then wait without a deadline, and the clock's one
task keeps the time of them all. It loses every link whose peer was silent
for the session's timeout (at most ``LIVENESS_RESOLUTION_S`` early) and, every
``sweep_every_s``, pings every quiet link in one sweep (``session.sweep``).
An idle edge then wakes once per sweep for all its pings, not once per link,
and a frame moves no deadline; the pings leave together and the nodes'
answers (``NodeSession`` answers a ping) come back together, so a wake-up
of the edge serves many links (docs/benchmarks.md, "Idle links").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, Generic, NoReturn, Protocol, TypeVar, cast, runtime_checkable

import trio

from iop.errors import LinkError, first_leaf
from iop.protocol import CLOSE_HEARTBEAT, FrameChannel, LinkClosed

__all__ = [
    "LIVENESS_RESOLUTION_S",
    "MAX_FRAMES_PER_WAKE",
    "Backpressure",
    "LinkClock",
    "LinkDriver",
    "LinkSession",
    "NowaitFrameChannel",
    "PeerSilent",
    "SweptSession",
    "Wakeup",
]

E = TypeVar("E")

# Frames the reader takes without a schedule point when more have already
# arrived (``NowaitFrameChannel``): the edge's ASGI queue holds at most
# ``max_app_queue_size`` (10) messages, one more already in a woken reader's
# hands and a waiting sender's (12 seen at most), so a wake-up of the edge's
# reader takes what it has; the bound is for a channel that can hold a
# flood, whose reader then yields between batches of this many.
MAX_FRAMES_PER_WAKE: Final = 16

# How often at most a ``LinkClock`` wakes to check deadlines, and so how much
# earlier than its deadline it may lose a silent peer: a node silent for
# 1.9 to 2.0 s of a 2 s timeout is lost, never later (timers allowing).
LIVENESS_RESOLUTION_S: Final = 0.1


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


@runtime_checkable
class NowaitFrameChannel(FrameChannel, Protocol):
    """A ``FrameChannel`` that hands over a frame that has already arrived
    without a schedule point (the edge's ``AsgiFrameChannel``)."""

    def receive_nowait(self) -> bytes:
        """The next frame if one has arrived (with the checks ``receive``
        makes of it); else ``trio.WouldBlock``."""
        ...


class Backpressure(Protocol):
    """What makes a link's reader wait before it reads on (the edge's
    ``iop.edge.runs._delivery.WithoutCredit``: per-run credit off)."""

    def is_held(self) -> bool: ...

    async def release(self) -> None: ...


class SweptSession(Protocol):
    """What a ``LinkClock`` needs of a session (``EdgeSession``)."""

    @property
    def liveness_deadline(self) -> float: ...

    @property
    def has_data_to_send(self) -> bool: ...

    def sweep(self, now: float) -> None: ...


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

    def clear(self) -> None:
        """Forget a ``set()`` no ``wait()`` has returned for yet."""
        self._set = False

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
        clock: Keeps this link's time with many others' (its session must
            be a ``SweptSession``); None: the reader's own deadline does.
        backpressure: Asked after each frame whether the reader must wait
            before the next (only with a ``clock``).
        frame_interval: Least time in seconds between two rounds of frames
            that are not urgent (``wake(urgent=False)``): what is queued
            within it goes out together, in one frame, when it has passed.
            A round after a quiet link goes at once, and an urgent wake-up
            ends the wait. 0: every wake-up is a round.
    """

    def __init__(
        self,
        chan: FrameChannel,
        session: LinkSession[E],
        on_events: Callable[[list[E]], None],
        *,
        after_send: Callable[[], None] | None = None,
        peer: str = "peer",
        clock: LinkClock | None = None,
        backpressure: Backpressure | None = None,
        frame_interval: float = 0.0,
    ) -> None:
        if backpressure is not None and clock is None:
            raise ValueError("a link reader that may wait needs a LinkClock")
        if not 0 <= frame_interval < math.inf:
            raise ValueError(f"frame_interval must be >= 0 and finite, got {frame_interval!r}")
        self._frame_interval = frame_interval
        # Something that may not wait for the interval is queued, and the
        # writer's wait for the interval while it is not (None: no wait).
        self._urgent = False
        self._pacing: trio.Event | None = None
        self.chan = chan
        self._backpressure = backpressure
        self._holding = False
        self._resume_until = -math.inf
        self.session = session
        self._on_events = on_events
        self._after_send = after_send
        self._peer = peer
        self._clock = clock
        self._wake = Wakeup()
        # The reader's scope (its deadline: liveness, or the next tick; none
        # under a clock, which cancels it when the peer is lost).
        self._scope: trio.CancelScope | None = None

    @property
    def liveness_deadline(self) -> float:
        """When the peer is lost: never while the reader waits on backpressure,
        and after a wait no sooner than what was left of it when it began."""
        if self._holding:
            return math.inf
        return max(self.session.liveness_deadline, self._resume_until)

    async def _hold(self, backpressure: Backpressure) -> None:
        left = max(0.0, self.session.liveness_deadline - trio.current_time())
        self._holding = True
        try:
            await backpressure.release()
        finally:
            self._holding = False
            self._resume_until = trio.current_time() + left

    def wake(self, *, urgent: bool = True) -> None:
        """The session has something to send, or to do at a tick: the writer
        sends it soon (not ``urgent``: within ``frame_interval`` of its last
        round, with whatever else comes meanwhile), and the reader's deadline
        moves up to the session's next tick if that came earlier (a collected
        run began to hold events)."""
        if urgent:
            self._send_soon()
        else:
            self._wake.set()
        scope = self._scope
        if scope is not None and self._clock is None:
            tick = self.session.next_tick_at
            if tick < scope.deadline:
                scope.deadline = tick

    def _send_soon(self) -> None:
        """The writer's next round goes without waiting for the frame
        interval: an urgent ``wake``, and whatever the reader or the clock
        found the session has to say (a ping, credit, a report at its tick)."""
        self._wake.set()
        self._urgent = True
        if self._pacing is not None:
            self._pacing.set()

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
        except BaseExceptionGroup as group:
            cancelled, rest = group.split(trio.Cancelled)
            if rest is None:
                raise  # only the cancel: the scope that cancelled takes it
            links, other = rest.split(LinkError)
            if other is not None:
                raise  # a bug beside them: everything goes up, nothing is lost
            assert links is not None
            if cancelled is not None:
                # Cancelled from outside while the link broke: the cancel is
                # the cause, and a LinkError beside it would escape the
                # canceller's scope in a group (its caller "never raises").
                raise first_leaf(cancelled, trio.Cancelled) from None
            raise first_leaf(links, LinkError) from None

    def _silent(self) -> PeerSilent:
        return PeerSilent(
            f"{self._peer} silent past the heartbeat timeout",
            close_code=CLOSE_HEARTBEAT,
            reason="heartbeat timeout",
        )

    async def _reader(self) -> None:
        session, chan = self.session, self.chan
        nowait = _nowait(chan)
        if session.has_data_to_send:
            self._send_soon()
        if self._clock is not None:
            await self._clocked_reader(self._clock)
            return
        while True:
            with trio.CancelScope(
                deadline=min(session.liveness_deadline, session.next_tick_at)
            ) as scope:
                self._scope = scope
                while True:
                    frame: bytes | None = await chan.receive()
                    taken = 0
                    while frame is not None:
                        taken += 1
                        events = session.receive(frame, trio.current_time())
                        scope.deadline = min(session.liveness_deadline, session.next_tick_at)
                        if events:
                            self._on_events(events)
                        if session.has_data_to_send:
                            self._send_soon()
                        frame = _queued(nowait, taken)
            if not scope.cancelled_caught:  # pragma: no cover - the loop only ends by cancel
                return
            now = trio.current_time()
            if now >= session.liveness_deadline:
                raise self._silent()
            session.tick(now)
            if session.has_data_to_send:
                self._send_soon()

    async def _clocked_reader(self, clock: LinkClock) -> None:
        session, chan = self.session, self.chan
        nowait = _nowait(chan)
        backpressure = self._backpressure
        with trio.CancelScope() as scope:
            self._scope = scope
            clock.add(self)
            try:
                while True:
                    frame: bytes | None = await chan.receive()
                    taken = 0
                    while frame is not None:
                        taken += 1
                        events = session.receive(frame, trio.current_time())
                        if events:
                            self._on_events(events)
                        if session.has_data_to_send:
                            self._send_soon()
                        if backpressure is not None and backpressure.is_held():
                            await self._hold(backpressure)
                            break
                        frame = _queued(nowait, taken)
            finally:
                clock.discard(self)
        # Only the clock cancels this scope (``lose``): the peer went silent.
        raise self._silent()

    def lose(self) -> None:
        """The clock found the peer silent: the reader raises ``PeerSilent``."""
        if self._scope is not None:
            self._scope.cancel()

    def sweep(self, now: float) -> None:
        """The clock's ping sweep: the session pings if the link was quiet."""
        session = cast("SweptSession", self.session)
        session.sweep(now)
        if session.has_data_to_send:
            self._send_soon()

    async def _writer(self) -> None:
        session, chan = self.session, self.chan
        interval = self._frame_interval
        last_round = -math.inf
        while True:
            await self._wake.wait()
            if interval and not self._urgent:
                due = last_round + interval
                if due > trio.current_time():
                    await self._paced(due)
                    # What was queued meanwhile goes in this round: the
                    # wake-ups it made ask for nothing more.
                    self._wake.clear()
            self._urgent = False
            for frame in session.data_to_send(trio.current_time()):
                await chan.send(frame)
            last_round = trio.current_time()
            scope = self._scope
            if scope is not None and self._clock is None:
                # Nothing queued any more: the session's next ping is due
                # again (``next_tick_at`` has none while the writer has work).
                tick = session.next_tick_at
                if tick < scope.deadline:
                    scope.deadline = tick
            if self._after_send is not None:
                self._after_send()

    async def _paced(self, due: float) -> None:
        """Wait until ``due`` (``frame_interval`` after the last round), or
        until an urgent wake-up: what is queued meanwhile joins the round."""
        self._pacing = event = trio.Event()
        try:
            with trio.move_on_at(due):
                await event.wait()
        finally:
            self._pacing = None


def _nowait(chan: FrameChannel) -> Callable[[], bytes] | None:
    """``chan``'s ``receive_nowait``, if it has one."""
    return chan.receive_nowait if isinstance(chan, NowaitFrameChannel) else None


def _queued(nowait: Callable[[], bytes] | None, taken: int) -> bytes | None:
    """The next frame that has already arrived, if this wake-up may take one
    more after ``taken`` (``MAX_FRAMES_PER_WAKE``); else None: the reader's
    next ``receive`` is its schedule point."""
    if nowait is None or taken >= MAX_FRAMES_PER_WAKE:
        return None
    try:
        return nowait()
    except trio.WouldBlock:
        return None


class LinkClock:
    """One task that keeps the liveness time of many links (the edge's).

    ``run`` loses every registered link whose session's ``liveness_deadline``
    is within ``LIVENESS_RESOLUTION_S`` (``LinkDriver.lose``), and every
    ``sweep_every_s`` calls ``sweep`` on all of them at once, so the quiet
    ones' pings leave in one wake-up. It sleeps until the next sweep or the
    earliest deadline, whichever comes first, but wakes at most once per
    resolution: however many links, and whatever their phases, it costs at
    most ``1 / LIVENESS_RESOLUTION_S`` wake-ups a second, and an idle edge
    whose nodes answer its sweeps about one per sweep.

    Args:
        sweep_every_s: Between two ping sweeps (the edge's
            ``link.heartbeat_timeout_s``: ``EdgeSession.sweep``).
        resolution_s: The least time between two wake-ups (at most a
            quarter of ``sweep_every_s``, for heartbeats set very short).
    """

    def __init__(
        self, sweep_every_s: float, *, resolution_s: float = LIVENESS_RESOLUTION_S
    ) -> None:
        if not (sweep_every_s > 0 and resolution_s > 0):
            raise ValueError("a link clock needs a positive sweep interval and resolution")
        self.sweep_every_s = sweep_every_s
        self.resolution_s = min(resolution_s, sweep_every_s / 4)
        self._drivers: dict[LinkDriver[Any], None] = {}
        self._sleep: trio.CancelScope | None = None
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self._drivers)

    def add(self, driver: LinkDriver[Any]) -> None:
        """Keep ``driver``'s time from now on (its reader calls this)."""
        self._drivers[driver] = None
        sleep = self._sleep
        if sleep is not None:
            # A link whose last frame is older than the clock's plan (a slow
            # handshake) moves the next wake-up up.
            wake_at = driver.liveness_deadline - self.resolution_s
            if wake_at < sleep.deadline:
                sleep.deadline = wake_at

    def discard(self, driver: LinkDriver[Any]) -> None:
        self._drivers.pop(driver, None)

    async def run(self) -> NoReturn:
        """Keep time until cancelled."""
        res = self.resolution_s
        next_sweep = trio.current_time() + self.sweep_every_s
        while True:
            now = trio.current_time()
            earliest = math.inf
            for driver in list(self._drivers):
                deadline = driver.liveness_deadline
                if deadline <= now + res:
                    self.discard(driver)
                    driver.lose()
                elif deadline < earliest:
                    earliest = deadline
            if now >= next_sweep:
                self.sweeps += 1
                for driver in self._drivers:
                    driver.sweep(now)
                next_sweep += self.sweep_every_s
                if next_sweep <= now:  # the clock was late: sweep in step again
                    next_sweep = now + self.sweep_every_s
            with trio.CancelScope(
                deadline=min(next_sweep, max(earliest - res, now + res))
            ) as sleep:
                self._sleep = sleep
                await trio.sleep_forever()
            self._sleep = None
