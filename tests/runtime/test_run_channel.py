"""A run's event channel behaves as trio's memory channel does, for one sender and one receiver.

Every test runs against both: ``trio.open_memory_channel`` (the reference)
and ``OneToOneChannel`` (what a run uses, for its memory: docs/benchmarks.md,
"Memory", "Second pass").
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import pytest
import trio
import trio.testing

from iop.events import Delta, RuntimeEvent
from iop.runtime._channel import OneToOneChannel
from iop.runtime._run import RunEvents


class Pair(Protocol):
    def send_nowait(self, event: RuntimeEvent) -> None: ...
    async def send(self, event: RuntimeEvent) -> None: ...
    def close_send(self) -> None: ...
    def receive_nowait(self) -> RuntimeEvent: ...
    async def receive(self) -> RuntimeEvent: ...
    def close_receive(self) -> None: ...


class _TrioPair:
    def __init__(self, capacity: int) -> None:
        self.tx, self.rx = trio.open_memory_channel[RuntimeEvent](capacity)
        self.send_nowait = self.tx.send_nowait
        self.send = self.tx.send
        self.close_send = self.tx.close
        self.receive_nowait = self.rx.receive_nowait
        self.receive = self.rx.receive
        self.close_receive = self.rx.close


class _RunPair:
    def __init__(self, capacity: int) -> None:
        self.channel = OneToOneChannel[RuntimeEvent](capacity)
        events = RunEvents(self.channel)
        self.send_nowait = self.channel.send_nowait
        self.send = self.channel.send
        self.close_send = self.channel.close
        self.receive_nowait = events.receive_nowait
        self.receive = events.receive
        self.close_receive = events.close


Factory = Callable[[int], Any]
pairs = pytest.mark.parametrize("make", [_TrioPair, _RunPair], ids=["trio", "run"])


def ev(i: int) -> Delta:
    return Delta(text=str(i))


@pairs
async def test_fifo_up_to_capacity_then_would_block(make: Factory) -> None:
    p: Pair = make(3)
    for i in range(3):
        p.send_nowait(ev(i))
    with pytest.raises(trio.WouldBlock):
        p.send_nowait(ev(3))
    assert [p.receive_nowait() for _ in range(3)] == [ev(0), ev(1), ev(2)]
    with pytest.raises(trio.WouldBlock):
        p.receive_nowait()


@pairs
async def test_close_send_delivers_the_rest_then_end_of_channel(make: Factory) -> None:
    p: Pair = make(4)
    p.send_nowait(ev(0))
    p.send_nowait(ev(1))
    p.close_send()
    with pytest.raises(trio.ClosedResourceError):
        p.send_nowait(ev(2))
    assert await p.receive() == ev(0)
    assert p.receive_nowait() == ev(1)
    with pytest.raises(trio.EndOfChannel):
        await p.receive()
    with pytest.raises(trio.EndOfChannel):
        p.receive_nowait()


@pairs
async def test_close_send_wakes_a_waiting_receiver_with_end_of_channel(make: Factory) -> None:
    p: Pair = make(4)
    got: list[object] = []

    async def receiver() -> None:
        try:
            await p.receive()
        except trio.EndOfChannel:
            got.append("end")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        p.close_send()
    assert got == ["end"]


@pairs
async def test_close_receive_breaks_the_sender(make: Factory) -> None:
    p: Pair = make(1)
    p.send_nowait(ev(0))
    p.close_receive()
    with pytest.raises(trio.BrokenResourceError):
        p.send_nowait(ev(1))
    with pytest.raises(trio.BrokenResourceError):
        await p.send(ev(1))
    with pytest.raises(trio.ClosedResourceError):
        p.receive_nowait()


@pairs
async def test_close_receive_wakes_a_blocked_sender_with_broken(make: Factory) -> None:
    p: Pair = make(1)
    p.send_nowait(ev(0))
    got: list[object] = []

    async def sender() -> None:
        try:
            await p.send(ev(1))
        except trio.BrokenResourceError:
            got.append("broken")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        p.close_receive()
    assert got == ["broken"]


@pairs
async def test_a_waiting_receiver_gets_the_event_and_capacity_still_counts(make: Factory) -> None:
    p: Pair = make(1)
    got: list[RuntimeEvent] = []

    async def receiver() -> None:
        got.append(await p.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        p.send_nowait(ev(0))  # to the waiting receiver
        p.send_nowait(ev(1))  # the buffer's one place
        with pytest.raises(trio.WouldBlock):
            p.send_nowait(ev(2))
    assert got == [ev(0)]
    assert p.receive_nowait() == ev(1)


@pairs
async def test_a_blocked_sender_goes_on_when_the_receiver_takes(make: Factory) -> None:
    p: Pair = make(1)
    p.send_nowait(ev(0))
    sent: list[bool] = []

    async def sender() -> None:
        await p.send(ev(1))
        sent.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert p.receive_nowait() == ev(0)
    assert sent == [True]
    assert p.receive_nowait() == ev(1)


@pairs
async def test_a_cancelled_receive_leaves_nothing_behind(make: Factory) -> None:
    p: Pair = make(2)
    with trio.move_on_after(1) as scope:
        await p.receive()
    assert scope.cancelled_caught
    p.send_nowait(ev(0))
    p.send_nowait(ev(1))  # the receiver that left holds no place
    assert [p.receive_nowait(), p.receive_nowait()] == [ev(0), ev(1)]


@pairs
async def test_a_cancelled_send_delivers_nothing(make: Factory) -> None:
    p: Pair = make(1)
    p.send_nowait(ev(0))
    with trio.move_on_after(1) as scope:
        await p.send(ev(1))
    assert scope.cancelled_caught
    assert p.receive_nowait() == ev(0)
    with pytest.raises(trio.WouldBlock):
        p.receive_nowait()


@pairs
async def test_send_and_receive_are_checkpoints(make: Factory) -> None:
    p: Pair = make(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await p.send(ev(0))
    p.send_nowait(ev(0))
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await p.receive()
    assert p.receive_nowait() == ev(0)  # not taken by the cancelled receive
    with trio.testing.assert_checkpoints():
        p.send_nowait(ev(1))
        await p.receive()


async def test_a_second_waiting_receiver_is_a_bug() -> None:
    p = _RunPair(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await p.receive()
        nursery.cancel_scope.cancel()


async def test_statistics() -> None:
    p = _RunPair(2)
    p.send_nowait(ev(0))
    stats = RunEvents(p.channel).statistics()
    assert (stats.current_buffer_used, stats.max_buffer_size) == (1, 2)
    assert (stats.open_send_channels, stats.open_receive_channels) == (1, 1)
    p.close_send()
    assert p.channel.statistics().open_send_channels == 0


@pairs
async def test_a_taken_send_returns_even_if_the_receiver_closes_next(make: Factory) -> None:
    p: Pair = make(1)
    p.send_nowait(ev(0))
    sent: list[bool] = []

    async def sender() -> None:
        await p.send(ev(1))
        sent.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert p.receive_nowait() == ev(0)  # ev(1) joins the buffer
        p.close_receive()
    assert sent == [True]


async def _receive_once(events: RunEvents, outcome: list[object]) -> None:
    """One ``receive``: its event, or ``trio.WouldBlock`` when interrupted."""
    try:
        outcome.append(await events.receive())
    except trio.WouldBlock:
        outcome.append(trio.WouldBlock)


async def test_an_interrupted_receive_raises_would_block() -> None:
    # The edge's keep-alive clock wakes an idle stream this way, with no
    # cancel scope per wait (iop/edge/runs/_keepalive.py).
    p = _RunPair(1)
    events = RunEvents(p.channel)
    assert not events.interrupt_receive()  # nobody waits
    outcome: list[object] = []
    receiver = partial(_receive_once, events, outcome)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        assert events.interrupt_receive()
        assert not events.interrupt_receive()  # woken once
    assert outcome == [trio.WouldBlock]
    p.send_nowait(ev(0))  # nothing was lost or taken: the channel goes on
    assert events.receive_nowait() == ev(0)


async def test_an_event_sent_before_the_interrupted_receiver_runs_is_what_it_gets() -> None:
    p = _RunPair(1)
    events = RunEvents(p.channel)
    outcome: list[object] = []
    receiver = partial(_receive_once, events, outcome)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        assert events.interrupt_receive()
        p.send_nowait(ev(0))
        # The room is the channel's capacity (one), not one more: the
        # interrupt put no event in the receiver's hands.
        with pytest.raises(trio.WouldBlock):
            p.send_nowait(ev(1))
    assert outcome == [ev(0)]
