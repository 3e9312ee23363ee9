"""Slow clients: a write-stall deadline on every connection of the edge.

A client that stops reading fills its TCP window; the edge's write then
blocks. Two things must end, and both are bounded by
``server.write_stall_timeout_s``:

* **the run**: its sink waits on a consumer that takes nothing. The runtime
  cancels it with ``slow_client`` (``RunSupervisor.start_run``'s
  ``write_stall_timeout_s``), which frees its node slot and closes the
  backend's connection, whatever the API surface.
* **the connection**: the response generator is stuck inside hypercorn's
  socket write, which hypercorn runs in a *shielded* scope
  (``TCPServer.protocol_send``): no cancellation from the app can end it,
  and an ASGI wrapper around ``send`` cannot either. Only closing the socket
  does. So the edge wraps every accepted stream (``StallGuard.listener``):
  its ``send_all`` gives each ``send`` syscall (each bit of progress) the
  deadline; a client that accepts no byte for that long has its connection
  marked stalled and closed. Hypercorn sees a broken stream, the request's
  ASGI app gets ``http.disconnect``, and the response generator is
  cancelled.

Either can notice first (the socket stalls before the run's channel fills,
but how soon the channel fills depends on the backend's speed), so the reason
is shared: the ASGI wrapper (``StallGuard.asgi``) puts the connection's
``ConnectionStall`` in a context variable for the request, and the edge's
"client went away" path asks ``client_gone_reason()``: ``slow_client`` once
the connection was marked stalled, ``client_disconnect`` otherwise. A run's
first cancel reason wins, so the run ends ``slow_client`` either way.

``serve_guarded`` is the edge's hypercorn server
(``iop.edge.server._hypercorn``) with the listeners wrapped, TLS on top of
the guard when the edge has a certificate (``iop.edge.server._tls``).
"""

from __future__ import annotations

import contextvars
import errno
import fcntl
import logging
import os
import sys
import termios
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from iop.edge.server._http1 import EdgeHypercornConfig
from iop.edge.server._hypercorn import serve_edge_listeners
from iop.events import CancelReason
from iop.timeline import StallKind, Timeline

__all__ = [
    "ConnectionStall",
    "StallGuard",
    "client_gone_reason",
    "current_connection",
    "serve_guarded",
]

log = logging.getLogger("iop.edge.http")

# How often a blocked write checks whether the peer made progress. A quarter
# of the deadline (so a stall is seen within 25 % of it), at most a second.
PROGRESS_POLL_MAX_S: Final = 1.0

_Peer = tuple[Any, ...]
_ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class ConnectionStall:
    """What the guard knows about one connection."""

    __slots__ = ("_guard", "_socket", "peer", "stalled", "timeline", "timeout_s")

    def __init__(
        self,
        peer: _Peer | None,
        timeout_s: float,
        guard: StallGuard | None = None,
        sock: trio.socket.SocketType | None = None,
    ) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        self.stalled = False
        self._guard = guard
        self._socket = sock
        # The run streaming on the connection now: its write stalls go there.
        self.timeline: Timeline | None = None

    def cut_off(self) -> None:
        """Close the connection of a client found stalled elsewhere (its run).

        The run's own stall bound (``write_stall_timeout_s`` on the run's
        sink) can end the run before this connection's write has been
        blocked for the deadline: the run is over as ``slow_client``, and the
        client must lose its connection too, not get it back if it reads
        again. Closing the socket (trio's ``close`` wakes a task blocked on
        it with ``ClosedResourceError``) ends hypercorn's shielded write.
        Idempotent; it never blocks."""
        if self.stalled or self._socket is None:
            return
        if self._guard is not None:
            self._guard._stalled(self)
            self._guard._closed(self)
        else:
            self.stalled = True
        self._socket.close()


_CURRENT: Final = contextvars.ContextVar[ConnectionStall | None](
    "iop_connection_stall", default=None
)


def current_connection() -> ConnectionStall | None:
    """The current request's connection, when the guard is on."""
    return _CURRENT.get()


