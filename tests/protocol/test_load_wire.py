"""LoadReport on the wire: the welcome's gate, coalescing in the node's
session, and the edge's rate limit (sans-IO, explicit times)."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from iop.errors import LinkLimitError, LinkProtocolError
from iop.protocol import (
    CLOSE_RATE,
    EdgeSession,
    EngineLoad,
    InstanceLoad,
    LoadReport,
    LoadReported,
    NodeSession,
    Ping,
    Welcome,
    decode_node_batch,
    encode,
    encode_batch,
)

FIGURES = [
    InstanceLoad(
        instance="i0",
        in_flight=2,
        queued=1,
        max_concurrency=4,
        max_queue=8,
        engine=EngineLoad(running=2.0, waiting=3.0, kv_usage=0.5, age_s=0.2),
    )
]


def node(rate: float = 10.0) -> tuple[NodeSession, list[int]]:
    calls = [0]

    def source() -> list[InstanceLoad]:
        calls[0] += 1
        return FIGURES

    return NodeSession(
        node_id="n", token="t", now=0.0, load_reports_per_s=rate, load_source=source
    ), calls


def welcome(**kw: object) -> bytes:
    fields = {
        "protocol_version": 3,
        "node_id": "n",
        "heartbeat_interval_s": 1.0,
        "heartbeat_timeout_s": 2.0,
        **kw,
    }
    return encode(msgspec.convert(fields, Welcome))


def reports(session: NodeSession, now: float) -> list[LoadReport]:
    out = []
    for frame in session.data_to_send(now):
        out += [m for m in decode_node_batch(frame) if isinstance(m, LoadReport)]
    return out


def test_a_report_round_trips_and_an_old_peer_decodes_the_welcome() -> None:
    frame = encode_batch([encode(LoadReport(instances=FIGURES))])
    assert decode_node_batch(frame) == [LoadReport(instances=FIGURES)]
    old = msgspec.msgpack.encode(
        {
            "t": "welcome",
            "protocol_version": 3,
            "node_id": "n",
            "heartbeat_interval_s": 1.0,
            "heartbeat_timeout_s": 2.0,
        }
    )
    got = msgspec.msgpack.decode(old, type=Welcome)
    assert (got.load_reports_per_s, got.load_stale_s) == (0.0, 0.0)


def test_an_edge_from_before_load_reports_gets_none() -> None:
    session, calls = node()
    session.receive(welcome(), 0.0)  # no load_reports_per_s: an older edge
    assert not session.load_changed(0.0)
    session.tick(100.0)
    assert reports(session, 100.0) == []
    assert calls == [0]


def test_changes_within_an_interval_become_one_report_at_its_end() -> None:
    session, calls = node(rate=4.0)
    session.receive(welcome(load_reports_per_s=10.0, load_stale_s=6.0), 0.0)
    assert len(reports(session, 0.0)) == 1  # the first, with the welcome
    for i in range(1, 100):
        session.load_changed(i * 0.001)  # 99 changes in 0.1 s
    assert reports(session, 0.1) == []
    assert session.next_tick_at == pytest.approx(0.25)  # the lower rate: ours
    session.tick(0.25)
    assert len(reports(session, 0.25)) == 1
    assert calls == [2]  # built once per report, not per change
    # Nothing changed since: the next is the refresh, a third of load_stale_s later.
    assert session.next_load_at == pytest.approx(2.25)


def test_the_edge_counts_reports_against_its_control_budget() -> None:
    edge = EdgeSession(
        tokens=["t"],
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=2.0,
        now=0.0,
        control_rate_per_s=1.0,
        control_burst=3,
        load_reports_per_s=0.25,
        load_stale_s=5.0,
    )
    node_session, _ = node()
    edge.receive(node_session.hello([]), 0.0)
    w = msgspec.msgpack.decode(edge.welcome(), type=Welcome)
    assert (w.load_reports_per_s, w.load_stale_s) == (0.25, 5.0)
    frame = encode_batch([encode(LoadReport(instances=FIGURES))])
    (event,) = edge.receive(frame, 1.0)
    assert event == LoadReported(FIGURES, 1.0)
    edge.receive(frame, 1.0)
    edge.receive(frame, 1.0)
    with pytest.raises(LinkLimitError) as info:
        edge.receive(frame, 1.0)  # a node that ignores the rate: cut off
    assert info.value.close_code == CLOSE_RATE


def test_a_report_from_an_edge_is_a_protocol_error() -> None:
    session, _ = node()
    session.receive(welcome(load_reports_per_s=1.0), 0.0)
    with pytest.raises(LinkProtocolError):
        session.receive(encode_batch([encode(LoadReport(instances=[]))]), 0.0)


def test_an_idle_links_heartbeats_carry_the_refresh_and_no_more_frames() -> None:
    session, _ = node()
    session.receive(welcome(load_reports_per_s=10.0, load_stale_s=5.0), 0.0)
    now, frames, pings, refreshes = 0.0, 0, 0, [0.0]
    session.data_to_send(now)  # the first report, with the welcome
    while now < 30.0:
        now = session.next_tick_at
        session.tick(now)
        for frame in session.data_to_send(now):
            frames += 1
            for msg in decode_node_batch(frame):
                if isinstance(msg, LoadReport):
                    refreshes.append(now)
                else:
                    pings += 1
    # One frame per heartbeat interval (the welcome's 1 s), as without load
    # reports, and every one a report: never stale at the edge.
    assert frames <= 31
    assert pings == 0
    assert max(b - a for a, b in itertools.pairwise(refreshes)) <= 5.0 / 3


def test_answers_to_the_edges_pings_carry_the_refresh_too() -> None:
    session, _ = node()
    session.receive(welcome(load_reports_per_s=10.0, load_stale_s=5.0), 0.0)
    session.data_to_send(0.0)
    ping = encode_batch([encode(Ping(nonce=1))])
    now, frames, refreshes = 0.0, 0, [0.0]
    sweep = 2.0  # the edge's sweeps, every heartbeat_timeout_s
    while now < 30.0:
        now = min(session.next_tick_at, sweep)
        if now == sweep:
            session.receive(ping, now)
            sweep += 2.0
        else:
            session.tick(now)
        for frame in session.data_to_send(now):
            frames += 1
            if any(isinstance(m, LoadReport) for m in decode_node_batch(frame)):
                refreshes.append(now)
    # No frame of its own for the refresh: heartbeats and answers carry it.
    assert frames <= 31
    assert max(b - a for a, b in itertools.pairwise(refreshes)) <= 5.0 / 3


def test_a_held_up_writer_keeps_at_most_one_report_queued() -> None:
    """A link whose writer cannot send (its TCP window full, or the edge not
    reading while per-run credit is off) gets no pile of reports, and no
    tick due in the past that would wake the reader without pause."""
    session, calls = node(rate=10.0)
    session.receive(welcome(load_reports_per_s=10.0, load_stale_s=6.0), 0.0)
    # The writer does not take data_to_send for 30 s; the load keeps changing.
    for i in range(1, 300):
        now = i * 0.1
        session.load_changed(now)
        assert session.next_tick_at > now - 1e-9 or session.next_tick_at == float("inf")
        session.tick(now)
    assert calls == [1]  # the first report, still queued: no second one built
    (first,) = reports(session, 30.0)
    assert first == LoadReport(instances=FIGURES)
    # Once it went, the changes since are reported within an interval.
    session.tick(30.1)
    assert len(reports(session, 30.1)) == 1
    assert calls == [2]


class _OldEngineLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``EngineLoad`` as an edge from before ``cache_tokens`` declares it."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    age_s: float = 0.0


class _OldInstanceLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    instance: str
    in_flight: int
    queued: int
    max_concurrency: int
    max_queue: int
    engine: _OldEngineLoad | None = None


class _OldLoadReport(msgspec.Struct, frozen=True, kw_only=True, tag_field="t", tag="load"):
    instances: list[_OldInstanceLoad]


def test_a_cache_size_round_trips_and_old_peers_read_the_report_without_it() -> None:
    """``EngineLoad.cache_tokens`` rides the load report: a new edge reads it,
    an edge from before it decodes the rest of the report, and a node from
    before it sends reports a new edge reads as "size unknown"."""
    sized = [
        msgspec.structs.replace(FIGURES[0], engine=EngineLoad(kv_usage=0.5, cache_tokens=32768))
    ]
    frame = encode_batch([encode(LoadReport(instances=sized))])
    assert decode_node_batch(frame) == [LoadReport(instances=sized)]
    assert decode_node_batch(frame)[0].instances[0].engine.cache_tokens == 32768  # type: ignore[union-attr]
    (old_edge,) = msgspec.msgpack.decode(frame, type=list[_OldLoadReport])
    assert old_edge.instances[0].engine == _OldEngineLoad(kv_usage=0.5)
    old_node = msgspec.msgpack.encode(
        [
            _OldLoadReport(
                instances=[
                    _OldInstanceLoad(
                        instance="i0",
                        in_flight=1,
                        queued=0,
                        max_concurrency=4,
                        max_queue=8,
                        engine=_OldEngineLoad(running=1.0),
                    )
                ]
            )
        ]
    )
    (report,) = decode_node_batch(old_node)
    assert isinstance(report, LoadReport)
    assert report.instances[0].engine == EngineLoad(running=1.0)
    assert report.instances[0].engine.cache_tokens is None
