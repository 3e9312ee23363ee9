"""The node's HTTP/1.1 transport to one backend: a keep-alive pool that costs O(1) per request.

``KeepAliveTransport`` is an ``httpx`` transport (``HTTPBackend`` sends its
requests straight to it, without an ``httpx.AsyncClient`` in front). HTTP/1.1
itself stays httpcore's: each connection is an ``httpcore.AsyncHTTPConnection``
(h11 framing, keep-alive state, TLS set-up). What this module owns is which
connection a request gets, and the socket under it.

Theory of operation
-------------------
Idle connections wait in a stack per origin, most recently used on top: its
socket is the warmest, and the least likely to have been closed by the
server's keep-alive timeout. A request pops the top one and checks only that
one (idle, its keep-alive not expired, its socket not readable: a readable
idle socket is the server's EOF); if none passes, it opens a new connection.
Connections idle for longer than the keep-alive expiry are closed from the
bottom of the stack, where the oldest are, whenever the stack is used.
There is no limit on connections in use, as before: the node's slot limiter
(``max_concurrency``) bounds them. When a response is closed, its connection
goes back on the stack if httpcore left it idle (the body was read to its
end), else it is gone (closed early, or cancelled: that is what tells the
backend to stop generating). At most ``max_idle`` wait; more are closed.

An early answer: a server with a smaller body limit than the edge's (the
sim's ``MAX_REQUEST_BYTES``, 4 MiB, against the edge's 8 MiB) answers 413
after reading part of a body and reads no more. When the kernel's socket
buffers take the rest, the write succeeds and httpcore, seeing the whole
request sent and the whole response read, leaves the connection idle; but
the server is still behind the bytes it never read, and the next request on
that connection waits for an answer that never comes (the run's
first-token timeout, a 504). So a write larger than ``HEAD_MAX_BYTES`` that
finds the server's answer already waiting (or a write that fails) marks the
connection, and it is closed with its response, never reused. A server that
answers a whole large body very fast may be taken for one that answered
early: that costs one new connection, nothing else.

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

A response body (``_PooledBody``) is read from the connection's h11 state
and socket directly, not through httpcore's body iterator: that one yields
each HTTP chunk (each of a backend's SSE events: the sim and vLLM write one
per token) through two async generators, an exception map (a ``contextlib``
context manager) around each of h11's events and a ``bytes`` copy, and a
node paid it per token. Here one ``__anext__`` returns everything one
socket read completed, in one piece. A chunked body's framing is h11's
until h11 stands between two chunks with nothing left unparsed (at once,
for a head that came alone or with whole chunks), then the node's own
decoder's (``iop.wire.ChunkedDecoder``, checked against h11 with
hypothesis): h11 paid an event, a state-machine step and two
``next_event`` calls per chunk, and an engine writes one token per chunk.
At the last chunk h11 is given ``0\r\n`` and what followed, so the
trailer section, the end of the message and the connection's state
(keep-alive or not) are h11's and httpcore's as before; an end of stream
between chunks is h11's error too. A response whose stream is not httpcore's HTTP/1.1 one
(``_direct_body``: another httpcore, a request traced through httpcore's
``trace`` extension) is read through httpcore's iterator as before
(``tests/adapters/test_pool.py`` pins the attributes read).

The socket (``_SocketStream``) is trio's, without a cancel scope per read
when there is no read timeout (the node's case); over plain TCP such a read
waits until the socket is readable and then reads once (trio's ``recv``
tries first, and a paced backend's next token is never there yet: a failed
system call per token), and it sends the request
head together with the body: httpcore writes them as two ``send`` calls (two
TCP segments, two wakeups of the backend); a head up to ``HEAD_MAX_BYTES`` is
held until the next write or read and then goes out with it.

Errors: the socket raises trio's errors as httpcore's, as httpcore's
network-stream interface requires (httpcore's own trio backend does the
same): a deadline becomes the phase's timeout (``ConnectTimeout``,
``ReadTimeout``, ``WriteTimeout``), a broken or closed stream a
``ConnectError``, ``ReadError`` or ``WriteError``. That is not only a
label: httpcore's HTTP/1.1 connection reads the server's answer after a
``WriteError`` (the early answer above), and only here is the phase known.
From there on httpcore's exceptions go out of this transport as they are,
although it is an httpx transport in shape: the adapters call it inside
their one error boundary (``iop.adapters._errors.backend_errors``), which
maps httpcore's exceptions straight to ``BackendError``. Nothing uses this
transport under an ``httpx.AsyncClient``, which would let them through.

Closing a connection runs shielded (httpcore closes a response it abandons
from a shielded scope, and so do the pool's check-in and ``aclose``): it
must finish even while the run is cancelled, since the closed socket is
what tells the backend to stop. Every such close ends in
``_SocketStream.aclose``, which gives it ``CLOSE_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import Any, Final, Protocol, cast

import h11
import httpcore
import httpx
import trio

from iop.wire import ChunkedDecoder, ChunkedError

__all__ = ["CLOSE_TIMEOUT_S", "HEAD_MAX_BYTES", "KEEPALIVE_EXPIRY_S", "KeepAliveTransport"]

log = logging.getLogger("iop.adapters")

# httpx's default keep-alive expiry: an idle connection older than this is
# closed rather than reused (servers close theirs after 5-75 s; uvicorn, which
# serves vLLM, after 5 s).
KEEPALIVE_EXPIRY_S: Final = 5.0

# A write this small is held and sent with the next one. A request head is a
# few hundred bytes (the configured headers included); a bigger first write
# goes out at once, so nothing large is ever copied to be joined.
HEAD_MAX_BYTES: Final = 16 * 1024

# Our side of closing a backend connection, shielded (module docstring). A
# trio socket closes before its first checkpoint and a TLS stream made
# https_compatible sends no close_notify, so no close waits today; a stream
# that would (a TLS close_notify into a full send buffer) must not hold a
# cancelled run's end, and its node slot, for ever.
CLOSE_TIMEOUT_S: Final = 1.0

# The most one body read asks the socket for: httpcore's own read size
# (``AsyncHTTP11Connection.READ_NUM_BYTES``), so a read returns what it did.
READ_BYTES: Final = 64 * 1024


class _CoreBody(Protocol):
    """What httpcore's HTTP/1.1 response stream offers."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class _SocketStream(httpcore.AsyncNetworkStream):
    """httpcore's view of one trio stream (a socket, or TLS over one).

    httpcore's interface passes each read's and write's timeout as an
    argument (ASYNC109 is silenced for it); the node passes None for reads.
    """

    def __init__(self, stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> None:
        self._stream = stream
        # Plain TCP is read by waiting, then one read (``read``); TLS through
        # trio's stream, which owns the TLS state.
        self._plain = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._held: bytes | None = None  # a small write not sent yet (module docstring)
        # The server answered while a large write was still going out: it may
        # not have taken the body in full (module docstring, "early answer").
        self.answered_early = False

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._held is not None:
            await self._send(b"", None)
        if timeout is None and self._plain is not None:
            return await self._wait_and_read(self._plain, max_bytes)
        try:
            if timeout is None:
                return bytes(await self._stream.receive_some(max_bytes))
            with trio.fail_after(timeout):
                return bytes(await self._stream.receive_some(max_bytes))
        except trio.TooSlowError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def _wait_and_read(self, sock: trio.socket.SocketType, max_bytes: int) -> bytes:
        """Wait until the socket is readable, then read once.

        trio's ``recv`` tries first, and a paced backend's next token is
        never there yet: a read failing with EAGAIN under two context
        managers per token, before the wait and the read. Waiting first
        costs one schedule point per read whether or not data was there.
        """
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError as exc:  # closed while we waited
                raise httpcore.ReadError(str(exc)) from exc
            fd = sock.fileno()
            if fd < 0:
                raise httpcore.ReadError("the connection was closed")
            try:
                return os.read(fd, max_bytes)
            except BlockingIOError:
                continue  # woken for nothing (another reader's data): wait again
            except OSError as exc:  # worded as trio's (its BrokenResourceError)
                raise httpcore.ReadError(f"socket connection broken: {exc}") from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        if self._held is None and len(buffer) <= HEAD_MAX_BYTES:
            self._held = buffer
            return
        await self._send(buffer, timeout)

    async def _send(self, buffer: bytes, limit_s: float | None) -> None:
        held, self._held = self._held, None
        if held is not None:
            if len(buffer) <= HEAD_MAX_BYTES:
                buffer = held + buffer
            else:  # too big to copy for one segment less
                await self._send_all(held, limit_s)
        await self._send_all(buffer, limit_s)

    async def _send_all(self, data: bytes, limit_s: float | None) -> None:
        try:
            with trio.fail_after(float("inf") if limit_s is None else limit_s):
                await self._stream.send_all(data)
        except trio.TooSlowError as exc:
            if self._peer_answered():
                # The server answered before taking the whole body (an early
                # 413 from a smaller body limit) and stopped reading: httpcore
                # reads that answer after a WriteError, not after a timeout.
                self.answered_early = True
                raise httpcore.WriteError("the server answered before taking the body") from exc
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.answered_early = True  # whatever it answers, the body did not all go
            raise httpcore.WriteError(str(exc)) from exc
        if len(data) > HEAD_MAX_BYTES and self._peer_answered():
            # The kernel's buffers took the rest of a body the server had
            # stopped reading, and its answer is already here: the request
            # looks complete to httpcore, which would keep the connection
            # idle, but the server is still behind the unread bytes.
            self.answered_early = True

    def _peer_answered(self) -> bool:
        """Whether the server has sent something (its response) meanwhile."""
        stream = self._stream
        plain = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        # (Only a socket can tell; a stream that is none, a test's, never answered early.)
        return isinstance(plain, trio.SocketStream) and plain.socket.is_readable()

    async def aclose(self) -> None:
        self._held = None
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
            await self._stream.aclose()
        if scope.cancelled_caught:
            # trio's streams release their socket when their close is
            # cancelled; what is left is not ours to wait for.
            log.warning("closing a backend connection took over %gs: abandoned", CLOSE_TIMEOUT_S)

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        assert isinstance(self._stream, trio.SocketStream)
        assert self._held is None
        tls = trio.SSLStream(
            self._stream,
            ssl_context=ssl_context,
            server_hostname=server_hostname,
            https_compatible=True,
        )
        try:
            with trio.fail_after(float("inf") if timeout is None else timeout):
                await tls.do_handshake()
        except BaseException as exc:
            # httpcore gets no stream to close from a handshake that did not
            # end: the socket is closed here, whatever ended it (a cancel
            # too; the close is shielded and bounded), then it goes on.
            await self.aclose()
            if isinstance(exc, trio.TooSlowError):
                raise httpcore.ConnectTimeout(str(exc)) from exc
            if isinstance(exc, trio.BrokenResourceError):
                raise httpcore.ConnectError(str(exc)) from exc
            raise
        return _SocketStream(tls)

    def _socket(self) -> trio.socket.SocketType:
        stream = self._stream
        return (
            stream.socket
            if isinstance(stream, trio.SocketStream)
            else stream.transport_stream.socket
        )

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and isinstance(self._stream, trio.SSLStream):
            # trio keeps the ssl.SSLObject private (python-trio/trio#542);
            # httpcore's own trio stream reads it the same way.
            return getattr(self._stream, "_ssl_object", None)
        if info == "socket":
            return self._socket()
        if info == "client_addr":
            return self._socket().getsockname()
        if info == "server_addr":
            return self._socket().getpeername()
        if info == "is_readable":
            return self._socket().is_readable()
        return None


class _TrioBackend(httpcore.AsyncNetworkBackend):
    """Opens ``_SocketStream``s (trio sets ``TCP_NODELAY`` on TCP sockets)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with trio.fail_after(float("inf") if timeout is None else timeout):
                stream = await trio.open_tcp_stream(host, port, local_address=local_address)
        except trio.TooSlowError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        for option in socket_options or ():
            stream.setsockopt(*option)
        return _SocketStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - endpoints are http(s) URLs
        raise httpcore.UnsupportedProtocol("unix sockets are not supported")

    async def sleep(self, seconds: float) -> None:  # pragma: no cover - only for connect retries
        await trio.sleep(seconds)


_OriginKey = tuple[bytes, bytes, int]


def _key(origin: httpcore.Origin) -> _OriginKey:
    return origin.scheme, origin.host, origin.port  # an Origin is not hashable


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
        self._backend = _TrioBackend()
        # Per origin: (when it went idle, connection), oldest first.
        self._idle: dict[_OriginKey, deque[tuple[float, httpcore.AsyncHTTPConnection]]] = {}
        self._open: set[httpcore.AsyncHTTPConnection] = set()
        self._closed = False

    @property
    def idle_connections(self) -> int:
        """Connections waiting for a request, over all origins."""
        return sum(len(stack) for stack in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        origin = core_request.url.origin
        conn = await self._checkout(origin)
        try:
            response = await conn.handle_async_request(core_request)
        except BaseException:
            # httpcore has closed the connection (a failed connect, or a
            # request that broke off): it is not reused.
            self._open.discard(conn)
            raise
        stream = response.extensions.get("network_stream")
        body = _PooledBody(
            cast(_CoreBody, response.stream),
            origin,
            conn,
            self,
            chunked=_chunked(core_request.method, response),
        )
        body.answered_early = isinstance(stream, _SocketStream) and stream.answered_early
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=body,
            extensions=response.extensions,
        )

    async def _checkout(self, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        stack = self._idle.get(_key(origin))
        if stack:
            await self._prune(stack)
        while stack:
            _, conn = stack.pop()
            if conn.is_idle() and not conn.has_expired():
                return conn
            self._open.discard(conn)
            await conn.aclose()
        conn = httpcore.AsyncHTTPConnection(
            origin=origin,
            ssl_context=self._ssl_context,
            keepalive_expiry=self._keepalive_expiry_s,
            network_backend=self._backend,
        )
        self._open.add(conn)
        return conn

    async def _checkin(
        self, origin: httpcore.Origin, conn: httpcore.AsyncHTTPConnection, *, reusable: bool = True
    ) -> None:
        """A response of ``conn`` is closed: keep it for the next request, or let it go
        (always when not ``reusable``: its server may not have read the whole request)."""
        if not reusable or not conn.is_idle() or self._closed:
            self._open.discard(conn)
            if not conn.is_closed():
                await conn.aclose()
            return
        stack = self._idle.setdefault(_key(origin), deque())
        await self._prune(stack)
        if len(stack) >= self._max_idle:
            self._open.discard(conn)
            await conn.aclose()
            return
        stack.append((self._clock(), conn))

    async def _prune(self, stack: deque[tuple[float, httpcore.AsyncHTTPConnection]]) -> None:
        """Close the connections idle for longer than the keep-alive expiry:
        the oldest are at the bottom, so this looks at no others."""
        if self._keepalive_expiry_s is None:
            return
        limit = self._clock() - self._keepalive_expiry_s
        while stack and stack[0][0] < limit:
            _, conn = stack.popleft()
            self._open.discard(conn)
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every connection, idle or in use (idempotent)."""
        self._closed = True
        conns, self._open = list(self._open), set()
        self._idle.clear()
        with trio.CancelScope(shield=True):  # each close is bounded (module docstring)
            for conn in conns:
                await conn.aclose()


def _chunked(method: bytes, response: httpcore.Response) -> bool:
    """Whether h11 reads ``response``'s body as chunked (h11's ``_body_framing``:
    no body for 204, 304, HEAD, CONNECT; else ``Transfer-Encoding: chunked``)."""
    if response.status in (204, 304) or method in (b"HEAD", b"CONNECT"):
        return False
    codings = [
        coding.strip().lower()
        for name, value in response.headers
        if name.lower() == b"transfer-encoding"
        for coding in value.split(b",")
    ]
    return codings == [b"chunked"]


def _direct_body(stream: object) -> tuple[h11.Connection, _SocketStream, float | None] | None:
    """The h11 state, socket and read timeout of httpcore 1.0's HTTP/1.1
    response ``stream``, to read its body directly (module docstring); None
    when it is something else, or its request is traced."""
    conn = getattr(stream, "_connection", None)
    request = getattr(stream, "_request", None)
    state = getattr(conn, "_h11_state", None)
    net = getattr(conn, "_network_stream", None)
    if not (
        isinstance(state, h11.Connection)
        and isinstance(net, _SocketStream)
        and isinstance(request, httpcore.Request)
    ):
        return None
    if "trace" in request.extensions:
        return None
    timeouts = request.extensions.get("timeout", {})
    return state, net, timeouts.get("read")


class _PooledBody(httpx.AsyncByteStream):
    """A response body; closing it hands its connection back to the pool.

    An iterator class rather than an async generator, so that leaving the
    body early leaves no generator of ours to trio's finalizer; closing it
    closes httpcore's too.
    """

    def __init__(
        self,
        stream: _CoreBody,
        origin: httpcore.Origin,
        conn: httpcore.AsyncHTTPConnection,
        pool: KeepAliveTransport,
        *,
        chunked: bool = False,
    ) -> None:
        self._stream = stream
        self._origin = origin
        self._conn = conn
        self._pool = pool
        self._parts: AsyncIterator[bytes] | None = None
        self._closed = False
        self._ended = False
        self._direct = direct = _direct_body(stream)
        # A chunked body's framing: h11's until it stands between two chunks,
        # then ``_chunks`` (module docstring); ``_shadow`` follows the bytes
        # h11 is given until then, to know when that is.
        self._chunks: ChunkedDecoder | None = None
        self._shadow: ChunkedDecoder | None = None
        if chunked and direct is not None and direct[0].their_state is h11.SEND_BODY:
            shadow = ChunkedDecoder()
            try:
                shadow.feed(direct[0].trailing_data[0])  # what came with the head
            except ChunkedError:
                pass  # h11 reports it
            else:
                self._shadow = shadow
        # The server answered before it took the whole request body: the
        # connection is closed with the response, never reused.
        self.answered_early = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._direct is not None:
            return await self._read_direct(*self._direct)
        # One iteration over httpcore's body, however many loops read from
        # this one (the pump and then its drain).
        if self._parts is None:
            if self._closed:
                raise StopAsyncIteration
            self._parts = self._stream.__aiter__()
        return await self._parts.__anext__()

    async def _read_direct(
        self, state: h11.Connection, net: _SocketStream, read_timeout: float | None
    ) -> bytes:
        """The body data one socket read completes, joined (module docstring).

        Raises:
            httpcore.RemoteProtocolError: h11 refused the framing, or the
                server closed the connection before the body's end (what
                httpcore's iterator raises for both).
            httpcore.ReadError, httpcore.ReadTimeout: the read failed.
        """
        if self._closed or self._ended:
            raise StopAsyncIteration
        parts: list[bytes] = []
        decoder = self._chunks
        if decoder is not None:
            # Between two chunks, h11 has seen none of the body since.
            while True:
                data = await net.read(READ_BYTES, read_timeout)
                if not data:
                    # h11's end of stream between two chunks: its error.
                    self._chunks = None
                    state.receive_data(b"")
                    break
                try:
                    body = decoder.feed(data)
                except ChunkedError as exc:
                    raise httpcore.RemoteProtocolError(str(exc)) from exc
                if decoder.done:
                    # The trailer section and the end are h11's again.
                    self._chunks = None
                    state.receive_data(b"0\r\n" + decoder.rest)
                    if body:
                        parts.append(body)
                    break
                if body:
                    return body
        while True:
            try:
                event = state.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpcore.RemoteProtocolError(str(exc)) from exc
            kind = type(event)
            if kind is h11.Data:
                data = cast(h11.Data, event).data
                parts.append(data if type(data) is bytes else bytes(data))
            elif event is h11.NEED_DATA:
                shadow = self._shadow
                if shadow is not None and shadow.at_boundary and not shadow.done:
                    # h11 took every byte it was given, whole chunks: the
                    # next ones are the decoder's.
                    self._chunks, self._shadow = shadow, None
                    if parts:
                        return parts[0] if len(parts) == 1 else b"".join(parts)
                    return await self._read_direct(state, net, read_timeout)
                if parts:
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                data = await net.read(READ_BYTES, read_timeout)
                if not data and state.their_state is h11.SEND_RESPONSE:
                    raise httpcore.RemoteProtocolError(
                        "Server disconnected without sending a response."
                    )
                state.receive_data(data)
                if shadow is not None:
                    try:
                        shadow.feed(data)
                    except ChunkedError:
                        self._shadow = None  # h11 reports it
            else:  # EndOfMessage (or PAUSED after it): the response's close recycles
                self._ended = True
                if parts:
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            parts, self._parts = self._parts, None
            if isinstance(parts, AsyncGenerator):
                await parts.aclose()
            await self._stream.aclose()
        finally:
            with trio.CancelScope(shield=True):  # it only closes, bounded (module docstring)
                await self._pool._checkin(
                    self._origin, self._conn, reusable=not self.answered_early
                )
