"""The one boundary where a backend's transport errors become ``BackendError``.

After httpx's ``map_httpcore_exceptions``
(https://github.com/encode/httpx/blob/master/httpx/_transports/default.py):
one context manager, ``backend_errors``, is around every call the adapters
make into their transport (``HTTPBackend`` in ``iop/adapters/_http.py``:
sending a request, reading or closing a body), and maps the lower
libraries' exceptions to the project's tree (``iop/errors.py``) with
``raise ... from exc``. No other adapter code catches a transport exception.

What arrives here
-----------------
* httpcore's exceptions, from the node's keep-alive pool
  (``iop/adapters/_pool.py``). trio's errors never get this far: the pool's
  socket raises them as httpcore's, because httpcore's network-stream
  interface requires it (its HTTP/1.1 connection reads a server's early
  answer only after a ``WriteError``) and because only the socket knows the
  phase a deadline ran out in (the connect's: unavailable; a write's: a
  timeout). h11's errors arrive as httpcore's protocol errors too (httpcore
  maps them in its connection).
* httpx's exceptions, from the places that still make them: httpx's own
  transport, used through a proxy (``backend_transport``), httpx's content
  decoders (a gzip body that is not gzip: ``DecodingError``), and any
  transport an adapter is given (the tests' ``FakeTransport``). httpx's tree
  mirrors httpcore's class for class, so each row below names both.

The table, first match wins::

    ConnectError, ConnectTimeout, UnsupportedProtocol  ->  BackendUnavailable  503, fails over
    TimeoutException (read, write, pool)               ->  BackendTimeout      504
    ReadError, WriteError, RemoteProtocolError         ->  BackendStreamError  502
    any other httpcore or httpx error                  ->  BackendError        502

The message is ``<what>: <detail>``: ``what`` says which call failed
(``vllm request failed``), the detail the cause without secrets, naming
``host:port`` and never userinfo, path or query (``transport_detail``).

Only httpcore's and httpx's exceptions are caught (bar httpcore's
pool-internal ``ConnectionNotAvailable``, which no connection of ours
raises): ``trio.Cancelled`` (a ``BaseException``), a ``BackendError``
already mapped and any exception group pass through untouched. No group
of transport errors can arrive: no nursery of ours is around a request
(trio's ``open_tcp_stream`` folds its attempts' errors into one
``OSError``, whose group ``transport_detail`` reads). ``except*`` would be
wrong here: the mapped error raised in an ``except*`` clause would reach
the caller wrapped in a group.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Final

import httpcore
import httpx

from iop.errors import BackendError, BackendStreamError, BackendTimeout, BackendUnavailable

__all__ = ["backend_errors", "transport_detail"]

# The rows of the table above, first match wins.
_TABLE: Final[tuple[tuple[tuple[type[Exception], ...], type[BackendError]], ...]] = (
    (
        (
            httpcore.ConnectError,
            httpcore.ConnectTimeout,
            httpcore.UnsupportedProtocol,
            httpx.ConnectError,
            httpx.ConnectTimeout,
            httpx.UnsupportedProtocol,
        ),
        BackendUnavailable,
    ),
    ((httpcore.TimeoutException, httpx.TimeoutException), BackendTimeout),
    (
        (
            httpcore.ReadError,
            httpcore.WriteError,
            httpcore.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
            httpx.RemoteProtocolError,
        ),
        BackendStreamError,
    ),
)

# Everything the boundary catches: httpcore's exceptions but its pool's
# internal ``ConnectionNotAvailable`` (which no connection of ours raises),
# and httpx's.
_CAUGHT: Final[tuple[type[Exception], ...]] = (
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
    httpcore.ProtocolError,
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpx.HTTPError,
)


@contextlib.contextmanager
def backend_errors(what: str, url: httpx.URL | None = None) -> Iterator[None]:
    """Map a transport error raised in the body to a ``BackendError`` (module docstring).

    Args:
        what: Which call failed; prefixes the message (``vllm request failed``).
        url: Where the request went (its ``host:port`` is named); None for an
            error that names only the httpx request attached to it, if any.

    Raises:
        BackendError: One of its subclasses, as the table says.
    """
    try:
        yield
    except _CAUGHT as exc:
        kind = next((error for sources, error in _TABLE if isinstance(exc, sources)), BackendError)
        raise kind(f"{what}: {transport_detail(exc, url)}") from exc


def transport_detail(exc: Exception, url: httpx.URL | None = None) -> str:
    """A short, secret-free cause: ``connection refused by 127.0.0.1:8000``."""
    where = _where(exc, url)
    if isinstance(exc, httpcore.ConnectTimeout | httpx.ConnectTimeout):
        return f"no connection to {where} within the connect timeout"
    if isinstance(exc, httpcore.ConnectError | httpx.ConnectError):
        os_error = _os_error_under(exc)
        if isinstance(os_error, ConnectionRefusedError):
            return f"connection refused by {where}"
        if isinstance(os_error, socket.gaierror):
            return f"cannot resolve the host of {where} ({os_error.strerror})"
        if os_error is not None and os_error.strerror:
            return f"cannot connect to {where} ({os_error.strerror})"
    return str(exc) or type(exc).__name__


def _where(exc: Exception, url: httpx.URL | None) -> str:
    """``host:port`` the failed request went to (never userinfo, path or query)."""
    if url is None and isinstance(exc, httpx.HTTPError):
        with contextlib.suppress(RuntimeError):  # an httpx error may carry its request
            url = exc.request.url
    if url is None:
        return "the backend"
    return f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"


def _os_error_under(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``'s cause chain and exception groups.

    Over trio the refusal is buried: ``ConnectError`` <- ``OSError("all
    attempts to connect ... failed")`` <- a group of ``ConnectionRefusedError``.
    """
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None
