"""Run timelines (iop.timeline): the record, its bounds, and what the
runtime writes into it (virtual time)."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from iop.config import Deadlines
from iop.events import Cancelled, CancelReason, Complete, Delta, Error, Start
from iop.runtime import EventSender, open_run_supervisor
from iop.runtime._run import _RunSink
from iop.timeline import (
    NodeTimeline,
    Placement,
    Stall,
    StallKind,
    Timeline,
    TimelineRing,
    outcome_label,
)
from tests.runtime.test_run import NO_DEADLINES, SPEC, ScriptedAdapter, script


def test_stalls_past_the_cap_are_counted_not_kept() -> None:
    t = Timeline(run_id="r", max_stalls=2)
    kept = [t.stall_began(StallKind.CREDIT, float(i)) for i in range(5)]
    assert [s is not None for s in kept] == [True, True, False, False, False]
    assert len(t.stalls) == 2
    assert t.stalls_dropped == 3
    assert t.summary()["stalls"] == 5


def test_the_phase_follows_the_run() -> None:
    t = Timeline(run_id="r", received=10.0)
    assert t.phase == "received"
    t.queued = 10.1
    assert t.phase == "queued"
    t.dequeued = 10.2
    t.placements.append(Placement(attempt=1, node="n", instance="i", at=10.2))
    assert t.phase == "placed"
    t.first_output = 10.3
    assert t.phase == "streaming"
    stall = t.stall_began(StallKind.CLIENT_WRITE, 10.4, 100)
    assert t.phase == "stalled"
    assert stall is not None
    stall.end = 10.5
    assert t.phase == "streaming"
    t.cancel(10.6, CancelReason.CLIENT_DISCONNECT)
    t.cancel(10.7, CancelReason.IDLE_TIMEOUT)  # the first cancel stands
    assert t.phase == "cancelling"
    t.end(10.8, Cancelled(reason=CancelReason.CLIENT_DISCONNECT))
    assert t.phase == "done"
    view = t.to_json()
    assert view["queued_ms"] == 100.0
    assert view["cancel_requested_ms"] == 600.0
    assert view["cancel_cause"] == "client_disconnect"
    assert view["outcome"] == "cancelled:client_disconnect"
    assert view["stalls"] == [
        {"kind": "client_write", "start_ms": 400.0, "end_ms": 500.0, "size": 100}
    ]
    # JSON all the way down.
    assert msgspec.json.decode(msgspec.json.encode(view)) == view


def test_outcome_labels_match_the_metrics_keys() -> None:
    assert outcome_label(Complete(finish_reason="length")) == "complete:length"
    assert outcome_label(Cancelled(reason=CancelReason.SLOW_CLIENT)) == "cancelled:slow_client"
    assert outcome_label(Error(message="x", status=502, code="backend_error")) == (
        "error:backend_error"
    )


def test_a_node_timeline_moves_to_the_edge_clock() -> None:
    node = NodeTimeline(node="n1", started=100.0, backend_closed=101.5)
    node.stalls.append(node_stall := _stall(100.5, 100.7))
    moved = node.shifted(-90.0, 0.002)
    assert (moved.started, moved.backend_closed) == (10.0, 11.5)
    assert moved.stalls[0].start == 10.5
    assert moved.stalls[0].end == pytest.approx(10.7)
    assert moved.clock_offset_s == -90.0
    assert moved.clock_rtt_s == 0.002
    assert node_stall.start == 100.5  # the original is untouched
    edge = Timeline(run_id="r", received=9.0, node=moved)
    view = edge.to_json()["node"]
    assert isinstance(view, dict)
    assert view["started_ms"] == 1000.0
    assert view["clock_rtt_ms"] == 2.0


def _stall(start: float, end: float) -> Stall:
    t = Timeline(run_id="x")
    s = t.stall_began(StallKind.CREDIT, start)
    assert s is not None
    s.end = end
    return s


@given(capacity=st.integers(0, 8), ids=st.lists(st.integers(0, 20), max_size=40))
def test_the_ring_keeps_the_newest_and_finds_what_it_keeps(capacity: int, ids: list[int]) -> None:
    ring = TimelineRing(capacity)
    added: list[Timeline] = []
    for i in ids:
        t = Timeline(run_id=f"r{i}")
        ring.add(t)
        added.append(t)
    kept = added[-capacity:] if capacity else []
    assert list(ring.newest_first()) == kept[::-1]
    assert len(ring) == len(kept)
    for t in kept:
        # The newest timeline of an id is the one found.
        found = ring.get(t.run_id)
        assert found is [k for k in kept if k.run_id == t.run_id][-1]
    for t in added:
        if t.run_id not in {k.run_id for k in kept}:
            assert ring.get(t.run_id) is None


async def test_a_run_records_its_first_output_and_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adapter = script(Start(), Delta("a"), Delta("b"), Complete(), pause=1.0)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, NO_DEADLINES)
        got = [ev async for ev in run.events]
    t = run.timeline
    assert got[-1] == Complete()
    assert t.run_id == SPEC.run_id
    assert t.first_output is not None
    assert t.terminal is not None
    assert (t.first_output - t.received, t.terminal - t.received) == (2.0, 4.0)
    assert t.outcome == "complete:stop"
    assert t.cancel_requested is None


async def test_a_deadline_cancel_is_recorded_when_it_was_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadlines = Deadlines(first_token_timeout_s=3.0, idle_timeout_s=None, request_timeout_s=None)
    adapter = script(Start(), Delta("late"), pause=10.0)
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, SPEC, deadlines)
        async with run.events:
            _ = [ev async for ev in run.events]
    t = run.timeline
    assert t.cancel_cause is CancelReason.FIRST_TOKEN_TIMEOUT
    assert t.cancel_requested is not None
    assert t.cancel_requested - t.received == 3.0
    assert t.outcome == "cancelled:first_token_timeout"


async def test_a_consumer_that_holds_a_window_is_a_credit_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A push_nowait producer (the edge's link reader) with a window of 2:
    # the consumer leaves 2 unread for 5 s, then reads on.
    async def body(send: EventSender) -> None:
        assert isinstance(send, _RunSink)
        send.on_consumed(lambda n: None)  # credit goes back to the producer
        send.push_nowait(Start())
        send.push_nowait(Delta("a"))
        await trio.sleep(10.0)
        send.push_nowait(Complete())

    async with open_run_supervisor() as sup:
        run = sup.start_run(
            ScriptedAdapter(body),
            SPEC,
            NO_DEADLINES,
            buffer=4,
            stall_at=2,
            write_stall_timeout_s=60,
        )
        await trio.sleep(5.0)
        async with run.events:
            got = [await run.events.receive() for _ in range(3)]
    assert got[-1] == Complete()
    (stall,) = run.timeline.stalls
    assert stall.kind is StallKind.CREDIT
    assert stall.size == 2
    assert stall.start - run.timeline.received == 0.0
    assert stall.end is not None
    assert stall.end - run.timeline.received == 5.0


async def test_a_stall_still_open_at_the_end_ends_with_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def body(send: EventSender) -> None:
        assert isinstance(send, _RunSink)
        send.push_nowait(Start())
        send.push_nowait(Delta("a"))
        await trio.sleep(10.0)

    async with open_run_supervisor() as sup:
        run = sup.start_run(
            ScriptedAdapter(body), SPEC, NO_DEADLINES, buffer=4, stall_at=2, write_stall_timeout_s=3
        )
        outcome = await run.wait()
        run.events.close()
    assert isinstance(outcome, Cancelled)
    assert outcome.reason is CancelReason.SLOW_CLIENT
    t = run.timeline
    (stall,) = t.stalls
    assert stall.end == t.terminal
    assert t.cancel_cause is CancelReason.SLOW_CLIENT
