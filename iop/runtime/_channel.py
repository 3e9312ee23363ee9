"""A memory channel for exactly one sender and one receiver, in little memory."""

from __future__ import annotations

from typing import Generic, TypeVar, cast

import trio

__all__ = ["OneToOneChannel"]

T = TypeVar("T")


class OneToOneChannel(Generic[T]):
    """A bounded FIFO between one sending task and one receiving task.

    What ``trio.open_memory_channel(capacity)`` gives, for one producer and
    one consumer (a run's sink and ``RunEvents``; hypercorn and an edge
    request's ASGI app, ``iop.edge.server._asgi_queue``): the same
    ``send_nowait``/``send``/``receive`` semantics (``WouldBlock`` when full,
    ``EndOfChannel`` after the sender closed and the buffer is drained,
    ``BrokenResourceError`` to a sender whose consumer closed, a checkpoint
    in every ``async`` call, a cancelled wait leaves nothing behind), without
    the pair's general machinery (two endpoint objects, a deque, two ordered
    dicts of waiting tasks and two sets of them: 1.8 KiB, against 0.3 here,
    for each run and each request an edge holds open; ``docs/benchmarks.md``,
    "Memory", "Second pass"). At most one task waits on each side; a second
    is a bug (``trio.BusyResourceError``). The sender closes with ``close``,
    the receiver with ``close_receive``.
    """

    __slots__ = (
        "_capacity",
        "_items",
        "_receive_closed",
        "_receiver",
        "_send_closed",
        "_sender",
        "_sending",
        "_taken",
        "_woken",
    )

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: list[T] = []
        self._send_closed = False
        self._receive_closed = False
        self._receiver: trio.lowlevel.Task | None = None
        # The receiver was woken for an event in ``_items`` and has not run
        # yet: that event is in its hands, not in the buffer (as trio's
        # channel hands it over directly).
        self._woken = False
        self._sender: trio.lowlevel.Task | None = None
        self._sending: T | None = None  # the waiting sender's event
        self._taken = False  # ... went into the buffer (not: the receiver closed)

    def _wake_receiver(self) -> None:
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            self._woken = True
            trio.lowlevel.reschedule(receiver)

    # --- the sender's side (a run's ``Outlet``) -----------------------------------

    def send_nowait(self, event: T) -> None:
        if self._send_closed:
            raise trio.ClosedResourceError
        if self._receive_closed:
            raise trio.BrokenResourceError
        if self._receiver is None and len(self._items) - self._woken >= self._capacity:
            raise trio.WouldBlock
        self._items.append(event)
        self._wake_receiver()

    async def send(self, event: T) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.send_nowait(event)
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._sender is not None:
            raise trio.BusyResourceError("another task is sending on this channel")
        self._sender = trio.lowlevel.current_task()
        self._sending = event
        self._taken = False

        def abort(_: object) -> trio.lowlevel.Abort:
            self._sender = self._sending = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        self._sending = None
        if not self._taken:  # woken by the receiver's close
            raise trio.BrokenResourceError

    def close(self) -> None:
        """The sender's close: the consumer gets ``EndOfChannel`` once it has the rest."""
        if not self._send_closed:
            self._send_closed = True
            self._wake_receiver()

    # --- the receiver's side --------------------------------------------------------

    def receive_nowait(self) -> T:
        if self._receive_closed:
            raise trio.ClosedResourceError
        self._woken = False
        items = self._items
        sender = self._sender
        if sender is not None:
            # Room now: the waiting sender's event joins the buffer.
            items.append(cast(T, self._sending))
            self._sender = None
            self._taken = True
            trio.lowlevel.reschedule(sender)
        if items:
            return items.pop(0)
        if self._send_closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            event = self.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return event
        if self._receiver is not None:
            raise trio.BusyResourceError("another task is receiving on this channel")
        self._receiver = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._receiver = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        # Woken by an event, by the sender's close (then EndOfChannel) or by
        # ``interrupt_receive`` (then WouldBlock, unless an event came since).
        return self.receive_nowait()

    def interrupt_receive(self) -> bool:
        """Wake a receiver waiting in ``receive`` with nothing to take: its
        ``receive`` raises ``trio.WouldBlock``. A timer beside the channel
        without a cancel scope per wait (the edge's keep-alive clock,
        ``iop.edge.runs._keepalive``). Returns whether one was waiting.
        """
        receiver = self._receiver
        if receiver is None:
            return False
        # Not ``_woken``: no event is in its hands, the buffer's room is unchanged.
        self._receiver = None
        trio.lowlevel.reschedule(receiver)
        return True

    def close_receive(self) -> None:
        """The consumer's close: what is buffered is dropped, a sender gets
        ``BrokenResourceError``."""
        if self._receive_closed:
            return
        self._receive_closed = True
        self._items.clear()
        sender = self._sender
        if sender is not None:
            self._sender = None  # not ``_taken``: its send raises
            trio.lowlevel.reschedule(sender)

    def statistics(self) -> trio.MemoryChannelStatistics:
        return trio.MemoryChannelStatistics(
            current_buffer_used=len(self._items),
            max_buffer_size=self._capacity,
            open_send_channels=0 if self._send_closed else 1,
            open_receive_channels=0 if self._receive_closed else 1,
            tasks_waiting_send=0 if self._sender is None else 1,
            tasks_waiting_receive=0 if self._receiver is None else 1,
            peak_buffer_used=len(self._items),
        )
