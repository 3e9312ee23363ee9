"""A batch's states and every transition between them, in one table (sans-IO).

OpenAI's batch statuses (``openai.types.Batch.status``;
https://platform.openai.com/docs/guides/batch, "Check the status of a
batch")::

    validating ──validated──► in_progress ──lines_done──► finalizing ──finalized──► completed
        │                        │   │
        invalid                  │   expire ──► expired        (the lines not run: batch_expired)
        ▼                        cancel
      failed                     ▼
                             cancelling ──cancel_done──► cancelled   (the lines not run: batch_cancelled)

``validating`` ends before ``POST /v1/batches`` answers (the file was
checked at upload; what is left is that the batch's endpoint is the
file's), so clients see it only in a batch refused as ``failed``. A
cancel of a batch in ``validating`` or ``finalizing`` goes through
``cancelling`` too. Each state but the first stamps its time
(``TIMESTAMPS``): ``in_progress_at``, ``completed_at``... as OpenAI's object
has them. ``advance`` is the only way a status changes; a transition the
table lacks raises ``BadTransition`` (a cancel of a finished batch is a
409, as OpenAI answers it).
"""

from __future__ import annotations

import enum
from typing import Final

from iop.errors import ErrorCode, RequestError

__all__ = [
    "ACTIVE",
    "FINAL",
    "TIMESTAMPS",
    "TRANSITIONS",
    "BadTransition",
    "BatchEvent",
    "BatchStatus",
    "advance",
]


class BatchStatus(enum.StrEnum):
    """A batch's status, OpenAI's words."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class BatchEvent(enum.StrEnum):
    """What happens to a batch."""

    VALIDATED = "validated"  # its file fits its endpoint
    INVALID = "invalid"  # it does not
    LINES_DONE = "lines_done"  # every line has its result
    FINALIZED = "finalized"  # the output and error files are written
    CANCEL = "cancel"  # POST /v1/batches/{id}/cancel
    CANCEL_DONE = "cancel_done"  # the lines in flight ended, the files are written
    EXPIRE = "expire"  # its completion window passed


S, E = BatchStatus, BatchEvent

TRANSITIONS: Final[dict[tuple[BatchStatus, BatchEvent], BatchStatus]] = {
    (S.VALIDATING, E.VALIDATED): S.IN_PROGRESS,
    (S.VALIDATING, E.INVALID): S.FAILED,
    (S.VALIDATING, E.CANCEL): S.CANCELLING,
    (S.IN_PROGRESS, E.LINES_DONE): S.FINALIZING,
    (S.IN_PROGRESS, E.CANCEL): S.CANCELLING,
    (S.IN_PROGRESS, E.EXPIRE): S.EXPIRED,
    (S.FINALIZING, E.FINALIZED): S.COMPLETED,
    (S.FINALIZING, E.CANCEL): S.CANCELLING,
    (S.CANCELLING, E.CANCEL_DONE): S.CANCELLED,
}

FINAL: Final = frozenset({S.FAILED, S.COMPLETED, S.EXPIRED, S.CANCELLED})
"""States no event leaves."""

ACTIVE: Final = frozenset({S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.CANCELLING})
"""States a restarted edge resumes."""

TIMESTAMPS: Final[dict[BatchStatus, str]] = {
    S.FAILED: "failed_at",
    S.IN_PROGRESS: "in_progress_at",
    S.FINALIZING: "finalizing_at",
    S.COMPLETED: "completed_at",
    S.EXPIRED: "expired_at",
    S.CANCELLING: "cancelling_at",
    S.CANCELLED: "cancelled_at",
}
"""The field of the batch object each state stamps when it is entered."""


class BadTransition(RequestError):
    """``event`` does not apply to a batch in ``status`` (409)."""

    def __init__(self, status: BatchStatus, event: BatchEvent) -> None:
        verb = "cancel" if event is E.CANCEL else f"apply {event.value!r} to"
        super().__init__(
            f"Cannot {verb} a batch with status {status.value!r}.",
            status=409,
            code=ErrorCode.INVALID_VALUE,
        )
        self.from_status = status
        self.event = event


def advance(status: BatchStatus, event: BatchEvent) -> BatchStatus:
    """The state ``event`` takes a batch in ``status`` to.

    Raises:
        BadTransition: The table has no such transition.
    """
    try:
        return TRANSITIONS[status, event]
    except KeyError:
        raise BadTransition(status, event) from None
