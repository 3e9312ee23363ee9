"""Placement with nodes' load reports: the scheduler over hand-made
registrations, in virtual time. A report orders candidates and never holds a
run back: stale, missing or absurd, placement goes on."""

from __future__ import annotations

import math

import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities, ProviderStatus
from iop.config import SchedulerSettings
from iop.edge.runs import LOAD_FIGURE_CAP, InstanceState, NodeConnection, NodeRegistry
from iop.edge.scheduler import Scheduler
from iop.protocol import EdgeSession, EngineLoad, InstanceLoad

SLOTS = 4


def caps(name: str = "i0") -> Capabilities:
    return Capabilities(
        adapter="sim",
        instance=name,
        targets=("m",),
        max_concurrency=SLOTS,
        provider_status=ProviderStatus.AVAILABLE,
    )


def cluster(*node_ids: str, **settings: object) -> tuple[Scheduler, dict[str, NodeConnection]]:
    registry = NodeRegistry()
    conns = {}
    for node_id in node_ids:
        session = EdgeSession(
            tokens=["t"], heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0, now=0.0
        )
        conn = NodeConnection(
            node_id, session, {"i0": InstanceState(node_id, caps())}, connected_at=0.0
        )
        registry.add(conn)
        conns[node_id] = conn
    return Scheduler(registry, SchedulerSettings(affinity=False, **settings)), conns  # type: ignore[arg-type]


def load(
    in_flight: int = 0,
    queued: int = 0,
    engine: EngineLoad | None = None,
) -> list[InstanceLoad]:
    return [
        InstanceLoad(
            instance="i0",
            in_flight=in_flight,
            queued=queued,
            max_concurrency=SLOTS,
            max_queue=8,
            engine=engine,
        )
    ]


async def place(scheduler: Scheduler) -> str:
    """Where the next run goes; it must go at once (never queued)."""
    with trio.fail_after(0.001):  # virtual time: only a wait would take any
        lease = await scheduler.acquire("m")
    lease.release()
    return lease.conn.node_id


async def test_a_fresh_report_steers_placement_away_from_a_busy_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b")
    assert await place(scheduler) == "a"  # the registry's order breaks ties
    conns["a"].on_load(load(in_flight=SLOTS, queued=3), trio.current_time())
    assert await place(scheduler) == "b"


