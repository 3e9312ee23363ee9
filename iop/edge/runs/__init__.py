"""The edge's half of a run: the failover executor, each attempt's state,
the node connections runs go over, how a node's events reach its runs, the
link handshake that accepts a node, drains, and the keep-alive clock of the
runs' streams.
"""

from iop.edge.runs._attempt import AttemptEnd, RemoteRun, RunStart
from iop.edge.runs._delivery import (
    RUN_BUFFER_WITHOUT_CREDIT,
    DeliveryPolicy,
    WithoutCredit,
    delivery_policy,
)
from iop.edge.runs._drains import drain_node, drain_runs, known_node, undrain_node
from iop.edge.runs._executor import MAX_ATTEMPTS, RemoteExecutor, RunHost
from iop.edge.runs._handshake import accept_node, node_credentials
from iop.edge.runs._keepalive import KEEPALIVE_RESOLUTION_S, KeepaliveClock, KeepaliveWatch
from iop.edge.runs._links import NodeLinks
from iop.edge.runs._model_controls import LOAD_TIME_BUCKETS, ModelStats, ModelTotals, NodeModels
from iop.edge.runs._nodes import (
    LOAD_FIGURE_CAP,
    InstanceState,
    NodeConnection,
    NodeDrain,
    NodeRegistry,
    ReportedLoad,
)

__all__ = [
    "KEEPALIVE_RESOLUTION_S",
    "LOAD_FIGURE_CAP",
    "LOAD_TIME_BUCKETS",
    "MAX_ATTEMPTS",
    "RUN_BUFFER_WITHOUT_CREDIT",
    "AttemptEnd",
    "DeliveryPolicy",
    "InstanceState",
    "KeepaliveClock",
    "KeepaliveWatch",
    "ModelStats",
    "ModelTotals",
    "NodeConnection",
    "NodeDrain",
    "NodeLinks",
    "NodeModels",
    "NodeRegistry",
    "RemoteExecutor",
    "RemoteRun",
    "ReportedLoad",
    "RunHost",
    "RunStart",
    "WithoutCredit",
    "accept_node",
    "delivery_policy",
    "drain_node",
    "drain_runs",
    "known_node",
    "node_credentials",
    "undrain_node",
]
