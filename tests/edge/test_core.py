"""The edge core over in-memory links, in virtual time: scheduling, credit,
cancellation, node loss, failover, liveness and drain. The node side is a
scripted ``NodeSession`` so every frame the edge sends can be checked."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities, ProviderStatus
from iop.config import Deadlines, EdgeConfig, LinkSettings, SchedulerSettings
from iop.edge import EdgeCore, open_edge_core
from iop.edge.scheduler import QueueExit
from iop.errors import IopError, RequestError
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, RuntimeEvent, Start
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_HEARTBEAT,
    CLOSE_ID_IN_USE,
    AssignReceived,
    CancelReceived,
    CreditReceived,
    LinkClosed,
    NodeMessage,
    NodeSession,
    Ping,
    Welcomed,
    encode,
    encode_batch,
)
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import MemoryFrameChannel, memory_link_pair

TOKEN = "node-token"


def config(**kw: object) -> EdgeConfig:
    link = LinkSettings(
        node_tokens=[TOKEN], heartbeat_interval_s=0.5, heartbeat_timeout_s=1.5, run_window=4
    )
    sched = SchedulerSettings(max_queue=2, queue_timeout_s=5.0)
    deadlines = Deadlines(first_token_timeout_s=30, idle_timeout_s=30, request_timeout_s=120)
    base = EdgeConfig(link=link, scheduler=sched, deadlines=deadlines)
    return msgspec.structs.replace(base, **kw)


def spec(model: str = "m", run_id: str = "r1") -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        request=ChatRequest(model=model, messages=[Message(role="user", content="hi")]),
    )


def caps(
    slots: int = 2, model: str = "m", status: ProviderStatus = ProviderStatus.AVAILABLE
) -> Capabilities:
    return Capabilities(
        adapter="sim",
        instance="i0",
        targets=(model,),
        max_concurrency=slots,
        provider_status=status,
    )


def frame(*messages: NodeMessage) -> bytes:
    """One link frame of ``messages``, written by hand (bypassing a session)."""
    return encode_batch([encode(m) for m in messages])


class FakeNode:
    """A node played by hand: a NodeSession over one end of a memory link."""

    def __init__(self, chan: MemoryFrameChannel, node_id: str = "n1", token: str = TOKEN) -> None:
        self.chan = chan
        self.session = NodeSession(node_id=node_id, token=token, now=trio.current_time())
        self.assigned: list[str] = []
        self.cancels: list[CancelReceived] = []
        self.credits: list[CreditReceived] = []
        self.inbox: trio.MemorySendChannel[AssignReceived]
        self.assigns: trio.MemoryReceiveChannel[AssignReceived]
        self.inbox, self.assigns = trio.open_memory_channel(16)
        self.closed: LinkClosed | None = None
        self.answer_pings = True

    async def hello(self, instances: list[Capabilities]) -> None:
        await self.chan.send(self.session.hello(instances))
        (welcomed,) = self.session.receive(await self.chan.receive(), trio.current_time())
        assert isinstance(welcomed, Welcomed)

    async def serve(self) -> None:
        """Read the edge's frames (and send a quiet node's heartbeat) until the link closes."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.keepalive)
            await self._read()
            nursery.cancel_scope.cancel()

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.chan.receive()
                for ev in self.session.receive(frame, trio.current_time()):
                    if isinstance(ev, AssignReceived):
                        self.assigned.append(ev.assign.run_id)
                        self.inbox.send_nowait(ev)
                    elif isinstance(ev, CancelReceived):
                        self.cancels.append(ev)
                    elif isinstance(ev, CreditReceived):
                        self.credits.append(ev)

        except LinkClosed as exc:
            self.closed = exc

    async def keepalive(self) -> None:
        """A quiet node's heartbeat (none when told not to answer, as if frozen)."""
        try:
            while True:
                await trio.sleep(config().link.heartbeat_interval_s)
                if self.answer_pings:
                    await self.chan.send(frame(Ping(nonce=0)))
        except LinkClosed:
            return

    async def send(self, run_id: str, *events: RuntimeEvent) -> None:
        """Queue ``events`` and send what the run's credit lets go."""
        for ev in events:
            self.session.push(run_id, ev)
        for frame in self.session.data_to_send(trio.current_time()):
            await self.chan.send(frame)


