"""The edge's part of run timelines: the queue, placements, cancels, the ring,
``/admin/runs`` and the JSONL export (in-memory links, virtual time)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from iop.config import TimelineSettings
from iop.edge import open_edge_core
from iop.edge._timeline_export import TimelineExport
from iop.events import Cancelled, CancelReason, Complete, Delta, Start
from iop.timeline import NodeTimeline, Timeline
from tests.edge.test_core import caps, config, connect, drain_events, edge_with_node, spec


async def test_a_queued_run_says_why_and_when_it_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(instances=[caps(slots=1)]) as (core, node, _):
        r1 = core.start_run(spec(run_id="r1"))
        await node.assigns.receive()
        await trio.sleep(1.0)
        r2 = core.start_run(spec(run_id="r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert r2.timeline.phase == "queued"
        assert r2.timeline.why_queued == "every slot busy: n1/i0 1/1"
        await trio.sleep(2.0)
        await node.send("r1", Start(), Delta("a"), Complete())
        await drain_events(r1)
        await node.assigns.receive()
        await node.send("r2", Start(), Delta("b"), Complete())
        await drain_events(r2)
    t1, t2 = r1.timeline, r2.timeline
    assert t1.admitted == t1.received
    assert t1.queued is None
    assert t2.admitted is None
    assert t2.queued is not None
    assert t2.dequeued is not None
    assert t2.dequeued - t2.queued == 2.0
    (placement,) = t2.placements
    assert (placement.attempt, placement.node, placement.instance) == (1, "n1", "i0")
    assert placement.at == t2.dequeued
    assert placement.result == "ran"
    assert t2.outcome == "complete:stop"
    assert t2.first_output is not None
    assert t2.cancel_sent is None


async def test_a_run_behind_others_is_queued_behind_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node(instances=[caps(slots=1)]) as (core, _node, _):
        runs = []
        for i in range(3):
            runs.append(core.start_run(spec(run_id=f"r{i}")))
            await trio.testing.wait_all_tasks_blocked()
        assert runs[1].timeline.why_queued == "every slot busy: n1/i0 1/1"
        assert runs[2].timeline.why_queued == "1 run(s) queued ahead"
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)


async def test_a_cancel_is_recorded_with_its_cause_and_when_it_went_to_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with edge_with_node() as (core, node, _):
        run = core.start_run(spec())
        await node.assigns.receive()
        await node.send("r1", Start(), Delta("a"))
        await run.events.receive()
        await trio.sleep(1.0)
        run.cancel(CancelReason.CLIENT_DISCONNECT, "client went away")
        await run.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert len(node.cancels) == 1
    t = run.timeline
    assert t.cancel_cause is CancelReason.CLIENT_DISCONNECT
    assert t.cancel_requested is not None
    assert t.cancel_sent is not None
    assert t.cancel_requested <= t.cancel_sent
    assert t.placements[0].result == "cancelled"
    assert t.outcome == "cancelled:client_disconnect"


async def test_a_failover_shows_both_placements(autojump_clock: trio.testing.MockClock) -> None:
    async with open_edge_core(config()) as core, trio.open_nursery() as nursery:
        a = await connect(core, nursery, [caps(slots=1)], "a")
        b = await connect(core, nursery, [caps(slots=1)], "b")
        run = core.start_run(spec())
        await trio.testing.wait_all_tasks_blocked()
        first, other = (a, b) if a.assigned else (b, a)
        await first.assigns.receive()
        await first.chan.aclose()
        await other.assigns.receive()
        await other.send("r1", Start(), Complete())
        await drain_events(run)
        nursery.cancel_scope.cancel()
    lost, ran = run.timeline.placements
    assert (lost.attempt, ran.attempt) == (1, 2)
    assert lost.result is not None
    assert lost.result.startswith("lost: ")
    assert ran.result == "ran"
    assert {lost.node, ran.node} == {"a", "b"}


async def test_finished_runs_are_kept_in_a_bounded_ring(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = config(timelines=TimelineSettings(recent=2))
    async with edge_with_node(cfg) as (core, node, _):
        for i in range(3):
            run = core.start_run(spec(run_id=f"r{i}"))
            await node.assigns.receive()
            await node.send(f"r{i}", Start(), Complete())
            await drain_events(run)
        await trio.testing.wait_all_tasks_blocked()
        live = core.start_run(spec(run_id="live"))
        await node.assigns.receive()
        view = core.runs_view(limit=10)
        assert [r["run_id"] for r in view["live"]] == ["live"]  # type: ignore[index,union-attr]
        assert [r["run_id"] for r in view["recent"]] == ["r2", "r1"]  # type: ignore[index,union-attr]
        assert (view["kept"], view["capacity"]) == (2, 2)
        assert core.run_view("r0") is None
        r1 = core.run_view("r1")
        assert r1 is not None
        assert r1["outcome"] == "complete:stop"
        assert core.run_view("live") is not None
        live.cancel(CancelReason.CLIENT_DISCONNECT)
        await drain_events(live)


def _timeline(i: int) -> Timeline:
    return Timeline(run_id=f"run-{i:04d}", model="m", received=1.0, terminal=2.0, outcome="x")


async def test_the_export_writes_one_line_per_run_and_rotates(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    line = len(msgspec.json.encode(_timeline(0).to_json())) + 1
    export = TimelineExport(
        TimelineSettings(
            export_path=str(path), export_max_bytes=max(4096, 10 * line), export_keep=2
        )
    )
    per_file = export.max_bytes // line
    async with trio.open_nursery() as nursery:
        nursery.start_soon(export.run)
        for i in range(per_file * 3 + 1):
            export.add(_timeline(i))
            if i % 7 == 0:
                await trio.sleep(0.01)  # written in several batches
        export.close()
    files = [path, path.with_name("runs.jsonl.1"), path.with_name("runs.jsonl.2")]
    assert not path.with_name("runs.jsonl.3").exists()
    sizes = [f.stat().st_size for f in files]
    assert all(size <= export.max_bytes for size in sizes)
    lines = [ln for f in reversed(files) for ln in f.read_text().splitlines()]
    ids = [msgspec.json.decode(ln)["run_id"] for ln in lines]
    # Oldest file first: the newest runs, in order, none lost but the rotated-out file.
    assert ids == sorted(ids)
    assert ids[-1] == f"run-{per_file * 3:04d}"
    assert export.rotations == 3
    assert export.dropped == 0


async def test_the_export_files_are_the_operators_alone(tmp_path: Path) -> None:
    """Every tenant's run ids (each answer's id is built from its run's) and
    names: readable by the edge's user only, whatever its umask."""
    path = tmp_path / "runs.jsonl"
    line = len(msgspec.json.encode(_timeline(0).to_json())) + 1
    export = TimelineExport(
        TimelineSettings(export_path=str(path), export_max_bytes=max(4096, 10 * line))
    )
    old = os.umask(0o022)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(export.run)
            for i in range(export.max_bytes // line + 1):
                export.add(_timeline(i))
            export.close()
    finally:
        os.umask(old)
    assert export.rotations == 1
    for f in (path, path.with_name("runs.jsonl.1")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


async def test_a_full_export_buffer_drops_lines_and_counts_them(tmp_path: Path) -> None:
    export = TimelineExport(TimelineSettings(export_path=str(tmp_path / "x.jsonl")))
    from iop.edge._timeline_export import EXPORT_BUFFER

    for i in range(EXPORT_BUFFER + 5):  # nobody writes: the writer is not running
        export.add(_timeline(i))
    assert export.dropped == 5


async def test_the_edge_writes_its_last_lines_at_exit(tmp_path: Path) -> None:
    # Real time: the export writes in a worker thread, which a virtual clock
    # would race past (its flush deadline would pass while the thread writes).
    path = tmp_path / "runs.jsonl"
    cfg = config(timelines=TimelineSettings(export_path=str(path)))
    async with edge_with_node(cfg) as (core, node, _):
        run = core.start_run(spec(run_id="last"))
        await node.assigns.receive()
        await node.send("last", Start(), Complete())
        await drain_events(run)
    (line,) = path.read_text().splitlines()
    assert msgspec.json.decode(line)["run_id"] == "last"


def test_timeline_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="export_max_bytes"):
        TimelineSettings(export_max_bytes=10)
    with pytest.raises(ValueError, match="recent"):
        TimelineSettings(recent=-1)


async def test_admin_runs_over_http_behind_the_admin_keys() -> None:
    from tests.edge.test_app import CHAT, answer, edge
    from tests.edge.test_app import config as app_config

    cfg = app_config(api_keys=["sk-1"], admin_keys=["sk-admin"])
    async with edge(cfg) as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        client_key = {"Authorization": "Bearer sk-1"}
        bearer = {"Authorization": "Bearer sk-admin"}
        n.start_soon(answer, node, Start(), Delta("hi"), Complete())
        resp = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers=client_key
        )
        assert resp.status_code == 200
        # A client key opens no timeline, not even its own run's.
        for headers in ({}, client_key):
            assert (await client.get("/admin/runs", headers=headers)).status_code == 401
            assert (await client.get("/admin/runs/x", headers=headers)).status_code == 401
        view = (await client.get("/admin/runs", headers=bearer)).json()
        assert view["live"] == []
        (summary,) = view["recent"]
        assert summary["outcome"] == "complete:stop"
        assert summary["node"] == "n1"
        one = await client.get(f"/admin/runs/{summary['run_id']}", headers=bearer)
        assert one.status_code == 200
        timeline = one.json()
        assert timeline["stream"] is True
        assert timeline["placements"][0]["result"] == "ran"
        assert timeline["terminal_ms"] >= timeline["first_output_ms"] >= 0
        missing = await client.get("/admin/runs/nope", headers=bearer)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        assert (await client.get("/admin/runs?limit=0", headers=bearer)).json()["recent"] == []
        for bad in ("x", "-1", "1001"):
            resp = await client.get(f"/admin/runs?limit={bad}", headers=bearer)
            assert resp.status_code == 400
            assert resp.json()["error"]["param"] == "limit"


