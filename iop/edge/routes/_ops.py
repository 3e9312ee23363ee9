"""The edge's plain GET routes: the models a key may use, health and metrics.

``GET /v1/models`` and ``GET /v1/models/{id}`` answer in OpenAI's or
Anthropic's shapes (``iop.api._models``); ``GET /healthz`` says the process
answers, ``GET /readyz`` whether it can serve a model now; ``GET /metrics``
is Prometheus's text, behind ``MetricsGate`` (``_admin_auth``).
"""

from __future__ import annotations

from typing import Final

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from iop.api import (
    ANTHROPIC_AUTH_FAILED,
    CHAT,
    MessagesSurface,
    Surface,
    anthropic_model_body,
    anthropic_model_list_body,
    model_body,
    model_list_body,
    wants_anthropic,
)
from iop.edge._core import EdgeCore
from iop.edge._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from iop.edge.routes._admin_auth import METRICS_OFF_MESSAGE, MetricsGate, Verdict
from iop.edge.routes._errors import (
    anthropic_key,
    error,
    json_response,
    key_refused,
    request_headers,
)
from iop.edge.tenancy._tenants import Tenant
from iop.errors import ErrorCode

__all__ = ["add_ops_routes"]

# /metrics' 401: which key it wants (iop/edge/routes/_admin_auth.py).
_METRICS_KEY_WANTED: Final = (
    "send one of server.metrics_keys or server.admin_keys as `Authorization: Bearer KEY` "
    "(a client key never opens /metrics)."
)


class _Ops:
    """The routes' state: the core, the Messages surface (Anthropic's model
    shapes) and the metrics gate."""

    def __init__(self, core: EdgeCore, messages: MessagesSurface, metrics_gate: MetricsGate):
        self.core = core
        self.messages = messages
        self.metrics_gate = metrics_gate

    async def healthz(self) -> Response:
        return json_response(b'{"status":"ok"}')

    async def readyz(self) -> Response:
        core = self.core
        if core.draining:
            return json_response(b'{"status":"draining"}', 503)
        if not core.registry.nodes:
            return json_response(b'{"status":"no nodes connected"}', 503)
        if not core.models():
            return json_response(b'{"status":"no node can serve a model right now"}', 503)
        return json_response(
            msgspec.json.encode({"status": "ready", "nodes": len(core.registry.nodes)})
        )

    def model_reader(self) -> tuple[Surface, Tenant | None, Response | None]:
        """The surface whose shapes a model route answers in, and its 401 if
        the key is missing or wrong (``iop.api._models``: Anthropic's shapes
        for a request with ``anthropic-version``, else OpenAI's). Either key
        header is accepted on either shape: both carry a key of the same
        ``api_keys``, and a cross-origin page can set neither without a CORS
        preflight, which the edge never grants (it sends no
        ``Access-Control-Allow-*`` header)."""
        headers = request_headers()
        messages = self.messages
        surface = messages if wants_anthropic(headers) else CHAT
        key = anthropic_key(headers)
        tenant = self.core.tenants.identify(key)
        if tenant is not None:
            return surface, tenant, None
        if surface is messages:
            message = key_refused(key, ANTHROPIC_AUTH_FAILED, anthropic=True)
            refused = error(401, message, code=ErrorCode.INVALID_API_KEY, surface=messages)
            return surface, None, refused
        message = key_refused(key, "Incorrect API key provided.")
        return surface, None, error(401, message, code=ErrorCode.INVALID_API_KEY)

    async def models(self) -> Response:
        surface, tenant, refused = self.model_reader()
        if refused is not None:
            return refused
        assert tenant is not None
        core = self.core
        served = [(m.id, m.nodes) for m in core.models() if tenant.may_use(m.id)]
        if surface is self.messages:
            return json_response(anthropic_model_list_body(served, int(core.started_at)))
        return json_response(model_list_body(served, int(core.started_at)))

    async def model(self, model_id: str) -> Response:
        surface, tenant, refused = self.model_reader()
        if refused is not None:
            return refused
        assert tenant is not None
        core = self.core
        found = next((m for m in core.models() if m.id == model_id), None)
        if found is None or not tenant.may_use(model_id):
            return error(
                404,
                f"The model '{model_id}' does not exist",
                code=ErrorCode.MODEL_NOT_FOUND,
                param="model",
                surface=surface,
            )
        if surface is self.messages:
            body = anthropic_model_body(found.id, found.nodes, int(core.started_at))
        else:
            body = model_body(found.id, found.nodes, int(core.started_at))
        return json_response(body)

    async def metrics(self) -> Response:
        verdict = self.metrics_gate.check(request.headers.get("Authorization"))
        if verdict is Verdict.DISABLED:
            return error(403, METRICS_OFF_MESSAGE, code=ErrorCode.METRICS_DISABLED)
        if verdict is not Verdict.ALLOWED:
            said = (
                "Not a metrics key: " if "Authorization" in request.headers else "No metrics key: "
            )
            return error(401, said + _METRICS_KEY_WANTED, code=ErrorCode.INVALID_API_KEY)
        return Response(self.core.metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)


def add_ops_routes(
    app: QuartTrio, core: EdgeCore, messages: MessagesSurface, metrics_gate: MetricsGate
) -> None:
    """Route the models, health and metrics GETs of ``app`` to ``core``."""
    ops = _Ops(core, messages, metrics_gate)
    app.add_url_rule("/healthz", "healthz", ops.healthz, methods=["GET"])
    app.add_url_rule("/readyz", "readyz", ops.readyz, methods=["GET"])
    app.add_url_rule("/v1/models", "models", ops.models, methods=["GET"])
    # ``path``: model ids may hold ``/`` (``Qwen/Qwen3-8B``), sent as is or as %2F.
    app.add_url_rule("/v1/models/<path:model_id>", "model", ops.model, methods=["GET"])
    app.add_url_rule("/metrics", "metrics", ops.metrics, methods=["GET"])
