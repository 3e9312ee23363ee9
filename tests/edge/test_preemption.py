"""Slots for runs that may not wait (iop.edge.scheduler, docs/operations.md, "Sessions and
objectives"): a share of each instance's slots that sheddable runs may not take
(``reserved_slot_fraction``), and the preemption of a sheddable run that has sent no
output yet when a run of a higher objective priority finds no slot (``max_preemptions``):
its attempt is cancelled on the node and the run is placed again, which its client never
sees. On an edge core with a hand-played node and a virtual clock; the config's bounds at
the end.
"""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
import trio.testing

from iop.config import EdgeConfig, Objective, SchedulerSettings, decode_config
from iop.edge import EdgeCore
from iop.errors import ConfigError
from iop.events import Cancelled, CancelReason, Complete, Delta, Start
from iop.protocol import AssignReceived
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message, Routing
from tests.edge.test_core import FakeNode, caps, config, drain_events, edge_with_node
from tests.edge.test_fair_queue import tenant

OBJECTIVES = [
    Objective(name="interactive", priority=10),
    Objective(name="batch", priority=0, sheddable=True),
    Objective(name="bulk", priority=-5, sheddable=True),
]
NAMES = [o.name for o in OBJECTIVES]


def setup(**sched: object) -> EdgeConfig:
    settings = SchedulerSettings(
        max_queue=64,
        queue_timeout_s=600.0,
        max_queue_delay_s=0.0,
        **sched,  # type: ignore[arg-type]
    )
    return config(
        scheduler=settings,
        tenants=[
            tenant("a", objectives=NAMES),
            tenant("b", objectives=NAMES),
            tenant("vip", objectives=NAMES, priority="high"),
        ],
        objectives=OBJECTIVES,
    )


def start(core: EdgeCore, run_id: str, objective: str = "", who: str = "a") -> Run:
    routing = Routing(objective=objective)
    request = ChatRequest(model="m", messages=[Message(role="user", content="hi")], routing=routing)
    ticket = core.tenants.admit(core.tenants.all[who], 0, trio.current_time())
    return core.start_run(ExecutionSpec(run_id=run_id, request=request), ticket=ticket)


async def submit(core: EdgeCore, objective: str, *run_ids: str, who: str = "a") -> dict[str, Run]:
    runs = {}
    for rid in run_ids:
        runs[rid] = start(core, rid, objective, who)
        await trio.testing.wait_all_tasks_blocked()
    return runs


def assigned(node: FakeNode) -> list[str]:
    """The Assigns the node has received and not yet taken, in order."""
    out = []
    while True:
        try:
            out.append(node.assigns.receive_nowait().assign.run_id)
        except trio.WouldBlock:
            return out


async def next_assign(node: FakeNode) -> AssignReceived:
    with trio.fail_after(60):
        return await node.assigns.receive()


# --- the reserve ---------------------------------------------------------------------


async def test_sheddable_runs_leave_the_reserved_slots_to_runs_that_may_not_be_shed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(reserved_slot_fraction=0.5, max_preemptions=0)
    async with edge_with_node(cfg, [caps(slots=4)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1", "b2", "b3")
        assert assigned(node) == ["b0", "b1"]  # two of four: the other two are reserved
        assert core.scheduler.queued == 2
        # A run that may not be shed takes a reserved slot at once, though
        # sheddable runs were queued before it; so does one of no objective.
        runs |= await submit(core, "interactive", "i0")
        runs |= await submit(core, "", "n0")
        assert assigned(node) == ["i0", "n0"]
        assert core.scheduler.queued == 2
        # A reserved slot that frees is not a batch run's either.
        await node.send("i0", Start(), Complete())
        assert await drain_events(runs.pop("i0")) == [Start(), Complete()]
        await trio.testing.wait_all_tasks_blocked()
        assert assigned(node) == []
        # One of the batch runs' own two frees: the next batch run takes it.
        await node.send("b0", Start(), Complete())
        await drain_events(runs.pop("b0"))
        await trio.testing.wait_all_tasks_blocked()
        assert assigned(node) == ["b2"]


async def test_without_a_reserve_a_sheddable_flood_takes_every_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=0), [caps(slots=4)]) as (core, node, _):
        await submit(core, "batch", "b0", "b1", "b2", "b3", "b4")
        assert assigned(node) == ["b0", "b1", "b2", "b3"]
        await submit(core, "interactive", "i0")
        assert assigned(node) == []
        assert core.scheduler.queued == 2


