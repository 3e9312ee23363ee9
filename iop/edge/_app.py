"""The edge's HTTP face: a quart-trio app over an ``EdgeCore``.

Routes: ``POST /v1/chat/completions`` (streaming and not), ``GET /v1/models``,
``GET /healthz``, ``GET /readyz``, ``GET /admin/nodes`` and the node link
WebSocket ``/v1/link``. Every error a client sees is OpenAI's error body with
the right status.

Streaming (trio-stack.md §2): the response body is an async generator that
only awaits the run's channel and yields bytes; no ``yield`` sits inside a
cancel scope or nursery (the keep-alive timeout wraps only the ``receive``).
What is already queued is coalesced into one send (§5e). When the client goes
away, quart-trio cancels the generator and its ``finally`` cancels the run
with ``client_disconnect``; the run task, owned by the core's supervisor and
not by the request, then tells the node from a shielded scope.

Request input (``docs/operations.md`` "HTTP input"): a body must be JSON
(``Content-Type: application/json`` or ``application/*+json``; no
Content-Type at all is read as JSON) or the answer is 415; the body must
arrive within ``server.body_read_timeout_s`` (408, and the connection is
closed: the rest of a dribbled body is never read); its size, depth and
values are checked by ``parse_chat_request``. Framing (smuggling, header
size) is refused below the app, in ``_http1.py``.

Headers are committed on the run's first output, or after
``keepalive_interval_s`` (then keep-alive comments follow while the run is
queued or in prefill). A run that fails before any output therefore gets a
real HTTP status (429, 404, the backend's 400...) rather than an SSE error
behind a 200.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncGenerator
from typing import Final

import msgspec
import trio
from quart import Response, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from iop.edge._admin_page import render_admin_page
from iop.edge._core import EdgeCore
from iop.edge._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from iop.edge._openai_out import (
    ChatCompletionCollector,
    ChatCompletionStream,
    cancel_message,
    cancel_status,
    error_body,
    openai_error_type,
)
from iop.edge._request import parse_chat_request
from iop.errors import IopError, RequestError
from iop.events import Cancelled, CancelReason, Error, RuntimeEvent, Start, is_terminal
from iop.protocol import CLOSE_NORMAL, CLOSE_PROTOCOL, LinkClosed
from iop.runtime import Run, new_run_id
from iop.spec import ExecutionSpec

__all__ = ["create_edge_app"]

_NO_OUTCOME: Final = Error(
    message="run ended without an outcome", status=500, code="internal_error"
)

log = logging.getLogger("iop.edge.http")

# Events taken from a run's channel per send when more are already queued:
# one write per batch instead of one per token (trio-stack.md §5e).
COALESCE_MAX: Final = 64

_SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def _json_response(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(body, status=status, content_type="application/json", headers=headers)


def _error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = error_body(message, type=openai_error_type(status), code=code, param=param)
    return _json_response(body, status, headers)


def _from_exc(exc: IopError) -> Response:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    param = exc.param if isinstance(exc, RequestError) else None
    return _error(exc.status, exc.message, code=exc.code, param=param, headers=headers)


class _WebSocketChannel:
    """``FrameChannel`` over quart's websocket object (binary frames only)."""

    def __init__(self) -> None:
        self._closed = False

    async def send(self, frame: bytes) -> None:
        if self._closed:
            raise LinkClosed("link closed")
        await websocket.send(frame)

    async def receive(self) -> bytes:
        data = await websocket.receive()
        if isinstance(data, str):
            raise LinkClosed(
                "text frame on the node link", close_code=CLOSE_PROTOCOL, reason="text frame"
            )
        return data

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        if not self._closed:
            self._closed = True
            try:
                await websocket.close(code, reason)
            except Exception as exc:  # the socket may already be gone
                log.debug("closing node websocket: %r", exc)


