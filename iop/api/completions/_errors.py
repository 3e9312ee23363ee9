"""OpenAI's error vocabulary for the completions and embeddings surfaces (sans-IO).

The same body, types and statuses as chat's (``iop.edge._openai_out`` until
the chat refactor moves them to ``iop.api``; this module is then to be folded
into the shared one): ``{"error": {"message", "type", "param", "code"}}``,
``rate_limit_error`` for 429, ``invalid_request_error`` for any other 4xx,
``server_error`` for the rest, and one status per cancel reason.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from iop.errors import RequestError
from iop.events import Cancelled, CancelReason, Error

__all__ = [
    "cancel_message",
    "cancel_status",
    "decode_object",
    "error_body",
    "error_response",
    "event_error",
    "from_validation",
    "invalid",
    "openai_error_type",
]


class _ErrorInfo(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorResponse(msgspec.Struct, frozen=True):
    error: _ErrorInfo


_encode: Final = msgspec.json.encode


def openai_error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    if 400 <= status <= 499:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error body; lone surrogates in ``message`` become ``?``."""
    text = message.encode("utf-8", "replace").decode("utf-8")
    return _encode(_ErrorResponse(_ErrorInfo(text, type, param, code)))


def _status(status: int) -> int:
    return status if 400 <= status <= 599 else 500


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> tuple[int, bytes]:
    """``Surface.error_body`` for OpenAI's surfaces: the status, clamped to 4xx/5xx."""
    status = _status(status)
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
    """503 node lost, 504 every timeout, 408 slow client, 500 the rest (as chat)."""
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


def event_error(event: Error | Cancelled) -> tuple[int, bytes]:
    """The status and error body of a run that failed or was cancelled."""
    if isinstance(event, Cancelled):
        return error_response(
            cancel_status(event.reason), cancel_message(event), code=event.reason.value
        )
    return error_response(
        event.status, event.message or "run failed", code=event.code, param=event.param
    )


def invalid(message: str, param: str | None = None) -> RequestError:
    """A 400 ``invalid_value`` for ``param``."""
    return RequestError(message, param=param, code="invalid_value")


_INVALID_JSON: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The API expects a JSON payload, but what was sent "
    "was not valid JSON.)"
)
# msgspec's ValidationError messages, each optionally followed by " - at `$.path`".
_AT: Final = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TYPE: Final = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<rest>.*?), got `(?P<got>[^`]+)`$")


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object.

    Raises:
        RequestError: Not JSON (``invalid_json``), or not an object.
    """
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestError(_INVALID_JSON, code="invalid_json") from exc
    if not isinstance(value, dict):
        raise RequestError("Invalid request body: expected a JSON object.", code="invalid_type")
    return value


def from_validation(exc: msgspec.ValidationError) -> RequestError:
    """A 400 worded like OpenAI's for one of msgspec's messages, ``param`` set."""
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    msg, param = m["msg"], (m["path"] or "").removeprefix(".") or None
    if missing := _MISSING.match(msg):
        param = f"{param}.{missing['field']}" if param else missing["field"]
        return RequestError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    where = f" for '{param}'" if param else ""
    if wrong := _TYPE.match(msg):
        return RequestError(
            f"Invalid type{where}: expected {wrong['expected']}{wrong['rest']}, "
            f"but got {wrong['got']} instead.",
            param=param,
            code="invalid_type",
        )
    return RequestError(f"Invalid value{where}: {msg}.", param=param, code="invalid_value")
