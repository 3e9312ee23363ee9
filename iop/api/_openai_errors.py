"""OpenAI's error vocabulary, and how IOP maps a failed run to a status (sans-IO).

Shared by every OpenAI-shaped surface (chat completions, Responses, legacy
completions, embeddings) and by the edge's own errors (auth, 404, 413...).

* :func:`error_body`: OpenAI's error body
  ``{"error": {"message", "type", "param", "code"}}``, which the official
  SDK raises as ``APIError`` (a lone surrogate in a relayed backend message,
  which UTF-8 cannot encode, becomes ``?``).
* :func:`openai_error_type`: the ``type`` OpenAI sends for a status.
* :func:`error_status`, :func:`cancel_status`, :func:`cancel_message`: how a
  run's ``Error`` or ``Cancelled`` becomes an HTTP status and a message safe
  for clients. ``iop.api._output.OutputShaper`` applies them once, into
  ``ShapedFailed``, for every surface (Anthropic's included, which then only
  maps the status onto its own error types).
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop.events import Cancelled, CancelReason

__all__ = [
    "cancel_message",
    "cancel_status",
    "error_body",
    "error_status",
    "openai_error",
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


_encode: Final = msgspec.json.encode


def scrub(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status.

    429 is ``rate_limit_error``, any other 4xx ``invalid_request_error`` (what
    OpenAI sends for 400, 401, 404 alike, the ``code`` tells them apart), and
    everything else ``server_error``.
    """
    if status == 429:
        return "rate_limit_error"
    if 400 <= status <= 499:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        return _encode(_ErrorResponse(_ErrorInfo(message, type, param, code)))
    except UnicodeEncodeError:  # a lone surrogate in a relayed backend message
        return _encode(_ErrorResponse(_ErrorInfo(scrub(message), type, param, code)))


def openai_error(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> tuple[int, bytes]:
    """``(status, body)`` of OpenAI's error response for an IOP status (``Surface.error_body``)."""
    return status, error_body(message, type=openai_error_type(status), code=code, param=param)


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
    CancelReason.SLOW_CLIENT: "the client stopped reading its response",
}


def cancel_status(reason: CancelReason) -> int:
    """The HTTP status a cancelled run is reported with.

    503 when the node was lost (the request may be retried elsewhere), 504 for
    every timeout (first token, idle, total, queue), 408 for a slow client
    (the server stopped waiting for it; it is not reading, so it is for logs
    and metrics), 500 for the rest (explicit cancel, shutdown, and a client
    disconnect nobody will read).
    """
    if reason is CancelReason.NODE_LOST:
        return 503
    if reason in _TIMEOUT_REASONS:
        return 504
    if reason is CancelReason.SLOW_CLIENT:
        return 408
    return 500


def cancel_message(event: Cancelled) -> str:
    """The client-facing message of a cancelled run: the event's, or its reason's."""
    return event.message or _CANCEL_MESSAGES.get(event.reason, f"run cancelled: {event.reason}")


def error_status(status: int) -> int:
    """The HTTP status a failed run (``Error.status``) is reported with: its own
    when it is an error status (400-599), else 500."""
    return status if 400 <= status <= 599 else 500
