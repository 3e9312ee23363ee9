"""The node link served at the ASGI level (``iop.edge.server._link_asgi``), over real sockets.

hypercorn serves ``EdgeASGI`` on loopback exactly as ``serve_edge`` does
(``serve_guarded``, the edge's hypercorn config); the client is the node's
own WebSocket channel (``open_ws_link``). Real sockets, so real time:
every wait is bounded by ``fail_after``, and ``gc.collect()`` at the end
makes a leaked socket fail the test (``ResourceWarning`` is an error).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import httpx
import msgspec
import pytest
import trio
import trio.testing

from iop.config import EdgeConfig, LinkSettings
from iop.edge import EdgeHandle, serve_edge
from iop.edge.server._link_asgi import EdgeASGI, LinkEndpoint
from iop.edge.server._serve import _hypercorn_config
from iop.edge.server._stall import StallGuard, serve_guarded
from iop.errors import LinkClosed, LinkLimitError, LinkProtocolError
from iop.node import open_ws_link
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL,
    CLOSE_RATE,
    CLOSE_TOO_BIG,
    FrameChannel,
    NodeSession,
    Welcome,
    decode_edge_message,
)
from iop.runtime import NowaitFrameChannel

DEADLINE_S = 10.0
TOKEN = "a-node-token-of-some-length"

Body = Callable[[FrameChannel, Callable[[int], None] | None], Awaitable[None]]


class Handler:
    """A ``LinkHandler`` that runs ``body`` on each connection and keeps what it saw."""

    def __init__(self, body: Body) -> None:
        self._body = body
        self.peers: list[str] = []
        self.errors: list[BaseException] = []
        self.done = trio.Event()

    async def __call__(
        self,
        chan: FrameChannel,
        peer: str = "",
        *,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        self.peers.append(peer)
        try:
            await self._body(chan, on_open)
        except (LinkClosed, LinkProtocolError) as exc:
            self.errors.append(exc)
        finally:
            self.done.set()


@asynccontextmanager
async def serving(app: EdgeASGI) -> AsyncIterator[str]:
    """hypercorn serving ``app`` on a free loopback port; its ``http://`` URL."""
    stop = trio.Event()
    hc = _hypercorn_config(EdgeConfig(), "127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_guarded, app, hc, StallGuard(None), shutdown_trigger=stop.wait)
        )
        try:
            yield str(binds[0])
        finally:
            stop.set()


def link_app(handler: Handler, *, hello_limit: int = 4096, max_queued: int = 0) -> EdgeASGI:
    """A listener that serves only the link (``link.port``'s), with ``handler``."""
    endpoint = LinkEndpoint(handler, hello_limit=hello_limit, max_queued=max_queued)
    return EdgeASGI(http=None, link=endpoint)


def ws(url: str, path: str = "/v1/link") -> str:
    return "ws" + url[len("http") :] + path


async def test_binary_frames_round_trip_and_our_close_reaches_the_node() -> None:
    async def body(chan: FrameChannel, on_open: object) -> None:
        frame = await chan.receive()
        await chan.send(frame[::-1])
        await chan.aclose(CLOSE_BAD_TOKEN, "bad token")
        await chan.aclose()  # idempotent
        with pytest.raises(LinkClosed):
            await chan.send(b"late")

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            async with open_ws_link(ws(url)) as node:
                await node.send(b"\x00frame\xff")
                assert await node.receive() == b"\xffemarf\x00"
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert (info.value.close_code, info.value.reason) == (CLOSE_BAD_TOKEN, "bad token")
    assert handler.errors == []
    (peer,) = handler.peers
    assert peer.startswith("127.0.0.1:")
    gc.collect()


async def test_a_text_frame_is_a_protocol_error() -> None:
    async def body(chan: FrameChannel, on_open: object) -> None:
        try:
            await chan.receive()
        except LinkProtocolError as exc:
            await chan.aclose(CLOSE_PROTOCOL, str(exc))
            raise

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            async with open_ws_link(ws(url)) as node:
                await node._send_text("hello?")
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    (error,) = handler.errors
    assert isinstance(error, LinkProtocolError)
    assert "text frame" in str(error)
    assert info.value.close_code == CLOSE_PROTOCOL
    gc.collect()


