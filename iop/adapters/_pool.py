"""The node's HTTP/1.1 client to one backend: a keep-alive pool that costs O(1) per request.

``KeepAliveTransport`` is an ``httpx`` transport (``HTTPBackend`` sends its
requests straight to it, without an ``httpx.AsyncClient`` in front). Each
connection (``_Connection``) is a trio stream (a socket, or TLS over one);
h11 writes the request and reads the response head, and the body's framing
is read by ``iop.wire._http_body.BodyReader``.

Theory of operation
-------------------
Idle connections wait in a stack per origin, most recently used on top: its
socket is the warmest, and the least likely to have been closed by the
server's keep-alive timeout. A request pops the top one and checks only that
one (its keep-alive not expired, its socket not readable: a readable idle
socket is the server's EOF); if none passes, it opens a new connection.
Connections idle for longer than the keep-alive expiry are closed from the
bottom of the stack, where the oldest are, whenever the stack is used.
There is no limit on connections in use, as before: the node's slot limiter
(``max_concurrency``) bounds them. When a response is closed, its connection
goes back on the stack if its body was read to the end and both sides keep
it alive, else it is closed (closed early, or cancelled: that is what tells
the backend to stop generating). At most ``max_idle`` wait; more are closed.

Why not httpx's own pool (httpcore 1.0.9 ``AsyncConnectionPool``), measured
in ``docs/benchmarks.md`` ("Where the fixed cost goes"):

* every request *and* every response close walk the whole connection list;
  for each idle connection they poll its socket (``has_expired`` ->
  ``is_readable``, a ``poll`` syscall) and count the whole list again (the
  O(N^2) keep-alive check of encode/httpcore#1035): 12 % of the node's CPU at
  32 concurrent streams;
* that check compares the *total* number of connections with
  ``max_keepalive_connections``: above it, every connection that goes idle is
  closed, and the next request opens a new one.

Why not httpcore's connection either ("Per chunk and non-streaming (second
pass)" in the same page): a streamed answer comes as one HTTP chunk per
token, and httpcore gives each chunk its own trip through h11's reader, its
event loop and two generators, about 15 µs of the node's CPU per token. Here
each socket read becomes one piece of body, however many chunks it held.

The request head goes out together with the body, in one ``send_all`` (one
TCP segment, one wakeup of the backend), unless the body is bigger than
``HEAD_MAX_BYTES`` (it is not copied to save a segment). Reads have no cancel
scope when there is no read timeout (the node's case: the run's deadlines
apply, ``iop.adapters._http``).

A server may answer before it has taken the whole body (an early 413 from a
smaller body limit) and stop reading: a write that then fails or times out
while the socket has something to read is followed by reading that answer,
as httpcore does; the connection is not reused.

Errors are httpx's (the same classes httpx's own transport raises), so what
the adapters map (``map_transport_error``) is unchanged.

Closing a connection runs shielded (the pool's check-in and ``aclose``, and
a response its reader abandons): it must finish even while the run is
cancelled, since the closed socket is what tells the backend to stop. Every
close ends in ``_close``, which gives it ``CLOSE_TIMEOUT_S``.
"""

from __future__ import annotations

import enum
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Final

import h11
import httpx
import trio

from iop.wire._http_body import BodyFraming, BodyFramingError, BodyReader

__all__ = [
    "CLOSE_TIMEOUT_S",
    "HEAD_MAX_BYTES",
    "KEEPALIVE_EXPIRY_S",
    "READ_BYTES",
    "KeepAliveTransport",
]

log = logging.getLogger("iop.adapters")

# httpx's default keep-alive expiry: an idle connection older than this is
# closed rather than reused (servers close theirs after 5-75 s; uvicorn, which
# serves vLLM, after 5 s).
KEEPALIVE_EXPIRY_S: Final = 5.0

# A request whose head and body together are at most this is sent in one
# write; a bigger body goes out after the head, so nothing large is ever
# copied to be joined. A request head is a few hundred bytes.
HEAD_MAX_BYTES: Final = 16 * 1024

