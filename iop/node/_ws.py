"""The production ``FrameChannel``: a WebSocket client on trio-websocket.

One binary WebSocket message carries one link frame (``iop.protocol``). Two
rough edges of trio-websocket 0.12.2 are handled here (docs/architecture.md,
"Facts about our dependencies: trio-websocket"):

* ``disconnect_timeout`` defaults to 60 s: a frozen edge would keep the close
  handshake (and the node's reconnect) waiting a minute. We use 2 s.
* When the *server* closes, the client never closes its TCP stream (its
  ``aclose`` returns early once a close reason is known), which leaks a socket
  (a ``ResourceWarning``). ``aclose`` here always closes the stream itself.

TLS (``wss://``): the edge's certificate is verified against the system's
trusted roots, or the edge entry's ``tls_ca_file``, and its host name checked
(``client_tls_context``); the node presents its own certificate when the
entry has one (an edge with ``link.client_ca``). A failed verification is a
one-line ``LinkError`` naming the URL, the host and OpenSSL's reason, never
a traceback.

Liveness is not this module's job: the link driver (``iop.node._agent``)
applies the application heartbeat deadline, which is what detects a frozen
or partitioned edge.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final, cast
from urllib.parse import urlsplit

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    wrap_client_stream,
)

from iop._tls import send_pending_alert, tls_reason
from iop.config import NodeEdge
from iop.errors import ConfigError, LinkAuthError, LinkError, LinkProtocolError
from iop.protocol import CLOSE_NORMAL, CLOSE_PROTOCOL, LinkClosed

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DISCONNECT_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "WebSocketFrameChannel",
    "client_tls_context",
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


def client_tls_context(edge: NodeEdge) -> ssl.SSLContext | None:
    """The TLS context for dialling ``edge`` (None for ``ws://``): the
    system's roots or ``tls_ca_file``, host name checked (or the one
    certificate of ``tls_pin_certfile``), the node's own certificate when the
    entry has one.

    Raises:
        ConfigError: A file of the entry cannot be loaded (the message names
            the key and the file).
    """
    if not edge.url.startswith("wss://"):
        return None
    where = f"node.edges ({edge.url})"
    if edge.tls_pin_certfile is not None:
        ctx = _pinned_context(edge.tls_pin_certfile, where)
    else:
        try:
            ctx = ssl.create_default_context(cafile=edge.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}: tls_ca_file {edge.tls_ca_file!r}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if edge.tls_certfile is not None and edge.tls_keyfile is not None:
        try:
            ctx.load_cert_chain(edge.tls_certfile, edge.tls_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"{where}: tls_certfile {edge.tls_certfile!r} / tls_keyfile "
                f"{edge.tls_keyfile!r}: {exc}"
            ) from None
    return ctx


def _pinned_context(path: str, where: str) -> ssl.SSLContext:
    """A client context trusting exactly the first certificate in ``path``.

    OpenSSL's partial-chain flag lets that certificate anchor the chain on
    its own, so the edge's chain need not reach a root this node knows; only
    the first certificate is loaded, so that a chain file's intermediates
    (which sign other hosts' certificates too) are not trusted. With one
    certificate trusted, the host name adds nothing and is not checked.
    """
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
        end = text.index(_PEM_END) + len(_PEM_END)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=text[text.index(_PEM_BEGIN) : end])
    except (OSError, UnicodeDecodeError, ValueError, ssl.SSLError) as exc:
        reason = "no PEM certificate in it" if isinstance(exc, ValueError) else exc
        raise ConfigError(f"{where}: tls_pin_certfile {path!r}: {reason}") from None
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


_PEM_BEGIN: Final = "-----BEGIN CERTIFICATE-----"
_PEM_END: Final = "-----END CERTIFICATE-----"


class _WatchedStream(trio.abc.Stream):
    """The link's stream, telling the upgrade's waiter when it breaks.

    trio-websocket 0.12.2 waits for the upgrade's answer until its connect
    timeout even when the stream broke or closed meanwhile (its reader
    notes the break but never wakes the waiter): a TLS alert after the
    handshake (an edge refusing the node's certificate, under TLS 1.3) or an
    edge closing the connection would cost the whole connect timeout and
    say only "timeout". While ``on_break`` is set, a break or an end of
    stream calls it (``open_ws_link`` cancels the wait) and keeps the error.
    """

    def __init__(self, inner: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> None:
        self._inner = inner
        self.on_break: Callable[[], None] | None = None
        self.failure: BaseException | None = None

    def _broke(self, exc: BaseException | None) -> None:
        if self.failure is None and exc is not None:
            self.failure = exc
        if self.on_break is not None:
            self.on_break()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._inner.send_all(data)
        except trio.BrokenResourceError as exc:
            self._broke(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._inner.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            self._broke(exc)
            raise
        if not data:
            self._broke(None)
        return data

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __getattr__(self, name: str) -> Any:
        # trio-websocket reads ``socket`` (or ``transport_stream.socket``) for
        # its ``local`` / ``remote`` addresses.
        return getattr(self._inner, name)


async def _open_stream(
    url: str, ssl_context: ssl.SSLContext | None
) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
    """TCP, then TLS for ``wss://`` with its handshake done here: a refused
    certificate fails now, with OpenSSL's reason."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise LinkError(f"cannot connect to edge {url}: {exc.strerror or exc}") from exc
    if not secure:
        return tcp
    context = ssl_context if ssl_context is not None else ssl.create_default_context()
    stream = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        # Tell the edge why (its log then names the reason, not a reset).
        with trio.CancelScope(shield=True):
            await send_pending_alert(stream)
        await trio.aclose_forcefully(stream)
        raise _connect_error(url, exc) from exc
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream


@asynccontextmanager
async def open_ws_link(
    url: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_message_size: int = MAX_FRAME_BYTES,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[WebSocketFrameChannel]:
    """Connect to an edge's link endpoint; close the connection on exit.

    Args:
        url: ``ws://`` or ``wss://`` URL of the edge's link endpoint.
        connect_timeout_s: Deadline of the TCP connect, the TLS handshake and
            the WebSocket upgrade.
        max_message_size: Largest frame accepted (1009 above).
        ssl_context: For ``wss://`` (``client_tls_context``); None: the
            system's defaults.

    Raises:
        LinkAuthError: The edge refused the upgrade with HTTP 401/403.
        LinkError: The edge could not be reached, its TLS failed (the
            message names the host and OpenSSL's reason) or it refused the
            upgrade (the message names the URL).
    """
    parts = urlsplit(url)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rpartition("@")[2]
    try:
        async with trio.open_nursery() as nursery:  # trio-websocket's reader task
            stream: _WatchedStream | None = None
            opening = trio.CancelScope()
            with trio.move_on_after(connect_timeout_s) as deadline:
                stream = _WatchedStream(await _open_stream(url, ssl_context))
                with opening:
                    stream.on_break = opening.cancel
                    ws = await wrap_client_stream(
                        nursery,
                        cast(Any, stream),
                        host_header,
                        resource,
                        max_message_size=max_message_size,
                    )
                stream.on_break = None
            if deadline.cancelled_caught or opening.cancelled_caught:
                raise await _not_opened(url, stream, opening.cancelled_caught, connect_timeout_s)
            chan = WebSocketFrameChannel(ws, url)
            try:
                yield chan
            finally:
                # Shielded: leaving by cancellation must still release the
                # socket; bounded by DISCONNECT_TIMEOUT_S inside aclose. The
                # reader task ends once the stream is closed.
                with trio.CancelScope(shield=True):
                    await chan.aclose()
    except BaseExceptionGroup as group:
        # One task raised (the body, or the reader with the edge's refusal):
        # raise it as itself, as trio-websocket's own context manager does.
        leaves = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(group.exceptions) == 1 or len(leaves) == 1:
            only = leaves[0] if leaves else group.exceptions[0]
            if isinstance(only, ConnectionRejected):
                raise _rejected(url, only) from only
            raise only from None
        raise


async def _not_opened(
    url: str, stream: _WatchedStream | None, broke: bool, timeout_s: float
) -> LinkError:
    """Why the link did not open (the stream is closed here): the stream's
    failure, the edge closing it, or no answer within the connect timeout."""
    if stream is not None:
        await trio.aclose_forcefully(stream)
        if stream.failure is not None:
            return _connect_error(url, stream.failure)
    if broke:
        hint = " (if the edge serves TLS, dial it with wss://)" if url.startswith("ws://") else ""
        return LinkError(
            f"cannot connect to edge {url}: the edge closed the connection during the upgrade{hint}"
        )
    return LinkError(f"cannot connect to edge {url}: no answer within {timeout_s:g}s")


def _rejected(url: str, exc: ConnectionRejected) -> LinkError:
    said = ""
    if exc.body:
        said = ": " + exc.body.decode(errors="replace").strip()[:200]
    message = f"edge {url} refused the link upgrade: HTTP {exc.status_code}{said}"
    if exc.status_code in (401, 403):
        return LinkAuthError(message)
    return LinkError(message)


def _connect_error(url: str, exc: BaseException) -> LinkError:
    host = urlsplit(url).hostname or "?"
    reason = tls_reason(exc)
    if reason is not None:
        return LinkError(f"cannot connect to edge {url}: TLS with {host} failed: {reason}")
    detail = str(exc) or type(exc).__name__
    return LinkError(f"cannot connect to edge {url}: {detail}")