async def test_the_engines_waiting_requests_count_on_top(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b")
    now = trio.current_time()
    conns["a"].on_load(load(in_flight=1, engine=EngineLoad(waiting=5.0)), now)
    conns["b"].on_load(load(in_flight=2), now)
    assert scheduler.occupancy(conns["a"].instances["i0"], now) == 6.0
    assert await place(scheduler) == "b"


async def test_a_stale_report_is_ignored_never_read_as_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b", load_stale_s=5.0)
    conns["a"].on_load(load(in_flight=SLOTS, queued=8), trio.current_time())
    conns["b"].on_load(load(in_flight=1), trio.current_time())
    assert await place(scheduler) == "b"
    await trio.sleep(6.0)
    # Both reports are stale now: the edge's own counts (both idle) decide.
    assert scheduler.stale_instances() == 2
    inst = conns["a"].instances["i0"]
    assert scheduler.occupancy(inst, trio.current_time()) == 0.0
    assert await place(scheduler) == "a"


async def test_reports_of_full_everywhere_never_block_placement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The node's own admission is the authority: the run goes, and a node
    # that really is full refuses it (and it fails over).
    scheduler, conns = cluster("a", "b")
    for conn in conns.values():
        conn.on_load(load(in_flight=SLOTS, queued=8), trio.current_time())
    for _ in range(SLOTS):
        with trio.fail_after(0.001):
            await scheduler.acquire("m")
    assert scheduler.queued == 0


async def test_stale_engine_figures_alone_are_ignored_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b", load_stale_s=5.0)
    now = trio.current_time()
    old = EngineLoad(running=4.0, waiting=50.0, kv_usage=1.0, age_s=60.0)
    conns["a"].on_load(load(engine=old), now)
    inst = conns["a"].instances["i0"]
    assert scheduler.is_stale(inst, now)
    assert scheduler.occupancy(inst, now) == 0.0
    assert scheduler.kv_usage(inst, now) == 0.0
    assert await place(scheduler) == "a"


async def test_missing_engine_figures_cannot_block_placement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b")
    now = trio.current_time()
    conns["a"].on_load(load(engine=EngineLoad()), now)  # the engine said nothing
    conns["b"].on_load(load(in_flight=1, engine=None), now)
    inst = conns["a"].instances["i0"]
    assert not scheduler.is_stale(inst, now)
    assert scheduler.occupancy(inst, now) == 0.0
    assert await place(scheduler) == "a"


@pytest.mark.parametrize(
    "report",
    [
        load(in_flight=-5, queued=-(2**63)),
        load(in_flight=2**63 - 1, queued=2**63 - 1),
        load(engine=EngineLoad(running=math.nan, waiting=math.nan, kv_usage=math.nan)),
        load(engine=EngineLoad(running=-1.0, waiting=math.inf, kv_usage=-math.inf)),
        load(engine=EngineLoad(waiting=1e308, kv_usage=1e308, age_s=math.nan)),
        load(engine=EngineLoad(waiting=3.0, age_s=-1e9)),
        load(engine=EngineLoad(waiting=3.0, age_s=math.inf)),
    ],
)
async def test_absurd_reports_are_clamped_and_cannot_starve_the_edge(
    autojump_clock: trio.testing.MockClock, report: list[InstanceLoad]
) -> None:
    scheduler, conns = cluster("a", "b", placement="prefix")
    now = trio.current_time()
    conns["a"].on_load(report, now)
    inst = conns["a"].instances["i0"]
    occupancy = scheduler.occupancy(inst, now)
    assert math.isfinite(occupancy)
    assert 0 <= occupancy <= 2 * LOAD_FIGURE_CAP
    assert 0.0 <= scheduler.kv_usage(inst, now) <= 1.0
    # Every slot of both nodes is still handed out at once.
    for _ in range(2 * SLOTS):
        with trio.fail_after(0.001):
            await scheduler.acquire("m")
    assert scheduler.queued == 0


async def test_an_instance_the_node_never_advertised_is_ignored(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _scheduler, conns = cluster("a")
    ghost = InstanceLoad(instance="ghost", in_flight=1, queued=0, max_concurrency=1, max_queue=0)
    conns["a"].on_load([ghost], trio.current_time())
    assert set(conns["a"].instances) == {"i0"}
    assert conns["a"].instances["i0"].reported is None


async def test_kv_usage_costs_prefix_placement_its_weight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler, conns = cluster("a", "b", placement="prefix", kv_weight=0.5)
    now = trio.current_time()
    conns["a"].on_load(load(engine=EngineLoad(kv_usage=0.9)), now)
    conns["b"].on_load(load(engine=EngineLoad(kv_usage=0.1)), now)
    with trio.fail_after(0.001):
        lease = await scheduler.acquire("m", prefix=[b"block"])
    assert lease.conn.node_id == "b"
    assert lease.scores == {"a/i0": -0.45, "b/i0": -0.05}


async def test_a_capabilities_update_keeps_the_report(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, conns = cluster("a")
    conns["a"].on_load(load(in_flight=3), trio.current_time())
    conns["a"].update_instances([caps()])
    rep = conns["a"].instances["i0"].reported
    assert rep is not None
    assert rep.in_flight == 3


async def test_a_run_that_ends_after_a_capabilities_update_frees_its_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The node pushes new capabilities while runs hold slots (its backend died
    under them): their slots, released after, must free the instance the
    scheduler places on now, or it stays full forever."""
    scheduler, conns = cluster("a")
    with trio.fail_after(0.001):
        leases = [await scheduler.acquire("m") for _ in range(SLOTS)]
    down = msgspec.structs.replace(caps(), provider_status=ProviderStatus.UNAVAILABLE)
    conns["a"].update_instances([down])
    for lease in leases:
        lease.release()
    conns["a"].update_instances([caps()])

    assert conns["a"].instances["i0"].in_flight == 0
    assert await place(scheduler) == "a"
