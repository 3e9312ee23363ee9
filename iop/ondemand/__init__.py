"""Models on demand, sans-IO: which models a node holds, loads and unloads.

``ModelTable`` decides which on-demand model to load, which to evict and
when to unload (``iop.ondemand._table``); it does no IO. Its trio driver is
the node's ``ModelManager`` (``iop.node._models``), which starts and stops
the models' processes (``iop.managed._models``: llama.cpp, a vLLM command,
the sim). docs/operations.md, "Models on demand", says what an operator
sees; docs/protocol.md, "Models on demand", what the edge is told.
"""

from iop.ondemand._table import (
    TRANSITIONS,
    Action,
    Decision,
    GroupSpec,
    Model,
    ModelSpec,
    ModelState,
    ModelTable,
    Ready,
    Refused,
    StartLoad,
    StartUnload,
    Wait,
)

__all__ = [
    "TRANSITIONS",
    "Action",
    "Decision",
    "GroupSpec",
    "Model",
    "ModelSpec",
    "ModelState",
    "ModelTable",
    "Ready",
    "Refused",
    "StartLoad",
    "StartUnload",
    "Wait",
]
