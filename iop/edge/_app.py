"""The edge's HTTP face: a quart-trio app over an ``EdgeCore``.

Routes: the API surfaces (``POST /v1/chat/completions``, ``/v1/responses``,
``/v1/messages``, streaming and not, and ``/v1/messages/count_tokens``:
``iop.api``), ``GET /v1/models`` and ``GET /v1/models/{id}`` (OpenAI's or
Anthropic's shapes, ``iop.api._models``), ``GET /healthz``, ``GET /readyz``,
``GET /metrics``, the admin pages (``GET /admin`` as HTML, or its login form;
``POST /admin/login`` and ``/admin/logout``; ``GET /admin/nodes`` as JSON;
``POST /admin/nodes/{id}/drain`` and ``/undrain``, from a script or the
page's buttons; ``POST /admin/reload``: ``_admin_auth`` says who may open
them). The node link WebSocket
(``/v1/link``) is served beside this app, at the ASGI level
(``iop.edge.server._link_asgi``). Every error a client sees is its API's error
body (OpenAI's, except on a surface route whose surface has its own) with
the right status; the one HTML answer to a refused request is ``/admin``'s
login form, for people.

Every surface is served by one handler (``answer`` in ``create_edge_app``),
so adding one is one ``SurfaceRoute(path, surface, key_of)`` line in
``surface_routes``: the
surface (``iop.api.Surface``, sans-IO) parses the body and turns the run's
events into bytes; this module only reads the body, checks the API key,
starts the run and writes what comes back. The surface routes are served
below quart (``_surface_asgi``: quart's per-request machinery was the
largest part of a short request's cost on the edge); the app returned is
that ASGI layer, with the quart app behind it for every other route.

Streaming (docs/architecture.md, "Facts about our dependencies: quart and
quart-trio"): the response body is an async generator that
only awaits the run's channel and yields bytes; no ``yield`` sits inside a
cancel scope or nursery (the keep-alive timeout wraps only the ``receive``).
What is already queued is coalesced into one send (docs/benchmarks.md,
"Earlier measurements: The trio-stack spike"). When the client goes
away, quart-trio cancels the generator and its ``finally`` cancels the run
with ``client_disconnect`` (``slow_client`` when the edge's write-stall
guard closed the connection, ``iop.edge.server._stall``); the run task, owned by the
core's supervisor and not by the request, then tells the node from a
shielded scope.

Request input (``docs/operations.md`` "HTTP input"): a body must be JSON
(``Content-Type: application/json`` or ``application/*+json``; no
Content-Type at all is read as JSON) or the answer is 415; the body must
arrive within ``server.body_read_timeout_s`` (408, and the connection is
closed: the rest of a dribbled body is never read); its size, depth and
values are checked by each surface's parser (``iop.api._json_guard`` first,
the same guards for every surface). Framing (smuggling, header
size) is refused below the app, in ``_http1.py``.

Headers are committed on the run's first output, or after
``keepalive_interval_s`` (then keep-alive comments follow while the run is
queued or in prefill). A run that fails before any output therefore gets a
real HTTP status (429, 404, the backend's 400...) rather than an SSE error
behind a 200.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, NamedTuple, Protocol, cast, runtime_checkable
from urllib.parse import urlsplit

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop.api import (
    ANTHROPIC_AUTH_FAILED,
    CHAT,
    ChatSurface,
    Collector,
    CompletionsSurface,
    EmbeddingsSurface,
    MessagesSurface,
    ResponsesSurface,
    RunContext,
    StreamEncoder,
    Surface,
    anthropic_api_key,
    anthropic_model_body,
    anthropic_model_list_body,
    model_body,
    model_list_body,
    shape_failure,
    wants_anthropic,
)
from iop.config import EdgeConfig
from iop.edge._core import EdgeCore
from iop.edge._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from iop.edge.routes._admin_auth import (
    ADMIN_OFF_MESSAGE,
    COOKIE_NAME,
    METRICS_OFF_MESSAGE,
    AdminGate,
    MetricsGate,
    Verdict,
)
from iop.edge.routes._admin_page import (
    RECENT_ON_PAGE,
    USAGE_DAYS,
    render_admin_page,
    render_login_page,
    render_off_page,
    render_run_page,
)
from iop.edge.server._link_asgi import LINK_PATH
from iop.edge.server._stall import ConnectionStall, client_gone_reason, current_connection
from iop.edge.server._surface_asgi import BodyReader, EndKnownBody, SurfaceAnswer, SurfaceASGI
from iop.edge.tenancy._tenants import (
    RateLimited,
    Tenant,
    no_access,
    rate_headers,
    retry_headers,
)
from iop.errors import ErrorCode, IopError, RequestError
from iop.events import (
    Cancelled,
    CancelReason,
    Error,
    RuntimeEvent,
    Start,
    TerminalEvent,
    TokenCount,
    Usage,
    is_terminal,
)
from iop.ledger import GROUPS as USAGE_GROUPS
from iop.ledger import parse_day, period_start, report_json
from iop.runtime import Run, new_run_id
from iop.spec import ExecutionSpec, TokenizeRequest
from iop.tracing import valid_traceparent

__all__ = ["LINK_PATH", "create_edge_app"]

# Anthropic's token counting, beside its Messages route.
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
# A request that sent no key at all is told so, not that its key was wrong.
NO_KEY: Final = "No API key provided: send one as `Authorization: Bearer KEY`."
ANTHROPIC_NO_KEY: Final = "No API key provided: send one in the `x-api-key` header."
# The admin views' and /metrics' 401: which key they want (iop/edge/routes/_admin_auth.py).
_ADMIN_KEY_WANTED: Final = (
    "send one of server.admin_keys as `Authorization: Bearer KEY` "
    "(a client key never opens the admin views)."
)
_METRICS_KEY_WANTED: Final = (
    "send one of server.metrics_keys or server.admin_keys as `Authorization: Bearer KEY` "
    "(a client key never opens /metrics)."
)

_NO_OUTCOME: Final = Error(
    message="run ended without an outcome", status=500, code=ErrorCode.INTERNAL_ERROR
)

log = logging.getLogger("iop.edge.http")

# Events taken from a run's channel per send when more are already queued:
# one write per batch instead of one per token (docs/benchmarks.md, "Earlier
# measurements: The trio-stack spike").
COALESCE_MAX: Final = 64

# Finished runs ``GET /admin/runs`` lists unless ``?limit=`` says otherwise.
ADMIN_RUNS_LIMIT: Final = 100

# A drain's reason: a line for the page and the log (a ticket, "kernel
# upgrade"), not a document; its body (JSON or the page's form) is a few
# hundred bytes, so anything past 4 KiB is not a drain request.
DRAIN_REASON_MAX_CHARS: Final = 200
DRAIN_BODY_MAX_BYTES: Final = 4096


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    """The optional JSON body of ``POST /admin/nodes/{id}/drain``."""

    reason: str = ""


_SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def _json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


# What a person who opens the edge's root (or /v1) in a browser is told.
_ROOT_POINTERS: Final = (
    "This is an IOP edge: the OpenAI and Anthropic APIs are under /v1 "
    "(GET /v1/models lists the models), the admin view is /admin and health /healthz; "
    "docs/api.md in the IOP repository describes the API."
)


def _unknown_url(method: str, path: str) -> str:
    """The 404 message; at the root, where to go instead."""
    message = f"Unknown request URL: {method} {path}."
    if path.rstrip("/") in ("", "/v1"):
        return f"{message} {_ROOT_POINTERS}"
    return message


def _key_refused(key: str, wrong: str, *, anthropic: bool = False) -> str:
    """The 401 message for ``key``: none sent, or ``wrong``."""
    if key:
        return wrong
    return ANTHROPIC_NO_KEY if anthropic else NO_KEY


def _error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    surface: Surface = CHAT,
) -> Response:
    """An error response in ``surface``'s shape (OpenAI's unless a route says otherwise)."""
    sent, body = surface.error_body(status, message, code=code, param=param)
    return _json_response(body, sent, None if headers is None else dict(headers))


def _from_exc(
    exc: IopError, surface: Surface = CHAT, headers: Mapping[str, str] | None = None
) -> Response:
    if headers is None and exc.status == 429:
        headers = {"Retry-After": "1"}
    param = exc.param if isinstance(exc, RequestError) else None
    return _error(
        exc.status, exc.message, code=exc.code, param=param, headers=headers, surface=surface
    )


KeyReader = Callable[[Mapping[str, str]], str]
"""How a route finds the client's API key in the request's (lower-cased) headers."""


def bearer_key(headers: Mapping[str, str]) -> str:
    """The key of ``Authorization: Bearer <key>`` (OpenAI's way), or ``""``."""
    auth = headers.get("authorization", "")
    return auth[7:] if auth.startswith("Bearer ") else ""


def _headers() -> dict[str, str]:
    """The request's headers, names lower-cased (what ``Surface.parse`` gets)."""
    return {name.lower(): value for name, value in request.headers.items()}


def anthropic_key(headers: Mapping[str, str]) -> str:
    """The key of ``x-api-key`` (Anthropic's way) or a Bearer token, or ``""``."""
    return anthropic_api_key(headers) or ""


class SurfaceRoute(NamedTuple):
    """One API surface the edge serves: ``POST path``, the key read by ``key_of``,
    and the message a missing or wrong key gets (in the surface's error body)."""

    path: str
    surface: Surface
    key_of: KeyReader = bearer_key
    auth_failed: str = "Incorrect API key provided."


def surface_routes(core: EdgeCore) -> list[SurfaceRoute]:
    """The API surfaces the edge serves. Adding one is one line here; a surface
    that keeps state (a response store) is built here from ``core.config``."""
    depth = core.config.server.max_json_depth
    responses = ResponsesSurface.from_settings(
        core.config.responses, tenants=len(core.tenants.all), max_depth=depth
    )

    def reshare(config: EdgeConfig) -> None:
        # Each tenant's share of the store follows the tenants a reload leaves.
        responses.store.tenants = len(core.tenants.all)

    core.reload_hooks.append(reshare)
    return [
        SurfaceRoute("/v1/chat/completions", ChatSurface(max_depth=depth)),
        SurfaceRoute("/v1/responses", responses),
        SurfaceRoute(
            "/v1/messages", MessagesSurface(max_depth=depth), anthropic_key, ANTHROPIC_AUTH_FAILED
        ),
        SurfaceRoute("/v1/completions", CompletionsSurface(max_depth=depth)),
        SurfaceRoute("/v1/embeddings", EmbeddingsSurface(max_depth=depth)),
    ]


@runtime_checkable
class _Summarised(Protocol):
    """An encoder or collector with a close-log summary (chat's ``StreamSummary``)."""

    def summary(self) -> object: ...


# --- /admin: see _admin_auth for the rules ---------------------------------------------

# Admin pages are neither cached (they show live state, or a login form) nor
# framed (a framed log-out button could be clicked for the user); no script
# runs, forms post only here.
_ADMIN_HEADERS: Final = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    # Not no-referrer: Chromium then sends `Origin: null` on the form's POST.
    "Referrer-Policy": "same-origin",
}