# Bytes asked of the socket per read (httpcore's figure): a streamed answer
# arrives a few hundred bytes at a time; a long non-streamed one in 64 KiB.
READ_BYTES: Final = 64 * 1024

# Our side of closing a backend connection, shielded (module docstring). A
# trio socket closes before its first checkpoint and a TLS stream made
# https_compatible sends no close_notify, so no close waits today; a stream
# that would (a TLS close_notify into a full send buffer) must not hold a
# cancelled run's end, and its node slot, for ever.
CLOSE_TIMEOUT_S: Final = 1.0

_Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


async def _close(stream: trio.abc.AsyncResource) -> None:
    """Close ``stream``, shielded, given up after ``CLOSE_TIMEOUT_S``."""
    with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
        await stream.aclose()
    if scope.cancelled_caught:
        # trio's streams release their socket when their close is
        # cancelled; what is left is not ours to wait for.
        log.warning("closing a backend connection took over %gs: abandoned", CLOSE_TIMEOUT_S)


class _ConnState(enum.Enum):
    IDLE = "idle"  # waiting on the stack, or new
    ACTIVE = "active"  # a request or its response is under way
    CLOSED = "closed"


def _timeout(request: httpx.Request, phase: str) -> float | None:
    value = request.extensions.get("timeout", {}).get(phase)
    return None if value is None else float(value)


