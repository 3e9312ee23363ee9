"""The edge's write-stall guard (iop.edge.server._stall) on real loopback sockets."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import pytest
import trio

from iop.edge.server._stall import StallGuard, client_gone_reason, current_connection
from iop.events import CancelReason

STALL_S = 0.3
PAYLOAD = b"x" * (8 * 1024 * 1024)  # far more than both sockets' buffers


async def _guarded_pair(guard: StallGuard) -> tuple[trio.abc.HalfCloseableStream, socket.socket]:
    """(the server side, accepted through the guard; a client socket with a tiny window)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = guard.listener(listeners[0])
    port = listeners[0].socket.getsockname()[1]
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    client.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        client.connect(("127.0.0.1", port))
    server = await listener.accept()
    await listener.aclose()
    return server, client


async def test_a_peer_that_accepts_nothing_is_cut_off_and_marked() -> None:
    guard = StallGuard(STALL_S)
    server, client = await _guarded_pair(guard)
    with client:
        seen: list[tuple[CancelReason, str]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            try:
                await server.send_all(PAYLOAD)
            except trio.BrokenResourceError:
                seen.append(client_gone_reason())

        peer = client.getsockname()
        with trio.fail_after(10):
            await guard.asgi(app)({"type": "http", "client": peer}, None, None)
        assert seen == [
            (
                CancelReason.SLOW_CLIENT,
                f"the client accepted no data for write_stall_timeout_s={STALL_S:g}",
            )
        ]
        assert guard.stalled_total == 1
        # The server closed the connection: the client reads what it holds, then EOF/RST.
        client.setblocking(True)
        client.settimeout(5)
        closed = False
        try:
            while client.recv(65536):
                pass
            closed = True
        except ConnectionResetError:
            closed = True
        assert closed


async def test_a_slow_peer_that_keeps_reading_is_not_cut_off() -> None:
    guard = StallGuard(STALL_S)
    server, client = await _guarded_pair(guard)
    # More than the kernel reports writable at once, so the write blocks for
    # longer than the stall deadline while the client keeps reading.
    data = b"y" * (24 * 1024)
    got = bytearray()

    async def read_slowly() -> None:
        while len(got) < len(data):
            await trio.sleep(STALL_S / 2)  # pauses, but never the stall's length
            with contextlib.suppress(BlockingIOError):
                got.extend(client.recv(1024))

    with client, trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(read_slowly)
            await server.send_all(data)
        await server.aclose()
    assert bytes(got) == data
    assert guard.stalled_total == 0


async def test_a_connection_cut_off_for_its_run_is_closed_and_marked() -> None:
    # The run's sink found the client stalled first (both bounds are
    # write_stall_timeout_s): the connection closes at once, its blocked
    # write ends, and its client is a slow client, not a disconnect.
    guard = StallGuard(60.0)
    server, client = await _guarded_pair(guard)
    with client:
        seen: list[tuple[CancelReason, str]] = []

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            connection = current_connection()
            assert connection is not None
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
                        await server.send_all(PAYLOAD)
                    seen.append(client_gone_reason())

                nursery.start_soon(write)
                await trio.sleep(0.2)  # the write is blocked on the full window
                connection.cut_off()
                connection.cut_off()  # idempotent

        with trio.fail_after(10):
            await guard.asgi(app)({"type": "http", "client": client.getsockname()}, None, None)
        assert seen == [
            (CancelReason.SLOW_CLIENT, "the client accepted no data for write_stall_timeout_s=60")
        ]
        assert guard.stalled_total == 1
        client.setblocking(True)
        client.settimeout(5)
        try:
            while client.recv(65536):
                pass
        except ConnectionResetError:
            pass


async def test_a_disconnect_without_stall_is_client_disconnect() -> None:
    guard = StallGuard(STALL_S)
    reasons: list[tuple[CancelReason, str]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reasons.append(client_gone_reason())

    await guard.asgi(app)({"type": "http", "client": ("127.0.0.1", 1)}, None, None)
    assert reasons == [(CancelReason.CLIENT_DISCONNECT, "client disconnected")]


def test_disabled_guard_does_not_wrap() -> None:
    guard = StallGuard(None)
    sentinel: Any = object()
    assert guard.listener(sentinel) is sentinel
