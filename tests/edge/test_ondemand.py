"""Models on demand, the edge's half (``iop.edge.scheduler._ondemand``): the
edge core over in-memory links in virtual time, each node a scripted
``NodeSession`` that offers models and answers ``LoadModel`` by hand, so
every load the edge asks for is counted; and the choice of a node for a
load over hand-made offers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from iop.capabilities import Capabilities, ProviderStatus
from iop.config import EdgeConfig, SchedulerSettings
from iop.edge import EdgeCore, open_edge_core
from iop.edge.runs import InstanceState, NodeConnection
from iop.edge.scheduler import QueueExit, QueueShare
from iop.edge.scheduler._ondemand import RANK_EVICTS, RANK_FREE, RANK_LOADING, choose_load
from iop.errors import ErrorCode, IopError
from iop.events import CancelReason, Complete, Error, Start
from iop.protocol import (
    AssignReceived,
    EdgeSession,
    LinkClosed,
    LoadModelReceived,
    ModelLoadResult,
    ModelOffer,
)
from iop.testing import memory_link_pair
from tests.edge.test_core import FakeNode, config, drain_events, spec

MODELS = ("a", "b", "c")


def model_caps(name: str, slots: int = 2) -> Capabilities:
    # A model's instance: unavailable while not loaded (iop.node._models.ModelAdapter).
    return Capabilities(
        adapter="sim",
        instance=name,
        targets=(name,),
        max_concurrency=slots,
        provider_status=ProviderStatus.UNAVAILABLE,
    )


def offer(name: str, state: str = "cold", memory: int = 60, **kw: object) -> ModelOffer:
    return ModelOffer(model=name, state=state, memory_mib=memory, **kw)  # type: ignore[arg-type]


class ModelNode(FakeNode):
    """A node with on-demand models: it records each ``LoadModel`` and is
    told by the test what its models do."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.loads: list[LoadModelReceived] = []
        self.offers: dict[str, ModelOffer] = {}
        self.load_asked = trio.Event()

    async def join(self, offers: list[ModelOffer], memory_mib: int) -> None:
        self.offers = {o.model: o for o in offers}
        caps = [model_caps(o.model) for o in offers]
        await self.chan.send(self.session.hello(caps, models=offers, memory_mib=memory_mib))
        self.session.receive(await self.chan.receive(), trio.current_time())

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.chan.receive()
                for ev in self.session.receive(frame, trio.current_time()):
                    if isinstance(ev, LoadModelReceived):
                        self.loads.append(ev)
                        self.load_asked.set()
                        self.load_asked = trio.Event()
                    elif isinstance(ev, AssignReceived):
                        self.assigned.append(ev.assign.run_id)
                        self.inbox.send_nowait(ev)
        except LinkClosed as exc:
            self.closed = exc

    async def models(self, **states: str) -> None:
        """Its models' new states, as the node pushes them."""
        for name, state in states.items():
            self.offers[name] = msgspec.structs.replace(self.offers[name], state=state)
        caps = [
            msgspec.structs.replace(
                model_caps(o.model),
                provider_status=ProviderStatus.AVAILABLE
                if o.state == "ready"
                else ProviderStatus.UNAVAILABLE,
            )
            for o in self.offers.values()
        ]
        self.session.capabilities(caps, list(self.offers.values()))
        await self.flush()

    async def answer(
        self,
        n: int,
        ok: bool = True,
        code: str = "",
        message: str = "",
        pinned: tuple[str, ...] = (),
    ) -> None:
        """Answer the ``n``-th ``LoadModel``."""
        request = self.loads[n].request
        self.session.model_load_result(
            ModelLoadResult(
                request_id=request.request_id,
                model=request.model,
                ok=ok,
                code=code,
                message=message,
                pinned=pinned,
            )
        )
        await self.flush()

    async def flush(self) -> None:
        for data in self.session.data_to_send(trio.current_time()):
            await self.chan.send(data)
        await trio.testing.wait_all_tasks_blocked()


def od_config(**sched: object) -> EdgeConfig:
    base = config()
    scheduler = SchedulerSettings(
        max_queue=16,
        queue_timeout_s=5.0,
        model_load_wait_s=sched.pop("model_load_wait_s", 60.0),  # type: ignore[arg-type]
        model_load_backoff_s=sched.pop("model_load_backoff_s", 10.0),  # type: ignore[arg-type]
        **sched,  # type: ignore[arg-type]
    )
    return msgspec.structs.replace(base, scheduler=scheduler)


