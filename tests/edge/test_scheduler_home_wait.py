"""A run whose prefix's home is briefly full waits for it (``[scheduler]
prefix_wait_s``; docs/operations.md, "What the caches hold") rather than
prefilling the whole prompt elsewhere: on an edge core with two nodes over
in-memory links, in virtual time."""

from __future__ import annotations

from typing import Final

import msgspec
import pytest
import trio
import trio.testing

from iop.config import EdgeConfig, SchedulerSettings
from iop.edge import EdgeCore, open_edge_core
from iop.events import Cancelled, CancelReason
from iop.runtime import Run
from iop.spec import ExecutionSpec
from tests.edge.test_core import FakeNode, caps, connect, drain_events
from tests.edge.test_prefix import SYSTEM, chat, prefix_config
from tests.edge.test_prefix_tenants import start as start_tenant
from tests.edge.test_prefix_tenants import two_tenants

WAIT_S: Final = 0.5
POET: Final = "You are a poet. " * 80


def home_config(**sched: object) -> EdgeConfig:
    return prefix_config(**{"prefix_wait_s": WAIT_S, **sched})  # type: ignore[return-value]


async def start(core: EdgeCore, system: str, run_id: str) -> Run:
    run = core.start_run(ExecutionSpec(run_id=run_id, request=chat(system, run_id)))
    await trio.testing.wait_all_tasks_blocked()
    return run


def placed(nodes: dict[str, FakeNode], run_id: str) -> str | None:
    return next((n for n, f in nodes.items() if run_id in f.assigned), None)


async def fill_home(core: EdgeCore, nodes: dict[str, FakeNode]) -> tuple[str, list[Run]]:
    """The poet's run on one node, then the support prompt's 4 on the
    other, its home, which is full then."""
    runs = [await start(core, POET, "o0")]
    runs += [await start(core, SYSTEM, f"s{i}") for i in range(4)]
    home = placed(nodes, "s0")
    assert home is not None
    assert home != placed(nodes, "o0")
    assert {placed(nodes, f"s{i}") for i in range(4)} == {home}
    return home, runs


async def end(runs: list[Run]) -> None:
    for run in runs:
        run.cancel(CancelReason.CLIENT_DISCONNECT)
        await drain_events(run)


async def test_a_run_whose_home_is_full_waits_for_its_next_slot_not_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(home_config()) as core, trio.open_nursery() as nursery:
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
        home, runs = await fill_home(core, nodes)
        held = await start(core, SYSTEM, "s4")
        # The other node has 3 free slots; the run waits for its home.
        assert placed(nodes, "s4") is None
        assert core.scheduler.queued == 1  # counted as a queued run
        assert held.timeline.why_queued is not None
        assert "home" in held.timeline.why_queued
        runs[1].cancel(CancelReason.CLIENT_DISCONNECT)  # s0 ends: a slot frees at home
        await drain_events(runs[1])
        await trio.testing.wait_all_tasks_blocked()
        assert placed(nodes, "s4") == home
        assert held.timeline.home_wait_ms is not None
        assert core.scheduler.home_waits == {"home": 1, "expired": 0, "left": 0}
        assert "iop_prefix_home_waits_total" in core.metrics.render().decode()
        await end([held, runs[0], *runs[2:]])
        nursery.cancel_scope.cancel()


async def test_a_run_waits_no_longer_than_prefix_wait_s_then_goes_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(home_config()) as core, trio.open_nursery() as nursery:
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
        home, runs = await fill_home(core, nodes)
        held = await start(core, SYSTEM, "s4")
        await trio.sleep(WAIT_S * 0.9)
        assert placed(nodes, "s4") is None
        await trio.sleep(WAIT_S * 0.2)
        assert placed(nodes, "s4") not in (None, home)
        timeline = held.timeline
        assert timeline.queued is not None
        assert timeline.dequeued is not None
        # Virtual time: exactly the bound, not a tick more.
        assert timeline.dequeued - timeline.queued == pytest.approx(WAIT_S)
        assert timeline.home_wait_ms == pytest.approx(WAIT_S * 1000)
        assert core.scheduler.home_waits == {"home": 0, "expired": 1, "left": 0}
        assert core.scheduler.queued == 0
        await end([held, *runs])
        nursery.cancel_scope.cancel()


