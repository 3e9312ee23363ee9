"""Batches run on the edge's own nodes, on the capacity interactive runs leave.

Theory of operation. ``Batches`` owns the store (``iop.batches.BatchStore``,
one SQLite file, called in a worker thread one call at a time) and one task
per batch in progress. A batch's task hands its lines with no result to
``batches.max_concurrent_per_batch`` workers; each line, before it runs,
takes one of ``batches.max_concurrent`` places shared by every batch. A
line runs through the edge's own surface handler (``LineCall``: the same
parse, tenant admission, ``EdgeCore.start_run`` and collector a client's
non-streaming request gets, no HTTP loopback), as the batch objective
(``EdgeConfig.batch_objective``: the lowest priority, sheddable) and as its
batch's tenant, with the key name the batch was created with: its tenant's
limits and budgets apply and its usage is in the ledger like any run's.

Spare capacity: a line the edge refuses for want of capacity (the
scheduler's 429: a full queue, a sheddable run shed or evicted; the
tenant's limits; no node or instance serving the model yet; a draining
edge; a run cut by the edge's shutdown) is not an answer: its batch pauses
(``retry_initial_s``, doubling to ``retry_max_s``, reset by the next line
that runs) and the line runs again. Everything else the endpoint answers,
2xx or not, is the line's result: written to the store (committed) before
the line counts as done.

How a batch ends, each in one store transaction (``BatchStore.finish``):

| how | when | lines with no result |
| --- | --- | --- |
| ``completed`` | every line has its result | none |
| ``cancelled`` | ``cancel``: the lines' scope is cancelled, runs in flight end ``explicit`` | ``batch_cancelled`` errors |
| ``expired`` | ``expires_at`` passed (the lines' scope has it as deadline) | ``batch_expired`` errors |

Restart (even ``kill -9``): at start every batch not in a final state is
resumed; its lines with a stored result never run again, those in flight
at the kill have none and run again. A batch found ``cancelling`` is
finished as cancelled.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, ParamSpec, Protocol, TypeVar

import trio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop.batches import (
    BatchEvent,
    BatchLine,
    BatchRow,
    BatchStatus,
    BatchStore,
    FileRow,
    LineResult,
    PendingLine,
    Progress,
    answer_line,
)
from iop.config import BatchSettings, Objective
from iop.errors import ErrorCode, RequestError
from iop.events import Usage

__all__ = ["COMPLETION_WINDOW_S", "Batches", "LineAnswer", "LineCall"]

log = logging.getLogger("iop.edge.batches")

COMPLETION_WINDOW_S: Final = {"24h": 24 * 3600}
"""The completion windows a batch may ask for (OpenAI's one), in seconds."""

# A line whose handler crashed: OpenAI's error body, as the HTTP routes answer a crash.
_CRASHED: Final = (
    b'{"error":{"message":"The server had an error while processing this request.",'
    b'"type":"server_error","param":null,"code":"internal_error"}}'
)

_P = ParamSpec("_P")
_T = TypeVar("_T")


class LineAnswer(NamedTuple):
    """What the edge's handler made of one line.

    Attributes:
        status: The HTTP status the endpoint answered.
        body: Its JSON body.
        request_id: The run's id (``response.request_id``).
        usage: What the run used (charged to the tenant).
        refused: A refusal for want of capacity: run the line again later,
            record nothing (module docstring).
    """

    status: int
    body: bytes
    request_id: str
    usage: Usage = Usage()
    refused: bool = False


LineCall = Callable[[str, str, str, bytes, Objective], Awaitable[LineAnswer]]
"""Runs one line: (endpoint, tenant name, key name, body, objective) -> its answer."""

LineCheck = Callable[[str, str, bytes], None]
"""Checks one line's body at upload: (endpoint, tenant name, body); raises the
endpoint's ``RequestError``."""


class Offload(Protocol):
    """Runs a blocking call (the store's) without blocking the event loop."""

    async def __call__(self, fn: Callable[[], _T], /) -> _T: ...


async def _in_thread(fn: Callable[[], _T], /) -> _T:
    return await trio.to_thread.run_sync(fn)


def new_id(prefix: str) -> str:
    """An id as OpenAI's look (``file-...``, ``batch_...``), unguessable."""
    return prefix + secrets.token_hex(12)


@dataclass(slots=True)
class _Live:
    """A batch this process runs: its row (the one the store is written from),
    the scope of its lines, and its pace."""

    row: BatchRow
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: float = 0.0  # trio clock
    done_here: int = 0  # lines this process ended
    resume_at: float = 0.0  # trio clock: paused until then
    backoff_s: float = 0.0
    progress: Progress | None = None


class Batches:
    """The edge's batches: the store, the runner, and what the routes call.

    Args:
        settings: ``[batches]``.
        path: The store's file (``BatchSettings.store_path``).
        registry: Where its metrics go (the edge's /metrics).
        objective: The objective lines run as (read at each line: a reload
            may change it).
        offload: How a store call is made: in a worker thread (the event
            loop never waits on the disk); tests on virtual time call it
            in the loop, where a thread's real time would let the clock jump.
    """

    def __init__(
        self,
        settings: BatchSettings,
        path: str,
        registry: CollectorRegistry,
        objective: Callable[[], Objective],
        offload: Offload | None = None,
    ) -> None:
        self._offload: Offload = offload or _in_thread
        self.settings = settings
        self.path = path
        self._objective = objective
        self._store: BatchStore | None = None
        self._said_volatile = False  # the in-memory store was warned of (``create``)
        self._lock = trio.Lock()  # one store call at a time
        self._all = trio.CapacityLimiter(settings.max_concurrent)
        self._live: dict[str, _Live] = {}
        self._call: LineCall | None = None
        self.check: LineCheck | None = None
        self._bound = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._by_status: dict[str, int] = {}
        self.lines = Counter(
            "iop_batch_lines",
            "Batch lines ended, by how: completed (a 2xx answer), failed (any other "
            "answer), cancelled, expired.",
            ["outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "iop_batch_line_retries",
            "Batch lines refused for want of capacity and run again later.",
            registry=registry,
        )
        registry.register(_StatusCollector(self))

    # --- the service ------------------------------------------------------------

    def bind(self, call: LineCall, check: LineCheck) -> None:
        """How lines run and are checked (the edge's surface handler); batches
        start after it."""
        self._call = call
        self.check = check
        self._bound.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the store, then, once bound, resume every unfinished batch and
        run the new ones until cancelled."""
        path = self.path
        store = await self._offload(lambda: BatchStore(path))
        self._store = store
        try:
            self._by_status = await self._db(store.counts)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._bound.wait()
                for row in await self._db(store.active):
                    self._start(row)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                async with self._lock:
                    self._store = None
                    await self._offload(store.close)

    async def _db(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        store = self._store
        if store is None:
            raise RequestError("the batch store is closed", status=503, code=ErrorCode.DRAINING)
        async with self._lock:
            return await self._offload(lambda: fn(*args, **kwargs))

    def _start(self, row: BatchRow) -> None:
        nursery = self._nursery
        if nursery is None or row.id in self._live:
            return
        live = self._live[row.id] = _Live(row, started=trio.current_time())
        nursery.start_soon(self._drive, live, name=f"batch {row.id}")

    # --- files ------------------------------------------------------------------

    async def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileRow:
        store = self._need()
        row = FileRow(
            id=new_id("file-"),
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            bytes=len(data),
            created_at=int(time.time()),
        )
        await self._db(store.add_file, row, data)
        return row

    async def file(self, tenant: str, file_id: str) -> FileRow | None:
        return await self._db(self._need().file, tenant, file_id)

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        return await self._db(self._need().content, tenant, file_id)

    async def files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRow], bool]:
        store = self._need()
        return await self._db(
            store.files,
            tenant,
            purpose=purpose,
            after=after,
            limit=limit,
            newest_first=newest_first,
        )

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return await self._db(self._need().delete_file, tenant, file_id)

    # --- batches ----------------------------------------------------------------

    async def create(
        self,
        *,
        tenant: str,
        key_name: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        lines: list[BatchLine],
    ) -> BatchRow:
        """Store a batch of ``lines`` (its file's, checked) and start it."""
        store = self._need()
        now = int(time.time())
        row = BatchRow(
            id=new_id("batch_"),
            tenant=tenant,
            key_name=key_name,
            endpoint=endpoint,
            model=lines[0].model,
            input_file_id=input_file_id,
            completion_window=completion_window,
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S[completion_window],
            metadata=metadata,
            total=len(lines),
        )
        row.advance(BatchEvent.VALIDATED, now)
        await self._db(store.add_batch, row, [(x.custom_id, x.body) for x in lines])
        self._count(None, row.status)
        if self.path == ":memory:" and not self._said_volatile:
            # Once per process: the operator learns it at the first batch,
            # not at every start of an edge that runs none.
            self._said_volatile = True
            log.warning(
                "batch %s is kept in memory only: a restart of this edge loses it and "
                "every batch after it; set usage.ledger_path or batches.path for a "
                'store on disk (docs/operations.md, "Batches")',
                row.id,
            )
        self._start(row)
        return row

    async def batch(self, tenant: str, batch_id: str) -> BatchRow | None:
        live = self._live.get(batch_id)
        if live is not None:
            return live.row if live.row.tenant == tenant else None
        return await self._db(self._need().batch, tenant, batch_id)

    async def batches(
        self, tenant: str, *, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        rows, more = await self._db(self._need().batches, tenant, after=after, limit=limit)
        return [self._live[r.id].row if r.id in self._live else r for r in rows], more

    async def cancel(self, tenant: str, batch_id: str) -> BatchRow | None:
        """Cancel ``batch_id`` (``cancelling`` now, ``cancelled`` once its lines
        in flight ended); None: not ``tenant``'s.

        Raises:
            BadTransition: The batch has ended (409).
        """
        row = await self.batch(tenant, batch_id)
        if row is None:
            return None
        before = row.status
        # Under the store's lock, as ``_finish``: a batch that completed
        # first is a 409 here, one cancelled first is cancelled there.
        await self._db(self._need().cancel, row, int(time.time()))
        self._count(before, row.status)
        live = self._live.get(batch_id)
        if live is not None:
            live.scope.cancel()
        else:
            self._start(row)  # its task finishes the cancel
        return row

    async def progress(self, batch_id: str) -> Progress:
        return await self._db(self._need().progress, batch_id)

    def pace(self, row: BatchRow, progress: Progress) -> dict[str, Any]:
        """IOP's progress of ``row`` beside OpenAI's fields: tokens so far, and
        (while it runs here) lines per second and the seconds left at that pace."""
        out: dict[str, Any] = {
            "input_tokens": progress.input_tokens,
            "output_tokens": progress.output_tokens,
            "lines_per_s": None,
            "eta_s": None,
        }
        live = self._live.get(row.id)
        if live is not None and live.done_here:
            elapsed = max(trio.current_time() - live.started, 1e-3)
            rate = live.done_here / elapsed
            left = progress.total - progress.completed - progress.failed
            out["lines_per_s"] = round(rate, 3)
            out["eta_s"] = math.ceil(left / rate)
        return out

    def live_view(self) -> list[dict[str, Any]]:
        """The batches this process runs, for /admin (every tenant's)."""
        out = []
        for live in self._live.values():
            row, p = live.row, live.progress
            done = 0 if p is None else p.completed + p.failed
            elapsed = max(trio.current_time() - live.started, 1e-3)
            rate = live.done_here / elapsed
            out.append(
                {
                    "id": row.id,
                    "tenant": row.tenant,
                    "model": row.model,
                    "status": row.status.value,
                    "total": row.total,
                    "done": done,
                    "failed": 0 if p is None else p.failed,
                    "lines_per_s": round(rate, 3),
                    "eta_s": math.ceil((row.total - done) / rate) if rate else None,
                    "paused": live.resume_at > trio.current_time(),
                }
            )
        return out

    def _need(self) -> BatchStore:
        if self._store is None:
            raise RequestError("the batch store is closed", status=503, code=ErrorCode.DRAINING)
        return self._store

    def _count(self, before: BatchStatus | None, after: BatchStatus) -> None:
        if before is not None:
            self._by_status[before.value] = self._by_status.get(before.value, 1) - 1
        self._by_status[after.value] = self._by_status.get(after.value, 0) + 1

    # --- running ----------------------------------------------------------------

    async def _drive(self, live: _Live) -> None:
        row = live.row
        try:
            store = self._need()
            if row.status is BatchStatus.IN_PROGRESS:
                pending = await self._db(store.pending, row.id)
                live.progress = await self._db(store.progress, row.id)
                # The completion window is wall-clock time; the scope's deadline is trio's.
                live.scope.deadline = trio.current_time() + (row.expires_at - time.time())
                with live.scope:
                    await self._run_lines(live, pending)
            await self._finish(live)
        except* Exception:
            # The store failed (a full disk, a broken file): this batch stops
            # here, loudly, as it is in the store (its results so far kept);
            # the edge and the other batches go on, and a restart resumes it.
            log.exception("batch %s: stopped, its store failed; a restart resumes it", row.id)
        finally:
            self._live.pop(row.id, None)

    async def _run_lines(self, live: _Live, pending: list[PendingLine]) -> None:
        # 0: a worker takes a line only when it is free; nothing queues here.
        send, receive = trio.open_memory_channel[PendingLine](0)
        async with trio.open_nursery() as nursery:
            for _ in range(min(self.settings.max_concurrent_per_batch, len(pending))):
                nursery.start_soon(self._worker, live, receive.clone())
            receive.close()
            async with send:
                for line in pending:
                    await send.send(line)

    async def _worker(self, live: _Live, receive: trio.MemoryReceiveChannel[PendingLine]) -> None:
        async with receive:
            async for line in receive:
                await self._run_line(live, line)

    async def _run_line(self, live: _Live, line: PendingLine) -> None:
        row = live.row
        call = self._call
        assert call is not None  # bound before any batch starts
        while True:
            await trio.sleep_until(live.resume_at)
            async with self._all:
                try:
                    answer = await call(
                        row.endpoint, row.tenant, row.key_name, line.body, self._objective()
                    )
                except Exception:
                    # A bug of the edge's, as a request's crash is: logged,
                    # and a 500 for this line (not the edge's end).
                    log.exception("batch %s: line %s crashed", row.id, line.custom_id)
                    answer = LineAnswer(500, _CRASHED, "")
            if not answer.refused:
                break
            self.retries.inc()
            s = self.settings
            live.backoff_s = min(max(live.backoff_s * 2, s.retry_initial_s), s.retry_max_s)
            live.resume_at = max(live.resume_at, trio.current_time() + live.backoff_s)
        live.backoff_s = 0.0
        ok = 200 <= answer.status < 300
        result = LineResult(
            idx=line.idx,
            line=answer_line(
                new_id("batch_req_"), line.custom_id, answer.request_id, answer.status, answer.body
            ),
            ok=ok,
            input_tokens=answer.usage.input_tokens,
            output_tokens=answer.usage.output_tokens,
        )
        # Shielded: a result the edge has is kept even when the batch is
        # cancelled while it is written (its run has ended; running it again
        # would answer its custom_id twice over a restart).
        with trio.CancelScope(shield=True):
            await self._db(self._need().put_results, row.id, [result])
        live.done_here += 1
        p = live.progress
        if p is not None:
            live.progress = Progress(
                total=p.total,
                completed=p.completed + ok,
                failed=p.failed + (not ok),
                input_tokens=p.input_tokens + result.input_tokens,
                output_tokens=p.output_tokens + result.output_tokens,
            )
        self.lines.labels("completed" if ok else "failed").inc()

    async def _finish(self, live: _Live) -> None:
        row = live.row
        store = self._need()
        before = row.status
        now = int(time.time())
        expired = live.scope.cancelled_caught or now >= row.expires_at
        with trio.CancelScope(shield=True):
            left = await self._db(store.finish, row, now, expired=expired, new_id=new_id)
        self._count(before, row.status)
        if left:
            how = "cancelled" if row.status is BatchStatus.CANCELLED else "expired"
            self.lines.labels(how).inc(left)
        log.info("batch %s of tenant %s: %s", row.id, row.tenant, row.status.value)


class _StatusCollector(Collector):
    """``iop_batches{status}``: the store's batches by status (every tenant's)."""

    def __init__(self, batches: Batches) -> None:
        self._batches = batches

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(
            "iop_batches", "Batches in the store, by status.", labels=["status"]
        )
        counts = self._batches._by_status
        for status in BatchStatus:
            family.add_metric([status.value], counts.get(status.value, 0))
        return [family]

    def describe(self) -> list[Metric]:
        return self.collect()
