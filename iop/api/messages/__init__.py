"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``), sans-IO.

* ``_request``: Anthropic's request, typed, translated to a ``ChatRequest``;
  400s worded like Anthropic's.
* ``_encode``: shaped events to Anthropic's SSE events, or one ``Message``.
* ``_errors``: Anthropic's error bodies and the status mapping.
* ``_tokens``: count_tokens answers and the estimate.
* ``_surface``: :data:`MESSAGES`, the ``iop.api.Surface``; auth and headers.

``docs/api.md``, "Anthropic Messages", says what is supported and how.
"""

from iop.api.messages._encode import PING, MessagesCollector, MessagesStream, stop_reason
from iop.api.messages._errors import anthropic_error, error_body, error_event
from iop.api.messages._request import (
    IGNORED_FIELDS,
    MessagesRequest,
    parse_count_tokens,
    parse_messages_request,
    reasoning_effort,
)
from iop.api.messages._surface import (
    AUTH_FAILED,
    MESSAGES,
    ApiHeaders,
    MessagesSurface,
    api_headers,
    api_key,
)
from iop.api.messages._tokens import (
    COUNT_HEADER,
    count_tokens_response,
    estimate_input_tokens,
)

__all__ = [
    "AUTH_FAILED",
    "COUNT_HEADER",
    "IGNORED_FIELDS",
    "MESSAGES",
    "PING",
    "ApiHeaders",
    "MessagesCollector",
    "MessagesRequest",
    "MessagesStream",
    "MessagesSurface",
    "anthropic_error",
    "api_headers",
    "api_key",
    "count_tokens_response",
    "error_body",
    "error_event",
    "estimate_input_tokens",
    "parse_count_tokens",
    "parse_messages_request",
    "reasoning_effort",
    "stop_reason",
]