async def test_a_sheddable_run_is_not_admitted_to_a_reserved_slot_by_the_fast_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The queue is empty and a slot is free, but it is the reserve's: the
    sheddable run waits (and the admission check sees that it would)."""
    cfg = setup(reserved_slot_fraction=0.25, max_preemptions=0)
    async with edge_with_node(cfg, [caps(slots=4)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1", "b2", "b3")
        assert assigned(node) == ["b0", "b1", "b2"]
        assert runs["b3"].timeline.queued is not None
        assert "reserved" in (runs["b3"].timeline.why_queued or "")


# --- preemption ----------------------------------------------------------------------


async def test_a_sheddable_run_that_sent_nothing_yields_its_slot_and_runs_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        assert (await next_assign(node)).assign.run_id == "b0"
        await node.send("b0", Start())  # its opening, no output yet
        runs |= await submit(core, "interactive", "i0")
        # The batch run's attempt is cancelled on the node, and the slot is
        # the interactive run's.
        assert [(c.cancel.run_id, c.cancel.reason) for c in node.cancels] == [
            ("b0", CancelReason.EXPLICIT)
        ]
        assert (await next_assign(node)).assign.run_id == "i0"
        await node.send("b0", Cancelled(reason=CancelReason.EXPLICIT, message="cancelled"))
        await node.send("i0", Start(), Delta("now"), Complete())
        assert await drain_events(runs["i0"]) == [Start(), Delta("now"), Complete()]
        # Then the batch run runs again, on a link id of its own (the node
        # may still be ending the first attempt), and its client sees one
        # answer: one Start, the output, one terminal.
        again = (await next_assign(node)).assign.run_id
        assert again != "b0"
        assert again.startswith("b0")
        await node.send(again, Start(), Delta("later"), Complete())
        assert await drain_events(runs["b0"]) == [Start(), Delta("later"), Complete()]
        timeline = runs["b0"].timeline
        assert [p.result for p in timeline.placements] == ["preempted", "ran"]
        assert timeline.outcome == "complete:stop"
        assert core.scheduler.preempted == 1
        assert core.snapshot()["outcomes"] == {"complete": 2}
        assert core.snapshot()["queue"]["preempted"] == 1


async def test_a_run_that_sent_output_is_never_preempted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        await next_assign(node)
        await node.send("b0", Start(), Delta("a"))
        assert await runs["b0"].events.receive() == Start()
        runs |= await submit(core, "interactive", "i0")
        assert node.cancels == []
        assert assigned(node) == []
        await node.send("b0", Complete())
        assert await drain_events(runs["b0"]) == [Delta("a"), Complete()]
        assert (await next_assign(node)).assign.run_id == "i0"
        assert core.scheduler.preempted == 0


async def test_a_run_is_preempted_at_most_max_preemptions_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        await next_assign(node)
        runs |= await submit(core, "interactive", "i0")
        assert (await next_assign(node)).assign.run_id == "i0"
        await node.send("b0", Cancelled(reason=CancelReason.EXPLICIT, message="cancelled"))
        await node.send("i0", Start(), Complete())
        await drain_events(runs["i0"])
        again = (await next_assign(node)).assign.run_id
        # Preempted once already: the next interactive run waits for it.
        runs |= await submit(core, "interactive", "i1")
        assert len(node.cancels) == 1
        assert assigned(node) == []
        await node.send(again, Start(), Delta("x"), Complete())
        assert await drain_events(runs["b0"]) == [Start(), Delta("x"), Complete()]
        assert (await next_assign(node)).assign.run_id == "i1"
        assert core.scheduler.preempted == 1


async def test_max_preemptions_zero_never_preempts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=0), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        await next_assign(node)
        runs |= await submit(core, "interactive", "i0")
        assert node.cancels == []
        await node.send("b0", Start(), Complete())
        await drain_events(runs["b0"])
        assert (await next_assign(node)).assign.run_id == "i0"


@pytest.mark.parametrize(
    ("victim", "newcomer", "who"),
    [
        ("batch", "", "a"),  # no objective: priority 0, the batch run's own
        ("batch", "batch", "b"),  # another tenant's run of the same objective
        ("batch", "batch", "vip"),  # a tenant of a higher class: its class never preempts
        ("", "interactive", "a"),  # a run that may not be shed is never a victim
    ],
)
async def test_only_a_higher_objective_priority_preempts_and_only_a_sheddable_run(
    autojump_clock: trio.testing.MockClock, victim: str, newcomer: str, who: str
) -> None:
    async with edge_with_node(setup(max_preemptions=3), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, victim, "v0")
        await next_assign(node)
        runs |= await submit(core, newcomer, "n0", who=who)
        assert node.cancels == []
        await node.send("v0", Start(), Complete())
        await drain_events(runs["v0"])
        assert (await next_assign(node)).assign.run_id == "n0"
        assert core.scheduler.preempted == 0


async def test_the_lowest_priority_newest_run_is_the_one_preempted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=3)]) as (core, node, _):
        runs = await submit(core, "bulk", "k0")
        runs |= await submit(core, "batch", "b0", "b1")
        assert assigned(node) == ["k0", "b0", "b1"]
        runs |= await submit(core, "interactive", "i0")
        # bulk (-5) goes before batch (0), though the batch runs are newer.
        assert [c.cancel.run_id for c in node.cancels] == ["k0"]
        assert (await next_assign(node)).assign.run_id == "i0"
        runs |= await submit(core, "interactive", "i1")
        # Among the batch runs, the newest (least work lost).
        assert [c.cancel.run_id for c in node.cancels] == ["k0", "b1"]
        assert (await next_assign(node)).assign.run_id == "i1"
        assert core.scheduler.preempted == 2


async def test_one_preemption_per_run_that_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two interactive runs find four busy batch slots: two batch runs are
    preempted, not four."""
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=4)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1", "b2", "b3")
        assert assigned(node) == ["b0", "b1", "b2", "b3"]
        runs["i0"] = start(core, "i0", "interactive")
        runs["i1"] = start(core, "i1", "interactive")
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(c.cancel.run_id for c in node.cancels) == ["b2", "b3"]
        assert sorted(assigned(node)) == ["i0", "i1"]
        assert core.scheduler.queued == 2  # b2 and b3, to run again


