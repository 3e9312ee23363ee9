"""CORS for browser clients: ``server.cors_origins``, preflight included.

A browser calling the API from a page of another origin sends ``Origin`` and,
for a request that is not "simple" (a JSON body, an ``Authorization``
header: every API call), first an ``OPTIONS`` preflight with
``Access-Control-Request-Method`` (the Fetch standard, "CORS protocol",
https://fetch.spec.whatwg.org/#http-cors-protocol). This ASGI wrapper, in
front of the HTTP app:

* answers a preflight from a listed origin itself: 204 with the allowed
  origin, methods and the headers the browser asked for, cached by the
  browser ``PREFLIGHT_MAX_AGE_S``;
* adds ``Access-Control-Allow-Origin`` (and ``Vary: Origin``) to every
  response to a listed origin;
* leaves everything else alone: with no origin listed (the default) or an
  origin not listed, no CORS header is ever sent and the browser refuses
  the page the answer. The API's own auth (client keys) applies either way:
  CORS only lets a browser read what the key already allows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

__all__ = ["PREFLIGHT_MAX_AGE_S", "cors"]

# 10 minutes: Chromium's cap (longer values are cut to it); a page then
# preflights at most every 10 minutes per URL.
PREFLIGHT_MAX_AGE_S: Final = 600
_METHODS: Final = b"GET, POST, DELETE, OPTIONS"

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


def cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """``app`` granting CORS to ``origins`` (``*``: any); ``app`` itself
    when there are none."""
    if not origins:
        return app
    any_origin = "*" in origins
    allowed = {o.encode() for o in origins}

    async def with_cors(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        origin = headers.get(b"origin")
        if origin is None or not (any_origin or origin in allowed):
            await app(scope, receive, send)
            return
        granted = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", b"authorization, content-type")
            reply = [
                *granted,
                (b"access-control-allow-methods", _METHODS),
                (b"access-control-allow-headers", asked),
                (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 204, "headers": reply})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        async def granting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *granted]}
            await send(message)

        await app(scope, receive, granting)

    return with_cors
