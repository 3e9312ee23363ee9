"""Load reports, node to edge: coalesced to the configured rate, the last state
always sent, engine figures scraped and carried; real nodes and edges over
in-memory links, in virtual time."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
import trio
import trio.testing

from iop.adapters import VllmAdapter
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
    VllmInstance,
)
from iop.edge import EdgeCore, open_edge_core
from iop.errors import LinkError
from iop.events import CancelReason, Complete, RuntimeEvent
from iop.node import NodeAgent, open_node_agent
from iop.protocol import LoadReport, decode_node_batch
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import MemoryFrameChannel, memory_link_pair
from iop.wire import EngineFigures

TOKEN = "node-token"
EDGE = NodeEdge(url="ws://edge.test/v1/link", token=TOKEN)
MODEL = "iop-sim"


def edge_config(**link: object) -> EdgeConfig:
    settings = msgspec.convert(
        {
            "node_tokens": [TOKEN],
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 1.5,
            **link,
        },
        LinkSettings,
    )
    return EdgeConfig(
        link=settings,
        scheduler=SchedulerSettings(queue_timeout_s=20.0, max_queue=1000),
        deadlines=Deadlines(first_token_timeout_s=60, idle_timeout_s=60, request_timeout_s=300),
    )


def sim(**kw: object) -> SimInstance:
    cfg = {"name": "sim", "max_concurrency": 1, "max_queue": 0, **kw}
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


class ReportTap:
    """The node's end of a link, noting each LoadReport it sends and when."""

    def __init__(self, chan: MemoryFrameChannel) -> None:
        self._chan = chan
        self._hello_seen = False
        self.reports: list[tuple[float, LoadReport]] = []

    async def send(self, frame: bytes) -> None:
        if self._hello_seen:
            for msg in decode_node_batch(frame):
                if isinstance(msg, LoadReport):
                    self.reports.append((trio.current_time(), msg))
        self._hello_seen = True
        await self._chan.send(frame)

    async def receive(self) -> bytes:
        return await self._chan.receive()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self._chan.aclose(code, reason)


@asynccontextmanager
async def node(
    node_id: str,
    *instances: SimInstance | VllmInstance,
    adapters: dict | None = None,
    **section: object,
) -> AsyncIterator[NodeAgent]:
    settings = msgspec.convert(
        {"id": node_id, "edges": [msgspec.to_builtins(EDGE)], **section}, NodeSection
    )
    cfg = NodeConfig(node=settings, instances=list(instances))
    async with open_node_agent(cfg, adapters=adapters) as agent:
        yield agent


async def attach(nursery: trio.Nursery, core: EdgeCore, agent: NodeAgent) -> ReportTap:
    edge_end, node_end = memory_link_pair()
    tap = ReportTap(node_end)
    nursery.start_soon(core.handle_link, edge_end, "memory")

    async def serve() -> None:
        with contextlib.suppress(LinkError):  # the test's nursery ends the link
            await agent.serve_link(tap, edge=EDGE)  # type: ignore[arg-type]

    nursery.start_soon(serve)
    await trio.testing.wait_all_tasks_blocked()
    return tap


async def drain(run: Run) -> list[RuntimeEvent]:
    async with run.events:
        return [ev async for ev in run.events]


def reported(core: EdgeCore, node_id: str, instance: str = "sim") -> tuple[int, int] | None:
    rep = core.registry.nodes[node_id].instances[instance].reported
    return None if rep is None else (rep.in_flight, rep.queued)


async def test_a_burst_of_changes_is_coalesced_to_the_rate_and_the_last_state_goes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rate = 4.0
    fast = sim(
        max_concurrency=8,
        max_queue=200,
        queue_timeout_s=60.0,
        sim=SimConfig(ttft_s=0.01, output_tokens=3, tokens_per_s=100),
    )
    async with (
        open_edge_core(edge_config()) as core,
        node("n1", fast, load_reports_per_s=rate) as agent,
        trio.open_nursery() as nursery,
    ):
        tap = await attach(nursery, core, agent)
        runs = []
        # 120 runs in 3 s: each takes and gives back a slot, hundreds of changes.
        for i in range(120):
            runs.append(core.start_run(spec(f"r{i}", output_tokens=3)))
            await trio.sleep(0.025)
        for run in runs:
            assert isinstance((await drain(run))[-1], Complete)
        await trio.sleep(1.0)  # past the last interval
        times = [t for t, _ in tap.reports]
        assert len(times) >= 8  # the load did change, repeatedly
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= 1 / rate - 1e-9
        for t in times:
            assert sum(1 for u in times if t <= u < t + 1.0 - 1e-9) <= rate
        # The last report is the last state: idle. The edge holds it.
        last = tap.reports[-1][1].instances[0]
        assert (last.in_flight, last.queued) == (0, 0)
        assert reported(core, "n1") == (0, 0)
        # Some report in the burst saw the node busy.
        assert any(r.instances[0].in_flight > 0 for _, r in tap.reports)
        nursery.cancel_scope.cancel()


