"""The in-process link's channel (``iop.runtime._local_link``), in virtual time.

What the link code can tell of a socket: frames in order, a close seen with
its code and reason after the frames sent before it, a full channel holding
the sender (bounded by ``send_timeout_s``), and an end that goes away
without closing seen as a dropped connection (1006).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop.protocol import CLOSE_GOING_AWAY, LinkClosed
from iop.runtime import CLOSE_DROPPED, LOCAL_LINK_FRAMES, local_link_pair

TIMEOUT_S = 1.5


async def test_frames_arrive_in_order_both_ways(autojump_clock: trio.testing.MockClock) -> None:
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S)
    for i in range(3):
        await node.send(b"n%d" % i)
        await edge.send(b"e%d" % i)
    assert [await edge.receive() for _ in range(3)] == [b"n0", b"n1", b"n2"]
    assert [await node.receive() for _ in range(3)] == [b"e0", b"e1", b"e2"]


async def test_a_close_is_seen_after_the_frames_sent_before_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S)
    await edge.send(b"goodbye")
    await edge.aclose(CLOSE_GOING_AWAY, "edge shutting down")
    assert await node.receive() == b"goodbye"
    with pytest.raises(LinkClosed) as closed:
        await node.receive()
    assert (closed.value.close_code, closed.value.reason) == (
        CLOSE_GOING_AWAY,
        "edge shutting down",
    )
    with pytest.raises(LinkClosed):
        await node.send(b"too late")
    # The first close wins; closing again changes nothing.
    await node.aclose()
    await edge.aclose()
    assert node.close_code == CLOSE_GOING_AWAY


async def test_a_full_channel_holds_the_sender_until_the_peer_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S)
    for i in range(LOCAL_LINK_FRAMES):
        await node.send(b"%d" % i)
    sent = trio.Event()

    async def one_more() -> None:
        await node.send(b"over")
        sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one_more)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()  # held: LOCAL_LINK_FRAMES are queued
        assert await edge.receive() == b"0"
        await sent.wait()
    assert edge.close_code is None


async def test_a_peer_that_takes_no_frame_for_the_timeout_drops_the_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S, capacity=1)
    await node.send(b"queued")
    t0 = trio.current_time()
    with pytest.raises(LinkClosed) as closed:
        await node.send(b"never taken")
    assert trio.current_time() - t0 == pytest.approx(TIMEOUT_S)
    assert closed.value.close_code == CLOSE_DROPPED
    # The reader gets what was queued, then the loss.
    assert await edge.receive() == b"queued"
    with pytest.raises(LinkClosed) as seen:
        await edge.receive()
    assert seen.value.close_code == CLOSE_DROPPED


async def test_an_end_that_goes_away_unclosed_is_a_dropped_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S)
    async with trio.open_nursery() as nursery:
        failures: list[LinkClosed] = []

        async def read() -> None:
            try:
                await edge.receive()
            except LinkClosed as exc:
                failures.append(exc)

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        node.abort()
    assert [f.close_code for f in failures] == [CLOSE_DROPPED]
    # abort after a close keeps the close's code.
    edge2, node2 = local_link_pair(send_timeout_s=TIMEOUT_S)
    await node2.aclose(CLOSE_GOING_AWAY, "bye")
    node2.abort()
    assert edge2.close_code == CLOSE_GOING_AWAY


async def test_frames_that_arrived_are_taken_without_a_schedule_point(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The link reader takes every frame already queued in one wake-up
    (``NowaitFrameChannel``), as it does from the edge's WebSocket."""
    edge, node = local_link_pair(send_timeout_s=TIMEOUT_S)
    with pytest.raises(trio.WouldBlock):
        edge.receive_nowait()
    for i in range(3):
        await node.send(b"n%d" % i)
    assert [edge.receive_nowait() for _ in range(3)] == [b"n0", b"n1", b"n2"]
    with pytest.raises(trio.WouldBlock):
        edge.receive_nowait()
    await node.send(b"last")
    await node.aclose(CLOSE_GOING_AWAY, "node leaving")
    assert edge.receive_nowait() == b"last"
    with pytest.raises(LinkClosed) as closed:
        edge.receive_nowait()
    assert closed.value.close_code == CLOSE_GOING_AWAY