@asynccontextmanager
async def edge_with_node(
    cfg: EdgeConfig | None = None, instances: list[Capabilities] | None = None, node_id: str = "n1"
) -> AsyncIterator[tuple[EdgeCore, FakeNode, trio.Nursery]]:
    async with open_edge_core(cfg or config()) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, instances or [caps()], node_id)
        yield core, node, nursery
        nursery.cancel_scope.cancel()


async def connect(
    core: EdgeCore, nursery: trio.Nursery, instances: list[Capabilities], node_id: str
) -> FakeNode:
    edge_end, node_end = memory_link_pair()
    nursery.start_soon(core.handle_link, edge_end, "test")
    node = FakeNode(node_end, node_id)
    await node.hello(instances)
    nursery.start_soon(node.serve)
    await trio.testing.wait_all_tasks_blocked()
    return node


async def drain_events(run: Run) -> list[RuntimeEvent]:
    async with run.events:
        return [ev async for ev in run.events]


async def test_run_flows_through_the_node_with_credit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        assert [m.id for m in core.models()] == ["m"]
        run = core.start_run(spec())
        assign = await node.assigns.receive()
        assert assign.assign.instance == "i0"
        assert assign.assign.credit == 4
        await node.send("r1", Start(), Delta("a"), Delta("b"), Delta("c"))
        assert node.session.credit("r1") == 0  # Start counts too
        got = [await run.events.receive() for _ in range(4)]
        assert got == [Start(), Delta("a"), Delta("b"), Delta("c")]
        await trio.testing.wait_all_tasks_blocked()
        # Half a window consumed: the edge returned credit.
        assert sum(c.credit for c in node.credits) >= 2
        await node.send("r1", Delta("d"), Complete())
        assert await drain_events(run) == [Delta("d"), Complete()]
        assert core.snapshot()["outcomes"] == {"complete": 1}
        assert node.cancels == []


async def test_client_disconnect_sends_cancel_to_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))
        await run.events.receive()
        run.cancel(CancelReason.CLIENT_DISCONNECT, "client went away")
        outcome = await run.wait()
        assert isinstance(outcome, Cancelled)
        assert outcome.reason is CancelReason.CLIENT_DISCONNECT
        await trio.testing.wait_all_tasks_blocked()
        assert [c.cancel.reason for c in node.cancels] == [CancelReason.CLIENT_DISCONNECT]
        # The slot is free again.
        assert next(iter(core.registry.nodes["n1"].instances.values())).in_flight == 0


async def test_wait_timeout_cancels_with_its_reason(autojump_clock: trio.testing.MockClock) -> None:
    cfg = config(
        deadlines=Deadlines(first_token_timeout_s=3, idle_timeout_s=30, request_timeout_s=60)
    )
    async with edge_with_node(cfg) as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start())
        events = await drain_events(run)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.FIRST_TOKEN_TIMEOUT
        await trio.testing.wait_all_tasks_blocked()
        assert [c.cancel.reason for c in node.cancels] == [CancelReason.FIRST_TOKEN_TIMEOUT]


async def test_node_lost_mid_stream_ends_the_run(autojump_clock: trio.testing.MockClock) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))
        await node.chan.aclose()
        events = await drain_events(run)
        assert events[:2] == [Start(), Delta("a")]
        last = events[-1]
        assert isinstance(last, Cancelled)
        assert last.reason is CancelReason.NODE_LOST
        assert "n1" in last.message
        assert core.registry.nodes == {}


async def test_frozen_node_is_detected_within_two_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))
        frozen_at = trio.current_time()
        node.chan.freeze()
        events = await drain_events(run)
        last = events[-1]
        assert isinstance(last, Cancelled)
        assert last.reason is CancelReason.NODE_LOST
        assert "heartbeat" in last.message
        assert trio.current_time() - frozen_at <= 2.0
        assert node.chan.close_code == CLOSE_HEARTBEAT