async def test_the_nodes_close_code_and_reason_reach_the_handler() -> None:
    after: list[BaseException] = []

    async def body(chan: FrameChannel, on_open: object) -> None:
        try:
            await chan.receive()
        finally:
            for call in (chan.receive(), chan.send(b"late")):
                try:
                    await call
                except LinkClosed as exc:
                    after.append(exc)
            await chan.aclose()  # a no-op: the peer is gone

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            async with open_ws_link(ws(url)) as node:
                await node.aclose(CLOSE_GOING_AWAY, "node draining")
            await handler.done.wait()
    (error,) = handler.errors
    assert isinstance(error, LinkClosed)
    assert (error.close_code, error.reason) == (CLOSE_GOING_AWAY, "node draining")
    assert str(error) == "link closed by the peer (1001 node draining)"
    # Later calls say the same.
    assert [(e.close_code, str(e)) for e in after if isinstance(e, LinkClosed)] == [
        (CLOSE_GOING_AWAY, str(error))
    ] * 2
    gc.collect()


async def test_a_connection_gone_without_a_close_frame_is_1006() -> None:
    handler = Handler(lambda chan, on_open: chan.receive())
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            async with open_ws_link(ws(url)) as node:
                await node._stream.aclose()  # TCP closed, no close frame
            await handler.done.wait()
    (error,) = handler.errors
    assert isinstance(error, LinkClosed)
    assert error.close_code == 1006
    gc.collect()


async def test_a_frame_over_the_hello_limit_wakes_the_handler_with_1009(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = Handler(lambda chan, on_open: chan.receive())
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler, hello_limit=4096)) as url:
            async with open_ws_link(ws(url)) as node:
                await node.send(b"x" * 5000)
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert info.value.close_code == CLOSE_TOO_BIG  # sent by hypercorn, at once
    (error,) = handler.errors
    assert isinstance(error, LinkClosed)
    assert error.close_code == CLOSE_TOO_BIG
    assert "frame of more than 5000 bytes before its hello (limit 4096): closing (1009)" in (
        caplog.text
    )
    gc.collect()


async def test_on_open_raises_the_frame_limit() -> None:
    got: list[int] = []

    async def body(chan: FrameChannel, on_open: Callable[[int], None] | None) -> None:
        assert on_open is not None
        on_open(1 << 20)
        got.append(len(await chan.receive()))
        await chan.aclose()

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler, hello_limit=4096)) as url:
            async with open_ws_link(ws(url)) as node:
                await node.send(b"x" * (512 << 10))
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert got == [512 << 10]
    assert info.value.close_code == 1000
    gc.collect()


async def test_frames_queued_unread_past_the_bound_are_cut_off_4429(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent = trio.Event()

    async def body(chan: FrameChannel, on_open: object) -> None:
        await sent.wait()
        # hypercorn has read everything on the socket and queued it for us.
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        try:
            while True:
                await chan.receive()
        except LinkLimitError as exc:
            await chan.aclose(exc.close_code, exc.message)
            raise

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler, max_queued=3000)) as url:
            async with open_ws_link(ws(url)) as node:
                for _ in range(5):  # within hypercorn's queue of 10
                    await node.send(b"x" * 1000)
                sent.set()
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert info.value.close_code == CLOSE_RATE
    (error,) = handler.errors
    assert isinstance(error, LinkLimitError)
    assert "4000 bytes queued unread (limit 3000): closing (4429)" in caplog.text
    gc.collect()


async def upgrade(url: str, path: str) -> httpx.Response:
    """A WebSocket upgrade request to ``path``, as a node's would be (RFC 6455 §4.1).

    Through httpx, not trio-websocket: trio-websocket 0.12.2 leaves the
    socket of a refused upgrade open."""
    headers = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
    }
    async with httpx.AsyncClient() as client:
        return await client.get(url + path, headers=headers)


