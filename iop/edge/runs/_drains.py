"""Drains: an operator's drain of a node id, and the edge's own drain at shutdown.

An operator drains a node id (``POST /admin/nodes/{id}/drain``): no new run
goes there until it is undrained, across the node's reconnects, and the
runs on it go on to their end (``NodeRegistry.drained``; docs/operations.md,
"Draining a node"). Undraining lets queued runs go there first.

The edge drains itself at shutdown (``drain_runs``): new runs are refused
(``EdgeCore.draining``), runs in flight get ``timeout_s`` to finish, the
rest are cancelled (``shutdown``) and every node link is closed (1001).
"""

from __future__ import annotations

import logging
import time
from typing import Final

import trio

from iop.edge.runs._nodes import NodeDrain, NodeRegistry
from iop.edge.scheduler import Scheduler
from iop.events import CancelReason
from iop.protocol import CLOSE_GOING_AWAY
from iop.runtime import RunSupervisor

__all__ = ["CANCEL_SEND_TIMEOUT_S", "drain_node", "drain_runs", "known_node", "undrain_node"]

log = logging.getLogger("iop.edge")

# How long cancelled runs may take to end on a drain.
CANCEL_SEND_TIMEOUT_S: Final = 1.0


def known_node(registry: NodeRegistry, node_id: str) -> bool:
    """Whether ``node_id`` is connected or drained (what drain and undrain act on)."""
    return node_id in registry.nodes or node_id in registry.drained


def drain_node(registry: NodeRegistry, node_id: str, *, reason: str = "", by: str = "") -> bool:
    """An operator's drain of ``node_id``: no new runs go there until
    ``undrain_node``, across its reconnects; its runs go on to their end.

    Returns:
        Whether it changed anything (False: already drained, kept as it was).

    Raises:
        KeyError: No node of that id is connected or drained.
    """
    if not known_node(registry, node_id):
        raise KeyError(node_id)
    if node_id in registry.drained:
        return False
    registry.drained[node_id] = NodeDrain(reason=reason, by=by, since_unix=time.time())
    conn = registry.nodes.get(node_id)
    log.warning(
        "node %s drained by %s%s: no new runs go there; %d run(s) on it go on",
        node_id,
        by or "?",
        f" ({reason})" if reason else "",
        0 if conn is None else len(conn.runs),
    )
    return True


def undrain_node(
    registry: NodeRegistry, scheduler: Scheduler, node_id: str, *, by: str = ""
) -> bool:
    """Undo ``drain_node``: ``node_id`` takes runs again (queued ones first).

    Returns:
        Whether it changed anything (False: it was not drained).

    Raises:
        KeyError: No node of that id is connected or drained.
    """
    if not known_node(registry, node_id):
        raise KeyError(node_id)
    if registry.drained.pop(node_id, None) is None:
        return False
    log.warning("node %s undrained by %s: it takes runs again", node_id, by or "?")
    scheduler.dispatch()
    return True


async def drain_runs(supervisor: RunSupervisor, registry: NodeRegistry, timeout_s: float) -> None:
    """Let in-flight runs finish for ``timeout_s``, cancel the rest, close the links."""
    if supervisor.runs:
        log.info("draining: waiting up to %gs for %d run(s)", timeout_s, len(supervisor.runs))
    with trio.move_on_after(timeout_s):
        await supervisor.wait_idle()
    if supervisor.runs:
        log.warning("drain: cancelling %d run(s) still going", len(supervisor.runs))
        supervisor.cancel_all(CancelReason.SHUTDOWN)
        with trio.move_on_after(CANCEL_SEND_TIMEOUT_S * 2):
            await supervisor.wait_idle()
    for conn in list(registry.nodes.values()):
        conn.close(CLOSE_GOING_AWAY, "edge shutting down")
