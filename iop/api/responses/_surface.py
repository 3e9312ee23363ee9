"""The OpenAI Responses surface (``POST /v1/responses``) behind ``iop.api.Surface``.

:class:`ResponsesSurface` holds the one piece of state the surface needs,
the store of earlier responses for ``previous_response_id``
(``_store.ResponseStore``), and a monotonic clock; the edge creates one per
process with the store sized by ``[responses]`` (``iop.config``) and shared
by its tenants. Parsing is ``_request``; output is ``_encode``.

Tenants. A response is stored as the asking tenant's (``parse``'s
``tenant``, carried in ``ResponsesCall.tenant`` to where the finished
response is kept) and looked up among that tenant's responses only, so
another tenant's id gets the very answer an unknown id gets. The edge's
surface (``from_settings``) also names each response with a random id
(``resp_`` + 32 hex digits from ``secrets``), not ``resp_<run id>``: run
ids are in logs and on ``/admin/runs``. The scoping is the guarantee; the
random id only keeps a response's id from being known to anyone the client
did not give it to.

An unknown or expired ``previous_response_id`` is a 400 with code
``previous_response_not_found`` and OpenAI's message ``Previous response with
id '...' not found.`` (``param: previous_response_id``): OpenAI answers 400,
not 404, and clients (Codex, proxies in front of it) recognise the code to
start the conversation over with its full input.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Final

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._openai_errors import error_status, openai_error
from iop.api._routing import routing_of
from iop.api._surface import Call, RunContext, Surface
from iop.api.responses._encode import (
    ReasoningEcho,
    ResponseEcho,
    ResponsesCall,
    ResponsesCollector,
    ResponsesStream,
    TextEcho,
)
from iop.api.responses._request import (
    OfferedTools,
    ResponsesRequest,
    decode_request,
    translate,
)
from iop.api.responses._store import ResponseStore
from iop.config import ResponsesSettings
from iop.errors import ErrorCode, RequestError
from iop.spec import Message, NamedToolChoice, ToolChoice

__all__ = ["PREVIOUS_NOT_FOUND_STATUS", "ResponsesSurface"]

PREVIOUS_NOT_FOUND_STATUS: Final = 400
"""OpenAI's status for an unknown ``previous_response_id`` (module docstring)."""


def run_response_id(run_id: str) -> str:
    """``resp_<run id>``: readable ids for a surface whose ids nobody else sees."""
    return f"resp_{run_id}"


def random_response_id(run_id: str) -> str:
    """``resp_`` + 128 random bits as hex: nothing another tenant sees gives it."""
    del run_id
    return f"resp_{secrets.token_hex(16)}"


def _choice_echo(choice: ToolChoice | None, tools: OfferedTools) -> object:
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoice):
        origin = tools.map.origin(choice.function.name)
        if origin is not None and origin.custom:
            return {"type": "custom", "name": origin.name}
        return {"type": "function", "name": choice.function.name}
    return choice


def _format_echo(req: ResponsesRequest) -> TextEcho:
    fmt = req.text.format if req.text else None
    if not fmt or fmt.get("type") not in ("json_schema", "json_object"):
        return TextEcho({"type": "text"})
    keys = ("type", "name", "description", "schema", "strict")
    return TextEcho({k: fmt[k] for k in keys if k in fmt})


def _echo(req: ResponsesRequest, tools: OfferedTools, choice: ToolChoice | None) -> ResponseEcho:
    return ResponseEcho(
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata or {},
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        reasoning=ReasoningEcho(
            effort=req.reasoning.effort if req.reasoning else None,
            summary=req.reasoning.summary if req.reasoning else None,
        ),
        store=req.store is not False,
        temperature=req.temperature,
        text=_format_echo(req),
        tool_choice=_choice_echo(choice, tools),
        tools=tools.echo,
        top_p=req.top_p,
        truncation=req.truncation or "disabled",
    )


