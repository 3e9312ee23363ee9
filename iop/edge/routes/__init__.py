"""The edge's routes: the API surfaces with their streamed and collected bodies, the admin pages
with their authentication, models, health and metrics, and OpenAI's Files and Batches.

``create_edge_app`` assembles them over an ``EdgeCore``: the API surface
routes (``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/messages``,
``/v1/completions``, ``/v1/embeddings``: ``_surfaces``) are served below
quart (``iop.edge.server._surface_asgi``); the quart-trio app behind them
serves Anthropic's ``/v1/messages/count_tokens`` (``_surfaces``), the
models, health and metrics GETs (``_ops``) and the admin pages (``_admin``,
with ``_admin_auth`` saying who may open them and ``_admin_page`` drawing
them), OpenAI's Files and Batches (``_batches``; ``POST /v1/files`` below
quart with a body limit of its own). The node link WebSocket (``/v1/link``) is served beside this app, at
the ASGI level (``iop.edge.server._link_asgi``). Every error a client sees
is its API's error body (``_errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop.api import MessagesSurface, Surface
from iop.edge._core import EdgeCore
from iop.edge.routes._admin import add_admin_routes, open_gates
from iop.edge.routes._batches import add_batch_routes
from iop.edge.routes._errors import Refusals, bearer_key
from iop.edge.routes._ops import add_ops_routes
from iop.edge.routes._surfaces import SurfaceRoute, add_surface_routes, surface_routes
from iop.edge.server._surface_asgi import SurfaceASGI

__all__ = ["SurfaceRoute", "bearer_key", "create_edge_app", "surface_routes"]


def create_edge_app(core: EdgeCore, *, routes: Sequence[SurfaceRoute] | None = None) -> SurfaceASGI:
    """The edge's ASGI app, serving ``core``: the surface routes below quart
    (``_surface_asgi``), everything else by the quart-trio app (``.fallback``).

    Args:
        core: The edge's node links, scheduler and runs.
        routes: The API surfaces to serve; ``surface_routes(core)`` when None.
    """
    cfg = core.config
    app = QuartTrio("iop.edge")
    # Quart's 60 s response timeout would cut long streams silently
    # (docs/architecture.md, "Facts about our dependencies: quart and
    # quart-trio"); runs have their own deadlines. Its body timeout is
    # the edge's, much shorter (config.EdgeServer says why).
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = cfg.server.body_read_timeout_s
    app.config["MAX_CONTENT_LENGTH"] = cfg.server.max_body_bytes
    gate, metrics_gate = open_gates(core)

    # The API surfaces by route: errors on their routes (401, 404, 413...) take
    # their shape.
    surfaces: dict[str, Surface] = {}
    refusals = Refusals(cfg, surfaces)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return refusals.refusal(exc, request.method, request.path)

    @app.errorhandler(Exception)
    async def crash(exc: Exception) -> Response:
        return refusals.crashed(exc, request.method, request.path)

    # count_tokens and Anthropic's model routes: the Messages surface's parser and errors.
    messages = MessagesSurface(max_depth=cfg.server.max_json_depth)
    add_ops_routes(app, core, messages, metrics_gate)
    add_admin_routes(app, core, gate)
    answers = add_surface_routes(
        app, core, surface_routes(core) if routes is None else routes, messages, surfaces
    )
    uploads, body_limits = add_batch_routes(app, core)
    return SurfaceASGI(
        app,
        {**answers, **uploads},
        max_body_bytes=cfg.server.max_body_bytes,
        body_limits=body_limits,
        body_read_timeout_s=cfg.server.body_read_timeout_s,
        refused=refusals.refusal_answer,
        crashed=refusals.crashed_answer,
    )