async def test_a_websocket_to_another_path_is_refused_404() -> None:
    handler = Handler(lambda chan, on_open: chan.receive())
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            for path in ("/v1/other", "/v1/link/", "/"):
                resp = await upgrade(url, path)
                assert resp.status_code == 404
                assert resp.json()["error"]["message"] == f"Unknown WebSocket URL: {path}."
            assert (await upgrade(url, "/v1/link")).status_code == 101  # the same request
            await handler.done.wait()
    assert len(handler.peers) == 1  # only the link path reached the handler
    gc.collect()


async def test_a_listener_without_an_http_app_answers_404() -> None:
    handler = Handler(lambda chan, on_open: chan.receive())
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url, httpx.AsyncClient() as client:
            for resp in (
                await client.get(url + "/v1/models"),
                await client.post(url + "/v1/chat/completions", json={"model": "m"}),
                await client.get(url + "/v1/link"),
            ):
                assert resp.status_code == 404
                assert resp.json()["error"]["code"] == "not_found"
    gc.collect()


def edge_config(**link: object) -> EdgeConfig:
    """An edge on a free port, with ``link`` settings."""
    base = EdgeConfig(link=LinkSettings(node_tokens=[TOKEN], **link))  # type: ignore[arg-type]
    return msgspec.structs.replace(base, server=msgspec.structs.replace(base.server, port=0))


async def _hello(url: str) -> Welcome:
    session = NodeSession(node_id="n1", token=TOKEN, now=0.0)
    async with open_ws_link(url) as node:
        await node.send(session.hello([]))
        welcome = decode_edge_message(await node.receive())
    assert isinstance(welcome, Welcome)
    return welcome


async def test_with_link_port_set_the_link_has_a_listener_of_its_own() -> None:
    """``link.port``: nodes dial the link's own port; the API port serves no link
    (404, saying where it is), and the link port serves no API."""
    cfg = edge_config(port=0)
    stop = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: EdgeHandle = await nursery.start(partial(serve_edge, cfg, shutdown=stop))
            assert handle.link_listener is not None
            assert handle.link_url == ws(handle.link_listener)
            assert handle.link_listener != handle.url
            welcome = await _hello(handle.link_url)
            assert welcome.max_frame_bytes == cfg.link_frame_bytes
            refused = await upgrade(handle.url, "/v1/link")
            assert refused.status_code == 404
            assert "its own port (link.port)" in refused.json()["error"]["message"]
            async with httpx.AsyncClient() as client:
                assert (await client.get(handle.url + "/healthz")).status_code == 200
                assert (await client.get(handle.link_listener + "/healthz")).status_code == 404
            stop.set()
    gc.collect()


async def test_by_default_the_api_port_serves_the_link() -> None:
    stop = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: EdgeHandle = await nursery.start(
                partial(serve_edge, edge_config(), shutdown=stop)
            )
            assert handle.link_listener is None
            assert handle.link_url == ws(handle.url)
            await _hello(handle.link_url)
            # Other WebSockets never reach quart (which answered them 500).
            assert (await upgrade(handle.url, "/v1/other")).status_code == 404
            stop.set()
    gc.collect()


class _Peer:
    """The server's side of one ASGI connection, played by hand."""

    def __init__(self, *incoming: dict[str, object]) -> None:
        self._incoming = list(incoming)
        self.sent: list[dict[str, object]] = []

    async def receive(self) -> dict[str, object]:
        return self._incoming.pop(0)

    async def send(self, message: dict[str, object]) -> None:
        self.sent.append(message)


async def test_without_asgis_http_response_extension_a_websocket_is_closed_unaccepted() -> None:
    """ASGI: a close before the accept is the server's 403."""
    app = link_app(Handler(lambda chan, on_open: chan.receive()))
    peer = _Peer({"type": "websocket.connect"})
    await app({"type": "websocket", "path": "/v1/other"}, peer.receive, peer.send)
    assert peer.sent == [{"type": "websocket.close", "code": 1000}]


