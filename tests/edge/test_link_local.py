"""The edge's in-process link (``EdgeCore.open_local_link``, ``iop up``'s own node).

The same frames, handshake, token check, credit and frame limits as a node
over a WebSocket, because the same ``EdgeSession`` reads them: a node played
by hand (``tests/edge/test_core.py``'s ``FakeNode``) over the in-process end,
in virtual time. Its end behaves as a link's end: a close the edge sees with
its code, an end left unclosed as a loss (1006).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop.edge import EdgeCore, open_edge_core
from iop.events import Cancelled, CancelReason, Complete, Delta, Start
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_TOO_BIG,
    LinkClosed,
    Ping,
)
from iop.runtime import CLOSE_DROPPED
from tests.edge.test_core import FakeNode, caps, config, drain_events, frame, spec


@asynccontextmanager
async def joined() -> AsyncIterator[tuple[EdgeCore, FakeNode]]:
    """An edge core with a node joined over its in-process link, serving."""
    async with (
        open_edge_core(config()) as core,
        core.open_local_link() as chan,
        trio.open_nursery() as nursery,
    ):
        node = FakeNode(chan)  # type: ignore[arg-type]
        await node.hello([caps()])
        nursery.start_soon(node.serve)
        await trio.testing.wait_all_tasks_blocked()  # registered
        yield core, node
        nursery.cancel_scope.cancel()


async def test_an_in_process_node_joins_by_the_handshake_and_streams_with_credit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with joined() as (core, node):
        (view,) = core.snapshot()["nodes"]  # type: ignore[misc]
        assert (view["id"], view["peer"]) == ("n1", "in-process")
        run = core.start_run(spec())
        assign = await node.assigns.receive()
        assert assign.assign.credit == 4  # the link's window, as over a socket
        await node.send("r1", Start(), Delta("a"), Delta("b"), Delta("c"))
        assert node.session.credit("r1") == 0
        got = [await run.events.receive() for _ in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        assert sum(c.credit for c in node.credits) >= 2  # returned once consumed
        await node.send("r1", Delta("d"), Complete())
        events = got + await drain_events(run)
        assert [type(e) for e in events] == [Start, Delta, Delta, Delta, Delta, Complete]
        assert "".join(e.text for e in events if isinstance(e, Delta)) == "abcd"


async def test_a_bad_token_is_refused_with_4401(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_edge_core(config()) as core, core.open_local_link() as chan:
        node = FakeNode(chan, token="wrong")  # type: ignore[arg-type]
        await chan.send(node.session.hello([caps()]))
        with pytest.raises(LinkClosed) as closed:
            await chan.receive()
        assert closed.value.close_code == CLOSE_BAD_TOKEN
        assert "refusing node from in-process: node 'n1' presented a bad token" in caplog.text
        assert core.registry.nodes == {}


async def test_a_hello_over_the_hello_limit_is_refused_with_1009(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = config()
    async with open_edge_core(cfg) as core, core.open_local_link() as chan:
        await chan.send(b"\0" * (cfg.link.max_hello_bytes + 1))
        with pytest.raises(LinkClosed) as closed:
            await chan.receive()
        assert closed.value.close_code == CLOSE_TOO_BIG
        assert core.registry.nodes == {}


async def test_a_frame_over_the_limit_after_the_hello_closes_the_link_with_1009(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config()
    async with open_edge_core(cfg) as core, core.open_local_link() as chan:
        node = FakeNode(chan)  # type: ignore[arg-type]
        await node.hello([caps()])
        await chan.send(frame(Ping(nonce=1)))  # within the limit: kept
        await chan.send(b"\0" * (cfg.link_frame_bytes + 1))
        with trio.fail_after(1.0):  # the close, at once (virtual time)
            await trio.testing.wait_all_tasks_blocked()
        assert chan.close_code == CLOSE_TOO_BIG
        assert "node n1 broke the protocol: frame of" in caplog.text
        assert core.registry.nodes == {}


async def test_an_end_left_unclosed_is_a_node_loss(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with open_edge_core(config()) as core:
        async with core.open_local_link() as chan:
            node = FakeNode(chan)  # type: ignore[arg-type]
            await node.hello([caps()])
            await trio.testing.wait_all_tasks_blocked()  # registered
            run = core.start_run(spec())
            (assigned,) = node.session.receive(await chan.receive(), trio.current_time())
            assert assigned.assign.run_id == "r1"  # type: ignore[union-attr]
            await node.send("r1", Start(), Delta("a"))
        # Left without a close, as a crashed dial task leaves its link.
        events = await drain_events(run)
        assert events[:2] == [Start(), Delta("a")]
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.NODE_LOST
        assert f"node n1 disconnected: lost ({CLOSE_DROPPED}" in caplog.text
        assert core.registry.nodes == {}


async def test_the_edge_drain_closes_it_with_1001(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with joined() as (core, node):
        await core.drain(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert node.closed is not None
        assert node.closed.close_code == CLOSE_GOING_AWAY
