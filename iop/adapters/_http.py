"""HTTP plumbing shared by the adapters that speak OpenAI's wire format.

Besides chat, every operation but chat is executed here, the same way for
vLLM and any OpenAI-compatible server (``HTTPAdapter.execute`` dispatches on
``spec.operation``):

* ``completion``: ``POST /v1/completions``, streamed; the ``choices[0].text``
  chunks go through the chat stream parser (``iop.wire._openai_stream``), so
  framing, in-stream errors, usage and ``[DONE]`` are handled as for chat,
  and non-2xx answers are mapped as for chat.
* ``embedding``: ``POST /v1/embeddings``, not streamed; the body is read up
  to ``max_embedding_body_bytes``, then one ``EmbeddingData`` per input.
* ``tokenize``: ``POST /tokenize``. vLLM takes ``{"model", "prompt"}`` or
  ``{"model", "messages"}`` and answers ``{"count", "tokens", ...}``;
  llama.cpp takes ``{"content"}`` and answers ``{"tokens"}``, and renders
  messages with ``POST /apply-template`` (``{"messages"}`` ->
  ``{"prompt"}``). The ``openai_compat`` dialect sends ``content`` and
  ``prompt`` both (each server ignores the key it does not know) and
  counts ``count`` or else ``tokens``; a server with neither endpoint (404,
  405, 501) gets IOP's estimate, flagged ``estimated``, and so does an
  answer over ``max_tokenize_body_bytes`` (a long prompt's ids: about 7
  bytes each in vLLM's answer, more than its text).

A backend that keeps prefix caches apart per request (``cache_salt``:
vLLM, SGLang) gets the run's ``ExecutionSpec.cache_salt`` in its chat and
completion requests, in place of any the client sent (the edge folded that
in); the adapter says whether its backend does (``HTTPBackend``'s
``cache_salt``). Others get none: a server that refuses unknown fields
would fail every run (docs/operations.md, "Tenants and limits", "Prefix
caches").

Each request is made inside the run's cancel scope with the response in an
``async with``: a cancelled run closes its connection, whatever it was
waiting for.

Every call into the transport (sending a request, reading or closing a
body) is made inside ``backend_errors`` (``iop.adapters._errors``): the one
boundary where httpcore's and httpx's exceptions become the project's
``BackendError`` tree, so nothing of either escapes to the runtime.

Timeouts: httpx's per-read timeout is disabled on purpose. Time to first
token is often longer than any sane read timeout, and the run's own
deadlines (first token, idle, total; ``iop.runtime``) are the ones that
apply, as typed cancel reasons. Connect and write keep a transport timeout.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import ssl
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Final, Protocol, cast
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec
import trio

from iop.adapters._base import require_model
from iop.adapters._errors import backend_errors
from iop.adapters._pool import KeepAliveTransport
from iop.capabilities import Capabilities, ProbeResult, ProviderStatus, provider_detail
from iop.config import HTTPInstance
from iop.errors import (
    BackendError,
    BackendHTTPError,
    BackendProtocolError,
    BackendTimeout,
    ConfigError,
    InvariantError,
    RequestError,
)
from iop.events import Complete, EmbeddingData, Start, TokenCount, Usage
from iop.runtime import EventSender
from iop.spec import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ExecutionSpec,
    Message,
    Operation,
    TokenizeRequest,
    Tool,
)
from iop.timeline import current_timeline
from iop.wire._engine_load import (
    EngineDialect,
    EngineFigures,
    figures_from_metrics,
    metric_names,
    parse_cache_config,
    parse_llamacpp_slots,
    parse_metrics,
)
from iop.wire._errors import ERROR_EXCERPT_BYTES, excerpt, openai_error_code, parse_error_body
from iop.wire._openai_stream import ChatStreamParser

__all__ = [
    "HTTP_OPERATIONS",
    "HTTPAdapter",
    "HTTPBackend",
    "backend_transport",
    "build_chat_body",
    "build_completion_body",
    "environment_proxy",
    "estimate_tokens",
    "join_openai_path",
]

# What an HTTP instance serves when its config lists no ``operations``:
# every OpenAI-compatible server streams chat and legacy completions, and a
# token count always has an answer (the estimate, without /tokenize).
# Embeddings are opt-in: vLLM serves them only for pooling models, llama.cpp
# only with --embeddings, and neither says so in /v1/models.
HTTP_OPERATIONS: Final[tuple[Operation, ...]] = ("chat", "completion", "tokenize")

# Statuses meaning "this server has no such endpoint": the tokenize estimate.
_NO_ENDPOINT: Final = frozenset({404, 405, 501})

log = logging.getLogger("iop.adapters")

# Idle connections kept through a proxy (httpx's own pool, whose bookkeeping
# is quadratic in pooled connections: ``iop.adapters._pool``): httpx's default.
# Total connections are not capped: the node's slot limiter bounds them.
PROXY_KEEPALIVE_CONNECTIONS: Final = 20

# What an httpx.AsyncClient would add to every request (httpx 0.28), kept so
# that backends see the same requests as when the node used one; Content-Type
# and the configured headers come on top.
_DEFAULT_HEADERS: Final = {
    "Accept": "*/*",
    "Accept-Encoding": "gzip, deflate",
    "Connection": "keep-alive",
    "User-Agent": f"python-httpx/{httpx.__version__}",
}


def environment_proxy(endpoint: str) -> str | None:
    """The proxy the environment names for ``endpoint`` (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, minus ``NO_PROXY``), as an
    ``httpx.AsyncClient`` would use it, or None."""
    parts = urlsplit(endpoint)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.netloc):
        return None
    return proxy


def backend_tls_context(cfg: HTTPInstance) -> ssl.SSLContext:
    """The TLS context for an ``https://`` backend: its certificate verified
    against the system's roots (``SSL_CERT_FILE`` and ``SSL_CERT_DIR``
    honoured) or ``tls_ca_file``; with ``tls_verify = false`` not verified
    at all, which is logged as a warning.

    Raises:
        ConfigError: ``tls_ca_file`` cannot be loaded.
    """
    if not cfg.tls_verify:
        log.warning(
            "instance %s: tls_verify = false: the certificate of %s is NOT verified "
            "(anyone on the path can read and change its traffic)",
            cfg.name,
            cfg.endpoint,
        )
        return httpx.create_ssl_context(verify=False)
    if cfg.tls_ca_file is not None:
        try:
            return ssl.create_default_context(cafile=cfg.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"instance {cfg.name}: tls_ca_file {cfg.tls_ca_file!r}: {exc}"
            ) from None
    return httpx.create_ssl_context()  # honours SSL_CERT_FILE and SSL_CERT_DIR


def backend_transport(cfg: HTTPInstance) -> httpx.AsyncBaseTransport:
    """The transport to ``cfg.endpoint``: the node's keep-alive pool
    (``iop.adapters._pool``), or httpx's through a proxy the environment names."""
    tls = backend_tls_context(cfg)
    proxy = environment_proxy(cfg.endpoint)
    if proxy is not None:
        return httpx.AsyncHTTPTransport(
            verify=tls,
            proxy=proxy,
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=PROXY_KEEPALIVE_CONNECTIONS
            ),
        )
    # One idle connection per slot, and one for the probe: a burst of runs
    # finds its connections again instead of opening new ones.
    return KeepAliveTransport(max_idle=cfg.max_concurrency + 1, ssl_context=tls)


