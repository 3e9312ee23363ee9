"""The one exception tree of IOP.

Every failure that crosses a module boundary is one of these. Foreign exceptions
(httpx, msgspec, OS errors) are mapped at the boundary that sees them, with
``raise ... from exc``, so no ``httpx.*`` error ever escapes an adapter.

Faults are split by *whose* fault they are, after h11's Local/Remote split:
the caller's input (``RequestError``), our own configuration
(``ConfigError``), a broken internal contract (``InvariantError``, always a bug
in IOP), or the backend (``BackendError`` and its children)::

    IopError
    ├── ConfigError                 a config file or value is wrong (names key and file)
    ├── ListenError                 a server cannot listen on its address (port taken)
    ├── RequestError                the client's request is invalid             -> 4xx
    ├── InvariantError              an internal contract was broken (a bug)     -> 500
    ├── RunAborted                  an executor ended its run as cancelled (reason)
    ├── LinkError                   the edge<->node link failed
    │   ├── LinkAuthError           a node presented a bad token / version
    │   ├── LinkProtocolError       a peer sent a frame that breaks the protocol
    │   │   └── LinkLimitError      ... or crossed a link limit (frame size, rate)
    │   └── LinkClosed              the link closed (WebSocket close code, reason)
    └── BackendError                the inference backend failed                -> 5xx / backend's status
        ├── BackendUnavailable      connection refused, DNS, connect timeout    -> 503
        ├── BackendTimeout          a transport read/write timed out            -> 504
        ├── BackendHTTPError        the backend answered non-2xx (status, body) -> backend's status
        ├── BackendStreamError      the stream broke: reset, truncated, or an
        │                           error event inside the stream               -> 502
        └── BackendProtocolError    the backend sent malformed data: oversize
                                    line, bad JSON beyond the tolerance         -> 502

Each class carries a stable ``code`` (a snake_case string that ends up in
``Error.code`` events and OpenAI error bodies) and an HTTP ``status``.
"""

from __future__ import annotations

import errno

__all__ = [
    "BackendError",
    "BackendHTTPError",
    "BackendProtocolError",
    "BackendStreamError",
    "BackendTimeout",
    "BackendUnavailable",
    "ConfigError",
    "InvariantError",
    "IopError",
    "LinkAuthError",
    "LinkClosed",
    "LinkError",
    "LinkLimitError",
    "LinkProtocolError",
    "ListenError",
    "RequestError",
    "RunAborted",
    "listen_error_from",
]


class IopError(Exception):
    """Base of every IOP error.

    Attributes:
        message: Human readable, safe to show a client (no secrets).
        status: The HTTP status this error maps to.
        code: Stable machine-readable code.
        param: The request parameter OpenAI's error body names, if any.
    """

    code: str = "iop_error"
    status: int = 500
    param: str | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class ConfigError(IopError):
    """A configuration file or value is invalid; the message names key and file."""

    code = "config_error"
    status = 500


class ListenError(IopError):
    """A server cannot listen on its address: the port is taken, or not ours to take.

    Attributes:
        address: ``host:port`` as configured.
        in_use: The port is held by another process (``EADDRINUSE``).
    """

    code = "listen_error"

    def __init__(self, address: str, why: str, *, in_use: bool = False) -> None:
        super().__init__(f"cannot listen on {address}: {why}")
        self.address = address
        self.in_use = in_use


_BIND_ERRORS = {
    errno.EADDRINUSE: "the port is already in use",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "the address is not one of this machine's",
}


def listen_error_from(address: str, exc: BaseException) -> ListenError | None:
    """The ``ListenError`` for a bind of ``address`` that failed with ``exc``.

    ``exc`` may be the ``OSError`` or an exception group holding only it (a
    server's nursery); anything else is not a bind failure: None.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, OSError) and exc.errno in _BIND_ERRORS:
        return ListenError(address, _BIND_ERRORS[exc.errno], in_use=exc.errno == errno.EADDRINUSE)
    return None


class RequestError(IopError):
    """The client's request is invalid (maps to a 4xx with OpenAI's error body).

    Attributes:
        param: The request parameter at fault, if one is known.
    """

    code = "invalid_request_error"
    status = 400

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.param = param


class InvariantError(IopError):
    """An internal contract was broken, e.g. an adapter emitted two terminal events."""

    code = "internal_error"
    status = 500


class RunAborted(IopError):
    """An executor ends its run as cancelled rather than failed.

    The runtime turns it into ``Cancelled(reason)``; the edge raises it when
    a run's node is lost, so the client learns the run was cut off.

    Attributes:
        reason: A ``CancelReason`` value.
    """

    code = "run_cancelled"
    status = 503

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class LinkError(IopError):
    """The edge<->node link failed."""

    code = "link_error"
    status = 503


class LinkAuthError(LinkError):
    """A node was refused: bad token or unsupported protocol version."""

    code = "link_auth_error"
    status = 401


class LinkProtocolError(LinkError):
    """A peer sent a frame that breaks the link protocol."""

    code = "link_protocol_error"
    status = 502


class LinkLimitError(LinkProtocolError):
    """A peer crossed a limit of the link: a frame too large, too many messages.

    Attributes:
        close_code: The WebSocket close code the link is closed with.
    """

    code = "link_limit_exceeded"

    def __init__(self, message: str, *, close_code: int) -> None:
        super().__init__(message)
        self.close_code = close_code


class LinkClosed(LinkError):
    """The link is closed; ``close_code``/``reason`` say why (when known)."""

    code = "link_closed"

    def __init__(self, message: str, *, close_code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.close_code = close_code
        self.reason = reason


class BackendError(IopError):
    """The inference backend failed."""

    code = "backend_error"
    status = 502


class BackendUnavailable(BackendError):
    """The backend could not be reached (refused, DNS, connect timeout)."""

    code = "backend_unavailable"
    status = 503


class BackendTimeout(BackendError):
    """A transport-level read or write to the backend timed out."""

    code = "backend_timeout"
    status = 504


class BackendHTTPError(BackendError):
    """The backend answered with a non-2xx status.

    Attributes:
        backend_status: The status the backend sent.
        body_excerpt: At most a few KiB of the response body, for diagnosis.
    """

    code = "backend_http_error"

    def __init__(
        self,
        message: str,
        *,
        backend_status: int,
        body_excerpt: str = "",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        # A backend's 4xx is usually the client's fault (bad params, context
        # overflow) and is relayed as is; a backend 5xx stays a 5xx. ``code``
        # and ``param``: OpenAI's, when the adapter recognised the error.
        super().__init__(
            message, status=backend_status if 400 <= backend_status < 600 else 502, code=code
        )
        self.backend_status = backend_status
        self.body_excerpt = body_excerpt
        self.param = param


class BackendStreamError(BackendError):
    """The response stream broke: reset, truncated, or an error event inside it."""

    code = "backend_stream_error"
    status = 502


class BackendProtocolError(BackendError):
    """The backend sent data we cannot accept (oversize line, malformed chunks)."""

    code = "backend_protocol_error"
    status = 502
