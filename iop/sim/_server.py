"""The simulated backend as an HTTP server speaking vLLM's wire format.

``create_sim_app(cfg)`` builds a quart-trio app with vLLM's routes
(``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming and
not, ``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize``,
``GET /v1/models``, ``GET /health``); ``serve_sim`` runs it on hypercorn's
trio worker. What the model says and when comes from ``iop.sim._script``
(chat), ``iop.sim._completions``, ``iop.sim._embeddings`` and
``iop.sim._tokenizer``, the bytes from those and ``iop.sim._vllm_wire``;
this module only does the IO: it reads the request, sleeps the script's
delays and writes the frames.

An embeddings request takes ``ttft_s`` to compute (the prefill of its
inputs) and honours the same injected failures as a non-streamed chat
answer, so that cancelling it can be tested the same way.

Streams are async generators that only ``trio.sleep`` and ``yield`` bytes
(no nursery or cancel scope around a ``yield``: docs/architecture.md, "Facts
about our dependencies: quart and quart-trio"). A
client that disconnects makes quart-trio cancel the generator, whose
``finally`` counts it in ``app.sim_stats``: tests assert that the server saw
the client go away, which is what makes a real vLLM abort the generation.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Final

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed, NotFound, RequestEntityTooLarge

from iop.config import SimConfig
from iop.errors import RequestError, listen_error_from
from iop.sim._completions import (
    build_completion_script,
    completion_stream_plan,
    completion_text_body,
    parse_completion_request,
)
from iop.sim._embeddings import check_embedding_request, embedding_body, parse_embedding_request
from iop.sim._engine import Admission, Engine, PrefixCache
from iop.sim._script import apply_overrides, build_script
from iop.sim._tokenize_api import detokenize_body, tokenize_body
from iop.sim._tokenizer import tokenize_chat
from iop.sim._vllm_wire import (
    SSE_CONTENT_TYPE,
    Ending,
    StreamPlan,
    cache_salt,
    completion_body,
    error_body,
    injected_http_error,
    model_not_found,
    models_body,
    parse_chat_request,
    request_priority,
    stream_plan,
)

__all__ = ["MAX_REQUEST_BYTES", "SimApp", "SimStats", "create_sim_app", "serve_sim"]

log = logging.getLogger("iop.sim")

# A chat request with a long conversation and many tool schemas is a few
# hundred KiB; 4 MiB leaves room for that and still bounds what one request
# can make the sim buffer.
MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024

# How long open streams may run on after shutdown is triggered. Stalled
# streams never end by themselves, so keep it short: Ctrl-C should be prompt.
SHUTDOWN_GRACE_S: Final = 1.0

_JSON: Final = "application/json"
# Event batches in one /kv_events answer: one per admitted request, up to
# tens of KiB each with its token ids, so the answer also stops at
# KV_EVENTS_ANSWER_BYTES (iop/sim/_engine.py), within a reader's page
# limit; a reader behind asks again.
KV_EVENTS_PER_ANSWER: Final = 256


@dataclasses.dataclass
class SimStats:
    """What the server has seen; read by tests and benchmarks.

    Attributes:
        requests: ``POST /v1/chat/completions`` requests received.
        completions_requests: ``POST /v1/completions`` requests received.
        embeddings_requests: ``POST /v1/embeddings`` requests received.
        tokenize_requests: ``POST /tokenize`` and ``/detokenize`` requests.
        statuses: Responses by HTTP status.
        streams_opened: Streamed responses started (chat and completions).
        streams_finished: Streams that ran to the end of their plan.
        open_streams: Streams currently open.
        open_completions: Non-streamed answers currently being generated
            (chat, completions and embeddings).
        client_disconnects: Generations (streamed or not, embeddings too)
            cut off before their end because the client went away (or the
            server shut down).
        traceparents: The ``traceparent`` headers of the last
            ``TRACEPARENTS_KEPT`` chat requests that had one (W3C Trace
            Context: a backend that traces would join that trace).
    """

    requests: int = 0
    completions_requests: int = 0
    embeddings_requests: int = 0
    tokenize_requests: int = 0
    statuses: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    streams_opened: int = 0
    streams_finished: int = 0
    open_streams: int = 0
    open_completions: int = 0
    client_disconnects: int = 0
    traceparents: list[str] = dataclasses.field(default_factory=list)

    def saw_traceparent(self, value: str | None) -> None:
        if value:
            self.traceparents.append(value[:TRACEPARENT_MAX_CHARS])
            del self.traceparents[:-TRACEPARENTS_KEPT]


# What /sim/stats keeps of the trace contexts it was sent: enough for a test
# to find its own request's, bounded whatever the clients send.
TRACEPARENTS_KEPT: Final = 64
TRACEPARENT_MAX_CHARS: Final = 256


class SimApp(QuartTrio):
    """The sim's quart-trio app; ``sim_config`` and ``sim_stats`` are public."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__("iop.sim")
        self.sim_config = cfg
        self.sim_stats = SimStats()
        # The engine model (off unless its keys are set): one per server.
        self.engine = Engine(cfg)
        self.started_at = int(time.time())