# After [DONE] a server sends only the end of its chunked body; a server that
# sends more than this, or takes longer, loses its keep-alive connection.
DRAIN_MAX_BYTES: Final = 64 * 1024
DRAIN_TIMEOUT_S: Final = 1.0

# Request fields copied from the client's request when set. Adapter-owned
# fields (model, messages, stream, stream_options) are set last and win.
_SAMPLING_FIELDS: Final = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "reasoning_effort",
    "parallel_tool_calls",
    "user",
)


def join_openai_path(base_url: str, path: str) -> str:
    """Append an OpenAI path to an endpoint without ever producing ``/v1/v1``.

    ``http://h:8000`` + ``/v1/models`` -> ``http://h:8000/v1/models``;
    ``http://h:8000/v1/`` + ``/v1/models`` -> ``http://h:8000/v1/models``.
    Query strings on the endpoint are kept (seed 003: ``joinOpenAIPath``).
    """
    try:
        parts = urlsplit(base_url)
    except ValueError:
        return base_url.rstrip("/") + path
    base_path = parts.path.rstrip("/")
    if base_path.endswith("/v1") and path.startswith("/v1/"):
        path = path[len("/v1") :]
    return urlunsplit(parts._replace(path=base_path + path))


def build_chat_body(
    spec: ExecutionSpec,
    *,
    model: str,
    passthrough: tuple[str, ...] = ("tools", "tool_choice", "format", "think", "keep_alive"),
    cache_salt: str = "",
) -> dict[str, Any]:
    """The JSON body of an upstream streaming chat request.

    Precedence, lowest first (seed 003's ``buildRequestBody``): the client's
    ``options`` copied to top level, unmodelled keys (``extra_body``),
    standard sampling fields, the pass-through fields, and finally the
    adapter-owned fields, which always win: among them ``cache_salt`` when
    not empty (``HTTPBackend.salt_of``).
    """
    req = spec.request
    if not isinstance(req, ChatRequest):
        raise InvariantError(f"chat body for a {spec.operation} run")
    body: dict[str, Any] = {}
    if req.options:
        body.update(req.options)
    if req.extra_body:
        body.update(req.extra_body)
    for name in _SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    for name in passthrough:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    body["model"] = model
    body["messages"] = req.messages
    body["stream"] = True
    # Ask for the usage chunk: every backend here honours it (docs/architecture.md,
    # "Facts about the backends: Usage").
    body["stream_options"] = {"include_usage": True}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


