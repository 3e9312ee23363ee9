"""A scriptable inference backend that misbehaves precisely.

``FakeBackend`` is a real HTTP/1.1 server on a loopback socket, written with
trio and h11 rather than a web framework so that every byte and every pause
is under the test's control. Tests queue ``Reply`` objects per path; each
reply says what to send and how: the status, headers and body, how the body is
cut into writes (``Split``), pauses between writes, stalls before the headers,
before the body or after *n* body bytes, and truncation (the connection is
dropped after *n* body bytes, with a FIN or an RST).

Theory of operation
-------------------
Each accepted connection runs two tasks in one nursery:

* the **reader** owns ``receive_some``: it feeds every byte to h11 and never
  blocks on anything else, so a client that goes away (EOF or RST) is noticed
  at once, even while the responder is stalled or blocked in ``send_all``
  (hypercorn does the same). It records when and how the client left, then
  cancels the connection;
* the **responder** pulls h11 events (waking up when the reader fed data),
  records each request, picks its reply and sends it, executing the reply's
  plan (``Reply.body_plan``) step by step.

Streaming replies use chunked transfer encoding, like vLLM and llama.cpp;
other replies carry a ``Content-Length``. Every connection is a ``Connection``
record with an explicit ``ConnState`` and, once closed, ``closed_at``,
``close_cause`` and ``closed_in`` (the state it was in), so a test can assert
that the client closed its socket while the server was stalling or streaming,
and measure how long that took.

Everything runs in the nursery that started ``FakeBackend.serve`` (usually
through ``open_fake_backend``); ``aclose`` stops it and closes every socket.

``FakeTransport`` is the in-memory sibling: an ``httpx`` transport that plays
the same ``Reply`` scripts without sockets, and can also fail a request the way
a refused connection does (``ConnectFailure``).
"""

from __future__ import annotations

import enum
import itertools
import math
import random
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import urlsplit

import h11
import httpx
import msgspec
import trio

__all__ = [
    "CHAT_COMPLETIONS_PATH",
    "MODELS_PATH",
    "Abort",
    "CloseCause",
    "ConnState",
    "ConnectFailure",
    "Connection",
    "FakeBackend",
    "FakeTransport",
    "Pause",
    "RecordedRequest",
    "Reply",
    "ReplyHandler",
    "Split",
    "SplitMode",
    "Stall",
    "Step",
    "TransportResponse",
    "Write",
    "open_fake_backend",
]

CHAT_COMPLETIONS_PATH: Final = "/v1/chat/completions"
MODELS_PATH: Final = "/v1/models"

# One read from the socket. Requests in tests are small; 64 KiB matches
# httpcore's own read size.
RECEIVE_BYTES: Final = 64 * 1024
# Longest request head (request line + headers) h11 will buffer; h11's own
# default, far above anything httpx sends.
MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024
# Scheduling rounds the reader lets pass before recording a client's close
# (see _read_loop): one for the responder to resume, one to reach its next step.
_SETTLE_CHECKPOINTS: Final = 2
# Longest request body recorded. Chat requests with long prompts stay far
# below this; a bigger body is a broken test, not a backend scenario.
MAX_REQUEST_BODY_BYTES: Final = 16 * 1024 * 1024
# The receive buffer of a connection whose reads a ``stop_reading`` reply
# stopped: the smallest the kernel grants (it rounds up), so a client's body
# backs up into its own send buffer.
STOPPED_RCVBUF: Final = 1024


# --- how a body is cut into writes (sans-IO) -----------------------------------


class SplitMode(enum.Enum):
    """How ``Split`` cuts a body."""

    WHOLE = "whole"
    EVERY = "every"
    CUTS = "cuts"
    RANDOM = "random"