def _tokens(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    """The comma-separated, lower-cased values of every ``name`` header."""
    out: set[bytes] = set()
    for key, value in headers:
        if key.lower() == name:
            out.update(v.strip().lower() for v in value.split(b","))
    return out


def _framing(method: bytes, response: h11.Response) -> tuple[BodyFraming, int]:
    """How the body of ``response`` ends (RFC 9112 §6.3; h11 has checked
    that Content-Length is one number and Transfer-Encoding only chunked)."""
    status = response.status_code
    if method == b"HEAD" or status in (204, 304):
        return BodyFraming.NONE, 0
    if b"chunked" in _tokens(response.headers, b"transfer-encoding"):
        return BodyFraming.CHUNKED, 0
    for key, value in response.headers:
        if key == b"content-length":
            return BodyFraming.LENGTH, int(value)
    return BodyFraming.CLOSE, 0


class _Connection:
    """One HTTP/1.1 connection to an origin, used for one request at a time."""

    __slots__ = ("_body", "_keep", "_reader", "_stream", "idle_since", "state")

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self.state = _ConnState.IDLE
        self.idle_since = 0.0
        self._reader: BodyReader | None = None
        self._body = b""  # body bytes read along with the head
        self._keep = False  # both sides keep the connection alive

    def readable(self) -> bool:
        """An idle socket with something to read: the server's EOF (or junk)."""
        stream = self._stream
        plain = stream if isinstance(stream, trio.SocketStream) else stream.transport_stream
        return plain.socket.is_readable()

    async def request(self, request: httpx.Request) -> h11.Response:
        """Send ``request``; read its response's head.

        Raises:
            httpx.TransportError: The request could not be sent, or the head
                not read (the connection is then closed).
        """
        self.state = _ConnState.ACTIVE
        h11_conn = h11.Connection(h11.CLIENT)
        url = request.url
        method = request.method.encode("ascii")
        try:
            head = h11_conn.send(
                h11.Request(method=method, target=url.raw_path, headers=request.headers.raw)
            )
            assert isinstance(request.stream, httpx.AsyncByteStream)
            body = b"".join([bytes(part) async for part in request.stream])
            data = h11_conn.send(h11.Data(data=body)) if body else b""
            h11_conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            await self.aclose()
            raise httpx.LocalProtocolError(str(exc)) from exc
        assert head is not None
        assert data is not None
        try:
            write_s = _timeout(request, "write")
            if len(head) + len(data) <= HEAD_MAX_BYTES:
                sent = await self._send_all(head + data, write_s)
            else:
                sent = await self._send_all(head, write_s)
                sent = sent and await self._send_all(data, write_s)
            response = await self._read_head(h11_conn, _timeout(request, "read"))
        except BaseException:
            await self.aclose()
            raise
        keep = sent and response.http_version == b"1.1"
        keep = keep and b"close" not in _tokens(request.headers.raw, b"connection")
        self._keep = keep and b"close" not in _tokens(response.headers, b"connection")
        framing, length = _framing(method, response)
        self._reader = BodyReader(framing, length)
        self._body, _ = h11_conn.trailing_data
        return response

    async def _send_all(self, data: bytes, limit_s: float | None) -> bool:
        """Send ``data``: True, or False if the server answered before
        taking it all and stopped reading (that answer is the response)."""
        try:
            with trio.fail_after(float("inf") if limit_s is None else limit_s):
                await self._stream.send_all(data)
        except trio.TooSlowError as exc:
            if self.readable():
                return False
            raise httpx.WriteTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if not isinstance(exc, trio.ClosedResourceError) and self.readable():
                return False  # the same, the server having closed its read side
            raise httpx.WriteError(str(exc) or "the connection broke") from exc
        return True

    async def _read(self, limit_s: float | None) -> bytes:
        try:
            if limit_s is None:
                return bytes(await self._stream.receive_some(READ_BYTES))
            with trio.fail_after(limit_s):
                return bytes(await self._stream.receive_some(READ_BYTES))
        except trio.TooSlowError as exc:
            raise httpx.ReadTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx.ReadError(str(exc) or "the connection broke") from exc

    async def _read_head(self, h11_conn: h11.Connection, limit_s: float | None) -> h11.Response:
        while True:
            try:
                event = h11_conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc)) from exc
            if event is h11.NEED_DATA:
                data = await self._read(limit_s)
                if not data and h11_conn.their_state is h11.SEND_RESPONSE:
                    raise httpx.RemoteProtocolError(
                        "Server disconnected without sending a response."
                    )
                h11_conn.receive_data(data)
            elif isinstance(event, h11.Response):
                return event
            elif not isinstance(event, h11.InformationalResponse):  # pragma: no cover - h11's
                raise httpx.RemoteProtocolError(
                    f"unexpected {type(event).__name__} before a response"
                )

    async def read_body(self) -> bytes:
        """The body's next bytes (at least one), or b"" at its end.

        Raises:
            httpx.RemoteProtocolError: Broken framing, or EOF before the end.
            httpx.ReadError: The socket broke.
        """
        reader = self._reader
        assert reader is not None
        try:
            if self._body:
                data, self._body = self._body, b""
                piece = reader.feed(data)
                if piece:
                    return piece
            while not reader.done:
                data = await self._read(None)
                if not data:
                    reader.feed_eof()
                    self._keep = False
                    return b""
                piece = reader.feed(data)
                if piece:
                    return piece
        except BodyFramingError as exc:
            self._keep = False
            raise httpx.RemoteProtocolError(str(exc)) from exc
        return b""

    @property
    def reusable(self) -> bool:
        """The response was read to its end and both sides keep the connection."""
        reader = self._reader
        return (
            self.state is _ConnState.ACTIVE
            and self._keep
            and reader is not None
            and reader.done
            and not self._body
        )

    def release(self) -> None:
        """Ready for the next request."""
        self.state = _ConnState.IDLE
        self._reader = None

    async def aclose(self) -> None:
        if self.state is _ConnState.CLOSED:
            return
        self.state = _ConnState.CLOSED
        self._reader = None
        # trio closes the socket before its checkpoint: a cancelled caller
        # still closes it, and the backend sees it at once.
        await _close(self._stream)


