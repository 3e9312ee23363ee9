"""The edge's usage ledger writer: every finished run, durably, off the event loop.

``[usage] ledger_path`` set: each finished run's ``UsageRecord``
(``iop.ledger``) goes into a bounded channel (``usage.buffer`` records)
from the run supervisor's callback, which never waits. One task,
``Ledger.run``, owns the SQLite file: it takes what has queued, waits
until ``usage.flush_interval_s`` has passed since the batch's first record
(so one commit carries a busy second's runs), and appends the batch in a
worker thread (``trio.to_thread.run_sync``): the event loop never waits on
the disk. A full channel drops the record and counts it
(``iop_usage_ledger_dropped_total``, an error in the log): a stalled disk
costs ledger lines, never runs.

Stopping: ``close`` closes the channel; ``run`` then writes everything
still queued in one last batch (shielded from cancellation, so the edge's
shutdown cannot cut it) and returns. So a graceful stop loses nothing and a
``kill -9`` loses at most the records of the last flush interval (those
not yet committed; docs/operations.md, "Usage and budgets").

At start, before the edge serves, ``run`` opens the file and reads what a
restart restores (``Restored``): each tenant's spend in the current UTC day
and month, and the runs of the last minute for its rate windows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Final

import trio
from prometheus_client import CollectorRegistry, Counter

from iop.config import UsageSettings
from iop.ledger import LedgerStore, UsageRecord, UsageRow, period_start

__all__ = ["RATE_WINDOW_S", "Ledger", "Restored"]

log = logging.getLogger("iop.edge.ledger")

# What restores the rate windows: the runs of the last minute (the buckets
# refill in a minute, so older runs no longer count).
RATE_WINDOW_S: Final = 60.0


@dataclass(slots=True)
class Restored:
    """What the ledger held for the current periods when the edge started."""

    at: float = 0.0
    spent: dict[str, dict[str, int]] = field(default_factory=dict)  # period -> tenant -> micros
    recent: list[UsageRecord] = field(default_factory=list)  # the last minute's runs


class Ledger:
    """The ledger's writer (module docstring). ``run`` is its task.

    Args:
        settings: ``[usage]`` (``ledger_path`` set).
        registry: Where its counters are registered (the edge's /metrics).
    """

    def __init__(self, settings: UsageSettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self._send, self._receive = trio.open_memory_channel[UsageRecord](settings.buffer)
        self._store: LedgerStore | None = None
        # One thread call at a time on the store: the writer's batches and
        # the admin's reports take turns.
        self._lock = trio.Lock()
        self.restored = Restored()
        self.written = Counter(
            "iop_usage_ledger_records",
            "Runs written to the usage ledger.",
            registry=registry,
        )
        self.dropped = Counter(
            "iop_usage_ledger_dropped",
            "Runs not written to the usage ledger: its buffer was full (a stalled disk).",
            registry=registry,
        )
        self._dropped = 0

    def add(self, record: UsageRecord) -> None:
        """Queue ``record``; never waits (a full buffer drops it, counted)."""
        try:
            self._send.send_nowait(record)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self._dropped += 1
            self.dropped.inc()
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.error(
                    "usage ledger %s is behind: %d run(s) not recorded so far",
                    self.settings.ledger_path,
                    self._dropped,
                )

    def close(self) -> None:
        """No more records: ``run`` writes what is queued and returns (idempotent)."""
        self._send.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the file, read what restarts restore, then write until ``close``."""
        store = await trio.to_thread.run_sync(LedgerStore, self.settings.ledger_path)
        self._store = store
        try:
            self.restored = await trio.to_thread.run_sync(_restore, store, time.time())
            task_status.started()
            batch: list[UsageRecord] = []
            async with self._receive:
                try:
                    async for first in self._receive:
                        batch.append(first)
                        # Gather for one flush interval, then commit them together.
                        with trio.move_on_after(self.settings.flush_interval_s):
                            async for record in self._receive:
                                batch.append(record)
                        batch += _drain(self._receive)
                        await self._write(batch)
                        batch = []
                finally:
                    # Closed (a graceful stop) or cancelled: what is queued is
                    # written, whatever happens around it.
                    batch += _drain(self._receive)
                    if batch:
                        with trio.CancelScope(shield=True):
                            await self._write(batch)
        finally:
            with trio.CancelScope(shield=True):
                async with self._lock:
                    self._store = None
                    await trio.to_thread.run_sync(store.close)

    async def _write(self, batch: list[UsageRecord]) -> None:
        store = self._store
        assert store is not None
        try:
            async with self._lock:
                await trio.to_thread.run_sync(store.append, batch)
        except Exception:
            # A full disk or a broken file: said loudly and counted; the edge
            # goes on serving (its runs do not wait for the ledger).
            log.exception("usage ledger %s: %d run(s) not written", store.path, len(batch))
            self._dropped += len(batch)
            self.dropped.inc(len(batch))
        else:
            self.written.inc(len(batch))

    async def report(
        self,
        by: tuple[str, ...],
        *,
        since: float | None = None,
        until: float | None = None,
        tenant: str | None = None,
    ) -> list[UsageRow]:
        """``LedgerStore.report`` of the written runs, in a worker thread."""
        async with self._lock:
            store = self._store
            if store is None:
                return []
            return await trio.to_thread.run_sync(
                lambda: store.report(by, since=since, until=until, tenant=tenant)
            )


def _drain(receive: trio.MemoryReceiveChannel[UsageRecord]) -> list[UsageRecord]:
    out: list[UsageRecord] = []
    while True:
        try:
            out.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return out


def _restore(store: LedgerStore, now: float) -> Restored:
    return Restored(
        at=now,
        spent={
            "day": store.spent(period_start("day", now)),
            "month": store.spent(period_start("month", now)),
        },
        recent=store.since(now - RATE_WINDOW_S),
    )
