"""The one link driver (``iop.runtime.LinkDriver``) over both sessions, in virtual time.

What the driver adds to the sessions (tested alone in tests/protocol/): the
heartbeats a quiet link costs, none on a busy one, a silent peer noticed at
its liveness deadline, and everything queued between two wake-ups of the
writer sent as one frame.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities
from iop.events import Complete, Delta, Start
from iop.protocol import (
    CLOSE_HEARTBEAT,
    AssignReceived,
    EdgeLinkEvent,
    EdgeSession,
    NodeJoined,
    NodeLinkEvent,
    NodeSession,
    RunEventsReceived,
    Welcomed,
    decode_edge_batch,
    decode_node_batch,
)
from iop.runtime import LinkDriver, PeerSilent, Wakeup
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import MemoryFrameChannel, memory_link_pair

INTERVAL_S = 0.5
TIMEOUT_S = 1.5
CAPS = Capabilities(adapter="sim", instance="sim", targets=("m",))
SPEC = ExecutionSpec(
    run_id="r1", request=ChatRequest(model="m", messages=[Message(role="user", content="hi")])
)


def record(chan: MemoryFrameChannel, decode: Callable[[bytes], Sequence[object]]) -> list[str]:
    """The names of the messages ``chan`` sends from now on."""
    said: list[str] = []
    send = chan.send

    async def recording(frame: bytes) -> None:
        said.extend(type(m).__name__ for m in decode(frame))
        await send(frame)

    chan.send = recording  # type: ignore[method-assign]
    return said


class Ends:
    """An edge and a node session, each under its own driver, over a memory link."""

    def __init__(self, edge_chan: MemoryFrameChannel, node_chan: MemoryFrameChannel) -> None:
        now = trio.current_time()
        self.edge_chan, self.node_chan = edge_chan, node_chan
        self.edge = EdgeSession(
            tokens=["t"], heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S, now=now
        )
        self.node = NodeSession(node_id="n1", token="t", now=now)
        self.edge_events: list[EdgeLinkEvent] = []
        self.node_events: list[NodeLinkEvent] = []
        self.edge_driver = LinkDriver(edge_chan, self.edge, self.edge_events.extend, peer="node")
        self.node_driver = LinkDriver(node_chan, self.node, self.node_events.extend, peer="edge")

    async def handshake(self) -> None:
        now = trio.current_time()
        await self.node_chan.send(self.node.hello([CAPS]))
        (joined,) = self.edge.receive(await self.edge_chan.receive(), now)
        assert isinstance(joined, NodeJoined)
        await self.edge_chan.send(self.edge.welcome())
        (welcomed,) = self.node.receive(await self.node_chan.receive(), now)
        assert isinstance(welcomed, Welcomed)


@asynccontextmanager
async def driven() -> AsyncIterator[tuple[Ends, trio.Nursery]]:
    edge_chan, node_chan = memory_link_pair()
    ends = Ends(edge_chan, node_chan)
    await ends.handshake()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ends.edge_driver.run)
        nursery.start_soon(ends.node_driver.run)
        yield ends, nursery
        nursery.cancel_scope.cancel()


async def test_an_idle_link_costs_a_ping_per_interval_one_way_and_per_timeout_the_other(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with driven() as (ends, _):
        edge_said = record(ends.edge_chan, decode_edge_batch)
        node_said = record(ends.node_chan, decode_node_batch)
        await trio.sleep(30.0)
        # Each side pings when it sent nothing for its interval; nobody answers.
        assert set(node_said) == set(edge_said) == {"Ping"}
        assert len(node_said) == pytest.approx(30.0 / INTERVAL_S, abs=1)
        assert len(edge_said) == pytest.approx(30.0 / TIMEOUT_S, abs=1)


async def test_a_busy_link_sends_no_heartbeat(autojump_clock: trio.testing.MockClock) -> None:
    """Events one way and credit the other: every frame proves both ends alive."""
    async with driven() as (ends, nursery):
        edge_said = record(ends.edge_chan, decode_edge_batch)
        node_said = record(ends.node_chan, decode_node_batch)
        ends.edge.assign("r1", "sim", SPEC, credit=4)
        ends.edge_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(ends.node_events[-1], AssignReceived)

        async def stream() -> None:
            ends.node.push("r1", Start())
            for i in range(200):
                while ends.node.backlog("r1"):
                    await trio.sleep(0.01)
                ends.node.push("r1", Delta(f"{i}"))
                ends.node_driver.wake()
                await trio.sleep(0.05)  # 20 tokens/s for 10 s
            ends.node.push("r1", Complete())
            ends.node_driver.wake()

        async def consume() -> None:
            seen = 0
            while True:
                got = [e for e in ends.edge_events if isinstance(e, RunEventsReceived)]
                for ev in got[seen:]:
                    n = sum(1 for e in ev.events if not isinstance(e, Complete))
                    if ends.edge.consumed("r1", n):
                        ends.edge_driver.wake()
                    if ev.finished:
                        return
                seen = len(got)
                await trio.sleep(0.01)

        nursery.start_soon(stream)
        await consume()
        assert ends.edge.run("r1") is None  # ended, exactly once
        # The assign and credit one way, events the other: no ping.
        assert set(edge_said) == {"Assign", "Credit"}
        assert edge_said.count("Credit") >= 201 // 4  # at least every half window or so
        assert set(node_said) == {"RunEvents"}


async def test_a_frozen_peer_is_lost_at_its_liveness_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge_chan, node_chan = memory_link_pair()
    ends = Ends(edge_chan, node_chan)
    await ends.handshake()
    t0 = trio.current_time()
    edge_chan.freeze()
    with pytest.raises(PeerSilent) as lost:
        await ends.edge_driver.run()
    assert lost.value.close_code == CLOSE_HEARTBEAT
    assert trio.current_time() - t0 == pytest.approx(TIMEOUT_S)


async def test_what_is_queued_between_two_wake_ups_goes_out_as_one_frame(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with driven() as (ends, _):
        for run in ("r1", "r2", "r3"):
            ends.edge.assign(run, "sim", SPEC, credit=8)
        ends.edge_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        sent = ends.node_chan.frames_sent
        for run in ("r1", "r2", "r3"):
            ends.node.push(run, Start())
            ends.node.push(run, Delta("a"))
            ends.node_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        assert ends.node_chan.frames_sent == sent + 1
        got = [e for e in ends.edge_events if isinstance(e, RunEventsReceived)]
        assert [e.run_id for e in got] == ["r1", "r2", "r3"]


async def test_wakeup_ends_the_current_or_the_next_wait_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    wakeup = Wakeup()
    wakeup.set()  # before any wait: the next returns at once
    with trio.testing.assert_checkpoints():
        await wakeup.wait()
    woke: list[bool] = []

    async def waiter() -> None:
        await wakeup.wait()
        woke.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []  # the earlier set() was used up
        wakeup.set()
    assert woke == [True]
    with trio.move_on_after(1) as cancelled:  # a cancelled wait leaves it armed
        await wakeup.wait()
    assert cancelled.cancelled_caught
    wakeup.set()
    with trio.fail_after(1):
        await wakeup.wait()