async def test_a_quiet_node_repeats_its_report_before_the_edge_would_call_it_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_edge_core(edge_config()) as core,
        node("n1", sim()) as agent,
        trio.open_nursery() as nursery,
    ):
        tap = await attach(nursery, core, agent)
        await trio.sleep(20.0)
        stale_s = core.config.scheduler.load_stale_s
        times = [t for t, _ in tap.reports]
        assert len(times) >= 20 / stale_s * 2
        assert max(b - a for a, b in itertools.pairwise(times)) < stale_s
        assert core.scheduler.stale_instances() == 0
        nursery.cancel_scope.cancel()


async def test_an_edge_that_asks_for_no_reports_gets_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What an edge from before LoadReport says in its welcome: nothing.
    async with (
        open_edge_core(edge_config()) as core,
        node("n1", sim(), load_reports_per_s=0) as agent,
        trio.open_nursery() as nursery,
    ):
        tap = await attach(nursery, core, agent)
        await drain(core.start_run(spec("r1", output_tokens=2)))
        await trio.sleep(5.0)
        assert tap.reports == []
        assert reported(core, "n1") is None
        nursery.cancel_scope.cancel()


async def test_the_edge_asks_for_at_most_a_quarter_of_its_control_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fast = sim(max_concurrency=4, max_queue=100, sim=SimConfig(ttft_s=0.0, output_tokens=2))
    async with (
        open_edge_core(edge_config(control_rate_per_s=8.0, control_burst=8)) as core,
        node("n1", fast, load_reports_per_s=20) as agent,
        trio.open_nursery() as nursery,
    ):
        tap = await attach(nursery, core, agent)
        for i in range(30):  # a change every 0.1 s for 3 s
            await drain(core.start_run(spec(f"r{i}", output_tokens=2)))
            await trio.sleep(0.1)
        times = [t for t, _ in tap.reports]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(gaps) >= 4
        assert min(gaps) >= 1 / 2.0 - 1e-9  # 8 / 4
        assert "n1" in core.registry.nodes  # never over the edge's rate limit
        nursery.cancel_scope.cancel()


async def test_the_edge_places_by_the_report_when_another_edge_filled_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_edge_core(edge_config()) as mine,
        open_edge_core(edge_config()) as theirs,
        node("shared", sim()) as shared,
        node("spare", sim()) as spare,
        trio.open_nursery() as nursery,
    ):
        await attach(nursery, theirs, shared)
        await attach(nursery, mine, shared)
        await attach(nursery, mine, spare)
        busy = theirs.start_run(spec("theirs-1"))
        await trio.sleep(0.5)
        assert reported(mine, "shared") == (1, 0)
        run = mine.start_run(spec("mine-1", output_tokens=2))
        assert isinstance((await drain(run))[-1], Complete)
        # Straight to the spare node: no refusal, no failover.
        assert [p.node for p in run.timeline.placements] == ["spare"]
        snapshot = mine.snapshot()
        nodes = {n["id"]: n for n in snapshot["nodes"]}  # type: ignore[attr-defined]
        view = nodes["shared"]["instances"][0]["reported"]
        assert (view["in_flight"], view["queued"], view["stale"]) == (1, 0, False)
        busy.cancel(CancelReason.EXPLICIT)
        await drain(busy)
        nursery.cancel_scope.cancel()


# --- engine figures -------------------------------------------------------------


class MetricsBackend:
    """A vLLM's /metrics (httpx.MockTransport): figures set by the test, or failing."""

    def __init__(self) -> None:
        self.running = 0.0
        self.waiting = 0.0
        self.kv = 0.0
        self.failing = False
        self.scrapes = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        assert request.url.path == "/metrics"
        self.scrapes += 1
        if self.failing:
            return httpx.Response(503, text="engine restarting")
        page = (
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} {self.kv}\n'
        )
        return httpx.Response(200, text=page)


def vllm_instance(**kw: object) -> VllmInstance:
    return msgspec.convert(
        {"name": "sim", "endpoint": "http://engine.test/v1", "load_scrape_interval_s": 0.5, **kw},
        VllmInstance,
    )


