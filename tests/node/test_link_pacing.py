"""Which of a run's events wait for the node's frame interval (``NodeRun.send_nowait``).

Only tokens after a run's first output may wait (``node.frame_interval_ms``,
docs/benchmarks.md "Frames paced on the node"): the first output is what
the client's time to first token waits for, and the terminal event frees
the run's slot on the edge. Here a node's link, with a run assigned by a
real edge session, in virtual time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop._secrets import SecretMasker
from iop.capabilities import Capabilities
from iop.config import NodeEdge, NodeSection
from iop.events import Complete, Delta, RuntimeEvent, Start
from iop.node._link import NodeLink, NodeRun
from iop.protocol import (
    RUN_BACKLOG,
    UNLIMITED_CREDIT,
    AssignReceived,
    EdgeLinkEvent,
    EdgeSession,
    NodeJoined,
    NodeSession,
    RunEventsReceived,
    Welcomed,
)
from iop.runtime import LinkDriver
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import memory_link_pair

INTERVAL_S = 0.005
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))


@asynccontextmanager
async def linked_run(
    *, credit: int, run_backlog: int = RUN_BACKLOG
) -> AsyncIterator[tuple[NodeRun, list[tuple[float, list[RuntimeEvent]]]]]:
    """Run ``r1`` on a node's paced link, assigned by an edge session: its
    ``NodeRun``, and when each of its frames' events reached the edge."""
    edge_chan, node_chan = memory_link_pair()
    now = trio.current_time()
    edge = EdgeSession(tokens=["t"], heartbeat_interval_s=60.0, heartbeat_timeout_s=120.0, now=now)
    session = NodeSession(node_id="n1", token="t", now=now)
    await node_chan.send(session.hello([CAPS]))
    (joined,) = edge.receive(await edge_chan.receive(), now)
    assert isinstance(joined, NodeJoined)
    await edge_chan.send(edge.welcome())
    (welcomed,) = session.receive(await node_chan.receive(), now)
    assert isinstance(welcomed, Welcomed)

    runs: dict[str, NodeRun] = {}
    arrived: list[tuple[float, list[RuntimeEvent]]] = []

    def on_edge_events(events: list[EdgeLinkEvent]) -> None:
        for e in events:
            if isinstance(e, RunEventsReceived):
                arrived.append((trio.current_time(), list(e.events)))

    def on_assign(link: NodeLink, event: AssignReceived) -> None:
        run_id = event.assign.spec.run_id
        runs[run_id] = NodeRun(link, run_id, "sim")

    link = NodeLink(
        NodeEdge(url="ws://edge/v1/link", token="t"),
        node_chan,
        session,
        SecretMasker(),
        on_assign=on_assign,
        on_run_closed=lambda _: None,
        run_backlog=run_backlog,
        frame_interval=INTERVAL_S,
    )
    edge_driver = LinkDriver(edge_chan, edge, on_edge_events, peer="node")
    spec = ExecutionSpec(
        run_id="r1", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge_driver.run)
        nursery.start_soon(link.driver.run)
        edge.assign("r1", "sim", spec, credit=credit)
        edge_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        yield runs["r1"], arrived
        nursery.cancel_scope.cancel()


async def test_a_runs_first_output_and_terminal_go_at_once_and_its_later_tokens_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with linked_run(credit=64) as (nr, arrived):
        t0 = trio.current_time()
        nr.send_nowait(Start())
        nr.send_nowait(Delta("first"))
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.001)
        # Right after a round: the first output did not wait, and went with its Start.
        assert [(t, [type(e) for e in evs]) for t, evs in arrived] == [(t0, [Start, Delta])]

        nr.send_nowait(Delta("second"))  # 1 ms after the last round: waits 4 ms more
        await trio.testing.wait_all_tasks_blocked()
        assert len(arrived) == 1
        await trio.sleep(0.01)
        assert arrived[1] == (pytest.approx(t0 + INTERVAL_S), [Delta("second")])

        nr.send_nowait(Delta("third"))  # 5 ms after the last round... later: at once
        await trio.sleep(0.001)
        nr.send_nowait(Delta("fourth"))  # within the interval: waits
        await trio.sleep(0.001)
        nr.send_nowait(Complete())  # the terminal does not wait, nor what is before it
        await trio.testing.wait_all_tasks_blocked()
        t_end = trio.current_time()
        assert arrived[-1] == (t_end, [Delta("fourth"), Complete()])


@pytest.mark.parametrize("interval", [-1.0, 50.001, float("nan")])
def test_frame_interval_ms_is_bounded(interval: float) -> None:
    with pytest.raises(ValueError, match="frame_interval_ms"):
        NodeSection(id="n", frame_interval_ms=interval)


def test_frame_interval_ms_defaults_to_5_and_takes_0_to_50() -> None:
    assert NodeSection(id="n").frame_interval_ms == 5.0
    assert NodeSection(id="n", frame_interval_ms=0).frame_interval_ms == 0
    assert NodeSection(id="n", frame_interval_ms=50).frame_interval_ms == 50


async def test_a_run_that_must_wait_for_the_writer_does_not_wait_for_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With per-run credit off a run may have ``run_backlog`` events unsent;
    the one past them waits for the writer's round, which then goes at
    once: a fast run is not held to its backlog per frame interval."""
    async with linked_run(credit=UNLIMITED_CREDIT, run_backlog=2) as (nr, arrived):
        nr.send_nowait(Start())
        nr.send_nowait(Delta("0"))  # the first output: a round at once
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        for i in range(1, 41):  # 40 more, as fast as the writer lets them go
            await nr.send(Delta(str(i)))
        await trio.testing.wait_all_tasks_blocked()
        # Two unsent at a time, each round at once: no interval was waited.
        assert trio.current_time() - t0 < INTERVAL_S
        await trio.sleep(0.1)
        texts = [ev.text for _, evs in arrived for ev in evs if isinstance(ev, Delta)]
        assert texts == [str(i) for i in range(41)]  # in order, nothing lost
