"""The API surface routes, served below quart: one ASGI handler per request.

A ``POST`` to a surface path (``surface_routes`` in ``iop.edge.routes._surfaces``)
is answered here; every other request goes on to the quart app. The answer
itself is the route's (auth, content type, the body, parse, run, stream or
collect: ``iop.edge.routes._surfaces``), given the request's headers and a
way to read its body; what this module replaces is quart's per-request
machinery around it. Quart-trio gives each request a request object with its
own header and body containers, request and app contexts, a response object
processed after the view, and two tasks besides the one hypercorn runs the
app in (one awaits the view, one the client's disconnect): about 13 % of the
edge's CPU for a short stream, and two of the five trio tasks an open stream
keeps on the edge (``docs/benchmarks.md``, "Where the fixed cost goes").

Here a request is its ASGI scope and messages:

* the headers are the scope's (ASGI names are lower case);
* the body is read from ``http.request`` messages, within
  ``server.body_read_timeout_s`` (else 408) and up to
  ``server.max_body_bytes`` (a bigger ``Content-Length`` is refused before
  any byte is read; else 413 once the bytes pass it), both in the surface's
  error shape with ``Connection: close``, as quart's limits were
  (``iop.edge.routes._errors``' ``Refusals`` builds that answer for both);
* once the body is read, ``http.disconnect`` cancels the answer
  (quart-trio's own rule): a client that leaves ends its run as
  ``client_disconnect`` (or ``slow_client``, ``iop.edge.server._stall``). Under
  the edge's hypercorn the request's queue calls back when hypercorn puts
  the message in (``iop.edge.server._asgi_queue``); elsewhere one task waits for
  it;
* the answer is an ``Answer``: the status and headers of
  ``http.response.start`` as ASGI has them, and a body; a whole body goes out
  in one ``http.response.body`` message, a streamed one (``EndKnownBody``)
  piece by piece, its last piece in the message that ends the response;
* an exception before the response starts is logged and answered with a 500
  in the surface's shape, as quart's error handler does.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple

import trio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge, RequestTimeout

from iop.edge.server._asgi_queue import app_queue
from iop.edge.server._http1 import BodyWriter, body_writer, response_ends

__all__ = ["ASGIApp", "Answer", "BodyReader", "EndKnownBody", "SurfaceASGI", "SurfaceAnswer"]

log = logging.getLogger("iop.edge.http")

ASGIApp = Callable[..., Awaitable[None]]


class EndKnownBody(abc.ABC):
    """A streamed body that knows when the piece it just gave is its last.

    ``_send_answer`` sends that piece as the response's last message, so
    that it leaves in one write with the end of the response (the chunked
    terminator, ``_http1.response_ends``) instead of the terminator alone
    after it; the body is closed at that piece, without being asked for one
    more. It is always closed (``aclose``) once sent or abandoned."""

    __slots__ = ()

    @property
    def at_end(self) -> bool:
        return False

    def __aiter__(self) -> EndKnownBody:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> bytes: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...


class Answer(NamedTuple):
    """A surface request's response, as the ASGI messages it goes out in.

    Attributes:
        status: ``http.response.start``'s status.
        headers: ``http.response.start``'s headers (lower-case names, latin-1).
        body: Whole (one ``http.response.body``) or streamed.
    """

    status: int
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes | EndKnownBody


BodyReader = Callable[[], Awaitable[bytes]]
SurfaceAnswer = Callable[[Mapping[str, str], BodyReader], Awaitable[Answer]]
"""Answers one surface request, given its headers (names lower-cased) and a
way to read its body (which raises werkzeug's 408 or 413)."""

RefusalAnswer = Callable[[HTTPException, str], Answer]
"""The answer to a refused request (408, 413), given the request's path."""

CrashAnswer = Callable[[Exception, str], Answer]
"""The answer (and log) for an unexpected exception, given the path."""

_METHOD: Final = "POST"


class _Disconnected(Exception):
    """The client left while its body was being read."""


class SurfaceASGI:
    """``POST`` to a surface path answered here, the rest by ``fallback``.

    Args:
        fallback: The app for every other request (quart).
        answers: The answer of each surface path.
        max_body_bytes: ``server.max_body_bytes``.
        body_limits: A path's own body limit in place of ``max_body_bytes``
            (``POST /v1/files``: ``batches.max_file_bytes`` and its
            multipart envelope).
        body_read_timeout_s: ``server.body_read_timeout_s``.
        refused: Builds the response of a 408 or 413.
        crashed: Logs an unexpected exception and builds its 500.
    """

    def __init__(
        self,
        fallback: ASGIApp,
        answers: Mapping[str, SurfaceAnswer],
        *,
        max_body_bytes: int,
        body_read_timeout_s: float,
        refused: RefusalAnswer,
        crashed: CrashAnswer,
        body_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.fallback = fallback
        self._answers = dict(answers)
        self._max_body_bytes = max_body_bytes
        self._body_limits = dict(body_limits or {})
        self._body_read_timeout_s = body_read_timeout_s
        self._refused = refused
        self._crashed = crashed

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        answer = None
        if scope["type"] == "http" and scope["method"] == _METHOD:
            answer = self._answers.get(scope["path"])
        if answer is None:
            await self.fallback(scope, receive, send)
            return
        await self._serve(answer, scope, receive, send)

    async def _serve(
        self, answer: SurfaceAnswer, scope: dict[str, Any], receive: Any, send: Any
    ) -> None:
        queue = app_queue(scope)
        if queue is not None:
            # The edge's hypercorn tells the disconnect itself: no task.
            with trio.CancelScope() as cancel:
                try:
                    await self._respond(
                        answer,
                        scope,
                        receive,
                        send,
                        lambda: queue.on_disconnect(cancel.cancel),
                        lambda: queue.on_disconnect(None),
                    )
                finally:
                    queue.on_disconnect(None)
            return
        async with trio.open_nursery() as nursery:

            def watch() -> None:
                nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)

            try:
                await self._respond(answer, scope, receive, send, watch, _nothing)
            finally:
                nursery.cancel_scope.cancel()

    async def _respond(
        self,
        answer: SurfaceAnswer,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        watch: Callable[[], None],
        unwatch: Callable[[], None],
    ) -> None:
        """Answer; once the body is read, ``watch()`` makes a disconnect cancel the
        answer, until ``unwatch()``, right before the response's last message."""
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}

        limit = self._body_limits.get(path, self._max_body_bytes)
        read_body = partial(self._read_then_watch, headers, receive, watch, limit)
        try:
            status, head, body = await answer(headers, read_body)
        except HTTPException as exc:  # 408, 413 from read_body
            status, head, body = self._refused(exc, path)
        except _Disconnected:
            return
        except Exception as exc:
            status, head, body = self._crashed(exc, path)
        # A stream holds this frame open until it ends: keep only what the
        # body needs, not the request's headers (1 KB per open stream,
        # docs/benchmarks.md, "Memory", "Second pass").
        del headers, read_body
        await _send_answer(status, head, body, send, unwatch, body_writer(scope))

    async def _read_then_watch(
        self, headers: Mapping[str, str], receive: Any, watch: Callable[[], None], limit: int
    ) -> bytes:
        body = await self._read_body(headers, receive, limit)
        # From now on only a disconnect can arrive: it cancels the answer.
        watch()
        return body

    async def _read_body(self, headers: Mapping[str, str], receive: Any, limit: int) -> bytes:
        """The whole request body, or werkzeug's 413 / 408 (what quart raised).

        Raises:
            RequestEntityTooLarge: Over ``limit`` (``max_body_bytes`` or the
                path's own), by its ``Content-Length`` or once read.
            RequestTimeout: Not all there within ``body_read_timeout_s``.
            _Disconnected: The client left first.
        """
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestEntityTooLarge()
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(self._body_read_timeout_s) as scope:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                data: bytes = message.get("body", b"")
                if data:
                    size += len(data)
                    if size > limit:
                        raise RequestEntityTooLarge()
                    parts.append(data)
                if not message.get("more_body", False):
                    break
        if scope.cancelled_caught:
            raise RequestTimeout()
        return parts[0] if len(parts) == 1 else b"".join(parts)


async def _watch_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _nothing() -> None:
    pass


async def _send_answer(
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes | EndKnownBody,
    send: Any,
    ending: Callable[[], None],
    write: BodyWriter | None = None,
) -> None:
    """An answer as ASGI messages: the start, then the body; ``ending()`` before the last.

    With ``write`` (the connection's ``BodyWriter``), the pieces between a
    stream's first and last are written through it (``_http1.py``)."""
    # Hypercorn keeps the start message (and copies its headers) for the response.
    await send({"type": "http.response.start", "status": status, "headers": headers})
    del headers
    if isinstance(body, bytes):
        # Whole: one message (head, body and end leave in one write, _http1.py).
        ending()
        with response_ends():
            await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    opened = False  # the first piece carries the held head: through hypercorn
    try:
        async for data in body:
            if body.at_end:
                ending()
                with response_ends():
                    await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            # The middle of a stream: straight to the connection (_http1.py).
            if opened and write is not None and await write(data):
                continue
            await send({"type": "http.response.body", "body": data, "more_body": True})
            opened = True
    finally:
        await body.aclose()
    ending()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
