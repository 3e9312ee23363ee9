"""The edge's end of the node link against hostile and unlucky nodes, in virtual time.

docs/operations.md "Limits and abuse" / "The node link": every limit is
crossed here and the close code, the log line and the effect on other runs
are checked. The node is a scripted ``NodeSession`` over a memory link
(``tests/edge/test_core.py``'s ``FakeNode``).
"""

from __future__ import annotations

import contextlib
import logging

import msgspec
import pytest
import trio
import trio.testing

from iop.config import EdgeConfig
from iop.edge import EdgeCore, open_edge_core
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, Start
from iop.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL,
    CLOSE_RATE,
    CLOSE_TOO_BIG,
    Goodbye,
    Hello,
    LinkClosed,
    NodeSession,
    Ping,
    RunEvents,
    encode,
)
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import MemoryFrameChannel, memory_link_pair
from tests.edge.test_core import (
    TOKEN,
    FakeNode,
    caps,
    config,
    connect,
    drain_events,
    frame,
    spec,
)


async def test_events_for_a_run_never_assigned_close_the_link_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps()], "n1")
        t0 = trio.current_time()
        await node.chan.send(
            frame(RunEvents(run_id="nobody-assigned-me", seq=0, events=[Delta("x")]))
        )
        await trio.testing.wait_all_tasks_blocked()
        assert node.closed is not None
        assert node.chan.close_code == CLOSE_PROTOCOL
        assert "not assigned on this link" in node.chan.close_reason
        assert trio.current_time() == t0  # not a heartbeat timeout later
        assert "node n1 broke the protocol: events for run 'nobody-assigned-me'" in caplog.text
        assert core.registry.nodes == {}
        nursery.cancel_scope.cancel()


async def test_late_events_of_a_cancelled_run_keep_the_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps()], "n1")
        run = core.start_run(spec())
        await node.assigns.receive()
        run.cancel(CancelReason.CLIENT_DISCONNECT, "gone")
        await drain_events(run)
        await trio.testing.wait_all_tasks_blocked()
        assert [c.cancel.run_id for c in node.cancels] == ["r1"]
        # What the node had in flight when the cancel crossed it (sent by
        # hand: the node's own session drops what it still holds).
        await node.chan.send(frame(RunEvents(run_id="r1", seq=0, events=[Start(), Delta("late")])))
        end = Cancelled(reason=CancelReason.CLIENT_DISCONNECT)
        await node.chan.send(frame(RunEvents(run_id="r1", seq=1, events=[end])))
        await trio.testing.wait_all_tasks_blocked()
        assert node.closed is None
        assert "n1" in core.registry.nodes
        nursery.cancel_scope.cancel()


async def test_a_control_message_flood_is_cut_off(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config()
    cfg = msgspec.structs.replace(
        cfg, link=msgspec.structs.replace(cfg.link, control_rate_per_s=10.0, control_burst=50)
    )
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps()], "n1")
        run = core.start_run(spec())
        await node.assigns.receive()
        sent = 0
        closed: LinkClosed | None = None
        while sent < 10_000 and closed is None:
            try:
                await node.chan.send(frame(Goodbye(reason="spam")))  # costs no credit
            except LinkClosed as exc:
                closed = exc
            sent += 1
        assert closed is not None
        assert node.chan.close_code == CLOSE_RATE
        assert sent < 200  # the burst (50), plus what the memory link buffers
        assert "exceeds the link's message rate" in caplog.text
        events = await drain_events(run)
        assert isinstance(events[-1], Cancelled)  # the abuser's own run, not another node's
        nursery.cancel_scope.cancel()


async def test_a_frame_too_big_before_the_hello_is_closed_1009(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "10.1.2.3:5555")
        hello = Hello(protocol_version=1, node_id="n1", token=TOKEN, software="x" * 300_000)
        await node_end.send(encode(hello))
        with pytest.raises(LinkClosed):
            await node_end.receive()
        assert node_end.close_code == CLOSE_TOO_BIG
        assert "refusing node link from 10.1.2.3:5555: frame of" in caplog.text
        assert "before its hello (limit 262144)" in caplog.text
        assert core.registry.nodes == {}