async def test_a_cancelled_runs_line_waits_for_its_nodes_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Real time (the export writes in a thread), a short wait for the node's side.
    monkeypatch.setattr("iop.edge._timeline_export.NODE_PART_WAIT_S", 0.3)
    path = tmp_path / "runs.jsonl"
    cfg = config(timelines=TimelineSettings(export_path=str(path)))
    async with edge_with_node(cfg) as (core, node, _):
        for run_id in ("answered", "silent"):
            run = core.start_run(spec(run_id=run_id))
            await node.assigns.receive()
            await node.send(run_id, Start(), Delta("a"))
            await run.events.receive()
            run.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(run)
            await trio.testing.wait_all_tasks_blocked()
        # The node answers one cancel, with its side of the run, 0.5 s later.
        placed = core.timeline("answered").placements[0].at  # type: ignore[union-attr]
        now = trio.current_time()
        node.session.push(
            "answered",
            Cancelled(reason=CancelReason.CLIENT_DISCONNECT),
            # One clock here (one process): the node's times are the edge's.
            NodeTimeline(node="n1", started=placed, backend_closed=now, terminal=now),
        )
        for frame in node.session.data_to_send(trio.current_time()):
            await node.chan.send(frame)
        await trio.testing.wait_all_tasks_blocked()
        answered = core.timeline("answered")
        assert answered is not None
        assert answered.node is not None
        assert answered.node.backend_closed is not None
        lines: dict[str, Any] = {}

        async def both_written() -> None:
            while len(lines) < 2:
                await trio.sleep(0.02)
                if path.exists():
                    lines.update(
                        (line["run_id"], line)
                        for line in map(msgspec.json.decode, path.read_text().splitlines())
                    )

        with trio.fail_after(10):  # the silent one's comes after its wait ends
            await both_written()
        assert lines["answered"]["node"]["backend_closed_ms"] is not None
        assert lines["silent"]["node"] is None
        assert lines["silent"]["outcome"] == "cancelled:client_disconnect"


