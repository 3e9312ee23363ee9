"""Files, batches and each batch line's result in one SQLite file (no event loop here).

The edge's batch runner (``iop.edge.batches``) calls this from a worker
thread, one call at a time. Three tables:

* ``files``: what ``POST /v1/files`` took (purpose ``batch``) and the
  output and error files a batch wrote (``batch_output``), each its
  tenant's, its bytes in the row;
* ``batches``: one row per batch: its status (``iop.batches._state``),
  timestamps, files and metadata;
* ``lines``: one row per request of a batch, copied from its input file
  when the batch is created (a deleted input file does not stop it), with
  ``result`` NULL until the line has run: then the line of the output or
  error file it answers with, exactly as written there.

Durability (docs/operations.md, "Batches"): WAL mode; each result is
committed when its line ends, before anything else sees it. A restarted
edge runs the lines with no result again, never one that has one: every
``custom_id`` is answered exactly once. The output and error files are
built from the results, in line order, and the batch set to its final
state in the same transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from iop.batches._jsonl import error_line
from iop.batches._state import ACTIVE, TIMESTAMPS, BatchEvent, BatchStatus, advance
from iop.errors import ConfigError, ErrorCode

__all__ = ["BatchRow", "BatchStore", "FileRow", "LineResult", "PendingLine", "Progress"]

SCHEMA_VERSION: Final = 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    row TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body BLOB NOT NULL,
    result BLOB,
    ok INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
);
"""


class FileRow(msgspec.Struct, frozen=True, kw_only=True):
    """A stored file, as ``GET /v1/files/{id}`` shows it (``openai.types.FileObject``)."""

    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class BatchRow(msgspec.Struct, kw_only=True):
    """A batch: OpenAI's fields (``openai.types.Batch``) and whose it is."""

    id: str
    tenant: str
    key_name: str = ""
    endpoint: str
    model: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = BatchStatus.VALIDATING
    metadata: dict[str, str] | None = None
    total: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def advance(self, event: BatchEvent, now: int) -> None:
        """Apply ``event`` (``iop.batches._state.advance``) and stamp its time.

        Raises:
            BadTransition: ``event`` does not apply in this status.
        """
        self.status = advance(self.status, event)
        stamp = TIMESTAMPS.get(self.status)
        if stamp is not None:
            setattr(self, stamp, now)


class PendingLine(msgspec.Struct, frozen=True):
    """A line with no result yet: what to run."""

    idx: int
    custom_id: str
    body: bytes


class LineResult(msgspec.Struct, frozen=True, kw_only=True):
    """A line's end: its output (or error) file line and what it used.

    Attributes:
        idx: The line's index in its batch.
        line: The output or error file's line, JSON, no newline.
        ok: It goes to the output file (a 2xx answer), else to the error file.
    """

    idx: int
    line: bytes
    ok: bool
    input_tokens: int = 0
    output_tokens: int = 0


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """A batch's lines so far."""

    total: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int


# The error of a line that never ran (``BatchStore.finish``), OpenAI's words
# for an expired one (https://platform.openai.com/docs/guides/batch, "Batch expiration").
_CANCELLED: Final = (
    ErrorCode.BATCH_CANCELLED,
    "This request was not executed: its batch was cancelled.",
)
_EXPIRED: Final = (
    ErrorCode.BATCH_EXPIRED,
    "This request could not be executed before the completion window expired.",
)

_ROW_ENCODER: Final = msgspec.json.Encoder()
_ROW_DECODER: Final = msgspec.json.Decoder(BatchRow)


