"""Overflow seats for engine priority (iop.edge.scheduler, docs/operations.md, "Engine
priority"): when a run of a higher objective priority finds no free slot, and an
instance whose engine preempts by priority (it advertises ``engine_priority``) holds
sheddable runs of a lower priority, the run takes a seat there beyond the instance's
slots (``scheduler.priority_overflow_slots``), so that the engine preempts one of them
for it. Never for a sheddable run; never more seats beyond the slots than lower-priority
sheddable runs held there, nor than the key; the seat counts like any lease. On an edge core with a
hand-played node and a virtual clock; the config's bounds at the end.
"""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities
from iop.config import EdgeConfig
from iop.errors import ConfigError
from iop.events import Complete, Start
from iop.protocol import AssignReceived
from tests.edge.test_core import FakeNode, caps, drain_events, edge_with_node
from tests.edge.test_preemption import edge, setup, submit


def engine_caps(slots: int = 2, engine_priority: bool = True) -> Capabilities:
    return msgspec.structs.replace(caps(slots=slots), engine_priority=engine_priority)


def taken(node: FakeNode) -> dict[str, AssignReceived]:
    """The Assigns the node has received and not yet taken, by run id."""
    out = {}
    while True:
        try:
            got = node.assigns.receive_nowait()
        except trio.WouldBlock:
            return out
        out[got.assign.run_id] = got


async def test_a_higher_run_takes_an_overflow_seat_over_lower_sheddable_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(priority_overflow_slots=2, max_preemptions=0)
    async with edge_with_node(cfg, [engine_caps(slots=2)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1", "b2")
        got = taken(node)
        assert list(got) == ["b0", "b1"]
        # The engine is told each run's objective priority; a slot is no overflow.
        assert got["b0"].assign.spec.priority == 0
        assert not got["b0"].assign.spec.overflow
        runs |= await submit(core, "interactive", "i0", "i1", "i2")
        got = taken(node)
        # Two overflow seats (the key, and two batch runs held there); the third waits.
        assert list(got) == ["i0", "i1"]
        assert got["i0"].assign.spec.priority == 10
        assert got["i0"].assign.spec.overflow
        assert core.scheduler.queued == 2  # b2 and i2
        (where,) = runs["i0"].timeline.placements
        assert where.why.startswith("overflow")
        (inst,) = (i for _, i in core.registry.instances())
        assert (inst.in_flight, inst.overflow_in_flight) == (4, 2)
        assert core.scheduler.overflowed == 2
        # An overflow seat that frees goes to the waiting interactive run,
        # never to the batch run: the slots are still all held.
        await node.send("i0", Start(), Complete())
        assert await drain_events(runs.pop("i0")) == [Start(), Complete()]
        await trio.testing.wait_all_tasks_blocked()
        got = taken(node)
        assert list(got) == ["i2"]
        assert got["i2"].assign.spec.overflow
        assert core.scheduler.queued == 1
        assert (inst.in_flight, inst.overflow_in_flight) == (4, 2)


async def test_never_past_the_lower_sheddable_runs_held_there(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(priority_overflow_slots=8, max_preemptions=0)
    async with edge_with_node(cfg, [engine_caps(slots=2)]) as (core, node, _):
        await submit(core, "batch", "b0")
        await submit(core, "", "n0")  # no objective: priority 0, not sheddable
        assert list(taken(node)) == ["b0", "n0"]
        await submit(core, "interactive", "i0", "i1")
        # One batch run below it: one overflow seat, however many the key allows.
        assert list(taken(node)) == ["i0"]
        assert core.scheduler.queued == 1


async def test_the_bound_is_the_seats_beyond_the_slots_not_the_runs_placed_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An overflow run whose lower neighbour ended holds one of the slots
    now: the seats beyond the slots, not the runs once placed on overflow
    seats, are what the lower runs must cover (the engine, a batch of the
    slots, then still has a lower run to pause for the next one)."""
    cfg = setup(priority_overflow_slots=2, max_preemptions=0)
    async with edge_with_node(cfg, [engine_caps(slots=2)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1", "b2")
        runs |= await submit(core, "interactive", "i0")
        assert list(taken(node)) == ["b0", "b1", "i0"]
        # b0 ends: its slot is not free (b1 and i0 hold both), b2 still waits.
        await node.send("b0", Start(), Complete())
        await drain_events(runs.pop("b0"))
        await trio.testing.wait_all_tasks_blocked()
        assert taken(node) == {}
        # One batch run is left under the interactive ones, and no seat is
        # beyond the slots: the next interactive run may take one.
        runs |= await submit(core, "interactive", "i1")
        got = taken(node)
        assert list(got) == ["i1"]
        assert got["i1"].assign.spec.overflow
        # Now one seat beyond the slots and one batch run: no third.
        await submit(core, "interactive", "i2")
        assert taken(node) == {}


async def test_a_sheddable_run_never_overflows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(priority_overflow_slots=2, max_preemptions=0)
    async with edge_with_node(cfg, [engine_caps(slots=2)]) as (core, node, _):
        await submit(core, "bulk", "k0", "k1")
        await submit(core, "batch", "b0")  # above the bulk runs, but sheddable
        assert list(taken(node)) == ["k0", "k1"]
        assert core.scheduler.queued == 1
        assert core.scheduler.overflowed == 0


@pytest.mark.parametrize(
    ("overflow", "engine_priority"), [(0, True), (2, False)], ids=["off", "not-advertised"]
)
async def test_no_overflow_off_or_on_an_engine_without_priority(
    autojump_clock: trio.testing.MockClock, overflow: int, engine_priority: bool
) -> None:
    cfg = setup(priority_overflow_slots=overflow, max_preemptions=0)
    instances = [engine_caps(slots=2, engine_priority=engine_priority)]
    async with edge_with_node(cfg, instances) as (core, node, _):
        await submit(core, "batch", "b0", "b1")
        got = taken(node)
        # Without engine priority the edge sends no priority at all.
        assert got["b0"].assign.spec.priority == (0 if engine_priority else None)
        await submit(core, "interactive", "i0")
        assert taken(node) == {}
        assert core.scheduler.queued == 1


def test_the_default_is_off_and_the_bounds_hold() -> None:
    assert edge({}).scheduler.priority_overflow_slots == 0
    for bad in (-1, 1025):
        with pytest.raises(ConfigError, match="priority_overflow_slots"):
            edge({"scheduler": {"priority_overflow_slots": bad}})
    cfg: EdgeConfig = edge({"scheduler": {"priority_overflow_slots": 1024}})
    assert cfg.scheduler.priority_overflow_slots == 1024
