"""HTTP plumbing shared by the adapters that speak OpenAI's wire format.

This is the boundary where httpx lives: every ``httpx`` exception is mapped
here to the project's error tree (``raise ... from exc``) and nothing of
httpx escapes to the runtime.

Timeouts: httpx's per-read timeout is disabled on purpose. Time to first
token is often longer than any sane read timeout, and the run's own
deadlines (first token, idle, total; ``iop.runtime``) are the ones that
apply, as typed cancel reasons. Connect and write keep a transport timeout.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Final, cast
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec
import trio

from iop.capabilities import Capabilities, ProbeResult, ProviderStatus, provider_detail
from iop.config import HTTPInstance
from iop.errors import (
    BackendError,
    BackendHTTPError,
    BackendProtocolError,
    BackendStreamError,
    BackendTimeout,
    BackendUnavailable,
)
from iop.runtime import EventSender
from iop.spec import ExecutionSpec
from iop.wire._errors import ERROR_EXCERPT_BYTES, excerpt, openai_error_code, parse_error_body
from iop.wire._openai_stream import ChatStreamParser

__all__ = [
    "HTTPAdapter",
    "HTTPBackend",
    "build_chat_body",
    "join_openai_path",
    "map_transport_error",
]

log = logging.getLogger("iop.adapters")

# The keep-alive pool stays at httpx's default: httpcore's bookkeeping is
# quadratic in pooled connections (trio-stack.md §3c). Total connections are
# not capped by httpx: the node's capacity limiter is what bounds concurrency.
KEEPALIVE_CONNECTIONS: Final = 20

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
) -> dict[str, Any]:
    """The JSON body of an upstream streaming chat request.

    Precedence, lowest first (seed 003's ``buildRequestBody``): the client's
    ``options`` copied to top level, unmodelled keys (``extra_body``),
    standard sampling fields, the pass-through fields, and finally the
    adapter-owned fields, which always win.
    """
    req = spec.request
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
    # Ask for the usage chunk: every backend here honours it (protocols.md §5).
    body["stream_options"] = {"include_usage": True}
    return body


def _os_error_under(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``'s cause chain and exception groups.

    httpx over trio buries the refusal: ``ConnectError`` <- ``OSError("all
    attempts to connect ... failed")`` <- a group of ``ConnectionRefusedError``.
    """
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _where(exc: httpx.HTTPError) -> str:
    """``host:port`` the failed request went to (never userinfo, path or query)."""
    try:
        url = exc.request.url
    except RuntimeError:  # no request attached
        return "the backend"
    return f"{url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"


def transport_detail(exc: httpx.HTTPError) -> str:
    """A short, secret-free cause: ``connection refused by 127.0.0.1:8000``."""
    where = _where(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        return f"no connection to {where} within the connect timeout"
    if isinstance(exc, httpx.ConnectError):
        os_error = _os_error_under(exc)
        if isinstance(os_error, ConnectionRefusedError):
            return f"connection refused by {where}"
        if isinstance(os_error, socket.gaierror):
            return f"cannot resolve the host of {where} ({os_error.strerror})"
        if os_error is not None and os_error.strerror:
            return f"cannot connect to {where} ({os_error.strerror})"
    return str(exc) or type(exc).__name__


def map_transport_error(exc: httpx.HTTPError, what: str) -> BackendError:
    """Translate an httpx exception into the project's error tree."""
    detail = transport_detail(exc)
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError | httpx.UnsupportedProtocol):
        return BackendUnavailable(f"{what}: {detail}")
    if isinstance(exc, httpx.TimeoutException):
        return BackendTimeout(f"{what}: {detail}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return BackendStreamError(f"{what}: {detail}")
    return BackendError(f"{what}: {detail}")


class HTTPBackend:
    """One OpenAI-compatible HTTP backend: client, headers, probes, streaming.

    Args:
        cfg: The instance's config.
        kind: Adapter kind, used in messages (``vllm``, ``openai_compat``).
        provider: Provider label for capabilities and probes.
        transport: An httpx transport to use instead of the network (tests).
    """

    def __init__(
        self,
        cfg: HTTPInstance,
        *,
        kind: str,
        provider: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self.kind = kind
        self.provider = provider
        self.endpoint = cfg.endpoint.rstrip("/")
        self._last_targets: tuple[str, ...] = ()
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(
                connect=cfg.connect_timeout_s,
                read=None,
                write=cfg.connect_timeout_s,
                pool=None,
            ),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS
            ),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

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
        url = self.url("/v1/models")
        body = b""
        with trio.move_on_after(self.cfg.probe_timeout_s) as scope:
            try:
                async with self._client.stream(
                    "GET", url, headers=self.headers(json_body=False)
                ) as resp:
                    if not 200 <= resp.status_code < 300:
                        raise BackendHTTPError(
                            f"status code {resp.status_code}",
                            backend_status=resp.status_code,
                            body_excerpt=excerpt(await self.read_error_body(resp)),
                        )
                    body = await self._read_probe_body(resp)
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, "request failed") from exc
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
        )

    # --- chat ---------------------------------------------------------------

    @asynccontextmanager
    async def post_chat(
        self, body: Mapping[str, Any], *, what: str
    ) -> AsyncIterator[httpx.Response]:
        """POST a streaming chat request; yield the response with its body unread.

        Leaving the context closes the response, and with it the TCP
        connection if the body was not read to the end: that is what makes
        the backend abort the generation on cancellation.

        Raises:
            BackendError: The request could not be sent (``what`` prefixes
                the message, e.g. "vllm retry request failed").
        """
        content = msgspec.json.encode(body)
        request = self._client.build_request(
            "POST",
            self.url("/v1/chat/completions"),
            content=content,
            headers=self.headers(json_body=True),
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, what) from exc
        try:
            yield response
        finally:
            await response.aclose()

    async def read_error_body(self, response: httpx.Response) -> bytes:
        """Read at most ``ERROR_EXCERPT_BYTES`` of a non-2xx body; never raises."""
        buf = bytearray()
        try:
            # Decoded bytes: a proxy may gzip an error page.
            async for piece in response.aiter_bytes():
                buf += piece
                if len(buf) >= ERROR_EXCERPT_BYTES:
                    break
        except httpx.HTTPError as exc:
            log.debug("%s: error body unreadable: %r", self.kind, exc)
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
        async with contextlib.aclosing(
            cast(AsyncGenerator[bytes, None], response.aiter_bytes())
        ) as chunks:
            try:
                async for piece in chunks:
                    for event in parser.feed(piece):
                        await send.send(event)
                    if parser.done:
                        break
                else:
                    parser.feed_eof()
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, f"{self.kind} stream scan failed") from exc
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


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (the chunked body's end) so the connection
    goes back to the keep-alive pool instead of being reset; bounded in bytes
    and time, and after the run's terminal event so nobody waits for it."""
    seen = 0
    with trio.move_on_after(DRAIN_TIMEOUT_S), contextlib.suppress(httpx.HTTPError):
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
    ) -> None:
        self._http = HTTPBackend(cfg, kind=self.kind, provider=provider, transport=transport)

    @property
    def name(self) -> str:
        return self._http.cfg.name

    async def capabilities(self) -> Capabilities:
        return await self._http.capabilities()

    async def probe(self, target: str = "") -> ProbeResult:
        return await self._http.probe(target)

    async def aclose(self) -> None:
        await self._http.aclose()


class _Model(msgspec.Struct, frozen=True):
    id: str = ""


class _ModelList(msgspec.Struct, frozen=True):
    data: list[_Model] | None = None
