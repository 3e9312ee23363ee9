"""The node agent over in-memory links, in virtual time.

The test plays the edge by hand with ``iop.protocol.EdgeSession`` (which also
checks that the node keeps to the protocol: credit, sequence numbers, one
terminal event); the node is a real ``NodeAgent`` with ``SimAdapter``
instances.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import pytest
import trio
import trio.testing

from iop.adapters import Adapter, SimAdapter, VllmAdapter
from iop.capabilities import Capabilities, ProbeResult, ProviderStatus
from iop.config import (
    Deadlines,
    InstanceConfig,
    NodeConfig,
    NodeEdge,
    NodeSection,
    SimConfig,
    SimInstance,
    VllmInstance,
)
from iop.errors import BackendError, LinkError, RunAborted
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    Error,
    RuntimeEvent,
    Start,
    is_terminal,
)
from iop.node import NodeAgent, open_node_agent
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    CLOSE_ID_IN_USE,
    CLOSE_NORMAL,
    CLOSE_TOO_BIG,
    EDGE_SILENCE_FACTOR,
    RUN_BACKLOG,
    CapabilitiesChanged,
    Credit,
    EdgeSession,
    Hello,
    LinkClosed,
    NodeDraining,
    NodeJoined,
    Ping,
    RunEvents,
    decode_node_batch,
    encode,
    encode_batch,
)
from iop.runtime import EventSender
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import CHAT_COMPLETIONS_PATH, MODELS_PATH, FakeTransport, RecordedRequest, Reply
from iop.testing._memory_link import MemoryFrameChannel, memory_link_pair

TOKEN = "s3cret-token"
EDGE = NodeEdge(url="ws://edge.test/v1/link", token=TOKEN)
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 1.5


def spec(run_id: str, **request: object) -> ExecutionSpec:
    return ExecutionSpec(
        run_id=run_id,
        request=ChatRequest(
            model="iop-sim",
            messages=[Message(role="user", content=f"hello from {run_id}")],
            **request,  # type: ignore[arg-type]
        ),
    )


INSTANCE_KEYS = {"max_concurrency", "max_queue", "queue_timeout_s", "deadlines", "targets"}


def sim(name: str = "sim", **kw: object) -> SimInstance:
    """A sim instance; keys of ``SimConfig`` go to ``sim``, the others to the instance."""
    sim_cfg: dict[str, object] = {"ttft_s": 0.0, "output_tokens": 8}
    sim_cfg.update({k: v for k, v in kw.items() if k not in INSTANCE_KEYS})
    inst = {k: v for k, v in kw.items() if k in INSTANCE_KEYS}
    return msgspec.convert(
        {"name": name, "sim": msgspec.convert(sim_cfg, SimConfig), **inst},
        SimInstance,
        from_attributes=True,
    )


class FakeEdge:
    """The edge's end of one memory link, played with ``EdgeSession``.

    ``pump`` reads every frame, feeds it to the session (which raises if the
    node breaks the protocol) and records each run's events as *sent* (also
    those of runs the session already let go of, e.g. after a Cancel).
    """

    def __init__(self, chan: MemoryFrameChannel, *, tokens: Sequence[str] = (TOKEN,)) -> None:
        self.chan = chan
        self.session = EdgeSession(
            tokens=tokens,
            heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            now=trio.current_time(),
        )
        self.hello: Hello | None = None
        self.events: dict[str, list[RuntimeEvent]] = {}
        self.frames: dict[str, int] = {}
        self.largest_frame = 0
        self.finished: dict[str, trio.Event] = {}
        self.caps_updates: list[list[Capabilities]] = []
        self.draining = trio.Event()
        self.progress = trio.Event()
        self.closed: LinkClosed | None = None
        self.node_error: LinkError | None = None
        self.node_done = trio.Event()

    async def handshake(self) -> Hello:
        (event,) = self.session.receive(await self.chan.receive(), trio.current_time())
        assert isinstance(event, NodeJoined)
        await self.chan.send(self.session.welcome())
        self.hello = event.hello
        return event.hello

    def start(self, nursery: trio.Nursery, *, ping: bool = True) -> None:
        nursery.start_soon(self.pump)
        if ping:
            nursery.start_soon(self.pinger)

    async def pump(self) -> None:
        try:
            while True:
                frame = await self.chan.receive()
                for msg in decode_node_batch(frame):
                    if isinstance(msg, RunEvents):
                        self.events.setdefault(msg.run_id, []).extend(msg.events)
                        self.frames[msg.run_id] = self.frames.get(msg.run_id, 0) + 1
                        self.largest_frame = max(self.largest_frame, len(msg.events))
                        if msg.events and is_terminal(msg.events[-1]):
                            self._finished(msg.run_id).set()
                for event in self.session.receive(frame, trio.current_time()):
                    if isinstance(event, CapabilitiesChanged):
                        self.caps_updates.append(event.instances)
                    elif isinstance(event, NodeDraining):
                        self.draining.set()
                await self.flush()  # pongs to the node's pings
                self.progress.set()
                self.progress = trio.Event()
        except LinkClosed as exc:
            self.closed = exc

    async def pinger(self) -> None:
        try:
            while True:
                await self.chan.send(encode_batch([encode(Ping(nonce=0))]))
                await trio.sleep(HEARTBEAT_INTERVAL_S)
        except LinkClosed:
            return

    async def flush(self) -> None:
        """Send what the session queued."""
        for frame in self.session.data_to_send(trio.current_time()):
            await self.chan.send(frame)

    def _finished(self, run_id: str) -> trio.Event:
        return self.finished.setdefault(run_id, trio.Event())

    async def assign(
        self,
        run_id: str,
        instance: str = "sim",
        credit: int = 64,
        *,
        collect: bool = False,
        **request: object,
    ) -> None:
        self.session.assign(run_id, instance, spec(run_id, **request), credit, collect=collect)
        await self.flush()

    async def grant(self, run_id: str, credit: int) -> None:
        """Give the run ``credit`` by hand (the session returns half windows)."""
        run = self.session.run(run_id)
        assert run is not None
        run.credit += credit
        await self.chan.send(encode_batch([encode(Credit(run_id=run_id, credit=credit))]))

    async def cancel(self, run_id: str, reason: CancelReason) -> None:
        assert self.session.cancel(run_id, reason, "cancelled by the test")
        await self.flush()

    async def wait_finished(self, run_id: str) -> list[RuntimeEvent]:
        await self._finished(run_id).wait()
        return self.events[run_id]

    async def wait_events(self, run_id: str, n: int) -> None:
        while len(self.events.get(run_id, ())) < n:
            await self.progress.wait()

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        await self.chan.aclose(code, reason)
        await self.node_done.wait()


@asynccontextmanager
async def running_node(
    *instances: InstanceConfig,
    adapters: dict[str, Adapter] | None = None,
    **node: object,
) -> AsyncIterator[NodeAgent]:
    section = msgspec.convert(
        {"id": "n1", "edges": [msgspec.to_builtins(EDGE)], **node}, NodeSection
    )
    cfg = NodeConfig(node=section, instances=list(instances))
    async with open_node_agent(cfg, adapters=adapters) as agent:
        yield agent


async def link(
    nursery: trio.Nursery, agent: NodeAgent, *, ping: bool = True, to: NodeEdge = EDGE
) -> FakeEdge:
    edge_chan, node_chan = memory_link_pair()
    edge = FakeEdge(edge_chan)

    async def serve() -> None:
        try:
            await agent.serve_link(node_chan, edge=to)
        except LinkError as exc:
            edge.node_error = exc
        finally:
            edge.node_done.set()

    nursery.start_soon(serve)
    await edge.handshake()
    edge.start(nursery, ping=ping)
    return edge


def assert_grammar(events: list[RuntimeEvent]) -> None:
    assert sum(is_terminal(e) for e in events) == 1
    assert is_terminal(events[-1])


# --- handshake and streaming ----------------------------------------------------------


async def test_hello_then_a_run_streams_in_batches(autojump_clock: trio.abc.Clock) -> None:
    adapter = SimAdapter(sim(output_tokens=40))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        hello = edge.hello
        assert hello is not None
        assert (hello.node_id, hello.token) == ("n1", TOKEN)
        assert [c.instance for c in hello.instances] == ["sim"]
        assert hello.instances[0].targets == ("iop-sim",)
        assert hello.instances[0].provider_status == ProviderStatus.AVAILABLE

        await edge.assign("r1")
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert isinstance(events[0], Start)
        assert isinstance(events[-1], Complete)
        assert sum(isinstance(e, Delta) for e in events) == 40
        # Instant tokens are coalesced: fewer frames than events.
        assert edge.frames["r1"] < len(events)
        await trio.testing.wait_all_tasks_blocked()
        assert agent.snapshot().runs == []
        await edge.close()
    assert edge.node_error is not None
    assert adapter.active_runs == 0


async def test_a_collected_run_reaches_the_edge_as_one_merged_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A non-streaming request pays for its answer once on the link, not per token."""
    async with running_node(sim(output_tokens=40)) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", collect=True)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        # An instant backend: everything was queued before the writer ran.
        assert edge.frames["r1"] == 1
        assert [type(e) for e in events] == [Start, Delta, Complete]
        merged = events[1]
        assert isinstance(merged, Delta)
        await edge.assign("r2")  # a request of the same length, streamed
        streamed = [e for e in await edge.wait_finished("r2") if isinstance(e, Delta)]
        assert len(streamed) == 40
        assert len(merged.text.split()) == len("".join(e.text for e in streamed).split())
        await edge.close()


