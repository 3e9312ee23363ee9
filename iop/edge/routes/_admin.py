"""The admin routes: the page, login and logout, drains, runs, usage and reload.

``GET /admin`` is HTML (or its login form); ``POST /admin/login`` and
``/admin/logout``; ``GET /admin/nodes`` as JSON; ``POST
/admin/nodes/{id}/drain`` and ``/undrain``, from a script or the page's
buttons; ``POST /admin/nodes/{id}/models/{model}/load``, ``/unload``,
``/pin`` and ``/unpin`` (an on-demand model of that node: docs/operations.md,
"Operator controls"), likewise; ``GET /admin/runs`` and ``/admin/runs/{id}`` (the page for a
browser); ``GET /admin/usage``; ``POST /admin/reload``. ``_admin_auth`` says
who may open them: every route asks ``_Admin.refusal`` first (the login page
for a browser, a JSON error for a script). The forms a browser posts are
checked for their origin (``_same_origin``) beside the cookie's
``SameSite=Strict``.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from typing import Any, Final, cast
from urllib.parse import urlsplit

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from iop.config import EdgeConfig
from iop.edge._core import EdgeCore
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
from iop.edge.routes._errors import error, json_response, unsupported_content_type
from iop.errors import ErrorCode
from iop.ledger import GROUPS as USAGE_GROUPS
from iop.ledger import parse_day, period_start, report_json
from iop.protocol import ModelAction, ModelControlResult

__all__ = [
    "ADMIN_RUNS_LIMIT",
    "DRAIN_BODY_MAX_BYTES",
    "DRAIN_REASON_MAX_CHARS",
    "add_admin_routes",
    "open_gates",
]

log = logging.getLogger("iop.edge.http")

# The admin views' 401: which key they want (iop/edge/routes/_admin_auth.py).
_ADMIN_KEY_WANTED: Final = (
    "send one of server.admin_keys as `Authorization: Bearer KEY` "
    "(a client key never opens the admin views)."
)

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


def open_gates(core: EdgeCore) -> tuple[AdminGate, MetricsGate]:
    """Who may open /admin and /metrics (``_admin_auth``; a client key never
    does), from ``core.config``, and again after each reload."""
    cfg = core.config
    tenants = core.tenants
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
    return gate, metrics_gate


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
    return error(403, "Cross-origin admin request refused.", code=ErrorCode.CROSS_ORIGIN)


def _over_https() -> bool:
    """Whether the browser talks https (here, or to the TLS proxy in front)."""
    # Trusting a spoofed header only makes the spoofer's own cookie https-only.
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip()
    return request.scheme == "https" or forwarded == "https"


def _drain_too_large() -> Response:
    return error(
        413,
        f"A drain request's body is at most {DRAIN_BODY_MAX_BYTES} bytes.",
        code=ErrorCode.REQUEST_ENTITY_TOO_LARGE,
        headers={"Connection": "close"},
    )


async def _drain_reason(form: bool) -> str | Response:
    """The drain's reason from the page's form or the JSON body (may be
    absent), or the refusal of a body that is not one."""
    length = request.content_length
    if length is not None and length > DRAIN_BODY_MAX_BYTES:
        return _drain_too_large()
    if form:
        reason = str((await request.form).get("reason", ""))
    else:
        unsupported = unsupported_content_type(request.headers.get("Content-Type"))
        if unsupported is not None:
            return error(415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE)
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        if len(body) > DRAIN_BODY_MAX_BYTES:
            return _drain_too_large()
        try:
            reason = msgspec.json.decode(body, type=DrainBody).reason if body.strip() else ""
        except msgspec.DecodeError as exc:
            return error(
                400,
                f'The body must be empty or {{"reason": "..."}}: {exc}',
                code=ErrorCode.INVALID_JSON,
            )
    # One line: no control characters (a newline would forge a log line).
    reason = " ".join("".join(c if c.isprintable() else " " for c in reason).split())
    if len(reason) > DRAIN_REASON_MAX_CHARS:
        return error(
            400,
            f"reason is at most {DRAIN_REASON_MAX_CHARS} characters",
            code=ErrorCode.INVALID_VALUE,
            param="reason",
        )
    return reason


class _Admin:
    """The admin routes over one core and its admin gate."""

    def __init__(self, core: EdgeCore, gate: AdminGate) -> None:
        self.core = core
        self.gate = gate

    def refused(
        self, verdict: Verdict, *, html: bool, denied: str | None = None
    ) -> Response | None:
        """The answer to a request ``verdict`` does not allow, else None: for a
        browser (``html``) the off page or the login form (saying ``denied``),
        for a script its JSON error."""
        gate = self.gate
        if verdict is Verdict.ALLOWED:
            return None
        if html:
            if verdict is Verdict.DISABLED:
                return _html(render_off_page(ADMIN_OFF_MESSAGE), 403)
            if verdict is Verdict.THROTTLED:
                return _html(render_login_page(_throttled_message(gate)), 429, _retry_after(gate))
            return _html(render_login_page(denied), 401)
        if verdict is Verdict.DISABLED:
            return error(403, ADMIN_OFF_MESSAGE, code=ErrorCode.ADMIN_DISABLED)
        if verdict is Verdict.THROTTLED:
            return error(
                429,
                _throttled_message(gate),
                code=ErrorCode.TOO_MANY_WRONG_KEYS,
                headers=_retry_after(gate),
            )
        said = "Not an admin key: " if "Authorization" in request.headers else "No admin key: "
        return error(401, said + _ADMIN_KEY_WANTED, code=ErrorCode.INVALID_API_KEY)

    def refusal(self, *, html: bool = False) -> Response | None:
        """Whether this request may open an admin route: None, or its refusal
        (``refused``). Every admin route but login and logout asks first."""
        verdict = self.gate.check(
            request.cookies.get(COOKIE_NAME), request.headers.get("Authorization")
        )
        if verdict is Verdict.DENIED and "Authorization" in request.headers:
            _log_wrong_admin_key(self.gate, "Bearer header", request.path)
        return self.refused(verdict, html=html)

    def who(self) -> str:
        """Who an allowed admin request is, for the log: how it got in, from where."""
        if self.gate.open:
            via = "open admin (no admin key set)"
        elif request.headers.get("Authorization", "").startswith("Bearer "):
            via = "admin key"
        else:
            via = "admin session"
        return f"{via} from {request.remote_addr}"

    async def page(self) -> Response:
        refused = self.refusal(html=True)
        if refused is not None:
            return refused
        core = self.core
        usage = None
        if core.ledger is not None:
            since = period_start("day", time.time()) - (USAGE_DAYS - 1) * 86400.0
            rows = await core.ledger.report(("day",), since=since)
            usage = cast("list[dict[str, Any]]", report_json(rows, ("day",))["rows"])
        return _html(
            render_admin_page(
                core.snapshot(),
                core.runs_view(RECENT_ON_PAGE),
                logout=not self.gate.open,
                usage=usage,
            )
        )

    async def nodes(self) -> Response:
        refused = self.refusal()
        if refused is not None:
            return refused
        return json_response(msgspec.json.encode(self.core.snapshot()))

    async def drain_or_undrain(self, node_id: str, drain: bool) -> Response:
        """``POST /admin/nodes/{id}/drain`` (``drain``) or ``/undrain``.

        The page's buttons post a form (with the session cookie: refused
        cross-origin, like login and logout, and answered with a redirect to
        the page); a script posts JSON or nothing with a Bearer admin key and
        gets the node's drain state as JSON.
        """
        if not _same_origin():
            return _cross_origin_refused()
        form = request.mimetype == "application/x-www-form-urlencoded"
        refused = self.refusal(html=form)
        if refused is not None:
            return refused
        reason = await _drain_reason(form) if drain else ""
        if isinstance(reason, Response):
            return reason
        core = self.core
        try:
            if drain:
                changed = core.drain_node(node_id, reason=reason, by=self.who())
            else:
                changed = core.undrain_node(node_id, by=self.who())
        except KeyError:
            return error(
                404,
                f"No node {node_id!r} is connected or drained.",
                code=ErrorCode.NODE_NOT_FOUND,
            )
        if form:
            return _see_other("/admin")
        return json_response(msgspec.json.encode({**core.drain_view(node_id), "changed": changed}))

    async def drain(self, node_id: str) -> Response:
        return await self.drain_or_undrain(node_id, drain=True)

    async def undrain(self, node_id: str) -> Response:
        return await self.drain_or_undrain(node_id, drain=False)

    async def model_action(self, node_id: str, model: str, action: ModelAction) -> Response:
        """``POST /admin/nodes/{id}/models/{model}/{action}``: an operator's
        load, unload, pin or unpin of one node's on-demand model.

        The node does it and answers at once (a load is started, not waited
        for: ``GET /admin/nodes`` shows it loading, then ready or failed). A
        script gets the model's state after it as JSON; the page's buttons
        post a form and are sent back to the page.
        """
        if not _same_origin():
            return _cross_origin_refused()
        form = request.mimetype == "application/x-www-form-urlencoded"
        refused = self.refusal(html=form)
        if refused is not None:
            return refused
        core = self.core
        conn = core.registry.nodes.get(node_id)
        if conn is None:
            return error(404, f"No node {node_id!r} is connected.", code=ErrorCode.NODE_NOT_FOUND)
        ops = conn.model_ops
        if model not in ops.offers:
            return error(
                404,
                f"Node {node_id!r} offers no on-demand model {model!r} "
                f"(it offers: {', '.join(ops.offers) or 'none'}).",
                code=ErrorCode.MODEL_NOT_FOUND,
            )
        if not ops.controls:
            return error(
                409,
                f"Node {node_id!r} runs software ({conn.software or 'unknown'}) that takes no "
                "model load, unload, pin or unpin from the edge; upgrade it.",
                code=ErrorCode.MODEL_CONTROLS_UNSUPPORTED,
            )
        by = self.who()
        timeout_s = core.config.link.heartbeat_timeout_s
        result = await ops.control(
            conn.session, conn.wake, model, action, by=by, timeout_s=timeout_s
        )
        if result is None:
            return error(
                504,
                f"Node {node_id!r} did not answer the {action.value} of {model!r} within "
                f"{timeout_s:g}s (link.heartbeat_timeout_s), or its link closed.",
                code=ErrorCode.MODEL_CONTROL_TIMEOUT,
            )
        log.info(
            "model %s on node %s: %s by %s: %s",
            model,
            node_id,
            action.value,
            by,
            "done" if result.ok else f"{result.code}: {result.message}",
        )
        if form:
            return _see_other("/admin")
        if not result.ok:
            status = 404 if result.code == ErrorCode.MODEL_NOT_FOUND else 409
            message = core.masker.mask(result.message)
            return error(status, message, code=result.code or ErrorCode.IOP_ERROR)
        return json_response(msgspec.json.encode(_control_answer(node_id, action, result, core)))

    async def reload(self) -> Response:
        """Re-read the config file and apply what changed (docs/operations.md,
        "Reloading"): 200 with the plan, or 422 with why the file was refused."""
        if not _same_origin():
            return _cross_origin_refused()
        refused = self.refusal()
        if refused is not None:
            return refused
        reloader = self.core.reloader
        if reloader is None:
            return error(
                409,
                "This edge has no config file to re-read (it was started without --config).",
                code=ErrorCode.RELOAD_UNAVAILABLE,
            )
        outcome = await reloader.reload(f"POST /admin/reload by {self.who()}")
        status = 422 if outcome.status == "refused" else 200
        return json_response(msgspec.json.encode(outcome), status)

    async def usage(self) -> Response:
        """The usage ledger's sums (``iop usage --format json``'s answer):
        ``by`` (comma-separated of day, tenant, model, key_name; default
        ``day,tenant,model``), ``since`` / ``until`` (``YYYY-MM-DD``, UTC;
        ``until`` excluded), ``tenant``. 404 without a ledger."""
        refused = self.refusal()
        if refused is not None:
            return refused
        ledger = self.core.ledger
        if ledger is None:
            return error(
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
            return error(400, str(exc), code=ErrorCode.INVALID_REQUEST)
        rows = await ledger.report(by, since=since, until=until, tenant=args.get("tenant"))
        return json_response(msgspec.json.encode(report_json(rows, by)))

    async def runs(self) -> Response:
        refused = self.refusal()
        if refused is not None:
            return refused
        recent = self.core.config.timelines.recent
        raw = request.args.get("limit", str(ADMIN_RUNS_LIMIT))
        if not raw.isdigit() or not 0 <= int(raw) <= recent:
            return error(
                400,
                f"limit must be an integer from 0 to {recent} (timelines.recent)",
                code=ErrorCode.INVALID_REQUEST,
                param="limit",
            )
        return json_response(msgspec.json.encode(self.core.runs_view(int(raw))))

    async def run(self, run_id: str) -> Response:
        # A browser (the admin page's links) gets the page, a script the JSON.
        browser = _wants_html(request.headers.get("Accept", ""))
        refused = self.refusal(html=browser)
        if refused is not None:
            return refused
        view = self.core.run_view(run_id)
        if view is not None and browser:
            return _html(render_run_page(view, logout=not self.gate.open))
        if view is None:
            return error(
                404,
                f"No run {run_id!r} is live or among the {self.core.config.timelines.recent} "
                "kept (timelines.recent).",
                code=ErrorCode.NOT_FOUND,
            )
        return json_response(msgspec.json.encode(view))

    async def login_form(self) -> Response:
        return _see_other("/admin")

    async def login(self) -> Response:
        if not _same_origin():
            return _cross_origin_refused()
        form = await request.form
        gate = self.gate
        verdict = gate.login(form.get("key", ""))
        if verdict is Verdict.DENIED:
            _log_wrong_admin_key(gate, "login form", request.path)
        refused = self.refused(verdict, html=True, denied="Wrong key.")
        if refused is not None:
            return refused
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

    async def logout(self) -> Response:
        if not _same_origin():
            return _cross_origin_refused()
        self.gate.logout(request.cookies.get(COOKIE_NAME))
        resp = _see_other("/admin")
        resp.delete_cookie(
            COOKIE_NAME, path="/admin", secure=_over_https(), httponly=True, samesite="Strict"
        )
        return resp


def _control_answer(
    node_id: str, action: ModelAction, result: ModelControlResult, core: EdgeCore
) -> dict[str, object]:
    offer = result.offer
    state = None if offer is None else {f: getattr(offer, f) for f in offer.__struct_fields__}
    return core.masker.mask_tree(
        {
            "node": node_id,
            "model": result.model,
            "action": action.value,
            "message": result.message,
            "state": state,
        }
    )


def add_admin_routes(app: QuartTrio, core: EdgeCore, gate: AdminGate) -> None:
    """Route ``/admin*`` of ``app`` to ``core``, behind ``gate``."""
    admin = _Admin(core, gate)
    get, post = ["GET"], ["POST"]
    app.add_url_rule("/admin", "admin_page", admin.page, methods=get)
    app.add_url_rule("/admin/nodes", "admin_nodes", admin.nodes, methods=get)
    # ``path``: node ids are the operator's strings (any but "/" is likely;
    # the converter takes that too).
    app.add_url_rule("/admin/nodes/<path:node_id>/drain", "admin_drain", admin.drain, methods=post)
    app.add_url_rule(
        "/admin/nodes/<path:node_id>/undrain", "admin_undrain", admin.undrain, methods=post
    )
    for action in ModelAction:
        app.add_url_rule(
            f"/admin/nodes/<path:node_id>/models/<path:model>/{action.value}",
            f"admin_model_{action.value}",
            partial(admin.model_action, action=action),
            methods=post,
        )
    app.add_url_rule("/admin/reload", "admin_reload", admin.reload, methods=post)
    app.add_url_rule("/admin/usage", "admin_usage", admin.usage, methods=get)
    app.add_url_rule("/admin/runs", "admin_runs", admin.runs, methods=get)
    app.add_url_rule("/admin/runs/<run_id>", "admin_run", admin.run, methods=get)
    app.add_url_rule("/admin/login", "admin_login_form", admin.login_form, methods=get)
    app.add_url_rule("/admin/login", "admin_login", admin.login, methods=post)
    app.add_url_rule("/admin/logout", "admin_logout", admin.logout, methods=post)
