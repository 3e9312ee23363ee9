"""The node's on-demand models in trio (``iop.node._models``), with sim models in
virtual time: one load for many runs, eviction, refusals, backoff, idle unloads,
and a run assigned to a cold model through a real node agent."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from iop.config import ModelConfig, NodeConfig, NodeSection, SimModel, SuperviseSettings
from iop.errors import BackendUnavailable, ErrorCode, LinkProtocolError
from iop.events import Complete, Error
from iop.managed import ModelBackend, Supervisor, build_model_backend
from iop.node import open_node_agent
from iop.node._models import ModelManager
from iop.ondemand import ModelState
from iop.protocol import EdgeLinkEvent, ModelLoadAnswered, ModelLoadResult
from tests.node.test_agent import EDGE, assert_grammar, link, running_node, sim

S = ModelState


def model(name: str, **kw: Any) -> SimModel:
    """A sim model; keys of ``SimConfig`` go to ``sim``, the others to the model."""
    sim_keys = {"load_time_s", "memory_mib", "ttft_s", "output_tokens"}
    sim = {"ttft_s": 0.0, "output_tokens": 4} | {k: v for k, v in kw.items() if k in sim_keys}
    rest = {k: v for k, v in kw.items() if k not in sim_keys}
    return msgspec.convert({"engine": "sim", "name": name, "sim": sim, **rest}, SimModel)


def section(**kw: Any) -> NodeSection:
    return msgspec.convert({"id": "n1", "edges": [msgspec.to_builtins(EDGE)], **kw}, NodeSection)


class Counting:
    """The backend factory, counting the loads it starts (the boundary, not the table)."""

    def __init__(self, make: Callable[[ModelConfig], ModelBackend] = build_model_backend) -> None:
        self.loads: list[str] = []
        self._make = make

    def __call__(self, cfg: ModelConfig) -> ModelBackend:
        self.loads.append(cfg.name)
        return self._make(cfg)


class FailingBackend:
    """A backend whose every start fails as an engine out of memory would."""

    def __init__(self, cfg: ModelConfig) -> None:
        async def serve(*, on_exit: Callable[[str], None], task_status: Any) -> None:
            await trio.sleep(1.0)
            raise BackendUnavailable(f"model {cfg.name}: CUDA out of memory")

        self.supervisor: Supervisor[None] = Supervisor(cfg.name, serve, SuperviseSettings())

    @property
    def adapter(self) -> Any:
        raise AssertionError("a failed load has no adapter")

    async def aclose(self) -> None:
        pass


@asynccontextmanager
async def manager(
    *models: SimModel, backends: Callable[[ModelConfig], ModelBackend], **node: Any
) -> AsyncIterator[ModelManager]:
    node.setdefault("memory_mib", 100)
    mgr = ModelManager(models, [], section(**node), backends=backends)
    async with trio.open_nursery() as nursery:
        await nursery.start(mgr.serve)
        yield mgr
        nursery.cancel_scope.cancel()


async def test_many_concurrent_runs_of_a_cold_model_start_one_load(
    autojump_clock: trio.abc.Clock,
) -> None:
    counting = Counting()
    async with manager(model("a", load_time_s=30.0, memory_mib=10), backends=counting) as mgr:
        leases = []

        async def run() -> None:
            leases.append(await mgr.acquire("a", 300.0))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(run)
        assert counting.loads == ["a"]
        assert len(leases) == 10
        assert len({id(lease.adapter) for lease in leases}) == 1
        assert mgr.table.models["a"].leases == 10
        assert mgr.table.models["a"].last_load_s == pytest.approx(30.0)
        for lease in leases:
            mgr.release(lease)
        assert mgr.table.models["a"].leases == 0


async def test_a_load_that_needs_the_memory_evicts_the_idle_model(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iop.node.models")
    counting = Counting()
    a, b = model("a", memory_mib=60, load_time_s=2.0), model("b", memory_mib=60, load_time_s=2.0)
    async with manager(a, b, backends=counting) as mgr:
        mgr.release(await mgr.acquire("a", 300.0))
        lease = await mgr.acquire("b", 300.0)
        assert mgr.table.models["a"].state is S.COLD
        assert mgr.table.models["b"].state is S.READY
        assert mgr.table.resident_mib() == 60
        mgr.release(lease)
    assert counting.loads == ["a", "b"]
    messages = [r.getMessage() for r in caplog.records]
    assert "model a: unloading: evicted for b" in messages
    assert any(m.startswith("model a: unloaded after") for m in messages)
    assert any(m.startswith("model b: loading (60 MiB of 100; evicting a)") for m in messages)
    assert any(m.startswith("model b: ready, loaded in 2s") for m in messages)


async def test_a_model_a_run_holds_is_never_evicted_the_load_is_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    a, b = model("a", memory_mib=60), model("b", memory_mib=60)
    async with manager(a, b, backends=Counting()) as mgr:
        lease = await mgr.acquire("a", 300.0)
        with pytest.raises(BackendUnavailable) as refused:
            await mgr.acquire("b", 300.0)
        assert refused.value.code == ErrorCode.MODEL_LOAD_REFUSED
        assert "a (1 run in flight)" in refused.value.message
        assert mgr.table.models["a"].state is S.READY
        mgr.release(lease)
        # Once the run ended, b may have a's memory.
        mgr.release(await mgr.acquire("b", 300.0))


async def test_a_failed_load_is_reported_with_its_reason_and_backs_off(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    counting = Counting(FailingBackend)
    async with manager(model("a"), backends=counting, model_retry_min_s=10.0) as mgr:
        with pytest.raises(BackendUnavailable) as failed:
            await mgr.acquire("a", 300.0)
        assert failed.value.code == ErrorCode.MODEL_LOAD_FAILED
        assert "CUDA out of memory" in failed.value.message
        # Within the backoff: refused at once, with the reason, and no new load.
        with pytest.raises(BackendUnavailable) as again:
            await mgr.acquire("a", 300.0)
        assert again.value.code == ErrorCode.MODEL_LOAD_FAILED
        assert "model a failed to load" in again.value.message
        assert counting.loads == ["a"]
        offer = mgr.offers()[0]
        assert offer.state == "failed"
        assert "CUDA out of memory" in offer.detail
        assert offer.retry_in_s > 0
        await trio.sleep(10.0)
        with pytest.raises(BackendUnavailable):
            await mgr.acquire("a", 300.0)
        assert counting.loads == ["a", "a"]  # loaded again after the backoff
    assert any(
        r.getMessage().startswith("model a: load failed after 1s: model a: CUDA out of memory")
        for r in caplog.records
    )


async def test_a_load_past_the_deadline_is_a_timeout(autojump_clock: trio.abc.Clock) -> None:
    async with manager(model("a", load_time_s=600.0), backends=Counting()) as mgr:
        with pytest.raises(BackendUnavailable) as late:
            await mgr.acquire("a", 5.0)
        assert late.value.code == ErrorCode.MODEL_LOAD_TIMEOUT
        assert mgr.table.models["a"].state is S.LOADING  # the load goes on


async def test_an_idle_model_unloads_after_its_ttl_and_a_pinned_one_loads_at_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    a = model("a", idle_ttl_s=60.0, memory_mib=10)
    p = model("p", pinned=True, memory_mib=10, load_time_s=3.0)
    async with manager(a, p, backends=Counting()) as mgr:
        with trio.fail_after(10):
            await mgr.wait_state("p", S.READY)
        mgr.release(await mgr.acquire("a", 300.0))
        with trio.fail_after(61):
            await mgr.wait_state("a", S.COLD)
        assert mgr.table.models["p"].state is S.READY


# --- through the node --------------------------------------------------------------------


async def test_a_run_assigned_to_a_cold_model_loads_it_and_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = NodeConfig(
        node=section(memory_mib=100),
        models=[model("a", load_time_s=20.0, memory_mib=60), model("b", memory_mib=60)],
    )
    async with open_node_agent(cfg) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        assert edge.hello is not None
        assert [(o.model, o.state) for o in edge.hello.models] == [("a", "cold"), ("b", "cold")]
        assert edge.hello.memory_mib == 100
        caps = {c.instance: c for c in edge.hello.instances}
        assert caps["a"].provider_status == "unavailable"
        assert caps["a"].targets == ("a",)
        await edge.assign("r1", instance="a")
        events = await edge.wait_finished("r1")
        assert_grammar(events)
        assert isinstance(events[-1], Complete)
        snap = agent.snapshot()
        assert [(m.model, m.state, m.load_s) for m in snap.models] == [
            ("a", "ready", 20.0),
            ("b", "cold", 0.0),
        ]
        # A run of the other model while a's memory is free again: a is evicted.
        await edge.assign("r2", instance="b")
        assert isinstance((await edge.wait_finished("r2"))[-1], Complete)
        states = {m.model: m.state for m in agent.snapshot().models}
        assert states == {"a": "cold", "b": "ready"}
        nursery.cancel_scope.cancel()


async def test_a_run_of_a_model_that_cannot_load_ends_with_the_reason(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = NodeConfig(node=section(memory_mib=100), models=[model("a")])
    mgr = ModelManager(cfg.models, [], cfg.node, backends=FailingBackend)
    async with open_node_agent(cfg, models=mgr) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        await edge.assign("r1", instance="a")
        (error,) = await edge.wait_finished("r1")
        assert isinstance(error, Error)
        assert error.code == ErrorCode.MODEL_LOAD_FAILED
        assert "CUDA out of memory" in error.message
        nursery.cancel_scope.cancel()


async def test_the_edge_asks_for_a_model_and_hears_when_it_is_ready(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = NodeConfig(node=section(memory_mib=100), models=[model("a", load_time_s=7.0)])
    async with open_node_agent(cfg) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        answers: list[ModelLoadResult] = []
        receive = edge.session.receive

        def recording(frame: bytes, now: float) -> list[EdgeLinkEvent]:
            events = receive(frame, now)
            answers.extend(e.result for e in events if isinstance(e, ModelLoadAnswered))
            return events

        edge.session.receive = recording  # type: ignore[method-assign]
        edge.session.load_model("q1", "a")
        edge.session.load_model("q2", "nope")
        await edge.flush()
        while len(answers) < 2:
            await edge.progress.wait()
        by_id = {a.request_id: a for a in answers}
        assert by_id["q1"].ok
        assert agent.snapshot().models[0].state == "ready"
        assert not by_id["q2"].ok
        assert by_id["q2"].code == ErrorCode.UNKNOWN_INSTANCE
        assert edge.caps_updates  # the state changes reached the edge
        nursery.cancel_scope.cancel()


async def test_the_edge_hears_a_load_past_the_deadline_as_a_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = NodeConfig(
        node=section(memory_mib=100, model_load_timeout_s=5.0),
        models=[model("a", load_time_s=600.0)],
    )
    async with open_node_agent(cfg) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        answers: list[ModelLoadResult] = []
        receive = edge.session.receive

        def recording(frame: bytes, now: float) -> list[EdgeLinkEvent]:
            events = receive(frame, now)
            answers.extend(e.result for e in events if isinstance(e, ModelLoadAnswered))
            return events

        edge.session.receive = recording  # type: ignore[method-assign]
        edge.session.load_model("q1", "a")
        await edge.flush()
        while not answers:
            await edge.progress.wait()
        assert not answers[0].ok
        assert answers[0].code == ErrorCode.MODEL_LOAD_TIMEOUT
        assert "model_load_timeout_s" in answers[0].message
        assert agent.snapshot().models[0].state == "loading"  # the load goes on
        nursery.cancel_scope.cancel()


async def test_the_edge_hears_whether_a_refusal_lasts_until_a_model_is_unpinned(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A load refused because pinned models alone leave no room lasts until an
    operator unpins one: the answer names them (``pinned``), and the edge
    answers its runs at once. One refused for a model inside its
    ``min_residency_s`` passes: no names, the edge waits and asks again."""
    cfg = NodeConfig(
        node=section(memory_mib=100),
        models=[
            model("a", memory_mib=60, pinned=True),
            model("b", memory_mib=60),
            model("q", memory_mib=30, min_residency_s=600.0),
            model("r", memory_mib=30),
        ],
    )
    async with open_node_agent(cfg) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        answers: dict[str, ModelLoadResult] = {}
        receive = edge.session.receive

        def recording(frame: bytes, now: float) -> list[EdgeLinkEvent]:
            events = receive(frame, now)
            answers.update(
                (e.result.request_id, e.result) for e in events if isinstance(e, ModelLoadAnswered)
            )
            return events

        edge.session.receive = recording  # type: ignore[method-assign]
        for request_id, name in [("q1", "a"), ("q2", "q")]:
            edge.session.load_model(request_id, name)
            await edge.flush()
            while request_id not in answers:
                await edge.progress.wait()
            assert answers[request_id].ok
        edge.session.load_model("q3", "b")
        edge.session.load_model("q4", "r")
        await edge.flush()
        while len(answers) < 4:
            await edge.progress.wait()
        lasting, passing = answers["q3"], answers["q4"]
        assert (lasting.ok, lasting.code) == (False, ErrorCode.MODEL_LOAD_REFUSED)
        assert lasting.pinned == ("a",)
        assert "a (pinned)" in lasting.message
        assert (passing.ok, passing.code) == (False, ErrorCode.MODEL_LOAD_REFUSED)
        assert passing.pinned == ()
        assert "min_residency_s" in passing.message
        nursery.cancel_scope.cancel()


async def test_load_model_to_a_node_that_offers_no_models_breaks_the_protocol(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with running_node(sim()) as agent, trio.open_nursery() as nursery:
        edge = await link(nursery, agent)
        assert edge.hello is not None
        assert edge.hello.models == []
        edge.session.load_model("q1", "a")
        await edge.flush()
        await edge.node_done.wait()
        assert isinstance(edge.node_error, LinkProtocolError)
        assert "offered no models" in edge.node_error.message
        nursery.cancel_scope.cancel()


async def test_a_reload_keeps_the_models_instances(autojump_clock: trio.abc.Clock) -> None:
    cfg = NodeConfig(node=section(memory_mib=100), instances=[sim("s")], models=[model("a")])
    async with open_node_agent(cfg) as agent, trio.open_nursery() as nursery:
        agent.apply_config(msgspec.structs.replace(cfg, instances=[sim("s", output_tokens=2)]))
        edge = await link(nursery, agent)
        await edge.assign("r1", instance="a")
        assert isinstance((await edge.wait_finished("r1"))[-1], Complete)
        nursery.cancel_scope.cancel()
