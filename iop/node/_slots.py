"""Per-instance capacity: a concurrency limit with a bounded, fair FIFO queue.

An instance executes at most ``max_concurrency`` runs at once. A run that
finds every slot taken waits in a FIFO queue of at most ``max_queue`` runs,
for at most ``queue_timeout_s``:

* queue full: ``IopError(status=429, code=ErrorCode.QUEUE_FULL)``; the runtime turns
  it into the run's ``Error`` event, and the edge answers 429;
* waited too long: ``RunAborted(reason=CancelReason.QUEUE_TIMEOUT)``; the runtime turns
  it into ``Cancelled(queue_timeout)``.

A run the edge placed on an *overflow* seat (``take(overflow=True)``: an
instance whose engine preempts lower-priority runs for higher ones;
docs/operations.md, "Engine priority") starts at once even with every
slot taken, up to ``OVERFLOW_SEATS_PER_SLOT`` per slot beyond them; past
that it queues as any run. An overflow seat that frees is not a free slot:
a waiter gets one only when fewer than ``max_concurrency`` are held.

Every change of ``in_flight`` or ``queued`` calls ``on_change`` (the node's
load reports: ``iop.node._agent``); it must not block.

A released slot is *handed over* to the first waiter (``in_flight`` does not
drop in between), so a newcomer can never overtake the queue, and each slot is
given to exactly one waiter. A waiter that is cancelled or times out leaves
the queue; if a slot was handed to it in the same instant, it passes the slot
on. Nothing polls: waiters sleep on their own ``trio.Event``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final

import trio

from iop.errors import ErrorCode, IopError, RunAborted
from iop.events import CancelReason

__all__ = ["OVERFLOW_SEATS_PER_SLOT", "InstanceSlots"]

# Overflow seats an instance takes beyond its slots, per slot: the edge
# places at most one per lower-priority run it holds there (and at most
# ``scheduler.priority_overflow_slots``), so a batch of the instance's slots
# never holds more than that many runs an engine preempts; the node's own
# bound keeps a peer that asks for more from doubling its engine's batch.
OVERFLOW_SEATS_PER_SLOT: Final = 1


class _Waiter:
    __slots__ = ("granted", "woken")

    def __init__(self) -> None:
        self.woken = trio.Event()
        self.granted = False


class InstanceSlots:
    """Capacity limiter of one adapter instance.

    Args:
        max_concurrency: Runs executed at once (>= 1).
        max_queue: Runs allowed to wait for a slot (0: no queue).
        queue_timeout_s: Longest wait for a slot.

    Attributes:
        in_flight: Slots currently held (including ones handed to a waiter
            that has not resumed yet).
    """

    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float) -> None:
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0
        self.on_change: Callable[[], None] | None = None
        # Insertion-ordered: the first key is the oldest waiter; removal of a
        # cancelled waiter is O(1).
        self._waiters: dict[_Waiter, None] = {}

    @property
    def queued(self) -> int:
        """Runs waiting for a slot."""
        return len(self._waiters)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[None]:
        """Hold one slot for the duration of the ``async with`` block (``take``, ``release``).

        Raises:
            IopError: The queue is full (status 429, code ``queue_full``).
            RunAborted: No slot within ``queue_timeout_s`` (reason
                ``queue_timeout``).
        """
        await self.take()
        try:
            yield
        finally:
            self.release()

    async def take(self, overflow: bool = False) -> None:
        """Take one slot, waiting in the queue if none is free; ``release`` gives it back.

        For a holder that keeps no context manager per slot (``RunExecutor``:
        one per open stream). ``overflow``: a run the edge placed on an
        overflow seat (module docstring). Raises as ``acquire`` does; then
        no slot is held.
        """
        await trio.lowlevel.checkpoint()
        if (self.in_flight < self.max_concurrency and not self._waiters) or (
            overflow and self.in_flight < self.max_concurrency * (1 + OVERFLOW_SEATS_PER_SLOT)
        ):
            self.in_flight += 1
            self._changed()
        else:
            await self._wait_for_slot()

    def release(self) -> None:
        """Give back a slot ``take`` gave."""
        self._release()

    def resize(self, max_concurrency: int, max_queue: int, queue_timeout_s: float) -> None:
        """New limits (a config reload). Held slots and queued runs stay: a
        lower ``max_concurrency`` is reached as runs end (none is taken
        away), a higher one hands its new slots to the oldest waiters now; a
        lower ``max_queue`` refuses newcomers until the queue is below it; a
        new ``queue_timeout_s`` is the wait of runs that queue from now on."""
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        while self._waiters and self.in_flight < self.max_concurrency:
            self.in_flight += 1
            self._grant_oldest()
        self._changed()

    def _grant_oldest(self) -> None:
        waiter = next(iter(self._waiters))
        del self._waiters[waiter]
        waiter.granted = True
        waiter.woken.set()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _wait_for_slot(self) -> None:
        if len(self._waiters) >= self.max_queue:
            raise IopError(
                f"instance busy: {self.in_flight} runs in flight and "
                f"{len(self._waiters)} queued (max_queue={self.max_queue})",
                status=429,
                code=ErrorCode.QUEUE_FULL,
            )
        waiter = _Waiter()
        self._waiters[waiter] = None
        self._changed()
        try:
            with trio.move_on_after(self.queue_timeout_s):
                await waiter.woken.wait()
        except BaseException:
            # Cancelled from outside: leave the queue, or pass on a slot that
            # was handed to us in the same instant. Then let it propagate.
            self._abandon(waiter)
            raise
        if not waiter.granted:
            self._abandon(waiter)
            raise RunAborted(
                f"no free slot within queue_timeout_s={self.queue_timeout_s:g}",
                reason=CancelReason.QUEUE_TIMEOUT,
            )

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.granted:
            self._release()
        else:
            del self._waiters[waiter]
            self._changed()

    def _release(self) -> None:
        if self._waiters and self.in_flight <= self.max_concurrency:
            # Hand the slot straight to the oldest waiter: in_flight unchanged.
            self._grant_oldest()
        else:
            # No waiter, or more slots held than there are since a resize.
            self.in_flight -= 1
        self._changed()
