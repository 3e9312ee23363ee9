"""HTTP/1.1 framing guards for the edge, below the ASGI app (hypercorn + h11).

Two answers come from hypercorn itself, before any request reaches quart,
and both were wrong for an OpenAI-compatible server:

* **Request smuggling** (RFC 9112 §6.1). h11 frames a request that has both
  ``Content-Length`` and ``Transfer-Encoding: chunked`` by the chunked
  encoding alone and keeps the connection open, so bytes a proxy in front
  counted as this request's body are parsed here as a second request: one
  connection, two answers. The RFC lets a server reject such a request and
  requires it to close the connection either way; the edge does both: a 400
  in OpenAI's body with ``Connection: close``, and nothing else read from
  the connection.
* **Errors h11 raises on the request head** (too long: 431; malformed: 400):
  hypercorn answers them with an empty body. The edge sends OpenAI's error
  body instead. h11 counts only a head that is still *incomplete* against
  ``max_incomplete_event_size``; a complete head that arrived in one read is
  never measured, so the edge measures every head itself and answers 431
  above ``server.max_header_bytes`` whichever way it arrived.

* **The response head is a write of its own.** Hypercorn sends the status
  line and headers as soon as the app starts its response, and the body in
  later writes: one more ``send`` syscall, one more trio schedule point and
  one more TCP segment for the client to wake up for, on every response
  (``docs/benchmarks.md``, "Where the fixed cost goes"). The edge holds the
  head and sends it with the response's first body write (or its end).
  Every edge response starts its body right away: a JSON body is whole, and
  an SSE body's first piece is the stream's opening chunk (with its first
  events), written before the generator awaits anything. A response whose
  app fails between its head and its body loses the head with the
  connection, which then closes: the client sees the same failed exchange,
  one line shorter.

* **The chunked terminator is a write of its own.** A streamed response's
  last body message ends it, but hypercorn writes that message's data and
  then the end (``0\r\n\r\n``) in two writes. The ASGI layer sends a
  response's last message inside ``response_ends()``; the data sent then is
  held and written with the end, which hypercorn sends right after it in
  the same call (a whole JSON body: head, body and end in one write).

* **A connection that must close stays open.** After a response with
  ``Connection: close`` (a 408 for a dribbled body, a 413, a client that
  asked for it), hypercorn closes the socket from the task that finished the
  response, which under quart-trio is the app's task, cancelled by then:
  ``send_eof`` raises ``Cancelled``, the socket stays open, and a client
  that keeps dribbling keeps its connection. The close (``send_eof`` and
  ``aclose``, neither of which blocks) runs shielded.

* **The keep-alive timer outlives its connection, or dies at birth.**
  Hypercorn's idle timer is a task beside the connection's reader. When a
  client closes the connection after an answer, the reader returns but the
  connection's task group waits for the timer, so the socket and its tasks
  stay for ``keep_alive_timeout_s``: the edge stops the timer once the
  connection is closed. After a quart route's response, the timer is
  restarted from the app's task just as quart-trio cancels it (on the
  ``http.disconnect`` hypercorn queued a moment before), so the new timer is
  cancelled before it starts and an idle connection stays open for good:
  the edge sends that restart shielded (docs/architecture.md, "Facts about
  our dependencies: hypercorn").

Hypercorn has no hook for its protocol class: ``ProtocolWrapper`` builds an
``H11Protocol`` found in ``hypercorn.protocol``'s namespace. ``install()``
puts ``EdgeH11Protocol`` there once; it is a subclass that behaves exactly
like hypercorn's own unless the server's config is an ``EdgeHypercornConfig``,
so other hypercorn servers in the process (``iop sim``'s backend) are
untouched. It overrides three methods hypercorn calls on every request
(``_check_protocol``, before the app sees the request), on every h11
error (``_send_error_response``) and for every h11 event it sends
(``_send_h11_event``); hypercorn is pinned below 0.19 and
``tests/edge/test_http_input.py`` drives them through real sockets, so a
hypercorn that stops calling them fails there.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from itertools import chain
from typing import Any, Final

import h11
import hypercorn.protocol
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import H11SendableEvent

from iop.api import CHAT
from iop.errors import ErrorCode

__all__ = ["EdgeH11Protocol", "EdgeHypercornConfig", "install", "response_ends"]

# h11's error_status_hint -> message and code, for the heads it refuses.
_H11_ERRORS: Final[dict[int, tuple[str, ErrorCode]]] = {
    400: ("Malformed HTTP request.", ErrorCode.BAD_REQUEST),
    431: ("Request header fields too large.", ErrorCode.REQUEST_HEADER_FIELDS_TOO_LARGE),
}


# Set around the ASGI send of a response's last body message (``response_ends``).
_ENDING: Final = contextvars.ContextVar[bool]("iop_response_ends", default=False)


@contextlib.contextmanager
def response_ends() -> Iterator[None]:
    """Around the ASGI ``send`` of a response's last body message (``more_body``
    false): its data leaves in one write with the response's end (module
    docstring). Hypercorn sends both from within that ``send``, in the
    app's task, where this context variable is seen."""
    token = _ENDING.set(True)
    try:
        yield
    finally:
        _ENDING.reset(token)


