"""The node's keep-alive transport (``iop.adapters._pool``), against real sockets.

A scripted ``FakeBackend`` counts the connections it accepts; a raw trio
server plays the one thing it cannot: a keep-alive connection that the server
closes while it is idle. The request head's write is checked at the socket
boundary, with a stream that records every ``send_all``.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import math
import ssl
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import h11
import httpcore
import httpx
import pytest
import trio
import trio.testing

from iop.adapters._http import HTTPBackend, environment_proxy
from iop.adapters._pool import (
    CLOSE_TIMEOUT_S,
    HEAD_MAX_BYTES,
    KeepAliveTransport,
    _SocketStream,
)
from iop.adapters.vllm import VllmAdapter
from iop.config import Deadlines, SimConfig, VllmInstance
from iop.events import Complete, Delta, Error
from iop.runtime import collect_run, open_run_supervisor
from iop.sim import MAX_REQUEST_BYTES, serve_sim
from iop.spec import ChatRequest, ExecutionSpec, Message
from iop.testing import (
    CHAT_COMPLETIONS_PATH,
    MODELS_PATH,
    CloseCause,
    Connection,
    Reply,
    Split,
    open_fake_backend,
)

BODY = b'data: {"choices":[]}\n\ndata: [DONE]\n\n'
NOTICE_S = 5.0


@asynccontextmanager
async def transport(max_idle: int = 64) -> AsyncIterator[KeepAliveTransport]:
    pool = KeepAliveTransport(max_idle=max_idle)
    try:
        yield pool
    finally:
        await pool.aclose()


async def fetch(pool: httpx.AsyncBaseTransport, url: str) -> bytes:
    response = await pool.handle_async_request(httpx.Request("GET", url))
    try:
        return await response.aread()
    finally:
        await response.aclose()


async def test_sequential_requests_share_one_connection() -> None:
    async with open_fake_backend() as fb, transport() as pool:
        fb.route(MODELS_PATH, Reply.json({"data": []}))
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        for path in (MODELS_PATH, CHAT_COMPLETIONS_PATH) * 3:
            await fetch(pool, fb.url + path)
        assert pool.idle_connections == 1
    assert len(fb.requests) == 6
    assert len(fb.connections) == 1


async def _burst(pool: KeepAliveTransport, url: str, n: int) -> None:
    """``n`` streams open at once, then each read to its end and closed."""
    opened = 0
    all_open = trio.Event()

    async def one() -> None:
        nonlocal opened
        response = await pool.handle_async_request(httpx.Request("POST", url, content=b"{}"))
        try:
            opened += 1
            if opened == n:
                all_open.set()
            await all_open.wait()
            assert await response.aread() == BODY
        finally:
            await response.aclose()

    with trio.fail_after(NOTICE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)


async def test_a_burst_finds_its_connections_again() -> None:
    # httpx's pool (httpcore 1.0.9) counts *all* connections against its
    # keep-alive limit (20 by default): after a burst of 32 it would close
    # the idle ones and the next burst would open new connections.
    async with open_fake_backend() as fb, transport(max_idle=32) as pool:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        await _burst(pool, fb.url + CHAT_COMPLETIONS_PATH, 32)
        assert pool.idle_connections == 32
        await _burst(pool, fb.url + CHAT_COMPLETIONS_PATH, 32)
        assert pool.idle_connections == 32
    assert len(fb.requests) == 64
    assert len(fb.connections) == 32


async def test_at_most_max_idle_connections_wait() -> None:
    async with open_fake_backend() as fb, transport(max_idle=3) as pool:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        await _burst(pool, fb.url + CHAT_COMPLETIONS_PATH, 8)
        assert pool.idle_connections == 3
        # The other five were closed by the pool: wait until the server saw it.
        seen = 0
        with trio.fail_after(NOTICE_S):
            async with trio.open_nursery() as nursery:

                async def watch(conn: Connection) -> None:
                    nonlocal seen
                    await conn.wait_closed()
                    seen += 1
                    if seen == 5:
                        nursery.cancel_scope.cancel()

                for conn in fb.connections:
                    nursery.start_soon(watch, conn)
        closed = [c for c in fb.connections if c.close_cause is not None]
    assert len(fb.connections) == 8
    assert len(closed) == 5
    assert all(c.closed_by_client for c in closed)


async def test_connections_idle_past_the_expiry_are_closed_from_the_bottom() -> None:
    now = 100.0
    async with open_fake_backend() as fb:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        pool = KeepAliveTransport(max_idle=8, keepalive_expiry_s=5.0, clock=lambda: now)
        try:
            await _burst(pool, fb.url + CHAT_COMPLETIONS_PATH, 3)
            now += 4.0  # not yet: the next request reuses the top one
            await fetch(pool, fb.url + CHAT_COMPLETIONS_PATH)
            assert (len(fb.connections), pool.idle_connections) == (3, 3)
            now += 2.0  # the two below it went idle 6 s ago
            await fetch(pool, fb.url + CHAT_COMPLETIONS_PATH)
            assert (len(fb.connections), pool.idle_connections) == (3, 1)
        finally:
            await pool.aclose()


async def test_a_body_left_early_closes_its_connection() -> None:
    async with open_fake_backend() as fb, transport() as pool:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_after_bytes=4))
        request = httpx.Request("POST", fb.url + CHAT_COMPLETIONS_PATH, content=b"{}")
        response = await pool.handle_async_request(request)
        parts = response.aiter_raw()
        assert await parts.__anext__() == BODY[:4]
        await response.aclose()
        conn = await fb.wait_client_closed(NOTICE_S)
        assert pool.idle_connections == 0
        # The next request opens a new connection.
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        assert await fetch(pool, fb.url + CHAT_COMPLETIONS_PATH) == BODY
    assert conn.close_cause in (CloseCause.CLIENT_EOF, CloseCause.CLIENT_RESET)
    assert len(fb.connections) == 2


async def _serve_then_close(
    accepted: list[trio.SocketStream],
    closed: trio.Event,
    stream: trio.SocketStream,
) -> None:
    """One response with keep-alive framing, then the server closes (idle timeout)."""
    accepted.append(stream)
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await stream.aclose()
    if len(accepted) == 1:
        closed.set()


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    accepted: list[trio.SocketStream] = []
    closed = trio.Event()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(
                trio.serve_tcp, partial(_serve_then_close, accepted, closed), 0, host="127.0.0.1"
            )
        )
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            url = f"http://127.0.0.1:{port}/"
            assert await fetch(pool, url) == b"ok"
            assert pool.idle_connections == 1
            with trio.fail_after(NOTICE_S):
                await closed.wait()
            # Its socket now reads EOF: reusing it would fail the request.
            assert await fetch(pool, url) == b"ok"
        nursery.cancel_scope.cancel()
    assert len(accepted) == 2


async def test_errors_are_httpcore_errors() -> None:
    """The pool lets httpcore's errors out as they are: the adapters' one
    boundary maps them (``iop.adapters._errors``; tests/adapters/test_backend_errors.py)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    async with transport() as pool:
        with pytest.raises(httpcore.ConnectError):
            await fetch(pool, f"http://127.0.0.1:{port}/")
    async with open_fake_backend() as fb, transport() as pool:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, truncate_after_bytes=5))
        with pytest.raises(httpcore.RemoteProtocolError):
            await fetch(pool, fb.url + CHAT_COMPLETIONS_PATH)
        assert pool.idle_connections == 0