async def join(
    core: EdgeCore, nursery: trio.Nursery, node_id: str, offers: list[ModelOffer], memory: int
) -> ModelNode:
    edge_end, node_end = memory_link_pair()
    nursery.start_soon(core.handle_link, edge_end, "test")
    node = ModelNode(node_end, node_id)
    await node.join(offers, memory)
    nursery.start_soon(node.serve)
    await trio.testing.wait_all_tasks_blocked()
    return node


@asynccontextmanager
async def edge(cfg: EdgeConfig | None = None) -> AsyncIterator[tuple[EdgeCore, trio.Nursery]]:
    async with open_edge_core(cfg or od_config()) as core, trio.open_nursery() as nursery:
        yield core, nursery
        nursery.cancel_scope.cancel()


async def serve_one(node: ModelNode, run_id: str | None = None) -> None:
    """Run the next run assigned to ``node`` (``run_id``, when given) to its end."""
    assign = await node.assigns.receive()
    if run_id is not None:
        assert assign.assign.run_id == run_id
    await node.send(assign.assign.run_id, Start(), Complete())


# --- a load, its waiters, its timeline ------------------------------------------------


async def test_concurrent_runs_for_a_cold_model_wait_for_one_load_then_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge() as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a"), offer("b")], 100)
        # An offered model is listed and admitted though nothing serves it yet.
        assert [m.id for m in core.models()] == ["a", "b"]
        runs = [core.start_run(spec("a", f"r{i}")) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in node.loads] == ["a"]  # one load for three runs
        assert node.assigned == []  # nothing is assigned before the model is ready
        assert all(r.timeline.phase == "loading" for r in runs)
        assert "loading on node n1" in (runs[0].timeline.why_queued or "")
        await trio.sleep(2.0)  # the load takes its time
        await node.models(a="ready")
        await node.answer(0)
        for _ in range(3):  # two slots: the third runs when one frees
            await serve_one(node)
        for run in runs:
            assert (await drain_events(run))[-1] == Complete()
        load = runs[0].timeline.model_load
        assert load is not None
        assert (load.node, load.model, load.result) == ("n1", "a", "ready")
        assert load.ended is not None
        assert load.ended - load.started == pytest.approx(2.0)
        shown = runs[0].timeline.to_json()["model_load"]
        assert isinstance(shown, dict)
        assert shown["elapsed_ms"] == pytest.approx(2000.0)
        assert len(node.loads) == 1
        assert (core.scheduler.loads.asked, core.scheduler.loads.failed) == (1, 0)


