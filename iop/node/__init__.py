"""The node agent: adapter instances, their capacity, and the links to edges.

``open_node_agent`` opens a ``NodeAgent``; ``NodeAgent.serve`` dials the
configured edges (``open_ws_link``, a WebSocket) and keeps them dialled;
``NodeAgent.serve_link`` drives one link (``iop.node._link``); ``InstanceSlots`` is the
per-instance capacity limiter. See ``iop.node._agent`` for the theory of
operation.
"""

from iop.node._agent import (
    CLOSE_TIMEOUT_S,
    DRAIN_FLUSH_TIMEOUT_S,
    MIN_RECONNECT_DELAY_S,
    PROBE_GUARD_S,
    STABLE_LINK_S,
    WELCOME_TIMEOUT_S,
    ConnectFactory,
    InstanceSnapshot,
    LinkSnapshot,
    NodeAgent,
    NodeSnapshot,
    RunSnapshot,
    open_node_agent,
)
from iop.node._slots import InstanceSlots
from iop.node._ws import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DISCONNECT_TIMEOUT_S,
    MAX_FRAME_BYTES,
    WebSocketFrameChannel,
    open_ws_link,
)

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DISCONNECT_TIMEOUT_S",
    "DRAIN_FLUSH_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "MIN_RECONNECT_DELAY_S",
    "PROBE_GUARD_S",
    "STABLE_LINK_S",
    "WELCOME_TIMEOUT_S",
    "ConnectFactory",
    "InstanceSlots",
    "InstanceSnapshot",
    "LinkSnapshot",
    "NodeAgent",
    "NodeSnapshot",
    "RunSnapshot",
    "WebSocketFrameChannel",
    "open_node_agent",
    "open_ws_link",
]