def test_the_run_page_draws_its_spans_and_escapes_what_nodes_report() -> None:
    from iop.edge.routes._admin_page import render_run_page
    from iop.timeline import Placement, Stall, StallKind

    evil = "<script>alert(1)</script>"
    t = Timeline(run_id="r<1>", model=evil, received=0.0, queued=0.0, dequeued=0.1)
    t.placements.append(Placement(attempt=1, node=evil, instance="i", at=0.1, result="ran"))
    t.first_output = 0.3
    t.stalls.append(Stall(kind=StallKind.CLIENT_WRITE, start=0.5, end=0.7, size=10))
    t.terminal = 1.0
    t.outcome = "complete:stop"
    t.node = NodeTimeline(
        node=evil,
        clock_rtt_s=0.002,
        started=0.11,
        backend_sent=0.12,
        backend_first_byte=0.2,
        first_output=0.29,
        backend_closed=0.98,
        terminal=0.99,
    )
    page = render_run_page(t.to_json()).decode()
    assert "<script>" not in page
    assert "&lt;script&gt;" in page
    assert "<h1>Run r&lt;1&gt;</h1>" in page
    # Spans as percentages of the run's 1000 ms: streaming from 300 ms to the end.
    assert "style='left:30.00%;width:70.00%'" in page
    assert "client_write stall" in page
    assert "style='left:50.00%;width:20.00%'" in page
    for moment in (
        "backend request sent",
        "backend first byte",
        "node&#x27;s terminal",
        "placed on",
    ):
        assert moment in page
    assert "good to 1.00 ms" in page
    assert "http-equiv='refresh'" not in page  # finished: nothing changes any more
    live = Timeline(run_id="live", received=0.0, first_output=0.2)
    assert "http-equiv='refresh'" in render_run_page(live.to_json()).decode()


