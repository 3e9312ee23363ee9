"""Per-run credit on and off (``link.run_window``): a stalled reader and the runs beside it.

With credit (the default) a client that stops reading stops only its own
run; with ``run_window = 0`` its full channel holds the link's reader, and
every run on that node waits until it reads (head-of-line blocking), but
memory stays bounded and every run still ends exactly once.
"""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from iop.config import Deadlines, LinkSettings
from iop.edge.runs import RUN_BUFFER_WITHOUT_CREDIT
from iop.events import Cancelled, CancelReason, Complete, Delta, RuntimeEvent, Start
from iop.protocol import UNLIMITED_CREDIT
from iop.runtime import Run
from tests.edge.test_core import caps, config, drain_events, edge_with_node, spec

SLOW_EVENTS = 200  # far more than any window or buffer here


def link(run_window: int) -> LinkSettings:
    return LinkSettings(
        node_tokens=["node-token"],
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=1.5,
        run_window=run_window,
    )


def taken(run: Run) -> list[RuntimeEvent]:
    """What the run's consumer can take now, without waiting."""
    got: list[RuntimeEvent] = []
    while True:
        try:
            got.append(run.events.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return got


async def test_with_credit_a_stalled_reader_does_not_hold_the_other_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(config(link=link(4)), [caps(slots=2)]) as (core, node, nursery):
        slow = core.start_run(spec(run_id="slow"))
        await node.assigns.receive()
        fast = core.start_run(spec(run_id="fast"))
        await node.assigns.receive()
        # The slow run's node side has far more than its credit: only 4 go.
        nursery.start_soon(
            node.send, "slow", Start(), *[Delta(f"s{i}") for i in range(SLOW_EVENTS)]
        )
        await trio.testing.wait_all_tasks_blocked()
        assert node.session.backlog("slow") > 0
        await node.send("fast", Start(), Delta("f"), Complete())
        await trio.sleep(5.0)  # nobody reads the slow run meanwhile
        assert await drain_events(fast) == [Start(), Delta("f"), Complete()]
        assert "n1" in core.registry.nodes
        slow.cancel(CancelReason.CLIENT_DISCONNECT, "test over")
        assert isinstance(await slow.wait(), Cancelled)


async def test_without_credit_a_stalled_reader_holds_every_run_on_its_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = config(link=link(0))
    async with edge_with_node(cfg, [caps(slots=2)]) as (core, node, nursery):
        slow = core.start_run(spec(run_id="slow"))
        assign = await node.assigns.receive()
        assert assign.assign.credit == UNLIMITED_CREDIT
        fast = core.start_run(spec(run_id="fast"))
        await node.assigns.receive()
        slow_events = [Start(), *[Delta(f"s{i}") for i in range(SLOW_EVENTS)], Complete()]
        await node.send("slow", *slow_events)  # all of it goes: no credit holds it
        fast_sent = trio.Event()

        async def fast_node() -> None:
            await node.send("fast", Start(), Delta("f"), Complete())
            fast_sent.set()

        nursery.start_soon(fast_node)
        # Far longer than the link's heartbeat timeout: the edge holds the
        # link, it does not lose it.
        await trio.sleep(5.0)
        assert fast_sent.is_set()
        assert taken(fast) == []  # behind the slow run on the link
        assert "n1" in core.registry.nodes
        conn = core.registry.nodes["n1"]
        assert conn.held  # the reader waits
        assert node.credits == []  # and no credit ever went back
        # The slow run's channel holds at most its buffer: bounded memory.
        assert slow.events.statistics().current_buffer_used <= RUN_BUFFER_WITHOUT_CREDIT + 2
        # The slow client reads: everything flows, each run ends once.
        assert await drain_events(slow) == slow_events
        assert await drain_events(fast) == [Start(), Delta("f"), Complete()]
        assert core.snapshot()["outcomes"] == {"complete": 2}


async def test_without_credit_a_client_that_never_reads_is_cut_off_and_the_link_flows_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = config(link=link(0))
    cfg = msgspec.structs.replace(
        cfg,
        server=msgspec.structs.replace(cfg.server, write_stall_timeout_s=3.0),
        deadlines=Deadlines(first_token_timeout_s=30, idle_timeout_s=30, request_timeout_s=120),
    )
    async with edge_with_node(cfg, [caps(slots=2)]) as (core, node, nursery):
        slow = core.start_run(spec(run_id="slow"))
        await node.assigns.receive()
        fast = core.start_run(spec(run_id="fast"))
        await node.assigns.receive()
        nursery.start_soon(
            node.send, "slow", Start(), *[Delta(f"s{i}") for i in range(SLOW_EVENTS)]
        )
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(node.send, "fast", Start(), Delta("f"), Complete())
        # The slow client never reads: write_stall_timeout_s ends its run
        # (slow_client), the reader lets go, and the fast run completes.
        assert await drain_events(fast) == [Start(), Delta("f"), Complete()]
        outcome = await slow.wait()
        assert isinstance(outcome, Cancelled)
        assert outcome.reason is CancelReason.SLOW_CLIENT
        await trio.testing.wait_all_tasks_blocked()
        assert [c.cancel.reason for c in node.cancels] == [CancelReason.CLIENT_DISCONNECT]
        assert not core.registry.nodes["n1"].held
        assert "n1" in core.registry.nodes