async def test_engine_figures_are_scraped_carried_and_age_when_the_scrape_fails(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MetricsBackend()
    cfg = vllm_instance()
    adapter = VllmAdapter(cfg, transport=httpx.MockTransport(backend.handle))
    async with (
        open_edge_core(edge_config()) as core,
        node("n1", cfg, adapters={"sim": adapter}) as agent,
        trio.open_nursery() as nursery,
    ):
        tap = await attach(nursery, core, agent)
        backend.running, backend.waiting, backend.kv = 3.0, 7.0, 0.5
        await trio.sleep(1.0)
        engine = tap.reports[-1][1].instances[0].engine
        assert engine is not None
        assert (engine.running, engine.waiting, engine.kv_usage) == (3.0, 7.0, 0.5)
        inst = core.registry.nodes["n1"].instances["sim"]
        # The engine's waiting requests count on top of the node's runs.
        assert core.scheduler.occupancy(inst, trio.current_time()) == 7.0
        assert core.scheduler.kv_usage(inst, trio.current_time()) == 0.5

        caplog.set_level(logging.INFO, logger="iop.node")
        backend.failing = True
        before = backend.scrapes
        await trio.sleep(10.0)
        assert backend.scrapes - before >= 15
        failures = [r for r in caplog.records if "reading the engine's load failed" in r.message]
        assert len(failures) == 1  # once per change of state, not per scrape
        # The figures aged past scheduler.load_stale_s: ignored, counted stale.
        now = trio.current_time()
        assert core.scheduler.is_stale(inst, now)
        assert core.scheduler.stale_instances() == 1
        assert core.scheduler.occupancy(inst, now) == 0.0
        assert core.scheduler.kv_usage(inst, now) == 0.0
        assert b"iop_load_stale_instances 1.0" in core.metrics.render()

        backend.failing = False
        await trio.sleep(2.0)
        assert any("read again" in r.message for r in caplog.records)
        assert core.scheduler.stale_instances() == 0
        assert b"iop_load_stale_instances 0.0" in core.metrics.render()
        nursery.cancel_scope.cancel()


async def test_a_scrape_interval_of_zero_reads_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MetricsBackend()
    cfg = vllm_instance(load_scrape_interval_s=0)
    adapter = VllmAdapter(cfg, transport=httpx.MockTransport(backend.handle))
    async with node("n1", cfg, adapters={"sim": adapter}) as agent:
        await trio.sleep(5.0)
        assert backend.scrapes == 0
        assert agent._load_report()[0].engine is None


def test_engine_figures_struct_is_the_wire_figures() -> None:
    assert EngineFigures(running=1.0) == EngineFigures(running=1.0, waiting=None)


@pytest.mark.parametrize("rate", [-1.0, 21.0, float("nan")])
def test_load_reports_per_s_is_bounded(rate: float) -> None:
    with pytest.raises(ValueError, match="load_reports_per_s"):
        NodeSection(id="n", load_reports_per_s=rate)


@pytest.mark.parametrize("stale", [0.0, -1.0, float("nan")])
def test_load_stale_s_must_be_positive(stale: float) -> None:
    with pytest.raises(ValueError, match="load_stale_s"):
        SchedulerSettings(load_stale_s=stale)


class ScriptedReader:
    """An engine reader that fails in the ways a broken adapter can."""

    load_scrape_interval_s = 1.0

    def __init__(self, *steps: str) -> None:
        self.steps = list(steps)

    async def engine_load(self) -> EngineFigures:
        step = self.steps.pop(0) if self.steps else "ok"
        if step == "crash":
            raise RuntimeError("adapter bug")
        if step == "hang":
            await trio.sleep_forever()
        return EngineFigures(running=1.0)


async def test_a_crashing_or_hanging_reader_is_logged_once_and_the_loop_goes_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    from iop.node._instances import SCRAPE_GUARD_S, Instance, scrape_engine_load

    inst = Instance(sim(), VllmAdapter(vllm_instance()))
    changes: list[float] = []
    reader = ScriptedReader("crash", "hang", "crash", "ok")
    caplog.set_level(logging.INFO, logger="iop.node")
    async with trio.open_nursery() as nursery:
        await nursery.start(scrape_engine_load, inst, reader, lambda: changes.append(1))
        await trio.sleep(3 + SCRAPE_GUARD_S + 1)
        nursery.cancel_scope.cancel()
    failed = [r for r in caplog.records if "failed" in r.message]
    assert len(failed) == 1
    assert "RuntimeError: adapter bug" in failed[0].message
    assert any("read again" in r.message for r in caplog.records)
    assert inst.engine == EngineFigures(running=1.0)
    assert changes == [1]  # once: the figures changed once


async def test_a_reader_with_no_interval_returns_at_once() -> None:
    from iop.node._instances import Instance, scrape_engine_load

    reader = ScriptedReader("crash")
    reader.load_scrape_interval_s = 0.0
    inst = Instance(sim(), VllmAdapter(vllm_instance()))
    async with trio.open_nursery() as nursery:
        await nursery.start(scrape_engine_load, inst, reader, lambda: None)
    assert reader.steps == ["crash"]  # never called


async def test_a_crashing_kv_events_follower_is_logged_and_stops_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A follower's bug (``KVEventsFollower``) is logged; it does not reach
    the node's nursery, whose scrape goes on."""
    from iop.node._instances import Instance, follow_kv_events

    class Broken:
        async def follow_kv_events(self) -> None:
            raise RuntimeError("follower bug")

    inst = Instance(sim(), VllmAdapter(vllm_instance()))
    caplog.set_level(logging.INFO, logger="iop.node")
    await follow_kv_events(inst, Broken())
    (record,) = [r for r in caplog.records if "KV cache events stopped" in r.message]
    assert record.exc_info is not None
    assert "follower bug" in str(record.exc_info[1])


async def test_cancelling_a_kv_events_follower_is_not_swallowed() -> None:
    from iop.node._instances import Instance, follow_kv_events

    class Forever:
        async def follow_kv_events(self) -> None:
            await trio.sleep_forever()

    inst = Instance(sim(), VllmAdapter(vllm_instance()))
    with trio.move_on_after(0.01) as scope:
        await follow_kv_events(inst, Forever())
    assert scope.cancelled_caught
