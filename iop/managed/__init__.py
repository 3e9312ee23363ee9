"""Backends the node runs itself, as supervised child processes.

``serve_llamacpp`` runs llama.cpp's own HTTP server (from the xllamacpp
wheel) with a small model shipped in a wheel, the node's embedded default
backend; ``llamacpp_available`` says whether it can run here, and why not.
"""

from iop.managed._llamacpp import (
    LlamaCppEndpoint,
    LlamaCppSettings,
    launcher_command,
    llamacpp_available,
    open_llamacpp,
    serve_llamacpp,
)

__all__ = [
    "LlamaCppEndpoint",
    "LlamaCppSettings",
    "launcher_command",
    "llamacpp_available",
    "open_llamacpp",
    "serve_llamacpp",
]
