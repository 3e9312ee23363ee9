"""Fair queueing (iop.edge.scheduler._scheduler, ``Scheduler.dispatch``): classes in order,
tenants by weighted fair share, on an edge core with a hand-played node and a
virtual clock."""

from __future__ import annotations

import hashlib

import pytest
import trio
import trio.testing

from iop.config import SchedulerSettings, TenantSettings
from iop.edge import EdgeCore
from iop.errors import IopError
from iop.events import Complete, Start
from iop.runtime import Run
from tests.edge.test_core import FakeNode, caps, config, drain_events, edge_with_node, spec


def tenant(name: str, **kw: object) -> TenantSettings:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return TenantSettings(name=name, key_sha256=[digest], **kw)  # type: ignore[arg-type]


def setup(*tenants: TenantSettings, max_queue: int = 64, max_queue_delay_s: float = 0.0) -> object:
    sched = SchedulerSettings(
        max_queue=max_queue, queue_timeout_s=600.0, max_queue_delay_s=max_queue_delay_s
    )
    return config(scheduler=sched, tenants=list(tenants))


def start(core: EdgeCore, who: str, run_id: str) -> Run:
    found = core.tenants.all[who]
    ticket = core.tenants.admit(found, 0, trio.current_time())
    return core.start_run(spec(run_id=run_id), ticket=ticket)


async def submit(core: EdgeCore, who: str, run_ids: list[str]) -> dict[str, Run]:
    runs = {}
    for rid in run_ids:  # one at a time: trio starts new tasks in any order
        runs[rid] = start(core, who, rid)
        await trio.testing.wait_all_tasks_blocked()
    return runs


async def served_order(node: FakeNode, runs: dict[str, Run], count: int) -> list[str]:
    """Finish the running run each time and record which queued run gets the slot."""
    order = []
    for _ in range(count):
        rid = (await node.assigns.receive()).assign.run_id
        order.append(rid)
        await node.send(rid, Start(), Complete())
        await drain_events(runs[rid])
    return order


async def test_a_flooding_tenant_takes_turns_with_one_that_comes_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"), tenant("b"))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", [f"a{i}" for i in range(9)])  # a0 runs, 8 wait
        runs |= await submit(core, "b", ["b0", "b1"])
        assert core.scheduler.queued == 10
        order = await served_order(node, runs, 11)
    # First come first served would give b0 the tenth slot; fair shares give it the third.
    assert order[:6] == ["a0", "a1", "b0", "a2", "b1", "a3"]
    assert sorted(order) == sorted(runs)


async def test_weights_share_the_slots_in_proportion(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("light", weight=1.0), tenant("heavy", weight=3.0))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "light", [f"l{i}" for i in range(9)])
        runs |= await submit(core, "heavy", [f"h{i}" for i in range(9)])
        order = await served_order(node, runs, 17)
    # l0 ran at once; of the next 12 slots, the heavy tenant gets three in four.
    window = order[1:13]
    assert sum(r.startswith("h") for r in window) == 9
    assert sum(r.startswith("l") for r in window) == 3


async def test_a_higher_class_is_served_first_whenever_it_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("batch", priority="low"), tenant("std"), tenant("vip", priority="high"))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "batch", ["b0", "b1", "b2"])
        runs |= await submit(core, "std", ["s0"])
        runs |= await submit(core, "vip", ["v0", "v1"])
        order = await served_order(node, runs, 6)
    assert order == ["b0", "v0", "v1", "s0", "b1", "b2"]


async def test_with_one_tenant_the_queue_is_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        ids = [f"a{i}" for i in range(6)]
        runs = await submit(core, "a", ids)
        assert await served_order(node, runs, 6) == ids


async def test_a_tenant_that_was_idle_comes_back_with_no_credit_saved(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"), tenant("b"))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", [f"a{i}" for i in range(7)])
        order = await served_order(node, runs, 4)  # a0..a3; b waited for nothing meanwhile
        runs |= await submit(core, "b", ["b0", "b1", "b2"])
        order += await served_order(node, runs, 6)
    # b does not get the four turns it "missed": it alternates with a from now on.
    assert order == ["a0", "a1", "a2", "a3", "a4", "b0", "a5", "b1", "a6", "b2"]


async def test_a_waiter_that_leaves_costs_its_tenant_no_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"), tenant("b"))
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", ["a0", "a1", "a2", "a3"])
        runs |= await submit(core, "b", ["b0"])
        runs["b0"].cancel(*_client_gone())
        await drain_events(runs.pop("b0"))
        runs |= await submit(core, "b", ["b1"])
        order = await served_order(node, runs, 5)
    assert order == ["a0", "a1", "b1", "a2", "a3"]


def _client_gone() -> tuple[object, str]:
    from iop.events import CancelReason

    return CancelReason.CLIENT_DISCONNECT, "client left"


async def test_a_full_queue_still_takes_a_tenant_holding_less_than_its_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"), tenant("b"), max_queue=4)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", ["a0", "a1", "a2", "a3", "a4"])  # a0 runs, 4 wait
        with pytest.raises(IopError) as err:
            start(core, "a", "a5")
        assert err.value.status == 429
        # b holds none of the queue: its part of 4 among two tenants is 2.
        runs |= await submit(core, "b", ["b0", "b1"])
        assert core.scheduler.queued == 6
        with pytest.raises(IopError):
            start(core, "b", "b2")
        order = await served_order(node, runs, 7)
    assert order[:3] == ["a0", "a1", "b0"]


async def test_another_tenants_long_line_does_not_refuse_a_newcomer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(tenant("a"), tenant("b"), max_queue_delay_s=5.0)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", [f"a{i}" for i in range(5)])
        await trio.sleep(30)  # a's line has not moved for 30 s
        with pytest.raises(IopError) as err:
            start(core, "a", "a-late")
        assert "would wait" in err.value.message
        runs |= await submit(core, "b", ["b0"])  # b's own line is empty
        order = await served_order(node, runs, 6)
    assert order[:3] == ["a0", "a1", "b0"]