async def test_a_failed_load_fails_its_waiters_naming_model_and_reason_then_backs_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge(od_config(model_load_backoff_s=10.0)) as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a")], 100)
        runs = [core.start_run(spec("a", f"r{i}")) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        reason = "model a failed to load: exited with 3 while loading: out of memory"
        await node.answer(0, ok=False, code=ErrorCode.MODEL_LOAD_FAILED, message=reason)
        for run in runs:
            (end,) = await drain_events(run)
            assert isinstance(end, Error)
            assert (end.status, end.code) == (503, ErrorCode.MODEL_LOAD_FAILED)
            assert "'a'" in end.message
            assert "out of memory" in end.message
            assert "node n1" in end.message
        assert core.scheduler.exits[QueueExit.LOAD_FAILED] == 2
        # Within the backoff: refused at once, and the node is not asked again.
        with pytest.raises(IopError) as refused:
            core.start_run(spec("a", "r9"))
        assert refused.value.code == ErrorCode.MODEL_LOAD_FAILED
        assert "model_load_backoff_s=10s" in refused.value.message
        assert len(node.loads) == 1
        await trio.sleep(10.0)
        # Past it: asked again.
        run = core.start_run(spec("a", "r10"))
        await trio.testing.wait_all_tasks_blocked()
        assert len(node.loads) == 2
        run.cancel(CancelReason.EXPLICIT)


async def test_a_failed_load_on_one_node_loads_on_another_that_offers_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge() as (core, nursery):
        n1 = await join(core, nursery, "n1", [offer("a")], 100)
        n2 = await join(core, nursery, "n2", [offer("a", memory=90)], 100)
        run = core.start_run(spec("a"))
        await trio.testing.wait_all_tasks_blocked()
        # n1 first: both have room, tie broken by id.
        assert (len(n1.loads), len(n2.loads)) == (1, 0)
        await n1.answer(
            0, ok=False, code=ErrorCode.MODEL_LOAD_FAILED, message="health never passed"
        )
        assert (len(n1.loads), len(n2.loads)) == (1, 1)
        await n2.models(a="ready")
        await n2.answer(0)
        await serve_one(n2, "r1")
        assert (await drain_events(run))[-1] == Complete()
        assert run.timeline.model_load is not None
        assert run.timeline.model_load.node == "n2"


async def test_a_refused_load_waits_and_asks_again_after_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The node refuses: the model in the way is inside its min_residency_s.
    # The run neither fails nor makes the node swap: it asks again later.
    async with edge(od_config(model_load_backoff_s=5.0)) as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a", "ready"), offer("b")], 100)
        run = core.start_run(spec("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in node.loads] == ["b"]
        refusal = "model b needs 60 MiB ...: a (used 1s ago, min_residency_s 30)"
        await node.answer(0, ok=False, code=ErrorCode.MODEL_LOAD_REFUSED, message=refusal)
        assert run.outcome is None
        assert "min_residency_s" in (run.timeline.why_queued or "") or run.timeline.model_load
        await trio.sleep(5.0)
        await trio.testing.wait_all_tasks_blocked()
        assert len(node.loads) == 2  # asked again once the backoff ended
        await node.models(a="cold", b="ready")
        await node.answer(1)
        await serve_one(node, "r1")
        assert (await drain_events(run))[-1] == Complete()


async def test_a_refusal_that_lasts_until_an_unpin_ends_the_runs_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The node refuses b: pinned a is in the way (its group's rule). No other
    # node may load b, so the runs end now, 503 model_load_refused naming
    # the pinned model and the node, not at model_load_wait_s.
    async with edge(od_config(model_load_wait_s=60.0, model_load_backoff_s=5.0)) as (
        core,
        nursery,
    ):
        node = await join(core, nursery, "n1", [offer("a", "ready", pinned=True), offer("b")], 200)
        began = trio.current_time()  # relative: as in the test below
        runs = [core.start_run(spec("b", f"r{i}")) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in node.loads] == ["b"]
        refusal = "model b may not run with models of group 'g' rules ...: a (pinned)"
        await node.answer(
            0, ok=False, code=ErrorCode.MODEL_LOAD_REFUSED, message=refusal, pinned=("a",)
        )
        for run in runs:
            (end,) = await drain_events(run)
            assert isinstance(end, Error)
            assert (end.status, end.code) == (503, ErrorCode.MODEL_LOAD_REFUSED)
            assert "'b'" in end.message
            assert "node n1" in end.message
            assert "pinned model a" in end.message
        assert trio.current_time() - began == pytest.approx(0.0, abs=0.1)
        assert core.scheduler.exits[QueueExit.LOAD_FAILED] == 2
        # Within the backoff: refused up front, the node not asked again.
        with pytest.raises(IopError) as refused:
            core.start_run(spec("b", "r9"))
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.MODEL_LOAD_REFUSED)
        assert len(node.loads) == 1


async def test_pinned_models_that_leave_no_room_refuse_the_run_without_asking(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # By the node's offers alone: pinned a holds 60 of 100, b needs 60. The
    # node is not asked (it would refuse); the run ends now, naming a.
    async with edge(od_config(model_load_wait_s=60.0)) as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a", "ready", pinned=True), offer("b")], 100)
        with pytest.raises(IopError) as refused:
            core.start_run(spec("b"))
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.MODEL_LOAD_REFUSED)
        assert "pinned model a" in refused.value.message
        assert "node n1" in refused.value.message
        assert node.loads == []
        # Unpinned (the node's offer says so): b's load is asked for.
        node.offers["a"] = offer("a", "ready")
        await node.models()
        run = core.start_run(spec("b", "r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in node.loads] == ["b"]
        run.cancel(CancelReason.EXPLICIT)


async def test_a_lasting_refusal_waits_while_another_node_may_load_it_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # n1 refuses for pinned a; n2 has no room only while its run on c lasts:
    # the run waits for n2, as for any refusal that passes.
    async with edge(od_config(model_load_wait_s=60.0)) as (core, nursery):
        n1 = await join(core, nursery, "n1", [offer("a", "ready", pinned=True), offer("b")], 200)
        n2 = await join(core, nursery, "n2", [offer("b"), offer("c", "ready", runs=1)], 100)
        run = core.start_run(spec("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in n1.loads] == ["b"]
        await n1.answer(0, ok=False, code=ErrorCode.MODEL_LOAD_REFUSED, message="a", pinned=("a",))
        assert run.outcome is None
        n2.offers["c"] = offer("c", "ready")  # its run ended
        await n2.models()
        assert [ev.request.model for ev in n2.loads] == ["b"]
        await n2.models(b="ready")
        await n2.answer(0)
        await serve_one(n2, "r1")
        assert (await drain_events(run))[-1] == Complete()


async def test_a_load_that_does_not_come_in_time_ends_503_model_load_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge(od_config(model_load_wait_s=30.0)) as (core, nursery):
        await join(core, nursery, "n1", [offer("a")], 100)
        # Relative: the edge's start (its batch store opens in a thread) may
        # move the autojump clock before the run starts.
        began = trio.current_time()
        run = core.start_run(spec("a"))
        (end,) = await drain_events(run)
        assert isinstance(end, Error)
        assert (end.status, end.code) == (503, ErrorCode.MODEL_LOAD_TIMEOUT)
        assert "model 'a' was not loaded within 30s" in end.message
        assert trio.current_time() - began == pytest.approx(30.0, abs=0.1)


async def test_a_model_a_node_serves_is_not_loaded_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge() as (core, nursery):
        n1 = await join(core, nursery, "n1", [offer("a")], 100)
        n2 = await join(core, nursery, "n2", [offer("a", "ready")], 100)
        run = core.start_run(spec("a"))
        await serve_one(n2, "r1")
        assert (await drain_events(run))[-1] == Complete()
        assert n1.loads == []
        assert n2.loads == []
        assert run.timeline.model_load is None


async def test_the_node_lost_while_loading_sends_the_waiters_to_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge() as (core, nursery):
        n1 = await join(core, nursery, "n1", [offer("a")], 100)
        n2 = await join(core, nursery, "n2", [offer("a")], 100)
        run = core.start_run(spec("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert (len(n1.loads), len(n2.loads)) == (1, 0)
        await n1.chan.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert len(n2.loads) == 1
        run.cancel(CancelReason.EXPLICIT)


# --- which node loads it ----------------------------------------------------------------


def conn(node_id: str, memory: int, *offers: ModelOffer, in_flight: int = 0) -> NodeConnection:
    session = EdgeSession(tokens=["t"], heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0, now=0.0)
    c = NodeConnection(node_id, session, {}, connected_at=0.0, memory_mib=memory)
    c.update_instances([model_caps(o.model) for o in offers])
    c.update_models(list(offers))
    for inst in c.instances.values():
        inst.in_flight = in_flight
    return c


def wanted(c: NodeConnection, name: str = "x") -> tuple[NodeConnection, InstanceState]:
    return c, c.instances[name]


def test_a_node_with_free_memory_comes_before_one_that_must_evict() -> None:
    full = conn("a-full", 100, offer("x"), offer("y", "ready"))
    free = conn("b-free", 100, offer("x"))
    choice, _ = choose_load([wanted(full), wanted(free)])
    assert choice is not None
    assert choice.conn.node_id == "b-free"
    assert "free" in choice.why


def test_a_load_on_its_way_comes_before_free_memory() -> None:
    free = conn("a-free", 100, offer("x"))
    loading = conn("b-loading", 100, offer("x", "loading"))
    choice, _ = choose_load([wanted(free), wanted(loading)])
    assert choice is not None
    assert choice.conn.node_id == "b-loading"


def test_a_node_whose_memory_is_held_by_runs_or_pins_is_no_candidate() -> None:
    held = conn("busy", 100, offer("x"), offer("y", "ready", runs=1))
    pinned = conn("pinned", 100, offer("x"), offer("y", "ready", pinned=True))
    choice, why = choose_load([wanted(held), wanted(pinned)])
    assert choice is None
    assert len(why) == 2
    assert "no room for x" in why[0]
    # An idle one may go: the node evicts it.
    idle = conn("idle", 100, offer("x"), offer("y", "ready"))
    choice, _ = choose_load([wanted(held), wanted(idle)])
    assert choice is not None
    assert choice.conn.node_id == "idle"


def test_between_equal_nodes_the_one_with_fewer_runs_loads() -> None:
    busy = conn("a", 100, offer("x"), in_flight=3)
    idle = conn("b", 100, offer("x"))
    choice, _ = choose_load([wanted(busy), wanted(idle)])
    assert choice is not None
    assert choice.conn.node_id == "b"


def test_the_ranks_are_ordered_and_a_node_without_budget_has_room() -> None:
    assert RANK_LOADING < RANK_FREE < RANK_EVICTS
    unbounded = conn("u", 0, offer("x", memory=10**6))
    choice, _ = choose_load([wanted(unbounded)])
    assert choice is not None
    assert choice.why == "no memory budget"


async def test_the_runs_ttft_deadline_bounds_its_wait_for_a_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge(od_config(model_load_wait_s=60.0)) as (core, nursery):
        await join(core, nursery, "n1", [offer("a")], 100)
        began = trio.current_time()  # relative: as in the test above
        with pytest.raises(IopError) as late:
            await core.scheduler.acquire("a", share=QueueShare(objective="chat", deadline_s=3.0))
        assert late.value.code == ErrorCode.MODEL_LOAD_TIMEOUT
        assert "within 3s" in late.value.message
        assert trio.current_time() - began == pytest.approx(3.0, abs=0.1)


async def test_a_waiter_of_a_loaded_but_busy_model_asks_for_no_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two runs wait for a; the node refuses its load (backoff 5 s), then
    # loads it anyway (another edge asked later): a has one slot. The second
    # run waits for that slot; when the backoff ends and wakes it, it must
    # not ask for a load of a model that is loaded.
    async with edge(od_config(model_load_backoff_s=5.0)) as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a")], 100)
        runs = [core.start_run(spec("a", f"r{i}")) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        await node.answer(0, ok=False, code=ErrorCode.MODEL_LOAD_REFUSED, message="in the way")
        await trio.sleep(1.0)
        node.session.capabilities(
            [
                msgspec.structs.replace(
                    model_caps("a", slots=1), provider_status=ProviderStatus.AVAILABLE
                )
            ],
            [offer("a", "ready")],
        )
        await node.flush()
        first = await node.assigns.receive()
        await trio.sleep(5.0)  # the backoff ends: the second run wakes
        await trio.testing.wait_all_tasks_blocked()
        assert len(node.loads) == 1
        await node.send(first.assign.run_id, Start(), Complete())
        await serve_one(node)
        for run in runs:
            assert (await drain_events(run))[-1] == Complete()


async def test_runs_that_waited_for_room_fail_with_the_load_a_later_change_started(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # No room at first (b holds the memory with a run): the runs for a wait
    # with no load asked. b's run ends: one load of a is asked for; it fails,
    # and every run waiting for a ends with it, not at model_load_wait_s.
    async with edge(od_config(model_load_wait_s=60.0)) as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a"), offer("b", "ready", runs=1)], 100)
        began = trio.current_time()  # relative: as in the tests above
        runs = [core.start_run(spec("a", f"r{i}")) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        assert node.loads == []
        assert "no room for a" in (runs[0].timeline.why_queued or "")
        node.offers["b"] = offer("b", "ready")  # its run ended
        await node.models()
        assert [ev.request.model for ev in node.loads] == ["a"]
        await trio.sleep(1.0)
        await node.answer(0, ok=False, code=ErrorCode.MODEL_LOAD_FAILED, message="bad gguf")
        for run in runs:
            (end,) = await drain_events(run)
            assert isinstance(end, Error)
            assert end.code == ErrorCode.MODEL_LOAD_FAILED
            assert "bad gguf" in end.message
        assert trio.current_time() - began == pytest.approx(1.0, abs=0.1)


async def test_a_model_this_edge_has_runs_on_is_not_counted_as_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The node learns of a run only when its Assign arrives, and its offer
    still says the model is idle: a load asked for meanwhile would make the
    node evict the model the run is on its way to (seen in the tight
    on-demand benchmark as 503 ``model_load_refused``). With room for one
    model, b waits until a's run on this edge has ended, then loads."""
    async with edge() as (core, nursery):
        node = await join(core, nursery, "n1", [offer("a", "ready"), offer("b")], 60)
        await node.models()  # a's instance usable
        on_a = core.start_run(spec("a", "ra"))
        await trio.testing.wait_all_tasks_blocked()
        assign = await node.assigns.receive()
        assert assign.assign.run_id == "ra"
        for_b = core.start_run(spec("b", "rb"))
        await trio.testing.wait_all_tasks_blocked()
        assert node.loads == []  # not while a's run is this edge's
        assert "no room for b" in (for_b.timeline.why_queued or "")
        await node.send("ra", Start(), Complete())
        assert (await drain_events(on_a))[-1] == Complete()
        await trio.testing.wait_all_tasks_blocked()
        assert [ev.request.model for ev in node.loads] == ["b"]
        await node.models(a="cold", b="ready")
        await node.answer(0)
        await serve_one(node, "rb")
        assert (await drain_events(for_b))[-1] == Complete()