async def test_a_burst_after_a_credit_stall_goes_out_in_few_frames(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running_node(sim(output_tokens=300)) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=1)
        await edge.wait_events("r1", 1)
        await trio.sleep(1)  # the run's channel fills up meanwhile
        await edge.grant("r1", 1000)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        # What queued during the stall (the run's backlog) leaves at once, in
        # one message, and the rest follows in a few more.
        assert edge.largest_frame >= RUN_BACKLOG
        assert edge.frames["r1"] <= 4
        await edge.close()


# --- credit ------------------------------------------------------------------------


async def test_no_credit_stops_the_node_and_blocks_the_adapter(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = SimAdapter(sim(output_tokens=100))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=4)
        await edge.wait_events("r1", 4)
        await trio.sleep(10)
        # Exactly the window, nothing more (EdgeSession would also have
        # raised on a credit overrun).
        assert len(edge.events["r1"]) == 4
        assert not any(is_terminal(e) for e in edge.events["r1"])
        # The sim is blocked in send(): still running, not finished.
        assert adapter.active_runs == 1
        snap = agent.snapshot()
        assert [(r.run_id, r.credit) for r in snap.runs] == [("r1", 0)]
        assert snap.instances[0].in_flight == 1

        await edge.grant("r1", 1000)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert isinstance(events[-1], Complete)
        assert sum(isinstance(e, Delta) for e in events) == 100
        await edge.close()
    assert adapter.active_runs == 0