async def test_aclose_closes_connections_in_use_too() -> None:
    async with open_fake_backend() as fb:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY, stall_after_headers=True))
        fb.route(MODELS_PATH, Reply.json({"data": []}))
        pool = KeepAliveTransport(max_idle=4)
        request = httpx.Request("POST", fb.url + CHAT_COMPLETIONS_PATH, content=b"{}")
        response = await pool.handle_async_request(request)  # one in use
        await fetch(pool, fb.url + MODELS_PATH)  # one idle
        assert pool.idle_connections == 1
        await pool.aclose()
        await pool.aclose()  # idempotent
        with trio.fail_after(NOTICE_S):
            for conn in fb.connections:
                await conn.wait_closed()
        with pytest.raises(RuntimeError, match="closed"):
            await fetch(pool, fb.url + MODELS_PATH)
        await response.aclose()
    assert len(fb.connections) == 2
    assert all(c.closed_by_client for c in fb.connections)


class _Recorder(trio.abc.Stream):
    """A socket that records each ``send_all`` and answers reads from a script."""

    def __init__(self, replies: list[bytes]) -> None:
        self.sends: list[bytes] = []
        self.events: list[str] = []
        self._replies = replies

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sends.append(bytes(data))
        self.events.append("send")
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self.events.append("receive")
        await trio.lowlevel.checkpoint()
        return self._replies.pop(0) if self._replies else b""

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_the_head_goes_out_with_the_body() -> None:
    raw = _Recorder([b"HTTP/1.1 200 OK\r\n"])
    stream = _SocketStream(raw)  # type: ignore[arg-type]
    await stream.write(b"HEAD\r\n\r\n")
    await stream.write(b"")
    assert raw.sends == []
    await stream.write(b'{"body":1}')
    assert raw.sends == [b'HEAD\r\n\r\n{"body":1}']