async def test_a_preempted_run_its_client_leaves_while_it_waits_ends_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        await next_assign(node)
        runs |= await submit(core, "interactive", "i0")
        await next_assign(node)
        assert core.scheduler.queued == 1  # b0, to run again
        runs["b0"].cancel(CancelReason.CLIENT_DISCONNECT, "client went away")
        outcome = await runs["b0"].wait()
        assert isinstance(outcome, Cancelled)
        assert outcome.reason is CancelReason.CLIENT_DISCONNECT
        assert core.scheduler.queued == 0
        events = await drain_events(runs["b0"])
        assert sum(isinstance(ev, Cancelled | Complete) for ev in events) == 1
        await node.send("i0", Start(), Complete())
        assert await drain_events(runs["i0"]) == [Start(), Complete()]


async def test_a_run_its_client_leaves_as_it_is_preempted_ends_once_and_is_not_placed_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The client leaves right after the scheduler preempts its run (at the
    first checkpoint after): the run ends cancelled, once, and does not
    queue again."""
    async with edge_with_node(setup(max_preemptions=1), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0")
        await next_assign(node)
        runs["i0"] = start(core, "i0", "interactive")
        for _ in range(1000):  # checkpoints, until the interactive run's task preempts
            if core.scheduler.preempted:
                break
            await trio.lowlevel.checkpoint()
        assert core.scheduler.preempted == 1
        runs["b0"].cancel(CancelReason.CLIENT_DISCONNECT, "client went away")
        outcome = await runs["b0"].wait()
        assert isinstance(outcome, Cancelled)
        assert outcome.reason is CancelReason.CLIENT_DISCONNECT
        events = await drain_events(runs["b0"])
        assert sum(isinstance(ev, Cancelled | Complete) for ev in events) == 1
        assert (await next_assign(node)).assign.run_id == "i0"
        await trio.testing.wait_all_tasks_blocked()
        assert core.scheduler.queued == 0
        assert assigned(node) == []
        await node.send("i0", Start(), Complete())
        assert await drain_events(runs["i0"]) == [Start(), Complete()]


async def test_a_preempted_run_is_not_refused_nor_shed_when_it_queues_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Past ``shed_queue_fraction`` a new sheddable run is refused; one that
    was preempted has its client's answer to give: it queues again all the same,
    and a full queue sheds a newer batch run rather than it."""
    cfg = setup(max_preemptions=1, shed_queue_fraction=0.5)
    cfg = config(
        scheduler=SchedulerSettings(
            max_queue=2,
            queue_timeout_s=600.0,
            max_queue_delay_s=0.0,
            max_preemptions=1,
            shed_queue_fraction=0.5,
        ),
        tenants=cfg.tenants,
        objectives=OBJECTIVES,
    )
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, "batch", "b0", "b1")  # b0 runs, b1 waits: the shed line
        await next_assign(node)
        runs |= await submit(core, "interactive", "i0")
        assert (await next_assign(node)).assign.run_id == "i0"
        assert core.scheduler.queued == 2  # b1, and b0 again
        assert core.scheduler.refused["shed"] == 0
        await node.send("b0", Cancelled(reason=CancelReason.EXPLICIT, message="cancelled"))
        runs |= await submit(core, "interactive", "i1")  # a full queue: b1 is shed, not b0
        events = await drain_events(runs.pop("b1"))
        assert events[-1].status == 429  # type: ignore[union-attr]
        await node.send("i0", Start(), Complete())
        await drain_events(runs.pop("i0"))
        # The preempted run is first of its level again; then i1 (higher).
        assert (await next_assign(node)).assign.run_id == "i1"
        await node.send("i1", Start(), Complete())
        await drain_events(runs.pop("i1"))
        again = (await next_assign(node)).assign.run_id
        await node.send(again, Start(), Delta("x"), Complete())
        assert await drain_events(runs["b0"]) == [Start(), Delta("x"), Complete()]


# --- the config ----------------------------------------------------------------------


def edge(data: dict[str, object]) -> EdgeConfig:
    return decode_config(data, EdgeConfig, source="edge.toml")


def test_the_defaults_reserve_nothing_and_preempt_once() -> None:
    s = edge({}).scheduler
    assert s.reserved_slot_fraction == 0.0
    assert s.max_preemptions == 1


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"scheduler": {"reserved_slot_fraction": 1.0}}, "reserved_slot_fraction"),
        ({"scheduler": {"reserved_slot_fraction": -0.1}}, "reserved_slot_fraction"),
        ({"scheduler": {"max_preemptions": -1}}, "max_preemptions"),
        ({"scheduler": {"max_preemptions": 101}}, "max_preemptions"),
    ],
)
def test_the_config_refuses_a_reserve_or_preemptions_out_of_bounds(
    data: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        edge(data)


def test_the_bounds_themselves_are_accepted() -> None:
    s = edge({"scheduler": {"reserved_slot_fraction": 0.99, "max_preemptions": 100}}).scheduler
    assert (s.reserved_slot_fraction, s.max_preemptions) == (0.99, 100)