class Split(msgspec.Struct, frozen=True, kw_only=True):
    """How a reply body is cut into separate writes (one chunk each when chunked).

    Use the constructors: ``Split.whole()``, ``Split.every(n)``,
    ``Split.bytewise()``, ``Split.at(*offsets)``, ``Split.random(seed)``.

    Attributes:
        mode: The cutting rule.
        size: ``EVERY``: the piece size; ``RANDOM``: the largest piece.
        cuts: ``CUTS``: body offsets to cut at.
        seed: ``RANDOM``: seed of the piece sizes (same seed, same pieces).
    """

    mode: SplitMode = SplitMode.WHOLE
    size: int = 0
    cuts: tuple[int, ...] = ()
    seed: int = 0

    @classmethod
    def whole(cls) -> Split:
        """The body in one write."""
        return cls()

    @classmethod
    def every(cls, n: int) -> Split:
        """Pieces of ``n`` bytes (the last may be shorter)."""
        if n < 1:
            raise ValueError("piece size must be >= 1")
        return cls(mode=SplitMode.EVERY, size=n)

    @classmethod
    def bytewise(cls) -> Split:
        """One byte per write."""
        return cls.every(1)

    @classmethod
    def at(cls, *offsets: int) -> Split:
        """Cut at these body offsets (out-of-range offsets are ignored)."""
        return cls(mode=SplitMode.CUTS, cuts=tuple(offsets))

    @classmethod
    def random(cls, seed: int, *, max_piece: int = 64) -> Split:
        """Pieces of 1..``max_piece`` bytes, drawn from ``seed``."""
        if max_piece < 1:
            raise ValueError("max_piece must be >= 1")
        return cls(mode=SplitMode.RANDOM, size=max_piece, seed=seed)

    def cut_points(self, length: int) -> list[int]:
        """Sorted offsets strictly inside ``(0, length)`` where the body is cut."""
        if self.mode is SplitMode.WHOLE:
            return []
        if self.mode is SplitMode.EVERY:
            return list(range(self.size, length, self.size))
        if self.mode is SplitMode.CUTS:
            return sorted({c for c in self.cuts if 0 < c < length})
        rng = random.Random(self.seed)
        points: list[int] = []
        pos = rng.randint(1, self.size)
        while pos < length:
            points.append(pos)
            pos += rng.randint(1, self.size)
        return points

    def pieces(self, body: bytes) -> list[bytes]:
        """``body`` cut into its writes; they join back to ``body``."""
        bounds = [0, *self.cut_points(len(body)), len(body)]
        return [body[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# --- what the server does after the headers (sans-IO) --------------------------


class Write(msgspec.Struct, frozen=True):
    """Send these body bytes (one chunk when chunked)."""

    data: bytes


class Pause(msgspec.Struct, frozen=True):
    """Sleep between two writes."""

    seconds: float


class Stall(msgspec.Struct, frozen=True):
    """Send nothing for ``seconds`` (forever when infinite) while watching the socket."""

    seconds: float


class Abort(msgspec.Struct, frozen=True):
    """Drop the connection now, body unfinished (RST when ``reset``)."""

    reset: bool = False


Step = Write | Pause | Stall | Abort


def _default_headers() -> tuple[tuple[str, str], ...]:
    return (("content-type", "text/event-stream"),)


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """One scripted response.

    Attributes:
        status: HTTP status.
        reason: Reason phrase; None sends the standard one ("Bad Request").
        headers: Response headers; framing headers are added by the server.
        body: The body, sent byte for byte.
        chunked: Transfer-Encoding chunked (True) or Content-Length (False);
            None picks chunked for ``text/event-stream`` bodies.
        split: How the body is cut into writes.
        delay_s: Pause between two writes.
        stall_before_headers: Stall before the status line (time to first byte).
        stall_after_headers: Stall after the headers, before the first body byte.
        stall_after_bytes: Stall once this many body bytes are out.
        stall_s: How long each stall lasts; infinite means until the client
            goes away or the server is closed.
        truncate_after_bytes: Drop the connection once this many body bytes
            are out (a chunked body is then never terminated).
        reset: Drop with a TCP RST instead of a FIN.
        close_connection: Send ``Connection: close`` and close after the reply.
        stop_reading: Stop reading the socket once the request head is in
            (a backend that stops reading the body): this reply is taken
            then, with the body unread, and the connection is closed after
            it (with an RST, the kernel's answer to unread bytes). The
            client's body backs up in its send buffer: one larger than the
            socket buffers blocks its writes.
    """

    status: int = 200
    reason: str | None = None
    headers: tuple[tuple[str, str], ...] = msgspec.field(default_factory=_default_headers)
    body: bytes = b""
    chunked: bool | None = None
    split: Split = Split()
    delay_s: float = 0.0
    stall_before_headers: bool = False
    stall_after_headers: bool = False
    stall_after_bytes: int | None = None
    stall_s: float = math.inf
    truncate_after_bytes: int | None = None
    reset: bool = False
    close_connection: bool = False
    stop_reading: bool = False

    @classmethod
    def sse(cls, body: bytes, **options: Any) -> Reply:
        """A ``text/event-stream`` reply (chunked) with ``body``."""
        return cls(body=body, **options)

    @classmethod
    def json(cls, payload: object, *, status: int = 200, **options: Any) -> Reply:
        """A JSON reply (Content-Length); ``payload`` bytes are sent as they are."""
        body = payload if isinstance(payload, bytes) else msgspec.json.encode(payload)
        return cls(
            status=status,
            headers=(("content-type", "application/json"),),
            body=body,
            **options,
        )

    @classmethod
    def text(cls, body: str | bytes, *, status: int = 200, **options: Any) -> Reply:
        """A plain-text reply (Content-Length)."""
        data = body.encode() if isinstance(body, str) else body
        return cls(
            status=status,
            headers=(("content-type", "text/plain; charset=utf-8"),),
            body=data,
            **options,
        )

    @property
    def is_chunked(self) -> bool:
        """Whether the body goes out with chunked transfer encoding."""
        if self.chunked is not None:
            return self.chunked
        ctype = next((v for k, v in self.headers if k.lower() == "content-type"), "")
        return ctype.lower().startswith("text/event-stream")

    def body_plan(self) -> list[Step]:
        """What happens after the headers, step by step (without header stalls).

        The body is cut where ``split`` says and also exactly at
        ``stall_after_bytes`` and ``truncate_after_bytes``, so a stall or a
        truncation lands on the byte asked for. A plan that does not end with
        ``Abort`` is followed by the end of the message.
        """
        body = self.body
        limit = len(body)
        if self.truncate_after_bytes is not None:
            limit = min(max(self.truncate_after_bytes, 0), limit)
        cuts = set(self.split.cut_points(len(body)))
        for extra in (self.stall_after_bytes, self.truncate_after_bytes):
            if extra is not None and 0 < extra < len(body):
                cuts.add(extra)
        bounds = [0, *sorted(c for c in cuts if c < limit), limit]
        steps: list[Step] = []
        if self.stall_after_headers or self.stall_after_bytes == 0:
            steps.append(Stall(self.stall_s))
        sent = 0
        for a, b in itertools.pairwise(bounds):
            if b <= a:
                continue
            if sent and self.delay_s > 0:
                steps.append(Pause(self.delay_s))
            steps.append(Write(body[a:b]))
            sent = b
            if self.stall_after_bytes is not None and sent == self.stall_after_bytes:
                steps.append(Stall(self.stall_s))
        if self.truncate_after_bytes is not None:
            steps.append(Abort(reset=self.reset))
        return steps

    @property
    def reason_phrase(self) -> str:
        """The reason phrase sent on the status line."""
        if self.reason is not None:
            return self.reason
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return ""

    def response_headers(self) -> list[tuple[str, str]]:
        """The headers sent, framing included."""
        skip = {"content-length", "transfer-encoding", "connection"}
        out = [(k, v) for k, v in self.headers if k.lower() not in skip]
        if self.is_chunked:
            out.append(("transfer-encoding", "chunked"))
        else:
            out.append(("content-length", str(len(self.body))))
        if self.close_connection:
            out.append(("connection", "close"))
        return out


class ConnectFailure(msgspec.Struct, frozen=True):
    """``FakeTransport`` only: fail the request as a refused connection would."""

    message: str = "[Errno 111] Connection refused"


# --- recording ----------------------------------------------------------------


class ConnState(enum.Enum):
    """Life of a server-side connection; transitions happen in ``FakeBackend``."""

    IDLE = "idle"  # waiting for a request
    RECEIVING = "receiving"  # reading a request
    SENDING = "sending"  # writing a reply
    PAUSED = "paused"  # between two writes (``delay_s``)
    STALLED = "stalled"  # deliberately sending nothing
    CLOSED = "closed"


class CloseCause(enum.Enum):
    """Who ended a connection, and how.

    EOF and RST are told apart on a best-effort basis: the kernel reports a
    reset once, to whichever call on the socket sees it first, so a reset
    that a failing send noticed can look like an EOF to the reader.
    """

    CLIENT_EOF = "client_eof"  # the client closed its socket (FIN)
    CLIENT_RESET = "client_reset"  # the client's socket reset (RST)
    SERVER_CLOSE = "server_close"  # the reply said so, or the request was unusable
    SERVER_ABORT = "server_abort"  # truncation: dropped mid-body (FIN or RST)
    SHUTDOWN = "shutdown"  # the fake backend was closed


@dataclass(eq=False)
class Connection:
    """One accepted TCP connection, as the server saw it.

    Attributes:
        id: Sequence number, from 0.
        opened_at: ``trio.current_time()`` at accept.
        state: Current state.
        body_bytes_sent: Body bytes written, over all replies.
        closed_at: When the connection ended.
        close_cause: Who ended it.
        closed_in: The state it was in when it ended (e.g. ``STALLED``).
        protocol_error: What h11 disliked about the client's bytes, if anything.
        reading_stopped: A ``stop_reading`` reply stopped the reads.
    """

    id: int
    opened_at: float
    state: ConnState = ConnState.IDLE
    body_bytes_sent: int = 0
    closed_at: float | None = None
    close_cause: CloseCause | None = None
    closed_in: ConnState | None = None
    protocol_error: str = ""
    reading_stopped: bool = False
    _closed: trio.Event = field(default_factory=trio.Event, init=False, repr=False, compare=False)

    @property
    def closed_by_client(self) -> bool:
        """True if the client went away (EOF or RST)."""
        return self.close_cause in (CloseCause.CLIENT_EOF, CloseCause.CLIENT_RESET)

    async def wait_closed(self) -> None:
        """Wait until the connection has ended, whoever ended it."""
        await self._closed.wait()

    def _enter(self, state: ConnState) -> None:
        if self.state is not ConnState.CLOSED:
            self.state = state

    def _close(self, cause: CloseCause, *, at: float | None = None) -> None:
        if self.close_cause is not None:
            return
        self.closed_in = self.state
        self.state = ConnState.CLOSED
        self.close_cause = cause
        self.closed_at = trio.current_time() if at is None else at
        self._closed.set()


@dataclass(frozen=True, eq=False)
class RecordedRequest:
    """A request the fake received.

    Attributes:
        method: ``GET``, ``POST``...
        target: The request target as sent (path and query).
        headers: Headers in order, names lower-cased.
        body: The raw body.
        received_at: ``trio.current_time()`` when the request was complete.
        connection: The connection it came on (None for ``FakeTransport``).
    """

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    received_at: float
    connection: Connection | None = None

    @property
    def path(self) -> str:
        """The target without its query string."""
        return urlsplit(self.target).path

    def header(self, name: str) -> str | None:
        """The first value of ``name`` (case-insensitive), or None."""
        low = name.lower()
        return next((v for k, v in self.headers if k == low), None)

    def header_values(self, name: str) -> list[str]:
        """Every value of ``name`` (case-insensitive)."""
        low = name.lower()
        return [v for k, v in self.headers if k == low]

    @property
    def json(self) -> Any:
        """The body decoded as JSON (None for an empty body).

        Raises:
            msgspec.DecodeError: The body is not JSON.
        """
        return msgspec.json.decode(self.body) if self.body else None


ReplyHandler = Callable[[RecordedRequest], Reply]

_Scripted = Reply | ReplyHandler | ConnectFailure


class _Script:
    """Replies per path: queued ones first (FIFO), then the path's default."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[_Scripted]] = {}
        self._defaults: dict[str, _Scripted] = {}

    def add(self, path: str, items: Iterable[_Scripted]) -> None:
        self._queues.setdefault(path, deque()).extend(items)

    def set_default(self, path: str, item: _Scripted) -> None:
        self._defaults[path] = item

    def pending(self, path: str) -> int:
        return len(self._queues.get(path, ()))

    def clear(self, path: str) -> None:
        self._queues.pop(path, None)

    def next_stops_reading(self, path: str) -> bool:
        """Whether the reply ``path`` would get now is a ``stop_reading`` one."""
        queue = self._queues.get(path)
        item = queue[0] if queue else self._defaults.get(path)
        return isinstance(item, Reply) and item.stop_reading

    def take(self, request: RecordedRequest) -> Reply | ConnectFailure:
        path = request.path
        queue = self._queues.get(path)
        item: _Scripted | None = queue.popleft() if queue else self._defaults.get(path)
        if item is None:
            return _not_found(request)
        if isinstance(item, Reply | ConnectFailure):
            return item
        return item(request)


def _not_found(request: RecordedRequest) -> Reply:
    message = f"fake backend: no reply scripted for {request.method} {request.path}"
    return Reply.json(
        {"error": {"message": message, "type": "not_found_error", "code": 404}}, status=404
    )


class _Wakeup:
    """Lets the responder sleep until the reader has fed h11 more bytes."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def current(self) -> trio.Event:
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()


# --- the server -----------------------------------------------------------------


class _ServerState(enum.Enum):
    NEW = "new"
    SERVING = "serving"
    CLOSED = "closed"


class FakeBackend:
    """A scriptable HTTP/1.1 backend on a loopback socket (see the module doc).

    Args:
        host: Address to listen on.

    Attributes:
        requests: Every request received, in order.
        connections: Every connection accepted, in order.
    """

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self._host = host
        self._port: int | None = None
        self._script = _Script()
        self._state = _ServerState.NEW
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self._changed = _Wakeup()
        self.requests: list[RecordedRequest] = []
        self.connections: list[Connection] = []

    # --- scripting ----------------------------------------------------------

    def script(self, path: str, *replies: Reply | ReplyHandler | ConnectFailure) -> None:
        """Queue replies for ``path``; each request takes the next one.

        A ``ConnectFailure`` resets the connection right after the request,
        before any byte of a response (a socket cannot un-accept; use
        ``FakeTransport`` for a true refused connect).
        """
        self._script.add(path, replies)

    def route(self, path: str, reply: Reply | ReplyHandler) -> None:
        """Answer ``path`` with ``reply`` whenever its queue is empty."""
        self._script.set_default(path, reply)

    def pending(self, path: str) -> int:
        """Queued replies not yet taken for ``path``."""
        return self._script.pending(path)

    def clear(self, path: str) -> None:
        """Drop the replies queued for ``path`` (its default stays)."""
        self._script.clear(path)

    # --- addresses ----------------------------------------------------------

    @property
    def port(self) -> int:
        """The port it listens on (once serving)."""
        if self._port is None:
            raise RuntimeError("the fake backend is not serving yet")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self._host}:{self.port}"

    # --- waiting ------------------------------------------------------------

    async def wait_requests(self, count: int, timeout_s: float) -> list[RecordedRequest]:
        """Wait until ``count`` requests have arrived; return them all.

        Raises:
            trio.TooSlowError: Fewer arrived within ``timeout_s`` seconds.
        """
        with trio.fail_after(timeout_s):
            while len(self.requests) < count:
                await self._changed.current().wait()
        return list(self.requests)

    async def wait_connection_closed(self, timeout_s: float, *, request: int = -1) -> Connection:
        """Wait until the connection that carried ``requests[request]`` has ended.

        Raises:
            trio.TooSlowError: No such request arrived, or its connection
                stayed open, within ``timeout_s`` seconds.
        """
        with trio.fail_after(timeout_s):
            while not -len(self.requests) <= request < len(self.requests):
                await self._changed.current().wait()
            conn = self.requests[request].connection
            assert conn is not None  # requests on a FakeBackend always have one
            await conn.wait_closed()
        return conn

    async def wait_client_closed(self, timeout_s: float, *, request: int = -1) -> Connection:
        """Like ``wait_connection_closed``, and the *client* must have closed it.

        Raises:
            trio.TooSlowError: See ``wait_connection_closed``.
            AssertionError: The server or a shutdown closed it instead.
        """
        conn = await self.wait_connection_closed(timeout_s, request=request)
        if not conn.closed_by_client:
            raise AssertionError(
                f"connection {conn.id} was closed by {conn.close_cause}, not by the client"
            )
        return conn

    # --- serving ------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled or ``aclose``d; reports ``url`` when ready.

        Use with ``nursery.start(fb.serve)``; the connections' tasks live in
        this task's own nursery, so they end with it.
        """
        if self._state is not _ServerState.NEW:
            raise RuntimeError("a FakeBackend serves only once")
        self._state = _ServerState.SERVING
        try:
            listeners = await trio.open_tcp_listeners(0, host=self._host)
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                for listener in listeners:
                    nursery.start_soon(self._accept_loop, listener, nursery)
                self._port = listeners[0].socket.getsockname()[1]
                task_status.started(self.url)
        finally:
            self._state = _ServerState.CLOSED
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop serving and close every connection (idempotent)."""
        if self._state is _ServerState.NEW:
            self._state = _ServerState.CLOSED
            self._stopped.set()
            return
        if self._scope is not None:
            self._scope.cancel()
        await self._stopped.wait()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                stream = await listener.accept()
                conn = Connection(id=len(self.connections), opened_at=trio.current_time())
                self.connections.append(conn)
                nursery.start_soon(self._serve_connection, stream, conn)

    async def _serve_connection(self, stream: trio.SocketStream, conn: Connection) -> None:
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
        wakeup = _Wakeup()
        end: CloseCause = CloseCause.SHUTDOWN
        reset = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop, stream, h, conn, wakeup, nursery.cancel_scope)
                end, reset = await self._respond_loop(stream, h, conn, wakeup)
                nursery.cancel_scope.cancel()
        finally:
            # Closing is synchronous so it also happens while being cancelled.
            if reset:
                stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            stream.socket.close()
            conn._close(end)
            self._changed.fire()

    async def _read_loop(
        self,
        stream: trio.SocketStream,
        h: h11.Connection,
        conn: Connection,
        wakeup: _Wakeup,
        scope: trio.CancelScope,
    ) -> None:
        """Own the socket's receive side: feed h11, notice the client leaving."""
        while True:
            if conn.reading_stopped:
                # A backend that stopped reading: it cannot see the client
                # leave either (the close waits behind the unread bytes).
                await trio.sleep_forever()
            try:
                data = await stream.receive_some(RECEIVE_BYTES)
            except trio.BrokenResourceError:
                cause = CloseCause.CLIENT_RESET
            except trio.ClosedResourceError:
                return  # we closed it ourselves
            else:
                if data:
                    h.receive_data(data)
                    wakeup.fire()
                    continue
                cause = CloseCause.CLIENT_EOF
            at = trio.current_time()
            # The client may have reacted to bytes that the responder handed
            # to the kernel before the responder ran again. Let the responder
            # reach its next step first, so that closed_in names what the
            # server was doing then (STALLED, say), not a finished write.
            with trio.CancelScope(shield=True):
                for _ in range(_SETTLE_CHECKPOINTS):
                    await trio.lowlevel.checkpoint()
            conn._close(cause, at=at)
            self._changed.fire()
            scope.cancel()
            return

    async def _next_event(self, h: h11.Connection, wakeup: _Wakeup) -> Any:
        while True:
            fed = wakeup.current()
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            await fed.wait()

    async def _respond_loop(
        self, stream: trio.SocketStream, h: h11.Connection, conn: Connection, wakeup: _Wakeup
    ) -> tuple[CloseCause, bool]:
        """Serve requests until the connection must end; say why and whether to reset."""
        while True:
            conn._enter(ConnState.IDLE)
            try:
                request = await self._receive_request(stream, h, conn, wakeup)
            except h11.RemoteProtocolError as exc:
                conn.protocol_error = str(exc)
                return CloseCause.SERVER_CLOSE, False
            if request is None:
                return CloseCause.SERVER_CLOSE, False
            item = self._script.take(request)
            if isinstance(item, ConnectFailure):
                # A socket cannot un-accept: the nearest thing is an RST
                # before any byte of the response.
                return CloseCause.SERVER_ABORT, True
            try:
                aborted = await self._send_reply(stream, h, conn, item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # A send fails only once the client has gone; the kernel
                # reports its RST to whichever call sees it first, so the
                # reader may see a plain EOF after this.
                conn._close(CloseCause.CLIENT_RESET)
                return CloseCause.CLIENT_RESET, False
            if aborted is not None:
                return CloseCause.SERVER_ABORT, aborted.reset
            if conn.reading_stopped:
                return CloseCause.SERVER_CLOSE, True
            if h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                return CloseCause.SERVER_CLOSE, False
            h.start_next_cycle()

    async def _receive_request(
        self, stream: trio.SocketStream, h: h11.Connection, conn: Connection, wakeup: _Wakeup
    ) -> RecordedRequest | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = await self._next_event(h, wakeup)
            if isinstance(event, h11.Request):
                head = event
                conn._enter(ConnState.RECEIVING)
                target = head.target.decode("ascii", "replace")
                if self._script.next_stops_reading(urlsplit(target).path):
                    conn.reading_stopped = True
                    # Small, so that the client's writes block soon.
                    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STOPPED_RCVBUF)
                    return self._record(head, body, conn)
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BODY_BYTES:
                    conn.protocol_error = "request body too large for the fake backend"
                    return None
            elif isinstance(event, h11.EndOfMessage) and head is not None:
                return self._record(head, body, conn)
            else:  # ConnectionClosed or PAUSED: nothing more to serve here
                return None

    def _record(self, head: h11.Request, body: bytearray, conn: Connection) -> RecordedRequest:
        request = RecordedRequest(
            method=head.method.decode("ascii"),
            target=head.target.decode("ascii", "replace"),
            headers=tuple(
                (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in head.headers
            ),
            body=bytes(body),
            received_at=trio.current_time(),
            connection=conn,
        )
        self.requests.append(request)
        self._changed.fire()
        return request

    async def _stall(self, conn: Connection, seconds: float) -> None:
        conn._enter(ConnState.STALLED)
        await trio.sleep(seconds)
        conn._enter(ConnState.SENDING)

    async def _send_reply(
        self, stream: trio.SocketStream, h: h11.Connection, conn: Connection, reply: Reply
    ) -> Abort | None:
        """Send one reply by its plan; return the ``Abort`` step if it cut the body."""
        conn._enter(ConnState.SENDING)
        if reply.stall_before_headers:
            await self._stall(conn, reply.stall_s)
        head = h11.Response(
            status_code=reply.status, headers=reply.response_headers(), reason=reply.reason_phrase
        )
        await stream.send_all(h.send(head) or b"")
        for step in reply.body_plan():
            if isinstance(step, Write):
                await stream.send_all(h.send(h11.Data(data=step.data)) or b"")
                conn.body_bytes_sent += len(step.data)
            elif isinstance(step, Pause):
                conn._enter(ConnState.PAUSED)
                await trio.sleep(step.seconds)
                conn._enter(ConnState.SENDING)
            elif isinstance(step, Stall):
                await self._stall(conn, step.seconds)
            else:
                return step
        # The reply is complete once the terminator is in the kernel's hands;
        # a client that reads it and hangs up at once closed an idle connection.
        conn._enter(ConnState.IDLE)
        await stream.send_all(h.send(h11.EndOfMessage()) or b"")
        return None


@asynccontextmanager
async def open_fake_backend(
    nursery: trio.Nursery | None = None, *, host: str = "127.0.0.1"
) -> AsyncIterator[FakeBackend]:
    """Start a ``FakeBackend``; stop it (and close its sockets) on exit.

    Args:
        nursery: Where the server task runs; by default a nursery owned by
            this context.
        host: Address to listen on.
    """
    fb = FakeBackend(host=host)
    if nursery is not None:
        await nursery.start(fb.serve)
        try:
            yield fb
        finally:
            await fb.aclose()
        return
    async with trio.open_nursery() as own:
        await own.start(fb.serve)
        try:
            yield fb
        finally:
            await fb.aclose()


# --- in memory ------------------------------------------------------------------


@dataclass(eq=False)
class TransportResponse:
    """A response ``FakeTransport`` returned, and what became of its body.

    Attributes:
        request: The request it answers.
        closed_at: ``trio.current_time()`` when the client closed the body
            (the in-memory counterpart of a socket's close).
        backend_ended: The body's plan ran out (to its end or to an ``Abort``)
            before the client closed it.
    """

    request: RecordedRequest
    closed_at: float | None = None
    backend_ended: bool = False

    @property
    def closed_by_client(self) -> bool:
        """True if the client closed the body before the backend ended it."""
        return self.closed_at is not None and not self.backend_ended


class _ReplyStream(httpx.AsyncByteStream):
    """Plays a reply's body plan to httpx (a class, not an async generator,
    so an abandoned stream leaves nothing for the GC to finalise)."""

    def __init__(
        self, steps: Sequence[Step], request: httpx.Request, record: TransportResponse
    ) -> None:
        self._steps = list(steps)
        self._request = request
        self._record = record
        self._pos = 0
        self._closed = False

    def __aiter__(self) -> _ReplyStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._closed and self._pos < len(self._steps):
            step = self._steps[self._pos]
            self._pos += 1
            if isinstance(step, Write):
                return step.data
            if isinstance(step, Pause | Stall):
                await trio.sleep(step.seconds)
                continue
            self._record.backend_ended = True
            if step.reset:
                raise httpx.ReadError("[Errno 104] Connection reset by peer", request=self._request)
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body",
                request=self._request,
            )
        if not self._closed:
            self._record.backend_ended = True
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._record.closed_at = trio.current_time()