async def test_a_held_head_is_sent_before_any_read() -> None:
    raw = _Recorder([b"HTTP/1.1 200 OK\r\n"])
    stream = _SocketStream(raw)  # type: ignore[arg-type]
    await stream.write(b"GET / HTTP/1.1\r\n\r\n")
    assert await stream.read(1024) == b"HTTP/1.1 200 OK\r\n"
    assert raw.sends == [b"GET / HTTP/1.1\r\n\r\n"]
    assert raw.events == ["send", "receive"]


async def test_a_big_body_is_not_copied_to_join_the_head() -> None:
    raw = _Recorder([])
    stream = _SocketStream(raw)  # type: ignore[arg-type]
    big = b"x" * (HEAD_MAX_BYTES + 1)
    await stream.write(b"HEAD")
    await stream.write(big)
    await stream.write(big)
    assert raw.sends == [b"HEAD", big, big]


class _SlowClose(_Recorder):
    """A stream whose close takes ``close_s`` (forever: ``math.inf``)."""

    def __init__(self, close_s: float) -> None:
        super().__init__([])
        self.close_s = close_s
        self.closed = False

    async def aclose(self) -> None:
        self.events.append("close")
        await trio.sleep(self.close_s)
        self.closed = True


async def test_a_cancelled_callers_close_still_runs(autojump_clock: trio.testing.MockClock) -> None:
    """The closed socket is what stops the backend: a cancelled run still closes."""
    raw = _SlowClose(CLOSE_TIMEOUT_S / 2)
    with trio.CancelScope() as scope:
        scope.cancel()
        await _SocketStream(raw).aclose()  # type: ignore[arg-type]
    assert raw.closed


async def test_a_close_that_hangs_is_abandoned_at_its_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    raw = _SlowClose(math.inf)
    start = trio.current_time()
    with trio.CancelScope() as scope:
        scope.cancel()  # shielded, as httpcore and the pool close
        await _SocketStream(raw).aclose()  # type: ignore[arg-type]
    assert trio.current_time() - start == CLOSE_TIMEOUT_S
    assert raw.events == ["close"]
    assert not raw.closed
    assert "closing a backend connection took over 1s: abandoned" in caplog.text


async def test_the_backend_sees_one_segment_per_request() -> None:
    # Through a real socket: the whole request arrives in the server's first read.
    got: list[bytes] = []
    done = trio.Event()

    async def server(stream: trio.SocketStream) -> None:
        got.append(await stream.receive_some(65536))
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        done.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        cfg = VllmInstance(name="v", endpoint=f"http://127.0.0.1:{port}")
        backend = HTTPBackend(cfg, kind="vllm")
        try:
            async with backend.post_json("/v1/chat/completions", {"a": 1}, what="x") as resp:
                assert resp.status_code == 200
        finally:
            await backend.aclose()
        with trio.fail_after(NOTICE_S):
            await done.wait()
        nursery.cancel_scope.cancel()
    head, _, body = got[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1")
    assert body == b'{"a":1}'


async def test_requests_carry_the_headers_an_httpx_client_sent() -> None:
    async with open_fake_backend() as fb:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(BODY))
        cfg = VllmInstance(name="v", endpoint=fb.url, headers={"X-Team": "a"})
        backend = HTTPBackend(cfg, kind="vllm")
        try:
            async with backend.post_json(CHAT_COMPLETIONS_PATH, {"a": 1}, what="x") as resp:
                await resp.aread()
        finally:
            await backend.aclose()
    req = fb.requests[0]
    names = [name for name, _ in req.headers]
    assert names[0] == "host"
    for name in ("accept", "accept-encoding", "connection", "user-agent", "content-length"):
        assert name in names
    assert req.header("content-type") == "application/json"
    assert req.header("x-team") == "a"
    assert req.header("user-agent") == f"python-httpx/{httpx.__version__}"


def test_environment_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert environment_proxy("http://gpu:8000") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert environment_proxy("http://gpu:8000") is None
    assert environment_proxy("https://api.example.com/v1") == "http://proxy:3128"
    monkeypatch.setenv("ALL_PROXY", "http://all:3128")
    assert environment_proxy("http://gpu:8000") == "http://all:3128"
    monkeypatch.setenv("NO_PROXY", "gpu")
    assert environment_proxy("http://gpu:8000") is None


