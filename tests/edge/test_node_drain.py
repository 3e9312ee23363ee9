"""An operator's drain of a node (``EdgeCore.drain_node`` / ``undrain_node``),
over in-memory links in virtual time: a drained node takes no new runs, its
runs go on, queued runs wait for another node or the undrain, the drain
outlives the node's reconnects, and every run's placement names the
candidates it was chosen from."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop.edge import open_edge_core
from iop.edge.runs import known_node
from iop.errors import ErrorCode, RequestError
from iop.events import CancelReason, Complete, Delta, Start
from tests.edge.test_core import FakeNode, caps, config, connect, drain_events, spec


def node_of(run_id: str, *nodes: FakeNode) -> FakeNode:
    (found,) = [n for n in nodes if run_id in n.assigned]
    return found


async def test_a_drained_node_finishes_its_runs_and_gets_no_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=2)], "a")
        b = await connect(core, nursery, [caps(slots=2)], "b")
        first = core.start_run(spec(run_id="r0"))
        await trio.testing.wait_all_tasks_blocked()
        busy = node_of("r0", a, b)
        other = b if busy is a else a
        await busy.assigns.receive()
        await busy.send("r0", Start(), Delta("x"))

        assert core.drain_node(busy.session.node_id, reason="kernel upgrade", by="test")
        assert not core.drain_node(busy.session.node_id, reason="again")  # idempotent
        assert core.registry.drained[busy.session.node_id].reason == "kernel upgrade"
        assert [m.nodes for m in core.models()] == [(other.session.node_id,)]

        later = [core.start_run(spec(run_id=f"r{i}")) for i in (1, 2)]
        await trio.testing.wait_all_tasks_blocked()
        assert busy.assigned == ["r0"]
        assert sorted(other.assigned) == ["r1", "r2"]
        placement = later[0].timeline.placements[0]
        assert placement.node == other.session.node_id
        assert set(placement.loads()) == {f"{other.session.node_id}/i0"}

        # The run in flight on the drained node ends as it would have.
        await busy.send("r0", Delta("y"), Complete())
        assert await drain_events(first) == [Start(), Delta("x"), Delta("y"), Complete()]
        for r in later:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
        nursery.cancel_scope.cancel()


async def test_queued_runs_wait_for_the_undrain_when_no_other_node_serves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        runs = {r: core.start_run(spec(run_id=r)) for r in ("r0", "r1")}
        await trio.testing.wait_all_tasks_blocked()
        assert core.scheduler.queued == 1
        core.drain_node("a", by="test")
        # (Which of the two runs' tasks asked first is trio's choice.)
        placed = (await a.assigns.receive()).assign.run_id
        waiting = "r1" if placed == "r0" else "r0"
        await a.send(placed, Start(), Complete())
        await drain_events(runs[placed])
        await trio.testing.wait_all_tasks_blocked()
        # The slot is free, but the node is drained: the run stays queued.
        assert a.assigned == [placed]
        assert core.scheduler.queued == 1

        # A new run is refused at once, saying why (not queued until its timeout).
        with pytest.raises(RequestError) as info:
            core.start_run(spec(run_id="r2"))
        assert info.value.status == 503
        assert info.value.code == ErrorCode.MODEL_UNAVAILABLE
        assert "node a is drained by an operator" in info.value.message

        assert core.undrain_node("a", by="test")
        assert not core.undrain_node("a")  # idempotent
        await trio.testing.wait_all_tasks_blocked()
        assert a.assigned == [placed, waiting]
        await a.send(waiting, Start(), Complete())
        assert (await drain_events(runs[waiting]))[-1] == Complete()
        nursery.cancel_scope.cancel()


async def test_the_drain_outlives_the_nodes_reconnect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        old = await connect(core, nursery, [caps()], "gpu-3")
        await connect(core, nursery, [caps()], "gpu-4")
        core.drain_node("gpu-3", reason="disk", by="test")
        await old.chan.aclose()  # it restarts...
        await trio.testing.wait_all_tasks_blocked()
        assert "gpu-3" not in core.registry.nodes
        # ...gone, it is still known: drained, and it may be undrained or shown.
        assert known_node(core.registry, "gpu-3")
        assert core.drain_view("gpu-3")["connected"] is False
        assert core.snapshot()["drained"] == {
            "gpu-3": {
                "reason": "disk",
                "by": "test",
                "since_unix": pytest.approx(core.registry.drained["gpu-3"].since_unix),
            }
        }
        new = await connect(core, nursery, [caps()], "gpu-3")
        runs = [core.start_run(spec(run_id=f"r{i}")) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        assert new.assigned == []
        [node] = [n for n in core.snapshot()["nodes"] if n["id"] == "gpu-3"]  # type: ignore[attr-defined]
        assert node["drained"]["reason"] == "disk"
        assert node["draining"] is False  # the node's own goodbye is another thing
        core.undrain_node("gpu-3")
        third = core.start_run(spec(run_id="r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert new.assigned == ["r2"]
        for r in [*runs, third]:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
        nursery.cancel_scope.cancel()


async def test_an_unknown_node_cannot_be_drained(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        await connect(core, nursery, [caps()], "a")
        with pytest.raises(KeyError):
            core.drain_node("nope")
        with pytest.raises(KeyError):
            core.undrain_node("nope")
        assert core.registry.drained == {}
        nursery.cancel_scope.cancel()


async def test_drains_are_a_gauge_and_routing_is_in_the_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        await connect(core, nursery, [caps()], "a")
        await connect(core, nursery, [caps()], "b")
        core.drain_node("b")
        text = core.metrics.render().decode()
        assert 'iop_node_drained{node="a"} 0.0' in text
        assert 'iop_node_drained{node="b"} 1.0' in text
        routing = core.snapshot()["routing"]
        assert routing["placement"] == "least_loaded"  # type: ignore[index]
        assert routing["prefix_index"] == {  # type: ignore[index]
            "entries": 0,
            "max_entries": core.scheduler.prefixes.max_entries,
            "evicted": 0,
            "bytes": 0,
            "homes": 0,
            "replicas": 0,
            "replicas_made": 0,
            "replicas_dropped": 0,
            "home_waits": {"home": 0, "expired": 0, "left": 0},
        }
        nursery.cancel_scope.cancel()


async def test_a_placement_lists_its_candidates_with_their_loads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=4)], "a")
        b = await connect(core, nursery, [caps(slots=4)], "b")
        first = core.start_run(spec(run_id="r0"))
        await trio.testing.wait_all_tasks_blocked()
        second = core.start_run(spec(run_id="r1", model="m"))
        await trio.testing.wait_all_tasks_blocked()
        busy = node_of("r0", a, b).session.node_id
        idle = "b" if busy == "a" else "a"
        # The same conversation: affinity chose the busier instance, and the
        # timeline says so, with both candidates and their loads.
        placed = second.timeline.placements[0]
        assert placed.loads() == {f"{busy}/i0": 0.25, f"{idle}/i0": 0.0}
        assert (placed.node, placed.why) == (busy, "affinity")
        assert second.timeline.to_json()["placements"][0]["candidates"] == placed.loads()  # type: ignore[index]
        for r in (first, second):
            r.cancel(CancelReason.CLIENT_DISCONNECT)
        nursery.cancel_scope.cancel()
