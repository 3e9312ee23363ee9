"""OpenAI's error vocabulary, as the Responses surface needs it (sans-IO).

The body ``{"error": {"message", "type", "param", "code"}}`` and the status
rules are the same as the chat surface's (``iop.api.chat``), which
``iop.api._openai_errors`` is to hold for every OpenAI surface; until that
module lands this is the Responses surface's copy, kept to the few functions
it uses so the later switch is an import change.
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop.events import Cancelled, CancelReason

__all__ = [
    "cancel_message",
    "cancel_status",
    "clamp_status",
    "error_body",
    "openai_error_type",
    "scrub",
]


class _ErrorInfo(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorResponse(msgspec.Struct, frozen=True):
    error: _ErrorInfo


def scrub(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: 429 ``rate_limit_error``, any
    other 4xx ``invalid_request_error``, everything else ``server_error``."""
    if status == 429:
        return "rate_limit_error"
    if 400 <= status <= 499:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, *, status: int, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error body for ``status``."""
    info = _ErrorInfo(scrub(message), openai_error_type(status), param, code)
    return msgspec.json.encode(_ErrorResponse(info))


def clamp_status(status: int) -> int:
    """``status`` when it is an error status (400-599), else 500."""
    return status if 400 <= status <= 599 else 500


_TIMEOUT_REASONS: Final = frozenset(
    {
        CancelReason.FIRST_TOKEN_TIMEOUT,
        CancelReason.IDLE_TIMEOUT,
        CancelReason.TOTAL_TIMEOUT,
        CancelReason.QUEUE_TIMEOUT,
    }
)

_CANCEL_MESSAGES: Final[dict[CancelReason, str]] = {
    CancelReason.CLIENT_DISCONNECT: "the client disconnected",
    CancelReason.NODE_LOST: "node disconnected",
    CancelReason.FIRST_TOKEN_TIMEOUT: "timed out waiting for the first token",
    CancelReason.IDLE_TIMEOUT: "timed out waiting for the next token",
    CancelReason.TOTAL_TIMEOUT: "the run exceeded its total time limit",
    CancelReason.QUEUE_TIMEOUT: "timed out waiting for capacity",
    CancelReason.EXPLICIT: "the run was cancelled",
    CancelReason.SHUTDOWN: "the server is shutting down",
}


def cancel_status(reason: CancelReason) -> int:
    """503 when the node was lost, 504 for every timeout, 500 for the rest
    (the chat surface's rule, docs/operations.md "Errors clients see")."""
    if reason is CancelReason.NODE_LOST:
        return 503
    if reason in _TIMEOUT_REASONS:
        return 504
    return 500


def cancel_message(event: Cancelled) -> str:
    """The client-facing message of a cancelled run: the event's, or its reason's."""
    return event.message or _CANCEL_MESSAGES.get(event.reason, f"run cancelled: {event.reason}")
