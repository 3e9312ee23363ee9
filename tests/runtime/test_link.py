"""The one link driver (``iop.runtime.LinkDriver``) over both sessions, in virtual time.

What the driver adds to the sessions (tested alone in tests/protocol/): the
heartbeats a quiet link costs, none on a busy one, a silent peer noticed at
its liveness deadline, and everything queued between two wake-ups of the
writer sent as one frame.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities
from iop.events import Complete, Delta, Start
from iop.protocol import (
    CLOSE_HEARTBEAT,
    EDGE_SILENCE_FACTOR,
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
from iop.runtime import (
    LIVENESS_RESOLUTION_S,
    MAX_FRAMES_PER_WAKE,
    LinkClock,
    LinkDriver,
    PeerSilent,
    Wakeup,
)
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

    def __init__(
        self,
        edge_chan: MemoryFrameChannel,
        node_chan: MemoryFrameChannel,
        clock: LinkClock | None = None,
        *,
        interval_s: float = INTERVAL_S,
        timeout_s: float = TIMEOUT_S,
        frame_interval: float = 0.0,
        after_node_send: Callable[[], None] | None = None,
    ) -> None:
        now = trio.current_time()
        self.edge_chan, self.node_chan = edge_chan, node_chan
        self.edge = EdgeSession(
            tokens=["t"], heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s, now=now
        )
        self.node = NodeSession(node_id="n1", token="t", now=now)
        self.edge_events: list[EdgeLinkEvent] = []
        self.node_events: list[NodeLinkEvent] = []
        self.edge_driver = LinkDriver(
            edge_chan, self.edge, self.edge_events.extend, peer="node", clock=clock
        )
        self.node_driver = LinkDriver(
            node_chan,
            self.node,
            self.node_events.extend,
            peer="edge",
            after_send=after_node_send,
            frame_interval=frame_interval,
        )
        self.edge_lost, self.node_lost = trio.Event(), trio.Event()
        self.edge_loss: PeerSilent | None = None
        self.node_loss: PeerSilent | None = None

    async def run_edge(self) -> None:
        """The edge's driver until it loses the node (noted, not raised)."""
        try:
            await self.edge_driver.run()
        except PeerSilent as exc:
            self.edge_loss = exc
            self.edge_lost.set()

    async def run_node(self) -> None:
        try:
            await self.node_driver.run()
        except PeerSilent as exc:
            self.node_loss = exc
            self.node_lost.set()

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


# --- one clock for many links (the edge's) ------------------------------------------


@asynccontextmanager
async def clocked(
    n: int, stagger_s: float = 0.3
) -> AsyncIterator[tuple[list[Ends], LinkClock, trio.Nursery]]:
    """``n`` links whose edge drivers share one clock, opened ``stagger_s`` apart
    (so each node's own pings start at its own phase)."""
    clock = LinkClock(TIMEOUT_S)
    links: list[Ends] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        for i in range(n):
            if i:
                await trio.sleep(stagger_s)
            edge_chan, node_chan = memory_link_pair()
            ends = Ends(edge_chan, node_chan, clock=clock)
            await ends.handshake()
            nursery.start_soon(ends.run_edge)
            nursery.start_soon(ends.run_node)
            links.append(ends)
        yield links, clock, nursery
        nursery.cancel_scope.cancel()


def record_times(chan: MemoryFrameChannel) -> list[float]:
    """When ``chan`` sends a frame, from now on."""
    times: list[float] = []
    send = chan.send

    async def recording(frame: bytes) -> None:
        times.append(trio.current_time())
        await send(frame)

    chan.send = recording  # type: ignore[method-assign]
    return times


async def test_a_clock_pings_every_quiet_link_in_one_sweep_and_the_answers_come_back_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with clocked(3) as (links, clock, _):
        await trio.sleep(2 * TIMEOUT_S)  # a sweep or two to get in step
        edge_times = [record_times(e.edge_chan) for e in links]
        node_times = [record_times(e.node_chan) for e in links]
        edge_said = [record(e.edge_chan, decode_edge_batch) for e in links]
        node_said = [record(e.node_chan, decode_node_batch) for e in links]
        await trio.sleep(30.0)
    # The edge's pings left at the same instants on every link: one wake-up each.
    assert edge_times[0] == edge_times[1] == edge_times[2]
    assert len(edge_times[0]) == pytest.approx(30.0 / TIMEOUT_S, abs=1)
    assert all(set(said) == {"Ping"} for said in edge_said + node_said)
    # The nodes started out of phase, answered a sweep, and stay in step with
    # it: their pings too reach the edge at the same instants, still one per
    # interval (an answer replaces the node's own ping, it is not one more).
    assert node_times[0] == node_times[1] == node_times[2]
    assert len(node_times[0]) == pytest.approx(30.0 / INTERVAL_S, abs=1)
    assert clock.sweeps == pytest.approx((30.0 + 2 * TIMEOUT_S + 0.6) / TIMEOUT_S, abs=1)