def _json_response(body: bytes, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status=status, headers=headers, content_type=_JSON)


def _error_response(exc: RequestError) -> Response:
    return _json_response(error_body(exc.message, status=exc.status, param=exc.param), exc.status)


async def _stream_body(
    plan: StreamPlan, stats: SimStats, run: _EngineRun | None = None
) -> AsyncIterator[bytes]:
    stats.streams_opened += 1
    stats.open_streams += 1
    finished = False
    try:
        if run is None:
            for frame in plan.frames:
                if frame.delay_s > 0:
                    await trio.sleep(frame.delay_s)
                yield frame.data
        else:
            first = (plan.frames[0].delay_s if plan.frames else 0.0) + run.admission.prefill_s
            async with run.engine.seat(
                run.admission, priority=run.priority, recompute_s=first
            ) as seat:
                for i, frame in enumerate(plan.frames):
                    # The first frame waits for prefill too; the others for
                    # a token of a batch as big as the engine's now. A
                    # preempted request waits in ``work``: its client sees
                    # a pause (iop.sim._engine).
                    delay = (
                        first if i == 0 else frame.delay_s * run.engine.decode_factor(run.config)
                    )
                    if delay > 0 or not seat.running:
                        await run.engine.work(seat, delay)
                    yield frame.data
        if plan.ending is Ending.STALL:
            await trio.sleep_forever()
        finished = True
    finally:
        stats.open_streams -= 1
        if finished:
            stats.streams_finished += 1
        else:
            stats.client_disconnects += 1


@dataclasses.dataclass(frozen=True)
class _EngineRun:
    """A request's place in the engine model (``iop.sim._engine``)."""

    engine: Engine
    admission: Admission
    config: SimConfig  # the request's (the server's with its overrides)
    priority: int = 0  # the body's ``priority`` (lower first)


async def _complete(
    cfg: SimConfig,
    delay_s: float,
    body: Callable[[], bytes],
    stats: SimStats,
    run: _EngineRun | None = None,
) -> Response:
    """A non-streaming answer, ``body()``, after the whole generation time."""
    finished = False
    stats.open_completions += 1
    try:
        if cfg.failure in ("stall_before_first_byte", "stall_mid_stream"):
            await trio.sleep_forever()
        if run is None:
            if delay_s > 0:
                await trio.sleep(delay_s)
        else:
            first = cfg.ttft_s + run.admission.prefill_s
            async with run.engine.seat(
                run.admission, priority=run.priority, recompute_s=first
            ) as seat:
                delay_s = run.admission.prefill_s + delay_s * run.engine.decode_factor(cfg)
                await run.engine.work(seat, delay_s)
        if cfg.failure == "midstream_error":
            data = b""
        else:
            # In a worker thread: a 2048-input embeddings body takes seconds
            # of CPU, which must not stall every other stream of the server.
            # A client that leaves meanwhile is counted like one that left
            # during the delay (the thread's result is dropped).
            data = await trio.to_thread.run_sync(body, abandon_on_cancel=True)
        finished = True
    finally:
        stats.open_completions -= 1
        if not finished:
            stats.client_disconnects += 1
    if cfg.failure == "midstream_error":
        # vLLM's full generator turns an engine failure into a 500.
        return _json_response(error_body("sim: injected generation error", status=500), 500)
    return _body_response(cfg, data)


