"""Running the edge: hypercorn's trio worker serving the app, with a drain."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import trio
from hypercorn.trio import serve

from iop.config import EdgeConfig
from iop.edge._app import create_edge_app
from iop.edge._core import EdgeCore, open_edge_core
from iop.edge._http1 import EdgeHypercornConfig, install

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
    task_status: trio.TaskStatus[EdgeHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the edge until ``shutdown`` is set, then drain and return.

    Drain: new runs are refused (503), in-flight runs get
    ``server.drain_timeout_s`` to finish, the rest are cancelled with reason
    ``shutdown`` (their clients get a clean SSE error and ``[DONE]``), node
    links are closed with 1001, then hypercorn stops.
    """
    stop = shutdown if shutdown is not None else trio.Event()
    async with open_edge_core(config) as core:
        app = create_edge_app(core)
        # Smuggling and header-size guards below the app (iop/edge/_http1.py).
        install()
        hc = EdgeHypercornConfig(max_header_bytes=config.server.max_header_bytes)
        hc.bind = [f"{config.server.host}:{config.server.port}"]
        hc.accesslog = None
        hc.graceful_timeout = 2.0
        # Liveness is the link protocol's heartbeat (hypercorn's ping never
        # checks pongs: trio-stack.md §4).
        hc.websocket_ping_interval = None

        async def trigger() -> None:
            await stop.wait()
            log.info("edge: shutting down")
            await core.drain(config.server.drain_timeout_s)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, app, hc, shutdown_trigger=trigger))
            url = str(binds[0])
            task_status.started(EdgeHandle(core, url))