def _wants_html(accept: str) -> bool:
    """Whether an ``Accept`` header asks for HTML before JSON (a browser's does)."""
    html = accept.find("text/html")
    json = accept.find("application/json")
    return html >= 0 and (json < 0 or html < json)


def _html(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        body,
        status=status,
        content_type="text/html; charset=utf-8",
        headers={**_ADMIN_HEADERS, **(headers or {})},
    )


def _retry_after(gate: AdminGate) -> dict[str, str]:
    return {"Retry-After": str(math.ceil(gate.retry_after() or 1))}


def _throttled_message(gate: AdminGate) -> str:
    return (
        f"Too many wrong admin keys (limit {gate.failures_per_minute} a minute); "
        f"try again in {_retry_after(gate)['Retry-After']} s."
    )


def _login_page(message: str | None, status: int, gate: AdminGate) -> Response:
    headers = _retry_after(gate) if status == 429 else None
    return _html(render_login_page(message), status, headers)


def _admin_off_page() -> Response:
    return _html(render_off_page(ADMIN_OFF_MESSAGE), 403)


def _admin_off() -> Response:
    return _error(403, ADMIN_OFF_MESSAGE, code=ErrorCode.ADMIN_DISABLED)


def _see_other(location: str) -> Response:
    return Response(b"", status=303, headers={**_ADMIN_HEADERS, "Location": location})


