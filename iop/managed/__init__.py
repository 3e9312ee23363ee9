"""Backends IOP runs itself, as supervised child processes.

``serve_llamacpp`` runs llama.cpp's own HTTP server (from the xllamacpp
wheel) with a small model shipped in a wheel, the embedded default backend
of ``iop up``; ``llamacpp_available`` says whether it can run here, and why
not. ``ManagedLlamaCppAdapter`` is a node's ``llamacpp`` instance: the
server, kept serving by a ``Supervisor`` (restarts with backoff, crash
loops, a liveness check), and the runs on it; ``build_model_backend`` one
load of a node's on-demand model (``iop.managed._models``); ``open_adapter`` gives any
instance's adapter for one use (``iop probe``, ``iop run``).
"""

from iop.managed._adapter import (
    LOSS_CONFIRM_S,
    ManagedLlamaCppAdapter,
    build_instance_adapter,
    llamacpp_settings,
    open_adapter,
)
from iop.managed._llamacpp import (
    LlamaCppEndpoint,
    LlamaCppSettings,
    launcher_command,
    llamacpp_available,
    open_llamacpp,
    serve_llamacpp,
)
from iop.managed._models import BackendFactory, ModelBackend, build_model_backend
from iop.managed._supervise import (
    OPERATOR_ACTION,
    BackendState,
    Life,
    RestartPolicy,
    ServeFn,
    SupervisedAdapter,
    Supervisor,
)

__all__ = [
    "LOSS_CONFIRM_S",
    "OPERATOR_ACTION",
    "BackendFactory",
    "BackendState",
    "Life",
    "LlamaCppEndpoint",
    "LlamaCppSettings",
    "ManagedLlamaCppAdapter",
    "ModelBackend",
    "RestartPolicy",
    "ServeFn",
    "SupervisedAdapter",
    "Supervisor",
    "build_instance_adapter",
    "build_model_backend",
    "launcher_command",
    "llamacpp_available",
    "llamacpp_settings",
    "open_adapter",
    "open_llamacpp",
    "serve_llamacpp",
]