async def test_a_frame_too_big_after_the_hello_is_closed_1009(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config()
    cfg = msgspec.structs.replace(
        cfg, link=msgspec.structs.replace(cfg.link, max_frame_bytes=1024 * 1024)
    )
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps()], "n1")
        assert node.session.peer_max_frame_bytes == 1024 * 1024  # told in the welcome
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.chan.send(frame(RunEvents(run_id="r1", seq=0, events=[Delta("x" * 2**20)])))
        await trio.testing.wait_all_tasks_blocked()
        assert node.chan.close_code == CLOSE_TOO_BIG
        assert "frame of 10" in caplog.text
        assert "on an open link (limit 1048576)" in caplog.text
        events = await drain_events(run)
        assert isinstance(events[-1], Cancelled)


async def test_a_request_too_big_for_the_node_is_refused_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The edge never sends a frame above what the node accepts (its hello
    says): that run gets a 413, the link and the node's other runs go on."""
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "test")
        node = FakeNode(node_end, "n1")
        node.session = NodeSession(
            node_id="n1", token=TOKEN, now=trio.current_time(), max_frame_bytes=100_000
        )
        await node.hello([caps()])
        nursery.start_soon(node.serve)
        await trio.testing.wait_all_tasks_blocked()
        small = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))
        big = ExecutionSpec(
            run_id="r2",
            request=ChatRequest(model="m", messages=[Message(role="user", content="x" * 200_000)]),
        )
        big_run = core.start_run(big)
        events = await drain_events(big_run)
        assert isinstance(events[-1], Error)
        assert events[-1].status == 413
        assert events[-1].code == "request_too_large"
        await node.send("r1", Delta("b"), Complete())
        assert await drain_events(small) == [Start(), Delta("a"), Delta("b"), Complete()]
        assert node.closed is None
        nursery.cancel_scope.cancel()


async def _run_on_a_stalled_link(
    core: EdgeCore, nursery: trio.Nursery
) -> tuple[Run, MemoryFrameChannel, FakeNode]:
    """A run whose node stopped reading: the link's one-frame buffer holds the
    assign, so the writer blocks in its next send, when the run's consumer
    takes its events and credit is due."""
    edge_end, node_end = memory_link_pair(buffer=1)
    nursery.start_soon(core.handle_link, edge_end, "test")
    node = FakeNode(node_end, "n1")
    await node.hello([caps()])
    await trio.testing.wait_all_tasks_blocked()
    run = core.start_run(spec())
    await trio.testing.wait_all_tasks_blocked()

    async def keep_alive() -> None:  # the node still sends; it just does not read
        with contextlib.suppress(LinkClosed):
            while True:
                await node_end.send(frame(Ping(nonce=0)))
                await trio.sleep(0.2)

    nursery.start_soon(keep_alive)
    await trio.sleep(1.0)
    await node_end.send(frame(RunEvents(run_id="r1", seq=0, events=[Start(), *[Delta("t")] * 40])))
    return run, node_end, node