async def test_a_proxy_in_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fake backend stands in for the proxy: it gets the absolute URL.
    async with open_fake_backend() as proxy:
        proxy.route(MODELS_PATH, Reply.json({"data": [{"id": "m"}]}))
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        backend = HTTPBackend(
            VllmInstance(name="v", endpoint="http://gpu.invalid:8000"), kind="vllm"
        )
        try:
            assert await backend.fetch_targets() == ["m"]
        finally:
            await backend.aclose()
    assert proxy.requests[0].target == "http://gpu.invalid:8000/v1/models"


SSE = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("encoding", ["", "gzip"])
async def test_a_stream_is_read_whether_or_not_the_backend_compresses_it(encoding: str) -> None:
    # Uncompressed, the transport's stream is read directly; compressed, httpx decodes it.
    body = gzip.compress(SSE) if encoding else SSE
    headers = (("content-type", "text/event-stream"),)
    if encoding:
        headers += (("content-encoding", encoding),)
    async with open_fake_backend() as fb:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(body, headers=headers, split=Split.every(7)))
        adapter = VllmAdapter(VllmInstance(name="v", endpoint=fb.url))
        request = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
        try:
            runs = [
                await collect_run(adapter, ExecutionSpec(run_id=f"r{i}", request=request))
                for i in range(2)
            ]
        finally:
            await adapter.aclose()
    for events in runs:
        assert [e.text for e in events if isinstance(e, Delta)] == ["Hi"]
        assert isinstance(events[-1], Complete)
    # Each body was read to its end: the second run reused the connection.
    assert len(fb.connections) == 1


async def test_a_stream_read_to_its_end_leaves_no_generator_to_trio() -> None:
    # The pump reads the body, then drains it in a second loop: both must
    # read one iteration of httpcore's body, or the first is left
    # half-done to trio's finalizer (a task per run; filtered in pytest's
    # settings, hence caught here).
    async with open_fake_backend() as fb:
        fb.route(CHAT_COMPLETIONS_PATH, Reply.sse(SSE))
        adapter = VllmAdapter(VllmInstance(name="v", endpoint=fb.url))
        request = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            try:
                events = await collect_run(adapter, ExecutionSpec(run_id="r", request=request))
            finally:
                await adapter.aclose()
            gc.collect()
    assert isinstance(events[-1], Complete)
    assert [str(w.message) for w in caught if "Async generator" in str(w.message)] == []


async def test_https_through_the_pool(tls_files: tuple[str, str]) -> None:
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    accepted: list[trio.SSLStream[trio.SocketStream]] = []

    async def serve(raw: trio.SocketStream) -> None:
        stream = trio.SSLStream(raw, server_ctx, server_side=True)
        accepted.append(stream)
        for _ in range(2):  # two requests on one kept-alive connection
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        pool = KeepAliveTransport(max_idle=2, ssl_context=ssl.create_default_context(cafile=cert))
        try:
            assert await fetch(pool, f"https://127.0.0.1:{port}/") == b"ok"
            assert await fetch(pool, f"https://127.0.0.1:{port}/") == b"ok"
        finally:
            await pool.aclose()
        nursery.cancel_scope.cancel()
    assert len(accepted) == 1


