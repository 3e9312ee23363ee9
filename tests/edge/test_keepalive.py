"""The edge's keep-alive clock: one task wakes every stream that wrote nothing
for its interval, never early and at most a resolution late, with no timer
per wait (``iop/edge/runs/_keepalive.py``); virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop.edge.runs import KEEPALIVE_RESOLUTION_S, KeepaliveClock
from iop.events import Delta, RuntimeEvent
from iop.runtime import RunEvents
from iop.runtime._channel import OneToOneChannel


def run_events() -> tuple[OneToOneChannel[RuntimeEvent], RunEvents]:
    channel = OneToOneChannel[RuntimeEvent](4)
    return channel, RunEvents(channel)


async def wait_for_wakeup(events: RunEvents) -> float:
    """When the clock interrupted the wait (an event is a failure)."""
    with pytest.raises(trio.WouldBlock):
        await events.receive()
    return trio.current_time()


async def test_an_idle_stream_is_woken_after_its_interval_and_not_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = KeepaliveClock()
    _, events = run_events()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        watch = clock.watch(events, 1.0)
        t0 = watch.last_write
        woken = await wait_for_wakeup(events)
        assert 1.0 <= woken - t0 <= 1.0 + KEEPALIVE_RESOLUTION_S
        watch.last_write = woken  # it wrote its keep-alive
        again = await wait_for_wakeup(events)
        assert 1.0 <= again - woken <= 1.0 + KEEPALIVE_RESOLUTION_S
        clock.discard(watch)
        nursery.cancel_scope.cancel()
    assert clock.wakeups == 2


async def test_a_stream_that_writes_is_never_woken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = KeepaliveClock()
    channel, events = run_events()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        watch = clock.watch(events, 1.0)
        for i in range(50):  # an event every 0.3 s for 15 s, each written
            with trio.move_on_after(0.3):
                await events.receive()
                pytest.fail("no event was sent yet")
            channel.send_nowait(Delta(str(i)))
            assert await events.receive() == Delta(str(i))
            watch.last_write = trio.current_time()
        clock.discard(watch)
        nursery.cancel_scope.cancel()
    assert clock.wakeups == 0


async def test_a_stream_added_to_a_sleeping_clock_moves_its_wakeup_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = KeepaliveClock()
    _, slow_events = run_events()
    _, fast_events = run_events()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        await trio.testing.wait_all_tasks_blocked()  # asleep with nothing to keep
        slow = clock.watch(slow_events, 30.0)
        fast = clock.watch(fast_events, 1.0)
        t0 = fast.last_write
        woken = await wait_for_wakeup(fast_events)
        assert 1.0 <= woken - t0 <= 1.0 + KEEPALIVE_RESOLUTION_S
        clock.discard(fast)
        clock.discard(slow)
        assert len(clock) == 0
        nursery.cancel_scope.cancel()


def test_a_clock_needs_a_positive_resolution() -> None:
    with pytest.raises(ValueError, match="positive"):
        KeepaliveClock(0)