class BatchStore:
    """The batch store (module docstring): one connection, used by one thread at a time.

    Raises:
        ConfigError: The file cannot be opened, or holds a newer schema.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"batches.path {path}: schema version {version} is newer than this IOP's "
                    f"({SCHEMA_VERSION})"
                )
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise ConfigError(f"batches.path {path}: cannot open it ({exc})") from exc

    def close(self) -> None:
        self._db.close()

    # --- files ------------------------------------------------------------------

    def add_file(self, row: FileRow, content: bytes) -> None:
        with self._db:
            self._insert_file(row, content)

    def _insert_file(self, row: FileRow, content: bytes) -> None:
        self._db.execute(
            "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at, content) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row.id, row.tenant, row.filename, row.purpose, row.bytes, row.created_at, content),
        )

    def file(self, tenant: str, file_id: str) -> FileRow | None:
        """``file_id`` if it is ``tenant``'s (None for another tenant's: the same as none)."""
        got = self._db.execute(
            "SELECT id, tenant, filename, purpose, bytes, created_at FROM files "
            "WHERE id = ? AND tenant = ?",
            (file_id, tenant),
        ).fetchone()
        return None if got is None else _file_row(got)

    def content(self, tenant: str, file_id: str) -> bytes | None:
        got = self._db.execute(
            "SELECT content FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
        ).fetchone()
        return None if got is None else bytes(got[0])

    def files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRow], bool]:
        """A page of ``tenant``'s files (after the file ``after``), and whether more follow."""
        return self._page(
            "SELECT id, tenant, filename, purpose, bytes, created_at FROM files",
            "files",
            tenant,
            after,
            limit,
            newest_first,
            ("purpose = ?", purpose) if purpose else None,
            _file_row,
        )

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._db:
            cur = self._db.execute(
                "DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
            )
        return cur.rowcount > 0

    # --- batches ----------------------------------------------------------------

    def add_batch(self, row: BatchRow, lines: Iterable[tuple[str, bytes]]) -> None:
        """Store a new batch and its lines (custom_id, body), in one transaction."""
        with self._db:
            self._put_batch(row, insert=True)
            self._db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                ((row.id, i, custom_id, body) for i, (custom_id, body) in enumerate(lines)),
            )

    def _put_batch(self, row: BatchRow, *, insert: bool = False) -> None:
        data = _ROW_ENCODER.encode(row).decode()
        if insert:
            self._db.execute(
                "INSERT INTO batches (id, tenant, created_at, status, row) VALUES (?, ?, ?, ?, ?)",
                (row.id, row.tenant, row.created_at, row.status.value, data),
            )
        else:
            self._db.execute(
                "UPDATE batches SET status = ?, row = ? WHERE id = ?",
                (row.status.value, data, row.id),
            )

    def put_batch(self, row: BatchRow) -> None:
        with self._db:
            self._put_batch(row)

    def batch(self, tenant: str, batch_id: str) -> BatchRow | None:
        got = self._db.execute(
            "SELECT row FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
        ).fetchone()
        return None if got is None else _ROW_DECODER.decode(got[0])

    def batches(self, tenant: str, *, after: str | None, limit: int) -> tuple[list[BatchRow], bool]:
        """A page of ``tenant``'s batches, newest first, and whether more follow."""
        return self._page(
            "SELECT row FROM batches",
            "batches",
            tenant,
            after,
            limit,
            True,
            None,
            lambda got: _ROW_DECODER.decode(got[0]),
        )

    def active(self) -> list[BatchRow]:
        """Every batch not in a final state, oldest first (what a restart resumes)."""
        marks = ", ".join("?" for _ in ACTIVE)
        got = self._db.execute(
            f"SELECT row FROM batches WHERE status IN ({marks}) ORDER BY created_at, id",
            tuple(s.value for s in ACTIVE),
        ).fetchall()
        return [_ROW_DECODER.decode(r[0]) for r in got]

    def counts(self) -> dict[str, int]:
        """Batches by status (every tenant's: /metrics)."""
        got = self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return dict(got)

    # --- lines ------------------------------------------------------------------

    def pending(self, batch_id: str) -> list[PendingLine]:
        """The lines of ``batch_id`` with no result, in order."""
        got = self._db.execute(
            "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND result IS NULL "
            "ORDER BY idx",
            (batch_id,),
        ).fetchall()
        return [PendingLine(idx, custom_id, bytes(body)) for idx, custom_id, body in got]

    def put_results(self, batch_id: str, results: Sequence[LineResult]) -> None:
        """Keep each line's result; a line that has one keeps its first."""
        with self._db:
            self._db.executemany(
                "UPDATE lines SET result = ?, ok = ?, input_tokens = ?, output_tokens = ? "
                "WHERE batch_id = ? AND idx = ? AND result IS NULL",
                (
                    (r.line, int(r.ok), r.input_tokens, r.output_tokens, batch_id, r.idx)
                    for r in results
                ),
            )

    def progress(self, batch_id: str) -> Progress:
        got = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(result IS NOT NULL AND ok = 1), 0), "
            "COALESCE(SUM(result IS NOT NULL AND ok = 0), 0), "
            "COALESCE(SUM(input_tokens), 0), COALESCE(SUM(output_tokens), 0) "
            "FROM lines WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return Progress(
            total=got[0], completed=got[1], failed=got[2], input_tokens=got[3], output_tokens=got[4]
        )

    def cancel(self, row: BatchRow, now: int) -> None:
        """Set ``row`` cancelling (``BatchEvent.CANCEL``), durably.

        Raises:
            BadTransition: ``row`` has ended (a 409).
        """
        with self._db:
            row.advance(BatchEvent.CANCEL, now)
            self._put_batch(row)

    def finish(
        self, row: BatchRow, now: int, *, expired: bool, new_id: Callable[[str], str]
    ) -> int:
        """End ``row``, all in one transaction, and say how many lines never ran.

        How is read here, under the same lock as ``cancel``: a batch found
        ``cancelling`` is cancelled, else one past its window (``expired``)
        expires, else it completes. The lines with no result get a
        ``batch_cancelled`` or ``batch_expired`` error; the output and error
        files are written from the results in line order (a file with no
        line is not written); the batch takes its final state. ``new_id``
        makes ids (``file-``, ``batch_req_``).
        """
        if row.status is BatchStatus.CANCELLING:
            event, unrun = BatchEvent.CANCEL_DONE, _CANCELLED
        elif expired:
            event, unrun = BatchEvent.EXPIRE, _EXPIRED
        else:
            event, unrun = BatchEvent.FINALIZED, None
        with self._db:
            left = self.pending(row.id) if unrun is not None else []
            if unrun is not None:
                code, message = unrun
                self._db.executemany(
                    "UPDATE lines SET result = ?, ok = 0 WHERE batch_id = ? AND idx = ?",
                    (
                        (
                            error_line(new_id("batch_req_"), p.custom_id, code, message),
                            row.id,
                            p.idx,
                        )
                        for p in left
                    ),
                )
            out: list[bytes] = []
            err: list[bytes] = []
            for result, ok in self._db.execute(
                "SELECT result, ok FROM lines WHERE batch_id = ? ORDER BY idx", (row.id,)
            ):
                (out if ok else err).append(bytes(result) + b"\n")
            for lines, name in ((out, "output"), (err, "error")):
                if not lines:
                    continue
                content = b"".join(lines)
                file_id = new_id("file-")
                self._insert_file(
                    FileRow(
                        id=file_id,
                        tenant=row.tenant,
                        filename=f"{row.id}_{name}.jsonl",
                        purpose="batch_output",
                        bytes=len(content),
                        created_at=now,
                    ),
                    content,
                )
                if name == "output":
                    row.output_file_id = file_id
                else:
                    row.error_file_id = file_id
            if event is BatchEvent.FINALIZED and row.status is BatchStatus.IN_PROGRESS:
                row.advance(BatchEvent.LINES_DONE, now)
            row.advance(event, now)
            self._put_batch(row)
        return len(left)

    # --- paging -----------------------------------------------------------------

    def _page(
        self,
        select: str,
        table: str,
        tenant: str,
        after: str | None,
        limit: int,
        newest_first: bool,
        extra: tuple[str, str] | None,
        make: Any,
    ) -> tuple[list[Any], bool]:
        where = ["tenant = ?"]
        args: list[object] = [tenant]
        if extra is not None:
            where.append(extra[0])
            args.append(extra[1])
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        if after:
            mark = self._db.execute(
                f"SELECT created_at FROM {table} WHERE id = ? AND tenant = ?", (after, tenant)
            ).fetchone()
            if mark is not None:
                where.append(f"(created_at, id) {cmp} (?, ?)")
                args += [mark[0], after]
        got = self._db.execute(
            f"{select} WHERE {' AND '.join(where)} ORDER BY created_at {order}, id {order} LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        return [make(g) for g in got[:limit]], len(got) > limit


def _file_row(got: Sequence[Any]) -> FileRow:
    return FileRow(
        id=got[0], tenant=got[1], filename=got[2], purpose=got[3], bytes=got[4], created_at=got[5]
    )
