"""OpenAI's errors for the completions and embeddings surfaces (sans-IO).

The body, types and statuses are every OpenAI surface's
(``iop.api._openai_errors``); here are what these two surfaces add: the
error of a failed run, and request-validation 400s worded like OpenAI's.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH, guarded_decode
from iop.api._openai_errors import (
    cancel_message,
    cancel_status,
    error_body,
    error_status,
    openai_error,
    openai_error_type,
)
from iop.api._openai_validation import from_validation as openai_from_validation
from iop.errors import ErrorCode, RequestError
from iop.events import Cancelled, Error

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


def error_response(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> tuple[int, bytes]:
    """``Surface.error_body`` for OpenAI's surfaces: the status, clamped to 4xx/5xx."""
    return openai_error(error_status(status), message, code=code, param=param)


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
    return RequestError(message, param=param, code=ErrorCode.INVALID_VALUE)


_INVALID_JSON: Final = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
    "using your HTTP library correctly. The API expects a JSON payload, but what was sent "
    "was not valid JSON.)"
)


def decode_object(body: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body as a JSON object, after the guards every surface applies
    (``iop.api._json_guard``: nesting, encoding, numbers the link can carry).

    Raises:
        RequestError: 400 (``invalid_json``, ``json_too_deep``, ...).
    """
    return guarded_decode(body, max_depth=max_depth)


def from_validation(exc: msgspec.ValidationError) -> RequestError:
    """A 400 worded like OpenAI's for one of msgspec's messages, ``param`` set."""
    return openai_from_validation(exc)