async def test_without_a_clock_the_nodes_pings_keep_their_own_phases(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the test above would see if the node did not answer: the reference."""
    starts: list[list[float]] = []
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            edge_chan, node_chan = memory_link_pair()
            ends = Ends(edge_chan, node_chan)
            await ends.handshake()
            starts.append(record_times(node_chan))
            nursery.start_soon(ends.edge_driver.run)
            nursery.start_soon(ends.node_driver.run)
            await trio.sleep(0.3)
        await trio.sleep(10.0)
        nursery.cancel_scope.cancel()
    assert not set(starts[0]) & set(starts[1])


async def test_under_a_clock_a_frozen_node_is_lost_within_its_timeout_and_only_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with clocked(2) as (links, clock, _):
        await trio.sleep(10.0)
        frozen, alive = links
        last = frozen.edge.last_seen  # the last frame the edge had from it
        frozen.edge_chan.freeze()
        await frozen.edge_lost.wait()
        silence = trio.current_time() - last
        assert TIMEOUT_S - LIVENESS_RESOLUTION_S <= silence <= TIMEOUT_S
        assert frozen.edge_loss is not None
        assert frozen.edge_loss.close_code == CLOSE_HEARTBEAT
        await trio.sleep(10.0)
        assert len(clock) == 1  # the other link is untouched
        assert not alive.edge_lost.is_set()
        assert trio.current_time() < alive.edge.liveness_deadline


async def test_a_node_loses_a_frozen_edge_at_twice_the_edges_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The other direction: the edge's sweeps keep its nodes sure of it
    through a long idle time, and a node notices an edge that stops."""
    async with clocked(1) as (links, _, _):
        (ends,) = links
        await trio.sleep(30.0)
        assert not ends.node_lost.is_set()
        last = ends.node.last_seen
        ends.node_chan.freeze()
        await ends.node_lost.wait()
        assert trio.current_time() - last == pytest.approx(TIMEOUT_S * EDGE_SILENCE_FACTOR)
        assert ends.node_loss is not None
        assert ends.node_loss.close_code == CLOSE_HEARTBEAT


async def test_a_link_that_joins_with_an_old_last_frame_moves_the_clock_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A slow handshake: the link's deadline comes before the clock's next
    planned wake-up, and is kept anyway."""
    clock = LinkClock(10.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(clock.run)
        await trio.sleep(1.0)
        edge_chan, node_chan = memory_link_pair()
        ends = Ends(edge_chan, node_chan, clock=clock)
        await ends.handshake()
        ends.edge.last_seen -= 1.0  # its hello came a second ago
        edge_chan.freeze()
        t0 = trio.current_time()
        with pytest.raises(PeerSilent):
            await ends.edge_driver.run()
        assert t0 + TIMEOUT_S - 1.0 - LIVENESS_RESOLUTION_S <= trio.current_time()
        assert trio.current_time() <= t0 + TIMEOUT_S - 1.0
        nursery.cancel_scope.cancel()
    assert LinkClock(0.2).resolution_s == pytest.approx(0.05)  # heartbeats set very short
    with pytest.raises(ValueError, match="positive"):
        LinkClock(0.0)


class _ClosingOnCancel:
    """A channel whose receive, when cancelled, reports the link closed (as a
    WebSocket library may when its connection is torn down at that moment)."""

    def __init__(self) -> None:
        self.receiving = trio.Event()

    async def receive(self) -> bytes:
        self.receiving.set()
        try:
            await trio.sleep_forever()
        finally:
            from iop.protocol import LinkClosed

            raise LinkClosed("closed while cancelled", close_code=1006, reason="")

    async def send(self, frame: bytes) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await trio.lowlevel.checkpoint()


async def test_a_driver_cancelled_as_its_link_closes_raises_only_the_cancel() -> None:
    # The runner's cancel is the cause: a link error at the same moment must
    # not escape its scope as an ExceptionGroup (handle_link never raises).
    edge = EdgeSession(
        tokens=["t"], heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S, now=0.0
    )
    chan = _ClosingOnCancel()
    driver = LinkDriver(chan, edge, lambda events: None, peer="node x")  # type: ignore[arg-type]
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver.run)
            await chan.receiving.wait()
            scope.cancel()
    assert scope.cancelled_caught


# --- frames that have already arrived: taken in one wake-up ------------------------


class QueuedFrames:
    """A ``NowaitFrameChannel`` whose frames are already there (as hypercorn's
    queue holds the frames of one socket read): ``receive`` passes a schedule
    point like a trio channel's, ``receive_nowait`` none."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.received = 0  # frames through ``receive``: one schedule point each
        self.more = trio.Event()

    async def send(self, frame: bytes) -> None:
        await trio.lowlevel.checkpoint()

    def receive_nowait(self) -> bytes:
        if not self.frames:
            raise trio.WouldBlock
        return self.frames.pop(0)

    async def receive(self) -> bytes:
        while not self.frames:
            await self.more.wait()
        self.received += 1
        await trio.lowlevel.checkpoint()
        return self.frames.pop(0)

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await trio.lowlevel.checkpoint()


class EchoSession:
    """A ``LinkSession``/``SweptSession`` whose every frame is one event."""

    liveness_deadline = math.inf
    next_tick_at = math.inf
    has_data_to_send = False

    def receive(self, frame: bytes, now: float) -> list[bytes]:
        return [frame]

    def data_to_send(self, now: float) -> list[bytes]:
        return []

    def tick(self, now: float) -> None:
        pass

    def sweep(self, now: float) -> None:
        pass


class Stream:
    """A stream task: woken by the reader's events, it writes everything
    that arrived since it last wrote in one write (as ``_sse_body`` does)."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.writes: list[list[bytes]] = []
        self.woken = Wakeup()

    def deliver(self, events: list[bytes]) -> None:
        self.pending.extend(events)
        self.woken.set()

    async def run(self) -> None:
        while True:
            await self.woken.wait()
            if self.pending:
                self.writes.append(self.pending)
                self.pending = []


async def _read_all(frames: list[bytes], *, clocked: bool) -> tuple[QueuedFrames, Stream]:
    """A driver reads ``frames``, all already arrived, into a stream task
    until the stream has every one (its own deadline, or under a clock)."""
    chan = QueuedFrames(list(frames))
    stream = Stream()
    clock = LinkClock(sweep_every_s=INTERVAL_S) if clocked else None
    driver = LinkDriver(chan, EchoSession(), stream.deliver, clock=clock)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        if clock is not None:
            nursery.start_soon(clock.run)
        nursery.start_soon(stream.run)
        nursery.start_soon(driver.run)
        with trio.fail_after(5):
            while sum(map(len, stream.writes)) < len(frames):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return chan, stream


@pytest.mark.parametrize("clocked", [False, True], ids=["own deadline", "under a clock"])
@pytest.mark.parametrize("queued", [8, MAX_FRAMES_PER_WAKE])
async def test_frames_already_queued_reach_a_stream_before_it_runs(
    clocked: bool, queued: int, autojump_clock: trio.testing.MockClock
) -> None:
    # Before: one schedule point per frame, and the stream woke and wrote
    # after the first (its first write held one or two of the frames).
    frames = [b"%d" % i for i in range(queued)]
    chan, stream = await _read_all(frames, clocked=clocked)
    assert stream.writes == [frames]
    assert chan.received == 1


@pytest.mark.parametrize("clocked", [False, True], ids=["own deadline", "under a clock"])
async def test_a_flood_is_taken_in_batches_with_a_schedule_point_between(
    clocked: bool, autojump_clock: trio.testing.MockClock
) -> None:
    queued = 2 * MAX_FRAMES_PER_WAKE + 3
    frames = [b"%d" % i for i in range(queued)]
    chan, stream = await _read_all(frames, clocked=clocked)
    # Every frame delivered, in order; the reader passed a schedule point
    # (a ``receive``) before each batch of at most the bound, and the stream
    # ran between the batches.
    assert [f for write in stream.writes for f in write] == frames
    assert chan.received == 3
    assert len(stream.writes) >= 2
    assert max(map(len, stream.writes)) <= 2 * MAX_FRAMES_PER_WAKE
