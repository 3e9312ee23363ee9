"""Serving a node's link, once accepted: registration, its frames' events, and its end.

``NodeLinks.handle`` serves one node connection until it closes: the
handshake (``iop.edge.runs._handshake``) accepts the node, the registry
takes its connection (replacing a dead link of the same id), and an
``iop.runtime.LinkDriver`` over the link's ``FrameChannel`` (WebSocket in
production, ``iop.testing.memory_link_pair`` in tests) drives it: one
reader, one writer, no other task per link. The reader hands each frame's
events over without blocking (``_on_link_events``): run events to the
connection's delivery, capabilities and load reports to its instances, a
goodbye to its draining flag, the answer to a model load to the scheduler
(``iop.edge.scheduler._ondemand``). When the link ends, however it ends, every
run on it is told (``RemoteRun.lose``: the executor fails it over or ends
it ``node_lost``), the close is logged at the level its cause deserves, and
the scheduler gives the freed slots to waiters.

``NodeLinks.open_local`` serves a node of this process (``iop up``'s) the
same way over an in-process channel (``iop.runtime.local_link_pair``): the
same handshake and session, no socket; ``/admin/nodes`` shows its peer as
``in-process``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Final

import trio

from iop.config import EdgeConfig, LinkSettings
from iop.edge.runs._delivery import DeliveryPolicy
from iop.edge.runs._handshake import accept_node, close_link, edge_session, node_credentials
from iop.edge.runs._nodes import NodeConnection, NodeRegistry
from iop.edge.scheduler import Scheduler
from iop.edge.scheduler._prefix import cache_blocks
from iop.errors import LinkProtocolError
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_GOING_AWAY,
    CLOSE_HEARTBEAT,
    CLOSE_NORMAL,
    CLOSE_REPLACED,
    CapabilitiesChanged,
    EdgeLinkEvent,
    EdgeSession,
    FrameChannel,
    InstanceLoad,
    LinkClosed,
    LoadReported,
    ModelControlAnswered,
    ModelLoadAnswered,
    NodeDraining,
    RunEventsReceived,
    close_code,
    close_reason,
)
from iop.runtime import LinkClock, LinkDriver, LocalFrameChannel, PeerSilent, local_link_pair

__all__ = ["IN_PROCESS_PEER", "NodeLinks"]

log = logging.getLogger("iop.edge")

# The codes no peer sends (RFC 6455, section 7.4.1): what they say happened,
# for a log line that would otherwise repeat the code as its reason.
_CLOSE_MEANING: Final[dict[int | None, str]] = {
    1005: "closed without a status code",
    1006: "the connection dropped without a close frame",
}


# The peer of a link opened by ``NodeLinks.open_local`` (logs, /admin/nodes).
IN_PROCESS_PEER: Final = "in-process"


def _nothing() -> None:
    pass


class NodeLinks:
    """The edge's node links: accepts them, serves them, closes revoked ones.

    ``config`` is the edge's current config (a reload replaces it: the next
    link gets the new limits); ``credentials`` what a hello may present.
    """

    def __init__(
        self,
        config: EdgeConfig,
        registry: NodeRegistry,
        scheduler: Scheduler,
        clock: LinkClock,
        delivery: DeliveryPolicy,
    ) -> None:
        self.config = config
        self.registry = registry
        self.scheduler = scheduler
        self.clock = clock
        self.delivery = delivery
        self.credentials = node_credentials(config.link)

    def set_credentials(self, link: LinkSettings) -> None:
        """Accept ``link``'s node credentials from the next handshake on (a
        config reload), and close (4401) every open link whose credential is
        gone or changed: a revoked token loses its links at once, the other
        nodes keep theirs (``docs/operations.md``, "TLS and node credentials").
        """
        credentials = node_credentials(link)
        self.credentials = credentials
        log.info("node credentials: %d accepted", len(credentials))
        for conn in list(self.registry.nodes.values()):
            held = conn.session.credential
            if held is not None and not credentials.admits(held, conn.node_id):
                log.warning(
                    "node %s: credential %s revoked: closing its link (4401)",
                    conn.node_id,
                    held.name,
                )
                conn.close(CLOSE_BAD_TOKEN, f"credential {held.name} revoked")

    async def handle(
        self,
        chan: FrameChannel,
        peer: str = "",
        *,
        on_open: Callable[[int], None] | None = None,
    ) -> None:
        """Serve one node connection until it closes. Never raises (but Cancelled).

        Args:
            chan: The connection.
            peer: Who is at the other end (address), for logs.
            on_open: Called with the frame limit after the hello once the
                node is accepted, so a transport that enforces the limit
                while buffering (hypercorn) can raise it from the hello's.
        """
        session = edge_session(self.config, self.credentials)
        conn = await accept_node(
            chan, session, self.registry, peer or "?", self.config.link.hello_timeout_s, on_open
        )
        if conn is not None:
            conn.delivery = self.delivery.for_link(conn)
            await self._serve(chan, session, conn)

    @asynccontextmanager
    async def open_local(self) -> AsyncIterator[LocalFrameChannel]:
        """A link to this edge from a node in the same process: its end.

        The edge serves the other end (``handle``) in a task of the caller's
        until the link ends; leaving the block without closing the link ends
        it as a dropped connection (1006), a link loss for the edge. A send
        the other end does not take within the link's heartbeat timeout
        closes it too (``iop.runtime._local_link``).
        """
        edge_end, node_end = local_link_pair(send_timeout_s=self.config.link.heartbeat_timeout_s)
        log.debug("in-process node link opened")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.handle, edge_end, IN_PROCESS_PEER, name="in-process link")
            try:
                yield node_end
            finally:
                node_end.abort()
        log.debug("in-process node link ended (close %s)", node_end.close_code)

    async def _serve(self, chan: FrameChannel, session: EdgeSession, conn: NodeConnection) -> None:
        old = self.registry.add(conn)
        if old is not None:
            # check_id_free let it in: the old link is past its deadline.
            log.warning(
                "node %s reconnected from %s: replacing its previous link from %s "
                "(silent for %.1fs)",
                conn.node_id,
                conn.peer or "?",
                old.peer or "?",
                trio.current_time() - old.session.last_seen,
            )
            old.close(CLOSE_REPLACED, "replaced by a new connection")
        credential = session.credential
        log.info(
            "node %s connected from %s with credential %s: %s",
            conn.node_id,
            conn.peer or "?",
            credential.name if credential is not None else "?",
            ", ".join(
                f"{i.caps.instance}({i.caps.adapter}, {i.caps.provider_status}, "
                f"targets={list(i.caps.targets)}, slots={i.caps.max_concurrency})"
                for i in conn.instances.values()
            )
            or "no instances",
        )
        driver = LinkDriver(
            chan,
            session,
            partial(self._on_link_events, conn),
            peer=f"node {conn.node_id}",
            clock=self.clock,
            backpressure=conn.delivery.backpressure,
        )
        conn.wake = driver.wake
        self.scheduler.dispatch()
        try:
            with conn.cancel_scope:
                await driver.run()
        except PeerSilent:
            log.warning(
                "node %s silent for %.1fs: declaring it lost",
                conn.node_id,
                trio.current_time() - session.last_seen,
            )
            if conn.close_code is None:
                conn.close_code, conn.close_reason = CLOSE_HEARTBEAT, "heartbeat timeout"
        except LinkClosed as closed:
            if conn.close_code is None:
                reason = closed.reason or _CLOSE_MEANING.get(closed.close_code, "no reason given")
                conn.close_code, conn.close_reason = closed.close_code, reason
        except LinkProtocolError as exc:
            code = close_code(exc)
            log.warning("node %s broke the protocol: %s (close %d)", conn.node_id, exc, code)
            conn.close_code, conn.close_reason = code, close_reason(str(exc))
        finally:
            if self.registry.remove(conn):
                # A new link of this node starts cold (iop.edge.scheduler._prefix).
                self.scheduler.prefixes.forget(conn.node_id)
            session.close()
            conn.model_ops.close()
            conn.wake = _nothing
            reason = conn.close_reason or "link closed"
            affected = conn.lose_runs(f"node {conn.node_id} lost: {reason}")
            # Its loads will not be answered: their waiters look elsewhere.
            self.scheduler.node_gone(conn, f"node {conn.node_id} lost: {reason}")
            await close_link(chan, conn.close_code or CLOSE_NORMAL, conn.close_reason)
            self._log_disconnect(conn, affected)
            self.scheduler.dispatch()

    @staticmethod
    def _log_disconnect(conn: NodeConnection, affected: int) -> None:
        """INFO for a clean end (1000/1001, or a goodbye then close), else WARNING."""
        code = conn.close_code
        if code is None and conn.draining:
            # The node said goodbye and the connection dropped without a close frame.
            level, how = logging.INFO, f"left after its goodbye ({conn.goodbye or 'draining'})"
        elif code is None:
            level, how = logging.WARNING, "closed the link without a goodbye"
        elif code in (CLOSE_NORMAL, CLOSE_GOING_AWAY):
            level, how = logging.INFO, f"closed cleanly ({code} {conn.close_reason or 'normal'})"
        else:
            level, how = logging.WARNING, f"lost ({code} {conn.close_reason or 'no reason'})"
        log.log(
            level,
            "node %s disconnected: %s; %d run(s) affected",
            conn.node_id,
            how,
            affected,
        )

    def _bound_prefixes(self, conn: NodeConnection, loads: list[InstanceLoad]) -> None:
        """What each advertised instance's cache holds bounds the prefix index
        (``iop.edge.scheduler._prefix``, ``PrefixIndex.bound``)."""
        settings = self.scheduler.settings
        for load in loads:
            engine = load.engine
            if engine is None or load.instance not in conn.instances:
                continue
            where = (conn.node_id, load.instance)
            blocks = partial(
                cache_blocks,
                block_chars=settings.prefix_block_chars,
                chars_per_token=settings.prefix_chars_per_token,
            )
            if engine.cache_tokens is not None:
                self.scheduler.prefixes.bound(where, blocks(engine.cache_tokens))
            reported = conn.instances[load.instance].reported
            if engine.cached_tokens is not None and reported is not None:
                # What its KV events say it held when its figures were
                # taken (0 after a reset).
                self.scheduler.prefixes.trim(
                    where, blocks(engine.cached_tokens), reported.engine_at, reported.at
                )

    def _on_link_events(self, conn: NodeConnection, events: list[EdgeLinkEvent]) -> None:
        """A frame's events (the link reader: never blocks)."""
        runs: list[RunEventsReceived] = []
        for event in events:
            if isinstance(event, RunEventsReceived):
                runs.append(event)
            elif isinstance(event, CapabilitiesChanged):
                if event.models is not None:
                    conn.model_ops.update(
                        event.models, trio.current_time(), self.registry.model_stats
                    )
                conn.update_instances(event.instances)
                conn.update_models(event.models)
                log.info("node %s updated its capabilities", conn.node_id)
                self.scheduler.dispatch()
            elif isinstance(event, ModelLoadAnswered):
                self.scheduler.load_answered(conn, event.result)
            elif isinstance(event, LoadReported):
                conn.on_load(event.instances, event.at)
                self._bound_prefixes(conn, event.instances)
            elif isinstance(event, ModelControlAnswered):
                conn.model_ops.answer(event.result)
            elif isinstance(event, NodeDraining):
                conn.draining = True
                conn.goodbye = event.reason
                log.info("node %s is draining: %s", conn.node_id, event.reason)
        if runs:
            conn.on_events(runs)
