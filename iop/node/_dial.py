"""Dialling the edges: connect, serve the link, back off, repeat.

One ``Dialer.dial`` task per configured edge keeps that edge dialled. On
loss it reconnects with exponential backoff and jitter ("equal jitter", so
the nodes of a restarted edge do not all come back at once); a link that
stayed up ``STABLE_LINK_S`` was healthy and restarts the backoff. An edge
that refuses the node's token, or says another node took its id, is
retried only at the maximum backoff, with an error log naming the edge, so
a misconfiguration is visible and never a hot loop.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Final, Protocol

import trio

from iop.config import NodeEdge, NodeSection
from iop.errors import LinkAuthError, LinkError, first_leaf
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_ID_IN_USE,
    CLOSE_NORMAL,
    CLOSE_REPLACED,
    FrameChannel,
    LinkClosed,
    Welcome,
)

__all__ = ["MIN_RECONNECT_DELAY_S", "STABLE_LINK_S", "ConnectFactory", "Dialer"]

log = logging.getLogger("iop.node")

# A link that stayed up this long was healthy: the reconnect backoff restarts
# from reconnect_min_s.
STABLE_LINK_S: Final = 5.0
# Floor of the reconnect delay: reconnect_min_s = 0 must not become a hot loop.
MIN_RECONNECT_DELAY_S: Final = 0.05

ConnectFactory = Callable[[NodeEdge], AbstractAsyncContextManager[FrameChannel]]
"""Opens a link to an edge: ``connect(edge)`` yields a connected ``FrameChannel``."""


class ServeLink(Protocol):
    def __call__(
        self, chan: FrameChannel, *, edge: NodeEdge, task_status: trio.TaskStatus[Welcome]
    ) -> Awaitable[None]: ...


def _refused(exc: LinkError) -> bool:
    """The edge refused this node itself: retrying soon would only repeat it."""
    if isinstance(exc, LinkAuthError):
        return True
    return isinstance(exc, LinkClosed) and exc.close_code in (
        CLOSE_BAD_TOKEN,
        CLOSE_REPLACED,
        CLOSE_ID_IN_USE,
    )


class Dialer:
    """Keeps edges dialled for one node.

    Args:
        node_id: The node's id (for logs).
        settings: The ``[node]`` section (reconnect delays).
        instance_names: The node's instances (for logs).
        serve_link: Serves one connected link until it ends.
        draining: Whether the node is draining (then it stops dialling).
    """

    def __init__(
        self,
        *,
        node_id: str,
        settings: NodeSection,
        instance_names: list[str],
        serve_link: ServeLink,
        draining: Callable[[], bool],
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.instance_names = instance_names
        self._serve_link = serve_link
        self._draining = draining
        self._rng = random.Random()

    async def dial(self, edge: NodeEdge, connect: ConnectFactory) -> None:
        """Keep one edge dialled: connect, serve the link, back off, repeat."""
        failures = 0
        while not self._draining():
            log.info("connecting to edge %s", edge.url)
            connected_at = math.inf
            failure: LinkError | None = None
            try:
                async with connect(edge) as chan, trio.open_nursery() as nursery:
                    await nursery.start(partial(self._serve_link, chan, edge=edge))
                    connected_at = trio.current_time()
                    log.info(
                        "connected to edge %s as node %s, instances: %s",
                        edge.url,
                        self.node_id,
                        ", ".join(self.instance_names) or "(none)",
                    )
            except* LinkError as group:
                failure = first_leaf(group, LinkError)
            except* Exception as group:
                # A bug must not take the node off the network for good: log
                # it loudly and reconnect like after any other failure.
                log.error("link to edge %s crashed", edge.url, exc_info=group)
                failure = LinkError(f"link to edge {edge.url} crashed")
            if self._draining() or failure is None:
                return
            lived = trio.current_time() - connected_at
            if _refused(failure):
                delay = self.settings.reconnect_max_s
                if isinstance(failure, LinkClosed) and failure.close_code == CLOSE_ID_IN_USE:
                    hint = (
                        f"another live node already uses the id {self.node_id!r} on that "
                        "edge; give each node its own node.id"
                    )
                else:
                    hint = "check the node's id and the token of this edge in the config"
                log.error(
                    "edge %s refused node %s: %s; %s; retrying in %.1fs",
                    edge.url,
                    self.node_id,
                    failure,
                    hint,
                    delay,
                )
                failures = 0
            else:
                if lived >= STABLE_LINK_S:
                    failures = 0
                delay = self._backoff(failures)
                failures += 1
                if connected_at == math.inf:
                    where = "" if edge.url in failure.message else f"edge {edge.url}: "
                    log.warning("%s%s; retrying in %.1fs", where, failure, delay)
                elif isinstance(failure, LinkClosed):
                    clean = failure.close_code in (CLOSE_NORMAL, CLOSE_GOING_AWAY)
                    log.log(
                        logging.INFO if clean else logging.WARNING,
                        "link to edge %s %s (close %s %s) after %.1fs; reconnecting in %.1fs",
                        edge.url,
                        "closed" if clean else "lost",
                        failure.close_code,
                        failure.reason or failure.message,
                        lived,
                        delay,
                    )
                else:
                    log.warning(
                        "link to edge %s lost: %s; reconnecting in %.1fs", edge.url, failure, delay
                    )
            await trio.sleep(delay)

    def _backoff(self, failures: int) -> float:
        """Exponential backoff with jitter, within [reconnect_min_s, reconnect_max_s]."""
        lo = max(self.settings.reconnect_min_s, MIN_RECONNECT_DELAY_S)
        hi = self.settings.reconnect_max_s
        nominal = min(hi, lo * 2.0 ** min(failures, 32))
        # "Equal jitter": spread reconnects of many nodes after an edge restart.
        return max(lo, self._rng.uniform(nominal / 2, nominal))
