"""The edge's body writer: a streamed response's middle pieces go straight to
the connection, framed as chunks, without hypercorn's per-message layers
(``iop/edge/server/_http1.py``), on real sockets; and the surface answer
uses it for exactly those pieces."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from types import FrameType
from typing import Any

import h11
import pytest
import trio
from hypercorn.trio import serve

from iop.edge.server._http1 import EdgeHypercornConfig, body_writer, chunk, is_chunked
from iop.edge.server._stall import StallGuard, serve_guarded
from iop.edge.server._surface_asgi import EndKnownBody, _send_answer

NOTICE_S = 10.0


def test_a_chunk_is_framed_as_rfc_9112_says() -> None:
    assert chunk(b"abc") == b"3\r\nabc\r\n"
    assert chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    with pytest.raises(AssertionError):
        chunk(b"")  # that is the body's end


def test_a_head_is_chunked_only_when_it_says_so() -> None:
    assert is_chunked(b"HTTP/1.1 200 \r\nTransfer-Encoding: chunked\r\n\r\n")
    assert is_chunked(b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\ndate: x\r\n\r\n")
    assert not is_chunked(b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n")
    assert not is_chunked(b"HTTP/1.0 200 \r\nconnection: close\r\n\r\n")


class App:
    """Streams ``pieces`` (chunked, or with a Content-Length on ``/sized``),
    the middle ones through the body writer when there is one."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.written: list[bool] = []  # per middle piece: the writer took it
        self.had_writer: list[bool] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        write = body_writer(scope)
        self.had_writer.append(write is not None)
        headers = []
        if scope["path"] == "/sized":
            headers = [(b"content-length", str(sum(map(len, self.pieces))).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        first, *middle, last = self.pieces
        await send({"type": "http.response.body", "body": first, "more_body": True})
        for piece in middle:
            took = write is not None and await write(piece)
            self.written.append(took)
            if not took:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": last, "more_body": False})


@asynccontextmanager
async def server(app: App, *, edge: bool = True) -> AsyncIterator[int]:
    config = EdgeHypercornConfig(max_header_bytes=16384)
    config.bind = ["127.0.0.1:0"]
    stop = trio.Event()
    serving = (
        partial(serve_guarded, app, config, StallGuard(30.0), shutdown_trigger=stop.wait)
        if edge
        else partial(serve, app, config, shutdown_trigger=stop.wait)
    )
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serving)
        yield int(binds[0].rsplit(":", 1)[1])
        stop.set()


async def exchange(port: int, paths: list[str]) -> list[bytes]:
    """GET each path in turn on one keep-alive connection; each response's body."""
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    bodies = []
    async with stream:
        for path in paths:
            await stream.send_all(
                conn.send(h11.Request(method="GET", target=path, headers=[("host", "x")]))
                + conn.send(h11.EndOfMessage())
            )
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    assert isinstance(event, h11.Response), event
                    assert event.status_code == 200
            bodies.append(body)
            conn.start_next_cycle()
    return bodies


PIECES = [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


async def test_the_middle_of_a_chunked_stream_is_written_straight_and_framed_right() -> None:
    app = App(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app) as port:
            # Twice on one connection: the writer follows the connection's
            # response, and h11's state stays right for the next request.
            bodies = await exchange(port, ["/a", "/b"])
    assert bodies == [b"".join(PIECES)] * 2
    assert app.had_writer == [True, True]
    assert app.written == [True, True] * 2


async def test_a_body_with_a_length_goes_through_hypercorn() -> None:
    # A Content-Length body is counted by h11: the writer leaves it alone.
    app = App(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app) as port:
            bodies = await exchange(port, ["/sized", "/a"])
    assert bodies == [b"".join(PIECES)] * 2
    assert app.written == [False, False, True, True]


async def test_plain_hypercorn_offers_no_writer() -> None:
    app = App(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app, edge=False) as port:
            bodies = await exchange(port, ["/a"])
    assert bodies == [b"".join(PIECES)]
    assert app.had_writer == [False]


class _Body(EndKnownBody):
    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = list(pieces)

    @property
    def at_end(self) -> bool:
        return not self._pieces

    async def __anext__(self) -> bytes:
        if not self._pieces:
            raise StopAsyncIteration
        return self._pieces.pop(0)

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("takes", [True, False])
async def test_a_surface_answer_writes_its_middle_pieces_through_the_writer(takes: bool) -> None:
    sent: list[tuple[bytes, bool]] = []
    written: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append((message["body"], message["more_body"]))

    async def write(data: bytes) -> bool:
        written.append(data)
        return takes

    await _send_answer(200, [], _Body(PIECES), send, lambda: None, write)
    middle = PIECES[1:-1]
    assert written == middle  # never the first (the head goes with it) nor the last
    if takes:
        assert sent == [(PIECES[0], True), (PIECES[-1], False)]
    else:
        assert sent == [(PIECES[0], True), *((p, True) for p in middle), (PIECES[-1], False)]


class _Steps(trio.abc.Instrument):
    """Counts the times a task gave the CPU back (each schedule point it passed)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


class _CountingApp(App):
    """Counts the schedule points the app's task passes in each middle write."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(pieces)
        self.steps: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = body_writer(scope) if scope["type"] == "http" else None
        if write is not None:

            async def counted(data: bytes) -> bool:
                steps = _Steps(trio.lowlevel.current_task())
                trio.lowlevel.add_instrument(steps)
                try:
                    return await write(data)
                finally:
                    trio.lowlevel.remove_instrument(steps)
                    self.steps.append(steps.steps)

            scope = {**scope, "extensions": {**scope["extensions"], "iop.body_writer": counted}}
        await super().__call__(scope, receive, send)


async def test_a_write_the_kernel_takes_at_once_passes_no_schedule_point() -> None:
    # Hypercorn's connection writes under a trio.Lock, whose acquire is a
    # schedule point even when the lock is free: a task switch per token.
    # The edge's server takes a free lock without one.
    app = _CountingApp(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app) as port:
            bodies = await exchange(port, ["/a"])
    assert bodies == [b"".join(PIECES)]
    assert app.written == [True, True]
    assert app.steps == [0, 0]


class _CancelledApp(App):
    """Writes its middle pieces from a cancelled scope: a write of the edge's
    connection is shielded, as hypercorn's, so each still goes out whole."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = body_writer(scope) if scope["type"] == "http" else None
        if write is not None:

            async def cancelled(data: bytes) -> bool:
                with trio.CancelScope() as cancel:
                    cancel.cancel()
                    return await write(data)

            scope = {**scope, "extensions": {**scope["extensions"], "iop.body_writer": cancelled}}
        await super().__call__(scope, receive, send)


async def test_a_write_from_a_cancelled_task_still_goes_out_whole() -> None:
    app = _CancelledApp(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app) as port:
            bodies = await exchange(port, ["/a"])
    assert bodies == [b"".join(PIECES)]
    assert app.written == [True, True]


class _CallsApp(App):
    """Records the Python functions each middle write calls (``sys.setprofile``)."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(pieces)
        self.calls: list[list[str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        write = body_writer(scope) if scope["type"] == "http" else None
        if write is not None:

            async def counted(data: bytes) -> bool:
                calls: list[str] = []

                def profile(frame: FrameType, event: str, arg: object) -> None:
                    if event == "call":
                        calls.append(frame.f_code.co_qualname)

                sys.setprofile(profile)
                try:
                    return await write(data)
                finally:
                    sys.setprofile(None)
                    self.calls.append(calls[1:])  # the first is ``write`` itself

            scope = {**scope, "extensions": {**scope["extensions"], "iop.body_writer": counted}}
        await super().__call__(scope, receive, send)


async def test_a_write_the_kernel_takes_at_once_takes_no_lock_and_builds_no_event() -> None:
    # A free send lock taken and released (trio's Lock registers a parking
    # lot breaker each time), a hypercorn ``RawData`` built and checked
    # against hypercorn's ABCs, per token: none is needed when the lock is
    # free and the kernel takes the whole write at once, since nothing
    # runs between the check and the write.
    app = _CallsApp(PIECES)
    with trio.fail_after(NOTICE_S):
        async with server(app) as port:
            bodies = await exchange(port, ["/a"])
    assert bodies == [b"".join(PIECES)]
    assert app.written == [True, True]
    for calls in app.calls:
        assert not [c for c in calls if "acquire" in c or "release" in c or "__init__" in c], calls
        assert len(calls) <= 8, calls  # 20 before