class ResponsesSurface:
    """``POST /v1/responses`` (see the module docstring).

    Args:
        store: The stored responses.
        max_depth: Deepest JSON nesting a body may have (``server.max_json_depth``).
        clock: Monotonic seconds (the store's TTL, ``completed_at``).
        response_id: A response's id from its run's id (``from_settings``
            gives :func:`random_response_id`).
    """

    def __init__(
        self,
        store: ResponseStore,
        *,
        max_depth: int = DEFAULT_MAX_JSON_DEPTH,
        clock: Callable[[], float] = time.monotonic,
        response_id: Callable[[str], str] = run_response_id,
    ) -> None:
        self._store = store
        self._max_depth = max_depth
        self._clock = clock
        self._response_id = response_id

    @classmethod
    def from_settings(
        cls,
        settings: ResponsesSettings,
        *,
        tenants: int = 1,
        max_depth: int = DEFAULT_MAX_JSON_DEPTH,
        clock: Callable[[], float] = time.monotonic,
    ) -> ResponsesSurface:
        """The edge's surface: a store sized by its ``[responses]`` section and
        shared by ``tenants`` tenants, random response ids, and bodies nested
        deeper than ``max_depth`` (``server.max_json_depth``) refused."""
        store = ResponseStore(
            max_entries=settings.store_max_entries,
            max_bytes=settings.store_max_bytes,
            ttl_s=settings.store_ttl_s,
            tenants=tenants,
        )
        return cls(store, max_depth=max_depth, clock=clock, response_id=random_response_id)

    @property
    def name(self) -> str:
        return "responses"

    @property
    def store(self) -> ResponseStore:
        return self._store

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        """Decode, check and translate a request of ``tenant`` (``_request``).

        Raises:
            RequestError: 400 in OpenAI's wording; an unknown or expired
                ``previous_response_id``, or another tenant's, included
                (module docstring).
        """
        req, extra = decode_request(body, max_depth=self._max_depth)
        prior: tuple[Message, ...] = ()
        if req.previous_response_id is not None:
            found = self._store.get(req.previous_response_id, now=self._clock(), tenant=tenant)
            if found is None:
                raise RequestError(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    status=PREVIOUS_NOT_FOUND_STATUS,
                    code=ErrorCode.PREVIOUS_RESPONSE_NOT_FOUND,
                    param="previous_response_id",
                )
            prior = found
        chat, history, tools, choice = translate(req, extra, prior)
        routing = routing_of(
            headers,
            prompt_cache_key=req.prompt_cache_key,
            user=req.user or req.safety_identifier,
            user_from="user" if req.user else "safety_identifier",
        )
        chat = msgspec.structs.replace(chat, routing=routing)
        native = ResponsesCall(
            echo=_echo(req, tools, choice), history=history, tenant=tenant, tools=tools.map
        )
        return Call(request=chat, stream=bool(req.stream), model=req.model, native=native)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        """OpenAI's error body, with ``status`` as it is (an error status, else 500)."""
        return openai_error(error_status(status), message, code=code, param=param)

    def _keep(self, tenant: str, response_id: str, conversation: tuple[Message, ...]) -> None:
        self._store.put(response_id, conversation, now=self._clock(), tenant=tenant)

    def _kept_as(self, call: Call) -> Callable[[str, tuple[Message, ...]], None]:
        """Where ``call``'s response is stored: as its tenant's."""
        native = call.native
        return partial(self._keep, native.tenant if isinstance(native, ResponsesCall) else "")

    def stream(self, call: Call, ctx: RunContext) -> ResponsesStream:
        return ResponsesStream(
            call,
            ctx,
            keep=self._kept_as(call),
            clock=self._clock,
            response_id=self._response_id(ctx.run_id),
        )

    def collector(self, call: Call, ctx: RunContext) -> ResponsesCollector:
        return ResponsesCollector(
            call,
            ctx,
            keep=self._kept_as(call),
            clock=self._clock,
            response_id=self._response_id(ctx.run_id),
        )


def _is_a_surface(surface: ResponsesSurface) -> Surface:
    """Never called: mypy checks here that the class implements ``Surface``."""
    return surface