async def test_credit_returned_piecemeal_keeps_the_stream_going(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running_node(sim(output_tokens=30)) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=3)
        seen = 0
        while not edge._finished("r1").is_set():
            await edge.wait_events("r1", seen + 1)
            new = edge.events["r1"][seen:]
            seen += len(new)
            used = sum(not is_terminal(e) for e in new)
            assert used <= 3  # never more than the credit outstanding
            if used and not edge._finished("r1").is_set():
                await edge.grant("r1", used)
        events = edge.events["r1"]
        assert_grammar(events)
        assert sum(isinstance(e, Delta) for e in events) == 30
        await edge.close()


async def test_a_starved_run_does_not_block_another(autojump_clock: trio.abc.Clock) -> None:
    slow = SimAdapter(sim("slow", output_tokens=200))
    fast = SimAdapter(sim("fast", output_tokens=20, tokens_per_s=50))
    async with running_node(slow.cfg, fast.cfg, adapters={"slow": slow, "fast": fast}) as agent:
        async with trio.open_nursery() as nursery:
            edge = await link(nursery, agent)
            await edge.assign("starved", instance="slow", credit=2)
            await edge.wait_events("starved", 2)
            await edge.assign("flows", instance="fast")
            events = await edge.wait_finished("flows")
            assert_grammar(events)
            assert isinstance(events[-1], Complete)
            # The starved run is still parked on its credit.
            assert len(edge.events["starved"]) == 2
            assert slow.active_runs == 1
            await edge.close()
        assert slow.active_runs == 0


# --- cancellation ----------------------------------------------------------------------


async def test_cancel_from_the_edge_needs_no_credit_and_stops_the_adapter(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = SimAdapter(sim(output_tokens=100))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=2)
        await edge.wait_events("r1", 2)
        await trio.sleep(1)
        assert adapter.active_runs == 1
        await edge.cancel("r1", CancelReason.CLIENT_DISCONNECT)
        events = await edge.wait_finished("r1")
        assert len(events) == 3
        assert events[-1] == Cancelled(
            reason=CancelReason.CLIENT_DISCONNECT,
            message="cancelled by the test",
            usage=events[-1].usage,  # type: ignore[union-attr]
        )
        assert adapter.active_runs == 0
        await edge.close()


async def test_cancel_while_streaming_drops_queued_deltas(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = SimAdapter(sim(output_tokens=1000, tokens_per_s=100))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=1000)
        await edge.wait_events("r1", 10)
        await edge.cancel("r1", CancelReason.EXPLICIT)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.EXPLICIT
        assert adapter.active_runs == 0
        await edge.close()


# --- refusals, capacity and node-side deadlines ----------------------------------------


