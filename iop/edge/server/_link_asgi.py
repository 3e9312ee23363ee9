"""The node link's WebSocket, served at the ASGI level, beside the quart app.

hypercorn runs ``EdgeASGI``: a WebSocket to the link path (``/v1/link``) is
served here by ``LinkEndpoint``, HTTP (and the lifespan) goes to the quart
app (``iop.edge.routes``). A link frame takes one hop between the socket and
the link reader: hypercorn's queue to the app (``max_app_queue_size``, 10
messages), which ``AsgiFrameChannel.receive`` reads. Served by quart, each
frame also went through a task that moved it into quart's own queue, a
signal per message each way, and a websocket context lookup per call.

A connection to the link path, step by step (ASGI's WebSocket spec,
https://asgi.readthedocs.io/en/latest/specs/www.html#websocket):

1. ``websocket.connect``: the frame guard (``LinkFrameGuard.install``) puts
   the pre-hello frame limit and the queued-bytes bound in hypercorn's
   stream and declines permessage-deflate;
2. ``websocket.accept``; the guard notes the peer's close frame from now on;
3. ``EdgeCore.handle_link`` serves the channel, raising the frame limit
   through ``on_open`` once the hello is accepted, until the link ends.

How a link ends, as the handler sees it:

==============================================  =================================
the node closes (close frame)                   ``LinkClosed`` with its code and reason
the TCP connection is gone, no close frame      ``LinkClosed`` 1006
a text frame                                    ``LinkProtocolError`` (the handler closes 4400)
a frame over the limit (hypercorn sent 1009)    ``LinkClosed`` 1009, at once
more than ``link.max_queued_bytes`` unread      ``LinkLimitError`` 4429 (the handler closes)
``aclose(code, reason)``                        the node gets ``code`` and ``reason``
==============================================  =================================

A WebSocket to any other path is refused with 404 before the upgrade (in
OpenAI's error body, through ASGI's ``websocket.http.response``); so is the
link path on a listener that does not serve the link (``link.port`` set:
the API port then serves no link). A listener without an HTTP app (the
separate link port) answers every HTTP request with 404.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol, cast

import trio

from iop.api import CHAT
from iop.edge.server._asgi_queue import app_queue
from iop.edge.server._link_guard import LinkFrameGuard, LinkFrameLimits
from iop.errors import ErrorCode, LinkClosed, LinkLimitError, LinkProtocolError
from iop.protocol import CLOSE_NORMAL, CLOSE_RATE, CLOSE_TOO_BIG, FrameChannel

__all__ = ["LINK_PATH", "AsgiFrameChannel", "EdgeASGI", "LinkEndpoint", "LinkHandler"]

log = logging.getLogger("iop.edge")

# The node link's WebSocket endpoint.
LINK_PATH: Final = "/v1/link"
# RFC 6455 §7.4.1: "no status code was actually present" (ASGI's default).
_NO_STATUS: Final = 1005

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ReceiveNowait = Callable[[], dict[str, Any]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # quart types its own ASGI dicts


class LinkHandler(Protocol):
    """What serves one link connection: ``EdgeCore.handle_link``."""

    async def __call__(
        self,
        chan: FrameChannel,
        peer: str = "",
        *,
        on_open: Callable[[int], None] | None = None,
    ) -> None: ...


class AsgiFrameChannel:
    """``FrameChannel`` over an accepted ASGI WebSocket (binary frames only).

    Args:
        receive: The connection's ASGI ``receive``.
        send: Its ASGI ``send``.
        limits: The frame guard's state for this connection (None when the
            guard could not install itself): a trip wakes ``receive``.
        receive_nowait: Takes a message already in the connection's queue
            (``AppQueue.receive_nowait``), else raises ``trio.WouldBlock``;
            None: ``receive_nowait`` never has one.
    """

    def __init__(
        self,
        receive: Receive,
        send: Send,
        limits: LinkFrameLimits | None,
        *,
        receive_nowait: ReceiveNowait | None = None,
    ) -> None:
        self._receive = receive
        self._receive_nowait = receive_nowait
        self._send = send
        self._limits = limits
        self._closed = False  # our close went out
        self._gone: LinkClosed | None = None  # the peer's end, once seen

    async def send(self, frame: bytes) -> None:
        """Send one binary frame.

        Raises:
            LinkClosed: The link was closed, by us or by the peer.
        """
        if self._gone is not None:
            raise _again(self._gone)
        if self._closed:
            raise LinkClosed("link closed")
        # hypercorn drops a send on a stream the peer already closed; the
        # reader learns of it from its next ``receive``.
        await self._send({"type": "websocket.send", "bytes": frame})

    async def receive(self) -> bytes:
        """The next frame.

        Raises:
            LinkClosed: The peer closed or went away (its close code and
                reason, else 1006), or sent a frame over the limit (1009).
            LinkLimitError: Too many bytes queued unread (4429).
            LinkProtocolError: A text frame.
        """
        if self._gone is not None:
            raise _again(self._gone)
        limits = self._limits
        message = await (self._receive() if limits is None else self._receive_guarded(limits))
        return self._frame(message, limits)

    def receive_nowait(self) -> bytes:
        """The next frame if hypercorn has already queued it, with every check
        ``receive`` makes (the guard's accounting and limits, the peer's close).

        Raises:
            trio.WouldBlock: None is queued, or the guard has tripped
                (``receive`` then raises its error at once).
            LinkClosed, LinkLimitError, LinkProtocolError: As ``receive``.
        """
        if self._gone is not None:
            raise _again(self._gone)
        nowait, limits = self._receive_nowait, self._limits
        if nowait is None or (limits is not None and limits.tripped):
            raise trio.WouldBlock
        message = nowait()
        if limits is not None:
            _account(message, limits)
        return self._frame(message, limits)

    def _frame(self, message: dict[str, Any], limits: LinkFrameLimits | None) -> bytes:
        kind = message["type"]
        if kind == "websocket.receive":
            data = message.get("bytes")
            if data is None:
                raise LinkProtocolError("text frame on the node link (the link is binary frames)")
            return bytes(data)
        if kind == "websocket.disconnect":
            code = int(message.get("code", _NO_STATUS))
            reason = str(message.get("reason") or "")
            if limits is not None and limits.peer_close is not None:
                code, reason = limits.peer_close
            said = f"{code} {reason}" if reason else str(code)
            self._gone = LinkClosed(
                f"link closed by the peer ({said})", close_code=code, reason=reason
            )
            raise _again(self._gone)
        raise LinkClosed(f"unexpected ASGI message on the link: {kind!r}")

    async def _receive_guarded(self, limits: LinkFrameLimits) -> dict[str, Any]:
        message: dict[str, Any] | None = None
        with trio.CancelScope() as scope:
            if limits.tripped:
                scope.cancel()
            limits.waiting(scope)
            try:
                message = await self._receive()
            finally:
                limits.waiting(None)
        if message is None:  # the guard tripped while we waited
            _check(limits)
            raise LinkClosed("link closed")  # pragma: no cover - only a trip cancels the scope
        _account(message, limits)
        return message

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Send our close frame (idempotent; nothing to do once the peer is gone)."""
        if self._closed:
            return
        self._closed = True
        if self._gone is not None:
            return
        try:
            await self._send({"type": "websocket.close", "code": code, "reason": reason})
        except Exception as exc:  # the socket may already be gone
            log.debug("closing node websocket: %r", exc)


