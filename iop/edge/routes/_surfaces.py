"""The API surface routes: admission, the run, and its streamed or collected body.

Every surface is served by one handler (``_Surfaces.answer``), so adding one
is one ``SurfaceRoute(path, surface, key_of)`` line in ``surface_routes``:
the surface (``iop.api.Surface``, sans-IO) parses the body and turns the
run's events into bytes; this module only checks the API key and the content
type, reads the body, admits the request into its tenant's limits, starts
the run and writes what comes back. It is served below quart
(``iop.edge.server._surface_asgi``: quart's per-request machinery was the
largest part of a short request's cost on the edge): an answer is an
``Answer``, the status and ASGI headers of ``http.response.start`` and a
body, whole bytes or a streamed ``EndKnownBody``.

Streaming (docs/architecture.md, "Facts about our dependencies: quart and
quart-trio"): the response body is an async generator that only awaits the
run's channel and yields bytes; no ``yield`` sits inside a cancel scope or
nursery, and its waits have no timeout of their own: one clock keeps every
stream's keep-alive time (``iop.edge.runs._keepalive``). What is already
queued is coalesced into one send (docs/benchmarks.md, "Earlier
measurements: The trio-stack spike"). When the client goes away, the ASGI
layer cancels the answer and closes the body, and the body's ``finally``
cancels the run with ``client_disconnect`` (``slow_client`` when the edge's
write-stall guard closed the connection, ``iop.edge.server._stall``); the
run task, owned by the core's supervisor and not by the request, then tells
the node from a shielded scope.

Request input (``docs/operations.md`` "HTTP input"): a body must be JSON
(``Content-Type: application/json`` or ``application/*+json``; no
Content-Type at all is read as JSON) or the answer is 415; the body must
arrive within ``server.body_read_timeout_s`` (408, and the connection is
closed: the rest of a dribbled body is never read); its size, depth and
values are checked by each surface's parser (``iop.api._json_guard`` first,
the same guards for every surface). Framing (smuggling, header size) is
refused below the app, in ``iop/edge/server/_http1.py``.

Headers are committed on the run's first output, or after
``keepalive_interval_s`` (then keep-alive comments follow while the run is
queued or in prefill). A run that fails before any output therefore gets a
real HTTP status (429, 404, the backend's 400...) rather than an SSE error
behind a 200.

Anthropic's ``POST /v1/messages/count_tokens`` is a quart route here too: a
tokenize run, collected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, MutableMapping, Sequence
from functools import partial
from typing import Final, NamedTuple, Protocol, runtime_checkable

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers

from iop.api import (
    ANTHROPIC_AUTH_FAILED,
    Call,
    ChatSurface,
    Collector,
    CompletionsSurface,
    EmbeddingsSurface,
    MessagesSurface,
    ResponsesSurface,
    RunContext,
    StreamEncoder,
    Surface,
    shape_failure,
)
from iop.config import EdgeConfig, Objective
from iop.edge._core import EdgeCore
from iop.edge.batches import LineAnswer
from iop.edge.routes._errors import (
    KeyReader,
    anthropic_key,
    bearer_key,
    error,
    error_answer,
    exc_answer,
    from_exc,
    json_answer,
    json_response,
    key_refused,
    raw_headers,
    request_headers,
    retry_after,
    unsupported_content_type,
)
from iop.edge.runs import KeepaliveClock
from iop.edge.server._stall import ConnectionStall, client_gone_reason, current_connection
from iop.edge.server._surface_asgi import Answer, BodyReader, EndKnownBody, SurfaceAnswer
from iop.edge.tenancy._charges import charged_usage
from iop.edge.tenancy._limits import RateLimited, rate_headers, retry_headers
from iop.edge.tenancy._tenants import Tenant, Ticket, no_access
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
from iop.runtime import Run, new_run_id
from iop.spec import ExecutionSpec, TokenizeRequest
from iop.tracing import valid_traceparent

__all__ = ["COUNT_TOKENS_PATH", "SurfaceRoute", "add_surface_routes", "surface_routes"]

log = logging.getLogger("iop.edge.http")

# Anthropic's token counting, beside its Messages route.
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"

# Events taken from a run's channel per send when more are already queued:
# one write per batch instead of one per token (docs/benchmarks.md, "Earlier
# measurements: The trio-stack spike").
COALESCE_MAX: Final = 64

_NO_OUTCOME: Final = Error(
    message="run ended without an outcome", status=500, code=ErrorCode.INTERNAL_ERROR
)

# An SSE answer's head, as http.response.start has it (what quart sent, in its order).
_SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


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


# What a batch line meets that says "not now" rather than answering it: the
# edge has no capacity for it yet (iop.edge.batches, "Spare capacity").
_NOT_NOW: Final = frozenset(
    {
        ErrorCode.QUEUE_FULL,
        ErrorCode.NO_NODES,
        ErrorCode.MODEL_NOT_FOUND,
        ErrorCode.MODEL_UNAVAILABLE,
        ErrorCode.DRAINING,
        ErrorCode.NODE_DRAINING,
    }
)
# A run cut by the edge's queue, its shutdown or a node that went away: the
# line was not answered, only interrupted.
_CUT_SHORT: Final = frozenset(
    {CancelReason.QUEUE_TIMEOUT, CancelReason.SHUTDOWN, CancelReason.NODE_LOST}
)


class _Surfaces:
    """The surface routes over one core; ``messages`` answers count_tokens."""

    def __init__(
        self, core: EdgeCore, messages: MessagesSurface, routes: Sequence[SurfaceRoute] = ()
    ) -> None:
        self.core = core
        self.messages = messages
        self.by_path = {r.path: r for r in routes}

    async def _start(
        self,
        surface: Surface,
        tenant: Tenant,
        key_name: str,
        body: bytes,
        headers: Mapping[str, str],
        objective: Objective | None = None,
        *,
        batch: bool = False,
    ) -> tuple[Call, Ticket, Run]:
        """Parse ``body``, admit it into ``tenant``'s limits and start its run:
        what every request of a surface, and every batch line, goes through.

        Raises:
            RateLimited: Over one of the tenant's limits or budgets.
            IopError: The surface's 4xx, a model the tenant may not use, or
                the run refused (``EdgeCore.start_run``; its ticket settled).
        """
        core = self.core
        call = surface.parse(body, headers, tenant=tenant.name)
        if not tenant.may_use(call.request.model):
            raise no_access(call.request.model)
        ticket = await core.admit(tenant, call.request, key_name, batch=batch)
        spec = ExecutionSpec(
            run_id=new_run_id(),
            request=call.request,
            target=call.request.model,
            # A client's trace context (checked): the run joins its trace.
            traceparent=valid_traceparent(headers.get("traceparent")),
        )
        try:
            run = core.start_run(spec, collect=not call.stream, ticket=ticket, objective=objective)
        except IopError:
            core.settle(ticket, Usage())  # it never ran
            raise
        return call, ticket, run

    def check_line(self, path: str, tenant: str, body: bytes) -> None:
        """A batch line's body, parsed as ``path``'s surface parses a request.

        Raises:
            RequestError: What the surface answers the body with.
        """
        self.by_path[path].surface.parse(body, {}, tenant=tenant)

    async def line(
        self, path: str, tenant_name: str, key_name: str, body: bytes, objective: Objective
    ) -> LineAnswer:
        """One batch line: what ``answer`` does for a non-streaming request
        (parse, the tenant's admission, the run, its collector), with the
        batch's tenant and ``objective``, and no HTTP.

        A refusal for want of capacity (``_NOT_NOW``, any 429: the queue's,
        a sheddable run shed or evicted, the backend's; the tenant's limits;
        a run cut short, ``_CUT_SHORT``) is ``LineAnswer.refused``: the batch
        runs the line again later."""
        core = self.core
        surface = self.by_path[path].surface
        tenant = core.tenants.all.get(tenant_name)
        if tenant is None:
            status, out = surface.error_body(
                401,
                f"Tenant {tenant_name!r} of this batch is no longer configured.",
                code=ErrorCode.INVALID_API_KEY,
            )
            return LineAnswer(status, out, new_run_id())
        try:
            # A line is never streamed (iop.batches._jsonl refuses stream).
            call, _, run = await self._start(
                surface, tenant, key_name, body, {}, objective, batch=True
            )
        except RateLimited as exc:
            core.metrics.tenant_refused.labels(tenant.name, exc.limit).inc()
            return LineAnswer(429, b"", "", refused=True)
        except IopError as exc:
            if exc.code in _NOT_NOW or exc.status == 429:
                return LineAnswer(exc.status, b"", "", refused=True)
            param = exc.param if isinstance(exc, RequestError) else None
            status, out = surface.error_body(exc.status, exc.message, code=exc.code, param=param)
            return LineAnswer(status, out, new_run_id())
        run_id, spec = run.run_id, run.spec
        ctx = RunContext(
            run_id=run_id,
            created=int(time.time()),
            policy=core.config.policy_for(call.request.model),
        )
        collector = surface.collector(call, ctx)
        # Left early: the batch was cancelled, expired, or the edge stops.
        await _collect(
            run,
            collector,
            lambda: (CancelReason.EXPLICIT, "its batch was cancelled or the edge stopped"),
        )
        outcome = run.outcome
        if (isinstance(outcome, Error) and (outcome.code in _NOT_NOW or outcome.status == 429)) or (
            isinstance(outcome, Cancelled) and outcome.reason in _CUT_SHORT
        ):
            return LineAnswer(429, b"", run_id, refused=True)
        status, out = collector.result()
        usage = charged_usage(outcome, spec.operation) if outcome is not None else None
        return LineAnswer(status, out, run_id, usage or Usage())

    async def answer(
        self, route: SurfaceRoute, headers: Mapping[str, str], read_body: BodyReader
    ) -> Answer:
        """One request of ``route.surface``: parse, run, then stream or collect.

        ``headers`` have lower-cased names; ``read_body`` reads the whole body
        (raising werkzeug's 408 or 413). Served below quart (``_surface_asgi``).
        """
        core = self.core
        tenants = core.tenants
        surface = route.surface
        key = route.key_of(headers)
        tenant = tenants.identify(key)
        if tenant is None:
            message = key_refused(key, route.auth_failed, anthropic=route.key_of is anthropic_key)
            return error_answer(401, message, code=ErrorCode.INVALID_API_KEY, surface=surface)
        unsupported = unsupported_content_type(headers.get("content-type"))
        if unsupported is not None:
            return error_answer(
                415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE, surface=surface
            )
        body = await read_body()
        anthropic = isinstance(surface, MessagesSurface)
        limit_headers: dict[str, str] | None = None
        try:
            call, ticket, run = await self._start(
                surface, tenant, tenants.key_name(route.key_of(headers)), body, headers
            )
            if ticket.limits:
                limit_headers = rate_headers(ticket.limits, anthropic)
        except RateLimited as exc:
            core.metrics.tenant_refused.labels(tenant.name, exc.limit).inc()
            return exc_answer(exc, surface, retry_headers(exc, anthropic))
        except IopError as exc:
            backoff = core.config.scheduler.model_load_backoff_s
            return exc_answer(exc, surface, retry_after(exc.status, exc.code, backoff))
        spec = run.spec
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
                return await _complete(
                    run, collector, limit_headers, core.config.scheduler.model_load_backoff_s
                )
            stream = surface.stream(call, ctx)
            keepalive_s = core.config.server.keepalive_interval_s
            first = await _first_output(run, keepalive_s)
            early = _early_failure(
                first, surface, limit_headers, core.config.scheduler.model_load_backoff_s
            )
            if early is not None:
                run.events.close()
                return early
            handed_over = True
            sse = _RunBody(run, stream, _sse_body(run, stream, first, keepalive_s, core.keepalives))
            if limit_headers:
                return Answer(200, (*_SSE_HEADERS, *raw_headers(limit_headers)), sse)
            return Answer(200, _SSE_HEADERS, sse)
        finally:
            if not handed_over:
                run.cancel(*client_gone_reason())

    async def count_tokens(self) -> Response:
        """Anthropic's count_tokens: a tokenize run on the model's backend; IOP's
        estimate (said so in a header) when the backend has no tokenizer.

        A request of its tenant like any other: it takes one from
        ``requests_per_minute`` and a place of ``max_concurrent_runs`` while
        it runs (429 over either), and reserves and is charged no tokens:
        it generates none (docs/operations.md, "Tenants and limits")."""
        core = self.core
        tenants = core.tenants
        messages = self.messages
        headers = request_headers()
        key = anthropic_key(headers)
        tenant = tenants.identify(key)
        if tenant is None:
            message = key_refused(key, ANTHROPIC_AUTH_FAILED, anthropic=True)
            return error(401, message, code=ErrorCode.INVALID_API_KEY, surface=messages)
        unsupported = unsupported_content_type(headers.get("content-type"))
        if unsupported is not None:
            return error(415, unsupported, code=ErrorCode.UNSUPPORTED_MEDIA_TYPE, surface=messages)
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
            return from_exc(exc, messages, retry_headers(exc, anthropic=True))
        except RequestError as exc:
            return from_exc(exc, messages)
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
                return from_exc(exc, messages)
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
                return error(failed.status, failed.message, code=failed.code, surface=messages)
        status, out, extra = messages.count_tokens(counted, exact=exact)
        return json_response(out, status, {**extra, **limit_headers})


def add_surface_routes(
    app: QuartTrio,
    core: EdgeCore,
    routes: Sequence[SurfaceRoute],
    messages: MessagesSurface,
    surfaces: MutableMapping[str, Surface],
) -> dict[str, SurfaceAnswer]:
    """The answer of each surface route's path, served below quart; count_tokens
    in quart. Each path's surface goes into ``surfaces`` (its errors' shape)."""
    served = _Surfaces(core, messages, routes)
    # Batch lines run through the same surfaces (iop.edge.batches).
    core.batches.bind(served.line, served.check_line)
    answers: dict[str, SurfaceAnswer] = {}
    for route in routes:
        surfaces[route.path] = route.surface
        answers[route.path] = partial(served.answer, route)
        # The same answer in quart, for a path only quart's routing matches
        # (``//v1/chat/completions``: werkzeug merges the slashes); the
        # rule also has quart answer the path's other methods (405, OPTIONS).
        app.add_url_rule(
            route.path,
            endpoint=f"surface:{route.path}",
            view_func=partial(_in_quart, served.answer, route),
            methods=["POST"],
        )
    app.add_url_rule(COUNT_TOKENS_PATH, "count_tokens", served.count_tokens, methods=["POST"])
    surfaces[COUNT_TOKENS_PATH] = messages
    return answers


async def _in_quart(
    answer: Callable[[SurfaceRoute, Mapping[str, str], BodyReader], Awaitable[Answer]],
    route: SurfaceRoute,
) -> Response:
    """``answer`` as a quart view: its status, headers and body in a ``Response``."""
    status, head, body = await answer(route, request_headers(), _quart_body)
    headers = Headers([(name.decode("latin-1"), value.decode("latin-1")) for name, value in head])
    return Response(body, status=status, headers=headers)


async def _quart_body() -> bytes:
    body = await request.get_data(cache=False)
    assert isinstance(body, bytes)
    return body


class _RunBody(EndKnownBody):
    """The response body: iterates the SSE generator, and closing it cancels
    the run even if the generator never started (a client that left before
    the body was asked for its first piece; an unstarted generator's
    ``finally`` never runs)."""

    __slots__ = ("_gen", "_run", "_stream")

    def __init__(self, run: Run, stream: StreamEncoder, gen: AsyncGenerator[bytes, None]) -> None:
        self._run = run
        self._stream = stream
        self._gen = gen

    @property
    def at_end(self) -> bool:
        """Whether the piece just given was the last (``_sse_body``)."""
        return self._stream.finished

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        # A no-op for a run that already ended.
        self._run.cancel(*client_gone_reason())
        await self._gen.aclose()


def _early_failure(
    first: list[RuntimeEvent],
    surface: Surface,
    limit_headers: Mapping[str, str] | None,
    load_backoff_s: float,
) -> Answer | None:
    """An HTTP error for a run that ended before any output, else None."""
    if not first or any(not isinstance(e, Start) for e in first[:-1]):
        return None
    end = first[-1]
    if not isinstance(end, Error | Cancelled):
        return None
    failed = shape_failure(end)
    headers = retry_after(failed.status, failed.code, load_backoff_s)
    status, head, body = error_answer(
        failed.status,
        failed.message,
        code=failed.code,
        param=failed.param,
        headers=headers,
        surface=surface,
    )
    if limit_headers:  # after the error's own headers, as quart's ``headers.update``
        head = [*head, *raw_headers(limit_headers)]
    return Answer(status, head, body)


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
    run: Run,
    stream: StreamEncoder,
    first: list[RuntimeEvent],
    keepalive_s: float,
    clock: KeepaliveClock,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: yields bytes only, and opens no cancel scope.

    The stream's opening chunk goes out with the first batch (``first``, the
    events ``_first_output`` found), in one piece: one write to the client,
    not two. Its last piece is yielded with ``stream.finished`` already set,
    so that ``_RunBody.at_end`` tells the ASGI layer it is the last
    (``_surface_asgi``: it leaves in the same write as the chunked
    terminator), and the body may be closed right there.

    Each wait for the run's next event has no deadline of its own: the
    edge's keep-alive clock (``iop.edge.runs._keepalive``) interrupts it
    once the stream has written nothing for ``keepalive_s``, and the stream
    writes a keep-alive. What is queued behind an event goes out with it,
    up to ``COALESCE_MAX`` events: one wake-up, one write.
    """
    finished = False
    events = run.events
    watch = clock.watch(events, keepalive_s)
    try:
        opening = stream.start()
        if not first:  # no output within keepalive_s: the head and opening now
            yield opening
            opening = b""
            watch.last_write = trio.current_time()
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
                now = trio.current_time()
                if out:
                    yield out
                    watch.last_write = now = trio.current_time()
                elif now - watch.last_write >= keepalive_s:
                    # Events arrive but nothing goes out (a buffered or strict
                    # stream holding its text): keep the connection alive.
                    yield stream.keepalive()
                    watch.last_write = trio.current_time()
            try:
                batch = [await events.receive()]
            except trio.WouldBlock:
                # The clock: nothing written for keepalive_s.
                yield stream.keepalive()
                watch.last_write = trio.current_time()
                batch = []
                continue
            except trio.EndOfChannel:
                # The run ended without handing us its terminal event
                # (we were too slow); its outcome still says how.
                batch = [run.outcome or _NO_OUTCOME]
                continue
            while len(batch) < COALESCE_MAX and not is_terminal(batch[-1]):
                try:
                    batch.append(events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
    finally:
        clock.discard(watch)
        if not finished:
            run.cancel(*client_gone_reason())
        events.close()
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


async def _collect(
    run: Run, collector: Collector, why_left: Callable[[], tuple[CancelReason, str]]
) -> None:
    """Feed ``run``'s events to ``collector`` up to its terminal; leaving
    early (cancelled) cancels the run for ``why_left()``'s reason."""
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
        # gone first would end as an internal error, not with that reason.
        if not done:
            run.cancel(*why_left())
        run.events.close()


async def _complete(
    run: Run,
    collector: Collector,
    extra_headers: dict[str, str] | None = None,
    load_backoff_s: float = 1.0,
) -> Answer:
    await _collect(run, collector, client_gone_reason)
    status, body = collector.result()
    outcome = run.outcome
    code = outcome.code if isinstance(outcome, Error) else ""
    headers = retry_after(status, code, load_backoff_s)
    if extra_headers:
        headers = {**extra_headers, **(headers or {})}
    return json_answer(body, status, headers)
