"""The node under an edge with per-run credit off (``UNLIMITED_CREDIT``): still bounded.

No credit stops the adapter, so what does is the link: a run may have at
most ``node.run_backlog`` events queued that the writer has not sent, and
the writer waits for the link's flow control.
"""

from __future__ import annotations

import trio
import trio.testing

from iop.adapters import SimAdapter
from iop.errors import LinkError
from iop.events import CancelReason
from iop.protocol import UNLIMITED_CREDIT
from iop.testing._memory_link import memory_link_pair
from tests.node.test_agent import EDGE, FakeEdge, assert_grammar, running_node, sim

BACKLOG = 8


async def test_without_credit_a_node_whose_edge_stops_reading_stops_its_backend(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = SimAdapter(sim(output_tokens=100_000))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}, run_backlog=BACKLOG) as agent,
        trio.open_nursery() as nursery,
    ):
        edge_chan, node_chan = memory_link_pair()
        edge = FakeEdge(edge_chan)

        async def serve() -> None:
            try:
                await agent.serve_link(node_chan, edge=EDGE)
            except LinkError as exc:
                edge.node_error = exc
            finally:
                edge.node_done.set()

        nursery.start_soon(serve)
        await edge.handshake()
        nursery.start_soon(edge.pinger)  # alive, but it reads nothing
        await edge.assign("r1", credit=UNLIMITED_CREDIT)
        await trio.sleep(3.0)
        # The link's buffer is full and the writer waits on it: the adapter
        # waits too, far from the end of its 100,000 tokens.
        (link,) = agent._links
        assert adapter.active_runs == 1
        assert link.session.unsent("r1") <= BACKLOG
        assert edge.node_error is None
        # The edge reads again and gives up on the run: it ends once, early.
        edge.start(nursery, ping=False)
        await edge.cancel("r1", CancelReason.CLIENT_DISCONNECT)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert len(events) < 100_000
        await edge.close()