class EdgeHypercornConfig(HypercornConfig):
    """Hypercorn's config, marking a server as the edge's (module docstring).

    Attributes:
        max_header_bytes: Largest request head (request line plus headers);
            also h11's ``max_incomplete_event_size``.
    """

    def __init__(self, *, max_header_bytes: int) -> None:
        super().__init__()
        self.max_header_bytes = max_header_bytes
        self.h11_max_incomplete_size = max_header_bytes


class _Refused(Exception):
    """Raised out of hypercorn's event loop once a refusal is sent and the
    connection closed, so the request never becomes a stream."""


def _head_size(request: h11.Request) -> int:
    """Bytes of ``request``'s head as sent, give or take whitespace."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + 1
    return line + sum(len(n) + len(v) + 4 for n, v in request.headers) + 2


def refusal(request: h11.Request, max_header_bytes: int) -> tuple[int, str, ErrorCode] | None:
    """Why the edge refuses ``request`` at the framing level, if it does.

    Returns:
        ``(status, message, code)``, or None for a request to serve.
    """
    if _head_size(request) > max_header_bytes:
        return (
            431,
            f"Request header fields too large (limit {max_header_bytes} bytes).",
            ErrorCode.REQUEST_HEADER_FIELDS_TOO_LARGE,
        )
    names = {name for name, _ in request.headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        return (
            400,
            "A request must not have both Content-Length and Transfer-Encoding "
            "(RFC 9112 section 6.1); the connection is closed.",
            ErrorCode.INVALID_REQUEST,
        )
    return None


class EdgeH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with the edge's guards (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes not sent yet: a response head (it goes out with the next
        # write), and a last body message's data (it goes out with the end).
        self._held: bytes | None = None
        if self._edge_limit() is not None:
            send = self.send

            # A close, and the idle timer's restart or stop, must not be
            # cut short by a cancel of the task that asks for them (module
            # docstring); neither blocks.
            async def send_shielded(event: Event) -> None:
                if isinstance(event, Closed | Updated):
                    with trio.CancelScope(shield=True):
                        await send(event)
                else:
                    await send(event)

            self.send = send_shielded

    def _edge_limit(self) -> int | None:
        cfg = self.config
        return cfg.max_header_bytes if isinstance(cfg, EdgeHypercornConfig) else None

    async def handle(self, event: Event) -> None:
        with contextlib.suppress(_Refused):
            await super().handle(event)
        if isinstance(event, Closed) and self._edge_limit() is not None:
            # The connection is over (module docstring): its idle timer goes too.
            await self.send(Updated(idle=False))

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        if self._edge_limit() is None:
            await super()._send_h11_event(event)
            return
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            # hypercorn's rule: an event h11 refuses after the client broke
            # the protocol is dropped.
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if isinstance(event, h11.Response):
            self._held = data  # module docstring: sent with the body
            return
        if isinstance(event, h11.Data) and _ENDING.get():
            # The end follows in this same send (module docstring).
            self._held = data if self._held is None else self._held + data
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        await self.send(RawData(data=data))

    async def _check_protocol(self, event: h11.Request) -> None:
        limit = self._edge_limit()
        if limit is not None and (refused := refusal(event, limit)) is not None:
            await self._send_openai_error(*refused)
            await self.send(Closed())
            raise _Refused
        await super()._check_protocol(event)

    async def _send_error_response(self, status_code: int) -> None:
        if self._edge_limit() is None:
            await super()._send_error_response(status_code)
            return
        message, code = _H11_ERRORS.get(
            status_code, ("Malformed HTTP request.", ErrorCode.BAD_REQUEST)
        )
        if status_code == 431:
            message = f"Request header fields too large (limit {self._edge_limit()} bytes)."
        await self._send_openai_error(status_code, message, code)

    async def _send_openai_error(self, status: int, message: str, code: ErrorCode) -> None:
        """A complete response in OpenAI's error body, with ``Connection: close``."""
        _, body = CHAT.error_body(status, message, code=code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await self._send_h11_event(
            h11.Response(
                status_code=status,
                headers=list(chain(headers, self.config.response_headers("h11"))),
            )
        )
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def install() -> None:
    """Make hypercorn build ``EdgeH11Protocol`` for HTTP/1.1 (idempotent)."""
    hypercorn.protocol.H11Protocol = EdgeH11Protocol  # type: ignore[attr-defined]
