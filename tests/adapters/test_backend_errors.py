"""Every way a backend connection fails, and the ``BackendError`` each becomes.

One table per source of foreign exceptions, each row a failure made where it
happens and the error an adapter raises for it (class, code, status,
message, whether the edge fails it over):

* ``test_a_broken_backend_connection`` plays each failure on a real socket
  (a raw trio server per row, trio's own hostname-resolver hook for DNS)
  through the node's keep-alive pool: trio's errors as the socket raises
  them (refused, reset, closed by another task, TLS, the connect and write
  deadlines) and h11's (a malformed or cut-off response), at each place an
  adapter calls the transport (the request, the stream, a bounded body
  read, the probe, the ``/metrics`` scrape).
* ``test_an_httpx_transport_error`` raises each of httpx's transport errors
  from a transport an adapter is given (httpx's own through a proxy, a
  test's), the one source of httpx exceptions besides httpx's decoders.

A cancelled run is never turned into an error (``test_a_cancel_*``).
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpcore
import httpx
import msgspec
import pytest
import trio
import trio.lowlevel
import trio.testing

from iop.adapters import VllmAdapter
from iop.adapters._errors import backend_errors
from iop.config import VllmInstance
from iop.errors import (
    RETRYABLE_CODES,
    BackendError,
    BackendHTTPError,
    BackendStreamError,
    BackendTimeout,
    BackendUnavailable,
    ErrorCode,
)
from iop.events import Complete, Delta, RuntimeEvent
from iop.spec import ChatRequest, EmbeddingRequest, ExecutionSpec, Message

NOTICE_S = 10.0
# The connect (and write) deadline of the rows that cross it: short, since a
# row waits for it in real time (a real socket that never answers).
SHORT_S = 0.3
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
RESET = "socket connection broken: [Errno 104] Connection reset by peer"
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


@dataclass(frozen=True)
class Outcome:
    """What an adapter raised, as the rest of IOP sees it."""

    kind: type[BackendError]
    code: ErrorCode
    status: int
    message: str
    retryable: bool

    @classmethod
    def of(cls, exc: BackendError) -> Outcome:
        return cls(type(exc), exc.code, exc.status, exc.message, exc.code in RETRYABLE_CODES)


def unavailable(message: str) -> Outcome:
    return Outcome(BackendUnavailable, ErrorCode.BACKEND_UNAVAILABLE, 503, message, True)


def timeout(message: str) -> Outcome:
    return Outcome(BackendTimeout, ErrorCode.BACKEND_TIMEOUT, 504, message, False)


def stream(message: str) -> Outcome:
    return Outcome(BackendStreamError, ErrorCode.BACKEND_STREAM_ERROR, 502, message, False)


def backend(message: str) -> Outcome:
    return Outcome(BackendError, ErrorCode.BACKEND_ERROR, 502, message, False)


class Sink:
    """An ``EventSender`` that keeps the events; ``streaming`` fires at the first delta."""

    def __init__(self) -> None:
        self.events: list[RuntimeEvent] = []
        self.streaming = trio.Event()

    async def send(self, event: RuntimeEvent) -> None:
        self.events.append(event)
        if isinstance(event, Delta):
            self.streaming.set()


def chat(content: str = "hi") -> ExecutionSpec:
    request = ChatRequest(model="m", messages=[Message(role="user", content=content)])
    return ExecutionSpec(run_id="r", request=request)


def embedding() -> ExecutionSpec:
    return ExecutionSpec(run_id="r", request=EmbeddingRequest(model="m", inputs=["a"]))


def vllm(endpoint: str, **cfg: Any) -> VllmAdapter:
    return VllmAdapter(msgspec.convert({"name": "v", "endpoint": endpoint, **cfg}, VllmInstance))


# --- real servers, one failure each ---------------------------------------------


async def read_request(stream: trio.SocketStream) -> bytes:
    """The request head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = await stream.receive_some(65536)
        if not piece:
            return data
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    want = int(length.group(1)) if length else 0
    while len(body) < want:
        body += await stream.receive_some(65536)
    return head


