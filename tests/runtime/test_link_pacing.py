"""The link driver's frame interval (``LinkDriver(frame_interval=...)``), in virtual time.

A node's tokens after a run's first wait up to the interval after the
writer's last round for company: everything queued meanwhile, from any run,
leaves in one frame (docs/benchmarks.md, "Frames paced on the node"). What
may not wait (an urgent wake-up: a first output, a terminal, a control
message) ends the wait, and a link that was quiet for the interval sends at
once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop.events import Delta, Start
from iop.protocol import UNLIMITED_CREDIT, NodeSession, RunEventsReceived
from iop.runtime import LinkDriver
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import MemoryFrameChannel, memory_link_pair
from tests.runtime.test_link import Ends

INTERVAL_S = 0.005
RUNS = ("r1", "r2", "r3")


def spec(run_id: str) -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        request=ChatRequest(model="m", messages=[Message(role="user", content="hi")]),
    )


class Paced(Ends):
    """The edge and node ends of ``tests/runtime/test_link.py``, the node's
    driver with a frame interval (``frame_interval``; 0: none), heartbeats
    far apart (only the frames under test cross the link), and when each
    round of the node's writer ended."""

    def __init__(
        self,
        edge_chan: MemoryFrameChannel,
        node_chan: MemoryFrameChannel,
        frame_interval: float = INTERVAL_S,
    ) -> None:
        self.rounds: list[float] = []
        super().__init__(
            edge_chan,
            node_chan,
            interval_s=60.0,
            timeout_s=120.0,
            frame_interval=frame_interval,
            after_node_send=lambda: self.rounds.append(trio.current_time()),
        )

    def tokens(self) -> list[tuple[str, list[str]]]:
        """What reached the edge: each RunEvents' run and texts, in order."""
        return [
            (e.run_id, [ev.text for ev in e.events if isinstance(ev, Delta)])
            for e in self.edge_events
            if isinstance(e, RunEventsReceived)
        ]

    def push(self, run_id: str, text: str, *, urgent: bool = False) -> None:
        self.node.push(run_id, Delta(text))
        self.node_driver.wake(urgent=urgent)


@asynccontextmanager
async def paced() -> AsyncIterator[Paced]:
    edge_chan, node_chan = memory_link_pair()
    ends = Paced(edge_chan, node_chan)
    await ends.handshake()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ends.edge_driver.run)
        nursery.start_soon(ends.node_driver.run)
        for run in RUNS:
            ends.edge.assign(run, "sim", spec(run), credit=UNLIMITED_CREDIT)
        ends.edge_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        for run in RUNS:  # each run's first output: urgent, a round of its own
            ends.node.push(run, Start())
            ends.push(run, "first", urgent=True)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1.0)  # the link quiet past the interval
        ends.edge_events.clear()
        ends.rounds.clear()
        yield ends
        nursery.cancel_scope.cancel()


async def test_tokens_within_the_interval_of_a_round_leave_together_when_it_has_passed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with paced() as ends:
        t0 = trio.current_time()
        ends.push("r1", "a")  # after a quiet link: at once
        await trio.testing.wait_all_tasks_blocked()
        assert ends.rounds == [t0]
        sent = ends.node_chan.frames_sent
        await trio.sleep(0.001)
        ends.push("r2", "b")
        await trio.sleep(0.001)
        ends.push("r3", "c")
        ends.push("r1", "d")
        await trio.testing.wait_all_tasks_blocked()
        assert ends.node_chan.frames_sent == sent  # waiting for the interval
        await trio.sleep(0.01)
        assert ends.node_chan.frames_sent == sent + 1  # one frame for all three runs
        assert ends.rounds == [t0, pytest.approx(t0 + INTERVAL_S)]
        first, *rest = ends.tokens()
        assert first == ("r1", ["a"])
        assert sorted(rest) == [("r1", ["d"]), ("r2", ["b"]), ("r3", ["c"])]


async def test_an_urgent_wake_up_ends_the_wait_with_everything_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with paced() as ends:
        t0 = trio.current_time()
        ends.push("r1", "a")
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.001)
        ends.push("r2", "b")
        await trio.sleep(0.001)
        ends.push("r3", "c", urgent=True)
        await trio.testing.wait_all_tasks_blocked()
        assert ends.rounds == [t0, pytest.approx(t0 + 0.002)]
        assert [run for run, _ in ends.tokens()] == ["r1", "r2", "r3"]


async def test_a_round_after_the_wait_leaves_no_empty_round_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The wake-ups made while the writer waited asked for what the round
    sent: none of them starts another round (a timer wake-up for nothing)."""
    async with paced() as ends:
        ends.push("r1", "a")
        await trio.testing.wait_all_tasks_blocked()
        ends.push("r1", "x")
        await trio.testing.wait_all_tasks_blocked()  # the writer waits for the interval
        ends.push("r2", "x")
        ends.push("r3", "x")
        await trio.sleep(1.0)
        assert len(ends.rounds) == 2
        assert [run for run, _ in ends.tokens()] == ["r1", "r1", "r2", "r3"]


async def test_a_steady_flow_goes_out_once_per_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three runs' tokens 0.6 ms apart for 0.3 s (1,600 tokens/s, as 32
    streams at 50 tokens/s): one frame per interval, not one per token."""
    async with paced() as ends:
        sent = ends.node_chan.frames_sent
        n = 500
        for i in range(n):
            ends.push(RUNS[i % 3], str(i))
            await trio.sleep(0.0006)
        await trio.sleep(0.1)
        frames = ends.node_chan.frames_sent - sent
        assert frames == pytest.approx(n * 0.0006 / INTERVAL_S, abs=2)
        texts = [t for _, ts in ends.tokens() for t in ts]
        assert sorted(texts, key=int) == [str(i) for i in range(n)]  # nothing lost


async def test_without_an_interval_every_wake_up_is_a_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge_chan, node_chan = memory_link_pair()
    ends = Paced(edge_chan, node_chan, frame_interval=0.0)
    await ends.handshake()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ends.edge_driver.run)
        nursery.start_soon(ends.node_driver.run)
        ends.edge.assign("r1", "sim", spec("r1"), credit=64)
        ends.edge_driver.wake()
        await trio.testing.wait_all_tasks_blocked()
        ends.node.push("r1", Start())
        sent = node_chan.frames_sent
        for i in range(5):
            ends.push("r1", str(i))
            await trio.sleep(0.001)
        assert node_chan.frames_sent == sent + 5
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("interval", [-0.001, float("inf"), float("nan")])
def test_a_frame_interval_must_be_finite_and_not_negative(interval: float) -> None:
    edge_chan, _ = memory_link_pair()
    session = NodeSession(node_id="n1", token="t", now=0.0)
    with pytest.raises(ValueError, match="frame_interval"):
        LinkDriver(edge_chan, session, lambda _: None, frame_interval=interval)
