"""InstanceSlots: FIFO fairness, cancellation, timeout, queue full, counters (virtual time)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop.errors import IopError, RunAborted
from iop.node import InstanceSlots


async def hold(slots: InstanceSlots, name: str, order: list[str], release: trio.Event) -> None:
    async with slots.acquire():
        order.append(name)
        await release.wait()


async def hold_in_turn(
    nursery: trio.Nursery,
    slots: InstanceSlots,
    names: str,
    order: list[str],
    releases: dict[str, trio.Event],
) -> None:
    """Start a ``hold`` per name, each blocked before the next: the queue's order."""
    for name in names:
        nursery.start_soon(hold, slots, name, order, releases[name])
        await trio.testing.wait_all_tasks_blocked()


async def test_free_slot_runs_immediately_and_counters(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(2, 4, 10.0)
    assert (slots.in_flight, slots.queued) == (0, 0)
    async with slots.acquire():
        assert (slots.in_flight, slots.queued) == (1, 0)
        async with slots.acquire():
            assert (slots.in_flight, slots.queued) == (2, 0)
        assert slots.in_flight == 1
    assert (slots.in_flight, slots.queued) == (0, 0)
    assert trio.current_time() == 0


async def test_waiters_get_slots_in_fifo_order(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(1, 10, 100.0)
    order: list[str] = []
    releases = {name: trio.Event() for name in "abcde"}
    async with trio.open_nursery() as nursery:
        await hold_in_turn(nursery, slots, "abcde", order, releases)
        assert order == ["a"]
        assert (slots.in_flight, slots.queued) == (1, 4)
        for name in "abcde":
            releases[name].set()
            await trio.testing.wait_all_tasks_blocked()
    assert order == list("abcde")
    assert (slots.in_flight, slots.queued) == (0, 0)


async def test_newcomer_cannot_overtake_a_handed_over_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    slots = InstanceSlots(1, 10, 100.0)
    order: list[str] = []
    release_a, release_b, release_c = trio.Event(), trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, slots, "a", order, release_a)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, slots, "b", order, release_b)
        await trio.testing.wait_all_tasks_blocked()
        # Release a, and in the same tick a newcomer arrives: b still wins.
        release_a.set()
        nursery.start_soon(hold, slots, "c", order, release_c)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["a", "b"]
        assert (slots.in_flight, slots.queued) == (1, 1)
        release_b.set()
        release_c.set()
    assert order == ["a", "b", "c"]


async def test_queue_full_is_a_429(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(1, 1, 100.0)
    order: list[str] = []
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, slots, "a", order, release)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, slots, "b", order, release)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(IopError) as info:
            async with slots.acquire():
                pytest.fail("should not get a slot")
        assert (info.value.status, info.value.code) == (429, "queue_full")
        assert (slots.in_flight, slots.queued) == (1, 1)
        release.set()
    assert order == ["a", "b"]


async def test_no_queue_means_busy_is_full(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(1, 0, 100.0)
    async with slots.acquire():
        with pytest.raises(IopError, match="busy"):
            async with slots.acquire():
                pass


async def test_queue_timeout(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(1, 4, 2.5)
    async with slots.acquire():
        start = trio.current_time()
        with pytest.raises(RunAborted) as info:
            async with slots.acquire():
                pass
        assert info.value.reason == "queue_timeout"
        assert trio.current_time() - start == pytest.approx(2.5)
        assert (slots.in_flight, slots.queued) == (1, 0)
    assert slots.in_flight == 0


async def test_cancelled_waiter_leaves_the_queue(autojump_clock: trio.abc.Clock) -> None:
    slots = InstanceSlots(1, 4, 100.0)
    order: list[str] = []
    release_a, release_c = trio.Event(), trio.Event()
    b_scope = trio.CancelScope()
    b_done = trio.Event()

    async def b() -> None:
        with b_scope:
            await hold(slots, "b", order, trio.Event())
        b_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, slots, "a", order, release_a)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(b)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, slots, "c", order, release_c)
        await trio.testing.wait_all_tasks_blocked()
        assert slots.queued == 2
        b_scope.cancel()
        await b_done.wait()
        assert (slots.in_flight, slots.queued) == (1, 1)
        release_a.set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["a", "c"]
        release_c.set()
    assert (slots.in_flight, slots.queued) == (0, 0)


