"""Every place the edge's HTTP server reaches into hypercorn's internals.

The edge runs hypercorn's trio worker with its own classes in three places
where hypercorn builds its own inside a function and offers no hook: the
HTTP/1.1 protocol (``iop/edge/server/_http1.py``: OpenAI-shaped 4xx for
refused heads, the head limit, coalesced and shielded writes), the
per-connection task group (``iop/edge/server/_asgi_queue.py``: the
disconnect-aware app queue) and the connection server that builds both.
Nothing in hypercorn's modules is replaced: the edge's server
(``serve_edge_listeners``) constructs ``EdgeTCPServer`` itself, which builds
the rest, so another hypercorn server in the process (``iop up``'s sim) is
plain hypercorn (``tests/edge/test_hypercorn.py`` checks both).

What this module touches, checked against hypercorn 0.18.0 (pyproject.toml
pins exactly that release: a fix hypercorn makes in code copied here would
not reach the edge), and the tests that fail if an upgrade changes it:

========================================  ===========================================
hypercorn internal, and why               what fails if it changes
========================================  ===========================================
``trio.run.worker_serve`` builds          ``serve_edge_listeners`` is its copy
``TCPServer`` inside: copied (no QUIC,    (``Lifespan``, ``WorkerContext``,
no ``max_requests``), with the edge's     ``ConnectionState``, ``raise_shutdown``,
listeners and ``EdgeTCPServer``.          ``ShutdownError``, ``repr_socket_addr``,
                                          ``wrap_app``): every test that starts an
                                          edge; a renamed import fails at import.
``TCPServer.run`` builds ``TaskGroup``    ``EdgeTCPServer.run`` is its copy and sets
and ``ProtocolWrapper`` from its          what hypercorn's other methods read
module's namespace: copied, building      (``_task_group``, ``protocol``) and calls
the edge's.                               them (``idle_task``, ``_idle_timeout``,
                                          ``_read_data``, ``_close``,
                                          ``protocol_send``): tests/edge/
                                          test_http_input.py (keep-alive, released
                                          connections), test_tls_config.py.
``ProtocolWrapper.__init__`` builds       ``EdgeProtocolWrapper.__init__`` sets the
``H11Protocol`` from                      attributes ``handle`` reads to switch to
``hypercorn.protocol``'s namespace.       HTTP/2 (h2c upgrade, prior knowledge:
                                          hypercorn's own code, as before): every
                                          HTTP/1.1 test below.
``H11Protocol``'s private methods         ``EdgeH11Protocol``: ``_check_protocol``
(called per request, per h11 error, per   (smuggling, head size),
h11 event sent) and its ``connection``    ``_send_error_response`` (OpenAI body),
(h11's) and ``send``.                     ``_send_h11_event`` (one write per head
                                          and body, per body and end): tests/edge/
                                          test_http_input.py, the 400/431 and
                                          write tests.
``TCPServer.protocol_send`` writes        ``EdgeTCPServer.protocol_send`` is its
under ``send_lock``, shielded; its        copy for a free lock (``acquire_nowait``),
``stream``, ``protocol``.                 hypercorn's otherwise; ``write_raw``
                                          writes a body chunk without the lock
                                          when it is free and the kernel takes
                                          it whole: tests/edge/
                                          test_body_writer.py (no schedule point,
                                          no lock, no event).
``H11Protocol.connection``'s state and    ``EdgeH11Protocol.write_body`` writes a
the head h11 wrote.                       chunk while h11 is in ``SEND_BODY``:
                                          tests/edge/test_body_writer.py.
``trio.task_group._handle``, the app      ``EdgeTaskGroup.spawn_app`` runs the app
runner ``TaskGroup.spawn_app`` uses       with it over an ``AppQueue``: tests/edge/
(logs an app's error, sends ``None``      test_asgi_queue.py.
when the app ends).
========================================  ===========================================

The node link's frame guard reaches into hypercorn's WebSocket stream from
inside the ASGI app, per connection, and falls back (with a warning) when
the stream is not what it expects: ``iop/edge/server/_link_guard.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, cast, runtime_checkable

import h11
import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveEvent,
    ASGISendEvent,
    ConnectionState,
    H11SendableEvent,
    LifespanState,
    Scope,
)
from hypercorn.utils import (
    ShutdownError,
    parse_socket_addr,
    raise_shutdown,
    repr_socket_addr,
    wrap_app,
)

from iop.edge.server._asgi_queue import APP_QUEUE, AppQueue
from iop.edge.server._http1 import (
    BODY_WRITER,
    EdgeHypercornConfig,
    chunk,
    error_response,
    h11_error,
    is_chunked,
    refusal,
    response_ending,
)
from iop.errors import ErrorCode

__all__ = [
    "EdgeH11Protocol",
    "EdgeProtocolWrapper",
    "EdgeTCPServer",
    "EdgeTaskGroup",
    "serve_edge_listeners",
]

log = logging.getLogger("iop.edge")


class _Refused(Exception):
    """Raised out of hypercorn's event loop once a refusal is sent and the
    connection closed, so the request never becomes a stream."""


class EdgeH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with the edge's guards (``_http1.py``)."""

    config: EdgeHypercornConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes not sent yet: a response head (it goes out with the next
        # write), and a last body message's data (it goes out with the end).
        self._held: bytes | None = None
        # The response under way frames its body in chunks (its head said so).
        self._chunked = False
        send = self.send

        # A close, and the idle timer's restart or stop, must not be cut
        # short by a cancel of the task that asks for them (_http1.py);
        # neither blocks.
        async def send_shielded(event: Event) -> None:
            if isinstance(event, Closed | Updated):
                with trio.CancelScope(shield=True):
                    await send(event)
            else:
                await send(event)

        self.send = send_shielded
        # How a body chunk is written: the edge's server sets its own
        # (``EdgeTCPServer.write_raw``); hypercorn's send otherwise.
        self.write_raw: Callable[[bytes], Awaitable[None]] = self._send_raw

    async def handle(self, event: Event) -> None:
        with contextlib.suppress(_Refused):
            await super().handle(event)
        if isinstance(event, Closed):
            # The connection is over (_http1.py): its idle timer goes too.
            await self.send(Updated(idle=False))

    async def _send_h11_event(self, event: H11SendableEvent) -> None:
        if (
            isinstance(event, h11.Response)
            and self.connection.their_state is h11.SEND_BODY
            and not any(name == b"connection" for name, _ in event.headers)
        ):
            # Answered before the request's body is in (an early error):
            # hypercorn closes the connection after it, as the body is not
            # read, so the head says so (RFC 9112 section 9.6); without it a
            # client reuses the connection and its next request is lost.
            event = h11.Response(
                status_code=event.status_code,
                headers=[*event.headers, (b"connection", b"close")],
                reason=event.reason,
            )
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            # hypercorn's rule: an event h11 refuses after the client broke
            # the protocol is dropped.
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if isinstance(event, h11.Response):
            self._held = data  # _http1.py: sent with the body
            self._chunked = is_chunked(data)
            return
        if isinstance(event, h11.Data) and response_ending():
            # The end follows in this same send (_http1.py).
            self._held = data if self._held is None else self._held + data
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        await self.send(RawData(data=data))

    async def write_body(self, data: bytes) -> bool:
        """``data`` as the next chunk of the response under way, written now
        (a ``BodyWriter``, ``_http1.py``); False when it cannot be: the caller
        sends it through hypercorn."""
        if (
            not data
            or self._held is not None
            or not self._chunked
            or self.connection.our_state is not h11.SEND_BODY
        ):
            return False
        await self.write_raw(chunk(data))
        return True

    async def _send_raw(self, data: bytes) -> None:
        await self.send(RawData(data=data))

    async def _check_protocol(self, event: h11.Request) -> None:
        if (refused := refusal(event, self.config.max_header_bytes)) is not None:
            await self._send_error(*refused)
            await self.send(Closed())
            raise _Refused
        # hypercorn's own check would switch to its HTTP/2 protocol on an h2c
        # upgrade or a prior-knowledge preface, out of the guards above: the
        # preface is refused by ``refusal`` (505), and an ``Upgrade: h2c`` is
        # ignored (RFC 9110 section 7.8 lets a server ignore Upgrade), so the
        # request is served in HTTP/1.1. WebSocket upgrades are not decided here.

    async def _send_error_response(self, status_code: int) -> None:
        await self._send_error(*h11_error(status_code, self.config.max_header_bytes))

    async def _send_error(self, status: int, message: str, code: ErrorCode) -> None:
        for event in error_response(status, message, code, self.config.response_headers("h11")):
            await self._send_h11_event(event)


class EdgeProtocolWrapper(ProtocolWrapper):
    """Hypercorn's protocol switch, starting with ``EdgeH11Protocol`` (HTTP/1.1).

    The edge offers only ``http/1.1`` in ALPN (``_tls.py``), and
    ``EdgeH11Protocol._check_protocol`` never raises the errors on which
    hypercorn's ``handle`` would switch to HTTP/2 (an h2c upgrade, a
    prior-knowledge preface): every connection stays HTTP/1.1.
    """

    def __init__(
        self,
        app: AppWrapper,
        config: EdgeHypercornConfig,
        context: WorkerContext,
        task_group: TaskGroup,
        state: ConnectionState,
        ssl: bool,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        send: Callable[[Event], Awaitable[None]],
    ) -> None:
        # ProtocolWrapper.__init__'s attributes, without its H11Protocol.
        self.app = app
        self.config = config
        self.context = context
        self.task_group = task_group
        self.ssl = ssl
        self.client = client
        self.server = server
        self.send = send
        self.state = state
        self.protocol = EdgeH11Protocol(
            app, config, context, task_group, state, ssl, client, server, send
        )


class EdgeTaskGroup(TaskGroup):
    """Hypercorn's per-connection task group; an HTTP request's and a
    WebSocket's queue is an ``AppQueue``, and an HTTP/1.1 request gets its connection's body writer
    (``EdgeH11Protocol.write_body``)."""

    # The connection's protocol switch (set by ``EdgeTCPServer.run``).
    connection: ProtocolWrapper | None = None

    async def spawn_app(
        self,
        app: AppWrapper,
        config: Any,
        scope: Scope,
        send: Callable[[ASGISendEvent | None], Awaitable[None]],
    ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await super().spawn_app(app, config, scope, send)
        queue = AppQueue(config.max_app_queue_size)
        scope["extensions"][APP_QUEUE] = queue  # type: ignore[assignment, typeddict-item]
        protocol = getattr(self.connection, "protocol", None)
        if kind == "http" and isinstance(protocol, EdgeH11Protocol):  # not after HTTP/2
            scope["extensions"][BODY_WRITER] = protocol.write_body  # type: ignore[assignment, typeddict-item]
        self.spawn(
            _handle,
            app,
            config,
            scope,
            queue.receive,
            send,
            trio.to_thread.run_sync,
            trio.from_thread.run,
        )
        # The node link's: the frames of one socket read are all queued
        # before the link reader runs, which takes them in one wake-up
        # (``AppQueue.put``; ``iop.runtime._link``, ``MAX_FRAMES_PER_WAKE``).
        return queue.put if kind == "websocket" else queue.send


@runtime_checkable
class NowaitStream(Protocol):
    """A connection stream that writes what the kernel takes without waiting
    (the stall guard's, ``iop.edge.server._stall``)."""

    def write_nowait(self, data: bytes) -> int: ...

    async def send_rest_shielded(self, data: bytes, total: int) -> None: ...


class EdgeTCPServer(TCPServer):
    """Hypercorn's trio connection server, building the edge's task group and protocol."""

    config: EdgeHypercornConfig
    # The connection's stream when it writes without waiting (``write_raw``).
    _nowait: NowaitStream | None = None

    async def protocol_send(self, event: Event) -> None:
        # hypercorn 0.18's, for a write: under the connection's send lock, the
        # write shielded (a cancelled app leaves no half-written chunk), a
        # broken stream handed to the protocol as Closed. trio.Lock.acquire
        # is a schedule point even when the lock is free: a task switch per
        # token of every stream. A free lock is taken without one (a trio
        # lock handed on at release stays held, so free means no waiter).
        if type(event) is not RawData or self.send_lock.locked():
            await super().protocol_send(event)
            return
        self.send_lock.acquire_nowait()
        try:
            try:
                # The stall guard's stream shields its write itself, with no
                # cancel scope when the kernel takes it whole (_stall.py).
                shielded = getattr(self.stream, "send_all_shielded", None)
                if shielded is not None:
                    await shielded(event.data)
                else:
                    with trio.CancelScope(shield=True):
                        await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()

    async def write_raw(self, data: bytes) -> None:
        """``protocol_send(RawData(data))`` for a body chunk, with nothing in
        between when the send lock is free and the kernel takes the whole
        write at once: nothing runs between the check and the write (no
        ``await``), so no other write of the connection can interleave, and
        the lock (whose acquire and release register and remove a parking
        lot breaker in trio) is taken only for a rest the kernel did not
        take. No hypercorn event is built per token either."""
        stream = self._nowait
        lock = self.send_lock
        if stream is None or lock.locked():
            await self.protocol_send(RawData(data=data))
            return
        try:
            total = stream.write_nowait(data)
            if total == len(data):
                return
            lock.acquire_nowait()
            try:
                await stream.send_rest_shielded(data, total)
            finally:
                lock.release()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())

    async def run(self) -> None:
        # hypercorn 0.18's TCPServer.run with EdgeTaskGroup and EdgeProtocolWrapper.
        # A TLS stream (_tls.py) is the one with a handshake; its ALPN offers
        # http/1.1 alone, so the protocol starts as HTTP/1.1 either way.
        stream: Any = self.stream
        handshake = getattr(stream, "do_handshake", None)
        if handshake is not None:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # the handshake failed (and _tls.py said why)
            sock = stream.transport_stream.socket
            ssl = True
        else:
            sock = stream.socket
            ssl = False
            # The stall guard's stream writes without waiting (not under TLS).
            if isinstance(stream, NowaitStream):
                self._nowait = stream
        client: Any = None
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with EdgeTaskGroup() as task_group:
                self._task_group = task_group
                self.protocol = EdgeProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                )
                cast(EdgeTaskGroup, task_group).connection = self.protocol
                if isinstance(self.protocol.protocol, EdgeH11Protocol):
                    self.protocol.protocol.write_raw = self.write_raw
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except* OSError:
            pass
        except* Exception as failed:
            # One connection's own server code (hypercorn's, or the edge's
            # queues and writers under it) failed: that connection ends, the
            # edge serves on. Unhandled, it stopped every listener and every
            # run (tests/edge/test_asgi_queue.py).
            log.error(
                "connection from %s: the server failed on it (%s); closed it",
                client,
                "; ".join(f"{type(e).__name__}: {e}" for e in failed.exceptions),
                exc_info=failed,
            )
        finally:
            await self._close()


async def serve_edge_listeners(
    app: Any,
    config: EdgeHypercornConfig,
    listen: Callable[[trio.socket.SocketType], trio.abc.Listener[Any]],
    *,
    scheme: str,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` like ``hypercorn.trio.serve``, on listeners the edge makes.

    Hypercorn's ``worker_serve`` (0.18) with ``EdgeTCPServer`` for every
    connection, no QUIC. ``listen`` makes each bound socket's listener
    (the stall guard's, with TLS on top); ``scheme`` names what they serve
    in the URLs reported to ``task_status``.
    """
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()

        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners: list[trio.abc.Listener[Any]] = []
            binds: list[str] = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(listen(trio.socket.from_stdlib_socket(sock)))
                bind = repr_socket_addr(sock.family, sock.getsockname())
                binds.append(f"{scheme}://{bind}")
                await config.log.info(f"Running on {scheme}://{bind} (CTRL + C to quit)")
            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners,
                            partial(
                                EdgeTCPServer,
                                wrapped,
                                config,
                                context,
                                ConnectionState(lifespan_state.copy()),
                            ),
                            listeners,
                            handler_nursery=server_nursery,
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split((ShutdownError, KeyboardInterrupt))
                if other is not None:
                    raise other from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
