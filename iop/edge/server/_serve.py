"""Running the edge: hypercorn's trio worker serving the app, with a drain.

Every listener is served by ``serve_guarded`` (``iop.edge.server._stall``):
the write-stall guard on each connection, and hypercorn built with the
edge's own classes (``iop.edge.server._hypercorn``) for the HTTP/1.1 guards
(``_http1.py``) and each request's disconnect-aware queue
(``_asgi_queue.py``); nothing in hypercorn is replaced.

One listener (``server.host:server.port``) serves the API and the node link
(``iop.edge.server._link_asgi.EdgeASGI``). With ``link.port`` set, a second one
serves only the link, and the API's no longer does.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Final

import trio

from iop.config import EdgeConfig
from iop.edge._core import EdgeCore, open_edge_core
from iop.edge.routes import SurfaceRoute, create_edge_app
from iop.edge.server._cors import cors
from iop.edge.server._http1 import EdgeHypercornConfig
from iop.edge.server._link_asgi import LINK_PATH, EdgeASGI, LinkEndpoint
from iop.edge.server._stall import StallGuard, serve_guarded
from iop.edge.server._tls import EdgeTLS, EdgeTLSListener
from iop.errors import ListenError, listen_error_from

__all__ = ["EdgeHandle", "check_ports", "serve_edge"]

log = logging.getLogger("iop.edge")

# Said in the 404 a node gets for dialling the API port when the link has its own.
_LINK_ELSEWHERE: Final = " The node link is served on its own port (link.port)."


@dataclass(frozen=True)
class EdgeHandle:
    """What ``serve_edge`` reports once it listens.

    Attributes:
        core: The edge's node links, scheduler and runs.
        url: ``http://host:port`` of the API (``https://`` with TLS).
        link_listener: ``http://host:port`` of the link's own listener
            (``link.port``), None when the link is served on the API's.
        tls: The listeners' TLS contexts (``server.tls_certfile``), None
            for plain HTTP; a config reload calls ``tls.reload(config)``.
    """

    core: EdgeCore
    url: str
    link_listener: str | None = None
    tls: EdgeTLS | None = None

    @property
    def link_url(self) -> str:
        """The URL nodes dial: ``ws://host:port/v1/link``."""
        base = self.link_listener or self.url
        return "ws" + base[len("http") :] + LINK_PATH


def check_ports(config: EdgeConfig) -> None:
    """Raise the ``ListenError`` ``serve_edge`` would for a taken port, now.

    For a process that starts something slow before the edge (``iop up``
    loads a model first). Each configured port (0 is always free) is bound
    with ``SO_REUSEADDR``, as hypercorn binds it, and let go at once: a port
    taken in between still fails in ``serve_edge``.

    Raises:
        ListenError: A port is taken or not ours to take.
    """
    binds = [(config.server.host, config.server.port)]
    if config.link.port is not None:
        binds.append((config.link.host or config.server.host, config.link.port))
    for host, port in binds:
        if port == 0:
            continue
        bind = f"{host}:{port}"
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror:
            continue  # not a bind failure: serve_edge reports it
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                error: ListenError | None = listen_error_from(bind, exc)
                if error is None:
                    raise
                raise error from exc


def _hypercorn_config(config: EdgeConfig, bind: str) -> EdgeHypercornConfig:
    hc = EdgeHypercornConfig(max_header_bytes=config.server.max_header_bytes)
    hc.keep_alive_timeout = config.server.keep_alive_timeout_s
    hc.backlog = config.server.listen_backlog
    hc.bind = [bind]
    hc.accesslog = None
    # hypercorn's own "-" logger prints in its own format; this one goes
    # through the process's handler (one log format, docs/operations.md).
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 2.0
    # Liveness is the link protocol's heartbeat (hypercorn's ping never
    # checks pongs: docs/architecture.md, "Facts about our dependencies:
    # hypercorn").
    hc.websocket_ping_interval = None
    # The only WebSocket is the node link: no message above its post-hello
    # limit is ever buffered (the frame guard applies the smaller pre-hello
    # one per connection; docs/operations.md "The node link").
    hc.websocket_max_message_size = config.link_frame_bytes
    # A TLS handshake is a round trip or two: the patience given to a
    # request head (an unauthenticated peer holds a task meanwhile).
    hc.ssl_handshake_timeout = config.server.keep_alive_timeout_s
    return hc