async def test_returning_credit_never_waits_on_a_stalled_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The consumer takes its events (credit is due) while the link writer is
    stuck; the link then closes. The run ends node_lost, and no read waited."""
    async with open_edge_core(_fast_pings()) as core, trio.open_nursery() as nursery:
        run, node_end, _ = await _run_on_a_stalled_link(core, nursery)
        t0 = trio.current_time()
        got = [await run.events.receive() for _ in range(41)]  # a half window and more
        assert len(got) == 41
        assert trio.current_time() == t0  # no read waited for the stuck writer
        await node_end.aclose(CLOSE_GOING_AWAY, "node restarting")
        events = await drain_events(run)
        end = events[-1]
        assert isinstance(end, Cancelled), end
        assert end.reason is CancelReason.NODE_LOST
        assert core.snapshot()["outcomes"] == {"cancelled:node_lost": 1}
        nursery.cancel_scope.cancel()


async def test_credit_queued_behind_a_stalled_link_is_sent_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(_fast_pings()) as core, trio.open_nursery() as nursery:
        run, _, node = await _run_on_a_stalled_link(core, nursery)
        for _ in range(41):
            await run.events.receive()
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(node.serve)  # the node reads again
        while not node.credits:
            await trio.sleep(0.05)
        assert [(c.run_id, c.credit) for c in node.credits] == [("r1", 32)]  # half the window
        run.cancel(CancelReason.CLIENT_DISCONNECT)
        nursery.cancel_scope.cancel()


def _fast_pings() -> EdgeConfig:
    cfg = config()
    return msgspec.structs.replace(
        cfg,
        link=msgspec.structs.replace(
            cfg.link, run_window=64, heartbeat_interval_s=0.01, control_burst=100_000
        ),
    )


class _StuckChannel:
    """A FrameChannel whose close never finishes (a peer that stopped reading)."""

    def __init__(self) -> None:
        self.closes = 0

    async def send(self, frame: bytes) -> None:
        await trio.sleep_forever()

    async def receive(self) -> bytes:
        return b"\xc1"  # never valid msgpack: a protocol error, then a close

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        self.closes += 1
        await trio.sleep_forever()


async def test_closing_a_stuck_link_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core:
        chan = _StuckChannel()
        with trio.fail_after(5):
            await core.handle_link(chan, "stuck")
        assert chan.closes == 1


async def test_a_clean_goodbye_is_info_and_a_heartbeat_loss_a_warning(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iop.edge")
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps()], "n1")
        await node.chan.send(frame(Goodbye(reason="node draining")))
        await node.chan.aclose(CLOSE_GOING_AWAY, "node draining")
        await trio.testing.wait_all_tasks_blocked()
        (line,) = [r for r in caplog.records if "node n1 disconnected" in r.getMessage()]
        assert line.levelno == logging.INFO
        assert "None" not in line.getMessage()
        assert "closed cleanly (1001 node draining)" in line.getMessage()

        caplog.clear()
        frozen = await connect(core, nursery, [caps()], "n2")
        frozen.chan.freeze()
        await trio.sleep(2.0)
        (line,) = [r for r in caplog.records if "node n2 disconnected" in r.getMessage()]
        assert line.levelno == logging.WARNING
        assert "4408 heartbeat timeout" in line.getMessage()
        nursery.cancel_scope.cancel()


async def test_two_newcomers_with_one_id_get_one_registration(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both hellos pass the check before either node is registered: the
    second to register is still refused (4410), the first is not replaced."""
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        ends = []
        for peer in ("a", "b"):
            edge_end, node_end = memory_link_pair()
            nursery.start_soon(core.handle_link, edge_end, peer)
            await node_end.send(NodeSession(node_id="n1", token=TOKEN, now=0.0).hello([caps()]))
            ends.append(node_end)
        await trio.testing.wait_all_tasks_blocked()
        assert len(core.registry.nodes) == 1
        assert sorted(str(e.close_code) for e in ends) == ["4410", "None"]
        live = core.registry.nodes["n1"]
        assert live.close_code is None
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("hello_timeout_s", [0.5, 7.0])
async def test_a_connection_that_never_says_hello_is_closed_after_hello_timeout_s(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    hello_timeout_s: float,
) -> None:
    link = msgspec.structs.replace(config().link, hello_timeout_s=hello_timeout_s)
    async with open_edge_core(config(link=link)) as core:
        edge_end, node_end = memory_link_pair()
        t0 = trio.current_time()
        await core.handle_link(edge_end, peer="10.9.8.7:4242")
        assert trio.current_time() - t0 == pytest.approx(hello_timeout_s)
        with pytest.raises(LinkClosed):
            await node_end.receive()
        assert node_end.close_code == CLOSE_PROTOCOL
        assert f"no hello within {hello_timeout_s:g}s" in caplog.text
        assert core.registry.nodes == {}