class FakeTransport(httpx.AsyncBaseTransport):
    """The in-memory sibling of ``FakeBackend``: an httpx transport playing ``Reply`` scripts.

    Pass it as ``transport=`` to an adapter. It has the same ``script`` /
    ``route`` / ``requests`` surface, and ``responses`` records when the
    client closed each body (``TransportResponse``); ``ConnectFailure`` fails a request the
    way a refused connection does. Stalls and pauses sleep on the trio clock,
    so virtual time (``autojump_clock``) works; header stalls happen before
    the response is returned. Connection-level facts (``Connection``) exist
    only on ``FakeBackend``.
    """

    def __init__(self) -> None:
        self._script = _Script()
        self.requests: list[RecordedRequest] = []
        self.responses: list[TransportResponse] = []

    def script(self, path: str, *replies: Reply | ReplyHandler | ConnectFailure) -> None:
        """Queue replies for ``path``; each request takes the next one."""
        self._script.add(path, replies)

    def route(self, path: str, reply: Reply | ReplyHandler) -> None:
        """Answer ``path`` with ``reply`` whenever its queue is empty."""
        self._script.set_default(path, reply)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        recorded = RecordedRequest(
            method=request.method,
            target=request.url.raw_path.decode("ascii", "replace"),
            headers=tuple((k.lower(), v) for k, v in request.headers.multi_items()),
            body=body,
            received_at=trio.current_time(),
        )
        self.requests.append(recorded)
        item = self._script.take(recorded)
        if isinstance(item, ConnectFailure):
            raise httpx.ConnectError(item.message, request=request)
        if item.stall_before_headers:
            await trio.sleep(item.stall_s)
        headers = [(k, v) for k, v in item.response_headers() if k != "transfer-encoding"]
        record = TransportResponse(recorded)
        self.responses.append(record)
        return httpx.Response(
            item.status,
            headers=headers,
            stream=_ReplyStream(item.body_plan(), request, record),
            request=request,
            extensions={"reason_phrase": item.reason_phrase.encode("ascii", "replace")},
        )
