"""An in-process link: two ``FrameChannel`` ends joined by bounded memory channels.

``iop up`` runs an edge and its own node in one trio run. Its node's link
carries the same frames as a remote node's (the same sans-IO sessions in
``iop.protocol``, the same handshake, token check, credit and frame limits:
the sessions enforce those, not the transport) over a pair of bounded memory
channels instead of a loopback WebSocket: no masking, no framing, no socket
calls (docs/architecture.md, "iop up").

It behaves as a socket would where the link code can tell:

==========================================  =====================================
one end                                     the other end sees
==========================================  =====================================
sends a frame                               the frame, in order
``aclose(code, reason)``                    the frames sent before, then
                                            ``LinkClosed`` with that code and reason;
                                            its sends raise ``LinkClosed`` at once
``abort()`` (its owner left, no close)      ``LinkClosed`` 1006, as a dropped TCP
                                            connection: a link loss
takes no frame for ``send_timeout_s``       the sender's ``LinkClosed`` 1006 (a
                                            stalled write; both ends closed)
==========================================  =====================================

A full channel blocks the sender, as a full socket buffer does: that is the
link's own flow control (``iop.runtime._link``, "Backpressure"), bounded by
``send_timeout_s``. A receive needs no deadline of its own: the link driver
reads under the session's liveness deadline.
"""

from __future__ import annotations

from typing import Final

import trio

from iop.protocol import CLOSE_NORMAL, LinkClosed

__all__ = ["CLOSE_DROPPED", "LOCAL_LINK_FRAMES", "LocalFrameChannel", "local_link_pair"]

# Frames in flight per direction before the sender waits. A frame already
# batches every run's events the peer accepts (``iop.protocol._session``,
# "Batching"), so a few frames keep both ends busy; hypercorn queues 10
# messages per WebSocket on the way in (``iop.edge.server._link_asgi``).
# Memory is bounded by this times the receiver's frame limit.
LOCAL_LINK_FRAMES: Final = 16
# RFC 6455 §7.4.1: "closed abnormally, without a close frame": what the
# peer of an end that went away without closing sees, as over a socket.
CLOSE_DROPPED: Final = 1006


class _Shared:
    """The state both ends see: the first close's code and reason."""

    def __init__(self) -> None:
        self.close_code: int | None = None
        self.close_reason = ""

    def closed_error(self) -> LinkClosed:
        said = f"{self.close_code} {self.close_reason}".strip()
        return LinkClosed(
            f"in-process link closed ({said})", close_code=self.close_code, reason=self.close_reason
        )


class LocalFrameChannel:
    """One end of an in-process link (``local_link_pair``); a
    ``NowaitFrameChannel``, so the link reader takes queued frames at once."""

    def __init__(
        self,
        shared: _Shared,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        send_timeout_s: float,
    ) -> None:
        self._shared = shared
        self._send = send
        self._receive = receive
        self._send_timeout_s = send_timeout_s

    @property
    def close_code(self) -> int | None:
        """The link's close code once either end closed it, else None."""
        return self._shared.close_code

    async def send(self, frame: bytes) -> None:
        """Send one frame, waiting while the peer has ``LOCAL_LINK_FRAMES`` unread.

        Raises:
            LinkClosed: The link is closed, or the peer took no frame for
                ``send_timeout_s`` (then the link is closed 1006).
        """
        if self._shared.close_code is not None:
            raise self._shared.closed_error()
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            try:
                # What MemorySendChannel.send does when there is room, without
                # the deadline's scope a frame rarely needs (the heap entry
                # of a deadline costs microseconds per frame).
                self._send.send_nowait(frame)
            except trio.WouldBlock:
                with trio.move_on_after(self._send_timeout_s) as waited:
                    await self._send.send(frame)
                if waited.cancelled_caught:
                    self._close(CLOSE_DROPPED, f"peer took no frame for {self._send_timeout_s:g}s")
                    raise self._shared.closed_error() from None
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._shared.closed_error() from None
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self) -> bytes:
        """The next frame.

        Raises:
            LinkClosed: The link closed (the first close's code and reason),
                once the frames sent before it are taken.
        """
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._shared.closed_error() from None

    def receive_nowait(self) -> bytes:
        """The next frame if one has arrived, without a schedule point (the
        link reader's ``NowaitFrameChannel``), else ``trio.WouldBlock``.

        Raises:
            LinkClosed: As ``receive``.
        """
        try:
            return self._receive.receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._shared.closed_error() from None

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close the link (idempotent): the peer sees ``code`` and ``reason``."""
        self._close(code, reason)
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """Close the link as a dropped connection (1006), unless it is closed."""
        self._close(CLOSE_DROPPED, "the in-process end went away")

    def _close(self, code: int, reason: str) -> None:
        shared = self._shared
        if shared.close_code is None:
            shared.close_code, shared.close_reason = code, reason
        # Our sending end: the peer reads what is queued, then EndOfChannel.
        # Our receiving end: the peer's waiting or next send is refused.
        self._send.close()
        self._receive.close()


def local_link_pair(
    *, send_timeout_s: float, capacity: int = LOCAL_LINK_FRAMES
) -> tuple[LocalFrameChannel, LocalFrameChannel]:
    """Two joined ends (edge's, node's), ``capacity`` frames each way.

    Args:
        send_timeout_s: How long a send waits for the peer to take a frame.
        capacity: Frames queued per direction before a send waits.
    """
    shared = _Shared()
    to_node, node_receives = trio.open_memory_channel[bytes](capacity)
    to_edge, edge_receives = trio.open_memory_channel[bytes](capacity)
    return (
        LocalFrameChannel(shared, to_node, edge_receives, send_timeout_s),
        LocalFrameChannel(shared, to_edge, node_receives, send_timeout_s),
    )
