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
        │   └── ModelLoadRefused    an on-demand model's load refused (pinned)  -> 503
        ├── BackendLost             a backend IOP started died or hung mid-run  -> 503
        ├── BackendTimeout          a transport read/write timed out            -> 504
        ├── BackendHTTPError        the backend answered non-2xx (status, body) -> backend's status
        ├── BackendStreamError      the stream broke: reset, truncated, or an
        │                           error event inside the stream               -> 502
        └── BackendProtocolError    the backend sent malformed data: oversize
                                    line, bad JSON beyond the tolerance         -> 502

Each class carries a stable ``code`` and an HTTP ``status``. Every code IOP
produces is a member of ``ErrorCode``, one enum for every module: failover
and the error mapping compare against its members, never against a string
written somewhere else. It is a ``StrEnum``, so a member *is* its snake_case
wire string: it ends up unchanged in ``Error.code`` events, OpenAI error
bodies and metrics labels. ``Error.code`` itself stays a ``str`` on the wire,
because a backend's code (or a newer node's) must still decode; comparing it
with a member works because a member equals, and hashes as, its value.
docs/api.md ("Error codes") lists them all, with status and meaning
(tests/test_errors.py checks it stays complete). ``CancelReason``, the code
of a cancelled run, lives here too, so this module imports nothing of IOP's.
"""

from __future__ import annotations

import enum
import errno
from typing import Final, TypeVar

__all__ = [
    "BACKEND_FAILURE_CODES",
    "RETRYABLE_CANCEL_REASONS",
    "RETRYABLE_CODES",
    "BackendError",
    "BackendHTTPError",
    "BackendLost",
    "BackendProtocolError",
    "BackendStreamError",
    "BackendTimeout",
    "BackendUnavailable",
    "CancelReason",
    "ConfigError",
    "ErrorCode",
    "InvariantError",
    "IopError",
    "LinkAuthError",
    "LinkClosed",
    "LinkError",
    "LinkLimitError",
    "LinkProtocolError",
    "ListenError",
    "ModelLoadRefused",
    "RequestError",
    "RunAborted",
    "backend_fails_over",
    "first_leaf",
    "listen_error_from",
]


class ErrorCode(enum.StrEnum):
    """Every error code IOP produces (docs/api.md, "Error codes").

    Codes a backend sends are relayed as they are and are not listed here;
    cancel reasons (``iop.events.CancelReason``) are codes of their own.
    """

    # --- the exception tree (each class's default) ---------------------------
    IOP_ERROR = "iop_error"  # an IopError no subclass describes
    CONFIG_ERROR = "config_error"  # a config file or value is wrong
    LISTEN_ERROR = "listen_error"  # a server cannot listen on its address
    INVALID_REQUEST_ERROR = "invalid_request_error"  # the client's request is invalid
    INTERNAL_ERROR = "internal_error"  # a bug in IOP: a broken internal contract, a crash
    RUN_CANCELLED = "run_cancelled"  # an executor ended its run as cancelled
    LINK_ERROR = "link_error"  # the edge<->node link failed
    LINK_AUTH_ERROR = "link_auth_error"  # a node was refused: bad token or version
    LINK_PROTOCOL_ERROR = "link_protocol_error"  # a peer broke the link protocol
    LINK_LIMIT_EXCEEDED = "link_limit_exceeded"  # a peer crossed a link limit
    LINK_CLOSED = "link_closed"  # the link closed
    BACKEND_ERROR = "backend_error"  # the backend failed (no finer code applies)
    BACKEND_UNAVAILABLE = "backend_unavailable"  # the backend cannot be reached
    BACKEND_LOST = "backend_lost"  # a backend IOP started died or hung during the run
    BACKEND_TIMEOUT = "backend_timeout"  # a read or write to the backend timed out
    BACKEND_HTTP_ERROR = "backend_http_error"  # the backend answered non-2xx
    BACKEND_STREAM_ERROR = "backend_stream_error"  # the backend's stream broke
    BACKEND_PROTOCOL_ERROR = "backend_protocol_error"  # the backend sent malformed data
    SSE_LINE_TOO_LONG = "sse_line_too_long"  # a backend SSE line or event over the limit
    TOOL_CALLS_TOO_LARGE = "tool_calls_too_large"  # a backend's tool calls over the limit
    EVENT_TOO_LARGE = "event_too_large"  # one event larger than the link's frame limit

    # --- admission at the edge ---------------------------------------------------
    DRAINING = "draining"  # the edge is shutting down
    NO_NODES = "no_nodes"  # no inference node is connected
    MODEL_NOT_FOUND = "model_not_found"  # no node serves the model (or the backend's 404)
    MODEL_UNAVAILABLE = "model_unavailable"  # the model is known, but no instance is up
    OPERATION_NOT_SUPPORTED = "operation_not_supported"  # the model does not serve the operation
    QUEUE_FULL = "queue_full"  # every slot busy and the queue full (edge or node)
    REQUEST_TOO_LARGE = "request_too_large"  # the run does not fit a frame the node takes

    # --- a node refusing an assigned run -------------------------------------------
    NODE_DRAINING = "node_draining"  # the node is draining
    UNKNOWN_INSTANCE = "unknown_instance"  # the node has no such instance
    RUN_ID_IN_USE = "run_id_in_use"  # the node already runs a run with that id
    MODEL_LOAD_FAILED = "model_load_failed"  # the node's on-demand model failed to load
    MODEL_LOAD_REFUSED = "model_load_refused"  # its load would evict models that must stay
    MODEL_LOAD_TIMEOUT = "model_load_timeout"  # not loaded within node.model_load_timeout_s
    BAD_NODE_EVENTS = "bad_node_events"  # a node sent a run's events out of order

    # --- HTTP, before a request reaches a surface -----------------------------------
    BAD_REQUEST = "bad_request"  # malformed HTTP/1.1
    INVALID_REQUEST = "invalid_request"  # both Content-Length and Transfer-Encoding
    REQUEST_HEADER_FIELDS_TOO_LARGE = "request_header_fields_too_large"  # head over the limit
    HTTP_VERSION_NOT_SUPPORTED = "http_version_not_supported"  # HTTP/2 in clear text
    NOT_FOUND = "not_found"  # no such route
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the route does not take the method
    REQUEST_TIMEOUT = "request_timeout"  # the body did not arrive in time
    REQUEST_ENTITY_TOO_LARGE = "request_entity_too_large"  # the body over the limit
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a body that is not JSON
    INVALID_API_KEY = "invalid_api_key"  # the API key (or admin key) is missing or wrong
    TOO_MANY_WRONG_KEYS = "too_many_wrong_keys"  # admin logins are braked
    CROSS_ORIGIN = "cross_origin"  # an admin form posted from another site
    ADMIN_DISABLED = "admin_disabled"  # client keys set, no admin key: the admin views are off
    METRICS_DISABLED = "metrics_disabled"  # client keys set, no metrics or admin key
    NODE_NOT_FOUND = "node_not_found"  # drain/undrain of a node id neither connected nor drained
    RELOAD_UNAVAILABLE = "reload_unavailable"  # POST /admin/reload on an edge with no config file
    MODEL_PINNED = "model_pinned"  # an operator's unload of a pinned on-demand model
    MODEL_CONTROLS_UNSUPPORTED = "model_controls_unsupported"  # a node too old for them
    MODEL_CONTROL_TIMEOUT = "model_control_timeout"  # the node did not answer a model control

    # --- a request body OpenAI would refuse (OpenAI's codes) -------------------------
    INVALID_JSON = "invalid_json"  # the body is not JSON
    JSON_TOO_DEEP = "json_too_deep"  # the body nests too deeply
    INVALID_TYPE = "invalid_type"  # a value of the wrong type
    INVALID_VALUE = "invalid_value"  # a value that is not allowed
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"  # a required field is missing
    EMPTY_ARRAY = "empty_array"  # an array that must not be empty is
    UNSUPPORTED_VALUE = "unsupported_value"  # a value this server does not support
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a parameter this server does not support
    INTEGER_BELOW_MIN_VALUE = "integer_below_min_value"  # an integer below its range
    INTEGER_ABOVE_MAX_VALUE = "integer_above_max_value"  # an integer above its range
    DECIMAL_BELOW_MIN_VALUE = "decimal_below_min_value"  # a number below its range
    DECIMAL_ABOVE_MAX_VALUE = "decimal_above_max_value"  # a number above its range
    OBJECT_ABOVE_MAX_PROPERTIES = "object_above_max_properties"  # an object with too many keys
    STRING_ABOVE_MAX_LENGTH = "string_above_max_length"  # a string over its length limit
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"  # not in the Responses store
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"  # a batch file's custom_id used twice
    BATCH_CANCELLED = "batch_cancelled"  # a batch line not run: its batch was cancelled
    BATCH_EXPIRED = "batch_expired"  # a batch line not run within its completion window

    # --- a backend's error, in OpenAI's words ---------------------------------------
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt exceeds the context
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # the backend answered 429
    SERVER_ERROR = "server_error"  # a failed Responses stream, any other cause


class CancelReason(enum.StrEnum):
    """Why a run was cancelled. Each cause has its own reason.

    docs/architecture.md, "How a run is cancelled", lists the causes.

    The code of a cancelled run (``Cancelled.reason``, ``RunAborted.reason``,
    the ``code`` of its error body); ``iop.events`` re-exports it.
    """

    CLIENT_DISCONNECT = "client_disconnect"
    NODE_LOST = "node_lost"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    QUEUE_TIMEOUT = "queue_timeout"
    EXPLICIT = "explicit"
    SHUTDOWN = "shutdown"
    # The client accepted nothing for ``server.write_stall_timeout_s`` (edge).
    SLOW_CLIENT = "slow_client"


# A node's error before Start that another node may not have: the edge fails
# the run over (iop/edge/runs/_attempt.py). ``Error.code`` is a ``str``: test it with
# ``code in RETRYABLE_CODES`` (a member hashes as its value; a code that is no
# member is simply not in the set).
RETRYABLE_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.QUEUE_FULL,
        ErrorCode.NODE_DRAINING,
        ErrorCode.UNKNOWN_INSTANCE,
        ErrorCode.BACKEND_UNAVAILABLE,
        ErrorCode.BACKEND_LOST,
        # Another node may have the model loaded, or room for it.
        ErrorCode.MODEL_LOAD_FAILED,
        ErrorCode.MODEL_LOAD_REFUSED,
        ErrorCode.MODEL_LOAD_TIMEOUT,
    }
)

# A backend's failure before any output that another instance may not have:
# the backend died, broke its stream or answered a 5xx (or a 429) before its
# first token (``backend_fails_over``). Nothing of the answer reached the client, so the
# edge tries the run on another instance (iop/edge/runs/_attempt.py); a 4xx
# (a bad request, context overflow) would be the same anywhere.
BACKEND_FAILURE_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.BACKEND_ERROR,
        ErrorCode.BACKEND_TIMEOUT,
        ErrorCode.BACKEND_HTTP_ERROR,
        ErrorCode.BACKEND_STREAM_ERROR,
        ErrorCode.BACKEND_PROTOCOL_ERROR,
    }
)


def backend_fails_over(code: str, status: int) -> bool:
    """Whether a node's ``Error`` before any output is its backend's failure
    another instance may not have: ``BACKEND_FAILURE_CODES`` with a 5xx, or
    the backend's 429 (``rate_limit_exceeded``: that server is out of
    capacity or over a limit of its own; another may have room). When every
    instance answers so, the last answer reaches the client as it came."""
    if status == 429:
        return code == ErrorCode.RATE_LIMIT_EXCEEDED
    return status >= 500 and code in BACKEND_FAILURE_CODES


# A node's ``Cancelled`` before any output that another node may not give:
# the run waited in the node's own queue for its ``queue_timeout_s`` (the
# node's slots were taken, e.g. by another edge's runs) and never ran. A
# ``Cancelled`` the edge asked for never reaches the run (the edge forgot it).
RETRYABLE_CANCEL_REASONS: Final[frozenset[CancelReason]] = frozenset({CancelReason.QUEUE_TIMEOUT})


class IopError(Exception):
    """Base of every IOP error.

    Attributes:
        message: Human readable, safe to show a client (no secrets).
        status: The HTTP status this error maps to.
        code: Stable machine-readable code.
        param: The request parameter OpenAI's error body names, if any.
    """

    code: ErrorCode = ErrorCode.IOP_ERROR
    status: int = 500
    param: str | None = None

    def __init__(
        self, message: str, *, status: int | None = None, code: ErrorCode | None = None
    ) -> None:
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

    code = ErrorCode.CONFIG_ERROR
    status = 500


class ListenError(IopError):
    """A server cannot listen on its address: the port is taken, or not ours to take.

    Attributes:
        address: ``host:port`` as configured.
        in_use: The port is held by another process (``EADDRINUSE``).
    """

    code = ErrorCode.LISTEN_ERROR

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

    code = ErrorCode.INVALID_REQUEST_ERROR
    status = 400

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: ErrorCode | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.param = param


class InvariantError(IopError):
    """An internal contract was broken, e.g. an adapter emitted two terminal events."""

    code = ErrorCode.INTERNAL_ERROR
    status = 500


class RunAborted(IopError):
    """An executor ends its run as cancelled rather than failed.

    The runtime turns it into ``Cancelled(reason)``; the edge raises it when
    a run's node is lost, so the client learns the run was cut off.

    Attributes:
        reason: Why the run was cancelled.
    """

    code = ErrorCode.RUN_CANCELLED
    status = 503

    def __init__(self, message: str, *, reason: CancelReason) -> None:
        super().__init__(message)
        self.reason = reason


class LinkError(IopError):
    """The edge<->node link failed."""

    code = ErrorCode.LINK_ERROR
    status = 503


class LinkAuthError(LinkError):
    """A node was refused: bad token or unsupported protocol version."""

    code = ErrorCode.LINK_AUTH_ERROR
    status = 401


class LinkProtocolError(LinkError):
    """A peer sent a frame that breaks the link protocol."""

    code = ErrorCode.LINK_PROTOCOL_ERROR
    status = 502


class LinkLimitError(LinkProtocolError):
    """A peer crossed a limit of the link: a frame too large, too many messages.

    Attributes:
        close_code: The WebSocket close code the link is closed with.
    """

    code = ErrorCode.LINK_LIMIT_EXCEEDED

    def __init__(self, message: str, *, close_code: int) -> None:
        super().__init__(message)
        self.close_code = close_code


class LinkClosed(LinkError):
    """The link is closed; ``close_code``/``reason`` say why (when known)."""

    code = ErrorCode.LINK_CLOSED

    def __init__(self, message: str, *, close_code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.close_code = close_code
        self.reason = reason


class BackendError(IopError):
    """The inference backend failed."""

    code = ErrorCode.BACKEND_ERROR
    status = 502


class BackendUnavailable(BackendError):
    """The backend could not be reached (refused, DNS, connect timeout)."""

    code = ErrorCode.BACKEND_UNAVAILABLE
    status = 503


class ModelLoadRefused(BackendUnavailable):
    """A node's on-demand model may not be loaded now: models that must stay
    are in the way (``iop.ondemand``'s ``Refused``).

    Attributes:
        pinned: The pinned models in the way when they make the refusal last
            until an operator unpins one; empty when it passes (runs in
            flight, ``min_residency_s``).
    """

    code = ErrorCode.MODEL_LOAD_REFUSED

    def __init__(self, message: str, *, pinned: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pinned = pinned


class BackendLost(BackendError):
    """A backend IOP started itself (``iop.managed``) exited or hung while a run used it.

    503 like ``BackendUnavailable`` (another node, or this one once the
    backend is restarted, may serve it) and retryable before any output: the
    edge fails the run over.
    """

    code = ErrorCode.BACKEND_LOST
    status = 503


class BackendTimeout(BackendError):
    """A transport-level read or write to the backend timed out."""

    code = ErrorCode.BACKEND_TIMEOUT
    status = 504


class BackendHTTPError(BackendError):
    """The backend answered with a non-2xx status.

    Attributes:
        backend_status: The status the backend sent.
        body_excerpt: At most a few KiB of the response body, for diagnosis.
    """

    code = ErrorCode.BACKEND_HTTP_ERROR

    def __init__(
        self,
        message: str,
        *,
        backend_status: int,
        body_excerpt: str = "",
        code: ErrorCode | None = None,
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

    code = ErrorCode.BACKEND_STREAM_ERROR
    status = 502


class BackendProtocolError(BackendError):
    """The backend sent data we cannot accept (oversize line, malformed chunks)."""

    code = ErrorCode.BACKEND_PROTOCOL_ERROR
    status = 502


_Leaf = TypeVar("_Leaf", bound=BaseException)


def first_leaf(group: BaseExceptionGroup[_Leaf], kind: type[_Leaf]) -> _Leaf:
    """The first leaf of ``group`` (groups nest), which ``except*`` says is a ``kind``.

    For a handler that reports one cause: a nursery that failed with several
    errors of a kind reports the first.
    """
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    if not isinstance(leaf, kind):  # pragma: no cover - except* guarantees it
        raise TypeError(f"expected a {kind.__name__}, got {type(leaf).__name__}")
    return leaf
