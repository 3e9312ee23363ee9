"""Models on demand: the node starts the models it may run when runs want them.

``ModelTable`` (sans-IO) decides which model to load, which to evict and
when to unload; ``ModelManager`` (trio) starts and stops their processes
(``iop.ondemand._engines``: llama.cpp, a vLLM command, the sim) and hands
runs leases. docs/operations.md, "Models on demand", says what an operator
sees; docs/protocol.md, "Models on demand", what the edge is told.
"""

from iop.ondemand._engines import BackendFactory, ModelBackend, build_model_backend
from iop.ondemand._instance import ModelAdapter
from iop.ondemand._manager import ModelLease, ModelManager, model_table
from iop.ondemand._table import (
    TRANSITIONS,
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
    "BackendFactory",
    "Decision",
    "GroupSpec",
    "Model",
    "ModelAdapter",
    "ModelBackend",
    "ModelLease",
    "ModelManager",
    "ModelSpec",
    "ModelState",
    "ModelTable",
    "Ready",
    "Refused",
    "StartLoad",
    "StartUnload",
    "Wait",
    "build_model_backend",
    "model_table",
]
