"""The Anthropic Messages surface: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

:data:`MESSAGES` implements ``iop.api.Surface`` (request bytes -> ``Call``,
events -> bytes, Anthropic's error bodies and statuses). Beside it, what
the edge's HTTP layer needs for Anthropic clients:

* :func:`api_key`: the client's key, from ``x-api-key`` (what the SDKs and
  Claude Code send) or ``Authorization: Bearer`` (what gateways send),
  checked by the edge against the same ``server.api_keys`` as OpenAI's
  Bearer. A failed check is answered with ``error_body(401, AUTH_FAILED)``.
* :func:`api_headers`: ``anthropic-version`` and ``anthropic-beta``. Any
  value of either is accepted: IOP speaks the one wire format Anthropic has
  versioned (``2023-06-01``), and beta features it does not implement add
  body keys that the parser ignores (``_request``). The values are returned
  for the log.
* count_tokens: :meth:`MessagesSurface.parse_count_tokens` and
  :meth:`MessagesSurface.count_tokens` (``_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from iop.api._json_guard import DEFAULT_MAX_JSON_DEPTH
from iop.api._routing import with_routing
from iop.api._surface import Call, RunContext
from iop.api.messages._encode import MessagesCollector, MessagesStream
from iop.api.messages._errors import anthropic_error, error_body
from iop.api.messages._request import MessagesRequest, parse_count_tokens, parse_messages_request
from iop.api.messages._tokens import count_tokens_response, estimate_input_tokens
from iop.errors import InvariantError
from iop.spec import ChatRequest

__all__ = ["AUTH_FAILED", "MESSAGES", "ApiHeaders", "MessagesSurface", "api_headers", "api_key"]

AUTH_FAILED = "invalid x-api-key"
"""Anthropic's message for a missing or wrong key (401 ``authentication_error``)."""


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """``headers[name]``, case-insensitively (quart's headers are; a dict is not)."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def api_key(headers: Mapping[str, str]) -> str | None:
    """The client's API key: ``x-api-key``, else a Bearer token; None when neither."""
    key = _header(headers, "x-api-key")
    if key:
        return key
    auth = _header(headers, "authorization") or ""
    return auth[7:] if auth.startswith("Bearer ") and len(auth) > 7 else None


class ApiHeaders(msgspec.Struct, frozen=True, kw_only=True):
    """Anthropic's request headers, as sent (any value is accepted).

    Attributes:
        version: ``anthropic-version`` (empty when absent).
        betas: The comma-separated ``anthropic-beta`` features.
    """

    version: str = ""
    betas: tuple[str, ...] = ()


def api_headers(headers: Mapping[str, str]) -> ApiHeaders:
    """``anthropic-version`` and ``anthropic-beta`` of a request (module docstring)."""
    beta = _header(headers, "anthropic-beta") or ""
    return ApiHeaders(
        version=(_header(headers, "anthropic-version") or "").strip(),
        betas=tuple(b.strip() for b in beta.split(",") if b.strip()),
    )


def _native(call: Call) -> MessagesRequest:
    if not isinstance(call.native, MessagesRequest):
        raise InvariantError("a Messages call without its MessagesRequest")
    return call.native


class MessagesSurface:
    """Anthropic Messages as an ``iop.api.Surface`` (stateless: one instance serves all).

    Args:
        max_depth: Deepest JSON nesting a body may have (``server.max_json_depth``).
    """

    def __init__(self, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._max_depth = max_depth

    @property
    def name(self) -> str:
        return "messages"

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str = "") -> Call:
        """Decode, check and translate a ``/v1/messages`` body (``_request``).

        Raises:
            RequestError: 400, worded like Anthropic's.
        """
        native, request = parse_messages_request(body, max_depth=self._max_depth)
        request = with_routing(request, headers, user_from="metadata.user_id")
        return Call(request=request, stream=native.stream, model=native.model, native=native)

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        """Anthropic's status and error body for an IOP status and code (``_errors``).

        ``param`` is already part of an Anthropic-worded message (``"max_tokens:
        Field required"``); Anthropic's body has no field for it.
        """
        del param
        status, etype = anthropic_error(status, code)
        return status, error_body(etype, message)

    def stream(self, call: Call, ctx: RunContext) -> MessagesStream:
        return MessagesStream(ctx.run_id, call.model, call.chat, _native(call), ctx.policy)

    def collector(self, call: Call, ctx: RunContext) -> MessagesCollector:
        return MessagesCollector(ctx.run_id, call.model, call.chat, _native(call), ctx.policy)

    # -- count_tokens --------------------------------------------------------------------

    def parse_count_tokens(self, body: bytes) -> ChatRequest:
        """Decode a ``/v1/messages/count_tokens`` body (``max_tokens`` not required).

        Raises:
            RequestError: 400, worded like Anthropic's.
        """
        return parse_count_tokens(body, max_depth=self._max_depth)[1]

    def count_tokens(
        self, request: ChatRequest, exact: int | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """The count_tokens answer: ``(status, body, headers)``.

        Args:
            request: The parsed request.
            exact: The backend tokenizer's count, when one counted; else the
                answer is :func:`estimate_input_tokens` and says so.
        """
        if exact is not None:
            body, headers = count_tokens_response(exact, estimated=False)
        else:
            body, headers = count_tokens_response(estimate_input_tokens(request), estimated=True)
        return 200, body, headers


MESSAGES = MessagesSurface()
"""The Messages surface the edge routes ``/v1/messages`` to."""