def _account(message: dict[str, Any], limits: LinkFrameLimits) -> None:
    """The handler took ``message``: the guard's books, then its limits."""
    if message["type"] == "websocket.receive":
        limits.consumed(len(message.get("bytes") or message.get("text") or ""))
    _check(limits)


def _check(limits: LinkFrameLimits) -> None:
    """Raise what a tripped guard means for the handler."""
    if limits.oversize is not None:
        raise LinkClosed(
            f"frame of more than {limits.oversize} bytes (limit {limits.limit})",
            close_code=CLOSE_TOO_BIG,
            reason="frame too big",
        )
    if limits.overqueued:
        raise LinkLimitError(
            f"{limits.queued} bytes queued unread (limit {limits.max_queued})",
            close_code=CLOSE_RATE,
        )


def _again(closed: LinkClosed) -> LinkClosed:
    """A fresh ``LinkClosed`` like ``closed`` (an exception raised twice keeps
    growing its traceback)."""
    return LinkClosed(str(closed), close_code=closed.close_code, reason=closed.reason)


class LinkEndpoint:
    """Serves WebSocket connections to the link path with ``handle_link``.

    Args:
        handle_link: Serves one connection (``EdgeCore.handle_link``).
        hello_limit: The frame limit before the hello (``link.max_hello_bytes``).
        max_queued: Bytes a connection may have queued unread
            (``EdgeConfig.link_queued_bytes``; 0: unbounded).
    """

    def __init__(self, handle_link: LinkHandler, *, hello_limit: int, max_queued: int) -> None:
        self._handle_link = handle_link
        self.guard = LinkFrameGuard(hello_limit=hello_limit, max_queued=max_queued)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One connection, from ``websocket.connect`` until the link ends."""
        first = await receive()
        if first["type"] != "websocket.connect":
            return  # gone before the handshake (websocket.disconnect)
        limits = self.guard.install(scope, send)
        await send({"type": "websocket.accept"})
        if limits is not None:
            self.guard.accepted(limits, send)
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "?"
        # The edge's hypercorn queues a link's messages in an ``AppQueue``
        # (``EdgeTaskGroup.spawn_app``): the reader takes what has arrived
        # without waiting (``iop.runtime._link``, ``MAX_FRAMES_PER_WAKE``).
        queue = app_queue(scope)
        await self._handle_link(
            AsgiFrameChannel(
                receive,
                send,
                limits,
                receive_nowait=None
                if queue is None
                else cast("ReceiveNowait", queue.receive_nowait),
            ),
            peer=peer,
            on_open=None if limits is None else limits.open,
        )


class EdgeASGI:
    """The app hypercorn serves on one listener of the edge.

    Args:
        http: The HTTP app (quart's, with the lifespan), or None on a
            listener that serves only the link (HTTP gets 404 there).
        link: Serves the link path, or None on a listener that does not
            (the link path is refused like any other WebSocket).
        elsewhere: Added to the 404 of a refused WebSocket, to say where
            the link is served instead.
    """

    def __init__(
        self,
        *,
        http: ASGIApp | None,
        link: LinkEndpoint | None,
        elsewhere: str = "",
    ) -> None:
        self._http = http
        self._link = link
        self._elsewhere = elsewhere

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            if self._link is not None and scope.get("path") == LINK_PATH:
                await self._link.serve(scope, receive, send)
            else:
                await self._refuse_websocket(scope, receive, send)
        elif self._http is not None:
            await self._http(scope, receive, send)
        elif kind == "http":
            await _not_found(send, f"Unknown request URL: {scope.get('method')} {scope['path']}.")
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _refuse_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        if "websocket.http.response" not in scope.get("extensions", {}):
            # ASGI: a close before the accept is an HTTP 403 (hypercorn's).
            await send({"type": "websocket.close", "code": CLOSE_NORMAL})
            return
        message = f"Unknown WebSocket URL: {scope['path']}.{self._elsewhere}"
        await _not_found(send, message, prefix="websocket.")


async def _not_found(send: Send, message: str, *, prefix: str = "") -> None:
    """A 404 in OpenAI's error body; the connection closes after it (the
    request's body, if any, is never read)."""
    status, body = CHAT.error_body(404, message, code=ErrorCode.NOT_FOUND)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": f"{prefix}http.response.start", "status": status, "headers": headers})
    await send({"type": f"{prefix}http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    """The lifespan of a listener with no HTTP app: nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