async def test_unknown_instance_is_a_404(autojump_clock: trio.abc.Clock) -> None:
    async with running_node(sim()) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", instance="nope")
        events = await edge.wait_finished("r1")
        assert len(events) == 1
        err = events[0]
        assert isinstance(err, Error)
        assert (err.status, err.code) == (404, "unknown_instance")
        assert "nope" in err.message
        await edge.close()


async def test_queue_full_is_a_429(autojump_clock: trio.abc.Clock) -> None:
    busy = sim(output_tokens=100, tokens_per_s=10, max_concurrency=1, max_queue=0)
    async with running_node(busy) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.wait_events("r1", 2)
        await edge.assign("r2")
        events = await edge.wait_finished("r2")
        assert len(events) == 1
        assert isinstance(events[0], Error)
        assert (events[0].status, events[0].code) == (429, "queue_full")
        await edge.cancel("r1", CancelReason.EXPLICIT)
        await edge.wait_finished("r1")
        await edge.close()


async def test_two_edges_share_the_nodes_slots(autojump_clock: trio.abc.Clock) -> None:
    """The node's admission is the one authority on its slots: a run from a
    second edge finds the slot a first edge's run holds (docs/operations.md,
    "Running several edges"), and is refused retryably (queue_full)."""
    busy = sim(output_tokens=100, tokens_per_s=10, max_concurrency=1, max_queue=0)
    other = NodeEdge(url="ws://edge-b.test/v1/link", token=TOKEN)
    async with running_node(busy) as agent, trio.open_nursery() as nursery:
        a = await link(nursery, agent)
        b = await link(nursery, agent, to=other)
        await a.assign("r1")
        await a.wait_events("r1", 2)
        await b.assign("r2")
        events = await b.wait_finished("r2")
        assert isinstance(events[0], Error)
        assert (events[0].status, events[0].code) == (429, "queue_full")
        assert agent.snapshot().instances[0].in_flight == 1
        await a.cancel("r1", CancelReason.EXPLICIT)
        await a.wait_finished("r1")
        # The slot is free: the second edge's next run gets it.
        await b.assign("r3", max_tokens=5)
        last = (await b.wait_finished("r3"))[-1]
        assert isinstance(last, Complete), last
        await a.close()
        await b.close()


async def test_queue_timeout_cancels_the_waiting_run(autojump_clock: trio.abc.Clock) -> None:
    busy = sim(output_tokens=100, tokens_per_s=10, max_concurrency=1, queue_timeout_s=2.0)
    async with running_node(busy) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.wait_events("r1", 2)
        await edge.assign("r2")
        await trio.sleep(0.5)
        snap = agent.snapshot().instances[0]
        assert (snap.in_flight, snap.queued) == (1, 1)
        start = trio.current_time()
        events = await edge.wait_finished("r2")
        assert trio.current_time() - start == pytest.approx(1.5, abs=0.1)
        assert len(events) == 1
        assert isinstance(events[0], Cancelled)
        assert events[0].reason is CancelReason.QUEUE_TIMEOUT
        await edge.cancel("r1", CancelReason.EXPLICIT)
        await edge.wait_finished("r1")
        await edge.close()


async def test_queued_run_gets_the_slot_when_one_frees(autojump_clock: trio.abc.Clock) -> None:
    one = sim(output_tokens=5, tokens_per_s=5, max_concurrency=1)
    async with running_node(one) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.assign("r2")
        first = await edge.wait_finished("r1")
        second = await edge.wait_finished("r2")
        assert isinstance(first[-1], Complete)
        assert isinstance(second[-1], Complete)
        await edge.close()


async def test_node_side_first_token_deadline(autojump_clock: trio.abc.Clock) -> None:
    stalled = sim(failure="stall_before_first_byte", deadlines=Deadlines(first_token_timeout_s=3))
    async with running_node(stalled) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        start = trio.current_time()
        await edge.assign("r1")
        events = await edge.wait_finished("r1")
        assert trio.current_time() - start == pytest.approx(3, abs=0.1)
        assert isinstance(events[0], Start)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.FIRST_TOKEN_TIMEOUT
        await edge.close()


# --- liveness ----------------------------------------------------------------------------


