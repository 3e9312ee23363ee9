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

* **Every chunk of a stream pays hypercorn's and h11's layers.** Each body
  message goes through hypercorn's ASGI send (``HTTPStream.app_send``: a
  ``Body`` event), its protocol's ``stream_send`` (an ``h11.Data``), h11's
  state machine and chunked writer, and ``TCPServer.protocol_send``: all
  for a few bytes of framing around one SSE chunk, once per token of a paced
  stream (``docs/benchmarks.md``, "Tokens per core at fleet scale"). While a
  chunked response's body is under way (its head sent, its last message not
  yet), a body piece is framed here (``chunk``: RFC 9112 §7.1) and written
  to the connection at once by the edge's protocol; the response's first
  and last messages still go through hypercorn and h11, which count nothing
  in a chunked body, so their state stays right. The app finds that writer
  in its scope's ``extensions`` (``BODY_WRITER``, ``body_writer``); it
  answers False when it cannot take the piece (no writer, a head not sent
  yet, a body that is not chunked, a connection gone), and the app sends the
  ASGI message as before.

This module is the rules, sans-IO: which heads are refused and with what
answer (h11 events), and the context that marks a response's last message.
``iop/edge/server/_hypercorn.py`` applies them inside hypercorn's HTTP/1.1
protocol (``EdgeH11Protocol``, which holds, coalesces and shields the writes
described above), a class only the edge's own server builds: other hypercorn
servers in the process (``iop up``'s sim) are plain hypercorn.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterable, Iterator
from itertools import chain
from typing import Any, Final

import h11
from hypercorn.config import Config as HypercornConfig

from iop.api import CHAT
from iop.errors import ErrorCode

__all__ = [
    "BODY_WRITER",
    "BodyWriter",
    "EdgeHypercornConfig",
    "body_writer",
    "chunk",
    "error_response",
    "h11_error",
    "is_chunked",
    "refusal",
    "response_ending",
    "response_ends",
]

# h11's error_status_hint -> message and code, for the heads it refuses.
_H11_ERRORS: Final[dict[int, tuple[str, ErrorCode]]] = {
    400: ("Malformed HTTP request.", ErrorCode.BAD_REQUEST),
    431: ("Request header fields too large.", ErrorCode.REQUEST_HEADER_FIELDS_TOO_LARGE),
}


# Set around the ASGI send of a response's last body message (``response_ends``).
_ENDING: Final = contextvars.ContextVar[bool]("iop_response_ends", default=False)

response_ending: Final = _ENDING.get
"""Whether the ASGI ``send`` running now carries a response's last body message."""


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


BODY_WRITER: Final = "iop.body_writer"
"""The key of a request's ``BodyWriter`` in its scope's ``extensions``."""

BodyWriter = Callable[[bytes], Awaitable[bool]]
"""Writes a piece of a chunked response's body now, or answers False (module docstring)."""


def body_writer(scope: dict[str, Any]) -> BodyWriter | None:
    """The request's ``BodyWriter``, when the edge's hypercorn gave it one."""
    extensions = scope.get("extensions")
    writer = extensions.get(BODY_WRITER) if extensions else None
    return writer if callable(writer) else None


def is_chunked(head: bytes) -> bool:
    """Whether a response ``head`` as h11 wrote it frames its body in chunks."""
    return b"\r\ntransfer-encoding: chunked\r\n" in head.lower()


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (RFC 9112 §7.1); never empty:
    an empty chunk is the body's end."""
    assert data, "an empty chunk ends the body"
    return b"%x\r\n%b\r\n" % (len(data), data)


class EdgeHypercornConfig(HypercornConfig):
    """Hypercorn's config with the edge's HTTP/1.1 head limit.

    Attributes:
        max_header_bytes: Largest request head (request line plus headers);
            also h11's ``max_incomplete_event_size``.
    """

    def __init__(self, *, max_header_bytes: int) -> None:
        super().__init__()
        self.max_header_bytes = max_header_bytes
        self.h11_max_incomplete_size = max_header_bytes


def _head_size(request: h11.Request) -> int:
    """Bytes of ``request``'s head as sent, give or take whitespace."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + 1
    return line + sum(len(n) + len(v) + 4 for n, v in request.headers) + 2


def refusal(request: h11.Request, max_header_bytes: int) -> tuple[int, str, ErrorCode] | None:
    """Why the edge refuses ``request`` at the framing level, if it does.

    Returns:
        ``(status, message, code)``, or None for a request to serve.
    """
    if request.http_version not in (b"1.0", b"1.1"):
        # HTTP/2 with prior knowledge (its preface reads as ``PRI * HTTP/2.0``,
        # RFC 9113 section 3.3): the edge serves HTTP/1.x only, so that every
        # connection passes the guards of this module.
        return (
            505,
            "This server speaks HTTP/1.1 only (HTTP/2 is not served in clear text "
            "or over TLS); the connection is closed.",
            ErrorCode.HTTP_VERSION_NOT_SUPPORTED,
        )
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


def h11_error(status_hint: int, max_header_bytes: int) -> tuple[int, str, ErrorCode]:
    """The answer to a head h11 refused with ``status_hint``: ``(status, message, code)``."""
    message, code = _H11_ERRORS.get(status_hint, ("Malformed HTTP request.", ErrorCode.BAD_REQUEST))
    if status_hint == 431:
        message = f"Request header fields too large (limit {max_header_bytes} bytes)."
    return status_hint, message, code


def error_response(
    status: int, message: str, code: ErrorCode, extra_headers: Iterable[tuple[bytes, bytes]]
) -> tuple[h11.Response, h11.Data, h11.EndOfMessage]:
    """A complete response in OpenAI's error body, with ``Connection: close``.

    Args:
        extra_headers: The server's own (hypercorn's ``response_headers``).
    """
    _, body = CHAT.error_body(status, message, code=code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return (
        h11.Response(status_code=status, headers=list(chain(headers, extra_headers))),
        h11.Data(data=body),
        h11.EndOfMessage(),
    )