async def test_https_with_an_unknown_certificate_is_a_connect_error(
    tls_files: tuple[str, str],
) -> None:
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def serve(raw: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await trio.SSLStream(raw, server_ctx, server_side=True).do_handshake()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        pool = KeepAliveTransport(max_idle=2, ssl_context=ssl.create_default_context())
        try:
            with pytest.raises(httpcore.ConnectError):
                await fetch(pool, f"https://127.0.0.1:{port}/")
        finally:
            await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_cancel_during_the_tls_handshake_closes_its_socket() -> None:
    """httpcore gets no stream to close from a handshake that did not end:
    the socket under it is closed when the run is cancelled, not left to the
    garbage collector (disabled here, so only the close can end the wait)."""
    accepted, closed = trio.Event(), trio.Event()

    async def silent(raw: trio.SocketStream) -> None:
        accepted.set()
        while await raw.receive_some(65536):  # the ClientHello, then EOF
            pass
        closed.set()

    async def cancel_in_the_handshake(scope: trio.CancelScope) -> None:
        await accepted.wait()
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()

    gc.disable()
    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            pool = KeepAliveTransport(max_idle=2, ssl_context=ssl.create_default_context())
            try:
                with trio.CancelScope() as scope:
                    nursery.start_soon(cancel_in_the_handshake, scope)
                    await fetch(pool, f"https://127.0.0.1:{port}/")
                with trio.fail_after(NOTICE_S):
                    await closed.wait()
            finally:
                await pool.aclose()
            nursery.cancel_scope.cancel()
    finally:
        gc.enable()
    assert scope.cancelled_caught


async def _refuse_early(done: trio.Event, stream: trio.SocketStream) -> None:
    """Read the head, answer 413 at once, then read nothing more (the body is
    too large): what a server with a smaller body limit than the edge's does."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    await stream.send_all(
        b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!"
    )
    await done.wait()
    await stream.aclose()


async def test_an_early_answer_to_a_body_the_server_stopped_reading_is_the_response() -> None:
    """Not a write timeout (a 504 on the edge): the server's answer is read."""
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, partial(_refuse_early, done), 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            request = httpx.Request(
                "POST",
                f"http://127.0.0.1:{port}/",
                content=b"x" * (64 * 1024 * 1024),
                extensions={"timeout": {"connect": 5.0, "read": 5.0, "write": 0.5, "pool": 5.0}},
            )
            with trio.fail_after(NOTICE_S):
                response = await pool.handle_async_request(request)
                try:
                    assert response.status_code == 413
                    assert await response.aread() == b"too big!"
                finally:
                    await response.aclose()
        done.set()
        nursery.cancel_scope.cancel()


async def test_a_connection_whose_body_the_server_refused_is_not_reused() -> None:
    """After an early 413 to a body larger than the backend's limit, the
    connection is closed, not kept idle: the next run on it would wait for an
    answer until its first-token timeout (the server is still behind the
    body's unread bytes), a 504 on the edge."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            partial(
                serve_sim,
                SimConfig(ttft_s=0.0, output_tokens=3),
                "127.0.0.1",
                0,
                shutdown_trigger=stop.wait,
            )
        )
        adapter = VllmAdapter(VllmInstance(name="v", endpoint=url))
        pool = adapter._http._transport
        assert isinstance(pool, KeepAliveTransport)
        deadlines = Deadlines(first_token_timeout_s=NOTICE_S, idle_timeout_s=NOTICE_S)
        big = "x " * MAX_REQUEST_BYTES  # twice the sim's limit, under the edge's 8 MiB
        outcomes = []
        try:
            async with open_run_supervisor() as sup:
                for i, content in enumerate([big, "hi"]):
                    request = ChatRequest(
                        model="iop-sim", messages=[Message(role="user", content=content)]
                    )
                    spec = ExecutionSpec(run_id=f"r{i}", request=request)
                    run = sup.start_run(adapter, spec, deadlines)
                    async with run.events:
                        outcomes.append([ev async for ev in run.events][-1])
                    if i == 0:
                        assert pool.idle_connections == 0
        finally:
            await adapter.aclose()
            stop.set()
    refused, answered = outcomes
    assert isinstance(refused, Error), refused
    assert refused.status == 413
    assert isinstance(answered, Complete), answered


async def _chunks_in_one_write(stream: trio.SocketStream) -> None:
    """A chunked answer whose head and three chunks arrive in one segment, as a
    backend's events do when it writes faster than the node reads."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"7\r\ndata: a\r\n7\r\ndata: b\r\n7\r\ndata: c\r\n0\r\n\r\n"
    )
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.receive_some(65536)  # until the client closes


async def test_a_read_that_completes_several_chunks_is_one_piece() -> None:
    # httpcore's body yields one piece per HTTP chunk (h11's Data), through
    # two generators and an exception map each: the node paid that for every
    # token. The pool's body gives what one socket read completed, and the
    # connection still goes back to the pool at the body's end.
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, _chunks_in_one_write, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            request = httpx.Request("POST", f"http://127.0.0.1:{port}/", content=b"{}")
            response = await pool.handle_async_request(request)
            pieces = []
            try:
                with trio.fail_after(NOTICE_S):
                    async for piece in response.stream:
                        pieces.append(piece)
            finally:
                await response.aclose()
            assert pieces == [b"data: adata: bdata: c"]
            assert pool.idle_connections == 1
        nursery.cancel_scope.cancel()


