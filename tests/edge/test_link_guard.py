"""The link's frame guard inside hypercorn (``iop.edge.server._link_guard``), piece by piece.

The end-to-end proof is ``tests/e2e/test_link_limits.py`` (a real edge cuts
a 4 MiB pre-hello frame at 256 KiB and logs it), and
``tests/edge/test_link_asgi.py`` drives the guard through real sockets
(only the link path gets it); here the buffer's and the installer's rules
are checked one by one, including that nothing above the limit is ever kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypercorn.protocol.ws_stream import FrameTooLargeError, WebsocketBuffer
from wsproto.events import BytesMessage, CloseConnection

from iop.edge.server._link_guard import LinkFrameGuard, LinkFrameLimits, _GuardedBuffer


def chunk(n: int, *, last: bool = False) -> BytesMessage:
    return BytesMessage(data=b"x" * n, frame_finished=last, message_finished=last)


def test_a_frame_over_the_hello_limit_is_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limits = LinkFrameLimits(100, "10.0.0.1:999")
    buf = _GuardedBuffer(limits)
    buf.extend(chunk(60))
    with pytest.raises(FrameTooLargeError):
        buf.extend(chunk(60))
    assert limits.oversize == 120
    assert buf.length == 0  # nothing kept
    assert buf.value is None
    with pytest.raises(FrameTooLargeError):  # the rest of it, while the close goes out
        buf.extend(chunk(1))
    assert (
        "node link from 10.0.0.1:999: frame of more than 120 bytes before its hello "
        "(limit 100): closing (1009)"
    ) in caplog.text


def test_after_the_hello_the_limit_is_raised() -> None:
    limits = LinkFrameLimits(100, "p")
    buf = _GuardedBuffer(limits)
    limits.open(1000)
    buf.extend(chunk(600, last=True))
    assert buf.to_message()["bytes"] == b"x" * 600
    assert limits.oversize is None


def test_bytes_queued_unread_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    limits = LinkFrameLimits(1000, "p", max_queued=1500)
    buf = _GuardedBuffer(limits)
    for _ in range(2):
        buf.extend(chunk(700, last=True))
        buf.to_message()
        buf.clear()
    assert limits.queued == 1400
    assert not limits.tripped
    limits.consumed(700)  # the handler read one
    buf.extend(chunk(700, last=True))
    buf.to_message()
    buf.clear()
    assert not limits.tripped
    buf.extend(chunk(700, last=True))
    buf.to_message()
    assert limits.overqueued
    assert "2100 bytes queued unread (limit 1500): closing (4429)" in caplog.text


class _Handshake:
    def __init__(self) -> None:
        self.extensions: list[str] | None = ["permessage-deflate"]


class _Connection:
    """wsproto's connection, as far as hypercorn's stream reads it."""

    def __init__(self, *events: Any) -> None:
        self._events = events

    def events(self) -> Any:
        yield from self._events


class _Stream:
    """The parts of hypercorn's WSStream the guard touches."""

    def __init__(self) -> None:
        self.buffer = WebsocketBuffer(16 << 20)
        self.handshake = _Handshake()
        self.connection = _Connection(chunk(3, last=True), CloseConnection(1001, "node draining"))

    async def app_send(self, message: Any) -> None:
        pass


def test_the_guard_fits_the_stream_before_the_accept() -> None:
    guard = LinkFrameGuard(hello_limit=4096, max_queued=1 << 20)
    stream = _Stream()
    limits = guard.install({"type": "websocket", "client": ("10.0.0.2", 1234)}, stream.app_send)
    assert isinstance(limits, LinkFrameLimits)
    assert (limits.limit, limits.peer, limits.max_queued) == (4096, "10.0.0.2:1234", 1 << 20)
    assert isinstance(stream.buffer, _GuardedBuffer)
    assert stream.handshake.extensions is None  # no permessage-deflate on the link


def test_after_the_accept_the_peers_close_frame_is_noted() -> None:
    guard = LinkFrameGuard(hello_limit=4096)
    stream = _Stream()
    limits = guard.install({"type": "websocket"}, stream.app_send)
    assert limits is not None
    assert limits.peer == "?"
    guard.accepted(limits, stream.app_send)
    events = list(stream.connection.events())  # what hypercorn's stream reads
    assert [type(e) for e in events] == [BytesMessage, CloseConnection]
    assert limits.peer_close == (1001, "node draining")


def test_unknown_server_internals_only_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    async def send(message: Any) -> None:
        pass

    guard = LinkFrameGuard(hello_limit=4096)
    for _ in range(3):
        assert guard.install({"type": "websocket", "path": "/v1/link"}, send) is None
    guard.accepted(LinkFrameLimits(4096, "p"), send)
    assert caplog.text.count("frame guard expects") == 1
