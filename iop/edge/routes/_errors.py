"""What a refused request is told, in its API's error shape, and where its key is read.

Every error a client sees is its API's error body (OpenAI's, except on a
surface route whose surface has its own: ``Surface.error_body``) with the
right status; the one HTML answer to a refused request is ``/admin``'s login
form, for people (``_admin``). ``Refusals`` answers what quart or the
surface layer refuse before a route runs (404, 405, 408, 413, a crash) in the
shape of the path's surface.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Final

from quart import Response, request
from werkzeug.exceptions import HTTPException

from iop.api import CHAT, Surface, anthropic_api_key
from iop.config import EdgeConfig
from iop.edge.server._surface_asgi import Answer
from iop.errors import ErrorCode, IopError, RequestError

__all__ = [
    "KeyReader",
    "Refusals",
    "anthropic_key",
    "bearer_key",
    "error",
    "error_answer",
    "exc_answer",
    "from_exc",
    "json_answer",
    "json_response",
    "key_refused",
    "raw_headers",
    "request_headers",
    "retry_after",
    "unknown_url",
    "unsupported_content_type",
]

log = logging.getLogger("iop.edge.http")

# A request that sent no key at all is told so, not that its key was wrong.
NO_KEY: Final = "No API key provided: send one as `Authorization: Bearer KEY`."
ANTHROPIC_NO_KEY: Final = "No API key provided: send one in the `x-api-key` header."

# What a crash is told (the log has the rest).
_CRASHED: Final = "internal server error"

# What a person who opens the edge's root (or /v1) in a browser is told.
_ROOT_POINTERS: Final = (
    "This is an IOP edge: the OpenAI and Anthropic APIs are under /v1 "
    "(GET /v1/models lists the models), the admin view is /admin and health /healthz; "
    "docs/api.md in the IOP repository describes the API."
)


def json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


def unknown_url(method: str, path: str) -> str:
    """The 404 message; at the root, where to go instead."""
    message = f"Unknown request URL: {method} {path}."
    if path.rstrip("/") in ("", "/v1"):
        return f"{message} {_ROOT_POINTERS}"
    return message


def key_refused(key: str, wrong: str, *, anthropic: bool = False) -> str:
    """The 401 message for ``key``: none sent, or ``wrong``."""
    if key:
        return wrong
    return ANTHROPIC_NO_KEY if anthropic else NO_KEY


def error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    surface: Surface = CHAT,
) -> Response:
    """An error response in ``surface``'s shape (OpenAI's unless a route says otherwise)."""
    sent, body = surface.error_body(status, message, code=code, param=param)
    return json_response(body, sent, None if headers is None else dict(headers))


# A model that failed to load, or was not loaded in time: retryable, once the
# edge asks its nodes again (``scheduler.model_load_backoff_s``,
# docs/operations.md, "Models on demand").
_MODEL_LOAD_CODES: Final = frozenset(
    {ErrorCode.MODEL_LOAD_FAILED, ErrorCode.MODEL_LOAD_REFUSED, ErrorCode.MODEL_LOAD_TIMEOUT}
)


def retry_after(status: int, code: str, load_backoff_s: float) -> dict[str, str] | None:
    """The ``Retry-After`` of a failed run's answer: 1 s for a 429, the edge's
    load backoff for a 503 of a model's load, else none."""
    if status == 429:
        return {"Retry-After": "1"}
    if status == 503 and code in _MODEL_LOAD_CODES:
        return {"Retry-After": str(max(1, math.ceil(load_backoff_s)))}
    return None


def from_exc(
    exc: IopError, surface: Surface = CHAT, headers: Mapping[str, str] | None = None
) -> Response:
    """The error response of ``exc`` (a 429 says when to retry)."""
    param, headers = _exc_fields(exc, headers)
    return error(
        exc.status, exc.message, code=exc.code, param=param, headers=headers, surface=surface
    )


def _exc_fields(
    exc: IopError, headers: Mapping[str, str] | None
) -> tuple[str | None, Mapping[str, str] | None]:
    """What ``exc``'s error says besides its status, message and code: the
    parameter at fault, and its headers (a 429 says when to retry)."""
    if headers is None and exc.status == 429:
        headers = {"Retry-After": "1"}
    return (exc.param if isinstance(exc, RequestError) else None), headers


# The surface routes answer below quart (``iop.edge.server._surface_asgi``):
# the same responses as ``json_response``, ``error`` and ``from_exc``, with
# the same headers in the same order (quart's: the route's headers, then
# ``content-type``, then ``content-length``), as the ASGI layer sends them.


def json_answer(body: bytes, status: int = 200, headers: Mapping[str, str] | None = None) -> Answer:
    """``body`` as a whole JSON answer of a surface route."""
    raw = raw_headers(headers) if headers else []
    raw.append((b"content-type", b"application/json"))
    raw.append((b"content-length", str(len(body)).encode("ascii")))
    return Answer(status, raw, body)


def raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """``headers`` as ASGI has them (names lower-cased, as quart sent them)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def error_answer(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    surface: Surface = CHAT,
) -> Answer:
    """``error``'s response as a surface route's answer."""
    sent, body = surface.error_body(status, message, code=code, param=param)
    return json_answer(body, sent, headers)


def exc_answer(
    exc: IopError, surface: Surface = CHAT, headers: Mapping[str, str] | None = None
) -> Answer:
    """``from_exc``'s response as a surface route's answer."""
    param, headers = _exc_fields(exc, headers)
    return error_answer(
        exc.status, exc.message, code=exc.code, param=param, headers=headers, surface=surface
    )


KeyReader = Callable[[Mapping[str, str]], str]
"""How a route finds the client's API key in the request's (lower-cased) headers."""


def bearer_key(headers: Mapping[str, str]) -> str:
    """The key of ``Authorization: Bearer <key>`` (OpenAI's way), or ``""``."""
    auth = headers.get("authorization", "")
    return auth[7:] if auth.startswith("Bearer ") else ""


def anthropic_key(headers: Mapping[str, str]) -> str:
    """The key of ``x-api-key`` (Anthropic's way) or a Bearer token, or ``""``."""
    return anthropic_api_key(headers) or ""


def request_headers() -> dict[str, str]:
    """The quart request's headers, names lower-cased (what ``Surface.parse`` gets)."""
    return {name.lower(): value for name, value in request.headers.items()}


def unsupported_content_type(value: str | None) -> str | None:
    """The message of a 415 for a body that does not say it is JSON, else None.

    ``application/json`` and ``application/*+json`` (any parameters) are
    JSON; so is a missing header (Python's ``requests`` and ``urllib`` send
    raw bytes without one). Anything else is refused, with the fix in the
    message: ``curl -d`` sends ``application/x-www-form-urlencoded``, and a
    browser page may send ``text/plain`` or a form cross-origin without a
    CORS preflight, which would otherwise run requests on an open edge
    (``docs/operations.md``, "HTTP input").
    """
    if value is None or not value.strip():
        return None
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    return (
        f"Unsupported Content-Type '{mime}': the request body must be JSON, sent with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')."
    )


class Refusals:
    """What quart and the surface layer answer before a route runs, in the
    path's surface's shape.

    Args:
        config: The edge's config (the body limits the messages name).
        surfaces: The surface of each path whose errors take its shape.
    """

    def __init__(self, config: EdgeConfig, surfaces: Mapping[str, Surface]) -> None:
        self._server = config.server
        self._surfaces = surfaces

    def _refusal(
        self, exc: HTTPException, method: str, path: str
    ) -> tuple[int, str, ErrorCode, dict[str, str] | None, Surface]:
        status = exc.code or 500
        message, code = {
            404: (unknown_url(method, path), ErrorCode.NOT_FOUND),
            405: (
                f"Method {method} is not allowed on {path}.",
                ErrorCode.METHOD_NOT_ALLOWED,
            ),
            408: (
                f"The request body did not arrive within {self._server.body_read_timeout_s:g} s.",
                ErrorCode.REQUEST_TIMEOUT,
            ),
            413: (
                f"Request body too large (limit {self._server.max_body_bytes} bytes).",
                ErrorCode.REQUEST_ENTITY_TOO_LARGE,
            ),
        }.get(
            # Quart raises no other HTTPException on the edge's routes today.
            status,
            (
                exc.description or exc.name,
                ErrorCode.BAD_REQUEST if status < 500 else ErrorCode.INTERNAL_ERROR,
            ),
        )
        # A body left unread (too slow, too large) must not stay on the
        # connection: after a "Connection: close" response the connection is
        # closed (from a shielded scope, _http1.py) and nothing more is read.
        headers = {"Connection": "close"} if status in (408, 413) else None
        return status, message, code, headers, self._surfaces.get(path, CHAT)

    def refusal(self, exc: HTTPException, method: str, path: str) -> Response:
        """An HTTP error (404, 405, 408, 413...) in the path's surface's shape."""
        status, message, code, headers, surface = self._refusal(exc, method, path)
        return error(status, message, code=code, headers=headers, surface=surface)

    def refusal_answer(self, exc: HTTPException, path: str) -> Answer:
        """``refusal`` of a ``POST`` to a surface route (408, 413), as its answer."""
        status, message, code, headers, surface = self._refusal(exc, "POST", path)
        return error_answer(status, message, code=code, headers=headers, surface=surface)

    def _crash(self, exc: Exception, method: str, path: str) -> Surface:
        """Logs an unexpected exception; the surface its 500 takes the shape of."""
        log.error("unhandled error on %s %s", method, path, exc_info=exc)
        return self._surfaces.get(path, CHAT)

    def crashed(self, exc: Exception, method: str, path: str) -> Response:
        """Logs an unexpected exception; its 500 in the path's surface's shape."""
        surface = self._crash(exc, method, path)
        return error(500, _CRASHED, code=ErrorCode.INTERNAL_ERROR, surface=surface)

    def crashed_answer(self, exc: Exception, path: str) -> Answer:
        """``crashed`` of a ``POST`` to a surface route, as its answer."""
        surface = self._crash(exc, "POST", path)
        return error_answer(500, _CRASHED, code=ErrorCode.INTERNAL_ERROR, surface=surface)