async def test_the_admin_page_lists_recent_runs_and_opens_their_timeline() -> None:
    from tests.edge.test_app import CHAT, answer, edge

    async with edge() as (_, node, client), trio.open_nursery() as n:
        assert node is not None
        n.start_soon(answer, node, Start(), Delta("hi"), Complete())
        resp = await client.post("/v1/chat/completions", json=CHAT)
        run_id = resp.json()["id"].removeprefix("chatcmpl-")
        page = (await client.get("/admin")).text
        assert "<h2>Recent runs</h2>" in page
        assert f"<a href='/admin/runs/{run_id}'>{run_id}</a>" in page
        browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
        view = await client.get(f"/admin/runs/{run_id}", headers=browser)
        assert view.headers["content-type"].startswith("text/html")
        assert f"<h1>Run {run_id}</h1>" in view.text
        assert "frame-ancestors 'none'" in view.headers["content-security-policy"]
        # A script gets the JSON.
        assert (await client.get(f"/admin/runs/{run_id}")).json()["run_id"] == run_id


async def test_cancelled_lines_held_for_their_node_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storm of cancels: past NODE_PART_WAITING_MAX held lines, the oldest is
    written without its node's side instead of holding them all for the wait."""
    from iop.timeline import Placement

    monkeypatch.setattr("iop.edge._timeline_export.NODE_PART_WAIT_S", 3600.0)
    monkeypatch.setattr("iop.edge._timeline_export.NODE_PART_WAITING_MAX", 3)
    export = TimelineExport(TimelineSettings(export_path=str(tmp_path / "x.jsonl")))

    def cancelled(i: int) -> Timeline:
        t = _timeline(i)
        t.cancel_sent = 1.5
        t.placements = [Placement(attempt=1, node="n1", instance="a", at=1.0, result="cancelled")]
        return t

    async with trio.open_nursery() as nursery:
        nursery.start_soon(export.run)
        for i in range(5):
            export.add(cancelled(i))
        with trio.fail_after(10):
            while export.written < 2:
                await trio.sleep(0.01)
        assert export.written == 2
        export.close()
    ids = [msgspec.json.decode(ln)["run_id"] for ln in (tmp_path / "x.jsonl").read_text().split()]
    assert ids == [f"run-{i:04d}" for i in range(5)]
