"""The production ``FrameChannel``: the node's WebSocket client, on a trio stream.

One binary WebSocket message carries one link frame (``iop.protocol``). The
protocol is ``iop.node._wsframes`` (sans-IO: the upgrade, masking, framing,
limits); this module is its IO, with no task of its own:

* ``send`` frames in the caller's task (the link's writer) and writes the
  frame with one ``os.write`` over plain TCP when the kernel takes it all,
  taking the free send lock with ``acquire_nowait``: no schedule point per
  frame. What the kernel does not take, and every TLS write, goes through
  trio's ``send_all``. The writer sends everything queued for the link as
  one frame (``iop.runtime._link``), so a burst costs one write.
* ``receive`` reads and parses in the caller's task (the link's reader):
  no reader task and no channel between the socket and the link, so a
  frame from the edge costs no task hop. It answers the edge's pings and
  its close frame (echoing its code).
* ``aclose`` sends a close frame, waits for the edge's (unless the reader
  is waiting for it) and always closes the stream, all within
  ``DISCONNECT_TIMEOUT_S``; an edge that closes the connection or breaks the
  stream during the upgrade fails the dial at once, with OpenSSL's reason
  for a TLS alert.

docs/benchmarks.md ("Tokens per core at fleet scale") has what this cut
from a token's path against trio-websocket, which the node used before.

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
import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Final
from urllib.parse import urlsplit

import trio

from iop._tls import send_pending_alert, tls_reason
from iop.config import NodeEdge
from iop.errors import ConfigError, LinkAuthError, LinkError, LinkProtocolError
from iop.node._wsframes import (
    CLOSE_ABNORMAL,
    Accepted,
    BinaryMessage,
    ClientFrames,
    CloseReceived,
    PingReceived,
    Refused,
    TextMessage,
    Upgrade,
    WebSocketFailure,
)
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
# Close handshake: a frozen edge must not keep the node's reconnect waiting
# (trio-websocket, which the node used before, waited 60 s).
DISCONNECT_TIMEOUT_S: Final = 2.0
# The default of ``open_ws_link(max_message_size=...)``; the agent passes
# ``node.max_frame_bytes`` (told to the edge in the hello, which sends
# nothing bigger). 1 MiB (trio-websocket's default) would close the link
# (1009) on a legitimate large request.
MAX_FRAME_BYTES: Final = 32 * 1024 * 1024
# One read of the link's socket: a frame from the edge is mostly an assign
# or credit, far smaller; a large assign takes several reads.
RECEIVE_BYTES: Final = 64 * 1024


class WebSocketFrameChannel:
    """A ``FrameChannel`` over an open WebSocket client connection.

    ``send`` frames and writes in the caller's task; ``receive`` reads and
    parses in the caller's task (the link's reader), answers the edge's
    pings and its close. No task of its own: ``open_ws_link`` owns the
    stream and closes it.

    Args:
        stream: The upgraded connection.
        frames: Its frames (what followed the upgrade's head already fed).
        url: The edge's URL, for messages.
    """

    def __init__(
        self,
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream],
        frames: ClientFrames,
        url: str,
    ) -> None:
        self._stream = stream
        self._frames = frames
        self.url = url
        # Over plain TCP a frame is written with one os.write when the kernel
        # takes it all (module docstring); TLS goes through trio's stream.
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        # A pong or a close from the reader and the writer's frames must not
        # interleave on the stream.
        self._send_lock = trio.Lock()
        self._ended: LinkClosed | None = None  # why no frame goes or comes any more
        self._ended_event = trio.Event()
        # A write failed: nothing more goes, but the reader still reads what
        # came before (the edge's close frame says why it hung up).
        self._send_broken: LinkClosed | None = None
        self._receiving = False
        self._stream_closed = False

    @property
    def closed(self) -> bool:
        return self._ended is not None or self._send_broken is not None

    def _closed_error(self) -> LinkClosed:
        ended = self._ended
        assert ended is not None
        return LinkClosed(ended.message, close_code=ended.close_code, reason=ended.reason)

    def _end(self, code: int | None, reason: str) -> LinkClosed:
        """Record why the connection ended (the first cause wins)."""
        if self._ended is None:
            text = f"{code} {reason}".strip() if code is not None else reason
            self._ended = LinkClosed(
                f"link to {self.url} closed ({text})", close_code=code, reason=reason
            )
            self._ended_event.set()
        return self._closed_error()

    def _lost(self, exc: BaseException | None) -> LinkClosed:
        """The stream broke or ended without a close frame (1006, RFC 6455 §7.1.5)."""
        return self._end(CLOSE_ABNORMAL, "" if exc is None else str(exc) or type(exc).__name__)

    async def send(self, frame: bytes) -> None:
        """Send one frame as a binary message.

        Passes no schedule point when the kernel takes the whole frame at
        once (the link's writer passes one per round, in its wait).

        Raises:
            LinkClosed: The connection is closed.
        """
        if self._ended is not None:
            raise self._closed_error()
        if self._send_broken is not None:
            raise LinkClosed(self._send_broken.message, close_code=CLOSE_ABNORMAL, reason="")
        try:
            await self._write(self._frames.binary(frame))
        except LinkClosed as broken:
            raise await self._why_broken(broken) from None

    async def _why_broken(self, broken: LinkClosed) -> LinkClosed:
        """A write failed: the edge's close frame, when one came, says why
        (its code tells the dialer whether to retry soon: ``iop.node._dial``)."""
        with trio.move_on_after(DISCONNECT_TIMEOUT_S):
            if self._receiving:
                await self._ended_event.wait()  # the reader reads it
            elif self._ended is None:
                await self._await_close()
        return self._closed_error() if self._ended is not None else broken

    async def _write(self, data: bytes) -> None:
        lock = self._send_lock
        try:
            lock.acquire_nowait()  # free: no schedule point (trio's acquire passes one)
        except trio.WouldBlock:
            await lock.acquire()
        try:
            sock = self._socket
            if sock is not None and (fd := sock.fileno()) >= 0:
                try:
                    sent = os.write(fd, data)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    raise self._broken(exc) from None
                if sent == len(data):
                    return
                data = data[sent:]
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise self._broken(exc) from None
        finally:
            lock.release()

    def _broken(self, exc: BaseException) -> LinkClosed:
        if self._send_broken is None:
            self._send_broken = LinkClosed(
                f"link to {self.url} closed ({CLOSE_ABNORMAL} {str(exc) or type(exc).__name__})",
                close_code=CLOSE_ABNORMAL,
                reason="",
            )
        return LinkClosed(self._send_broken.message, close_code=CLOSE_ABNORMAL, reason="")

    async def _write_close(self, code: int | None, reason: str = "") -> None:
        """Send a close frame, bounded by ``DISCONNECT_TIMEOUT_S``; a broken
        stream is no error here (it is closing anyway)."""
        with trio.move_on_after(DISCONNECT_TIMEOUT_S), suppress(LinkClosed):
            await self._write(self._frames.close(code, reason))

    async def _read(self) -> None:
        """Feed one read of the stream to the frames.

        Raises:
            LinkClosed: The stream broke or ended (1006).
        """
        try:
            data = await self._stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise self._lost(exc) from None
        if not data:
            raise self._lost(None)
        self._frames.receive_data(data)

    async def receive(self) -> bytes:
        """The next frame.

        Raises:
            LinkClosed: The connection closed (with the edge's code and
                reason; 1006 when it ended without a close frame; 1002, 1007
                or 1009 when the edge broke RFC 6455 or the size limit, and
                the node closed it).
            LinkProtocolError: The edge sent a text message (the link is
                closed with ``CLOSE_PROTOCOL``).
        """
        frames = self._frames
        self._receiving = True
        try:
            while True:
                if self._ended is not None:
                    raise self._closed_error()
                try:
                    event = frames.next_event()
                except WebSocketFailure as exc:
                    error = self._end(exc.code, exc.message)
                    await self._write_close(exc.code, exc.message)
                    raise error from None
                if event is None:
                    await self._read()
                elif type(event) is BinaryMessage:
                    return event.data
                elif isinstance(event, PingReceived):
                    await self._write(frames.pong(event.payload))
                elif isinstance(event, CloseReceived):
                    error = self._end(event.code, event.reason)
                    await self._write_close(event.code)  # RFC 6455 §5.5.1: echo the code
                    raise error
                elif isinstance(event, TextMessage):
                    await self.aclose(
                        CLOSE_PROTOCOL, "text frames are not part of the link protocol"
                    )
                    raise LinkProtocolError(f"edge {self.url} sent a text frame")
        finally:
            self._receiving = False

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close the connection and its stream (idempotent): send a close
        frame, wait for the edge's (unless a reader is waiting for it), then
        close the stream, all within ``DISCONNECT_TIMEOUT_S``."""
        if self._stream_closed:
            return
        try:
            if self._ended is None:
                self._end(code, reason)
                with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                    await self._write_close(code, reason)
                    if not self._receiving:
                        await self._await_close()
        finally:
            self._stream_closed = True
            if self._ended is not None:
                log.debug("%s", self._ended.message)
            # A cancelled aclose still releases the socket (trio's AsyncResource).
            await self._stream.aclose()

    async def _await_close(self) -> None:
        """Read until the edge's close frame or the end of the stream (RFC 6455 §7.1.1:
        the server closes the TCP connection first)."""
        frames = self._frames
        while True:
            try:
                event = frames.next_event()
            except WebSocketFailure:
                return
            if event is None:
                try:
                    await self._read()
                except LinkClosed:
                    return
            elif isinstance(event, CloseReceived):
                self._end(event.code, event.reason)
                return

    async def _send_text(self, text: str) -> None:
        """A text message: not part of the link (tests send one to see it refused)."""
        await self._write(self._frames.text(text))


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
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rpartition("@")[2]
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream] | None = None
    answer: Accepted | Refused | None = None
    with trio.move_on_after(connect_timeout_s):
        stream = await _open_stream(url, ssl_context)
        try:
            answer = await _upgrade(stream, url, Upgrade(host_header, target))
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    if not isinstance(answer, Accepted):
        if stream is not None:
            await trio.aclose_forcefully(stream)
        if answer is None:
            raise LinkError(
                f"cannot connect to edge {url}: no answer within {connect_timeout_s:g}s"
            )
        raise _rejected(url, answer)
    assert stream is not None
    log.debug("link to %s: WebSocket open", url)
    frames = ClientFrames(max_message_size)
    frames.receive_data(answer.rest)
    chan = WebSocketFrameChannel(stream, frames, url)
    try:
        yield chan
    finally:
        # Shielded: leaving by cancellation must still release the socket;
        # bounded by DISCONNECT_TIMEOUT_S inside aclose.
        with trio.CancelScope(shield=True):
            await chan.aclose()


async def _upgrade(
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream], url: str, upgrade: Upgrade
) -> Accepted | Refused:
    """Send the upgrade request and read the answer (``Upgrade``)."""
    try:
        await stream.send_all(upgrade.request())
        while True:
            answer = upgrade.receive(await stream.receive_some(RECEIVE_BYTES))
            if answer is not None:
                return answer
    except trio.BrokenResourceError as exc:
        # A TLS alert after the handshake (an edge refusing the node's
        # certificate, under TLS 1.3) or a reset: OpenSSL's reason, at once.
        raise _connect_error(url, exc) from exc
    except WebSocketFailure as exc:
        if exc.message != "closed during the upgrade":
            raise LinkError(f"cannot connect to edge {url}: {exc.message}") from None
        hint = " (if the edge serves TLS, dial it with wss://)" if url.startswith("ws://") else ""
        raise LinkError(
            f"cannot connect to edge {url}: the edge closed the connection during the upgrade{hint}"
        ) from None


def _rejected(url: str, answer: Refused) -> LinkError:
    if answer.problem:
        return LinkError(f"edge {url} answered the link upgrade with {answer.problem}")
    said = ""
    if answer.body:
        said = ": " + answer.body.decode(errors="replace").strip()[:200]
    message = f"edge {url} refused the link upgrade: HTTP {answer.status}{said}"
    if answer.status in (401, 403):
        return LinkAuthError(message)
    return LinkError(message)


def _connect_error(url: str, exc: BaseException) -> LinkError:
    host = urlsplit(url).hostname or "?"
    reason = tls_reason(exc)
    if reason is not None:
        return LinkError(f"cannot connect to edge {url}: TLS with {host} failed: {reason}")
    detail = str(exc) or type(exc).__name__
    return LinkError(f"cannot connect to edge {url}: {detail}")