async def test_a_traced_request_is_read_through_httpcores_body() -> None:
    # httpcore's ``trace`` extension reports each body read: a traced request
    # keeps httpcore's own iterator, one piece per chunk.
    seen: list[str] = []

    async def trace(name: str, info: dict[str, object]) -> None:
        seen.append(name)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, _chunks_in_one_write, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            request = httpx.Request(
                "POST", f"http://127.0.0.1:{port}/", content=b"{}", extensions={"trace": trace}
            )
            response = await pool.handle_async_request(request)
            try:
                with trio.fail_after(NOTICE_S):
                    pieces = [piece async for piece in response.stream]
            finally:
                await response.aclose()
            assert pieces == [b"data: a", b"data: b", b"data: c"]
            assert "http11.receive_response_body.started" in seen
            assert pool.idle_connections == 1
        nursery.cancel_scope.cancel()


async def test_a_read_that_waits_for_its_data_makes_one_read_system_call() -> None:
    # A paced backend's next token is never there yet when the node reads:
    # trio's socket ``recv`` first tries (a system call failing with EAGAIN,
    # under two context managers), then waits, then reads again. The pool's
    # socket waits first, then reads once.
    a, b = trio.socket.socketpair()
    reads: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") in ("recv", "recv_into", "read"):
            reads.append(getattr(arg, "__name__", ""))

    async def answer_later() -> None:
        await trio.testing.wait_all_tasks_blocked()
        await b.send(b"data: token\n\n")

    with a, b:
        stream = _SocketStream(trio.SocketStream(a))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_later)
            sys.setprofile(profile)
            try:
                with trio.fail_after(NOTICE_S):
                    data = await stream.read(1024)
            finally:
                sys.setprofile(None)
    assert data == b"data: token\n\n"
    assert len(reads) == 1, reads


async def _paced_chunks(stream: trio.SocketStream) -> None:
    """A chunked answer whose head comes with its first chunk, then 63 more
    chunks, each in its own write, then the last chunk with a trailer."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nt00\r\n")
    for i in range(1, 64):
        await stream.send_all(b"3\r\nt%02d\r\n" % i)
    await stream.send_all(b"0\r\nx-done: 1\r\n\r\n")
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.receive_some(65536)  # until the client closes


async def test_a_chunked_body_is_framed_without_h11_per_chunk() -> None:
    # h11 parsed each chunk of a paced stream (an engine writes one token per
    # chunk) with an event, a state-machine step and two ``next_event``
    # calls. The pool's body hands the chunks to its own decoder once h11
    # stands between two chunks, and back to h11 for the trailer section:
    # the body is the same, and the connection still goes back to the pool.
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call" and getattr(frame, "f_code", None) is h11.Connection.next_event.__code__:
            calls += 1

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _paced_chunks, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            request = httpx.Request("POST", f"http://127.0.0.1:{port}/", content=b"{}")
            response = await pool.handle_async_request(request)
            body = b""
            sys.setprofile(profile)
            try:
                with trio.fail_after(NOTICE_S):
                    async for piece in response.stream:
                        body += piece
            finally:
                sys.setprofile(None)
                await response.aclose()
            assert body == b"".join(b"t%02d" % i for i in range(64))
            assert pool.idle_connections == 1
        nursery.cancel_scope.cancel()
    assert calls <= 6, calls


def _then(tail: bytes) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def serve(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await stream.send_all(b"3\r\nt00\r\n")
        await stream.send_all(tail)
        await stream.aclose()

    return serve


@pytest.mark.parametrize(
    ("tail", "error"),
    [
        (b"3\r\nt01\r\nzz\r\n", "illegal chunk header: bytearray(b'zz\\r\\n')"),
        (b"3\r\nt01XY", "malformed chunk footer: bytearray(b'XY') (expected b'\\r\\n')"),
        (b"3\r\nt0", "incomplete chunked read"),
        (b"0\r\nnot a header\r\n\r\n", "illegal header line"),
    ],
)
async def test_a_broken_chunked_body_is_httpcores_error_with_h11s_words(
    tail: bytes, error: str
) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _then(tail), 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with transport() as pool:
            request = httpx.Request("GET", f"http://127.0.0.1:{port}/")
            response = await pool.handle_async_request(request)
            try:
                with trio.fail_after(NOTICE_S), pytest.raises(httpcore.RemoteProtocolError) as info:
                    async for _ in response.stream:
                        pass
            finally:
                await response.aclose()
            assert error in str(info.value)
            assert pool.idle_connections == 0
        nursery.cancel_scope.cancel()