async def test_a_connection_gone_before_the_handshake_is_never_accepted() -> None:
    handler = Handler(lambda chan, on_open: chan.receive())
    app = link_app(handler)
    for path in ("/v1/link", "/v1/other"):
        peer = _Peer({"type": "websocket.disconnect", "code": 1006})
        await app({"type": "websocket", "path": path}, peer.receive, peer.send)
        assert peer.sent == []
    assert handler.peers == []


async def test_the_frames_of_one_socket_read_are_all_queued_before_the_reader_runs() -> None:
    # The node's channel writes each frame with no schedule point, so the
    # five leave in one go and hypercorn reads them together. Before, its
    # task passed a schedule point after queueing each, and the reader
    # (woken by the first) found at most one more behind it.
    got: list[bytes] = []

    async def body(chan: FrameChannel, on_open: object) -> None:
        assert isinstance(chan, NowaitFrameChannel)
        got.append(await chan.receive())
        while True:
            try:
                got.append(chan.receive_nowait())
            except trio.WouldBlock:
                break
        await chan.aclose()

    handler = Handler(body)
    frames = [b"frame %d" % i for i in range(5)]
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler)) as url:
            async with open_ws_link(ws(url)) as node:
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # the reader waits
                for frame in frames:
                    await node.send(frame)
                with pytest.raises(LinkClosed):
                    await node.receive()
            await handler.done.wait()
    assert got == frames
    assert handler.errors == []
    gc.collect()


async def test_frames_taken_without_waiting_are_credited_to_the_queued_bound() -> None:
    # Two rounds of 3000 bytes under a bound of 3000: within it only if the
    # first round's frames, taken by ``receive_nowait``, left the guard's books.
    rounds: list[list[int]] = []
    taken, more = trio.Event(), trio.Event()

    async def body(chan: FrameChannel, on_open: object) -> None:
        assert isinstance(chan, NowaitFrameChannel)
        for event in (taken, None):
            got = [len(await chan.receive())]
            while len(got) < 3:
                try:
                    got.append(len(chan.receive_nowait()))
                except trio.WouldBlock:
                    got.append(len(await chan.receive()))
            rounds.append(got)
            if event is not None:
                event.set()
                await more.wait()
        await chan.aclose()

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler, max_queued=3000)) as url:
            async with open_ws_link(ws(url)) as node:
                for round_ in range(2):
                    for _ in range(3):
                        await node.send(b"x" * 1000)
                    if round_ == 0:
                        await taken.wait()
                        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                        more.set()
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert info.value.close_code == 1000
    assert handler.errors == []
    assert rounds == [[1000] * 3, [1000] * 3]
    gc.collect()


async def test_a_frame_over_the_limit_behind_others_trips_the_guard_before_they_are_taken_1009(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[int] = []

    async def body(chan: FrameChannel, on_open: object) -> None:
        assert isinstance(chan, NowaitFrameChannel)
        got.append(len(await chan.receive()))
        while True:
            try:
                got.append(len(chan.receive_nowait()))
            except trio.WouldBlock:
                await chan.receive()  # the guard's verdict

    handler = Handler(body)
    with trio.fail_after(DEADLINE_S):
        async with serving(link_app(handler, hello_limit=4096)) as url:
            async with open_ws_link(ws(url)) as node:
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                for _ in range(3):
                    await node.send(b"x" * 100)
                await node.send(b"x" * 5000)
                with pytest.raises(LinkClosed) as info:
                    await node.receive()
            await handler.done.wait()
    assert info.value.close_code == CLOSE_TOO_BIG
    (error,) = handler.errors
    assert isinstance(error, LinkClosed)
    assert error.close_code == CLOSE_TOO_BIG
    # A trip ends the link at once: what was queued before it is not taken
    # (as ``receive``), with or without waiting.
    assert got == []
    gc.collect()
