"""The edge: HTTP routing, node links, scheduling.

``serve_edge`` runs it; ``create_edge_app`` is the quart-trio app over an
``EdgeCore`` (node registry, scheduler, remote runs). What the API surfaces
say (request parsing, output, error bodies) is sans-IO in ``iop.api``; the
app routes each surface's requests through one generic handler.
"""

from iop.edge._core import EdgeCore, open_edge_core
from iop.edge.routes import SurfaceRoute, bearer_key, create_edge_app
from iop.edge.runs import RemoteExecutor
from iop.edge.server._serve import EdgeHandle, check_ports, serve_edge

__all__ = [
    "EdgeCore",
    "EdgeHandle",
    "RemoteExecutor",
    "SurfaceRoute",
    "bearer_key",
    "check_ports",
    "create_edge_app",
    "open_edge_core",
    "serve_edge",
]