async def test_with_prefix_wait_s_0_a_full_home_sends_the_run_elsewhere_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_edge_core(home_config(prefix_wait_s=0.0)) as core,  # type: ignore[arg-type]
        trio.open_nursery() as nursery,
    ):
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
        home, runs = await fill_home(core, nodes)
        other = await start(core, SYSTEM, "s4")
        assert placed(nodes, "s4") not in (None, home)
        await end([other, *runs])
        nursery.cancel_scope.cancel()


async def test_a_home_with_a_free_slot_takes_the_run_the_balance_rule_would_send_away(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The balance rule would send the fourth run of one prompt to the idle
    instance (3 of 8 slots busy against 0, as in
    tests/edge/test_prefix.py::test_too_much_load_on_the_warm_instance_turns_placement_to_least_loaded);
    with a cached prompt worth waiting for, the home's free slot takes it
    at once, not queued."""
    cfg = home_config(balance_load_threshold=0.25, balance_rel_threshold=1.5, load_weight=0.0)
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        nodes = {n: await connect(core, nursery, [caps(slots=8)], n) for n in "ab"}
        runs = [await start(core, SYSTEM, f"s{i}") for i in range(4)]
        home = placed(nodes, "s0")
        assert [placed(nodes, f"s{i}") for i in range(4)] == [home] * 4
        timeline = runs[3].timeline
        assert timeline.queued is None
        assert timeline.placements[0].why.endswith(
            "the balance rule aside (scheduler.prefix_wait_s)"
        )
        await end(runs)
        nursery.cancel_scope.cancel()


async def test_a_held_run_does_not_hold_back_another_tenants_run_that_can_be_placed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    base = home_config()
    cfg = msgspec.structs.replace(base, tenants=two_tenants())
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
        alice = [start_tenant(core, "alice", f"a{i}") for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        home = placed(nodes, "a0")
        assert {placed(nodes, f"a{i}") for i in range(4)} == {home}
        held = start_tenant(core, "alice", "a4")
        await trio.testing.wait_all_tasks_blocked()
        assert placed(nodes, "a4") is None
        # Bob's runs take the free slots of the other node at once, while
        # Alice's run waits for hers.
        bob = [start_tenant(core, "bob", f"b{i}") for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        assert [placed(nodes, f"b{i}") for i in range(3)] != [None] * 3
        assert None not in [placed(nodes, f"b{i}") for i in range(3)]
        assert placed(nodes, "a4") is None
        alice[0].cancel(CancelReason.CLIENT_DISCONNECT)
        await drain_events(alice[0])
        await trio.testing.wait_all_tasks_blocked()
        assert placed(nodes, "a4") == home
        await end([held, *alice[1:], *bob])
        nursery.cancel_scope.cancel()


async def test_a_cancelled_held_run_leaves_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(home_config()) as core, trio.open_nursery() as nursery:
        nodes = {n: await connect(core, nursery, [caps(slots=4)], n) for n in "ab"}
        _, runs = await fill_home(core, nodes)
        held = await start(core, SYSTEM, "s4")
        assert core.scheduler.queued == 1
        before = trio.current_time()
        held.cancel(CancelReason.CLIENT_DISCONNECT)
        events = await drain_events(held)
        assert trio.current_time() == before  # no tick of virtual time
        terminals = [e for e in events if isinstance(e, Cancelled)]
        assert len(terminals) == 1
        assert terminals[0].reason is CancelReason.CLIENT_DISCONNECT
        assert core.scheduler.queued == 0
        assert core.scheduler.home_waits == {"home": 0, "expired": 0, "left": 1}
        # A slot freeing at home later hands nothing to it.
        runs[1].cancel(CancelReason.CLIENT_DISCONNECT)
        await drain_events(runs[1])
        await trio.testing.wait_all_tasks_blocked()
        assert placed(nodes, "s4") is None
        await end([runs[0], *runs[2:]])
        nursery.cancel_scope.cancel()


def test_prefix_wait_settings_refuse_nonsense() -> None:
    for s in (-0.1, 10.5):
        with pytest.raises(ValueError, match="prefix_wait_s"):
            SchedulerSettings(prefix_wait_s=s)
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="prefix_wait_share"):
            SchedulerSettings(prefix_wait_share=share)
    SchedulerSettings(prefix_wait_s=0.0)
    SchedulerSettings(prefix_wait_s=10.0, prefix_wait_share=1.0)
