"""The edge's ASGI receive queue: hypercorn's, smaller, and it tells a disconnect (real sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from iop.edge.server._asgi_queue import AppQueue, app_queue
from iop.edge.server._http1 import EdgeHypercornConfig
from iop.edge.server._stall import StallGuard, serve_guarded

REQUEST = b"GET /%s HTTP/1.1\r\nhost: x\r\n\r\n"


class App:
    """Answers ``/ok`` at once; holds ``/hold`` until the client leaves."""

    def __init__(self) -> None:
        self.queues: list[AppQueue | None] = []
        self.log: list[str] = []
        self.holding = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        queue = app_queue(scope)
        self.queues.append(queue)
        await receive()  # the (empty) body
        with trio.CancelScope() as cancel:
            if queue is not None:
                queue.on_disconnect(cancel.cancel)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"2")],
                }
            )
            if scope["path"] == "/hold":
                self.holding.set()
                await trio.sleep_forever()
            if queue is not None:
                queue.on_disconnect(None)  # before the last message (AppQueue.on_disconnect)
            await send({"type": "http.response.body", "body": b"ok"})
        self.log.append(f"{scope['path']} {'cancelled' if cancel.cancelled_caught else 'done'}")


@asynccontextmanager
async def server(app: App, config: HypercornConfig, *, edge: bool = True) -> AsyncIterator[int]:
    """The edge's server (``serve_guarded``), or hypercorn's own ``serve``."""
    config.bind = ["127.0.0.1:0"]
    stop = trio.Event()
    serving = (
        partial(serve_guarded, app, config, StallGuard(None), shutdown_trigger=stop.wait)
        if edge
        else partial(serve, app, config, shutdown_trigger=stop.wait)
    )
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serving)
        yield int(binds[0].rsplit(":", 1)[1])
        stop.set()


async def read_response(stream: trio.SocketStream) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        data += await stream.receive_some(4096)
    return data


async def test_the_edge_gets_an_app_queue_any_other_server_hypercorn_s() -> None:
    # All at once, in one process, as ``iop up`` runs the edge and the sim;
    # hypercorn's own serve, even given the edge's config, is hypercorn's.
    apps = {"edge": App(), "hypercorn": App(), "hypercorn, edge config": App()}
    async with (
        server(apps["edge"], EdgeHypercornConfig(max_header_bytes=8192)) as edge_port,
        server(apps["hypercorn"], HypercornConfig(), edge=False) as plain_port,
        server(
            apps["hypercorn, edge config"], EdgeHypercornConfig(max_header_bytes=8192), edge=False
        ) as other_port,
    ):
        for port in (edge_port, plain_port, other_port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(REQUEST % b"ok")
            assert b" 200 " in await read_response(stream)
            await stream.aclose()
    got = {name: [isinstance(q, AppQueue) for q in app.queues] for name, app in apps.items()}
    assert got == {"edge": [True], "hypercorn": [False], "hypercorn, edge config": [False]}


async def test_a_client_that_leaves_cancels_a_finished_response_does_not() -> None:
    app = App()
    async with server(app, EdgeHypercornConfig(max_header_bytes=8192)) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        # Two answered requests on one connection: the end of the first is
        # no disconnect (the connection is reused for the second).
        for _ in range(2):
            await stream.send_all(REQUEST % b"ok")
            await read_response(stream)
        await stream.send_all(REQUEST % b"hold")
        await app.holding.wait()
        await stream.aclose()  # the client leaves: the held answer is cancelled
        with trio.fail_after(10):
            while len(app.log) < 3:
                await trio.sleep(0.01)
    assert app.log == ["/ok done", "/ok done", "/hold cancelled"]
    assert len({id(q) for q in app.queues}) == 3  # one queue per request


async def test_a_callback_set_after_the_disconnect_is_called_at_once() -> None:
    queue = AppQueue(4)
    await queue.send({"type": "http.request", "body": b"", "more_body": False})
    called: list[str] = []
    queue.on_disconnect(lambda: called.append("early"))
    queue.on_disconnect(None)
    await queue.send({"type": "http.disconnect"})
    assert called == []  # taken back before it came
    queue.on_disconnect(lambda: called.append("late"))
    assert called == ["late"]
    assert (await queue.receive())["type"] == "http.request"
    assert (await queue.receive())["type"] == "http.disconnect"


async def test_without_an_app_queue_a_task_watches_for_the_disconnect() -> None:
    # Another server's scope (no AppQueue in its extensions): SurfaceASGI's
    # own watcher task cancels the answer when http.disconnect arrives.
    from quart import Response

    from iop.edge.server._surface_asgi import SurfaceASGI

    answered: list[str] = []

    async def answer(headers: Any, read_body: Any) -> Response:
        await read_body()
        try:
            await trio.sleep_forever()
        finally:
            answered.append("cancelled")
        raise AssertionError("not reached")

    async def fallback(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not a fallback request")

    app = SurfaceASGI(
        fallback,
        {"/v1/x": answer},
        max_body_bytes=1024,
        body_read_timeout_s=10.0,
        refused=lambda exc, path: Response("refused"),
        crashed=lambda exc, path: Response("crashed"),
    )
    tx, rx = trio.open_memory_channel[dict[str, Any]](4)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": [], "extensions": {}}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, rx.receive, send)
        await tx.send({"type": "http.request", "body": b"{}", "more_body": False})
        await trio.testing.wait_all_tasks_blocked()
        assert answered == []
        await tx.send({"type": "http.disconnect"})
    assert answered == ["cancelled"]
    assert sent == []  # nothing answered to a client that left


async def test_a_disconnect_put_while_hypercorns_task_waits_on_a_full_queue_goes_in() -> None:
    """A frozen link reader leaves a WebSocket's queue full with hypercorn's
    connection task waiting in ``put``; when the app then closes, hypercorn
    puts ``websocket.disconnect`` from the app's own task. That second sender
    used to raise ``BusyResourceError`` out of hypercorn's task group and
    stop the whole edge (tests/e2e/test_node_loss.py, the frozen edge)."""
    queue = AppQueue(2)
    await queue.put({"type": "websocket.receive", "bytes": b"1"})
    await queue.put({"type": "websocket.receive", "bytes": b"2"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.put, {"type": "websocket.receive", "bytes": b"3"})
        await trio.testing.wait_all_tasks_blocked()
        await queue.put({"type": "websocket.disconnect", "code": 1000})
        got = [await queue.receive() for _ in range(4)]
    assert [m.get("bytes", m["type"]) for m in got] == [
        b"1",
        b"2",
        "websocket.disconnect",
        b"3",
    ] or [m.get("bytes", m["type"]) for m in got] == [b"1", b"2", b"3", "websocket.disconnect"]


async def test_a_connection_whose_server_code_fails_is_closed_and_the_edge_serves_on(
    monkeypatch: Any,
) -> None:
    """Whatever goes wrong in one connection's own server code ends that
    connection, logged, not the edge: the next client is served."""
    from iop.edge.server import _hypercorn

    real = _hypercorn.EdgeProtocolWrapper.initiate
    calls = 0

    async def initiate(self: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise trio.BusyResourceError("injected: another task is sending on this channel")
        await real(self)

    monkeypatch.setattr(_hypercorn.EdgeProtocolWrapper, "initiate", initiate)
    app = App()
    async with server(app, EdgeHypercornConfig(max_header_bytes=8192)) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(10):
            assert await first.receive_some(4096) == b""  # closed, no answer
        second = await trio.open_tcp_stream("127.0.0.1", port)
        await second.send_all(REQUEST % b"ok")
        with trio.fail_after(10):
            assert (await read_response(second)).startswith(b"HTTP/1.1 200")
        await first.aclose()
        await second.aclose()
