"""The production ``FrameChannel``: a WebSocket client on trio-websocket.

One binary WebSocket message carries one link frame (``iop.protocol``). Two
rough edges of trio-websocket 0.12.2 are handled here (docs/architecture.md,
"Facts about our dependencies: trio-websocket"):

* ``disconnect_timeout`` defaults to 60 s: a frozen edge would keep the close
  handshake (and the node's reconnect) waiting a minute. We use 2 s.
* When the *server* closes, the client never closes its TCP stream (its
  ``aclose`` returns early once a close reason is known), which leaks a socket
  (a ``ResourceWarning``). ``aclose`` here always closes the stream itself.

Liveness is not this module's job: the link driver (``iop.node._agent``)
applies the application heartbeat deadline, which is what detects a frozen
or partitioned edge.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from iop.errors import LinkAuthError, LinkError, LinkProtocolError
from iop.protocol import CLOSE_NORMAL, CLOSE_PROTOCOL, LinkClosed

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DISCONNECT_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "WebSocketFrameChannel",
    "open_ws_link",
]

log = logging.getLogger("iop.node.ws")

# TCP connect + WebSocket upgrade. An edge that does not answer within this
# is treated as down and retried with backoff.
DEFAULT_CONNECT_TIMEOUT_S: Final = 10.0
# Close handshake; trio-websocket's default is 60 s (docs/architecture.md,
# "Facts about our dependencies: trio-websocket").
DISCONNECT_TIMEOUT_S: Final = 2.0
# The default of ``open_ws_link(max_message_size=...)``; the agent passes
# ``node.max_frame_bytes`` (told to the edge in the hello, which sends
# nothing bigger). trio-websocket's 1 MiB default would close the link
# (1009) on a legitimate large request.
MAX_FRAME_BYTES: Final = 32 * 1024 * 1024


def _link_closed(exc: ConnectionClosed, url: str) -> LinkClosed:
    reason = exc.reason
    code = None if reason is None else reason.code
    text = "" if reason is None or reason.reason is None else reason.reason
    return LinkClosed(f"link to {url} closed ({code} {text})".strip(), close_code=code, reason=text)


class WebSocketFrameChannel:
    """A ``FrameChannel`` over an open trio-websocket client connection.

    Args:
        ws: The connection (owned by ``open_ws_link``).
        url: The edge's URL, for messages.
    """

    def __init__(self, ws: WebSocketConnection, url: str) -> None:
        self._ws = ws
        self.url = url

    async def send(self, frame: bytes) -> None:
        """Send one frame as a binary message.

        Raises:
            LinkClosed: The connection is closed.
        """
        try:
            await self._ws.send_message(frame)
        except ConnectionClosed as exc:
            raise _link_closed(exc, self.url) from None

    async def receive(self) -> bytes:
        """The next frame.

        Raises:
            LinkClosed: The connection closed (with the peer's code/reason).
            LinkProtocolError: The edge sent a text message (the link is
                closed with ``CLOSE_PROTOCOL``).
        """
        try:
            message = await self._ws.get_message()
        except ConnectionClosed as exc:
            raise _link_closed(exc, self.url) from None
        if isinstance(message, str):
            await self.aclose(CLOSE_PROTOCOL, "text frames are not part of the link protocol")
            raise LinkProtocolError(f"edge {self.url} sent a text frame")
        return message

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close the connection and its TCP stream (idempotent)."""
        with trio.move_on_after(DISCONNECT_TIMEOUT_S):
            try:
                await self._ws.aclose(code, reason or None)
            finally:
                # trio-websocket 0.12.2 leaves the stream open when the server
                # closed first. Closing a trio stream twice is harmless, and a
                # cancelled aclose still releases it (trio's AsyncResource).
                await self._ws._stream.aclose()

    @property
    def closed(self) -> bool:
        return self._ws.closed is not None


@asynccontextmanager
async def open_ws_link(
    url: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_message_size: int = MAX_FRAME_BYTES,
) -> AsyncIterator[WebSocketFrameChannel]:
    """Connect to an edge's link endpoint; close the connection on exit.

    Args:
        url: ``ws://`` or ``wss://`` URL of the edge's link endpoint.
        connect_timeout_s: Deadline of the TCP connect and WebSocket upgrade.
        max_message_size: Largest frame accepted (1009 above).

    Raises:
        LinkAuthError: The edge refused the upgrade with HTTP 401/403.
        LinkError: The edge could not be reached or refused the upgrade
            (the message names the URL).
    """
    try:
        async with open_websocket_url(
            url,
            connect_timeout=connect_timeout_s,
            disconnect_timeout=DISCONNECT_TIMEOUT_S,
            max_message_size=max_message_size,
        ) as ws:
            chan = WebSocketFrameChannel(ws, url)
            try:
                yield chan
            finally:
                # Shielded: leaving by cancellation must still release the
                # socket; bounded by DISCONNECT_TIMEOUT_S inside aclose.
                with trio.CancelScope(shield=True):
                    await chan.aclose()
    except ConnectionRejected as exc:
        if exc.status_code in (401, 403):
            raise LinkAuthError(
                f"edge {url} refused the link upgrade: HTTP {exc.status_code}"
            ) from exc
        raise LinkError(f"edge {url} refused the link upgrade: HTTP {exc.status_code}") from exc
    except HandshakeError as exc:
        cause = exc.__cause__ or exc
        detail = str(cause) or type(cause).__name__
        raise LinkError(f"cannot connect to edge {url}: {detail}") from exc
