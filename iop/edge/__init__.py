"""The edge: OpenAI-compatible HTTP API, node links, scheduling.

``serve_edge`` runs it; ``create_edge_app`` is the quart-trio app over an
``EdgeCore`` (node registry, scheduler, remote runs). The OpenAI output
(seed 001's streaming behaviour) is sans-IO in ``_openai_out``; request
validation in ``_request``.
"""

from iop.api.chat._encode import ChatCompletionCollector, ChatCompletionStream, error_body
from iop.api.chat._request import parse_chat_request
from iop.edge._app import create_edge_app
from iop.edge._core import EdgeCore, RemoteExecutor, open_edge_core
from iop.edge._serve import EdgeHandle, serve_edge

__all__ = [
    "ChatCompletionCollector",
    "ChatCompletionStream",
    "EdgeCore",
    "EdgeHandle",
    "RemoteExecutor",
    "create_edge_app",
    "error_body",
    "open_edge_core",
    "parse_chat_request",
    "serve_edge",
]