_COMPLETION_FIELDS: Final = (
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "echo",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "suffix",
    "best_of",
    "user",
)


def build_completion_body(
    request: CompletionRequest, *, model: str, cache_salt: str = ""
) -> dict[str, Any]:
    """The JSON body of an upstream streaming ``/v1/completions`` request.

    Same precedence as chat: ``extra_body``, then the modelled fields, then
    the adapter's own (model, prompt, stream, stream_options, and
    ``cache_salt`` when not empty), which win.
    """
    body: dict[str, Any] = dict(request.extra_body or {})
    for name in _COMPLETION_FIELDS:
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    body["model"] = model
    body["prompt"] = request.prompt
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def estimate_tokens(request: TokenizeRequest) -> int:
    """IOP's token estimate, for backends without a tokenizer endpoint: about
    4 characters per token (English BPE vocabularies) plus 4 tokens of
    template per message, and the tools' JSON."""
    chars = len(request.prompt or "")
    extra = 0
    for m in request.messages or ():
        chars += len(m.text()) + len(m.role)
        extra += 4
        if m.tool_calls:
            chars += len(msgspec.json.encode(m.tool_calls))
    if request.tools:
        chars += len(msgspec.json.encode(request.tools))
    return (chars + 3) // 4 + extra


class HTTPBackend:
    """One OpenAI-compatible HTTP backend: client, headers, probes, streaming.

    Args:
        cfg: The instance's config.
        kind: Adapter kind, used in messages (``vllm``, ``openai_compat``).
        provider: Provider label for capabilities and probes.
        transport: An httpx transport to use instead of the network (tests).
        cache_salt: Whether the backend keeps prefix caches apart by a
            request's ``cache_salt``: then it is sent (``salt_of``).
    """

    def __init__(
        self,
        cfg: HTTPInstance,
        *,
        kind: str,
        provider: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
        cache_salt: bool = False,
    ) -> None:
        self.cfg = cfg
        self.kind = kind
        self.provider = provider
        self.sends_cache_salt = cache_salt
        self.endpoint = cfg.endpoint.rstrip("/")
        self._last_targets: tuple[str, ...] = ()
        # Requests go straight to the transport: an httpx.AsyncClient in
        # front costs a URL merge, a cookie jar and three layers per request
        # (docs/benchmarks.md, "Where the fixed cost goes"), and the node
        # needs none of them (no redirects, no auth flows, no cookies).
        self._transport = transport if transport is not None else backend_transport(cfg)
        self._timeout: Final = {
            "connect": cfg.connect_timeout_s,
            "read": None,
            "write": cfg.connect_timeout_s,
            "pool": None,
        }
        self._urls: dict[str, httpx.URL] = {}
        self._get_headers = httpx.Headers({**_DEFAULT_HEADERS, **self.headers(json_body=False)})
        self._post_headers = httpx.Headers({**_DEFAULT_HEADERS, **self.headers(json_body=True)})

    async def aclose(self) -> None:
        await self._transport.aclose()

    def salt_of(self, spec: ExecutionSpec) -> str:
        """The ``cache_salt`` to send for ``spec``: its own, if this backend
        takes one; else none."""
        return spec.cache_salt if self.sends_cache_salt else ""

    def url(self, path: str) -> str:
        return join_openai_path(self.endpoint, path)

    def headers(self, *, json_body: bool) -> dict[str, str]:
        """Configured headers; the adapter owns Content-Type on JSON posts."""
        out: dict[str, str] = {}
        for k, v in self.cfg.headers.items():
            if json_body and k.lower() == "content-type":
                continue
            out[k] = v
        if json_body:
            out["Content-Type"] = "application/json"
        return out

    # --- probing ------------------------------------------------------------

    async def fetch_targets(self) -> list[str]:
        """``GET /v1/models`` with the probe deadline; the ids it lists.

        The body is read up to ``probe_max_body_bytes`` (decoded), an error
        body up to ``ERROR_EXCERPT_BYTES``: a huge or endless body fails the
        probe instead of growing the node's memory until the deadline.

        Raises:
            BackendError: Unreachable, non-2xx, timed out, a body over the
                limit, or not a model list.
        """
        body = b""
        url = self._url("/v1/models")
        with (
            trio.move_on_after(self.cfg.probe_timeout_s) as scope,
            backend_errors("request failed", url),
        ):
            resp = await self._send("GET", url, None, self._get_headers)
            try:
                if not 200 <= resp.status_code < 300:
                    raise BackendHTTPError(
                        f"status code {resp.status_code}",
                        backend_status=resp.status_code,
                        body_excerpt=excerpt(await self.read_error_body(resp)),
                    )
                body = await self._read_probe_body(resp)
            finally:
                await resp.aclose()
        if scope.cancelled_caught:
            raise BackendTimeout(f"no answer within {self.cfg.probe_timeout_s:g}s")
        try:
            models = msgspec.json.decode(body, type=_ModelList)
        except msgspec.DecodeError as exc:
            raise BackendError(f"decode response: {exc}") from exc
        # Ollama sends "data": null when no model is installed.
        return [m.id for m in models.data or () if m.id]

    async def _read_probe_body(self, response: httpx.Response) -> bytes:
        limit = self.cfg.probe_max_body_bytes
        buf = bytearray()
        async for piece in response.aiter_bytes():
            buf += piece
            if len(buf) > limit:
                # Leaving the stream context closes the connection unread.
                raise BackendProtocolError(
                    f"/v1/models body exceeds probe_max_body_bytes={limit} bytes"
                )
        return bytes(buf)

    async def probe(self, target: str = "") -> ProbeResult:
        """Probe availability and, if given, presence of ``target`` (seed 003)."""
        try:
            targets = await self.fetch_targets()
        except BackendError as exc:
            return ProbeResult(
                adapter=self.kind,
                instance=self.cfg.name,
                target=target,
                status=ProviderStatus.UNAVAILABLE,
                detail=exc.message,
                provider=self.provider,
            )
        status, detail = ProviderStatus.AVAILABLE, ""
        if target and target not in targets:
            status = ProviderStatus.UNAVAILABLE
            detail = f"target model {target!r} not found in provider models"
        return ProbeResult(
            adapter=self.kind,
            instance=self.cfg.name,
            target=target,
            status=status,
            targets=tuple(targets),
            detail=detail,
            provider=self.provider,
        )

    async def capabilities(self) -> Capabilities:
        """Capabilities with live targets and provider status from a probe.

        When the backend is down its last known models stay advertised (as
        ``unavailable``), so the edge answers "temporarily unavailable"
        instead of "no such model".
        """
        probe = await self.probe()
        if probe.targets:
            self._last_targets = probe.targets
        targets = probe.targets or self._last_targets or tuple(self.cfg.targets)
        return Capabilities(
            adapter=self.kind,
            instance=self.cfg.name,
            provider=self.provider,
            targets=targets,
            max_concurrency=self.cfg.max_concurrency,
            max_queue=self.cfg.max_queue,
            queue_timeout_s=self.cfg.queue_timeout_s,
            request_timeout_s=self.cfg.deadlines.request_timeout_s or 0.0,
            provider_status=probe.status,
            provider_detail=provider_detail(probe.detail),
            operations=tuple(self.cfg.operations or HTTP_OPERATIONS),
        )

    # --- chat ---------------------------------------------------------------

    def post_chat(
        self, body: Mapping[str, Any], *, what: str
    ) -> contextlib.AbstractAsyncContextManager[httpx.Response]:
        """POST a streaming chat request (``post_json`` to ``/v1/chat/completions``)."""
        return self.post_json("/v1/chat/completions", body, what=what)

    @asynccontextmanager
    async def post_json(
        self, path: str, body: Mapping[str, Any], *, what: str
    ) -> AsyncIterator[httpx.Response]:
        """POST a JSON request; yield the response with its body unread.

        Leaving the context closes the response, and with it the TCP
        connection if the body was not read to the end: that is what makes
        the backend abort the generation on cancellation.

        Raises:
            BackendError: The request could not be sent (``what`` prefixes
                the message, e.g. "vllm retry request failed").
        """
        content = msgspec.json.encode(body)
        timeline = current_timeline()  # the run's, when a run sends this
        if timeline is not None:
            timeline.backend_sent = trio.current_time()
        headers = self._post_headers
        if timeline is not None and timeline.traceparent:
            # The backend joins the run's trace (iop.tracing).
            headers = headers.copy()
            headers["traceparent"] = timeline.traceparent
        url = self._url(path)
        with backend_errors(what, url):
            response = await self._send("POST", url, content, headers)
        if timeline is not None:
            # The response head is the backend's first answer.
            timeline.backend_first_byte = trio.current_time()
        try:
            yield response
        finally:
            try:
                with backend_errors(what, url):
                    await response.aclose()
            finally:
                # Unread (a cancel, an error), its connection is closed; read
                # to the end, it went back to the pool.
                if timeline is not None:
                    timeline.backend_closed = trio.current_time()

    def _url(self, path: str) -> httpx.URL:
        """``path`` under the endpoint, parsed once per path."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url(path))
        return url

    async def _send(
        self, method: str, url: httpx.URL, content: bytes | None, headers: httpx.Headers
    ) -> httpx.Response:
        """Send a request to ``url``; its response with the body unread. The
        caller maps the transport's errors (``backend_errors``)."""
        request = httpx.Request(
            method, url, content=content, headers=headers, extensions={"timeout": self._timeout}
        )
        response = await self._transport.handle_async_request(request)
        response.request = request  # the request it answers (``_request_url``)
        return response

    async def read_error_body(self, response: httpx.Response) -> bytes:
        """Read at most ``ERROR_EXCERPT_BYTES`` of a non-2xx body; never raises."""
        buf = bytearray()
        try:
            with backend_errors(f"{self.kind} error body read failed", _request_url(response)):
                # Decoded bytes: a proxy may gzip an error page.
                async for piece in response.aiter_bytes():
                    buf += piece
                    if len(buf) >= ERROR_EXCERPT_BYTES:
                        break
        except BackendError as exc:  # the status is the error; its body only an excerpt
            log.debug("%s: %s", self.kind, exc)
        return bytes(buf[:ERROR_EXCERPT_BYTES])

    def http_error(self, response: httpx.Response, body: bytes) -> BackendHTTPError:
        """``<kind> returned <status>: <message>`` with a bounded excerpt, and
        OpenAI's code and param where the error has one (``openai_error_code``)."""
        info = parse_error_body(body)
        status_line = f"{response.status_code} {response.reason_phrase}".strip()
        message = info.message or status_line
        # The one place a backend's refusal gets OpenAI's code, if it has one.
        openai = openai_error_code(info, response.status_code)
        return BackendHTTPError(
            f"{self.kind} returned {status_line}: {message}",
            backend_status=response.status_code,
            body_excerpt=excerpt(body),
            code=openai.code if openai else None,
            param=openai.param if openai else None,
        )

    def new_parser(self) -> ChatStreamParser:
        return ChatStreamParser(
            label=self.kind,
            max_line_bytes=self.cfg.max_line_bytes,
            malformed_chunk_limit=self.cfg.malformed_chunk_limit,
            max_tool_call_bytes=self.cfg.max_tool_call_bytes,
        )

    async def pump(
        self,
        response: httpx.Response,
        send: EventSender,
        *,
        run_id: str,
        text_tool_fallback: bool = False,
    ) -> None:
        """Stream a 2xx response into events, ending with ``Complete``.

        Reads only as fast as ``send`` accepts: a slow consumer leaves bytes
        in the kernel buffers and the backend blocks (backpressure).

        Raises:
            BackendError: The stream broke, was malformed, or had no [DONE].
        """
        parser = self.new_parser()
        with backend_errors(f"{self.kind} stream scan failed", _request_url(response)):
            async with contextlib.aclosing(_body_pieces(response)) as chunks:
                async for piece in chunks:
                    for event in parser.feed(piece):
                        await send.send(event)
                    if parser.failed:
                        parser.feed_eof()  # the error after those events: raised
                    if parser.done:
                        break
                else:
                    parser.feed_eof()
                if parser.malformed_chunks:
                    log.warning(
                        "run %s: %s sent %d malformed chunk(s); last: %s",
                        run_id,
                        self.kind,
                        parser.malformed_chunks,
                        parser.last_malformed,
                    )
                await send.send(parser.complete(text_tool_fallback=text_tool_fallback))
                await _drain(chunks)

    # --- the engine's published load -----------------------------------------

    def root_url(self, path: str, query: str = "") -> str:
        """``path`` at the server's root: engines publish ``/metrics`` and
        ``/slots`` there, beside ``/v1``, whichever the endpoint names."""
        parts = urlsplit(self.endpoint)
        base = parts.path.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        return urlunsplit(parts._replace(path=base + path, query=query))

    async def fetch_page(self, path: str, query: str = "") -> bytes:
        """``GET path`` at the root, within ``load_scrape_timeout_s``, at most
        ``load_scrape_max_bytes``.

        Raises:
            BackendError: Unreachable, non-2xx (``BackendHTTPError``), timed
                out, or a body over the limit.
        """
        cfg = self.cfg
        body = b""
        # The scrape's errors name no host:port (no url): they never have.
        with (
            trio.move_on_after(cfg.load_scrape_timeout_s) as scope,
            backend_errors(f"{path} request failed"),
        ):
            request = httpx.Request(
                "GET",
                self.root_url(path, query),
                headers=self._get_headers,
                extensions={"timeout": self._timeout},
            )
            resp = await self._transport.handle_async_request(request)
            try:
                if not 200 <= resp.status_code < 300:
                    # Read a short error body whole, so that the
                    # connection goes back to the pool: a backend with
                    # no such page (a 404 every scrape) would otherwise
                    # cost a connection each time, and close the idle
                    # one its next run would have used.
                    with contextlib.suppress(BackendError):
                        await self.read_limited(resp, DRAIN_MAX_BYTES, "load_scrape_max_bytes")
                    raise BackendHTTPError(
                        f"{path}: status code {resp.status_code}",
                        backend_status=resp.status_code,
                    )
                body = await self.read_limited(
                    resp, cfg.load_scrape_max_bytes, "load_scrape_max_bytes"
                )
            finally:
                await resp.aclose()
        if scope.cancelled_caught:
            raise BackendTimeout(f"{path}: no answer within {cfg.load_scrape_timeout_s:g}s")
        return body

    # --- other operations ---------------------------------------------------

    async def read_limited(self, response: httpx.Response, limit: int, key: str) -> bytes:
        """A 2xx body, whole, or an error past ``limit`` bytes (decoded).

        Raises:
            BackendProtocolError: The body is bigger than ``limit`` (``key``
                names the config key that sets it).
            BackendStreamError: The body broke off.
        """
        body = await self.read_at_most(response, limit)
        if body is None:
            raise BackendProtocolError(f"{self.kind} response body exceeds {key}={limit} bytes")
        return body

    async def read_at_most(self, response: httpx.Response, limit: int) -> bytes | None:
        """A 2xx body, whole, or None once it is past ``limit`` bytes (the rest
        is not read: leaving the response's context closes the connection).

        Raises:
            BackendStreamError: The body broke off.
        """
        buf = bytearray()
        with backend_errors(f"{self.kind} response read failed", _request_url(response)):
            async for piece in response.aiter_bytes():
                buf += piece
                if len(buf) > limit:
                    return None
        return bytes(buf)

    async def execute_completion(self, spec: ExecutionSpec, send: EventSender) -> None:
        """A legacy completion: ``POST /v1/completions``, streamed as deltas."""
        request = spec.request
        if not isinstance(request, CompletionRequest):
            raise InvariantError(f"completion executed for a {spec.operation} run")
        model = require_model(self.kind, spec)
        await send.send(Start(target=model))
        body = build_completion_body(request, model=model, cache_salt=self.salt_of(spec))
        log.info("%s executing completion run_id=%s target=%s", self.kind, spec.run_id, model)
        async with self.post_json(
            "/v1/completions", body, what=f"{self.kind} request failed"
        ) as response:
            if not response.is_success:
                raise self.http_error(response, await self.read_error_body(response))
            await self.pump(response, send, run_id=spec.run_id)

    async def execute_embedding(self, spec: ExecutionSpec, send: EventSender) -> None:
        """Embeddings: ``POST /v1/embeddings`` (bounded read), one event per input."""
        request = spec.request
        if not isinstance(request, EmbeddingRequest):
            raise InvariantError(f"embedding executed for a {spec.operation} run")
        model = require_model(self.kind, spec)
        if not request.inputs:
            raise RequestError("`input` must not be empty", param="input")
        await send.send(Start(target=model))
        body: dict[str, Any] = dict(request.extra_body or {})
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        if request.user is not None:
            body["user"] = request.user
        body["model"] = model
        body["input"] = request.inputs
        # Floats always: the edge encodes what the client asked for.
        body["encoding_format"] = "float"
        limit = self.cfg.max_embedding_body_bytes
        async with self.post_json(
            "/v1/embeddings", body, what=f"{self.kind} request failed"
        ) as response:
            if not response.is_success:
                raise self.http_error(response, await self.read_error_body(response))
            raw = await self.read_limited(response, limit, "max_embedding_body_bytes")
        try:
            answer = msgspec.json.decode(raw, type=_EmbeddingList)
        except msgspec.DecodeError as exc:
            raise BackendProtocolError(
                f"{self.kind} sent an invalid embeddings body: {exc}"
            ) from exc
        vectors = sorted(answer.data, key=lambda d: d.index)
        if [d.index for d in vectors] != list(range(len(request.inputs))):
            raise BackendProtocolError(
                f"{self.kind} sent {len(vectors)} embeddings for {len(request.inputs)} inputs"
            )
        for item in vectors:
            await send.send(_embedding_event(item))
        prompt = answer.usage.prompt_tokens if answer.usage else None
        usage = Usage(input_tokens=prompt or 0, estimated=prompt is None)
        await send.send(Complete(usage=usage))

    async def execute_tokenize(
        self, spec: ExecutionSpec, send: EventSender, *, dialect: str
    ) -> None:
        """A token count: ``/tokenize`` in ``dialect`` (``vllm`` or
        ``openai_compat``, see the module docstring); the estimate where the
        server has no such endpoint."""
        request = spec.request
        if not isinstance(request, TokenizeRequest):
            raise InvariantError(f"tokenize executed for a {spec.operation} run")
        model = require_model(self.kind, spec)
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("a token count needs exactly one of prompt and messages")
        await send.send(Start(target=model))
        count: int | None
        if dialect == "vllm":
            body: dict[str, Any] = {"model": model}
            if request.messages is not None:
                body["messages"] = request.messages
                if request.tools:
                    body["tools"] = request.tools
            else:
                body["prompt"] = request.prompt
            count = await self._tokenize(body)
        else:
            text = request.prompt
            if request.messages is not None:
                text = await self._apply_template(model, request.messages, request.tools)
            count = (
                None
                if text is None
                else await self._tokenize({"model": model, "content": text, "prompt": text})
            )
        estimated = count is None
        tokens = estimate_tokens(request) if count is None else count
        await send.send(TokenCount(count=tokens, estimated=estimated))
        await send.send(Complete(usage=Usage(input_tokens=tokens, estimated=estimated)))

    async def _post_small(self, path: str, body: Mapping[str, Any]) -> bytes | None:
        """POST ``body``; the 2xx body, or None for "no such endpoint" and for
        an answer over ``max_tokenize_body_bytes``: the count is then IOP's
        estimate (docs/api.md, "count_tokens"), never a 502 for a prompt the
        edge accepted."""
        async with self.post_json(path, body, what=f"{self.kind} {path} failed") as response:
            if response.status_code in _NO_ENDPOINT:
                await self.read_error_body(response)
                return None
            if not response.is_success:
                raise self.http_error(response, await self.read_error_body(response))
            limit = self.cfg.max_tokenize_body_bytes
            raw = await self.read_at_most(response, limit)
            if raw is None:
                log.info(
                    "%s %s answer exceeds max_tokenize_body_bytes=%d: counting by IOP's estimate",
                    self.kind,
                    path,
                    limit,
                )
            return raw

    async def _tokenize(self, body: Mapping[str, Any]) -> int | None:
        raw = await self._post_small("/tokenize", body)
        if raw is None:
            return None
        try:
            answer = msgspec.json.decode(raw, type=_TokenizeAnswer)
        except msgspec.DecodeError as exc:
            raise BackendProtocolError(
                f"{self.kind} sent an invalid /tokenize body: {exc}"
            ) from exc
        if answer.count is not None:
            return answer.count
        if answer.tokens is not None:
            return len(answer.tokens)
        raise BackendProtocolError(f"{self.kind} /tokenize answer has neither count nor tokens")

    async def _apply_template(
        self, model: str, messages: list[Message], tools: list[Tool] | None
    ) -> str | None:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools  # llama.cpp renders them as its chat endpoint does
        raw = await self._post_small("/apply-template", body)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=_Rendered).prompt
        except msgspec.DecodeError as exc:
            raise BackendProtocolError(
                f"{self.kind} sent an invalid /apply-template body: {exc}"
            ) from exc