def _body_response(cfg: SimConfig, body: bytes) -> Response:
    if cfg.failure == "truncate":
        # Half a JSON document, then the connection closes.
        return _json_response(body[: len(body) // 2], 200, {"Connection": "close"})
    return _json_response(body, 200)


def _stream_response(plan: StreamPlan, stats: SimStats, run: _EngineRun | None = None) -> Response:
    headers = {"Connection": "close"} if plan.ending is Ending.TRUNCATE else None
    response = Response(
        _stream_body(plan, stats, run), status=200, headers=headers, content_type=SSE_CONTENT_TYPE
    )
    response.timeout = None
    return response


def _injected(cfg: SimConfig) -> Response | None:
    """The injected ``http_*`` failure's response, if ``cfg`` has one."""
    injected = injected_http_error(cfg, authorization=request.headers.get("Authorization", ""))
    if injected is None:
        return None
    status, body = injected
    headers = {"Retry-After": "1"} if status == 429 else None
    return _json_response(body, status, headers)


def _check_model(model: str | None, cfg: SimConfig) -> None:
    # vLLM serves the request with its model when the body names none.
    if model is not None and model != cfg.model:
        raise model_not_found(model)


def create_sim_app(cfg: SimConfig) -> SimApp:
    """Build the sim's app: vLLM's routes, answering from ``cfg``.

    Args:
        cfg: What to simulate; a request's ``iop_sim`` key overrides it for
            that request.
    """
    app = SimApp(cfg)
    # Quart's 60 s response timeout would silently cut long streams
    # (docs/architecture.md, "Facts about our dependencies: quart and
    # quart-trio"); run deadlines belong to the client.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    stats = app.sim_stats

    @app.after_request
    async def count_status(response: Response) -> Response:
        stats.statuses[response.status_code] += 1
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        stats.requests += 1
        stats.saw_traceparent(request.headers.get("traceparent"))
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        try:
            chat = parse_chat_request(raw)
            if chat.model != cfg.model:
                raise model_not_found(chat.model)
            salt = cache_salt(chat.extra_body)
            priority = request_priority(chat.extra_body, cfg)
            script = build_script(chat, cfg)
        except RequestError as exc:
            log.debug("sim: refused request (%d): %s", exc.status, exc.message)
            return _error_response(exc)
        if (injected := _injected(script.config)) is not None:
            return injected
        run = None
        if app.engine.enabled:
            prompt = tokenize_chat(chat.messages, tools=chat.tools or ())
            admission = app.engine.admit(prompt, script.config, salt)
            run = _EngineRun(app.engine, admission, script.config, priority)
            script = msgspec.structs.replace(
                script, prompt_tokens=admission.prompt_tokens, cached_tokens=admission.cached_tokens
            )
        created = int(time.time())
        if not chat.stream:
            return await _complete(
                script.config,
                script.total_delay_s,
                partial(completion_body, script, created=created),
                stats,
                run,
            )
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        return _stream_response(
            stream_plan(script, created=created, include_usage=include_usage), stats, run
        )

    @app.post("/v1/completions")
    async def completions() -> Response:
        stats.completions_requests += 1
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        try:
            body = parse_completion_request(raw)
            _check_model(body.model, cfg)
            # Many prompts make many frames: plan them off the event loop.
            script = await trio.to_thread.run_sync(
                build_completion_script, body, cfg, abandon_on_cancel=True
            )
        except RequestError as exc:
            log.debug("sim: refused completions request (%d): %s", exc.status, exc.message)
            return _error_response(exc)
        if (injected := _injected(script.config)) is not None:
            return injected
        created = int(time.time())
        if not body.stream:
            return await _complete(
                script.config,
                script.total_delay_s,
                partial(completion_text_body, script, created=created),
                stats,
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        plan = await trio.to_thread.run_sync(
            partial(completion_stream_plan, script, created=created, include_usage=include_usage),
            abandon_on_cancel=True,
        )
        return _stream_response(plan, stats)

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        stats.embeddings_requests += 1
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        try:
            body = parse_embedding_request(raw)
            _check_model(body.model, cfg)
            effective = apply_overrides(body.extra_body, cfg)
            # Checked up front: a bad input is a 400 before any waiting.
            check_embedding_request(body, effective)
        except RequestError as exc:
            log.debug("sim: refused embeddings request (%d): %s", exc.status, exc.message)
            return _error_response(exc)
        if (injected := _injected(effective)) is not None:
            return injected
        answer = partial(
            embedding_body, body, effective, model=body.model or cfg.model, created=int(time.time())
        )
        return await _complete(effective, effective.ttft_s, answer, stats)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        stats.tokenize_requests += 1
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        try:
            return _json_response(tokenize_body(raw, cfg), 200)
        except RequestError as exc:
            return _error_response(exc)

    @app.post("/detokenize")
    async def detokenize() -> Response:
        stats.tokenize_requests += 1
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        try:
            return _json_response(detokenize_body(raw, cfg), 200)
        except RequestError as exc:
            return _error_response(exc)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json_response(models_body(cfg.model, created=app.started_at), 200)

    @app.get("/health")
    async def health() -> Response:
        # vLLM answers an empty 200.
        return Response(b"", status=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        # vLLM's engine gauges and counters (iop/sim/_engine.py), for load scrapers.
        return Response(
            app.engine.metrics(cfg.model),
            status=200,
            content_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/kv_events")
    async def kv_events() -> Response:
        # vLLM publishes these over ZeroMQ (--kv-events-config); the sim
        # serves the same payloads with their numbers over HTTP, so a node
        # can read them without ZeroMQ (iop.wire._kv_events): a msgpack
        # array of [seq, payload] after ?after= (-1: from the oldest kept).
        try:
            after = int(request.args.get("after", "-1"))
        except ValueError:
            return _json_response(b'{"error": "after must be an integer"}', 400)
        batches = app.engine.cache.events_after(after, KV_EVENTS_PER_ANSWER)
        return Response(
            msgspec.msgpack.encode([[n, payload] for n, payload in batches]),
            status=200,
            content_type="application/msgpack",
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # vLLM's route of the same name: drop every cached block.
        app.engine.cache.clear()
        return Response(b"", status=200)

    @app.get("/sim/stats")
    async def sim_stats() -> Response:
        # Not a vLLM route: lets tests and benchmarks in other processes see
        # what the server saw (e.g. that a client went away).
        body = dataclasses.asdict(stats)
        body["statuses"] = {str(k): v for k, v in stats.statuses.items()}
        return _json_response(msgspec.json.encode(body), 200)

    @app.errorhandler(RequestEntityTooLarge)
    async def too_large(_exc: RequestEntityTooLarge) -> Response:
        message = f"request body exceeds {MAX_REQUEST_BYTES} bytes"
        return _json_response(error_body(message, status=413), 413)

    # FastAPI's bodies for unknown routes and methods, as vLLM sends them.
    @app.errorhandler(NotFound)
    async def not_found(_exc: NotFound) -> Response:
        return _json_response(b'{"detail":"Not Found"}', 404)

    @app.errorhandler(MethodNotAllowed)
    async def not_allowed(_exc: MethodNotAllowed) -> Response:
        return _json_response(b'{"detail":"Method Not Allowed"}', 405)

    return app


async def _publish_kv_events(
    scope: trio.CancelScope,
    cache: PrefixCache,
    cfg: SimConfig,
    *,
    task_status: trio.TaskStatus[tuple[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    # The kvevents extra (pyzmq): imported only when the sim publishes.
    from iop.sim._kv_publisher import publish_kv_events

    with scope:
        await publish_kv_events(cache, cfg, task_status=task_status)


def _bind(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def serve_sim(
    cfg: SimConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    app: SimApp | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    tls: tuple[str, str] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the sim on ``host:port`` until ``shutdown_trigger`` returns.

    Start it with ``url = await nursery.start(serve_sim, cfg, host, port)``;
    ``url`` is the bound base URL (``http://127.0.0.1:43117``), which tells
    the real port when ``port`` is 0. Stop it with ``shutdown_trigger``
    rather than by cancelling: that runs the app's shutdown and closes the
    connections cleanly.

    Args:
        cfg: What to simulate.
        host: Interface to listen on.
        port: TCP port; 0 picks a free one.
        app: Serve this app (from ``create_sim_app``) instead of a new one,
            e.g. to read its ``sim_stats``.
        shutdown_trigger: Returns when the server should stop.
        tls: ``(certfile, keyfile)``: serve HTTPS (hypercorn's own TLS);
            the URL is then ``https://``.
        task_status: Receives the bound URL once the socket listens.

    Raises:
        ListenError: ``host:port`` cannot be bound (taken, or not ours).
    """
    if app is None:
        app = create_sim_app(cfg)
    hc = HypercornConfig()
    hc.bind = [_bind(host, port)]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = SHUTDOWN_GRACE_S
    if tls is not None:
        hc.certfile, hc.keyfile = tls
    async with trio.open_nursery() as nursery:
        # The KV events publisher lives as long as the HTTP server.
        publishing = trio.CancelScope()
        if cfg.kv_events_endpoint:
            await nursery.start(_publish_kv_events, publishing, app.engine.cache, cfg)

        async def serving(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)
            finally:
                publishing.cancel()

        try:
            binds: list[str] = await nursery.start(serving)
        except (OSError, BaseExceptionGroup) as exc:
            error = listen_error_from(hc.bind[0], exc)
            if error is None:
                raise
            raise error from exc
        log.info("sim: serving model %r on %s", cfg.model, binds[0])
        task_status.started(binds[0])
