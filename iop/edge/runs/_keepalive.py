"""One clock for the keep-alives of every open SSE stream of an edge.

An SSE stream whose run sends nothing for ``server.keepalive_interval_s``
(queued, in prefill, a backend that pauses) writes a keep-alive comment, so
that proxies and clients keep the connection. Bounding each wait for the
run's next event with a cancel scope does that, but costs a scope per event:
entering and leaving one registers and removes a deadline in trio's heap,
through two ``contextlib`` context managers, once per token of every paced
stream (``_sse_body`` was about 3 % of the edge's CPU at 32 paced streams,
docs/benchmarks.md "Tokens per core at fleet scale").

Here a stream waits for its run's next event with no deadline, and says
when it last wrote (``KeepaliveWatch.last_write``, a float set per write).
One task (``KeepaliveClock.run``) wakes the streams whose last write is
``interval_s`` old: it interrupts the wait in the run's channel
(``RunEvents.interrupt_receive``), whose ``receive`` then raises
``trio.WouldBlock``, and the stream writes its keep-alive. The clock sleeps
until the earliest stream is due, but wakes at most once per
``KEEPALIVE_RESOLUTION_S``: a keep-alive is never early, and at most that
late. Registering is once per stream, not per event; a stream that writes
every 20 ms is never woken by the clock.
"""

from __future__ import annotations

import math
from typing import Final, NoReturn

import trio

from iop.runtime import RunEvents

__all__ = ["KEEPALIVE_RESOLUTION_S", "KeepaliveClock", "KeepaliveWatch"]

# The least time between two of the clock's wake-ups, so at most how late a
# keep-alive is: a small share of the shortest interval a test sets (0.2 s),
# and with thousands of idle streams registered at scattered times, at most
# 20 passes over them a second.
KEEPALIVE_RESOLUTION_S: Final = 0.05


class KeepaliveWatch:
    """One stream on the clock: its run's channel, and when it last wrote."""

    __slots__ = ("events", "interval_s", "last_write")

    def __init__(self, events: RunEvents, interval_s: float, last_write: float) -> None:
        self.events = events
        self.interval_s = interval_s
        self.last_write = last_write


class KeepaliveClock:
    """The task that wakes idle streams (module docstring); ``run`` in a nursery."""

    def __init__(self, resolution_s: float = KEEPALIVE_RESOLUTION_S) -> None:
        if not resolution_s > 0:
            raise ValueError("a keep-alive clock needs a positive resolution")
        self.resolution_s = resolution_s
        self._watches: dict[KeepaliveWatch, None] = {}
        self._sleep: trio.CancelScope | None = None
        self.wakeups = 0  # the streams it interrupted (tests, and the curious)

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, events: RunEvents, interval_s: float) -> KeepaliveWatch:
        """Keep time for a stream that last wrote now; ``discard`` it when it ends."""
        watch = KeepaliveWatch(events, interval_s, trio.current_time())
        self._watches[watch] = None
        sleep = self._sleep
        due = watch.last_write + interval_s
        if sleep is not None and due < sleep.deadline:
            sleep.deadline = due
        return watch

    def discard(self, watch: KeepaliveWatch) -> None:
        self._watches.pop(watch, None)

    async def run(self) -> NoReturn:
        """Wake due streams until cancelled."""
        res = self.resolution_s
        while True:
            now = trio.current_time()
            earliest = math.inf
            for watch in self._watches:
                due = watch.last_write + watch.interval_s
                if due <= now and watch.events.interrupt_receive():
                    # It writes its keep-alive and a new last_write; until
                    # it runs, count it due a full interval from now.
                    self.wakeups += 1
                    due = now + watch.interval_s
                elif due <= now:
                    # Not waiting for an event (about to run, or writing to a
                    # slow client): its next write moves last_write on, and
                    # the due time read then is never earlier than this.
                    due = now + watch.interval_s
                earliest = min(earliest, due)
            with trio.CancelScope(deadline=max(earliest, now + res)) as self._sleep:
                await trio.sleep_forever()
            self._sleep = None
