"""The edge's view of a node's on-demand models (``iop.edge.runs._model_controls``):
what the counters add up to, what the admin view shows, and the wait for a
control's answer, in memory with virtual time."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from iop.edge.runs import LOAD_TIME_BUCKETS, ModelStats, NodeModels
from iop.protocol import EdgeSession, ModelAction, ModelControlResult, ModelOffer, NodeSession
from tests.protocol.test_protocol import CAPS, pair

A = ModelOffer(model="a", state="cold", memory_mib=100)


def offer(**kw: object) -> ModelOffer:
    return msgspec.structs.replace(A, **kw)


def test_the_stats_count_what_the_counters_rose_by() -> None:
    stats = ModelStats()
    models = NodeModels([A], 200, now=0.0)
    stats.known("a")
    models.update([offer(state="ready", loads=1, load_s=3.0)], 1.0, stats)
    models.update([offer(state="ready", loads=3, load_s=40.0, cold_starts=5)], 2.0, stats)
    models.update([offer(state="unloading", loads=3, evictions=1, cold_starts=5)], 3.0, stats)
    t = stats.totals["a"]
    # Cold starts are the edge's own count, once per run (EdgeMetrics.record):
    # the node's (runs it made wait) would count some runs twice.
    assert (t.loads, t.evictions, t.cold_starts, t.load_failures) == (3, 1, 0, 0)
    stats.cold_start("a")
    assert t.cold_starts == 1
    # One load of 3 s, two at about the last one's 40 s.
    assert t.load_sum_s == pytest.approx(83.0)
    assert t.load_buckets[LOAD_TIME_BUCKETS.index(5.0)] == 1
    assert t.load_buckets[LOAD_TIME_BUCKETS.index(60.0)] == 2


def test_a_new_link_is_its_own_baseline_and_a_falling_counter_counts_nothing() -> None:
    stats = ModelStats()
    first = NodeModels([offer(loads=4)], 200)
    first.update([offer(loads=5)], 1.0, stats)
    # The node reconnects: its hello's counters are where the new link starts.
    again = NodeModels([offer(loads=5)], 200)
    again.update([offer(loads=5)], 2.0, stats)
    again.update([offer(loads=2, evictions=0)], 3.0, stats)
    assert stats.totals["a"].loads == 1


def test_the_view_shows_memory_used_and_the_time_loading_and_left_to_retry() -> None:
    models = NodeModels(
        [
            offer(state="loading", loading_s=2.0),
            offer(model="b", state="failed", retry_in_s=10.0, detail="exited with 1"),
            offer(model="c", state="ready", memory_mib=50, pinned=True),
            offer(model="d"),
        ],
        200,
        controls=True,
        now=100.0,
    )
    view = models.view(103.0)
    assert view["memory_mib"] == {"used": 150, "budget": 200}
    assert view["controls"] is True
    entries = view["models"]
    assert isinstance(entries, list)
    by_name = {m["model"]: m for m in entries}
    assert by_name["a"]["loading_for_s"] == 5.0
    assert by_name["b"]["retry_in_s"] == 7.0
    assert by_name["b"]["detail"] == "exited with 1"
    # Every field, defaults too.
    assert by_name["d"]["pinned"] is False
    assert by_name["d"]["runs"] == 0
    assert by_name["c"]["pinned"] is True


def _open_controlled() -> tuple[EdgeSession, NodeSession]:
    edge, node = pair()
    edge.receive(node.hello([CAPS], models=[A], model_controls=True), 0.0)
    node.receive(edge.welcome(), 0.0)
    return edge, node


async def test_a_control_waits_for_its_answer(autojump_clock: trio.testing.MockClock) -> None:
    edge, _ = _open_controlled()
    models = NodeModels([A], 200, controls=True)
    woken = []
    got: list[ModelControlResult | None] = []

    async def ask() -> None:
        got.append(
            await models.control(
                edge, lambda: woken.append(1), "a", ModelAction.PIN, by="me", timeout_s=5.0
            )
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(1.0)
        assert woken == [1]
        [request_id] = models._pending
        models.answer(ModelControlResult(request_id=request_id, model="a", ok=True))
    assert got[0] is not None
    assert got[0].ok


async def test_a_control_unanswered_ends_at_its_timeout_or_when_the_link_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, _ = _open_controlled()
    models = NodeModels([A], 200, controls=True)
    start = trio.current_time()
    assert (
        await models.control(edge, lambda: None, "a", ModelAction.LOAD, by="", timeout_s=2.0)
        is None
    )
    assert trio.current_time() - start == pytest.approx(2.0)
    assert not models._pending

    async with trio.open_nursery() as nursery:

        async def ask() -> None:
            result = await models.control(
                edge, lambda: None, "a", ModelAction.LOAD, by="", timeout_s=60.0
            )
            assert result is None
            assert trio.current_time() - start == pytest.approx(3.0)

        nursery.start_soon(ask)
        await trio.sleep(1.0)
        models.close()
