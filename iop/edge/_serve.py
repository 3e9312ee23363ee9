"""Running the edge: hypercorn's trio worker serving the app, with a drain."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import trio

from iop.config import EdgeConfig
from iop.edge._app import LINK_PATH, SurfaceRoute, create_edge_app
from iop.edge._core import EdgeCore, open_edge_core
from iop.edge._http1 import EdgeHypercornConfig, install
from iop.edge._link_guard import LinkFrameGuard
from iop.edge._stall import StallGuard, serve_guarded
from iop.errors import listen_error_from

__all__ = ["EdgeHandle", "serve_edge"]

log = logging.getLogger("iop.edge")


@dataclass(frozen=True)
class EdgeHandle:
    """What ``serve_edge`` reports once it listens."""

    core: EdgeCore
    url: str  # http://host:port

    @property
    def link_url(self) -> str:
        return "ws" + self.url[len("http") :] + "/v1/link"


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
        ListenError: ``server.host:server.port`` cannot be bound.
    """
    stop = shutdown if shutdown is not None else trio.Event()
    async with open_edge_core(config) as core:
        app = LinkFrameGuard(
            create_edge_app(core, routes=routes),
            path=LINK_PATH,
            hello_limit=config.link.max_hello_bytes,
            max_queued=config.link_queued_bytes,
        )
        # Smuggling and header-size guards below the app (iop/edge/_http1.py).
        install()
        hc = EdgeHypercornConfig(max_header_bytes=config.server.max_header_bytes)
        hc.keep_alive_timeout = config.server.keep_alive_timeout_s
        hc.bind = [f"{config.server.host}:{config.server.port}"]
        hc.accesslog = None
        # hypercorn's own "-" logger prints in its own format; this one goes
        # through the process's handler (one log format, docs/operations.md).
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = 2.0
        # Liveness is the link protocol's heartbeat (hypercorn's ping never
        # checks pongs: docs/architecture.md, "Facts about our dependencies:
        # hypercorn").
        hc.websocket_ping_interval = None
        # The only WebSocket is the node link: no message above its
        # post-hello limit is ever buffered (the guard applies the smaller
        # pre-hello one per connection; docs/operations.md "The node link").
        hc.websocket_max_message_size = config.link_frame_bytes

        async def trigger() -> None:
            await stop.wait()
            log.info("edge: shutting down")
            await core.drain(config.server.drain_timeout_s)

        async with trio.open_nursery() as nursery:
            # Every connection gets the write-stall deadline (iop.edge._stall).
            guard = StallGuard(config.server.write_stall_timeout)
            try:
                binds = await nursery.start(
                    partial(serve_guarded, app, hc, guard, shutdown_trigger=trigger)
                )
            except (OSError, BaseExceptionGroup) as exc:
                error = listen_error_from(hc.bind[0], exc)
                if error is None:
                    raise
                raise error from exc
            url = str(binds[0])
            task_status.started(EdgeHandle(core, url))
