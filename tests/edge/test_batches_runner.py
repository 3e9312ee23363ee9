"""The batch runner in memory, on virtual time (iop.edge.batches._runner).

The edge's handler is the boundary faked here (``LineCall``): each test's
``Backend`` answers lines, refuses them, or holds them, and counts what
runs at once. The store is a real SQLite file in the test's tmp dir.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import trio
from prometheus_client import CollectorRegistry

from iop.batches import BatchLine, BatchRow, BatchStatus, BatchStore
from iop.config import BatchSettings, EdgeConfig, Objective
from iop.edge.batches import Batches, LineAnswer
from iop.events import Usage

ENDPOINT = "/v1/chat/completions"
T = TypeVar("T")


@dataclass
class Backend:
    """The fake handler: ``hold`` lines wait for ``release``; the first
    ``refuse`` calls are refusals."""

    refuse: int = 0
    hold: bool = False
    release: trio.Event = field(default_factory=trio.Event)
    calls: list[tuple[float, str]] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    running: int = 0
    most: int = 0
    objectives: set[str] = field(default_factory=set)

    async def __call__(
        self, endpoint: str, tenant: str, key_name: str, body: bytes, objective: Objective
    ) -> LineAnswer:
        custom = json.loads(body)["messages"]
        self.calls.append((trio.current_time(), custom))
        self.objectives.add(objective.name)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.refuse > 0:
                self.refuse -= 1
                return LineAnswer(429, b"", "run", refused=True)
            await trio.sleep(1)
            if self.hold:
                await self.release.wait()
            self.answered.append(custom)
            return LineAnswer(
                200, b'{"ok": true}', f"run-{custom}", Usage(input_tokens=1, output_tokens=2)
            )
        finally:
            self.running -= 1

    def check(self, endpoint: str, tenant: str, body: bytes) -> None:
        pass


def _lines(n: int, batch: str = "") -> list[BatchLine]:
    return [
        BatchLine(
            number=i + 1,
            custom_id=f"{batch}{i}",
            url=ENDPOINT,
            model="m",
            body=json.dumps({"model": "m", "messages": f"{batch}{i}"}).encode(),
        )
        for i in range(n)
    ]


async def _inline(fn: Callable[[], T], /) -> T:
    # The store called in the loop: a worker thread's real time would let
    # the autojump clock jump past a batch's window while it waits.
    return fn()


@asynccontextmanager
async def _batches(
    path: Path, backend: Backend, **settings: object
) -> AsyncIterator[tuple[Batches, trio.Nursery]]:
    s = BatchSettings(**settings)  # type: ignore[arg-type]
    batches = Batches(
        s, str(path), CollectorRegistry(), lambda: EdgeConfig().batch_objective(), _inline
    )
    batches.bind(backend, backend.check)
    async with trio.open_nursery() as nursery:
        await nursery.start(batches.run)
        yield batches, nursery
        nursery.cancel_scope.cancel()


async def _create(batches: Batches, n: int, tenant: str = "t", prefix: str = "") -> BatchRow:
    return await batches.create(
        tenant=tenant,
        key_name="",
        endpoint=ENDPOINT,
        input_file_id="file-x",
        completion_window="24h",
        metadata=None,
        lines=_lines(n, prefix),
    )


async def _until(
    batches: Batches, tenant: str, batch_id: str, *status: BatchStatus, every: float = 0.5
) -> BatchRow:
    # Virtual time: a deadline of two days, past any batch's window.
    with trio.fail_after(2 * 86_400):
        while True:
            row = await batches.batch(tenant, batch_id)
            assert row is not None
            if row.status in status:
                return row
            await trio.sleep(every)


def _output(path: Path, row: BatchRow) -> list[dict[str, object]]:
    store = BatchStore(str(path))
    try:
        out = []
        for file_id in (row.output_file_id, row.error_file_id):
            if file_id:
                data = store.content(row.tenant, file_id)
                assert data is not None
                out += [json.loads(x) for x in data.splitlines()]
        return out
    finally:
        store.close()


async def test_lines_run_as_the_built_in_batch_objective(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend()
    async with _batches(tmp_path / "b.db", backend) as (batches, _):
        row = await _create(batches, 5)
        done = await _until(batches, "t", row.id, BatchStatus.COMPLETED)
    assert backend.objectives == {"batch"}
    assert EdgeConfig().batch_objective() == Objective(name="batch", priority=-1000, sheddable=True)
    out = _output(tmp_path / "b.db", done)
    assert sorted(str(o["custom_id"]) for o in out) == [str(i) for i in range(5)]


async def test_refusals_pause_the_batch_with_backoff_and_are_not_written(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend(refuse=5)
    async with _batches(
        tmp_path / "b.db",
        backend,
        max_concurrent_per_batch=1,
        retry_initial_s=1.0,
        retry_max_s=4.0,
    ) as (batches, _):
        row = await _create(batches, 2)
        done = await _until(batches, "t", row.id, BatchStatus.COMPLETED)
    times = [t for t, _ in backend.calls]
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(times)][:5]
    # The pause doubles from retry_initial_s and stops at retry_max_s.
    assert gaps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert batches.retries._value.get() == 5
    out = _output(tmp_path / "b.db", done)
    assert [o["error"] for o in out] == [None, None]
    assert done.error_file_id is None


@pytest.mark.parametrize(("per_batch", "overall"), [(3, 100), (100, 4)])
async def test_concurrency_is_bounded_per_batch_and_overall(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, per_batch: int, overall: int
) -> None:
    backend = Backend()
    async with _batches(
        tmp_path / "b.db",
        backend,
        max_concurrent_per_batch=per_batch,
        max_concurrent=overall,
    ) as (batches, _):
        rows = [await _create(batches, 10, prefix=f"{i}-") for i in range(3)]
        for row in rows:
            await _until(batches, "t", row.id, BatchStatus.COMPLETED)
    # Three batches of 10 lines: the bound is reached and never crossed.
    assert backend.most == min(3 * per_batch, overall)


async def test_cancel_cancels_the_lines_in_flight_and_answers_the_rest(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend(hold=True)
    async with _batches(tmp_path / "b.db", backend, max_concurrent_per_batch=2) as (batches, _):
        row = await _create(batches, 6)
        while backend.running < 2:
            await trio.sleep(0.1)
        got = await batches.cancel("t", row.id)
        assert got is not None
        assert got.status is BatchStatus.CANCELLING
        done = await _until(batches, "t", row.id, BatchStatus.CANCELLED)
        assert backend.running == 0  # the held lines were cancelled
    out = _output(tmp_path / "b.db", done)
    assert sorted(str(o["custom_id"]) for o in out) == [str(i) for i in range(6)]
    assert {o["error"]["code"] for o in out} == {"batch_cancelled"}  # type: ignore[index]


async def test_a_batch_expires_at_its_window(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend(hold=True)
    async with _batches(tmp_path / "b.db", backend) as (batches, _):
        row = await _create(batches, 3)
        done = await _until(batches, "t", row.id, BatchStatus.EXPIRED, every=600)
    assert done.expired_at is not None
    out = _output(tmp_path / "b.db", done)
    assert {o["error"]["code"] for o in out} == {"batch_expired"}  # type: ignore[index]


async def test_another_tenant_sees_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend(hold=True)
    async with _batches(tmp_path / "b.db", backend) as (batches, _):
        row = await _create(batches, 1, tenant="a")
        assert await batches.batch("b", row.id) is None
        assert await batches.cancel("b", row.id) is None
        assert await batches.batches("b", after=None, limit=10) == ([], False)
        assert (await batches.batch("a", row.id)) is not None
        backend.release.set()


async def test_a_restart_runs_only_the_lines_without_a_result(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "b.db"
    first = Backend()
    async with _batches(path, first, max_concurrent_per_batch=2) as (batches, nursery):
        row = await _create(batches, 8)
        while len(first.answered) < 3 or first.running == 0:
            await trio.sleep(0.1)
        # The process stops (its runner cancelled) with lines in flight.
        nursery.cancel_scope.cancel()
    interrupted = {c for _, c in first.calls} - set(first.answered)
    assert interrupted
    second = Backend()
    async with _batches(path, second) as (batches, _):
        done = await _until(batches, "t", row.id, BatchStatus.COMPLETED)
    # Those in flight ran again; none that had a result did.
    assert interrupted <= set(second.answered)
    assert set(first.answered).isdisjoint(second.answered)
    assert sorted(first.answered + second.answered) == sorted(str(i) for i in range(8))
    out = _output(path, done)
    assert sorted(str(o["custom_id"]) for o in out) == [str(i) for i in range(8)]


async def test_a_batch_kept_in_memory_only_is_warned_of_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a ledger or ``batches.path`` the store is in memory: the first
    batch says a restart would lose it, and the next says nothing more."""
    async with _batches(Path(":memory:"), Backend()) as (batches, _):
        first = await _create(batches, 1)
        await _create(batches, 1)
    said = [r.getMessage() for r in caplog.records if "kept in memory only" in r.getMessage()]
    assert len(said) == 1, said
    assert first.id in said[0]
    assert "usage.ledger_path or batches.path" in said[0]