def reset(stream: trio.SocketStream) -> None:
    """Close with an RST (SO_LINGER 0) instead of a FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def close_after_request(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.aclose()


async def reset_after_request(stream: trio.SocketStream) -> None:
    await read_request(stream)
    reset(stream)


async def malformed_head(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(b"garbage\r\n\r\n")
    await trio.sleep_forever()


async def reset_mid_stream(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(SSE_HEAD + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
    reset(stream)


async def cut_mid_stream(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(SSE_HEAD + b"%x\r\n%s" % (len(CHUNK), CHUNK[:10]))
    await stream.aclose()


async def stall_mid_stream(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(SSE_HEAD + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
    await trio.sleep_forever()


async def gzip_garbage_stream(stream: trio.SocketStream) -> None:
    await read_request(stream)
    head = SSE_HEAD.replace(b"\r\n\r\n", b"\r\ncontent-encoding: gzip\r\n\r\n")
    await stream.send_all(head + b"5\r\nnot-g\r\n0\r\n\r\n")
    await trio.sleep_forever()


async def reset_mid_json(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"data":')
    reset(stream)


async def cut_mid_json(stream: trio.SocketStream) -> None:
    await read_request(stream)
    await stream.send_all(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"data":')
    await stream.aclose()


async def read_head_then_stop(stream: trio.SocketStream) -> None:
    """Take the head, then read no more: the client's big body backs up."""
    await stream.receive_some(65536)
    await trio.sleep_forever()


async def silent(stream: trio.SocketStream) -> None:
    """Accept, then say nothing (no TLS handshake, no response)."""
    await trio.sleep_forever()