async def test_slot_handed_to_a_waiter_cancelled_in_the_same_tick_is_not_lost(
    autojump_clock: trio.abc.Clock,
) -> None:
    slots = InstanceSlots(1, 4, 100.0)
    order: list[str] = []
    release_a, release_c = trio.Event(), trio.Event()
    b_scope = trio.CancelScope()

    async def b() -> None:
        with b_scope:
            await hold(slots, "b", order, trio.Event())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, slots, "a", order, release_a)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(b)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, slots, "c", order, release_c)
        await trio.testing.wait_all_tasks_blocked()
        # In one tick: a hands its slot to b, and b is cancelled.
        release_a.set()
        b_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        # Whether b got to run or not, the slot went on to c exactly once.
        assert order[0] == "a"
        assert order[-1] == "c"
        assert (slots.in_flight, slots.queued) == (1, 0)
        release_c.set()
    assert (slots.in_flight, slots.queued) == (0, 0)


def test_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        InstanceSlots(0, 1, 1.0)
    with pytest.raises(ValueError, match="max_queue"):
        InstanceSlots(1, -1, 1.0)


async def test_take_and_release_are_acquire_without_a_context_manager(
    autojump_clock: trio.abc.Clock,
) -> None:
    slots = InstanceSlots(1, 1, 10.0)
    await slots.take()
    assert (slots.in_flight, slots.queued) == (1, 0)
    got: list[str] = []

    async def second() -> None:
        await slots.take()
        got.append("second")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert (slots.in_flight, slots.queued, got) == (1, 1, [])
        with pytest.raises(IopError):  # the queue's one place is taken
            await slots.take()
        slots.release()  # straight to the waiter
    assert (slots.in_flight, slots.queued, got) == (1, 0, ["second"])
    slots.release()
    assert slots.in_flight == 0
    await slots.take()
    with pytest.raises(RunAborted):  # the timeout leaves no slot held
        await slots.take()
    assert (slots.in_flight, slots.queued) == (1, 0)


# --- a config reload: new limits, the slots held and queued stay ------------------------


async def test_a_larger_concurrency_hands_its_new_slots_to_the_oldest_waiters(
    autojump_clock: trio.abc.Clock,
) -> None:
    slots = InstanceSlots(1, 10, 100.0)
    order: list[str] = []
    releases = {name: trio.Event() for name in "abcd"}
    async with trio.open_nursery() as nursery:
        await hold_in_turn(nursery, slots, "abcd", order, releases)
        assert order == ["a"]
        slots.resize(3, 10, 100.0)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(order) == ["a", "b", "c"]  # the two oldest waiters, not "d"
        assert (slots.in_flight, slots.queued) == (3, 1)
        for event in releases.values():
            event.set()
    assert (slots.in_flight, slots.queued) == (0, 0)


async def test_a_smaller_concurrency_is_reached_as_runs_end(
    autojump_clock: trio.abc.Clock,
) -> None:
    slots = InstanceSlots(3, 10, 100.0)
    order: list[str] = []
    releases = {name: trio.Event() for name in "abcd"}
    async with trio.open_nursery() as nursery:
        await hold_in_turn(nursery, slots, "abc", order, releases)
        slots.resize(1, 0, 100.0)
        assert slots.in_flight == 3  # nothing running is taken away
        # A lower queue bound refuses the next waiter.
        with pytest.raises(IopError, match="max_queue=0"):
            await slots.take()
        slots.resize(1, 10, 100.0)
        nursery.start_soon(hold, slots, "d", order, releases["d"])
        await trio.testing.wait_all_tasks_blocked()
        for name in "ab":
            releases[name].set()
            await trio.testing.wait_all_tasks_blocked()
        # Two ended: 1 slot held, at the new limit, so "d" still waits.
        assert order == ["a", "b", "c"]
        assert (slots.in_flight, slots.queued) == (1, 1)
        releases["c"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["a", "b", "c", "d"]
        releases["d"].set()
    assert (slots.in_flight, slots.queued) == (0, 0)


async def test_an_overflow_run_starts_beyond_the_slots_up_to_one_per_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A run the edge placed on an overflow seat (``ExecutionSpec.overflow``:
    the engine preempts a lower-priority run for it) starts at once with
    every slot taken, at most ``max_concurrency`` of them beyond the slots;
    the one past that queues as any run. An overflow seat that frees is no
    slot for a waiter: the slots are still all taken."""
    slots = InstanceSlots(2, 4, 10.0)
    await slots.take()
    await slots.take()
    await slots.take(overflow=True)
    await slots.take(overflow=True)
    assert (slots.in_flight, slots.queued) == (4, 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(slots.take, True)
        await trio.testing.wait_all_tasks_blocked()
        assert (slots.in_flight, slots.queued) == (4, 1)
        slots.release()
        slots.release()  # the two overflow seats free: both slots still taken
        await trio.testing.wait_all_tasks_blocked()
        assert (slots.in_flight, slots.queued) == (2, 1)
        slots.release()  # a slot frees: handed to the waiter
    assert (slots.in_flight, slots.queued) == (2, 0)