def _embedding_event(item: _Embedding) -> EmbeddingData:
    vector = item.embedding
    if isinstance(vector, str):  # a server that sends base64 anyway
        try:
            data = base64.b64decode(vector, validate=True)
        except ValueError as exc:
            raise BackendProtocolError(f"embedding {item.index} is not base64: {exc}") from exc
        if len(data) % 4:
            raise BackendProtocolError(f"embedding {item.index} is not float32 data")
        return EmbeddingData(index=item.index, vector=data)
    return EmbeddingData.of(item.index, vector)


class _Pieces(Protocol):
    """A response body's pieces, closable (an async generator, or a transport's stream)."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    def __anext__(self) -> Awaitable[bytes]: ...

    async def aclose(self) -> None: ...


def _body_pieces(response: httpx.Response) -> _Pieces:
    """The pieces of a streamed body as the transport reads them.

    An SSE body is rarely compressed; when it is not, httpx's decoding and
    re-chunking layers (``aiter_bytes`` over ``aiter_raw``: two async
    generators and two buffers per stream, run for every read) have nothing
    to do, and the transport's stream is read directly.
    """
    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        stream = cast(httpx.AsyncByteStream, response.stream)
        pieces = stream.__aiter__()
        if isinstance(pieces, AsyncGenerator):
            return pieces
        return cast(_Pieces, pieces)
    return cast(AsyncGenerator[bytes, None], response.aiter_bytes())


def _request_url(response: httpx.Response) -> httpx.URL | None:
    """The URL ``response`` answers, if the request is attached to it (``_send``)."""
    try:
        return response.request.url
    except RuntimeError:  # a response from ``fetch_page``: none
        return None


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (the chunked body's end) so the connection
    goes back to the keep-alive pool instead of being reset; bounded in bytes
    and time, and after the run's terminal event so nobody waits for it."""
    seen = 0
    with (
        trio.move_on_after(DRAIN_TIMEOUT_S),
        contextlib.suppress(BackendError),  # the run has ended: nothing to report it to
        backend_errors("drain"),
    ):
        async for piece in chunks:
            seen += len(piece)
            if seen > DRAIN_MAX_BYTES:
                break