def create_edge_app(core: EdgeCore) -> QuartTrio:
    """The edge's ASGI app, serving ``core``."""
    cfg = core.config
    app = QuartTrio("iop.edge")
    # Quart's 60 s response timeout would cut long streams silently
    # (trio-stack.md P1); runs have their own deadlines. Its body timeout is
    # the edge's, much shorter (config.EdgeServer says why).
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = cfg.server.body_read_timeout_s
    app.config["MAX_CONTENT_LENGTH"] = cfg.server.max_body_bytes
    keys = [k.encode() for k in cfg.server.api_keys]

    def authorized() -> bool:
        if not keys:
            return True
        auth = request.headers.get("Authorization", "")
        token = auth[7:].encode() if auth.startswith("Bearer ") else b""
        ok = False
        for k in keys:
            ok |= hmac.compare_digest(token, k)
        return ok

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {
            404: f"Unknown request URL: {request.method} {request.path}.",
            405: f"Method {request.method} is not allowed on {request.path}.",
            408: f"The request body did not arrive within {cfg.server.body_read_timeout_s:g} s.",
            413: f"Request body too large (limit {cfg.server.max_body_bytes} bytes).",
        }.get(status, exc.description or exc.name)
        # A body left unread (too slow, too large) must not stay on the
        # connection: after a "Connection: close" response the connection is
        # closed (from a shielded scope, _http1.py) and nothing more is read.
        headers = {"Connection": "close"} if status in (408, 413) else None
        return _error(status, message, code=exc.name.lower().replace(" ", "_"), headers=headers)

    @app.errorhandler(Exception)
    async def crash(exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
        return _error(500, "internal server error", code="internal_error")

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

    @app.get("/v1/models")
    async def models() -> Response:
        if not authorized():
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        created = int(core.started_at)
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": created,
                "owned_by": "iop",
                "nodes": list(m.nodes),
            }
            for m in core.models()
        ]
        return _json_response(msgspec.json.encode({"object": "list", "data": data}))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(core.metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/admin")
    async def admin_page() -> Response:
        if not authorized():
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        html = render_admin_page(core.snapshot())
        return Response(html, status=200, content_type="text/html; charset=utf-8")

    @app.get("/admin/nodes")
    async def admin_nodes() -> Response:
        if not authorized():
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        return _json_response(msgspec.json.encode(core.snapshot()))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        if not authorized():
            return _error(401, "Incorrect API key provided.", code="invalid_api_key")
        unsupported = _unsupported_content_type(request.headers.get("Content-Type"))
        if unsupported is not None:
            return unsupported
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        try:
            req = parse_chat_request(body, max_depth=cfg.server.max_json_depth)
            spec = ExecutionSpec(run_id=new_run_id(), request=req, target=req.model)
            run = core.start_run(spec)
        except IopError as exc:
            return _from_exc(exc)
        policy = cfg.policy_for(req.model)
        created = int(time.time())
        completion_id = f"chatcmpl-{spec.run_id}"
        if not req.stream:
            return await _complete(
                run,
                ChatCompletionCollector(
                    completion_id=completion_id,
                    created=created,
                    model=req.model,
                    request=req,
                    policy=policy,
                ),
            )
        stream = ChatCompletionStream(
            completion_id=completion_id,
            created=created,
            model=req.model,
            request=req,
            policy=policy,
        )
        handed_over = False
        try:
            first = await _first_output(run, cfg.server.keepalive_interval_s)
            early = _early_failure(first)
            if early is not None:
                run.events.close()
                return early
            handed_over = True
            sse = _RunBody(run, _sse_body(run, stream, first, cfg.server.keepalive_interval_s))
            return Response(sse, status=200, headers=_SSE_HEADERS)
        finally:
            if not handed_over:
                run.cancel(CancelReason.CLIENT_DISCONNECT, "client disconnected")

    @app.websocket("/v1/link")
    async def node_link() -> None:
        peer = websocket.headers.get("Remote-Addr", "")
        await websocket.accept()
        await core.handle_link(_WebSocketChannel(), peer=peer)

    return app


def _unsupported_content_type(value: str | None) -> Response | None:
    """A 415 for a body that does not say it is JSON, else None.

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
    return _error(
        415,
        f"Unsupported Content-Type '{mime}': the request body must be JSON, sent with "
        "'Content-Type: application/json' (curl: -H 'Content-Type: application/json').",
        code="unsupported_media_type",
    )


class _RunBody:
    """The response body: iterates the SSE generator, and closing it cancels
    the run even if the generator never started (a client that left before
    quart began sending; an unstarted generator's ``finally`` never runs)."""

    def __init__(self, run: Run, gen: AsyncGenerator[bytes, None]) -> None:
        self._run = run
        self._gen = gen

    def __aiter__(self) -> _RunBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        # A no-op for a run that already ended.
        self._run.cancel(CancelReason.CLIENT_DISCONNECT, "client disconnected")
        await self._gen.aclose()


def _early_failure(first: list[RuntimeEvent]) -> Response | None:
    """An HTTP error for a run that ended before any output, else None."""
    if not first or any(not isinstance(e, Start) for e in first[:-1]):
        return None
    end = first[-1]
    if isinstance(end, Error):
        status, message, code = end.status, end.message, end.code
    elif isinstance(end, Cancelled):
        status, message, code = cancel_status(end.reason), cancel_message(end), end.reason.value
    else:
        return None
    return _error(
        status, message, code=code, headers={"Retry-After": "1"} if status == 429 else None
    )


async def _first_output(run: Run, wait_s: float) -> list[RuntimeEvent]:
    """Events up to the first output or terminal, waiting at most ``wait_s``."""
    got: list[RuntimeEvent] = []
    with trio.move_on_after(wait_s):
        while True:
            try:
                ev = await run.events.receive()
            except trio.EndOfChannel:
                if run.outcome is not None:
                    got.append(run.outcome)
                break
            got.append(ev)
            if not isinstance(ev, Start):
                break
    return got


async def _sse_body(
    run: Run, stream: ChatCompletionStream, first: list[RuntimeEvent], keepalive_s: float
) -> AsyncGenerator[bytes, None]:
    """The SSE body: yields bytes only, never inside a cancel scope."""
    finished = False
    try:
        yield stream.start()
        last_write = trio.current_time()
        batch = first
        while True:
            if batch:
                out = stream.feed_many(batch)
                if out:
                    yield out
                    last_write = trio.current_time()
                if stream.finished:
                    finished = True
                    return
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
            run.cancel(CancelReason.CLIENT_DISCONNECT, "client disconnected")
        run.events.close()
        log.debug("stream %s closed: %s", run.run_id, stream.summary())


async def _complete(run: Run, collector: ChatCompletionCollector) -> Response:
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
            run.cancel(CancelReason.CLIENT_DISCONNECT, "client disconnected")
        run.events.close()
    status, body = collector.result()
    headers = {"Retry-After": "1"} if status == 429 else None
    return _json_response(body, status, headers)