_OriginKey = tuple[str, str, int]


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to a backend with a LIFO keep-alive pool (module docstring).

    Args:
        max_idle: Idle connections kept per origin; more are closed. The
            node's slot count, so a burst of that many runs reuses its
            connections.
        ssl_context: For https endpoints (``httpx.create_ssl_context()``).
        keepalive_expiry_s: An idle connection older than this is not reused.
        clock: Seconds, monotonic: when a connection went idle (tests set it).
    """

    def __init__(
        self,
        *,
        max_idle: int,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_expiry_s: float | None = KEEPALIVE_EXPIRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_idle = max_idle
        self._clock = clock
        self._ssl_context = ssl_context
        self._keepalive_expiry_s = keepalive_expiry_s
        # Per origin: idle connections, oldest first.
        self._idle: dict[_OriginKey, deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._closed = False

    @property
    def idle_connections(self) -> int:
        """Connections waiting for a request, over all origins."""
        return sum(len(stack) for stack in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported scheme {url.scheme!r}")
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        conn = await self._checkout(origin, request)
        try:
            head = await conn.request(request)
        finally:
            if conn.state is _ConnState.CLOSED:
                self._open.discard(conn)
        return httpx.Response(
            status_code=head.status_code,
            headers=head.headers.raw_items(),
            stream=_PooledBody(origin, conn, self),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    async def _checkout(self, origin: _OriginKey, request: httpx.Request) -> _Connection:
        stack = self._idle.get(origin)
        if stack:
            await self._prune(stack)
        while stack:
            conn = stack.pop()
            if not conn.readable():
                return conn
            self._open.discard(conn)
            await conn.aclose()
        conn = _Connection(await self._connect(origin, _timeout(request, "connect")))
        self._open.add(conn)
        return conn

    async def _connect(self, origin: _OriginKey, limit_s: float | None) -> _Stream:
        scheme, host, port = origin
        try:
            with trio.fail_after(float("inf") if limit_s is None else limit_s):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError as exc:
            raise httpx.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        if scheme != "https":
            return stream
        context = self._ssl_context
        if context is None:
            context = self._ssl_context = httpx.create_ssl_context()
        context.set_alpn_protocols(["http/1.1"])
        tls = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
        try:
            with trio.fail_after(float("inf") if limit_s is None else limit_s):
                await tls.do_handshake()
        except trio.TooSlowError as exc:
            await _close(stream)
            raise httpx.ConnectTimeout(str(exc)) from exc
        except trio.BrokenResourceError as exc:
            await _close(stream)
            raise httpx.ConnectError(str(exc.__cause__ or exc)) from exc
        return tls

    async def _checkin(self, origin: _OriginKey, conn: _Connection) -> None:
        """A response of ``conn`` is closed: keep it for the next request, or let it go."""
        if not conn.reusable or self._closed:
            self._open.discard(conn)
            await conn.aclose()
            return
        conn.release()
        stack = self._idle.setdefault(origin, deque())
        await self._prune(stack)
        if len(stack) >= self._max_idle:
            self._open.discard(conn)
            await conn.aclose()
            return
        conn.idle_since = self._clock()
        stack.append(conn)

    async def _prune(self, stack: deque[_Connection]) -> None:
        """Close the connections idle for longer than the keep-alive expiry:
        the oldest are at the bottom, so this looks at no others."""
        if self._keepalive_expiry_s is None:
            return
        limit = self._clock() - self._keepalive_expiry_s
        while stack and stack[0].idle_since < limit:
            conn = stack.popleft()
            self._open.discard(conn)
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every connection, idle or in use (idempotent)."""
        self._closed = True
        conns, self._open = list(self._open), set()
        self._idle.clear()
        with trio.CancelScope(shield=True):
            for conn in conns:
                await conn.aclose()


class _PooledBody(httpx.AsyncByteStream):
    """A response body, one piece per socket read; closing it hands its
    connection back to the pool.

    An iterator class rather than an async generator, so that leaving the
    body early leaves no generator to trio's finalizer, and however many
    loops read it (the pump and then its drain) share one position.
    """

    __slots__ = ("_closed", "_conn", "_origin", "_pool")

    def __init__(self, origin: _OriginKey, conn: _Connection, pool: KeepAliveTransport) -> None:
        self._origin = origin
        self._conn = conn
        self._pool = pool
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        piece = await self._conn.read_body()
        if not piece:
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):  # it only closes, bounded (module docstring)
            await self._pool._checkin(self._origin, self._conn)
