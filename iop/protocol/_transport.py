"""What a link driver needs from a transport: whole frames, in order.

The edge and node drivers are written against ``FrameChannel``; production
uses WebSockets (the node's own client, ``iop.node._ws``; hypercorn on the edge) and the
tests use ``iop.testing.memory_link_pair`` with virtual time. This module only
declares the interface (no trio import: the protocol package stays sans-IO).
"""

from __future__ import annotations

from typing import Final, Protocol

from iop.errors import LinkClosed, LinkLimitError, LinkProtocolError

__all__ = [
    "CLOSE_BAD_TOKEN",
    "CLOSE_GOING_AWAY",
    "CLOSE_HEARTBEAT",
    "CLOSE_ID_IN_USE",
    "CLOSE_NORMAL",
    "CLOSE_PROTOCOL",
    "CLOSE_RATE",
    "CLOSE_REPLACED",
    "CLOSE_TOO_BIG",
    "FrameChannel",
    "LinkClosed",
    "close_code",
    "close_reason",
]

# WebSocket close codes used on the link (4000-4999 are application codes).
CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001  # the peer is shutting down
CLOSE_TOO_BIG: Final = 1009  # a frame above the receiver's size limit (RFC 6455)
CLOSE_PROTOCOL: Final = 4400  # a frame broke the protocol
CLOSE_BAD_TOKEN: Final = 4401  # bad token or protocol version: do not retry blindly
CLOSE_HEARTBEAT: Final = 4408  # the peer was silent past the heartbeat deadline
CLOSE_REPLACED: Final = 4409  # the same node id connected again, the old link was dead
CLOSE_ID_IN_USE: Final = 4410  # refused: a live link already serves this node id
CLOSE_RATE: Final = 4429  # the peer sent more than the link's message rate allows


def close_code(exc: LinkProtocolError) -> int:
    """The close code for a protocol error: a crossed limit carries its own."""
    return exc.close_code if isinstance(exc, LinkLimitError) else CLOSE_PROTOCOL


def close_reason(text: str) -> str:
    """``text`` cut to fit a close frame."""
    # A WebSocket close reason is at most 123 bytes of UTF-8 (RFC 6455 §5.5).
    data = text.encode()
    return text if len(data) <= 120 else data[:120].decode(errors="ignore")


class FrameChannel(Protocol):
    """A message-oriented, ordered, bidirectional link."""

    async def send(self, frame: bytes) -> None:
        """Send one frame. Raises ``LinkClosed`` if the link is closed."""
        ...

    async def receive(self) -> bytes:
        """The next frame. Raises ``LinkClosed`` when the link closes."""
        ...

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close the link (idempotent); the peer sees ``code`` and ``reason``."""
        ...