async def close_at_once(stream: trio.SocketStream) -> None:
    await stream.aclose()


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[trio.SocketStream], Awaitable[None]], scheme: str = "http"
) -> AsyncIterator[str]:
    async def guarded(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await handler(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, guarded, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"{scheme}://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


class NoSuchHost(trio.abc.HostnameResolver):
    """DNS that knows no name (trio's resolver hook, for this test's run only)."""

    async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def getnameinfo(self, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


# --- what each row does ---------------------------------------------------------


async def run_chat(adapter: VllmAdapter) -> BackendError:
    with pytest.raises(BackendError) as info:
        await adapter.execute(chat(), Sink())
    return info.value


async def run_big_chat(adapter: VllmAdapter) -> BackendError:
    """A body far larger than the socket buffers: its write blocks."""
    with pytest.raises(BackendError) as info:
        await adapter.execute(chat("x" * (32 * 1024 * 1024)), Sink())
    return info.value


async def run_embedding(adapter: VllmAdapter) -> BackendError:
    with pytest.raises(BackendError) as info:
        await adapter.execute(embedding(), Sink())
    return info.value


async def run_metrics(adapter: VllmAdapter) -> BackendError:
    with pytest.raises(BackendError) as info:
        await adapter.engine_load()
    return info.value


async def run_chat_closed_meanwhile(adapter: VllmAdapter) -> BackendError:
    """The adapter is closed while its stream waits for the next chunk: the
    pool closes the socket under the read (trio's ClosedResourceError)."""
    sink = Sink()
    caught: list[BackendError] = []

    async def execute() -> None:
        try:
            await adapter.execute(chat(), sink)
        except BackendError as exc:
            caught.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(execute)
        await sink.streaming.wait()
        await adapter.aclose()
    assert len(caught) == 1
    return caught[0]


async def run_probe(adapter: VllmAdapter) -> str:
    probe = await adapter.probe()
    return probe.detail


@dataclass(frozen=True)
class Row:
    name: str
    handler: Callable[[trio.SocketStream], Awaitable[None]] | None  # None: nothing listens
    run: Callable[[VllmAdapter], Awaitable[BackendError]]
    expected: Callable[[str], Outcome]  # given host:port
    scheme: str = "http"
    cfg: tuple[tuple[str, Any], ...] = ()


ROWS = [
    # Connect: OSError (a group of ConnectionRefusedError under trio's "all attempts").
    Row(
        "refused",
        None,
        run_chat,
        lambda at: unavailable(f"vllm request failed: connection refused by {at}"),
    ),
    Row(
        "refused-metrics",
        None,
        run_metrics,
        # The scrape's request is not attached to its error: no host:port.
        lambda at: unavailable("/metrics request failed: connection refused by the backend"),
    ),
    # Connect: trio.TooSlowError under the connect deadline (the TLS handshake).
    Row(
        "connect-deadline",
        silent,
        run_chat,
        lambda at: unavailable(
            f"vllm request failed: no connection to {at} within the connect timeout"
        ),
        scheme="https",
        cfg=(("connect_timeout_s", SHORT_S),),
    ),
    # Connect: trio.BrokenResourceError from the TLS handshake (an ssl.SSLError under it).
    Row(
        "tls-eof",
        close_at_once,
        run_chat,
        lambda at: unavailable(
            f"vllm request failed: cannot connect to {at} "
            "([SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol)"
        ),
        scheme="https",
    ),
    # Request sent, no response: h11 sees the EOF.
    Row(
        "closed-before-response",
        close_after_request,
        run_chat,
        lambda at: stream("vllm request failed: Server disconnected without sending a response."),
    ),
    # Request sent, no response: trio.BrokenResourceError (ECONNRESET) on the read.
    Row(
        "reset-before-response",
        reset_after_request,
        run_chat,
        lambda at: stream(f"vllm request failed: {RESET}"),
    ),
    # h11.RemoteProtocolError: not an HTTP/1.1 response.
    Row(
        "malformed-head",
        malformed_head,
        run_chat,
        lambda at: stream("vllm request failed: illegal status line: bytearray(b'garbage')"),
    ),
    # Write: trio.TooSlowError under the write deadline, the server not answering.
    Row(
        "write-deadline",
        read_head_then_stop,
        run_big_chat,
        lambda at: timeout("vllm request failed: WriteTimeout"),
        cfg=(("connect_timeout_s", SHORT_S),),
    ),
    # The stream: trio.BrokenResourceError (ECONNRESET) mid-body.
    Row(
        "reset-mid-stream",
        reset_mid_stream,
        run_chat,
        lambda at: stream(f"vllm stream scan failed: {RESET}"),
    ),
    # The stream: h11 sees the EOF inside a chunk.
    Row(
        "cut-mid-stream",
        cut_mid_stream,
        run_chat,
        lambda at: stream(
            "vllm stream scan failed: peer closed connection without sending complete "
            "message body (incomplete chunked read)"
        ),
    ),
    # The stream: trio.ClosedResourceError (another task closed the socket).
    Row(
        "closed-mid-stream",
        stall_mid_stream,
        run_chat_closed_meanwhile,
        lambda at: stream("vllm stream scan failed: another task closed this fd"),
    ),
    # The stream: httpx's gzip decoder (httpx.DecodingError).
    Row(
        "gzip-garbage",
        gzip_garbage_stream,
        run_chat,
        lambda at: backend(
            "vllm stream scan failed: Error -3 while decompressing data: incorrect header check"
        ),
    ),
    # A bounded body read (embeddings): ECONNRESET, and an EOF short of Content-Length.
    Row(
        "reset-mid-body",
        reset_mid_json,
        run_embedding,
        lambda at: stream(f"vllm response read failed: {RESET}"),
    ),
    Row(
        "cut-mid-body",
        cut_mid_json,
        run_embedding,
        lambda at: stream(
            "vllm response read failed: peer closed connection without sending complete "
            "message body (received 8 bytes, expected 100)"
        ),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
async def test_a_broken_backend_connection(row: Row) -> None:
    with trio.fail_after(NOTICE_S):
        if row.handler is None:
            with socket.socket() as sock:  # bound, not listening: refused
                sock.bind(("127.0.0.1", 0))
                url = f"http://127.0.0.1:{sock.getsockname()[1]}"
                adapter = vllm(url, **dict(row.cfg))
                try:
                    exc = await row.run(adapter)
                finally:
                    await adapter.aclose()
        else:
            async with serving(row.handler, row.scheme) as url:
                adapter = vllm(url, **dict(row.cfg))
                try:
                    exc = await row.run(adapter)
                finally:
                    await adapter.aclose()
    at = url.split("//", 1)[1]
    got = Outcome.of(exc)
    want = row.expected(at)
    # ssl's messages name the line of its C source that raised them.
    message = re.sub(r" \(_ssl\.c:\d+\)", "", got.message)
    got = Outcome(got.kind, got.code, got.status, message, got.retryable)
    assert got == want
    assert exc.__cause__ is not None  # raise ... from the foreign error


async def test_an_unknown_certificate(tls_files: tuple[str, str]) -> None:
    """ssl.SSLCertVerificationError under trio's BrokenResourceError."""
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def handshake(raw: trio.SocketStream) -> None:
        await trio.SSLStream(raw, server_ctx, server_side=True).do_handshake()

    with trio.fail_after(NOTICE_S):
        async with serving(handshake, "https") as url:
            adapter = vllm(url)
            try:
                exc = await run_chat(adapter)
                detail = await run_probe(adapter)
            finally:
                await adapter.aclose()
    at = url.split("//", 1)[1]
    prefix = f"cannot connect to {at} ([SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
    assert isinstance(exc, BackendUnavailable)
    assert exc.message.startswith(f"vllm request failed: {prefix}"), exc.message
    assert exc.code in RETRYABLE_CODES
    assert detail.startswith(f"request failed: {prefix}"), detail


async def test_a_host_that_does_not_resolve() -> None:
    """socket.gaierror from the resolver (trio's hook: this run only)."""
    previous = trio.socket.set_custom_hostname_resolver(NoSuchHost())
    try:
        adapter = vllm("http://backend.invalid:8000")
        try:
            with trio.fail_after(NOTICE_S):
                exc = await run_chat(adapter)
                detail = await run_probe(adapter)
        finally:
            await adapter.aclose()
    finally:
        trio.socket.set_custom_hostname_resolver(previous)
    message = "cannot resolve the host of backend.invalid:8000 (Name or service not known)"
    assert Outcome.of(exc) == unavailable(f"vllm request failed: {message}")
    assert detail == f"request failed: {message}"


# --- httpx's errors, from a transport the adapter is given ---------------------------


class Raising(httpx.AsyncBaseTransport):
    """A transport whose every request fails with ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise self.exc


AT = "engine.test:8000"
URL = httpx.URL(f"http://{AT}/v1/chat/completions")
HTTPX_ROWS: list[tuple[type[httpx.HTTPError], str, Outcome]] = [
    (httpx.ConnectError, "boom", unavailable("vllm request failed: boom")),
    (httpx.ConnectError, "", unavailable("vllm request failed: ConnectError")),
    (
        httpx.ConnectTimeout,
        "boom",
        unavailable(f"vllm request failed: no connection to {AT} within the connect timeout"),
    ),
    (httpx.UnsupportedProtocol, "boom", unavailable("vllm request failed: boom")),
    (httpx.ReadTimeout, "boom", timeout("vllm request failed: boom")),
    (httpx.WriteTimeout, "", timeout("vllm request failed: WriteTimeout")),
    (httpx.PoolTimeout, "boom", timeout("vllm request failed: boom")),
    (httpx.TimeoutException, "boom", timeout("vllm request failed: boom")),
    (httpx.ReadError, "", stream("vllm request failed: ReadError")),
    (httpx.WriteError, "boom", stream("vllm request failed: boom")),
    (httpx.RemoteProtocolError, "boom", stream("vllm request failed: boom")),
    (httpx.LocalProtocolError, "boom", backend("vllm request failed: boom")),
    (httpx.ProtocolError, "boom", backend("vllm request failed: boom")),
    (httpx.NetworkError, "boom", backend("vllm request failed: boom")),
    (httpx.ProxyError, "boom", backend("vllm request failed: boom")),
    (httpx.DecodingError, "boom", backend("vllm request failed: boom")),
]


@pytest.mark.parametrize(
    ("kind", "text", "expected"), HTTPX_ROWS, ids=[f"{k.__name__}-{t!r}" for k, t, _ in HTTPX_ROWS]
)
async def test_an_httpx_transport_error(
    kind: type[httpx.HTTPError], text: str, expected: Outcome
) -> None:
    cfg = msgspec.convert({"name": "v", "endpoint": f"http://{AT}"}, VllmInstance)
    exc = kind(text)
    adapter = VllmAdapter(cfg, transport=Raising(exc))
    with pytest.raises(BackendError) as info:
        await adapter.execute(chat(), Sink())
    assert Outcome.of(info.value) == expected
    assert info.value.__cause__ is exc


# --- a cancel is never an error ---------------------------------------------------


@pytest.mark.parametrize(
    ("handler", "scheme"),
    [(silent, "https"), (silent, "http"), (stall_mid_stream, "http")],
    ids=["handshake", "head", "stream"],
)
async def test_a_cancel_is_never_turned_into_an_error(
    handler: Callable[[trio.SocketStream], Awaitable[None]], scheme: str
) -> None:
    """Cancelled in the TLS handshake, while the request waits for its
    response head, or mid-stream: ``trio.Cancelled`` goes through the
    boundary untouched, to its scope."""
    sink = Sink()
    with trio.fail_after(NOTICE_S):
        async with serving(handler, scheme) as url:
            adapter = vllm(url)
            try:
                # Were the cancel turned into an error, the nursery would raise it.
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(adapter.execute, chat(), sink)
                    if handler is silent:
                        await trio.testing.wait_all_tasks_blocked()
                    else:
                        await sink.streaming.wait()
                    nursery.cancel_scope.cancel()
            finally:
                await adapter.aclose()
    assert nursery.cancel_scope.cancelled_caught


# --- where a broken connection is not the run's error ------------------------------


async def error_body_cut(stream: trio.SocketStream) -> None:
    await read_request(stream)
    head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100\r\n\r\n"
    await stream.send_all(head + b'{"message":')
    await stream.aclose()


async def done_then_cut(stream: trio.SocketStream) -> None:
    """``[DONE]``, then the connection breaks before the chunked body's end."""
    await read_request(stream)
    body = CHUNK + b"data: [DONE]\n\n"
    await stream.send_all(SSE_HEAD + b"%x\r\n%s\r\n" % (len(body), body))
    reset(stream)


async def test_the_probe_reports_a_body_that_breaks_off() -> None:
    with trio.fail_after(NOTICE_S):
        async with serving(cut_mid_json) as url:
            adapter = vllm(url)
            try:
                detail = await run_probe(adapter)
            finally:
                await adapter.aclose()
    assert detail == (
        "request failed: peer closed connection without sending complete message body "
        "(received 8 bytes, expected 100)"
    )


async def test_an_error_body_that_breaks_off_still_gives_the_backends_status() -> None:
    """The error body is read for its excerpt only: its failure is no error of its own."""
    with trio.fail_after(NOTICE_S):
        async with serving(error_body_cut) as url:
            adapter = vllm(url)
            try:
                exc = await run_chat(adapter)
            finally:
                await adapter.aclose()
    assert isinstance(exc, BackendHTTPError)
    assert (exc.status, exc.code, exc.body_excerpt) == (500, "backend_http_error", '{"message":')


async def test_a_connection_that_breaks_after_done_ends_the_run_complete() -> None:
    """What follows ``[DONE]`` is only drained: a reset there fails nothing."""
    sink = Sink()
    with trio.fail_after(NOTICE_S):
        async with serving(done_then_cut) as url:
            adapter = vllm(url)
            try:
                await adapter.execute(chat(), sink)
            finally:
                await adapter.aclose()
    assert isinstance(sink.events[-1], Complete)


# --- the boundary itself ---------------------------------------------------------

# httpcore's classes by the same name as httpx's rows (httpx's tree mirrors
# httpcore's: before this boundary the pool mapped one to the other by
# name), so each gives the same error. The pool never raises some of them
# (no read or pool timeout is set, no proxy): they are met here only.
HTTPCORE_ROWS = [
    (getattr(httpcore, kind.__name__), text, expected)
    for kind, text, expected in HTTPX_ROWS
    if hasattr(httpcore, kind.__name__)
]


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    HTTPCORE_ROWS,
    ids=[f"{k.__name__}-{t!r}" for k, t, _ in HTTPCORE_ROWS],
)
def test_an_httpcore_error(kind: type[Exception], text: str, expected: Outcome) -> None:
    exc = kind(text)
    with pytest.raises(BackendError) as info, backend_errors("vllm request failed", URL):
        raise exc
    assert Outcome.of(info.value) == expected
    assert info.value.__cause__ is exc


def test_every_httpcore_error_has_a_row() -> None:
    public = {
        name
        for name in dir(httpcore)
        if isinstance(getattr(httpcore, name), type)
        and issubclass(getattr(httpcore, name), Exception)
    }
    # But httpcore's pool's internal signal, which no connection of ours
    # raises: it is no transport error (test_what_is_no_transport_error_*).
    assert public - {k.__name__ for k, _, _ in HTTPCORE_ROWS} == {"ConnectionNotAvailable"}


async def test_a_cancel_passes_the_boundary_untouched() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        with backend_errors("vllm request failed", URL):
            await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught


@pytest.mark.parametrize(
    "exc",
    [
        ExceptionGroup("several", [httpcore.ReadError("x"), httpcore.ReadError("y")]),
        ValueError("not a transport's"),
        BackendStreamError("already mapped"),
        httpcore.ConnectionNotAvailable(),
    ],
    ids=["group", "foreign", "mapped", "pool-internal"],
)
def test_what_is_no_transport_error_passes_untouched(exc: Exception) -> None:
    with pytest.raises(type(exc)) as info, backend_errors("vllm request failed", URL):
        raise exc
    assert info.value is exc
