"""The node link's frame limits, applied while hypercorn buffers a frame.

hypercorn assembles every WebSocket message in full before the app sees it
(``hypercorn.protocol.ws_stream.WebsocketBuffer``), up to one
``websocket_max_message_size`` for every connection alike, and on a bigger
message it closes with 1009 without telling the app. A limit checked by the
app would come too late: an anonymous peer could make the edge hold a whole
frame (and a copy of it) before its hello is even read. So ``LinkFrameGuard``
wraps the ASGI app and, for each connection to the link path, puts a
``_GuardedBuffer`` in the stream: its limit starts at ``link.max_hello_bytes``
and the link handler raises it once the hello is accepted
(``EdgeCore.handle_link(on_open=...)``). A message over the limit is dropped
at once (its bytes freed), hypercorn closes with 1009, the guard logs it with
the peer's address, and the handler's pending receive is woken.

It also bounds the bytes a connection has queued between hypercorn and the
link handler (``link.max_queued_bytes``): complete messages waiting in
hypercorn's and quart's queues because the edge's reader is behind. Above
it the handler closes the link with ``CLOSE_RATE`` (4429).

The guard also declines permessage-deflate on the link: a compressed chunk is
inflated in full before any length check, so a 64 KiB frame could become
tens of MiB. The link carries msgpack over a LAN; it needs no compression.

This reaches into hypercorn's stream object (pinned in constraints.txt). If
the internals are not what it expects, it logs a warning once and the global
``websocket_max_message_size`` (the post-hello limit, ``serve_edge``) and the
session's own check (``EdgeSession``) still apply.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import trio
from hypercorn.protocol.ws_stream import FrameTooLargeError, WebsocketBuffer
from wsproto.events import Message

__all__ = ["LINK_LIMITS_SCOPE_KEY", "LinkFrameGuard", "LinkFrameLimits"]

log = logging.getLogger("iop.edge")

# Where the guard puts a connection's ``LinkFrameLimits`` in the ASGI scope.
LINK_LIMITS_SCOPE_KEY: Final = "iop.link_limits"


class LinkFrameLimits:
    """One link connection's frame limit, raised once the node is accepted.

    Attributes:
        limit: Largest message the connection may send now.
        peer: The peer's address, for the log.
        oversize: Bytes the connection had sent of the message that crossed
            the limit (None while it has not).
    """

    def __init__(self, limit: int, peer: str, max_queued: int = 0) -> None:
        self.limit = limit
        self.peer = peer
        self.max_queued = max_queued  # 0: not bounded here
        self.queued = 0
        self.overqueued = False
        self.authenticated = False
        self.oversize: int | None = None
        self._waiter: trio.CancelScope | None = None

    @property
    def tripped(self) -> bool:
        return self.oversize is not None or self.overqueued

    def delivered(self, size: int) -> None:
        """hypercorn handed a whole message of ``size`` bytes towards the app."""
        self.queued += size
        if self.max_queued and self.queued > self.max_queued and not self.tripped:
            self.overqueued = True
            log.warning(
                "node link from %s: %d bytes queued unread (limit %d): closing (4429)",
                self.peer,
                self.queued,
                self.max_queued,
            )
            if self._waiter is not None:
                self._waiter.cancel()

    def consumed(self, size: int) -> None:
        """The handler took a message of ``size`` bytes."""
        self.queued = max(0, self.queued - size)

    def open(self, limit: int) -> None:
        """The hello was accepted: allow frames up to ``limit``."""
        self.authenticated = True
        self.limit = limit

    def trip(self, size: int) -> None:
        """A message crossed the limit: log it and wake the handler."""
        if self.tripped:
            return
        self.oversize = size
        when = "after its hello" if self.authenticated else "before its hello"
        log.warning(
            "node link from %s: frame of more than %d bytes %s (limit %d): closing (1009)",
            self.peer,
            size,
            when,
            self.limit,
        )
        if self._waiter is not None:
            self._waiter.cancel()

    def waiting(self, scope: trio.CancelScope | None) -> None:
        """The scope of the handler's pending receive (cancelled on a trip)."""
        self._waiter = scope


class _GuardedBuffer(WebsocketBuffer):
    """hypercorn's message buffer with a per-connection, changeable limit."""

    def __init__(self, limits: LinkFrameLimits) -> None:
        super().__init__(limits.limit)
        self._limits = limits

    def extend(self, event: Message) -> None:  # type: ignore[type-arg]
        limits = self._limits
        if limits.oversize is not None:
            raise FrameTooLargeError()  # the close is under way: drop the rest
        self.max_length = limits.limit
        size = self.length + len(event.data)
        if size > self.max_length:
            # Checked before the bytes are copied in: nothing is kept.
            self.clear()
            limits.trip(size)
            raise FrameTooLargeError()
        super().extend(event)

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = super().to_message()
        self._limits.delivered(self.length)
        return message


class LinkFrameGuard:
    """ASGI middleware: per-connection frame limits on the link path.

    Args:
        app: The edge's ASGI app.
        path: The link's path (``/v1/link``).
        hello_limit: The limit before the hello (``link.max_hello_bytes``).
        max_queued: Bytes a connection may have queued unread (0: unbounded).
    """

    def __init__(self, app: Any, *, path: str, hello_limit: int, max_queued: int = 0) -> None:
        self._app = app
        self._path = path
        self._hello_limit = hello_limit
        self._max_queued = max_queued
        self._warned = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "websocket" and scope.get("path") == self._path:
            limits = self._install(scope, send)
            if limits is not None:
                scope = {**scope, LINK_LIMITS_SCOPE_KEY: limits}
        await self._app(scope, receive, send)

    def _install(self, scope: Any, send: Any) -> LinkFrameLimits | None:
        stream: Any = getattr(send, "__self__", None)
        handshake: Any = getattr(stream, "handshake", None)
        if not isinstance(getattr(stream, "buffer", None), WebsocketBuffer) or not hasattr(
            handshake, "extensions"
        ):
            if not self._warned:
                self._warned = True
                log.warning(
                    "node link: hypercorn's stream is not what the frame guard expects; "
                    "the pre-hello frame limit applies only after a frame is buffered"
                )
            return None
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "?"
        limits = LinkFrameLimits(self._hello_limit, peer, self._max_queued)
        stream.buffer = _GuardedBuffer(limits)
        handshake.extensions = None  # no permessage-deflate (see the module doc)
        return limits