async def test_silent_edge_is_abandoned_and_its_runs_cancelled(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.node.run")
    adapter = SimAdapter(sim(output_tokens=1000, tokens_per_s=10))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.wait_events("r1", 5)
        assert adapter.active_runs == 1
        frozen_at = trio.current_time()
        edge.chan.freeze()
        await edge.node_done.wait()
        # Silence is noticed within the node's timeout of the edge (three of
        # the edge's ping intervals) after the last frame.
        assert trio.current_time() - frozen_at <= HEARTBEAT_TIMEOUT_S * EDGE_SILENCE_FACTOR + 0.01
        err = edge.node_error
        assert isinstance(err, LinkClosed)
        assert (err.close_code, err.reason) == (CLOSE_HEARTBEAT, "edge silent")
        assert edge.chan.close_code == CLOSE_HEARTBEAT
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.active_runs == 0
        assert agent.snapshot().links == []
    assert "run r1 cancelled reason=node_lost" in caplog.text


async def test_no_welcome_is_a_handshake_timeout(autojump_clock: trio.abc.Clock) -> None:
    cfg = NodeConfig(node=NodeSection(id="n1"), instances=[sim()])
    async with open_node_agent(cfg, welcome_timeout_s=4.0) as agent:
        edge_chan, node_chan = memory_link_pair()
        with pytest.raises(LinkClosed, match="no welcome") as info:
            await agent.serve_link(node_chan, edge=EDGE)
        assert info.value.close_code == CLOSE_HEARTBEAT
        assert trio.current_time() == pytest.approx(4.0)
        assert edge_chan.close_code == CLOSE_HEARTBEAT


async def test_edge_closing_the_link_cancels_runs(autojump_clock: trio.abc.Clock) -> None:
    adapter = SimAdapter(sim(output_tokens=1000, tokens_per_s=10))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.wait_events("r1", 3)
        await edge.close(CLOSE_GOING_AWAY, "edge restarting")
        err = edge.node_error
        assert isinstance(err, LinkClosed)
        assert (err.close_code, err.reason) == (CLOSE_GOING_AWAY, "edge restarting")
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.active_runs == 0


async def test_protocol_error_closes_the_link(autojump_clock: trio.abc.Clock) -> None:
    async with running_node(sim()) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent, ping=False)
        await edge.chan.send(b"\x81\xa1t\xa5nope!")
        await edge.node_done.wait()
        assert edge.chan.close_code == 4400
        assert edge.node_error is not None
        assert edge.node_error.code == "link_protocol_error"


# --- capabilities ----------------------------------------------------------------------


class MoodyAdapter(SimAdapter):
    """A sim whose provider status the test changes."""

    status = ProviderStatus.AVAILABLE

    async def capabilities(self) -> Capabilities:
        caps = await super().capabilities()
        return msgspec.structs.replace(caps, provider_status=self.status)