def _log_wrong_admin_key(gate: AdminGate, via: str, path: str) -> None:
    # Never the key itself: it may be a real key of something else, mistyped.
    log.warning(
        "wrong admin key from %s (%s, %s): %d of %d allowed a minute",
        request.remote_addr,
        via,
        path,
        gate.failures,
        gate.failures_per_minute,
    )
    wait = gate.retry_after()
    if wait is not None:  # this key was the last one checked this minute
        log.warning("admin logins braked for %.0f s: too many wrong keys", wait)


def _same_origin() -> bool:
    """CSRF guard for the admin forms, beside ``SameSite=Strict``: a browser's
    cross-site POST carries a foreign ``Origin`` (or ``null``); a script's
    carries none. Behind a proxy that rewrites ``Host``, its
    ``X-Forwarded-Host`` names the host the browser used (a cross-site form
    cannot set headers, so trusting it here opens nothing)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    netloc = urlsplit(origin).netloc.lower()
    forwarded = request.headers.get("X-Forwarded-Host", "").split(",")[0].strip().lower()
    return bool(netloc) and netloc in (request.host.lower(), forwarded)


def _cross_origin_refused() -> Response:
    log.warning("cross-origin admin form refused from %s", request.remote_addr)
    return _error(403, "Cross-origin admin request refused.", code=ErrorCode.CROSS_ORIGIN)


def _over_https() -> bool:
    """Whether the browser talks https (here, or to the TLS proxy in front)."""
    # Trusting a spoofed header only makes the spoofer's own cookie https-only.
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip()
    return request.scheme == "https" or forwarded == "https"


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
    tenants = core.tenants
    # Who may open /admin and /metrics: _admin_auth. A client key never does.
    gate = AdminGate(
        cfg.server.admin_keys,
        session_s=cfg.server.admin_session_s,
        failures_per_minute=cfg.server.admin_login_failures_per_minute,
        clients_keyed=not tenants.open,
    )
    metrics_gate = MetricsGate(
        cfg.server.metrics_keys, cfg.server.admin_keys, clients_keyed=not tenants.open
    )
    if gate.off:
        log.warning("%s", ADMIN_OFF_MESSAGE)
    if metrics_gate.off:
        log.warning("%s", METRICS_OFF_MESSAGE)

    # The API surfaces by route: errors on their routes (401, 404, 413...) take
    # their shape. The routes themselves: ``surface_routes``.
    surfaces: dict[str, Surface] = {}
    # count_tokens and Anthropic's model routes: the Messages surface's parser and errors.
    messages = MessagesSurface(max_depth=cfg.server.max_json_depth)

    def authorized(key: str) -> bool:
        return tenants.identify(key) is not None

    def admin_verdict() -> Verdict:
        verdict = gate.check(request.cookies.get(COOKIE_NAME), request.headers.get("Authorization"))
        if verdict is Verdict.DENIED and "Authorization" in request.headers:
            _log_wrong_admin_key(gate, "Bearer header", request.path)
        return verdict

    def refusal(exc: HTTPException, method: str, path: str) -> Response:
        """An HTTP error (404, 405, 408, 413...) in the path's surface's shape."""
        status = exc.code or 500
        message, code = {
            404: (_unknown_url(method, path), ErrorCode.NOT_FOUND),
            405: (
                f"Method {method} is not allowed on {path}.",
                ErrorCode.METHOD_NOT_ALLOWED,
            ),
            408: (
                f"The request body did not arrive within {cfg.server.body_read_timeout_s:g} s.",
                ErrorCode.REQUEST_TIMEOUT,
            ),
            413: (
                f"Request body too large (limit {cfg.server.max_body_bytes} bytes).",
                ErrorCode.REQUEST_ENTITY_TOO_LARGE,
            ),
        }.get(
            # Quart raises no other HTTPException on the edge's routes today.
            status,
            (
                exc.description or exc.name,
                ErrorCode.BAD_REQUEST if status < 500 else ErrorCode.INTERNAL_ERROR,
            ),
        )
        # A body left unread (too slow, too large) must not stay on the
        # connection: after a "Connection: close" response the connection is
        # closed (from a shielded scope, _http1.py) and nothing more is read.
        headers = {"Connection": "close"} if status in (408, 413) else None
        surface = surfaces.get(path, CHAT)
        return _error(status, message, code=code, headers=headers, surface=surface)

    def crashed(exc: Exception, method: str, path: str) -> Response:
        log.error("unhandled error on %s %s", method, path, exc_info=exc)
        surface = surfaces.get(path, CHAT)
        return _error(500, "internal server error", code=ErrorCode.INTERNAL_ERROR, surface=surface)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        return refusal(exc, request.method, request.path)

    @app.errorhandler(Exception)
    async def crash(exc: Exception) -> Response:
        return crashed(exc, request.method, request.path)

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json_response(b'{"status":"ok"}')

    @app.get("/readyz")
    async def readyz() -> Response:
        if core.draining:
            return _json_response(b'{"status":"draining"}', 503)
        if not core.registry.nodes:
            return _json_response(b'{"status":"no nodes connected"}', 503)
        if not core.models():
            return _json_response(b'{"status":"no node can serve a model right now"}', 503)
        return _json_response(
            msgspec.json.encode({"status": "ready", "nodes": len(core.registry.nodes)})
        )

    def model_reader() -> tuple[Surface, Tenant | None, Response | None]:
        """The surface whose shapes a model route answers in, and its 401 if
        the key is missing or wrong (``iop.api._models``: Anthropic's shapes
        for a request with ``anthropic-version``, else OpenAI's). Either key
        header is accepted on either shape: both carry a key of the same
        ``api_keys``, and a cross-origin page can set neither without a CORS
        preflight, which the edge never grants (it sends no
        ``Access-Control-Allow-*`` header)."""
        headers = _headers()
        surface = messages if wants_anthropic(headers) else CHAT
        key = anthropic_key(headers)
        tenant = tenants.identify(key)
        if tenant is not None:
            return surface, tenant, None
        if surface is messages:
            message = _key_refused(key, ANTHROPIC_AUTH_FAILED, anthropic=True)
            refused = _error(401, message, code=ErrorCode.INVALID_API_KEY, surface=messages)
            return surface, None, refused
        message = _key_refused(key, "Incorrect API key provided.")
        return surface, None, _error(401, message, code=ErrorCode.INVALID_API_KEY)

    @app.get("/v1/models")
    async def models() -> Response:
        surface, tenant, refused = model_reader()
        if refused is not None:
            return refused
        assert tenant is not None
        served = [(m.id, m.nodes) for m in core.models() if tenant.may_use(m.id)]
        if surface is messages:
            return _json_response(anthropic_model_list_body(served, int(core.started_at)))
        return _json_response(model_list_body(served, int(core.started_at)))

    # ``path``: model ids may hold ``/`` (``Qwen/Qwen3-8B``), sent as is or as %2F.
    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        surface, tenant, refused = model_reader()
        if refused is not None:
            return refused
        assert tenant is not None
        found = next((m for m in core.models() if m.id == model_id), None)
        if found is None or not tenant.may_use(model_id):
            return _error(
                404,
                f"The model '{model_id}' does not exist",
                code=ErrorCode.MODEL_NOT_FOUND,
                param="model",
                surface=surface,
            )
        if surface is messages:
            body = anthropic_model_body(found.id, found.nodes, int(core.started_at))
        else:
            body = model_body(found.id, found.nodes, int(core.started_at))
        return _json_response(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        verdict = metrics_gate.check(request.headers.get("Authorization"))
        if verdict is Verdict.DISABLED:
            return _error(403, METRICS_OFF_MESSAGE, code=ErrorCode.METRICS_DISABLED)
        if verdict is not Verdict.ALLOWED:
            said = (
                "Not a metrics key: " if "Authorization" in request.headers else "No metrics key: "
            )
            return _error(401, said + _METRICS_KEY_WANTED, code=ErrorCode.INVALID_API_KEY)
        return Response(core.metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/admin")
    async def admin_page() -> Response:
        verdict = admin_verdict()
        if verdict is Verdict.DISABLED:
            return _admin_off_page()
        if verdict is Verdict.THROTTLED:
            return _login_page(_throttled_message(gate), 429, gate)
        if verdict is Verdict.DENIED:
            return _login_page(None, 401, gate)
        usage = None
        if core.ledger is not None:
            since = period_start("day", time.time()) - (USAGE_DAYS - 1) * 86400.0
            rows = await core.ledger.report(("day",), since=since)
            usage = cast("list[dict[str, Any]]", report_json(rows, ("day",))["rows"])
        return _html(
            render_admin_page(
                core.snapshot(),
                core.runs_view(RECENT_ON_PAGE),
                logout=not gate.open,
                usage=usage,
            )
        )

    def admin_refusal() -> Response | None:
        """The JSON refusal of an admin API request, or None when it may go on."""
        verdict = admin_verdict()
        if verdict is Verdict.DISABLED:
            return _admin_off()
        if verdict is Verdict.THROTTLED:
            return _error(
                429,
                _throttled_message(gate),
                code=ErrorCode.TOO_MANY_WRONG_KEYS,
                headers=_retry_after(gate),
            )
        if verdict is Verdict.DENIED:
            said = "Not an admin key: " if "Authorization" in request.headers else "No admin key: "
            return _error(401, said + _ADMIN_KEY_WANTED, code=ErrorCode.INVALID_API_KEY)
        return None

    @app.get("/admin/nodes")
    async def admin_nodes() -> Response:
        refused = admin_refusal()
        if refused is not None:
            return refused
        return _json_response(msgspec.json.encode(core.snapshot()))

    def admin_who() -> str:
        """Who an allowed admin request is, for the log: how it got in, from where."""
        if gate.open:
            via = "open admin (no admin key set)"
        elif request.headers.get("Authorization", "").startswith("Bearer "):
            via = "admin key"
        else:
            via = "admin session"
        return f"{via} from {request.remote_addr}"

    async def drain_reason(form: bool) -> str | Response:
        """The drain's reason from the page's form or the JSON body (may be
        absent), or the refusal of a body that is not one."""
        length = request.content_length
        if length is not None and length > DRAIN_BODY_MAX_BYTES:
            return _error(
                413,
                f"A drain request's body is at most {DRAIN_BODY_MAX_BYTES} bytes.",
                code=ErrorCode.REQUEST_ENTITY_TOO_LARGE,
                headers={"Connection": "close"},
            )
        if form:
            reason = str((await request.form).get("reason", ""))
        else:
            unsupported = _unsupported_content_type(request.headers.get("Content-Type"))
            if unsupported is not None:
                return _error(415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE)
            body = await request.get_data(cache=False)
            assert isinstance(body, bytes)
            if len(body) > DRAIN_BODY_MAX_BYTES:
                return _error(
                    413,
                    f"A drain request's body is at most {DRAIN_BODY_MAX_BYTES} bytes.",
                    code=ErrorCode.REQUEST_ENTITY_TOO_LARGE,
                    headers={"Connection": "close"},
                )
            try:
                reason = msgspec.json.decode(body, type=DrainBody).reason if body.strip() else ""
            except msgspec.DecodeError as exc:
                return _error(
                    400,
                    f'The body must be empty or {{"reason": "..."}}: {exc}',
                    code=ErrorCode.INVALID_JSON,
                )
        # One line: no control characters (a newline would forge a log line).
        reason = " ".join("".join(c if c.isprintable() else " " for c in reason).split())
        if len(reason) > DRAIN_REASON_MAX_CHARS:
            return _error(
                400,
                f"reason is at most {DRAIN_REASON_MAX_CHARS} characters",
                code=ErrorCode.INVALID_VALUE,
                param="reason",
            )
        return reason

    async def drain_or_undrain(node_id: str, drain: bool) -> Response:
        """``POST /admin/nodes/{id}/drain`` (``drain``) or ``/undrain``.

        The page's buttons post a form (with the session cookie: refused
        cross-origin, like login and logout, and answered with a redirect to
        the page); a script posts JSON or nothing with a Bearer admin key and
        gets the node's drain state as JSON.
        """
        if not _same_origin():
            return _cross_origin_refused()
        form = request.mimetype == "application/x-www-form-urlencoded"
        if form:
            verdict = admin_verdict()
            if verdict is Verdict.DISABLED:
                return _admin_off_page()
            if verdict is Verdict.THROTTLED:
                return _login_page(_throttled_message(gate), 429, gate)
            if verdict is Verdict.DENIED:
                return _login_page(None, 401, gate)
        else:
            refused = admin_refusal()
            if refused is not None:
                return refused
        reason = await drain_reason(form) if drain else ""
        if isinstance(reason, Response):
            return reason
        try:
            if drain:
                changed = core.drain_node(node_id, reason=reason, by=admin_who())
            else:
                changed = core.undrain_node(node_id, by=admin_who())
        except KeyError:
            return _error(
                404,
                f"No node {node_id!r} is connected or drained.",
                code=ErrorCode.NODE_NOT_FOUND,
            )
        if form:
            return _see_other("/admin")
        return _json_response(msgspec.json.encode({**core.drain_view(node_id), "changed": changed}))

    # ``path``: node ids are the operator's strings (any but "/" is likely;
    # the converter takes that too).
    @app.post("/admin/nodes/<path:node_id>/drain")
    async def admin_drain(node_id: str) -> Response:
        return await drain_or_undrain(node_id, drain=True)

    @app.post("/admin/nodes/<path:node_id>/undrain")
    async def admin_undrain(node_id: str) -> Response:
        return await drain_or_undrain(node_id, drain=False)

    def reconfigure_gates(config: EdgeConfig) -> None:
        # After the tenants (EdgeCore.apply_config): whether clients have keys.
        server = config.server
        keyed = not tenants.open
        was_off, metrics_was_off = gate.off, metrics_gate.off
        gate.reconfigure(
            server.admin_keys,
            session_s=server.admin_session_s,
            failures_per_minute=server.admin_login_failures_per_minute,
            clients_keyed=keyed,
        )
        metrics_gate.reconfigure(server.metrics_keys, server.admin_keys, clients_keyed=keyed)
        if gate.off and not was_off:
            log.warning("%s", ADMIN_OFF_MESSAGE)
        if metrics_gate.off and not metrics_was_off:
            log.warning("%s", METRICS_OFF_MESSAGE)

    core.reload_hooks.append(reconfigure_gates)

    @app.post("/admin/reload")
    async def admin_reload() -> Response:
        """Re-read the config file and apply what changed (docs/operations.md,
        "Reloading"): 200 with the plan, or 422 with why the file was refused."""
        if not _same_origin():
            return _cross_origin_refused()
        refused = admin_refusal()
        if refused is not None:
            return refused
        if core.reloader is None:
            return _error(
                409,
                "This edge has no config file to re-read (it was started without --config).",
                code=ErrorCode.RELOAD_UNAVAILABLE,
            )
        outcome = await core.reloader.reload(f"POST /admin/reload by {admin_who()}")
        status = 422 if outcome.status == "refused" else 200
        return _json_response(msgspec.json.encode(outcome), status)

    @app.get("/admin/usage")
    async def admin_usage() -> Response:
        """The usage ledger's sums (``iop usage --format json``'s answer):
        ``by`` (comma-separated of day, tenant, model, key_name; default
        ``day,tenant,model``), ``since`` / ``until`` (``YYYY-MM-DD``, UTC;
        ``until`` excluded), ``tenant``. 404 without a ledger."""
        refused = admin_refusal()
        if refused is not None:
            return refused
        if core.ledger is None:
            return _error(
                404,
                "This edge keeps no usage ledger ([usage] ledger_path is not set).",
                code=ErrorCode.NOT_FOUND,
            )
        args = request.args
        by = tuple(g for g in args.get("by", "day,tenant,model").split(",") if g)
        try:
            if set(by) - set(USAGE_GROUPS):
                raise ValueError(f"by is a comma-separated list of {', '.join(USAGE_GROUPS)}")
            since = parse_day(args["since"]) if "since" in args else None
            until = parse_day(args["until"]) if "until" in args else None
        except ValueError as exc:
            return _error(400, str(exc), code=ErrorCode.INVALID_REQUEST)
        rows = await core.ledger.report(by, since=since, until=until, tenant=args.get("tenant"))
        return _json_response(msgspec.json.encode(report_json(rows, by)))

    @app.get("/admin/runs")
    async def admin_runs() -> Response:
        refused = admin_refusal()
        if refused is not None:
            return refused
        raw = request.args.get("limit", str(ADMIN_RUNS_LIMIT))
        if not raw.isdigit() or not 0 <= int(raw) <= cfg.timelines.recent:
            return _error(
                400,
                f"limit must be an integer from 0 to {cfg.timelines.recent} (timelines.recent)",
                code=ErrorCode.INVALID_REQUEST,
                param="limit",
            )
        return _json_response(msgspec.json.encode(core.runs_view(int(raw))))

    @app.get("/admin/runs/<run_id>")
    async def admin_run(run_id: str) -> Response:
        # A browser (the admin page's links) gets the page, a script the JSON.
        browser = _wants_html(request.headers.get("Accept", ""))
        if browser:
            verdict = admin_verdict()
            if verdict is Verdict.DISABLED:
                return _admin_off_page()
            if verdict is Verdict.THROTTLED:
                return _login_page(_throttled_message(gate), 429, gate)
            if verdict is Verdict.DENIED:
                return _login_page(None, 401, gate)
        else:
            refused = admin_refusal()
            if refused is not None:
                return refused
        view = core.run_view(run_id)
        if view is not None and browser:
            return _html(render_run_page(view, logout=not gate.open))
        if view is None:
            return _error(
                404,
                f"No run {run_id!r} is live or among the {cfg.timelines.recent} "
                "kept (timelines.recent).",
                code=ErrorCode.NOT_FOUND,
            )
        return _json_response(msgspec.json.encode(view))

    @app.get("/admin/login")
    async def admin_login_form() -> Response:
        return _see_other("/admin")

    @app.post("/admin/login")
    async def admin_login() -> Response:
        if not _same_origin():
            return _cross_origin_refused()
        form = await request.form
        verdict = gate.login(form.get("key", ""))
        if verdict is Verdict.DISABLED:
            return _admin_off_page()
        if verdict is Verdict.THROTTLED:
            return _login_page(_throttled_message(gate), 429, gate)
        if verdict is Verdict.DENIED:
            _log_wrong_admin_key(gate, "login form", request.path)
            return _login_page("Wrong key.", 401, gate)
        resp = _see_other("/admin")
        if not gate.open:
            log.info("admin login from %s", request.remote_addr)
            resp.set_cookie(
                COOKIE_NAME,
                gate.issue(),
                max_age=math.ceil(gate.session_s),
                path="/admin",
                secure=_over_https(),
                httponly=True,
                samesite="Strict",
            )
        return resp

    @app.post("/admin/logout")
    async def admin_logout() -> Response:
        if not _same_origin():
            return _cross_origin_refused()
        gate.logout(request.cookies.get(COOKIE_NAME))
        resp = _see_other("/admin")
        resp.delete_cookie(
            COOKIE_NAME, path="/admin", secure=_over_https(), httponly=True, samesite="Strict"
        )
        return resp

    async def answer(
        route: SurfaceRoute, headers: Mapping[str, str], read_body: BodyReader
    ) -> Response:
        """One request of ``route.surface``: parse, run, then stream or collect.

        ``headers`` have lower-cased names; ``read_body`` reads the whole body
        (raising werkzeug's 408 or 413). Served below quart
        (``_surface_asgi``); the quart route gives the same answer.
        """
        surface = route.surface
        key = route.key_of(headers)
        tenant = tenants.identify(key)
        if tenant is None:
            message = _key_refused(key, route.auth_failed, anthropic=route.key_of is anthropic_key)
            return _error(401, message, code=ErrorCode.INVALID_API_KEY, surface=surface)
        unsupported = _unsupported_content_type(headers.get("content-type"))
        if unsupported is not None:
            return _error(415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE, surface=surface)
        body = await read_body()
        anthropic = isinstance(surface, MessagesSurface)
        limit_headers: dict[str, str] | None = None
        try:
            call = surface.parse(body, headers, tenant=tenant.name)
            if not tenant.may_use(call.request.model):
                raise no_access(call.request.model)
            ticket = await core.admit(tenant, call.request, tenants.key_name(route.key_of(headers)))
            if ticket.limits:
                limit_headers = rate_headers(ticket.limits, anthropic)
            spec = ExecutionSpec(
                run_id=new_run_id(),
                request=call.request,
                target=call.request.model,
                # A client's trace context (checked): the run joins its trace.
                traceparent=valid_traceparent(headers.get("traceparent")),
            )
            try:
                run = core.start_run(spec, collect=not call.stream, ticket=ticket)
            except IopError:
                core.settle(ticket, Usage())  # it never ran
                raise
        except RateLimited as exc:
            core.metrics.tenant_refused.labels(tenant.name, exc.limit).inc()
            return _from_exc(exc, surface, retry_headers(exc, anthropic))
        except IopError as exc:
            return _from_exc(exc, surface)
        connection = current_connection()
        if connection is not None:
            run.on_outcome = _cut_off_when_slow(connection)
            connection.timeline = run.timeline  # its write stalls are the run's
        ctx = RunContext(
            run_id=spec.run_id,
            created=int(time.time()),
            policy=core.config.policy_for(call.request.model),
        )
        handed_over = False  # until then, leaving here cancels the run
        try:
            if not call.stream:
                collector = surface.collector(call, ctx)
                handed_over = True  # _complete owns the run
                return await _complete(run, collector, limit_headers)
            stream = surface.stream(call, ctx)
            keepalive_s = core.config.server.keepalive_interval_s
            first = await _first_output(run, keepalive_s)
            early = _early_failure(first, surface)
            if early is not None:
                run.events.close()
                if limit_headers:
                    early.headers.update(limit_headers)
                return early
            handed_over = True
            sse = _RunBody(run, stream, _sse_body(run, stream, first, keepalive_s))
            sse_headers = _SSE_HEADERS if not limit_headers else {**_SSE_HEADERS, **limit_headers}
            return Response(sse, status=200, headers=sse_headers)
        finally:
            if not handed_over:
                run.cancel(*client_gone_reason())

    answers: dict[str, SurfaceAnswer] = {}

    def serve_surface(route: SurfaceRoute) -> None:
        """Route ``POST route.path`` to its surface (below quart, and in quart)."""

        async def view() -> Response:
            return await answer(route, _headers(), _quart_body)

        surfaces[route.path] = route.surface
        answers[route.path] = partial(answer, route)
        app.add_url_rule(
            route.path, endpoint=f"surface:{route.path}", view_func=view, methods=["POST"]
        )

    for route in surface_routes(core) if routes is None else routes:
        serve_surface(route)

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens() -> Response:
        """Anthropic's count_tokens: a tokenize run on the model's backend; IOP's
        estimate (said so in a header) when the backend has no tokenizer.

        A request of its tenant like any other: it takes one from
        ``requests_per_minute`` and a place of ``max_concurrent_runs`` while
        it runs (429 over either), and reserves and is charged no tokens:
        it generates none (docs/operations.md, "Tenants and limits")."""
        headers = _headers()
        key = anthropic_key(headers)
        tenant = tenants.identify(key)
        if tenant is None:
            message = _key_refused(key, ANTHROPIC_AUTH_FAILED, anthropic=True)
            return _error(401, message, code=ErrorCode.INVALID_API_KEY, surface=messages)
        unsupported = _unsupported_content_type(headers.get("content-type"))
        if unsupported is not None:
            return _error(415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE, surface=messages)
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        try:
            counted = messages.parse_count_tokens(body)
            if not tenant.may_use(counted.model):
                raise no_access(counted.model)
            tokenize = TokenizeRequest(
                model=counted.model, messages=counted.messages, tools=counted.tools
            )
            # A count is a run on a node: one request of its tenant's limits
            # and a place in its tenant's line, not a free one beside them
            # (it reserves no tokens: estimate_tokens of a count is 0).
            ticket = await core.admit(tenant, tokenize, tenants.key_name(anthropic_key(headers)))
        except RateLimited as exc:
            core.metrics.tenant_refused.labels(tenant.name, exc.limit).inc()
            return _from_exc(exc, messages, retry_headers(exc, anthropic=True))
        except RequestError as exc:
            return _from_exc(exc, messages)
        limit_headers = rate_headers(ticket.limits, anthropic=True) if ticket.limits else {}
        spec = ExecutionSpec(
            run_id=new_run_id(),
            request=tokenize,
            target=counted.model,
            traceparent=valid_traceparent(headers.get("traceparent")),
        )
        try:
            run = core.start_run(spec, collect=True, ticket=ticket)
        except IopError as exc:
            core.settle(ticket, Usage())  # it never ran
            if exc.code != ErrorCode.OPERATION_NOT_SUPPORTED:
                return _from_exc(exc, messages)
            run = None  # no instance of the model counts tokens: estimate here
        exact: int | None = None
        if run is not None:
            end: RuntimeEvent | None = None
            try:
                async for ev in run.events:
                    if isinstance(ev, TokenCount) and not ev.estimated:
                        exact = ev.count
                    if is_terminal(ev):
                        end = ev
                        break
                end = end or run.outcome
            finally:
                if end is None:
                    run.cancel(*client_gone_reason())
                run.events.close()
            if isinstance(end, Error | Cancelled):
                failed = shape_failure(end)
                return _error(failed.status, failed.message, code=failed.code, surface=messages)
        status, out, extra = messages.count_tokens(counted, exact=exact)
        return _json_response(out, status, {**extra, **limit_headers})

    surfaces[COUNT_TOKENS_PATH] = messages

    return SurfaceASGI(
        app,
        answers,
        max_body_bytes=cfg.server.max_body_bytes,
        body_read_timeout_s=cfg.server.body_read_timeout_s,
        refused=lambda exc, path: refusal(exc, "POST", path),
        crashed=lambda exc, path: crashed(exc, "POST", path),
    )


async def _quart_body() -> bytes:
    body = await request.get_data(cache=False)
    assert isinstance(body, bytes)
    return body


def _unsupported_content_type(value: str | None) -> str | None:
    """The message of a 415 for a body that does not say it is JSON, else None.

    ``application/json`` and ``application/*+json`` (any parameters) are
    JSON; so is a missing header (Python's ``requests`` and ``urllib`` send
    raw bytes without one). Anything else is refused, with the fix in the
    message: ``curl -d`` sends ``application/x-www-form-urlencoded``, and a
    browser page may send ``text/plain`` or a form cross-origin without a
    CORS preflight, which would otherwise run requests on an open edge
    (``docs/operations.md``, "HTTP input").
    """
    if value is None or not value.strip():
        return None
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    return (
        f"Unsupported Content-Type '{mime}': the request body must be JSON, sent with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')."
    )


class _RunBody(EndKnownBody):
    """The response body: iterates the SSE generator, and closing it cancels
    the run even if the generator never started (a client that left before
    quart began sending; an unstarted generator's ``finally`` never runs)."""

    def __init__(self, run: Run, stream: StreamEncoder, gen: AsyncGenerator[bytes, None]) -> None:
        self._run = run
        self._stream = stream
        self._gen = gen

    @property
    def at_end(self) -> bool:
        """Whether the piece just given was the last (``_sse_body``)."""
        return self._stream.finished

    def __aiter__(self) -> _RunBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        # A no-op for a run that already ended.
        self._run.cancel(*client_gone_reason())
        await self._gen.aclose()


def _early_failure(first: list[RuntimeEvent], surface: Surface) -> Response | None:
    """An HTTP error for a run that ended before any output, else None."""
    if not first or any(not isinstance(e, Start) for e in first[:-1]):
        return None
    end = first[-1]
    if not isinstance(end, Error | Cancelled):
        return None
    failed = shape_failure(end)
    headers = {"Retry-After": "1"} if failed.status == 429 else None
    return _error(
        failed.status,
        failed.message,
        code=failed.code,
        param=failed.param,
        headers=headers,
        surface=surface,
    )


async def _first_output(run: Run, wait_s: float) -> list[RuntimeEvent]:
    """Events up to the first output or terminal, waiting at most ``wait_s``,
    then those already queued behind the first output (up to ``COALESCE_MAX``
    events, up to a terminal): they leave in the response's first write."""
    got: list[RuntimeEvent] = []
    with trio.move_on_after(wait_s):
        while True:
            try:
                ev = await run.events.receive()
            except trio.EndOfChannel:
                if run.outcome is not None:
                    got.append(run.outcome)
                return got
            got.append(ev)
            if not isinstance(ev, Start):
                break
    while got and len(got) < COALESCE_MAX and not is_terminal(got[-1]):
        try:
            got.append(run.events.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return got


async def _sse_body(
    run: Run, stream: StreamEncoder, first: list[RuntimeEvent], keepalive_s: float
) -> AsyncGenerator[bytes, None]:
    """The SSE body: yields bytes only, never inside a cancel scope.

    The stream's opening chunk goes out with the first batch (``first``, the
    events ``_first_output`` found), in one piece: one write to the client,
    not two. Its last piece is yielded with ``stream.finished`` already set,
    so that ``_RunBody.at_end`` tells the ASGI layer it is the last
    (``_surface_asgi``: it leaves in the same write as the chunked
    terminator), and the body may be closed right there.
    """
    finished = False
    try:
        opening = stream.start()
        if not first:  # no output within keepalive_s: the head and opening now
            yield opening
            opening = b""
        last_write = trio.current_time()
        batch = first
        while True:
            if batch:
                out = stream.feed_many(batch)
                if opening:
                    out, opening = opening + out, b""
                if stream.finished:
                    finished = True
                    if out:
                        yield out
                    return
                if out:
                    yield out
                    last_write = trio.current_time()
                if trio.current_time() - last_write >= keepalive_s:
                    # Events arrive but nothing goes out (a buffered or strict
                    # stream holding its text): keep the connection alive.
                    yield stream.keepalive()
                    last_write = trio.current_time()
            batch = []
            with trio.move_on_after(keepalive_s):
                try:
                    batch.append(await run.events.receive())
                except trio.EndOfChannel:
                    # The run ended without handing us its terminal event
                    # (we were too slow); its outcome still says how.
                    batch.append(run.outcome or _NO_OUTCOME)
            if not batch:
                yield stream.keepalive()
                last_write = trio.current_time()
                continue
            while len(batch) < COALESCE_MAX and not is_terminal(batch[-1]):
                try:
                    batch.append(run.events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
    finally:
        if not finished:
            run.cancel(*client_gone_reason())
        run.events.close()
        # The level first: a runtime-checkable isinstance walks the protocol's
        # members, about 1 % of the edge's CPU for a short stream.
        if log.isEnabledFor(logging.DEBUG) and isinstance(stream, _Summarised):
            log.debug("stream %s closed: %s", run.run_id, stream.summary())


def _cut_off_when_slow(connection: ConnectionStall) -> Callable[[TerminalEvent], None]:
    """A run's ``on_outcome`` that closes its client's connection on ``slow_client``.

    The run's sink can find the client stalled before the connection's own
    guard does (``iop.edge.server._stall``, both bound by write_stall_timeout_s);
    either way the client is cut off, not left a connection it may read
    again."""

    def on_outcome(outcome: TerminalEvent) -> None:
        if isinstance(outcome, Cancelled) and outcome.reason is CancelReason.SLOW_CLIENT:
            connection.cut_off()

    return on_outcome


async def _complete(
    run: Run, collector: Collector, extra_headers: dict[str, str] | None = None
) -> Response:
    done = False
    try:
        async for ev in run.events:
            collector.feed(ev)
            if is_terminal(ev):
                break
        else:
            if run.outcome is not None:
                collector.feed(run.outcome)
        done = True
    finally:
        # Cancel before closing the channel: a run that finds its consumer
        # gone first would end as an internal error, not client_disconnect.
        if not done:
            run.cancel(*client_gone_reason())
        run.events.close()
    status, body = collector.result()
    headers = {"Retry-After": "1"} if status == 429 else None
    if extra_headers:
        headers = {**extra_headers, **(headers or {})}
    return _json_response(body, status, headers)
