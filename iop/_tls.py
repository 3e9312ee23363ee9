"""TLS details both ends of a link share: OpenSSL's reason in words, and the
alert a failed handshake owes its peer.

trio's ``SSLStream`` raises ``BrokenResourceError`` (caused by the
``ssl.SSLError``) on a failed handshake without sending the alert OpenSSL
queued for the peer (``certificate expired``, ``certificate required``,
``unknown ca``): the peer then sees only a reset or an end of stream, and its
log cannot say why. ``send_pending_alert`` writes it to the transport
itself; trio keeps its outgoing ``MemoryBIO`` private (``_outgoing``), so
when that changes the alert is lost and nothing else.
"""

from __future__ import annotations

import contextlib
import re
import ssl
from typing import Any, Final

import trio

__all__ = ["ALERT_SEND_TIMEOUT_S", "send_pending_alert", "tls_reason"]

# One small write: the socket's buffer takes it at once unless the peer is gone.
ALERT_SEND_TIMEOUT_S: Final = 1.0


def tls_reason(exc: BaseException) -> str | None:
    """OpenSSL's reason for ``exc`` or what caused it, in words
    (``certificate required``), or None when no TLS error is in the chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"certificate verification failed: {seen.verify_message}"
        if isinstance(seen, ssl.SSLError):
            reason = (seen.reason or str(seen)).lower().replace("_", " ")
            # "TLSV13_ALERT_CERTIFICATE_REQUIRED": the peer's alert, said plainly.
            return re.sub(r"^(tlsv1\d?|sslv3) alert ", "", reason)
        seen = seen.__cause__ or seen.__context__
    return None


async def send_pending_alert(stream: trio.SSLStream[Any]) -> None:
    """Write what OpenSSL queued for the peer (the alert of a failed
    handshake) to ``stream``'s transport; never raises but Cancelled."""
    outgoing = getattr(stream, "_outgoing", None)
    if not isinstance(outgoing, ssl.MemoryBIO) or not outgoing.pending:
        return
    with (
        trio.move_on_after(ALERT_SEND_TIMEOUT_S),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.transport_stream.send_all(outgoing.read())
