"""Objectives in the edge's queue (iop.edge.scheduler, docs/operations.md, "Sessions and
objectives"): priority first, then the earliest deadline; a deadline that cannot be
met is refused at once; sheddable runs go first under overload. On an edge core
with a hand-played node and a virtual clock; the config's rules at the end."""

from __future__ import annotations

import hashlib

import pytest
import trio
import trio.testing

from iop.config import EdgeConfig, Objective, SchedulerSettings, decode_config
from iop.edge import EdgeCore
from iop.edge.scheduler import QueueExit
from iop.errors import ConfigError, ErrorCode, IopError, RequestError
from iop.events import Error
from iop.runtime import Run
from iop.spec import ChatRequest, ExecutionSpec, Message, Routing
from tests.edge.test_core import caps, config, drain_events, edge_with_node
from tests.edge.test_fair_queue import served_order, tenant

OBJECTIVES = [
    Objective(name="interactive", priority=10, ttft_deadline_s=30.0),
    Objective(name="batch", priority=0, sheddable=True),
]


def setup(max_queue: int = 64, **sched: object) -> EdgeConfig:
    # The queue's order alone: the hand-played node sends nothing until a run
    # is served, so each running batch run could be preempted
    # (tests/edge/test_preemption.py has that).
    sched.setdefault("max_preemptions", 0)
    settings = SchedulerSettings(
        max_queue=max_queue,
        queue_timeout_s=600.0,
        max_queue_delay_s=0.0,
        **sched,  # type: ignore[arg-type]
    )
    return config(scheduler=settings, tenants=[tenant("a")], objectives=OBJECTIVES)


def start(core: EdgeCore, run_id: str, objective: str = "", ttft_s: float | None = None) -> Run:
    routing = Routing(objective=objective, ttft_deadline_s=ttft_s)
    request = ChatRequest(model="m", messages=[Message(role="user", content="hi")], routing=routing)
    ticket = core.tenants.admit(core.tenants.all["a"], 0, trio.current_time())
    return core.start_run(ExecutionSpec(run_id=run_id, request=request), ticket=ticket)


async def submit(core: EdgeCore, run_ids: list[str], **kw: object) -> dict[str, Run]:
    runs = {}
    for rid in run_ids:
        runs[rid] = start(core, rid, **kw)  # type: ignore[arg-type]
        await trio.testing.wait_all_tasks_blocked()
    return runs


async def test_a_higher_priority_is_served_first(autojump_clock: trio.testing.MockClock) -> None:
    async with edge_with_node(setup(), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["b0", "b1", "b2", "b3"], objective="batch")
        runs |= await submit(core, ["i0", "i1"], objective="interactive")
        runs |= await submit(core, ["n0"])  # no objective: priority 0, like batch
        order = await served_order(node, runs, 7)
    assert order == ["b0", "i0", "i1", "b1", "b2", "b3", "n0"]


async def test_within_a_priority_the_earliest_deadline_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["r0"])
        runs |= await submit(core, ["none"])
        runs |= await submit(core, ["late"], ttft_s=100.0)
        runs |= await submit(core, ["early"], ttft_s=10.0)
        order = await served_order(node, runs, 4)
    # No deadline is the latest; arrival order would be none, late, early.
    assert order == ["r0", "early", "late", "none"]


async def test_a_deadline_the_queue_cannot_meet_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(), [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["r0", "r1"])  # r0 runs, r1 waits
        await trio.sleep(2.0)  # r1 has waited 2 s for nothing to leave: the line drains slowly
        with pytest.raises(IopError) as info:
            start(core, "hurried", ttft_s=1.0)
        assert info.value.status == 429
        assert info.value.code == ErrorCode.QUEUE_FULL
        assert "deadline" in info.value.message
        assert core.scheduler.refused["deadline"] == 1
        # One that can wait that long is queued.
        runs |= await submit(core, ["patient"], ttft_s=60.0)
        assert core.scheduler.queued == 2
        await served_order(node, runs, 3)


async def test_sheddable_runs_are_refused_past_the_shed_threshold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(max_queue=4, shed_queue_fraction=0.5)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["b0", "b1", "b2"], objective="batch")  # 1 runs, 2 wait
        with pytest.raises(IopError) as info:
            start(core, "b3", objective="batch")
        assert info.value.status == 429
        assert "sheddable" in info.value.message
        assert core.scheduler.refused["shed"] == 1
        runs |= await submit(core, ["i0"], objective="interactive")  # not sheddable: queued
        assert core.scheduler.queued == 3
        await served_order(node, runs, 4)


async def test_a_full_queue_sheds_its_newest_sheddable_run_for_one_that_is_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = setup(max_queue=2, shed_queue_fraction=1.0)
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["b0", "b1", "b2"], objective="batch")  # full: 2 wait
        with pytest.raises(IopError):
            start(core, "b3", objective="batch")  # sheddable: no one to evict for it
        runs |= await submit(core, ["i0"], objective="interactive")
        shed = runs.pop("b2")
        events = await drain_events(shed)
        assert isinstance(events[-1], Error)
        assert events[-1].status == 429
        assert events[-1].code == ErrorCode.QUEUE_FULL
        assert "shed" in events[-1].message
        assert core.scheduler.exits[QueueExit.SHED] == 1
        assert core.scheduler.queued == 2
        order = await served_order(node, runs, 3)
    assert order == ["b0", "i0", "b1"]


