"""Node-side admission seen from the edge: real edges and real nodes over
in-memory links, in virtual time.

Several edges may share a node: an edge's own count of a node's runs then
says nothing about the runs the other edges put there, and the node's own
slots (``iop.node._slots``) are the authority. A run the node cannot take
comes back to the edge as a typed refusal (``queue_full``, its queue
timeout, ``node_draining``, ``unknown_instance``) before any output, and the
edge fails it over to a node with room.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from iop.config import (
    Deadlines,
    EdgeConfig,
    LinkSettings,
    NodeConfig,
    NodeEdge,
    NodeSection,
    SchedulerSettings,
    SimConfig,
    SimInstance,
)
from iop.edge import EdgeCore, open_edge_core
from iop.errors import RETRYABLE_CANCEL_REASONS, RETRYABLE_CODES, ErrorCode, LinkError
from iop.events import Cancelled, CancelReason, Complete, Error, RuntimeEvent
from iop.node import NodeAgent, open_node_agent
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import memory_link_pair

TOKEN = "node-token"
EDGE = NodeEdge(url="ws://edge.test/v1/link", token=TOKEN)
MODEL = "iop-sim"


def edge_config(**scheduler: object) -> EdgeConfig:
    link = LinkSettings(node_tokens=[TOKEN], heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5)
    sched = msgspec.convert({"queue_timeout_s": 20.0, **scheduler}, SchedulerSettings)
    deadlines = Deadlines(first_token_timeout_s=60, idle_timeout_s=60, request_timeout_s=300)
    return EdgeConfig(link=link, scheduler=sched, deadlines=deadlines)


def sim(**kw: object) -> SimInstance:
    """One slot; a run streams 100 tokens at 10/s (10 s) unless told otherwise."""
    cfg = {"name": "sim", "max_concurrency": 1, "max_queue": 0, "queue_timeout_s": 1.0, **kw}
    cfg.setdefault("sim", SimConfig(ttft_s=0.0, output_tokens=100, tokens_per_s=10))
    return msgspec.convert(cfg, SimInstance, from_attributes=True)


def spec(run_id: str, output_tokens: int | None = None) -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        request=ChatRequest(
            model=MODEL,
            messages=[Message(role="user", content=f"hello from {run_id}")],
            max_tokens=output_tokens,
        ),
    )


@asynccontextmanager
async def node(node_id: str, instance: SimInstance, **section: object) -> AsyncIterator[NodeAgent]:
    settings = msgspec.convert(
        {"id": node_id, "edges": [msgspec.to_builtins(EDGE)], **section}, NodeSection
    )
    async with open_node_agent(NodeConfig(node=settings, instances=[instance])) as agent:
        yield agent


async def attach(nursery: trio.Nursery, core: EdgeCore, agent: NodeAgent) -> None:
    """Link ``agent`` to ``core`` in memory, as a node dials an edge."""
    edge_end, node_end = memory_link_pair()
    nursery.start_soon(core.handle_link, edge_end, "memory")

    async def serve() -> None:
        with contextlib.suppress(LinkError):  # the test's nursery ends the link
            await agent.serve_link(node_end, edge=EDGE)

    nursery.start_soon(serve)
    await trio.testing.wait_all_tasks_blocked()


async def drain(run: Run) -> list[RuntimeEvent]:
    async with run.events:
        return [ev async for ev in run.events]


async def occupy(nursery: trio.Nursery, other: EdgeCore, run_id: str) -> Run:
    """A long run through another edge: it takes the shared node's only slot."""
    run = other.start_run(spec(run_id))
    await trio.testing.wait_all_tasks_blocked()
    return run


@pytest.mark.parametrize(
    ("instance", "refusal"),
    [
        # IopError 429 queue_full, and Cancelled(queue_timeout) (iop/node/_slots.py).
        pytest.param(sim(max_queue=0), "instance busy", id="queue-full"),
        pytest.param(sim(max_queue=4, queue_timeout_s=1.0), "no free slot", id="queue-timeout"),
    ],
)
async def test_a_node_full_with_another_edges_runs_refuses_and_the_edge_fails_over(
    autojump_clock: trio.testing.MockClock, instance: SimInstance, refusal: str
) -> None:
    # Load reports off: the edge knows nothing of the other edge's run, and
    # places on the shared node first (it registered first).
    async with (
        open_edge_core(edge_config()) as mine,
        open_edge_core(edge_config()) as theirs,
        node("shared", instance, load_reports_per_s=0) as shared,
        node("spare", sim(), load_reports_per_s=0) as spare,
        trio.open_nursery() as nursery,
    ):
        await attach(nursery, theirs, shared)
        await attach(nursery, mine, shared)
        await attach(nursery, mine, spare)
        busy = await occupy(nursery, theirs, "theirs-1")
        run = mine.start_run(spec("mine-1", output_tokens=3))
        events = await drain(run)
        assert isinstance(events[-1], Complete)
        tried = [(p.node, p.result or "") for p in run.timeline.placements]
        assert [n for n, _ in tried] == ["shared", "spare"]
        assert tried[0][1].startswith("retry:")
        assert refusal in tried[0][1]
        busy.cancel(CancelReason.EXPLICIT)
        await drain(busy)
        nursery.cancel_scope.cancel()


async def test_with_no_other_node_the_nodes_refusal_is_the_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_edge_core(edge_config()) as mine,
        open_edge_core(edge_config()) as theirs,
        node("shared", sim(max_queue=4, queue_timeout_s=1.0), load_reports_per_s=0) as shared,
        trio.open_nursery() as nursery,
    ):
        await attach(nursery, theirs, shared)
        await attach(nursery, mine, shared)
        busy = await occupy(nursery, theirs, "theirs-1")
        events = await drain(mine.start_run(spec("mine-1")))
        assert len(events) == 1, events
        assert isinstance(events[0], Cancelled)
        assert events[0].reason is CancelReason.QUEUE_TIMEOUT
        busy.cancel(CancelReason.EXPLICIT)
        await drain(busy)
        nursery.cancel_scope.cancel()


def test_refusal_codes_are_retryable() -> None:
    assert {ErrorCode.QUEUE_FULL, ErrorCode.NODE_DRAINING, ErrorCode.UNKNOWN_INSTANCE} <= set(
        RETRYABLE_CODES
    )
    assert CancelReason.QUEUE_TIMEOUT in RETRYABLE_CANCEL_REASONS
    assert Error(message="x", code="queue_full").code in RETRYABLE_CODES
