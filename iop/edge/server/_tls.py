"""TLS on the edge's listeners: the contexts, reloadable, and logged refusals.

With ``server.tls_certfile`` and ``server.tls_keyfile`` set, every listener
of the edge (the API's, and the link's own with ``link.port``) serves TLS:
HTTPS for clients, ``wss://`` for nodes. With ``link.client_ca`` set too,
the link's own listener asks every peer for a certificate and completes the
handshake only with one that CA signed (mutual TLS); the node's token is
still checked in its hello.

The handshake runs in trio's ``SSLStream`` (hypercorn's TLS server does the
same), in the connection's own task: ``EdgeTLSListener.accept`` wraps the
accepted stream and returns at once. Hypercorn's connection server (and the
edge's copy of it, ``iop.edge.server._hypercorn``) drops a connection whose
handshake fails without a word (nor closing it: the peer would wait for its
own timeout); the wrapper sends the peer OpenSSL's alert
(``iop._tls.send_pending_alert``), closes the connection, and logs it, naming the peer
and the reason OpenSSL gives (``certificate required``, ``unknown ca``,
``http request`` for plain HTTP sent to a TLS port), so an operator sees
why a node never registers.

Reload: ``EdgeTLS`` holds the current contexts, and every accepted
connection reads them then. ``EdgeTLS.reload(config)`` builds new ones from
the files (a bad file raises ``ConfigError`` and keeps the old ones) and
swaps them: new handshakes use the new certificate and CA, open
connections keep theirs.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from typing import Any, Final

import trio

from iop._tls import ALERT_SEND_TIMEOUT_S, send_pending_alert, tls_reason
from iop.config import EdgeConfig
from iop.errors import ConfigError

__all__ = ["EdgeTLS", "EdgeTLSListener"]

log = logging.getLogger("iop.edge.tls")

# The edge speaks HTTP/1.1 only (its framing guards are h11's,
# iop.edge.server._http1); offering h2 in ALPN would hand h2 clients to hypercorn's
# unguarded HTTP/2 protocol.
_ALPN: Final = ["http/1.1"]
# The answer to plain HTTP (or ws://) sent to a TLS listener.
_PLAIN_BODY: Final = b"This port serves TLS: use https:// (or wss:// for the node link).\n"
_PLAIN_HTTP_ANSWER: Final = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_PLAIN_BODY)).encode() + b"\r\n\r\n" + _PLAIN_BODY
)


def _server_context(certfile: str, keyfile: str, client_ca: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(_ALPN)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"server.tls_certfile / tls_keyfile: no such file: {exc.filename or certfile}"
        ) from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"server.tls_certfile {certfile!r} / tls_keyfile {keyfile!r}: cannot load the "
            f"certificate and key: {exc}"
        ) from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"link.client_ca {client_ca!r}: cannot load: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class EdgeTLS:
    """The edge's server-side TLS contexts (module docstring).

    Attributes:
        api: The API listener's context (the link's too without ``link.port``).
        link: The link's own listener's context (mutual TLS with ``link.client_ca``).
    """

    def __init__(self, config: EdgeConfig) -> None:
        self.api, self.link = self._build(config)

    @staticmethod
    def enabled(config: EdgeConfig) -> bool:
        return config.server.tls_certfile is not None

    @staticmethod
    def _build(config: EdgeConfig) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        certfile, keyfile = config.server.tls_certfile, config.server.tls_keyfile
        if certfile is None or keyfile is None:
            raise ConfigError("server.tls_certfile and server.tls_keyfile are not set")
        api = _server_context(certfile, keyfile, None)
        client_ca = config.link.client_ca
        link = api if client_ca is None else _server_context(certfile, keyfile, client_ca)
        return api, link

    def reload(self, config: EdgeConfig) -> None:
        """Load the certificate, key and client CA again (``config``'s files);
        new handshakes use them. Nothing changes when one cannot be loaded.

        Raises:
            ConfigError: A file is missing or not a valid certificate, key or CA.
        """
        self.api, self.link = self._build(config)
        log.info("TLS: certificate reloaded from %s", config.server.tls_certfile)


class EdgeTLSListener(trio.abc.Listener[Any]):
    """Wraps each stream ``inner`` accepts in TLS with ``tls``'s current context.

    Args:
        inner: The TCP listener (the stall guard's).
        tls: The contexts.
        link: Whether this listener is the link's own (its context).
    """

    def __init__(self, inner: trio.abc.Listener[Any], tls: EdgeTLS, *, link: bool) -> None:
        self._inner = inner
        self._tls = tls
        self._link = link

    async def accept(self) -> _LoggedTLSStream:
        stream = await self._inner.accept()
        context = self._tls.link if self._link else self._tls.api
        return _LoggedTLSStream(
            trio.SSLStream(stream, context, server_side=True, https_compatible=True),
            _peer(stream),
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def _peer(stream: Any) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except (AttributeError, OSError):
        return "?"
    return f"{host}:{port}"


def handshake_failure(exc: BaseException) -> str:
    """OpenSSL's reason for a failed handshake, in words (``certificate required``)."""
    return tls_reason(exc) or str(exc) or type(exc).__name__


class _LoggedTLSStream:
    """trio's ``SSLStream`` whose failed handshake is logged (hypercorn drops it
    silently); everything else is the stream's own."""

    def __init__(self, stream: trio.SSLStream[Any], peer: str) -> None:
        self._stream = stream
        self._peer = peer

    async def do_handshake(self) -> None:
        try:
            await self._stream.do_handshake()
        except trio.BrokenResourceError as exc:
            reason = handshake_failure(exc)
            log.warning("TLS handshake from %s refused: %s", self._peer, reason)
            # Hypercorn returns without closing the stream: the peer would
            # wait for an answer until its own timeout.
            with trio.CancelScope(shield=True):
                await send_pending_alert(self._stream)
                if reason == "http request":
                    # Plain HTTP (or ws://) to a TLS port: say so in HTTP, as
                    # nginx does, so the client's error is the reason.
                    with (
                        trio.move_on_after(ALERT_SEND_TIMEOUT_S),
                        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                    ):
                        await self._stream.transport_stream.send_all(_PLAIN_HTTP_ANSWER)
                await trio.aclose_forcefully(self._stream.transport_stream)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