def client_gone_reason() -> tuple[CancelReason, str]:
    """Why the current request's client went away: stalled, or disconnected."""
    state = _CURRENT.get()
    if state is not None and state.stalled:
        return (
            CancelReason.SLOW_CLIENT,
            f"the client accepted no data for write_stall_timeout_s={state.timeout_s:g}",
        )
    return CancelReason.CLIENT_DISCONNECT, "client disconnected"


class StallGuard:
    """The edge's write-stall deadline, on its listeners and its ASGI app.

    Args:
        timeout_s: Longest time a connection may accept no byte of a pending
            write; None disables the guard (streams are not wrapped).
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        # Open connections by peer address, so that a request (whose ASGI
        # scope names its peer) finds its connection's state.
        self._connections: dict[_Peer, ConnectionStall] = {}
        self.stalled_total = 0

    def listener(self, inner: trio.SocketListener) -> trio.abc.Listener[Any]:
        if self.timeout_s is None:
            return inner
        return _GuardedListener(inner, self)

    def asgi(self, app: _ASGIApp) -> _ASGIApp:
        """``app`` with its connection's state in ``client_gone_reason``'s reach."""

        async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            client = scope.get("client")
            state = self._connections.get(tuple(client)) if client else None
            token = _CURRENT.set(state)
            try:
                await app(scope, receive, send)
            finally:
                _CURRENT.reset(token)

        return guarded

    def _opened(self, stream: trio.SocketStream) -> ConnectionStall:
        assert self.timeout_s is not None
        try:
            peer: _Peer | None = tuple(stream.socket.getpeername()[:2])
        except OSError:  # already gone
            peer = None
        state = ConnectionStall(peer, self.timeout_s, self, stream.socket)
        if peer is not None:
            self._connections[peer] = state
        return state

    def _closed(self, state: ConnectionStall) -> None:
        if state.peer is not None and self._connections.get(state.peer) is state:
            del self._connections[state.peer]

    def _stalled(self, state: ConnectionStall) -> None:
        state.stalled = True
        self.stalled_total += 1
        log.warning(
            "client %s accepted no data for write_stall_timeout_s=%g: closing its connection",
            _peer_text(state.peer),
            state.timeout_s,
        )


def _send_queue(sock: trio.socket.SocketType) -> int | None:
    """Bytes in the socket's send queue not yet acknowledged (Linux), else None."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)  # = SIOCOUTQ on sockets
    except OSError:
        return None
    return int.from_bytes(buf, sys.byteorder, signed=True)


def _write_now(sock: trio.socket.SocketType, view: memoryview) -> int:
    """Write what the socket takes without waiting (it is non-blocking); bytes written."""
    try:
        return os.write(sock.fileno(), view)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise trio.ClosedResourceError("the connection was closed") from exc
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def _peer_text(peer: _Peer | None) -> str:
    return "?" if peer is None else ":".join(str(p) for p in peer)


class _GuardedListener(trio.abc.Listener["_GuardedStream"]):
    def __init__(self, inner: trio.SocketListener, guard: StallGuard) -> None:
        self._inner = inner
        self._guard = guard

    async def accept(self) -> _GuardedStream:
        stream = await self._inner.accept()
        return _GuardedStream(stream, self._guard, self._guard._opened(stream))

    async def aclose(self) -> None:
        await self._inner.aclose()