async def test_a_batch_on_disk_is_not_warned_of(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with _batches(tmp_path / "b.db", Backend()) as (batches, _):
        await _create(batches, 1)
    assert not [r for r in caplog.records if "kept in memory only" in r.getMessage()]


def test_the_admin_page_plots_each_batchs_progress() -> None:
    """A stacked bar per running batch (answered, failed, left), each part's
    count in its tooltip, widths in proportion to the lines."""
    import re

    from iop.edge.routes._admin_page import render_admin_page

    batch = {
        "id": "batch_1", "tenant": "a", "model": "m", "status": "in_progress", "total": 200,
        "done": 150, "failed": 50, "lines_per_s": 10.0, "eta_s": 5, "paused": False,
    }  # fmt: skip
    page = render_admin_page({"batches": [batch]}).decode()
    assert page.count("<svg class='progress'") == 1
    assert "<title>answered: 100</title>" in page
    assert "<title>failed: 50</title>" in page
    assert "<title>left: 50</title>" in page
    widths = re.findall(r"<rect class='(\w+)'[^>]* width='([0-9.]+)'", page)
    assert [(k, float(w)) for k, w in widths if k in ("answered", "failed", "left")] == [
        ("answered", 100.0),
        ("failed", 50.0),
        ("left", 50.0),
    ]
    assert "<script" not in page
    assert "<svg class='progress'" not in render_admin_page({}).decode()