async def test_capability_changes_are_pushed(autojump_clock: trio.abc.Clock) -> None:
    moody = MoodyAdapter(sim("moody"))
    async with (
        running_node(
            moody.cfg, sim("steady"), adapters={"moody": moody}, probe_interval_s=2.0
        ) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await trio.sleep(5)
        assert edge.caps_updates == []  # unchanged probes push nothing
        moody.status = ProviderStatus.UNAVAILABLE
        await trio.sleep(2.1)
        assert len(edge.caps_updates) == 1
        update = {c.instance: c.provider_status for c in edge.caps_updates[0]}
        assert update == {"moody": "unavailable", "steady": "available"}
        moody.status = ProviderStatus.AVAILABLE
        caps = await agent.refresh_capabilities()
        assert [c.provider_status for c in caps] == ["available", "available"]
        await trio.testing.wait_all_tasks_blocked()
        assert len(edge.caps_updates) == 2
        await edge.close()


class BrokenProbe(SimAdapter):
    async def capabilities(self) -> Capabilities:
        raise RuntimeError("probe bug")


async def test_a_crashing_probe_reports_the_instance_unavailable(
    autojump_clock: trio.abc.Clock,
) -> None:
    broken = BrokenProbe(sim("broken", targets=["m"]))
    async with running_node(broken.cfg, adapters={"broken": broken}) as agent:
        [caps] = agent.capabilities
        assert caps.provider_status == ProviderStatus.UNAVAILABLE
        assert caps.targets == ("m",)


# --- drain -------------------------------------------------------------------------------


async def test_drain_lets_runs_finish_and_refuses_new_ones(autojump_clock: trio.abc.Clock) -> None:
    async with (
        running_node(sim(output_tokens=20, tokens_per_s=10)) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1")
        await edge.wait_events("r1", 3)
        start = trio.current_time()
        drained = trio.Event()

        async def drain() -> None:
            await agent.drain(30)
            drained.set()

        nursery.start_soon(drain)
        await edge.draining.wait()
        await edge.assign("r2")
        refused = await edge.wait_finished("r2")
        assert len(refused) == 1
        assert isinstance(refused[0], Error)
        assert (refused[0].status, refused[0].code) == (503, "node_draining")
        events = await edge.wait_finished("r1")
        assert isinstance(events[-1], Complete)
        await drained.wait()
        assert trio.current_time() - start < 5
        await edge.node_done.wait()
        assert edge.node_error is None  # closed by the node, on purpose
        assert edge.chan.close_code == CLOSE_GOING_AWAY
        assert agent.draining


async def test_drain_timeout_cancels_leftover_runs(autojump_clock: trio.abc.Clock) -> None:
    adapter = SimAdapter(sim(output_tokens=1000, tokens_per_s=1))
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=4)
        await edge.wait_events("r1", 2)
        start = trio.current_time()
        await agent.drain(3)
        assert trio.current_time() - start == pytest.approx(3, abs=0.1)
        events = edge.events["r1"]
        assert_grammar(events)
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.SHUTDOWN
        await edge.node_done.wait()
        assert edge.chan.close_code == CLOSE_GOING_AWAY
        assert adapter.active_runs == 0


# --- serve(): dialling, reconnecting, backoff -----------------------------------------------


class Dialer:
    """A ``connect`` factory handing out memory links; the test takes the edge ends."""

    def __init__(self) -> None:
        self.send, self.links = trio.open_memory_channel[tuple[float, MemoryFrameChannel]](8)
        self.dials = 0

    @asynccontextmanager
    async def connect(self, edge: NodeEdge) -> AsyncIterator[MemoryFrameChannel]:
        assert edge == EDGE
        self.dials += 1
        edge_chan, node_chan = memory_link_pair()
        await self.send.send((trio.current_time(), edge_chan))
        try:
            yield node_chan
        finally:
            await node_chan.aclose()

    async def next_edge(self) -> tuple[float, FakeEdge]:
        at, chan = await self.links.receive()
        return at, FakeEdge(chan)


async def test_serve_reconnects_with_backoff(autojump_clock: trio.abc.Clock) -> None:
    dialer = Dialer()
    async with (
        running_node(sim(), reconnect_min_s=1.0, reconnect_max_s=4.0) as agent,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(partial(agent.serve, connect=dialer.connect))
        delays = []
        _, edge = await dialer.next_edge()
        for _ in range(5):
            hello = await edge.handshake()
            assert hello.node_id == "n1"
            await edge.chan.aclose(CLOSE_GOING_AWAY, "edge restarting")
            lost_at = trio.current_time()
            dialled_at, edge = await dialer.next_edge()
            delays.append(dialled_at - lost_at)
        # Doubling from reconnect_min_s with jitter, capped at reconnect_max_s.
        assert delays[0] == pytest.approx(1.0)
        assert 1.0 <= delays[1] <= 2.0
        assert 1.0 <= delays[2] <= 4.0
        assert all(2.0 <= d <= 4.0 for d in delays[3:])
        await edge.handshake()
        nursery.cancel_scope.cancel()


async def test_backoff_resets_after_a_stable_link(autojump_clock: trio.abc.Clock) -> None:
    dialer = Dialer()
    async with (
        running_node(sim(), reconnect_min_s=1.0, reconnect_max_s=30.0) as agent,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(partial(agent.serve, connect=dialer.connect))
        _, edge = await dialer.next_edge()
        for _ in range(3):  # three quick failures: the backoff grows
            await edge.handshake()
            await edge.chan.aclose(CLOSE_GOING_AWAY)
            _, edge = await dialer.next_edge()
        await edge.handshake()
        edge.start(nursery)
        await trio.sleep(60)  # a healthy link for a minute
        await edge.chan.aclose(CLOSE_GOING_AWAY)
        lost_at = trio.current_time()
        dialled_at, edge = await dialer.next_edge()
        assert dialled_at - lost_at == pytest.approx(1.0)
        nursery.cancel_scope.cancel()


async def test_bad_token_retries_only_at_max_backoff(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.node")
    dialer = Dialer()
    async with (
        running_node(sim(), reconnect_min_s=0.2, reconnect_max_s=7.0) as agent,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(partial(agent.serve, connect=dialer.connect))
        _, edge = await dialer.next_edge()
        for _ in range(3):
            await edge.chan.receive()  # the hello
            await edge.chan.aclose(CLOSE_BAD_TOKEN, "bad token")
            refused_at = trio.current_time()
            dialled_at, edge = await dialer.next_edge()
            assert dialled_at - refused_at == pytest.approx(7.0)
        nursery.cancel_scope.cancel()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3
    assert EDGE.url in errors[0].getMessage()
    assert "4401" in errors[0].getMessage()
    assert TOKEN not in caplog.text


async def test_serve_stops_after_drain(autojump_clock: trio.abc.Clock) -> None:
    dialer = Dialer()
    async with (
        running_node(sim(output_tokens=10, tokens_per_s=10)) as agent,
        trio.open_nursery() as nursery,
    ):
        served = trio.Event()

        async def serve() -> None:
            await agent.serve(connect=dialer.connect)
            served.set()

        nursery.start_soon(serve)
        _, edge = await dialer.next_edge()
        await edge.handshake()
        edge.start(nursery)
        await edge.assign("r1")
        await edge.wait_events("r1", 2)
        await agent.drain(10)
        await served.wait()
        assert isinstance(edge.events["r1"][-1], Complete)
        assert edge.chan.close_code == CLOSE_GOING_AWAY
        assert dialer.dials == 1


async def test_deadline_while_starved_stops_the_adapter_and_still_ends_the_run(
    autojump_clock: trio.abc.Clock,
) -> None:
    adapter = SimAdapter(
        sim(output_tokens=1000, tokens_per_s=100, deadlines=Deadlines(request_timeout_s=5))
    )
    async with (
        running_node(adapter.cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent)
        await edge.assign("r1", credit=4)
        await edge.wait_events("r1", 4)
        events = await edge.wait_finished("r1")
        # At the deadline: the backend call is stopped, the slot freed, and
        # the run ends on the link at once with its one terminal event, its
        # undelivered deltas dropped (nobody had credit for them).
        assert trio.current_time() == pytest.approx(5.0, abs=0.1)
        assert adapter.active_runs == 0
        await trio.testing.wait_all_tasks_blocked()
        assert agent.snapshot().instances[0].in_flight == 0
        assert len(events) == 5
        assert isinstance(events[-1], Cancelled)
        assert events[-1].reason is CancelReason.TOTAL_TIMEOUT
        await edge.close()


async def test_a_run_id_still_running_is_refused(autojump_clock: trio.abc.Clock) -> None:
    async with (
        running_node(sim(output_tokens=100, tokens_per_s=10)) as agent,
        trio.open_nursery() as nursery,
    ):
        first = await link(nursery, agent)
        second = await link(nursery, agent)
        await first.assign("r1")
        await first.wait_events("r1", 2)
        await second.assign("r1")
        [refused] = await second.wait_finished("r1")
        assert isinstance(refused, Error)
        assert (refused.status, refused.code) == (409, "run_id_in_use")
        assert len(agent.snapshot().links) == 2
        await first.close()
        await second.close()


# --- secrets ---------------------------------------------------------------------------

BACKEND_KEY = "sk-backend-marker-6c1d2e"


def _echoing_vllm(headers: dict[str, str]) -> tuple[VllmInstance, VllmAdapter]:
    """A vllm instance whose backend refuses every chat, echoing the header it got."""
    cfg = VllmInstance(name="v", endpoint="http://backend.test", headers=headers, targets=["m"])
    transport = FakeTransport()
    transport.route(
        MODELS_PATH, Reply(status=200, body=b'{"object":"list","data":[{"id":"iop-sim"}]}')
    )

    def refuse(req: RecordedRequest) -> Reply:
        auth = dict(req.headers).get("authorization", "")
        body = msgspec.json.encode(
            {
                "error": {
                    "message": f"Incorrect API key provided: {auth}",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
        )
        return Reply(status=401, body=body)

    transport.route(CHAT_COMPLETIONS_PATH, refuse)
    return cfg, VllmAdapter(cfg, transport=transport)


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {BACKEND_KEY}"},
        {"Authorization": f"Basic {base64.b64encode(f'user:{BACKEND_KEY}'.encode()).decode()}"},
    ],
)
async def test_a_backend_echoing_its_credential_does_not_send_it_on_the_link(
    autojump_clock: trio.abc.Clock, headers: dict[str, str]
) -> None:
    cfg, adapter = _echoing_vllm(headers)
    async with running_node(cfg, adapters={"v": adapter}) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", instance="v")
        events = await edge.wait_finished("r1")
        err = events[-1]
        assert isinstance(err, Error)
        assert err.status == 401
        assert "Incorrect API key provided: " in err.message
        (value,) = headers.values()
        credential = value.split(" ", 1)[1]
        for secret in (value, credential, BACKEND_KEY):
            assert secret not in err.message
        assert "***" in err.message
        await edge.close()
    await adapter.aclose()


class _LeakyAdapter:
    """Ends runs as cancelled, or fails them, with a message naming the node's secrets."""

    kind = "sim"

    def __init__(self, name: str, text: str, *, cancel: bool) -> None:
        self.name = name
        self._text = text
        self._cancel = cancel

    async def capabilities(self) -> Capabilities:
        return Capabilities(adapter="sim", instance=self.name, targets=("iop-sim",))

    async def probe(self, target: str = "") -> ProbeResult:
        raise NotImplementedError

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        await send.send(Start(target="iop-sim"))
        if self._cancel:
            raise RunAborted(self._text, reason=CancelReason.EXPLICIT)
        raise BackendError(self._text)

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("cancel", [False, True])
async def test_error_and_cancel_messages_lose_the_nodes_secrets(
    autojump_clock: trio.abc.Clock, cancel: bool
) -> None:
    inst = VllmInstance(name="v", endpoint="http://b.test", headers={"X-Api-Key": BACKEND_KEY})
    b64 = base64.b64encode(BACKEND_KEY.encode()).decode()
    adapter = _LeakyAdapter("v", f"token {TOKEN} key {BACKEND_KEY} b64 {b64}", cancel=cancel)
    async with running_node(inst, adapters={"v": adapter}) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", instance="v")
        end = (await edge.wait_finished("r1"))[-1]
        assert isinstance(end, Cancelled if cancel else Error)
        assert end.message == "token *** key *** b64 ***"
        await edge.close()


async def test_a_live_id_refusal_is_an_error_log_and_max_backoff(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """4410 (another live node has this id): the node says so, naming the edge
    and the id, and retries only at the maximum backoff, never in a hot loop."""
    dialer = Dialer()
    async with (
        running_node(sim(), reconnect_min_s=0.2, reconnect_max_s=7.0) as agent,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(partial(agent.serve, connect=dialer.connect))
        _, edge = await dialer.next_edge()
        for _ in range(2):
            await edge.chan.receive()  # the hello
            await edge.chan.aclose(CLOSE_ID_IN_USE, "node id 'n1' is in use by a live link")
            refused_at = trio.current_time()
            dialled_at, edge = await dialer.next_edge()
            assert dialled_at - refused_at == pytest.approx(7.0)
        nursery.cancel_scope.cancel()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert EDGE.url in errors[0]
    assert "4410" in errors[0]
    assert "another live node already uses the id 'n1'" in errors[0]


async def test_frames_stay_within_what_the_edge_accepts(autojump_clock: trio.abc.Clock) -> None:
    """The welcome says how big a frame the edge accepts; a batch that would
    be bigger goes out in several frames, and the link stays up."""
    async with running_node(sim(output_tokens=60)) as agent, trio.open_nursery() as nursery:
        edge_chan, node_chan = memory_link_pair()
        edge = FakeEdge(edge_chan)
        edge.session.max_frame_bytes = 512  # the welcome tells the node

        async def serve() -> None:
            with contextlib.suppress(LinkError):
                await agent.serve_link(node_chan, edge=EDGE)
            edge.node_done.set()

        nursery.start_soon(serve)
        hello = await edge.handshake()
        assert hello.max_frame_bytes == NodeSection(id="x").max_frame_bytes
        edge.start(nursery)
        await edge.assign("r1", credit=64)
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert sum(isinstance(e, Delta) for e in events) == 60
        assert edge.frames["r1"] > 1
        assert edge.closed is None
        await edge.close()


class _StuckClose:
    """A memory link end whose close never finishes (an edge that stopped reading)."""

    def __init__(self, chan: MemoryFrameChannel) -> None:
        self._chan = chan
        self.closes = 0

    async def send(self, frame: bytes) -> None:
        await self._chan.send(frame)

    async def receive(self) -> bytes:
        return await self._chan.receive()

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        self.closes += 1
        await trio.sleep_forever()


async def test_closing_a_stuck_link_is_bounded(autojump_clock: trio.abc.Clock) -> None:
    cfg = NodeConfig(node=NodeSection(id="n1"), instances=[sim()])
    async with open_node_agent(cfg, welcome_timeout_s=1.0) as agent:
        _, node_chan = memory_link_pair()
        stuck = _StuckClose(node_chan)
        with trio.fail_after(10), pytest.raises(LinkClosed, match="no welcome"):
            await agent.serve_link(stuck, edge=EDGE)
        assert stuck.closes == 1


async def test_a_frame_above_the_node_limit_closes_1009(autojump_clock: trio.abc.Clock) -> None:
    async with (
        running_node(sim(), max_frame_bytes=65536) as agent,
        trio.open_nursery() as nursery,
    ):
        edge = await link(nursery, agent, ping=False)
        await edge.chan.send(encode_batch([encode(Ping(nonce=1))]) + b"\x00" * 70_000)
        await edge.node_done.wait()
        assert edge.chan.close_code == CLOSE_TOO_BIG
        assert edge.node_error is not None
        assert "limit 65536" in edge.node_error.message