class _GuardedStream(trio.abc.HalfCloseableStream):
    """A ``SocketStream`` whose writes fail when the peer accepts no byte in time."""

    def __init__(self, inner: trio.SocketStream, guard: StallGuard, state: ConnectionStall) -> None:
        self._inner = inner
        self._guard = guard
        self._state = state

    @property
    def socket(self) -> trio.socket.SocketType:
        """The socket (hypercorn reads its addresses)."""
        return self._inner.socket

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        # trio's SocketStream.send_all, watching the peer's progress while a
        # send() waits. A blocked send() is no measure of it: the kernel
        # reports the socket writable only once a third of its send buffer
        # (megabytes, autotuned) has drained, so a client reading slowly can
        # wait far longer than the deadline for that. Progress is the send
        # queue shrinking (the peer acknowledging bytes, SIOCOUTQ), polled
        # while blocked. A cancelled send() sent nothing, so no byte is lost.
        sock = self._inner.socket
        if not data:
            await trio.lowlevel.checkpoint()
            return
        # A cancellation point, but no schedule point when the kernel takes
        # the whole write at once (nearly every SSE write): no cancel scope,
        # no send-queue ioctl and no task switch per token. Only a write the
        # kernel cannot take whole is watched below.
        await trio.lowlevel.checkpoint_if_cancelled()
        with memoryview(data) as view:
            total = _write_now(sock, view)
            if total < len(view):
                await self._wait_rest(sock, view, total)

    async def send_all_shielded(self, data: bytes | bytearray | memoryview) -> None:
        """``send_all`` shielded from cancellation, as hypercorn's connection
        writes (a cancelled app's write still goes out whole), without a
        cancel scope (two context managers in trio) when the kernel takes
        the whole write at once: nearly every SSE write, once per token."""
        total = self.write_nowait(data) if data else 0
        if total < len(data):
            await self.send_rest_shielded(data, total)

    def write_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Write what the kernel takes of ``data`` now, without waiting; the
        bytes written (``send_rest_shielded`` sends the rest).

        Raises:
            trio.BrokenResourceError: The connection broke.
            trio.ClosedResourceError: The connection was closed here.
        """
        with memoryview(data) as view:
            return _write_now(self._inner.socket, view)

    async def send_rest_shielded(self, data: bytes | bytearray | memoryview, total: int) -> None:
        """``data[total:]``, which the kernel did not take at once, shielded."""
        sock = self._inner.socket
        with memoryview(data) as view, trio.CancelScope(shield=True):
            await self._wait_rest(sock, view, total)

    async def _wait_rest(self, sock: trio.socket.SocketType, view: memoryview, total: int) -> None:
        """What the kernel did not take at once, its wait on the run's timeline."""
        timeline = self._state.timeline
        stall = None
        if timeline is not None and timeline.terminal is None:
            stall = timeline.stall_began(
                StallKind.CLIENT_WRITE, trio.current_time(), len(view) - total
            )
        try:
            await self._send_rest(sock, view, total)
        finally:
            if stall is not None:
                stall.end = trio.current_time()

    async def _send_rest(self, sock: trio.socket.SocketType, view: memoryview, total: int) -> None:
        """Send ``view[total:]``, which the kernel did not take at once (``send_all``)."""
        timeout = self._state.timeout_s
        queued = _send_queue(sock)
        progress_at = trio.current_time()
        while total < len(view):
            with trio.move_on_after(min(timeout / 4, PROGRESS_POLL_MAX_S)) as waited:
                try:
                    total += await sock.send(view[total:])
                except OSError as exc:
                    if exc.errno == errno.EBADF:
                        raise trio.ClosedResourceError("the connection was closed") from exc
                    raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
            now = trio.current_time()
            if not waited.cancelled_caught:
                progress_at = now
                queued = _send_queue(sock)
                continue
            now_queued = _send_queue(sock)
            if now_queued is not None and queued is not None and now_queued < queued:
                progress_at = now
            queued = now_queued
            if now - progress_at >= timeout:
                self._guard._stalled(self._state)
                await self.aclose()
                raise trio.BrokenResourceError(f"the client accepted no data for {timeout:g}s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        self._guard._closed(self._state)
        await self._inner.aclose()


async def serve_guarded(
    app: Any,
    config: EdgeHypercornConfig,
    guard: StallGuard,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    tls: Callable[[trio.abc.Listener[Any]], trio.abc.Listener[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` like ``hypercorn.trio.serve``, every connection guarded.

    The edge's hypercorn server (``iop.edge.server._hypercorn``), with the
    listeners wrapped by ``guard`` (and then by ``tls``, which makes them
    serve TLS: the bound URLs are then ``https://``) and the app by
    ``guard.asgi``.
    """

    def listen(sock: trio.socket.SocketType) -> trio.abc.Listener[Any]:
        listener = guard.listener(trio.SocketListener(sock))
        return listener if tls is None else tls(listener)

    await serve_edge_listeners(
        guard.asgi(app),
        config,
        listen,
        scheme="http" if tls is None else "https",
        shutdown_trigger=shutdown_trigger,
        task_status=task_status,
    )