async def test_failover_before_first_output(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        run = core.start_run(spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.chan.aclose()  # lost before any output
        await other.assigns.receive()
        await other.send("r1", Start(), Delta("x"), Complete())
        events = await drain_events(run)
        assert events == [Start(), Delta("x"), Complete()]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "refusal",
    [
        Error(message="busy", status=429, code="queue_full"),
        Error(message="draining", status=503, code="node_draining"),
        Error(message="no such instance", status=404, code="unknown_instance"),
        Error(message="down", status=503, code="backend_unavailable"),
        Cancelled(reason=CancelReason.QUEUE_TIMEOUT, message="no free slot"),
    ],
    ids=lambda ev: getattr(ev, "code", "") or str(ev.reason),
)
async def test_node_error_before_start_fails_over(
    autojump_clock: trio.testing.MockClock, refusal: RuntimeEvent
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        run = core.start_run(spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.send("r1", refusal)
        await other.assigns.receive()
        await other.send("r1", Start(), Complete())
        assert await drain_events(run) == [Start(), Complete()]
        nursery.cancel_scope.cancel()


async def test_the_log_says_whether_a_failed_attempt_fails_over(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator reading "failing over" expects another attempt; with the
    model's only node excluded, the log says the run gives up instead."""
    busy = Error(message="busy", status=429, code="queue_full")
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        run = core.start_run(spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.send("r1", busy)
        await other.assigns.receive()
        await other.send("r1", busy)
        assert (await drain_events(run))[-1] == busy
        nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if "failed before output" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].endswith("; failing over"), said
    assert said[1].endswith("; no other instance serves the model, giving up"), said


async def test_non_retryable_node_error_is_the_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send(
            "r1",
            Start(),
            Error(message="vllm returned 400: too long", status=400, code="backend_http_error"),
        )
        events = await drain_events(run)
        assert events[-1] == Error(
            message="vllm returned 400: too long", status=400, code="backend_http_error"
        )


async def test_queue_waits_for_a_slot_then_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(instances=[caps(slots=1)]) as (core, node, _):
        r1 = core.start_run(spec(run_id="r1"))
        await node.assigns.receive()
        r2 = core.start_run(spec(run_id="r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert core.scheduler.queued == 1
        await node.send("r1", Start(), Complete())
        await drain_events(r1)
        # r1's slot went to r2.
        assign = await node.assigns.receive()
        assert assign.assign.run_id == "r2"
        r3 = core.start_run(spec(run_id="r3"))
        events = await drain_events(r3)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.QUEUE_TIMEOUT
        await node.send("r2", Start(), Complete())
        await drain_events(r2)


async def test_each_way_out_of_the_queue_is_counted_with_the_time_of_the_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The exits by how, and the last one's time on the host's monotonic clock
    (not trio's, which here is the virtual clock): what /admin/nodes and
    /metrics show, and what bench_stress.py times a queued cancel with."""
    async with edge_with_node(instances=[caps(slots=1)]) as (core, node, _):
        sched = core.scheduler
        assert core.snapshot()["queue"] == {
            "exits": {"placed": 0, "cancelled": 0, "timed_out": 0, "shed": 0, "load_failed": 0},
            "last_exit": None,
            "refused": {"queue_full": 0, "queue_delay": 0, "deadline": 0, "shed": 0},
            "preempted": 0,
            "priority_overflows": 0,
            "sessions": {"seen": 0, "queued": 0, "overflowed": 0},
        }
        r1 = core.start_run(spec(run_id="r1"))
        await node.assigns.receive()
        r2 = core.start_run(spec(run_id="r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert sched.queued == 1
        before = time.monotonic()
        r2.cancel(CancelReason.CLIENT_DISCONNECT)
        await r2.wait()
        after = time.monotonic()
        assert sched.queued == 0
        assert sched.last_exit is not None
        assert sched.last_exit.how is QueueExit.CANCELLED
        assert before <= sched.last_exit.monotonic_s <= after
        view = core.snapshot()["queue"]
        assert view["exits"] == {
            "placed": 0,
            "cancelled": 1,
            "timed_out": 0,
            "shed": 0,
            "load_failed": 0,
        }
        assert view["last_exit"] == {
            "how": "cancelled",
            "monotonic_s": sched.last_exit.monotonic_s,
        }
        r3 = core.start_run(spec(run_id="r3"))
        await trio.testing.wait_all_tasks_blocked()
        await node.send("r1", Start(), Complete())
        await drain_events(r1)
        assert (await node.assigns.receive()).assign.run_id == "r3"
        assert sched.last_exit.how is QueueExit.PLACED
        r4 = core.start_run(spec(run_id="r4"))
        assert isinstance((await drain_events(r4))[-1], Cancelled)  # queue_timeout_s
        assert sched.last_exit.how is QueueExit.TIMED_OUT
        assert sched.exits == {
            QueueExit.PLACED: 1,
            QueueExit.CANCELLED: 1,
            QueueExit.TIMED_OUT: 1,
            QueueExit.SHED: 0,
            QueueExit.LOAD_FAILED: 0,
        }
        text = core.metrics.render().decode()
        for how in ("placed", "cancelled", "timed_out"):
            assert f'iop_queue_exits_total{{how="{how}"}} 1.0' in text
        await node.send("r3", Start(), Complete())
        await drain_events(r3)


async def test_queue_full_is_429_up_front(autojump_clock: trio.testing.MockClock) -> None:
    async with edge_with_node(instances=[caps(slots=1)]) as (core, node, _):
        runs = [core.start_run(spec(run_id=f"r{i}")) for i in range(3)]  # 1 running + 2 queued
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(IopError) as info:
            core.start_run(spec(run_id="r9"))
        assert info.value.status == 429
        assert info.value.code == "queue_full"
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
        for r in runs:
            await r.wait()
        del node


async def test_a_run_that_would_wait_too_long_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``scheduler.max_queue_delay_s``: the queue's drain rate predicts a newcomer's wait."""
    sched = SchedulerSettings(max_queue=100, max_queue_delay_s=5.0, queue_timeout_s=60.0)
    async with edge_with_node(config(scheduler=sched), [caps(slots=1)]) as (core, node, nursery):
        r1 = core.start_run(spec(run_id="r1"))
        await node.assigns.receive()
        r2 = core.start_run(spec(run_id="r2"))  # nothing waited yet: a burst is let in
        await trio.sleep(3)
        # r2 has waited 3 s and nothing left the queue: r3 would wait about 3 s.
        assert 2.9 < core.scheduler.queue_delay("m") < 3.1
        r3 = core.start_run(spec(run_id="r3"))
        await trio.sleep(2)
        # Two waiters, the oldest waited 5 s for nothing: about 10 s for a newcomer
        # (the oldest one's own 5 s understates a queue that grows).
        assert 9.9 < core.scheduler.queue_delay("m") < 10.1
        with pytest.raises(IopError) as info:
            core.start_run(spec(run_id="r4"))
        assert (info.value.status, info.value.code) == (429, "queue_full")
        assert "max_queue_delay_s=5" in info.value.message
        assert core.scheduler.queued == 2
        # Another model on another node is not behind: it starts.
        other = await connect(core, nursery, [caps(model="m2")], "n2")
        r5 = core.start_run(spec(model="m2", run_id="r5"))
        await other.assigns.receive()
        # The slot frees: r2 takes it, r3 (one ahead of it when it came, 2 s ago)
        # is now the oldest and a newcomer would wait about 2 s: admitted again.
        await node.send("r1", Start(), Complete())
        await drain_events(r1)
        assert (await node.assigns.receive()).assign.run_id == "r2"
        assert core.scheduler.queue_delay("m") < 5.0
        r6 = core.start_run(spec(run_id="r6"))
        await trio.testing.wait_all_tasks_blocked()
        assert core.scheduler.queued == 2
        for r in (r2, r3, r5, r6):
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await r.wait()


async def test_max_queue_delay_zero_lets_the_queue_fill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sched = SchedulerSettings(max_queue=3, max_queue_delay_s=0.0, queue_timeout_s=60.0)
    async with edge_with_node(config(scheduler=sched), [caps(slots=1)]) as (core, node, _):
        runs = [core.start_run(spec(run_id="r0"))]
        await node.assigns.receive()
        for i in range(1, 4):
            runs.append(core.start_run(spec(run_id=f"r{i}")))
            await trio.sleep(5)  # (r0 hits its 30 s first-token deadline at t=30)
        assert core.scheduler.queued == 3
        with pytest.raises(IopError) as info:
            core.start_run(spec(run_id="r9"))
        assert "queue is full (3 waiting)" in info.value.message
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await r.wait()


async def test_free_slots_go_to_waiters_in_arrival_order_across_models(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One instance serving two models: waiters of both are served first come, first served."""
    two = Capabilities(adapter="sim", instance="i0", targets=("m", "m2"), max_concurrency=1)
    sched = SchedulerSettings(max_queue=10, queue_timeout_s=60.0)
    async with edge_with_node(config(scheduler=sched), [two]) as (core, node, _):
        first = core.start_run(spec(run_id="r0"))
        await node.assigns.receive()
        order = ["r1", "r2", "r3", "r4"]
        models = {"r1": "m2", "r2": "m", "r3": "m2", "r4": "m"}
        runs = {}
        for rid in order:  # one at a time: trio runs new tasks in any order
            runs[rid] = core.start_run(spec(model=models[rid], run_id=rid))
            await trio.testing.wait_all_tasks_blocked()
        assert core.scheduler.queued == 4
        await node.send("r0", Start(), Complete())
        await drain_events(first)
        for rid in order:
            assert (await node.assigns.receive()).assign.run_id == rid
            await node.send(rid, Start(), Complete())
            await drain_events(runs[rid])
        assert core.scheduler.queued == 0


async def test_unknown_model_is_404_and_no_node_is_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core:
        with pytest.raises(RequestError) as info:
            core.start_run(spec())
        assert info.value.status == 503
    async with edge_with_node() as (core, _, _):
        with pytest.raises(RequestError) as info:
            core.start_run(spec(model="nope"))
        assert info.value.status == 404
        assert info.value.param == "model"


async def test_unavailable_instance_is_not_served(autojump_clock: trio.testing.MockClock) -> None:
    async with edge_with_node(instances=[caps(status=ProviderStatus.UNAVAILABLE)]) as (core, _, _):
        assert core.models() == []


async def test_a_model_no_instance_can_take_is_503_naming_instance_and_cause(
    autojump_clock: trio.testing.MockClock,
) -> None:
    refused = "request failed: connection refused by 127.0.0.1:8000"
    never_up = Capabilities(
        adapter="vllm",
        instance="q",
        provider_status=ProviderStatus.UNAVAILABLE,
        provider_detail=refused,
    )
    # Down since the node started: no model listed, so any model might be its.
    async with edge_with_node(instances=[never_up]) as (core, _, _):
        with pytest.raises(RequestError) as info:
            core.start_run(spec(model="anything"))
    assert (info.value.status, info.value.code) == (503, "model_unavailable")
    assert f"instance n1/q (its models are unknown) is unavailable: {refused}" in info.value.message
    # Listed its model before going down (an old node sends no detail).
    async with edge_with_node(instances=[caps(status=ProviderStatus.UNAVAILABLE)]) as (core, _, _):
        with pytest.raises(RequestError) as info:
            core.start_run(spec(model="m"))
        assert "instance n1/i0 is unavailable: no reason given" in info.value.message
        # A model nobody lists, with every instance's models known: unknown.
        with pytest.raises(RequestError) as info:
            core.start_run(spec(model="nope"))
        assert (info.value.status, info.value.code) == (404, "model_not_found")


async def test_bad_token_is_refused_with_4401(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "10.0.0.9")
        node = FakeNode(node_end, token="wrong")
        await node_end.send(node.session.hello([caps()]))
        with pytest.raises(LinkClosed):
            await node_end.receive()
        assert node_end.close_code == CLOSE_BAD_TOKEN
        assert "bad token" in node_end.close_reason
        assert "refusing node from 10.0.0.9" in caplog.text
        assert core.registry.nodes == {}


async def test_a_live_node_id_is_not_taken_over(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/protocol.md "Refusals and close codes": 4410 for a second
    connection with the id of a live node; the live node's runs go on."""
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        old = await connect(core, nursery, [caps()], "n1")
        run = core.start_run(spec())
        await old.assigns.receive()
        await old.send("r1", Start(), Delta("a"))
        live = core.registry.nodes["n1"]
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "10.0.0.7:4242")
        intruder = FakeNode(node_end, "n1")
        await node_end.send(intruder.session.hello([caps()]))
        with pytest.raises(LinkClosed):
            await node_end.receive()
        assert node_end.close_code == CLOSE_ID_IN_USE
        assert "in use by a live link" in node_end.close_reason
        assert "refusing node from 10.0.0.7:4242: node id 'n1' is in use" in caplog.text
        await old.send("r1", Delta("b"), Complete())
        assert await drain_events(run) == [Start(), Delta("a"), Delta("b"), Complete()]
        assert core.registry.nodes["n1"] is live
        assert old.closed is None
        nursery.cancel_scope.cancel()


async def test_a_dead_link_gives_its_id_to_the_reconnecting_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        old = await connect(core, nursery, [caps()], "n1")
        run = core.start_run(spec())
        await old.assigns.receive()
        await old.send("r1", Start(), Delta("a"))
        old.chan.freeze()  # a node that vanished without a FIN
        await trio.sleep(2.0)  # past heartbeat_timeout_s (1.5 s)
        new = await connect(core, nursery, [caps()], "n1")
        events = await drain_events(run)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.NODE_LOST
        assert len(core.registry.nodes) == 1
        assert new.closed is None
        nursery.cancel_scope.cancel()


async def test_drain_lets_runs_finish_then_cancels(autojump_clock: trio.testing.MockClock) -> None:
    async with edge_with_node() as (core, node, nursery):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))

        async def consume() -> list[RuntimeEvent]:
            return await drain_events(run)

        nursery.start_soon(consume)
        await core.drain(timeout_s=2.0)
        assert isinstance(run.outcome, Cancelled)
        assert run.outcome.reason is CancelReason.SHUTDOWN
        with pytest.raises(RequestError) as info:
            core.start_run(spec(run_id="r2"))
        assert info.value.status == 503


async def test_failover_after_start_but_before_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Adapters send Start before they call their backend: a node lost during
    # prefill has produced nothing yet, so the run moves to another node and
    # the client sees one Start.
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        run = core.start_run(spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.send("r1", Start(target="m"))
        await trio.testing.wait_all_tasks_blocked()
        await first.chan.aclose()
        await other.assigns.receive()
        await other.send("r1", Start(target="m"), Delta("x"), Complete())
        assert await drain_events(run) == [Start(target="m"), Delta("x"), Complete()]
        nursery.cancel_scope.cancel()


async def test_no_other_node_reports_the_error_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        err = Error(message="connection refused", status=503, code="backend_unavailable")
        await node.send("r1", Start(), err)
        started = trio.current_time()
        events = await drain_events(run)
        assert events == [Start(), err]
        assert trio.current_time() - started < 1  # no wait for a queue timeout


def conversation(
    first_user: str, turns: int = 0, run_id: str = "r", user: str | None = None
) -> ExecutionSpec:
    msgs = [
        Message(role="system", content="You are helpful."),
        Message(role="user", content=first_user),
    ]
    for i in range(turns):
        msgs += [Message(role="assistant", content=f"a{i}"), Message(role="user", content=f"u{i}")]
    return ExecutionSpec(run_id=run_id, request=ChatRequest(model="m", messages=msgs, user=user))


async def test_affinity_sends_a_conversation_back_to_its_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=4)], "a")
        b = await connect(core, nursery, [caps(slots=4)], "b")
        nodes = {"a": a, "b": b}

        async def serve_one(spec_: ExecutionSpec) -> str:
            run = core.start_run(spec_)
            await trio.testing.wait_all_tasks_blocked()
            (name,) = [n for n, node in nodes.items() if spec_.run_id in node.assigned]
            await nodes[name].assigns.receive()
            await nodes[name].send(spec_.run_id, Start(), Complete())
            await drain_events(run)
            return name

        first = await serve_one(conversation("plan a trip", run_id="t0"))
        # Make `first` the busier node: least-loaded placement now prefers the
        # other one, as a new conversation shows...
        inst = core.registry.nodes[first].instances["i0"]
        inst.in_flight += 2
        assert await serve_one(conversation("something else", run_id="n0")) != first
        # ...but later turns of the first conversation (same head) go back to
        # the instance that served it, which still has free slots.
        for turn in range(1, 4):
            again = await serve_one(conversation("plan a trip", turns=turn, run_id=f"t{turn}"))
            assert again == first
        inst.in_flight -= 2
        # The client's `user` field is an explicit session key.
        u1 = await serve_one(conversation("x", run_id="u1", user="alice"))
        assert await serve_one(conversation("y", run_id="u2", user="alice")) == u1
        nursery.cancel_scope.cancel()


async def test_affinity_yields_to_a_full_instance(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        r0 = core.start_run(conversation("same", run_id="r0"))
        await trio.testing.wait_all_tasks_blocked()
        busy, other = (a, b) if a.assigned else (b, a)
        # Same conversation while its instance is busy: the other node serves it.
        r1 = core.start_run(conversation("same", turns=1, run_id="r1"))
        await trio.testing.wait_all_tasks_blocked()
        assert "r1" in other.assigned
        for node, rid, run in ((busy, "r0", r0), (other, "r1", r1)):
            await node.assigns.receive()
            await node.send(rid, Start(), Complete())
            await drain_events(run)
        nursery.cancel_scope.cancel()


def test_affinity_key_is_the_conversation_head() -> None:
    from iop.edge.scheduler import affinity_key

    k = affinity_key(conversation("hello").request)
    assert affinity_key(conversation("hello", turns=3).request) == k
    assert affinity_key(conversation("other").request) != k
    assert affinity_key(conversation("hello", user="bob").request).startswith("user:")


async def test_affinity_memory_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    cfg = config(scheduler=SchedulerSettings(max_queue=2, queue_timeout_s=5.0, affinity_entries=3))
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        node = await connect(core, nursery, [caps(slots=8)], "n1")
        for i in range(6):
            run = core.start_run(conversation(f"c{i}", run_id=f"r{i}"))
            await node.assigns.receive()
            await node.send(f"r{i}", Start(), Complete())
            await drain_events(run)
        assert len(core.scheduler.placement._affinity) == 3
        nursery.cancel_scope.cancel()


async def test_a_revoked_credential_closes_its_links_and_admits_no_new_one(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iop.edge")

    def digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    a, b = "token-of-node-a-0123456789", "token-of-node-b-0123456789"
    nodes = [
        {"name": "gpu-a", "token_sha256": digest(a)},
        {"name": "gpu-b", "token_sha256": digest(b)},
    ]
    cfg = msgspec.convert({"link": {"node_tokens": [TOKEN], "nodes": nodes}}, EdgeConfig)
    async with open_edge_core(cfg) as core, trio.open_nursery() as nursery:
        links = {}
        for node_id, token in (("na", a), ("nb", b), ("shared", TOKEN)):
            edge_end, node_end = memory_link_pair()
            nursery.start_soon(core.handle_link, edge_end, node_id)
            node = FakeNode(node_end, node_id, token=token)
            await node.hello([caps()])
            nursery.start_soon(node.serve)
            links[node_id] = node
        await trio.testing.wait_all_tasks_blocked()
        assert set(core.registry.nodes) == {"na", "nb", "shared"}
        assert "node na connected from na with credential gpu-a" in caplog.text
        # gpu-a revoked (a reload without its table): its link closes, alone.
        revoked = msgspec.convert(
            {"link": {"node_tokens": [TOKEN], "nodes": nodes[1:]}}, EdgeConfig
        )
        core.set_node_credentials(revoked.link)
        await trio.testing.wait_all_tasks_blocked()
        assert set(core.registry.nodes) == {"nb", "shared"}
        assert links["na"].closed is not None
        assert links["na"].closed.close_code == CLOSE_BAD_TOKEN
        assert "credential gpu-a revoked" in caplog.text
        # ... and its token admits no new link.
        edge_end, node_end = memory_link_pair()
        nursery.start_soon(core.handle_link, edge_end, "na-again")
        again = FakeNode(node_end, "na", token=a)
        await node_end.send(again.session.hello([caps()]))
        with pytest.raises(LinkClosed):
            await node_end.receive()
        assert node_end.close_code == CLOSE_BAD_TOKEN
        nursery.cancel_scope.cancel()