class HTTPAdapter:
    """What the OpenAI-style HTTP adapters share: the instance's name,
    probes, capabilities and the client's life cycle. Subclasses add
    ``execute``."""

    kind: ClassVar[str]

    def __init__(
        self,
        cfg: HTTPInstance,
        *,
        provider: str,
        transport: httpx.AsyncBaseTransport | None = None,
        cache_salt: bool = False,
    ) -> None:
        self._http = HTTPBackend(
            cfg, kind=self.kind, provider=provider, transport=transport, cache_salt=cache_salt
        )
        # llama.cpp without --metrics: read /slots instead (``engine_load``).
        self._use_slots = False

    @property
    def name(self) -> str:
        return self._http.cfg.name

    async def capabilities(self) -> Capabilities:
        return await self._http.capabilities()

    async def execute(self, spec: ExecutionSpec, send: EventSender) -> None:
        """Run ``spec``: chat by the subclass, the other operations here."""
        match spec.operation:
            case "chat":
                await self.execute_chat(spec, send)
            case "completion":
                await self._http.execute_completion(spec, send)
            case "embedding":
                await self._http.execute_embedding(spec, send)
            case "tokenize":
                await self._http.execute_tokenize(spec, send, dialect=self.kind)

    async def execute_chat(self, spec: ExecutionSpec, send: EventSender) -> None:
        raise NotImplementedError

    async def probe(self, target: str = "") -> ProbeResult:
        return await self._http.probe(target)

    # The engine whose load ``engine_load`` reads (subclasses set it).
    engine: EngineDialect = EngineDialect.NONE

    @property
    def load_scrape_interval_s(self) -> float:
        """How often the node should call ``engine_load`` (0: never)."""
        if self.engine is EngineDialect.NONE:
            return 0.0
        return self._http.cfg.load_scrape_interval_s

    async def engine_load(self) -> EngineFigures:
        """The engine's published load, read now (``iop.wire._engine_load``).

        llama.cpp publishes ``/metrics`` only when started with
        ``--metrics``: when it answers 404 or 501 there, its ``/slots`` is
        read from then on (busy slots, without a queue figure).

        Raises:
            BackendError: The page could not be read, or is not what the
                engine publishes.
        """
        http = self._http
        if self._use_slots:
            figures = parse_llamacpp_slots(await http.fetch_page("/slots"))
            if figures is None:
                raise BackendProtocolError("/slots: not a list of slots")
            return figures
        try:
            page = await http.fetch_page("/metrics")
        except BackendHTTPError as exc:
            if self.engine is EngineDialect.LLAMACPP and exc.backend_status in (404, 501):
                self._use_slots = True
                return await self.engine_load()
            raise
        figures = figures_from_metrics(self.engine, parse_metrics(page, metric_names(self.engine)))
        if self.engine is EngineDialect.VLLM:
            figures = msgspec.structs.replace(figures, cache_tokens=parse_cache_config(page))
        return figures

    async def aclose(self) -> None:
        await self._http.aclose()


class _Model(msgspec.Struct, frozen=True):
    id: str = ""


class _ModelList(msgspec.Struct, frozen=True):
    data: list[_Model] | None = None


class _Embedding(msgspec.Struct, frozen=True):
    index: int
    embedding: list[float] | str


class _EmbeddingUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int | None = None


class _EmbeddingList(msgspec.Struct, frozen=True):
    data: list[_Embedding]
    usage: _EmbeddingUsage | None = None


class _TokenizeAnswer(msgspec.Struct, frozen=True):
    count: int | None = None
    tokens: list[Any] | None = None


class _Rendered(msgspec.Struct, frozen=True):
    prompt: str
