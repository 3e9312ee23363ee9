"""OpenAI's Batch API, sans-IO: the file format, a batch's states, and its store.

* ``_jsonl``: a batch file's lines read and checked whole (a 400 naming the
  bad line), and the output and error files' lines;
* ``_state``: a batch's status enum and its one transition table;
* ``_store``: files, batches and each line's result in SQLite (synchronous:
  the edge calls it from a worker thread).

The edge runs batches on its own nodes (``iop.edge.batches``) and serves
the routes (``iop.edge.routes._batches``): docs/api.md, "Batches and files";
docs/operations.md, "Batches".
"""

from iop.batches._jsonl import (
    ENDPOINTS,
    BatchLine,
    answer_line,
    check_line,
    error_line,
    read_batch_file,
)
from iop.batches._state import (
    ACTIVE,
    FINAL,
    TIMESTAMPS,
    TRANSITIONS,
    BadTransition,
    BatchEvent,
    BatchStatus,
    advance,
)
from iop.batches._store import BatchRow, BatchStore, FileRow, LineResult, PendingLine, Progress

__all__ = [
    "ACTIVE",
    "ENDPOINTS",
    "FINAL",
    "TIMESTAMPS",
    "TRANSITIONS",
    "BadTransition",
    "BatchEvent",
    "BatchLine",
    "BatchRow",
    "BatchStatus",
    "BatchStore",
    "FileRow",
    "LineResult",
    "PendingLine",
    "Progress",
    "advance",
    "answer_line",
    "check_line",
    "error_line",
    "read_batch_file",
]
