"""An in-memory link for driving the edge and node link code in one trio run.

``memory_link_pair()`` returns two connected ``FrameChannel``s. Frames travel
through bounded memory channels (a stand-in for socket buffers), a close on
one side is seen by the other as ``LinkClosed`` with the same code and
reason, and ``freeze()`` simulates a peer that stopped (SIGSTOP, a network
partition): nothing is delivered any more, in either direction, and nothing
is closed, so only a heartbeat deadline can notice. Combined with trio's
``MockClock`` this tests liveness and flow control in virtual time.
"""

from __future__ import annotations

from typing import Final

import trio

from iop.protocol import CLOSE_NORMAL, LinkClosed

__all__ = ["MEMORY_LINK_BUFFER", "MemoryFrameChannel", "memory_link_pair"]

# Frames in flight per direction before the sender blocks (a socket buffer).
MEMORY_LINK_BUFFER: Final = 64


class _Shared:
    def __init__(self) -> None:
        self.close_code: int | None = None
        self.close_reason = ""
        self.frozen = False
        self.closed = trio.Event()
        self.frames = [0, 0]


class MemoryFrameChannel:
    """One end of an in-memory link (see ``memory_link_pair``)."""

    def __init__(
        self,
        side: int,
        shared: _Shared,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
    ) -> None:
        self._side = side
        self._shared = shared
        self._send = send
        self._receive = receive

    def _closed_error(self) -> LinkClosed:
        s = self._shared
        return LinkClosed(
            f"link closed ({s.close_code} {s.close_reason})".strip(),
            close_code=s.close_code,
            reason=s.close_reason,
        )

    @property
    def frames_sent(self) -> int:
        return self._shared.frames[self._side]

    async def send(self, frame: bytes) -> None:
        if self._shared.closed.is_set():
            raise self._closed_error()
        if self._shared.frozen:
            await trio.lowlevel.checkpoint()
            return  # swallowed by the partition
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._closed_error() from None
        self._shared.frames[self._side] += 1

    async def receive(self) -> bytes:
        if self._shared.frozen:
            await self._shared.closed.wait()
            raise self._closed_error()
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed_error() from None

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        s = self._shared
        if not s.closed.is_set():
            s.close_code, s.close_reason = code, reason
            s.closed.set()
        self._send.close()
        self._receive.close()
        await trio.lowlevel.checkpoint()

    def freeze(self) -> None:
        """Stop all delivery in both directions without closing anything."""
        self._shared.frozen = True

    @property
    def close_code(self) -> int | None:
        return self._shared.close_code

    @property
    def close_reason(self) -> str:
        return self._shared.close_reason


def memory_link_pair(
    buffer: int = MEMORY_LINK_BUFFER,
) -> tuple[MemoryFrameChannel, MemoryFrameChannel]:
    """Two connected in-memory frame channels (edge side, node side)."""
    shared = _Shared()
    a_send, b_receive = trio.open_memory_channel[bytes](buffer)
    b_send, a_receive = trio.open_memory_channel[bytes](buffer)
    return (
        MemoryFrameChannel(0, shared, a_send, a_receive),
        MemoryFrameChannel(1, shared, b_send, b_receive),
    )
