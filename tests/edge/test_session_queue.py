"""Sessions in the edge's queue (iop.edge.scheduler, ``Scheduler.dispatch``): a
tenant's sessions take turns, a session's key is its tenant's alone; on an edge
core with a hand-played node and a virtual clock."""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from iop.config import SchedulerSettings
from iop.edge import EdgeCore
from iop.edge.scheduler import affinity_key
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message, Routing
from tests.edge.test_core import caps, config, edge_with_node
from tests.edge.test_fair_queue import served_order, tenant


def setup(*names: str, **sched: object) -> object:
    settings = SchedulerSettings(
        max_queue=64,
        queue_timeout_s=600.0,
        max_queue_delay_s=0.0,
        **sched,  # type: ignore[arg-type]
    )
    return config(scheduler=settings, tenants=[tenant(n) for n in names])


def session_spec(run_id: str, session: str, content: str = "hi") -> ExecutionSpec:
    routing = Routing(session=session, session_from="x-iop-session-id") if session else None
    return ExecutionSpec(
        run_id=run_id,
        request=ChatRequest(
            model="m", messages=[Message(role="user", content=content)], routing=routing
        ),
    )


async def submit(core: EdgeCore, who: str, session: str, run_ids: list[str]) -> dict[str, Run]:
    runs = {}
    for rid in run_ids:  # one at a time: trio starts new tasks in any order
        ticket = core.tenants.admit(core.tenants.all[who], 0, trio.current_time())
        runs[rid] = core.start_run(session_spec(rid, session), ticket=ticket)
        await trio.testing.wait_all_tasks_blocked()
    return runs


async def test_a_burst_of_one_session_does_not_hold_back_another_of_its_tenant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup("a"), [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "s1", [f"s1-{i}" for i in range(9)])  # 1 runs, 8 wait
        runs |= await submit(core, "a", "s2", ["s2-0"])
        assert core.scheduler.sessions_queued == 2
        order = await served_order(node, runs, 10)
    # In arrival order s2-0 would be the tenth; the sessions take turns.
    assert order[:4] == ["s1-0", "s1-1", "s2-0", "s1-2"]
    assert core.scheduler.sessions_seen == 2


async def test_without_session_fairness_a_tenant_is_served_in_arrival_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup("a", session_fairness=False)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "s1", [f"s1-{i}" for i in range(9)])
        runs |= await submit(core, "a", "s2", ["s2-0"])
        order = await served_order(node, runs, 10)
    assert order[-1] == "s2-0"


async def test_sessions_take_turns_within_each_tenant_and_tenants_between_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup("a", "b"), [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "s1", [f"a1-{i}" for i in range(7)])
        runs |= await submit(core, "b", "s1", [f"b1-{i}" for i in range(6)])  # same id, b's own
        runs |= await submit(core, "a", "s2", ["a2-0"])
        runs |= await submit(core, "b", "s2", ["b2-0"])
        order = await served_order(node, runs, 15)
    # Tenants alternate; within each, s2's one run takes the tenant's next turn.
    assert order[:7] == ["a1-0", "a1-1", "b1-0", "a2-0", "b2-0", "a1-2", "b1-1"]


async def test_the_tracked_sessions_are_bounded_per_tenant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup("a", max_sessions_per_tenant=2)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "s1", ["s1-0", "s1-1", "s1-2"])
        runs |= await submit(core, "a", "s2", ["s2-0"])
        runs |= await submit(core, "a", "s3", ["s3-0"])  # no room: joins the unkeyed turn
        sched = core.scheduler
        assert (sched.sessions_seen, sched.sessions_overflowed, sched.sessions_queued) == (2, 1, 2)
        order = await served_order(node, runs, 5)
        assert sched.sessions_queued == 0
        # s1 and s2 are idle now: a new session takes the place of the oldest.
        runs |= await submit(core, "a", "s1", ["s1-3"])  # runs at once: not queued
        runs |= await submit(core, "a", "s4", ["s4-0"])
        assert (sched.sessions_seen, sched.sessions_overflowed) == (3, 1)
        order += await served_order(node, runs, 2)
    assert order[:4] == ["s1-0", "s1-1", "s2-0", "s3-0"]
    text = core.metrics.render().decode()
    assert "iop_queue_sessions_seen_total 3.0" in text
    assert "iop_queue_sessions_overflowed_total 1.0" in text
    assert "iop_queue_sessions 0.0" in text
    assert "s1" not in text.replace("sessions", "")  # a count, never a label per id


