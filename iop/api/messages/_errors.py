"""Anthropic's error vocabulary: IOP statuses and codes to Anthropic's (sans-IO).

Anthropic answers every error with
``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}``
and a status from a small vocabulary (``docs/api.md``, "Anthropic
Messages", "Errors and statuses"). The SDK picks its exception class by the
status alone (``BadRequestError`` for 400, ``OverloadedError`` for 529...),
and retries 408, 409, 429 and every 5xx. IOP's outcomes map onto it so:

==========================================  ======  ======================
IOP outcome                                 status  ``error.type``
==========================================  ======  ======================
400 (bad request, backend's 400)            400     invalid_request_error
401                                         401     authentication_error
403                                         403     permission_error
404 (unknown model)                         404     not_found_error
413 (body too large)                        413     request_too_large
other 4xx (a backend's 422...)              same    invalid_request_error
429 (queue full)                            429     rate_limit_error
503 (no node, draining, model unavailable,  529     overloaded_error
backend unreachable, node lost)
cancelled: ``node_lost``, ``shutdown``,     529     overloaded_error
``queue_timeout`` (no capacity came)
cancelled: first-token, idle, total         504     timeout_error
timeouts; 504 (backend timeout)
502 (backend failed)                        502     api_error
500, cancelled ``explicit`` or              500     api_error
``client_disconnect``, anything else
==========================================  ======  ======================

Why: 529 is how Anthropic says "no capacity, try again", and what Claude
Code and the SDK retry with back-off; every IOP 503 means exactly that
(another node, or the same one later, may serve it). A run that waited its
whole queue deadline for capacity is the same case. The other timeouts keep
504 (Anthropic's ``timeout_error``, the SDK's ``GatewayTimeoutError``):
capacity was there, the run was slow. 502 has no Anthropic name; it keeps its
status (the SDK treats any 5xx as ``InternalServerError``) with type
``api_error``.

IOP's own ``code`` is not in the body: Anthropic's ``error.details.error_code``
selects SDK exception classes, so a foreign code there could masquerade as
one of Anthropic's. The edge logs the code with the run.
"""

from __future__ import annotations

from typing import Final

import msgspec

from iop.events import CancelReason

__all__ = ["anthropic_error", "error_body", "error_event"]

# Codes (an ``Error``'s code or a cancel reason) that mean "no capacity now".
_OVERLOADED_CODES: Final = frozenset(
    {
        CancelReason.NODE_LOST.value,
        CancelReason.SHUTDOWN.value,
        CancelReason.QUEUE_TIMEOUT.value,
    }
)
_TIMEOUT_CODES: Final = frozenset(
    {
        CancelReason.FIRST_TOKEN_TIMEOUT.value,
        CancelReason.IDLE_TIMEOUT.value,
        CancelReason.TOTAL_TIMEOUT.value,
    }
)

_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, code: str | None = None) -> tuple[int, str]:
    """Anthropic's ``(status, error.type)`` for an IOP status and code (table above)."""
    if status == 503 or status == 529 or code in _OVERLOADED_CODES:
        return 529, "overloaded_error"
    if code in _TIMEOUT_CODES or status == 504:
        return 504, "timeout_error"
    if status in _TYPES:
        return status, _TYPES[status]
    if 400 <= status <= 499:
        return status, "invalid_request_error"
    return 500, "api_error"


class _ErrorObject(msgspec.Struct, frozen=True):
    type: str
    message: str


class _ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "error"
    error: _ErrorObject
    request_id: str | msgspec.UnsetType = msgspec.UNSET


def _scrub(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def error_body(type: str, message: str, *, request_id: str | None = None) -> bytes:
    """Anthropic's error body ``{"type":"error","error":{"type","message"},"request_id"}``."""
    body = _ErrorResponse(
        error=_ErrorObject(type, _scrub(message)),
        request_id=msgspec.UNSET if request_id is None else request_id,
    )
    return msgspec.json.encode(body)


def error_event(type: str, message: str, *, request_id: str | None = None) -> bytes:
    """The SSE ``error`` event of a stream that fails after it began."""
    return b"event: error\ndata: " + error_body(type, message, request_id=request_id) + b"\n\n"