async def serve_edge(
    config: EdgeConfig,
    *,
    shutdown: trio.Event | None = None,
    routes: Sequence[SurfaceRoute] | None = None,
    task_status: trio.TaskStatus[EdgeHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the edge until ``shutdown`` is set, then drain and return.

    Drain: new runs are refused (503), in-flight runs get
    ``server.drain_timeout_s`` to finish, the rest are cancelled with reason
    ``shutdown`` (their clients get a clean SSE error and ``[DONE]``), node
    links are closed with 1001, then hypercorn stops.

    ``routes`` are the API surfaces to serve (``create_edge_app``'s default
    when None).

    Raises:
        ListenError: ``server.host:server.port`` (or ``link.port``) cannot
            be bound.
    """
    stop = shutdown if shutdown is not None else trio.Event()
    tls = EdgeTLS(config) if EdgeTLS.enabled(config) else None
    async with open_edge_core(config) as core:
        core.tls = tls
        link = LinkEndpoint(
            core.handle_link,
            hello_limit=config.link.max_hello_bytes,
            max_queued=config.link_queued_bytes,
        )
        own_port = config.link.port is not None
        api = EdgeASGI(
            http=cors(create_edge_app(core, routes=routes), config.server.cors_origins),
            link=None if own_port else link,
            elsewhere=_LINK_ELSEWHERE if own_port else "",
        )
        drained = trio.Event()

        async def trigger() -> None:
            await stop.wait()
            log.info("edge: shutting down")
            await core.drain(core.config.server.drain_timeout_s)  # a reload may change it
            drained.set()  # the links are closed (1001): the link's listener may stop

        async with trio.open_nursery() as nursery:
            # Every connection gets the write-stall deadline (iop.edge.server._stall).
            guard = StallGuard(config.server.write_stall_timeout)

            async def listen(
                app: EdgeASGI, bind: str, until: Callable[[], Awaitable[None]], *, link: bool
            ) -> str:
                wrap = None if tls is None else partial(EdgeTLSListener, tls=tls, link=link)
                try:
                    binds = await nursery.start(
                        partial(
                            serve_guarded,
                            app,
                            _hypercorn_config(config, bind),
                            guard,
                            shutdown_trigger=until,
                            tls=wrap,
                        )
                    )
                except (OSError, BaseExceptionGroup) as exc:
                    error = listen_error_from(bind, exc)
                    if error is None:
                        raise
                    raise error from exc
                return str(binds[0])

            link_listener = None
            if own_port:
                # First: a taken link port then fails before the API says it runs.
                host = config.link.host or config.server.host
                link_only = EdgeASGI(http=None, link=link)
                link_listener = await listen(
                    link_only, f"{host}:{config.link.port}", drained.wait, link=True
                )
            url = await listen(
                api, f"{config.server.host}:{config.server.port}", trigger, link=False
            )
            _warn_if_open(config, url)
            task_status.started(EdgeHandle(core, url, link_listener, tls))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _warn_if_open(config: EdgeConfig, url: str) -> None:
    """An edge others can reach, with no client key, serves anyone who asks."""
    host = config.server.host
    if config.server.api_keys or config.tenants or _loopback(host):
        return
    log.warning(
        "edge: listening on %s (server.host %s, beyond this machine) with no client key "
        "(server.api_keys or [[tenants]]): anyone who reaches it may use it",
        url,
        host,
    )