async def test_the_timeline_shows_the_session_and_where_it_came_from(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup("a"), [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "agent-7", ["r0"])
        await served_order(node, runs, 1)
    view = runs["r0"].timeline.to_json()
    assert (view["session"], view["session_from"]) == ("agent-7", "x-iop-session-id")
    assert runs["r0"].timeline.summary()["session"] == "agent-7"


async def test_the_node_never_sees_the_routing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup("a"), [caps(slots=1)]) as (core, node, _):  # type: ignore[arg-type]
        runs = await submit(core, "a", "agent-7", ["r0"])
        got = await node.assigns.receive()
        assert isinstance(got.assign.spec.request, ChatRequest)
        assert got.assign.spec.request.routing is None
        assert b"agent-7" not in msgspec.json.encode(got.assign.spec)
        runs["r0"].cancel(*_gone())


def _gone() -> tuple[object, str]:
    from iop.events import CancelReason

    return CancelReason.CLIENT_DISCONNECT, "client left"


def test_a_session_key_never_matches_across_tenants() -> None:
    request = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
    a = affinity_key(request, "", session="s1", tenant="a")
    b = affinity_key(request, "", session="s1", tenant="b")
    assert a is not None
    assert b is not None
    assert a != b
    # With their own cache salts too, and a tenant name that looks like a prefix.
    assert affinity_key(request, "salt", session="1:s", tenant="a") != affinity_key(
        request, "salt", session="s", tenant="a:1"
    )
    # The session, not the conversation's head, is the key: two turns of one
    # session with different heads land together.
    other = ChatRequest(model="m", messages=[Message(role="user", content="other")])
    assert affinity_key(other, "", session="s1", tenant="a") == a


async def test_the_same_session_id_in_two_tenants_shares_no_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Tenants that share their prefix caches (no salt) still keep session ids apart."""
    shared = [tenant(n, share_prefix_cache=True) for n in ("a", "b")]
    settings = SchedulerSettings(max_queue=64, queue_timeout_s=600.0)
    cfg = config(scheduler=settings, tenants=shared)
    i1 = msgspec.structs.replace(caps(slots=2), instance="i1")
    async with edge_with_node(cfg, [caps(slots=2), i1]) as (core, node, _):
        # a's session s1 lands on i1 (i0 holds another run then); both end.
        runs = await submit(core, "a", "x", ["x0"])
        runs |= await submit(core, "a", "s1", ["a0"])
        placed = {}
        for _ in range(2):
            got = (await node.assigns.receive()).assign
            placed[got.spec.run_id] = got.instance
        assert placed == {"x0": "i0", "a0": "i1"}
        for rid in ("x0", "a0"):
            await node.send(rid, *_done())
            await _drain(runs[rid])
        # Both idle: b's s1 is no session of a's (least loaded: the first, i0);
        # a's next turn of s1 goes back to i1.
        runs |= await submit(core, "b", "s1", ["b0"])
        assert (await node.assigns.receive()).assign.instance == "i0"
        runs |= await submit(core, "a", "s1", ["a1"])
        assert (await node.assigns.receive()).assign.instance == "i1"
        for rid in ("b0", "a1"):
            await node.send(rid, *_done())
            await _drain(runs[rid])


def _done() -> tuple[object, ...]:
    from iop.events import Complete, Start

    return Start(), Complete()


async def _drain(run: Run) -> None:
    from tests.edge.test_core import drain_events

    await drain_events(run)