async def test_an_unknown_objective_is_a_400_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(setup(), [caps(slots=1)]) as (core, _, _):
        with pytest.raises(RequestError) as info:
            start(core, "r0", objective="realtime")
    assert info.value.status == 400
    assert "'realtime'" in info.value.message
    assert "'interactive'" in info.value.message
    assert info.value.param == "x-iop-objective"


async def test_a_tenants_objective_is_its_default(autojump_clock: trio.testing.MockClock) -> None:
    settings = SchedulerSettings(
        max_queue=64, queue_timeout_s=600.0, max_queue_delay_s=0.0, max_preemptions=0
    )
    cfg = config(
        scheduler=settings,
        tenants=[tenant("a", objective="batch")],
        objectives=OBJECTIVES,
    )
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, node, _):
        runs = await submit(core, ["b0", "b1"])
        runs |= await submit(core, ["i0"], objective="interactive")
        assert runs["b1"].timeline.objective == "batch"
        assert runs["i0"].timeline.to_json()["objective"] == "interactive"
        order = await served_order(node, runs, 3)
    assert order == ["b0", "i0", "b1"]


# --- the config --------------------------------------------------------------------


def edge(data: dict[str, object]) -> EdgeConfig:
    return decode_config(data, EdgeConfig, source="edge.toml")


def test_objectives_are_read_from_the_config() -> None:
    cfg = edge(
        {
            "objectives": [
                {"name": "interactive", "priority": 10, "ttft_deadline_s": 2.0},
                {"name": "batch", "sheddable": True},
            ],
            "scheduler": {"default_objective": "batch", "session_fairness": False},
        }
    )
    assert cfg.objective("interactive") == Objective(
        name="interactive", priority=10, ttft_deadline_s=2.0
    )
    assert cfg.scheduler.default_objective == "batch"


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"objectives": [{"name": "x", "prio": 1}]}, r"unknown key 'objectives\[0\]\.prio'"),
        ({"scheduler": {"session_fairnes": True}}, r"unknown key 'scheduler\.session_fairnes'"),
        ({"objectives": [{"name": "x"}, {"name": "x"}]}, "a name is used twice"),
        ({"objectives": [{"name": "x", "priority": 1001}]}, "priority must be between"),
        ({"objectives": [{"name": "x", "ttft_deadline_s": 0}]}, "ttft_deadline_s must be > 0"),
        ({"objectives": [{"name": "no spaces"}]}, "objective name"),
        ({"scheduler": {"default_objective": "gold"}}, r"scheduler\.default_objective.*'gold'"),
        ({"scheduler": {"max_sessions_per_tenant": 0}}, "max_sessions_per_tenant"),
        ({"scheduler": {"unkeyed_session_weight": 0}}, "unkeyed_session_weight"),
        ({"scheduler": {"shed_queue_fraction": 0}}, "shed_queue_fraction"),
        ({"scheduler": {"shed_queue_fraction": 1.5}}, "shed_queue_fraction"),
        ({"objectives": [{"name": f"o{i}"} for i in range(65)]}, "at most 64"),
    ],
)
def test_the_config_refuses_what_it_cannot_mean(data: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        edge(data)


def test_a_tenants_objective_must_exist() -> None:
    digest = hashlib.sha256(b"k").hexdigest()
    with pytest.raises(ConfigError, match=r"tenants\[a\]\.objective.*'gold'"):
        edge({"tenants": [{"name": "a", "key_sha256": [digest], "objective": "gold"}]})


# --- tenants are walls: a header cannot lift a tenant above its neighbours ------------


async def test_among_tenants_a_request_cannot_name_an_objective_above_its_tenants(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Objective priority is weighed before a tenant's class and share, so a
    tenant's client naming the top objective on every request would starve
    its neighbours: among several tenants, a request may name only objectives
    no higher than its tenant's own (or those its tenant lists)."""
    settings = SchedulerSettings(max_queue=64, queue_timeout_s=600.0, max_queue_delay_s=0.0)
    cfg = config(
        scheduler=settings,
        tenants=[tenant("a"), tenant("b", objectives=["interactive"])],
        objectives=OBJECTIVES,
    )
    async with edge_with_node(cfg, [caps(slots=1)]) as (core, _, _):

        def named(who: str, run_id: str, objective: str) -> Run:
            routing = Routing(objective=objective)
            request = ChatRequest(
                model="m", messages=[Message(role="user", content="hi")], routing=routing
            )
            ticket = core.tenants.admit(core.tenants.all[who], 0, trio.current_time())
            return core.start_run(ExecutionSpec(run_id=run_id, request=request), ticket=ticket)

        with pytest.raises(RequestError) as info:
            named("a", "a0", "interactive")
        assert info.value.status == 400
        assert info.value.param == "x-iop-objective"
        assert "'interactive'" in info.value.message
        assert "tenant 'a'" in info.value.message
        # Lower, or equal, is always allowed; a listed objective too.
        assert named("a", "a1", "batch").timeline.objective == "batch"
        assert named("b", "b0", "interactive").timeline.objective == "interactive"


def test_a_tenants_objectives_must_exist() -> None:
    with pytest.raises(ConfigError, match=r"tenants\[a\]\.objectives: no objective is called 'x'"):
        edge(
            {
                "objectives": [{"name": "batch"}],
                "tenants": [{"name": "a", "key_sha256": ["0" * 64], "objectives": ["x"]}],
            }
        )
