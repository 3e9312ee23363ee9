"""Accepting a node: its hello, the token check, a node id already in use, and the close codes.

A node opens its link with a hello (``iop.protocol``, "Handshake"); the
session checks its token against the node credentials (``node_credentials``,
``iop.protocol._credentials``) and its frame limits. ``accept_node`` then
refuses a node id whose link is alive (a live one is never taken over: a
reconnecting node replaces only a link past its liveness deadline) and
welcomes the node, or closes the connection with the code that says why:

==================  ====================================================
close code          why (``iop.protocol._transport``)
==================  ====================================================
``4401``            the token is not accepted (``LinkAuthError``)
``4410``            the node id is in use by a live link
the limit's code    a hello or frame over a limit (``LinkLimitError``)
``4400``            a protocol error, or no hello within ``hello_timeout_s``
==================  ====================================================

Our side of a close is bounded by ``CLOSE_TIMEOUT_S``: a peer that stopped
reading must not keep a handler, or a drain, waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

import trio

from iop.config import MAX_LOAD_REPORTS_PER_S, EdgeConfig, LinkSettings
from iop.edge.runs._model_controls import NodeModels
from iop.edge.runs._nodes import NodeConnection, NodeRegistry
from iop.errors import LinkAuthError, LinkError, LinkLimitError, LinkProtocolError
from iop.protocol import (
    CLOSE_BAD_TOKEN,
    CLOSE_ID_IN_USE,
    CLOSE_PROTOCOL,
    EdgeSession,
    FrameChannel,
    LinkClosed,
    NodeCredentials,
    NodeJoined,
    close_reason,
)

__all__ = ["CLOSE_TIMEOUT_S", "accept_node", "close_link", "edge_session", "node_credentials"]

log = logging.getLogger("iop.edge")

# Our side of closing a link (shielded cleanup, so it must be short): a peer
# that stopped reading must not keep a handler, or a drain, waiting.
CLOSE_TIMEOUT_S: Final = 1.0


def node_credentials(link: LinkSettings) -> NodeCredentials:
    """The node credentials ``link`` configures: its shared tokens and its
    ``[[link.nodes]]`` (``iop.protocol._credentials``)."""
    return NodeCredentials(
        shared=link.node_tokens,
        nodes=((n.name, n.token_sha256, n.node_ids) for n in link.nodes),
    )


class _NodeIdInUse(LinkError):
    """A second connection presented the id of a node whose link is alive."""


async def close_link(chan: FrameChannel, code: int, reason: str) -> None:
    """Close ``chan`` within ``CLOSE_TIMEOUT_S``, even while being cancelled."""
    with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        await chan.aclose(code, close_reason(reason))


def edge_session(config: EdgeConfig, credentials: NodeCredentials) -> EdgeSession:
    """The edge's side of a new link, with ``config``'s limits and ``credentials``."""
    link = config.link
    return EdgeSession(
        tokens=credentials,
        heartbeat_interval_s=link.heartbeat_interval_s,
        heartbeat_timeout_s=link.heartbeat_timeout_s,
        now=trio.current_time(),
        max_hello_bytes=link.max_hello_bytes,
        max_frame_bytes=config.link_frame_bytes,
        control_rate_per_s=link.control_rate_per_s,
        control_burst=link.control_burst,
        # A quarter of the budget the reports share with pings and
        # capability updates: a node at this rate never runs it dry.
        load_reports_per_s=min(MAX_LOAD_REPORTS_PER_S, link.control_rate_per_s / 4),
        load_stale_s=config.scheduler.load_stale_s,
    )


async def accept_node(
    chan: FrameChannel,
    session: EdgeSession,
    registry: NodeRegistry,
    who: str,
    hello_timeout_s: float,
    on_open: Callable[[int], None] | None = None,
) -> NodeConnection | None:
    """The node at ``chan``, welcomed; or None, the link refused and closed.

    Never raises (but Cancelled).

    Args:
        chan: The connection.
        session: Its edge session (``edge_session``).
        registry: The connected nodes, whose live ids are refused.
        who: Who is at the other end (address), for logs.
        hello_timeout_s: How long the hello may take.
        on_open: Called with the frame limit after the hello once the
            node is accepted, so a transport that enforces the limit
            while buffering (hypercorn) can raise it from the hello's.
    """
    try:
        opened = await _handshake(chan, session, registry, hello_timeout_s, on_open)
    except LinkClosed as exc:
        log.info("node link from %s closed during handshake: %s", who, exc)
        return None
    except LinkAuthError as exc:
        log.warning("refusing node from %s: %s", who, exc)
        await close_link(chan, CLOSE_BAD_TOKEN, exc.message)
        return None
    except _NodeIdInUse as exc:
        log.warning("refusing node from %s: %s", who, exc)
        await close_link(chan, CLOSE_ID_IN_USE, exc.message)
        return None
    except LinkLimitError as exc:
        log.warning("refusing node link from %s: %s (close %d)", who, exc, exc.close_code)
        await close_link(chan, exc.close_code, exc.message)
        return None
    except LinkProtocolError as exc:
        log.warning("refusing node link from %s: %s", who, exc)
        await close_link(chan, CLOSE_PROTOCOL, exc.message)
        return None
    if opened is None:
        log.warning("node link from %s: no hello within %gs", who, hello_timeout_s)
        await close_link(chan, CLOSE_PROTOCOL, "no hello")
        return None
    conn = opened
    conn.peer = who
    try:
        # Again, with no wait before the registration: two newcomers
        # with one id may both have passed the check before the welcome.
        check_id_free(registry, conn.node_id)
    except _NodeIdInUse as exc:
        log.warning("refusing node from %s: %s", who, exc)
        await close_link(chan, CLOSE_ID_IN_USE, exc.message)
        return None
    return conn


async def _handshake(
    chan: FrameChannel,
    session: EdgeSession,
    registry: NodeRegistry,
    hello_timeout_s: float,
    on_open: Callable[[int], None] | None,
) -> NodeConnection | None:
    with trio.move_on_after(hello_timeout_s):
        frame = await chan.receive()
        (event,) = session.receive(frame, trio.current_time())
        assert isinstance(event, NodeJoined)
        hello = event.hello
        check_id_free(registry, hello.node_id)
        if on_open is not None:
            # Before the welcome: the node may answer it with a big frame at once.
            on_open(session.max_frame_bytes)
        await chan.send(session.welcome())
        conn = NodeConnection(
            node_id=hello.node_id,
            session=session,
            instances={},
            connected_at=time.time(),
            software=hello.software,
            memory_mib=hello.memory_mib,
        )
        conn.update_instances(hello.instances)
        conn.update_models(hello.models)
        conn.model_ops = NodeModels(
            hello.models,
            hello.memory_mib,
            controls=hello.model_controls,
            now=trio.current_time(),
        )
        for offer in hello.models:
            registry.model_stats.known(offer.model)
        return conn
    return None


def check_id_free(registry: NodeRegistry, node_id: str) -> None:
    """Refuse a node id whose link is alive: it must not be taken over.

    A registered link is alive until its liveness deadline (last frame
    plus ``heartbeat_timeout_s``) has passed; a node pings every
    ``heartbeat_interval_s``, so a live node is never near it. A link
    past its deadline is dead (the link clock is about to close it) and a
    reconnecting node may replace it.

    Raises:
        _NodeIdInUse: The id is served by a live link.
    """
    old = registry.nodes.get(node_id)
    if old is None:
        return
    now = trio.current_time()
    if now < old.session.liveness_deadline:
        raise _NodeIdInUse(
            f"node id {node_id!r} is in use by a live link from {old.peer or '?'} "
            f"(last heard {now - old.session.last_seen:.1f}s ago); "
            "each node needs its own node.id"
        )
