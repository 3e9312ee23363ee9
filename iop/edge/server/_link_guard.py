"""The node link's hold on hypercorn's WebSocket stream: its frame limits.

hypercorn assembles every WebSocket message in full before the app sees it
(``hypercorn.protocol.ws_stream.WebsocketBuffer``), up to one
``websocket_max_message_size`` for every connection alike, and on a bigger
message it closes with 1009 without telling the app. A limit checked by the
app would come too late: an anonymous peer could make the edge hold a whole
frame (and a copy of it) before its hello is even read. So the link's ASGI
handler (``iop.edge.server._link_asgi``) has ``LinkFrameGuard.install`` put a
``_GuardedBuffer`` in each link connection's stream before it accepts: its
limit starts at ``link.max_hello_bytes`` and the link handler raises it once
the hello is accepted (``EdgeCore.handle_link(on_open=...)``). A message
over the limit is dropped at once (its bytes freed), hypercorn closes with
1009, the guard logs it with the peer's address, and the handler's pending
receive is woken.

It also bounds the bytes a connection has queued between hypercorn and the
link handler (``link.max_queued_bytes``): complete messages waiting in
hypercorn's queue to the app (``max_app_queue_size``, 10 messages) because
the edge's reader is behind. Above it the handler closes the link with
``CLOSE_RATE`` (4429).

The guard also declines permessage-deflate on the link: a compressed chunk is
inflated in full before any length check, so a 64 KiB frame could become
tens of MiB. The link carries msgpack over a LAN; it needs no compression.

Once the connection is accepted, ``LinkFrameGuard.accepted`` notes the
peer's close frame as wsproto parses it: hypercorn's
``websocket.disconnect`` says only 1000 (we closed first) or 1006, never the
code and reason the node sent (a draining node's 1001 "node draining").

This reaches into hypercorn's stream object (pinned in constraints.txt). If
the internals are not what it expects, it logs a warning once and the global
``websocket_max_message_size`` (the post-hello limit, ``serve_edge``) and the
session's own check (``EdgeSession``) still apply; a disconnect then carries
hypercorn's code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import trio
from hypercorn.protocol.ws_stream import FrameTooLargeError, WebsocketBuffer
from wsproto.events import CloseConnection, Event, Message

__all__ = ["LinkFrameGuard", "LinkFrameLimits"]

log = logging.getLogger("iop.edge")


class LinkFrameLimits:
    """One link connection's frame limit, raised once the node is accepted.

    Attributes:
        limit: Largest message the connection may send now.
        peer: The peer's address, for the log.
        oversize: Bytes the connection had sent of the message that crossed
            the limit (None while it has not).
        peer_close: The code and reason of the peer's close frame, once
            wsproto has parsed one (None before, or with no close frame).
    """

    def __init__(self, limit: int, peer: str, max_queued: int = 0) -> None:
        self.limit = limit
        self.peer = peer
        self.max_queued = max_queued  # 0: not bounded here
        self.queued = 0
        self.overqueued = False
        self.authenticated = False
        self.oversize: int | None = None
        self.peer_close: tuple[int, str] | None = None
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
    """Fits a link connection's hypercorn stream with the link's limits.

    Args:
        hello_limit: The limit before the hello (``link.max_hello_bytes``).
        max_queued: Bytes a connection may have queued unread (0: unbounded).
    """

    def __init__(self, *, hello_limit: int, max_queued: int = 0) -> None:
        self.hello_limit = hello_limit
        self.max_queued = max_queued
        self._warned = False

    def install(self, scope: Any, send: Any) -> LinkFrameLimits | None:
        """Before ``websocket.accept``: the connection's limits, or None when
        ``send`` is not hypercorn's stream as expected (warned once).

        Args:
            scope: The connection's ASGI scope (its ``client`` names the peer).
            send: The ASGI ``send`` hypercorn gave the app: its stream's
                ``app_send``.
        """
        stream: Any = getattr(send, "__self__", None)
        handshake: Any = getattr(stream, "handshake", None)
        if not isinstance(getattr(stream, "buffer", None), WebsocketBuffer) or not hasattr(
            handshake, "extensions"
        ):
            self._warn()
            return None
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "?"
        limits = LinkFrameLimits(self.hello_limit, peer, self.max_queued)
        stream.buffer = _GuardedBuffer(limits)
        handshake.extensions = None  # no permessage-deflate (see the module doc)
        return limits

    def accepted(self, limits: LinkFrameLimits, send: Any) -> None:
        """After ``websocket.accept``: note the peer's close frame in ``limits``."""
        connection: Any = getattr(getattr(send, "__self__", None), "connection", None)
        events = getattr(connection, "events", None)
        if not callable(events):
            self._warn()
            return

        def noting_close() -> Iterator[Event]:
            for event in events():
                if isinstance(event, CloseConnection):
                    limits.peer_close = (event.code, event.reason or "")
                yield event

        # hypercorn iterates ``self.connection.events()`` for every read.
        connection.events = noting_close

    def _warn(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "node link: hypercorn's stream is not what the frame guard expects; "
                "the pre-hello frame limit applies only after a frame is buffered"
            )
